// Argument checks and error messages of the two tree families, verification (tree_verify_greedy,
// tree_rejection_sample) and construction (tree_select, tree_build_parallel, tree_expand_topk), shared by the CPU and
// CUDA launchers so both backends reject bad input with the same message. Values are checked by the kernels (the
// structure checks of csrc/include/peagle/tree.h), which report the first error of each request in a [B, 3] table
// that raise_tree_error / raise_build_error turn into messages.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>

#include "checks/common.h"
#include "peagle/tree.h"

namespace peagle {

// ---------------------------------------------------------------------------------------------------------------------
// Verification.

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

// Float entries travel through the int64 `extra` of raise_tree_error_at as their bits.
inline int64_t float_bits(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float bits_float(int64_t bits) {
  const auto low = static_cast<uint32_t>(bits);
  float value = 0.0f;
  std::memcpy(&value, &low, sizeof(value));
  return value;
}

// Throws the message of error `code` of request b at node i. `extra` is what the message needs beyond the error table:
// the node's parent (kDuplicate) or the float bits of the offending entry (kTargetValue, kDraftValue, kUniform). The
// immediate checks (raise_tree_error) and deferred ones (csrc/cpu/deferred_checks.cpp) share it.
[[noreturn]] inline void raise_tree_error_at(const char* op, int64_t code, int64_t b, int64_t i, int64_t detail,
                                             int64_t extra, int64_t n_max, int64_t vocab) {
  switch (code) {
    case tree::kNumNodes:
      TORCH_CHECK(false, "peagle.", op, ": num_nodes[", b, "] must be in [1, n_max] = [1, ", n_max, "], got ", detail);
    case tree::kRootParent:
      TORCH_CHECK(false, "peagle.", op, ": parent[", b, ", 0] must be -1 (node 0 is the root), got ", detail);
    case tree::kParent:
      TORCH_CHECK(false, "peagle.", op, ": parent[", b, ", ", i, "] must be in [0, ", i,
                  ") (parents come before their children), got ", detail);
    case tree::kToken:
      TORCH_CHECK(false, "peagle.", op, ": tokens[", b, ", ", i, "] must be in [0, V) = [0, ", vocab, "), got ",
                  detail);
    case tree::kDuplicate:
      TORCH_CHECK(false, "peagle.", op, ": sibling tokens must be distinct, got duplicate token ", detail, " at node ",
                  i, " of request ", b, " (parent ", extra, ")");
    case tree::kTargetValue:
    case tree::kDraftValue:
      TORCH_CHECK(false, "peagle.", op, ": ", code == tree::kTargetValue ? "target_probs" : "draft_probs",
                  " must hold probabilities in [0, 1] (finite, non-negative), got ", bits_float(extra), " at [", b,
                  ", ", i, ", ", detail, "]");
    case tree::kTargetSum:
    case tree::kDraftSum:
      TORCH_CHECK(false, "peagle.", op, ": ", code == tree::kTargetSum ? "target_probs" : "draft_probs", " row [", b,
                  ", ", i, "] must sum to 1 within ", tree::kSumTolerance, ", got ",
                  static_cast<double>(detail) / tree::kFixedOne);
    case tree::kTargetNaN:
      TORCH_CHECK(false, "peagle.", op, ": target_probs must not contain NaN, got NaN at [", b, ", ", i, ", ", detail,
                  "]");
    case tree::kUniform:
      TORCH_CHECK(false, "peagle.", op, ": uniforms must be in [0, 1), got ", bits_float(extra), " at [", b, ", ", i,
                  "]");
    default:
      TORCH_CHECK(false, "peagle.", op, ": internal error code ", code, " for request ", b);
  }
}

// Throws the message of the first failing request. `errors` is a CPU int64 [B, 3] tensor: (code, node, detail), where
// detail is the offending value (parent, token, vocabulary index of a bad entry, or the fixed-point row sum).
inline void raise_tree_error(const char* op, const at::Tensor& errors, const at::Tensor& parent,
                             const at::Tensor& tokens, const at::Tensor& num_nodes, const at::Tensor& target_probs,
                             const c10::optional<at::Tensor>& draft_probs, const c10::optional<at::Tensor>& uniforms) {
  const int64_t* e = errors.data_ptr<int64_t>();
  for (int64_t b = 0; b < errors.size(0); ++b) {
    const int64_t code = e[3 * b], i = e[3 * b + 1], detail = e[3 * b + 2];
    if (code == tree::kOk) continue;
    int64_t extra = 0;
    if (code == tree::kDuplicate) extra = parent[b][i].item<int64_t>();
    if (code == tree::kTargetValue) extra = float_bits(target_probs[b][i][detail].item<float>());
    if (code == tree::kDraftValue) extra = float_bits((*draft_probs)[b][i][detail].item<float>());
    if (code == tree::kUniform) extra = float_bits((*uniforms)[b][i].item<float>());
    raise_tree_error_at(op, code, b, i, detail, extra, parent.size(1), target_probs.size(2));
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// Construction.

// num_nodes sizes the outputs ([B, N, N] mask): bounded so that an absurd value is an error, not an allocation.
inline void check_num_nodes(const char* op, int64_t num_nodes) {
  TORCH_CHECK(num_nodes >= 1 && num_nodes <= tree::kMaxTreeNodes, "peagle.", op, ": num_nodes must be in [1, ",
              tree::kMaxTreeNodes, "], got ", num_nodes);
}

// Checks shapes, dtypes and devices of tree_select; returns M (candidates per request).
inline int64_t check_tree_select_args(const at::Tensor& cand_tokens, const at::Tensor& cand_parent,
                                      const at::Tensor& cand_scores, const at::Tensor& num_candidates,
                                      int64_t num_nodes) {
  const char* op = "tree_select";
  check_rank(op, "cand_tokens", cand_tokens, 2, "[B, M]");
  check_rank(op, "cand_parent", cand_parent, 2, "[B, M]");
  check_rank(op, "cand_scores", cand_scores, 2, "[B, M]");
  check_rank(op, "num_candidates", num_candidates, 1, "[B]");
  check_integer(op, "cand_tokens", cand_tokens);
  check_integer(op, "cand_parent", cand_parent);
  check_integer(op, "num_candidates", num_candidates);
  TORCH_CHECK(c10::isFloatingType(cand_scores.scalar_type()), "peagle.tree_select: cand_scores must be floating, got ",
              cand_scores.scalar_type());
  TORCH_CHECK(cand_parent.sizes() == cand_tokens.sizes() && cand_scores.sizes() == cand_tokens.sizes(),
              "peagle.tree_select: cand_tokens, cand_parent and cand_scores must have the same shape [B, M], got ",
              shape_str(cand_tokens), ", ", shape_str(cand_parent), " and ", shape_str(cand_scores));
  const int64_t batch = cand_tokens.size(0), m = cand_tokens.size(1);
  TORCH_CHECK(num_candidates.size(0) == batch, "peagle.tree_select: num_candidates must have shape [", batch, "], got ",
              shape_str(num_candidates));
  TORCH_CHECK(m >= 1, "peagle.tree_select: need M >= 1 candidates (the root), got shape ", shape_str(cand_tokens));
  check_num_nodes(op, num_nodes);
  check_same_device(op, "cand_parent", cand_parent, cand_tokens, "cand_tokens");
  check_same_device(op, "cand_scores", cand_scores, cand_tokens, "cand_tokens");
  check_same_device(op, "num_candidates", num_candidates, cand_tokens, "cand_tokens");
  return m;
}

inline void check_tree_build_parallel_args(const at::Tensor& draft_probs, at::IntArrayRef topk, int64_t num_nodes) {
  check_rank("tree_build_parallel", "draft_probs", draft_probs, 3, "[B, K, V]");
  TORCH_CHECK(draft_probs.scalar_type() == at::kFloat, "peagle.tree_build_parallel: draft_probs must be float32, got ",
              draft_probs.scalar_type());
  const int64_t depths = draft_probs.size(1), vocab = draft_probs.size(2);
  TORCH_CHECK(static_cast<int64_t>(topk.size()) == depths, "peagle.tree_build_parallel: topk must have one entry per ",
              "depth (K = ", depths, "), got ", topk.size());
  check_num_nodes("tree_build_parallel", num_nodes);
  int64_t candidates = 1, level = 1;
  for (const int64_t k : topk) {
    TORCH_CHECK(k >= 1 && k <= vocab, "peagle.tree_build_parallel: every topk entry must be in [1, V] = [1, ", vocab,
                "], got ", topk);
    level *= k;
    candidates += level;
    TORCH_CHECK(candidates <= (int64_t{1} << 24), "peagle.tree_build_parallel: the Cartesian candidate tree of topk ",
                topk, " has more than 2^24 nodes");
  }
}

inline void check_tree_expand_topk_args(const at::Tensor& frontier_scores, const at::Tensor& child_probs,
                                        int64_t topk) {
  const char* op = "tree_expand_topk";
  check_rank(op, "frontier_scores", frontier_scores, 2, "[B, F]");
  check_rank(op, "child_probs", child_probs, 3, "[B, F, V]");
  TORCH_CHECK(child_probs.scalar_type() == at::kFloat, "peagle.tree_expand_topk: child_probs must be float32, got ",
              child_probs.scalar_type());
  TORCH_CHECK(c10::isFloatingType(frontier_scores.scalar_type()),
              "peagle.tree_expand_topk: frontier_scores must be floating, got ", frontier_scores.scalar_type());
  const int64_t batch = child_probs.size(0), width = child_probs.size(1), vocab = child_probs.size(2);
  TORCH_CHECK(frontier_scores.size(0) == batch && frontier_scores.size(1) == width,
              "peagle.tree_expand_topk: frontier_scores must have shape [", batch, ", ", width, "], got ",
              shape_str(frontier_scores));
  TORCH_CHECK(topk >= 1 && topk <= vocab, "peagle.tree_expand_topk: topk must be in [1, V] = [1, ", vocab, "], got ",
              topk);
  check_same_device(op, "child_probs", child_probs, frontier_scores, "frontier_scores");
}

// Throws the message of construction error `code` of request b: `i` is the failing candidate (or draft row), `detail`
// the bad count or token. The immediate checks (raise_build_error) and deferred ones (csrc/cpu/deferred_checks.cpp)
// share it.
[[noreturn]] inline void raise_build_error_at(const char* op, int64_t code, int64_t b, int64_t i, int64_t detail) {
  switch (code) {
    case tree::kCandidateCount:
      TORCH_CHECK(false, "peagle.", op, ": num_candidates[", b, "] must be in [1, M], got ", detail);
    case tree::kCandidateRoot:
      TORCH_CHECK(false, "peagle.", op, ": cand_parent[", b, ", 0] must be -1 (candidate 0 is the root)");
    case tree::kCandidateParent:
      TORCH_CHECK(false, "peagle.", op, ": cand_parent[", b, ", ", i, "] must be in [0, ", i,
                  ") (parents come before their children)");
    case tree::kCandidateScore:
      TORCH_CHECK(false, "peagle.", op, ": cand_scores[", b, ", ", i,
                  "] must be finite and must not exceed its parent's score");
    case tree::kDraftRow:
      TORCH_CHECK(false, "peagle.", op, ": draft probabilities must be in [0, 1], got a bad entry ", "in row ", i,
                  " of request ", b, " at token ", detail);
    case tree::kFrontierScore:
      TORCH_CHECK(false, "peagle.", op, ": frontier_scores[", b, ", ", i,
                  "] must be finite and >= 0 (a product of draft probabilities)");
    default:
      TORCH_CHECK(false, "peagle.", op, ": internal error code ", code);
  }
}

// Throws the message of the first failing request. `errors` is a CPU int64 [B, 3] tensor: (code, node, detail), where
// node is the failing candidate (or draft row) and detail the bad count or token.
inline void raise_build_error(const char* op, const at::Tensor& errors) {
  const int64_t* e = errors.data_ptr<int64_t>();
  for (int64_t b = 0; b < errors.size(0); ++b) {
    if (e[3 * b] != tree::kBuildOk) raise_build_error_at(op, e[3 * b], b, e[3 * b + 1], e[3 * b + 2]);
  }
}

using TreeSpecOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                   at::Tensor, at::Tensor>;

// The outputs of a tree construction op (TreeSpec) and their raw view for the kernels.
struct TreeSpecTensors {
  at::Tensor tokens, parent, depth, num_nodes, scores, mask, packed, paths, num_paths;
  tree::SpecView view;
  TreeSpecOutputs tuple() const { return {tokens, parent, depth, num_nodes, scores, mask, packed, paths, num_paths}; }
};

// [B, N] outputs (paths [B, N, L]) on opts' device, pre-filled with the padding every backend leaves: -1 tokens,
// parents, depths and paths, zero scores, masks and counts.
inline TreeSpecTensors make_tree_spec(const at::TensorOptions& opts, int64_t batch, int64_t nodes, int64_t path_len) {
  TreeSpecTensors t;
  const auto long_opts = opts.dtype(at::kLong);
  const int64_t words = (nodes + 31) / 32;
  t.tokens = at::full({batch, nodes}, -1, long_opts);
  t.parent = at::full({batch, nodes}, -1, long_opts);
  t.depth = at::full({batch, nodes}, -1, long_opts);
  t.num_nodes = at::zeros({batch}, long_opts);
  t.scores = at::zeros({batch, nodes}, opts.dtype(at::kDouble));
  t.mask = at::zeros({batch, nodes, nodes}, opts.dtype(at::kBool));
  t.packed = at::zeros({batch, nodes, words}, opts.dtype(at::kInt));
  t.paths = at::full({batch, nodes, path_len}, -1, long_opts);
  t.num_paths = at::zeros({batch}, long_opts);
  t.view = tree::SpecView{nodes,
                          path_len,
                          words,
                          t.tokens.data_ptr<int64_t>(),
                          t.parent.data_ptr<int64_t>(),
                          t.depth.data_ptr<int64_t>(),
                          t.num_nodes.data_ptr<int64_t>(),
                          t.scores.data_ptr<double>(),
                          t.mask.data_ptr<bool>(),
                          t.packed.data_ptr<int32_t>(),
                          t.paths.data_ptr<int64_t>(),
                          t.num_paths.data_ptr<int64_t>()};
  return t;
}

}  // namespace peagle
