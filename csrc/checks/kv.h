// Argument checks of kv_compact, shared by the CPU and CUDA launchers (same messages on both). Shapes, dtypes, devices
// and memory layout are checked on the host from metadata; the value checks are peagle/kv.h's check_request and
// claim_blocks, run by each backend, whose results raise_kv_error turns into messages.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "checks/common.h"
#include "peagle/kv.h"

namespace peagle {

struct KvDims {
  int64_t layers, batch, row_bytes;
  kv::Geometry geometry;
  int64_t len_max;  // the largest value seq_len's dtype holds
};

inline void check_kv_caches(const char* op, at::TensorList k_caches, at::TensorList v_caches) {
  TORCH_CHECK(k_caches.size() == v_caches.size(), "peagle.", op,
              ": k_caches and v_caches must list the same number of layers, got ", k_caches.size(), " and ",
              v_caches.size());
  TORCH_CHECK(!k_caches.empty(), "peagle.", op, ": k_caches must list at least one layer, got 0");
  const at::Tensor& ref = k_caches[0];
  check_rank(op, "k_caches[0]", ref, 4, "[num_blocks, block_size, kv_heads, head_dim]");
  const auto dtype = ref.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "peagle.", op,
              ": k_caches[0] must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(ref.numel() > 0, "peagle.", op, ": k_caches[0] must not be empty, got shape ", shape_str(ref));
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // [begin, end) of each cache's bytes
  for (int kind = 0; kind < 2; ++kind) {
    const at::TensorList caches = kind == 0 ? k_caches : v_caches;
    const char* list = kind == 0 ? "k_caches" : "v_caches";
    for (size_t l = 0; l < caches.size(); ++l) {
      const at::Tensor& c = caches[l];
      TORCH_CHECK(c.sizes() == ref.sizes(), "peagle.", op, ": ", list, "[", l, "] must have k_caches[0]'s shape ",
                  shape_str(ref), ", got ", shape_str(c));
      TORCH_CHECK(c.scalar_type() == dtype, "peagle.", op, ": ", list, "[", l, "] must have k_caches[0]'s dtype ",
                  dtype, ", got ", c.scalar_type());
      TORCH_CHECK(c.device() == ref.device(), "peagle.", op, ": ", list, "[", l, "] must be on k_caches[0]'s device ",
                  ref.device(), ", got ", c.device());
      TORCH_CHECK(c.is_contiguous(), "peagle.", op, ": ", list, "[", l, "] must be contiguous (updated in place)");
      const auto begin = reinterpret_cast<uintptr_t>(c.data_ptr());
      spans.emplace_back(begin, begin + c.nbytes());
    }
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    TORCH_CHECK(spans[i].first >= spans[i - 1].second, "peagle.", op,
                ": the layers' caches must not overlap in memory (each k and v cache its own storage), got two that "
                "share bytes");
  }
}

inline void check_kv_index(const char* op, const char* name, const at::Tensor& t, int64_t rank, const char* layout,
                           const at::Tensor& ref) {
  check_rank(op, name, t, rank, layout);
  check_integer(op, name, t);
  check_same_device(op, name, t, ref, "k_caches[0]");
}

inline KvDims check_kv_compact_args(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_table,
                                    const at::Tensor& seq_len, const at::Tensor& accepted_path,
                                    const at::Tensor& num_accepted) {
  const char* op = "kv_compact";
  check_kv_caches(op, k_caches, v_caches);
  const at::Tensor& ref = k_caches[0];
  check_kv_index(op, "block_table", block_table, 2, "[B, max_blocks]", ref);
  check_kv_index(op, "seq_len", seq_len, 1, "[B]", ref);
  check_kv_index(op, "accepted_path", accepted_path, 2, "[B, P]", ref);
  check_kv_index(op, "num_accepted", num_accepted, 1, "[B]", ref);
  const int64_t batch = block_table.size(0);
  TORCH_CHECK(seq_len.size(0) == batch, "peagle.", op, ": seq_len must be [B] with B = ", batch,
              " (block_table's rows), got shape ", shape_str(seq_len));
  TORCH_CHECK(accepted_path.size(0) == batch && accepted_path.size(1) >= 1, "peagle.", op,
              ": accepted_path must be [B, P] with B = ", batch, " and P >= 1, got shape ", shape_str(accepted_path));
  TORCH_CHECK(num_accepted.size(0) == batch, "peagle.", op, ": num_accepted must be [B] with B = ", batch,
              ", got shape ", shape_str(num_accepted));
  const kv::Geometry g{ref.size(0), ref.size(1), block_table.size(1), accepted_path.size(1)};
  const int64_t len_max =
      seq_len.scalar_type() == at::kInt ? std::numeric_limits<int32_t>::max() : std::numeric_limits<int64_t>::max();
  return {static_cast<int64_t>(k_caches.size()), batch, ref.size(2) * ref.size(3) * ref.element_size(), g, len_max};
}

// Raises the error of request b (a kv::Check with code != kOk) with the argument named.
inline void raise_kv_error(int64_t b, const kv::Check& c, const KvDims& d) {
  const char* op = "peagle.kv_compact: ";
  const int64_t bs = d.geometry.block_size, max_blocks = d.geometry.max_blocks;
  switch (c.code) {
    case kv::kNumAccepted:
      TORCH_CHECK(false, op, "num_accepted[", b, "] must be in [0, P - 1] = [0, ", c.bound, "], got ", c.value);
    case kv::kSeqLen:
      TORCH_CHECK(false, op, "seq_len[", b, "] must be >= 0, got ", c.value);
    case kv::kRoot:
      TORCH_CHECK(false, op, "accepted_path[", b, ", 0] must be 0 (the root), got ", c.value);
    case kv::kPathOrder:
      TORCH_CHECK(false, op, "accepted_path[", b, ", ", c.index, "] must be > accepted_path[", b, ", ", c.index - 1,
                  "] = ", c.bound, " (node indices strictly increase along the path), got ", c.value);
    case kv::kCapacity:
      TORCH_CHECK(false, op, "slot seq_len[", b, "] + accepted_path[", b, ", ", c.index, "] = ", c.value,
                  " must be < the slots block_table covers (max_blocks * block_size = ", max_blocks, " * ", bs, " = ",
                  c.bound, ")");
    case kv::kBlockId:
      TORCH_CHECK(false, op, "block_table[", b, ", ", c.index, "] must be a physical block in [0, num_blocks) = [0, ",
                  c.bound, ") (a moved slot lies in logical block ", c.index, "), got ", c.value);
    case kv::kBlockShared:
      TORCH_CHECK(false, op, "physical block ", c.value, " is read or written through block_table[", b, ", ", c.index,
                  "] and also through block_table[", c.bound / max_blocks, ", ", c.bound % max_blocks,
                  "]: the blocks a compaction touches must belong to one request and one logical block");
    case kv::kLenOverflow:
      TORCH_CHECK(false, op, "the new seq_len[", b, "] = ", c.value, " does not fit seq_len's dtype (max ", c.bound,
                  ")");
    default:
      TORCH_CHECK(false, op, "internal error: unknown check code ", c.code, " for request ", b);
  }
}

}  // namespace peagle
