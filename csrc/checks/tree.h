// Argument checks and error messages of the tree verification ops, shared by the CPU and CUDA launchers so both
// backends reject bad input with the same message.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "checks/common.h"
#include "peagle/tree.h"

namespace peagle {

struct TreeShape {
  int64_t batch;
  int64_t nodes;  // n_max
  int64_t vocab;
};

// Probability rows [B, n, V] must be unit-stride in V and dense in n; a broadcast batch (stride 0) is kept as is.
inline at::Tensor tree_rows(const at::Tensor& t) {
  if (t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2))) return t;
  return t.contiguous();
}

inline void check_probs(const char* op, const char* name, const at::Tensor& t, const TreeShape& s,
                        const at::Tensor& ref) {
  check_rank(op, name, t, 3, "[B, n_max, V]");
  TORCH_CHECK(t.scalar_type() == at::kFloat, "peagle.", op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.size(0) == s.batch && t.size(1) == s.nodes && t.size(2) == s.vocab, "peagle.", op, ": ", name,
              " must have shape [", s.batch, ", ", s.nodes, ", ", s.vocab, "], got ", shape_str(t));
  check_same_device(op, name, t, ref, "parent");
}

// Checks shapes, dtypes and devices (values are checked by the kernels). Returns (B, n_max, V).
inline TreeShape check_tree_args(const char* op, const at::Tensor& parent, const at::Tensor& tokens,
                                 const at::Tensor& num_nodes, const at::Tensor& target_probs,
                                 const c10::optional<at::Tensor>& draft_probs = c10::nullopt,
                                 const c10::optional<at::Tensor>& uniforms = c10::nullopt) {
  check_rank(op, "parent", parent, 2, "[B, n_max]");
  check_rank(op, "tokens", tokens, 2, "[B, n_max]");
  check_rank(op, "num_nodes", num_nodes, 1, "[B]");
  check_integer(op, "parent", parent);
  check_integer(op, "tokens", tokens);
  check_integer(op, "num_nodes", num_nodes);
  check_rank(op, "target_probs", target_probs, 3, "[B, n_max, V]");
  const TreeShape s{parent.size(0), parent.size(1), target_probs.size(2)};
  TORCH_CHECK(s.nodes >= 1, "peagle.", op, ": parent must have n_max >= 1 nodes, got shape ", shape_str(parent));
  // V <= 2^22 keeps every fixed-point row sum (entries <= 1 + tolerance, 40 fraction bits) inside int64.
  TORCH_CHECK(s.vocab >= 1 && s.vocab <= (int64_t{1} << 22), "peagle.", op,
              ": target_probs must have 1 <= V <= 4194304, got shape ", shape_str(target_probs));
  TORCH_CHECK(tokens.sizes() == parent.sizes(), "peagle.", op, ": tokens must have parent's shape ", shape_str(parent),
              ", got ", shape_str(tokens));
  TORCH_CHECK(num_nodes.size(0) == s.batch, "peagle.", op, ": num_nodes must have shape [", s.batch, "], got ",
              shape_str(num_nodes));
  check_same_device(op, "tokens", tokens, parent, "parent");
  check_same_device(op, "num_nodes", num_nodes, parent, "parent");
  check_probs(op, "target_probs", target_probs, s, parent);
  if (draft_probs.has_value()) check_probs(op, "draft_probs", *draft_probs, s, parent);
  if (uniforms.has_value()) {
    const at::Tensor& u = *uniforms;
    check_rank(op, "uniforms", u, 2, "[B, n_max]");
    TORCH_CHECK(u.scalar_type() == at::kFloat, "peagle.", op, ": uniforms must be float32, got ", u.scalar_type());
    TORCH_CHECK(u.size(0) == s.batch && u.size(1) == s.nodes, "peagle.", op, ": uniforms must have shape [", s.batch,
                ", ", s.nodes, "], got ", shape_str(u));
    check_same_device(op, "uniforms", u, parent, "parent");
  }
  return s;
}

// Throws the message of the first failing request. `errors` is a CPU int64 [B, 3] tensor: (code, node, detail), where
// detail is the offending value (parent, token, vocabulary index of a bad entry, or the fixed-point row sum).
inline void raise_tree_error(const char* op, const at::Tensor& errors, const at::Tensor& parent,
                             const at::Tensor& tokens, const at::Tensor& num_nodes, const at::Tensor& target_probs,
                             const c10::optional<at::Tensor>& draft_probs, const c10::optional<at::Tensor>& uniforms) {
  const int64_t* e = errors.data_ptr<int64_t>();
  const int64_t batch = errors.size(0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t code = e[3 * b], i = e[3 * b + 1], detail = e[3 * b + 2];
    if (code == tree::kOk) continue;
    const int64_t n_max = parent.size(1);
    switch (code) {
      case tree::kNumNodes:
        TORCH_CHECK(false, "peagle.", op, ": num_nodes[", b, "] must be in [1, n_max] = [1, ", n_max, "], got ",
                    num_nodes[b].item<int64_t>());
      case tree::kRootParent:
        TORCH_CHECK(false, "peagle.", op, ": parent[", b, ", 0] must be -1 (node 0 is the root), got ",
                    parent[b][0].item<int64_t>());
      case tree::kParent:
        TORCH_CHECK(false, "peagle.", op, ": parent[", b, ", ", i, "] must be in [0, ", i,
                    ") (parents come before their children), got ", detail);
      case tree::kToken:
        TORCH_CHECK(false, "peagle.", op, ": tokens[", b, ", ", i, "] must be in [0, V) = [0, ", target_probs.size(2),
                    "), got ", detail);
      case tree::kDuplicate:
        TORCH_CHECK(false, "peagle.", op, ": sibling tokens must be distinct, got duplicate token ", detail,
                    " at node ", i, " of request ", b, " (parent ", parent[b][i].item<int64_t>(), ")");
      case tree::kTargetValue:
      case tree::kDraftValue: {
        const bool target = code == tree::kTargetValue;
        const at::Tensor& rows = target ? target_probs : *draft_probs;
        TORCH_CHECK(false, "peagle.", op, ": ", target ? "target_probs" : "draft_probs",
                    " must hold probabilities in [0, 1] (finite, non-negative), got ", rows[b][i][detail].item<float>(),
                    " at [", b, ", ", i, ", ", detail, "]");
      }
      case tree::kTargetSum:
      case tree::kDraftSum:
        TORCH_CHECK(false, "peagle.", op, ": ", code == tree::kTargetSum ? "target_probs" : "draft_probs", " row [", b,
                    ", ", i, "] must sum to 1 within ", tree::kSumTolerance, ", got ",
                    static_cast<double>(detail) / tree::kFixedOne);
      case tree::kTargetNaN:
        TORCH_CHECK(false, "peagle.", op, ": target_probs must not contain NaN, got NaN at [", b, ", ", i, ", ", detail,
                    "]");
      case tree::kUniform:
        TORCH_CHECK(false, "peagle.", op, ": uniforms must be in [0, 1), got ", (*uniforms)[b][i].item<float>(),
                    " at [", b, ", ", i, "]");
      default:
        TORCH_CHECK(false, "peagle.", op, ": internal error code ", code, " for request ", b);
    }
  }
}

}  // namespace peagle
