// Argument checks of the attention-mask family, shared by the CPU and CUDA launchers (same messages on both).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "checks/common.h"

namespace peagle {

constexpr int64_t kMaxMaskBlockSize = 65536;

// The value errors' messages, shared by the immediate checks below and the deferred ones
// (csrc/cpu/deferred_checks.cpp).
[[noreturn]] inline void raise_mask_anchors(const char* op, int64_t length, int64_t lo, int64_t hi) {
  TORCH_CHECK(false, "peagle.", op, ": anchors must be in [0, T) with T = ", length,
              " (len(document_ids)), got values in [", lo, ", ", hi, "]");
}

[[noreturn]] inline void raise_mask_negative_depth(const char* op, int64_t dmin) {
  TORCH_CHECK(false, "peagle.", op, ": depths must be >= 0, got ", dmin);
}

[[noreturn]] inline void raise_mask_depth_outside_row(const char* op, int64_t i, int64_t depth, int64_t length) {
  TORCH_CHECK(false, "peagle.", op, ": depths[", i, "] = ", depth, " is out of range for T = ", length,
              ": expected 0 <= depth < T");
}

[[noreturn]] inline void raise_slice_anchors(const char* op, int64_t max_length, int64_t amax) {
  TORCH_CHECK(false, "peagle.", op, ": anchors must be < the table's max_length = ", max_length,
              " (table.shape[1]), got ", amax);
}

[[noreturn]] inline void raise_slice_depths(const char* op, int64_t num_depths, int64_t dmax) {
  TORCH_CHECK(false, "peagle.", op, ": depths must be < the table's num_depths = ", num_depths,
              " (table.shape[0]), got ", dmax);
}

// Depths are bounded by the row: 0 <= depth < T. Chains may run past the row's end (evaluation drafts chains from the
// last anchors too; their labels are simply absent), so unlike cod's elements anchor + depth may reach 2T - 2, which
// keeps the window arithmetic (anchor + depth - window) far inside int64.
inline void check_depths_inside_row(const char* op, const at::Tensor& depths, int64_t length) {
  const at::Tensor outside = depths.to(at::kLong) >= length;
  if (!outside.any().item<bool>()) return;
  const int64_t i = outside.nonzero()[0][0].item<int64_t>();
  raise_mask_depth_outside_row(op, i, depths[i].item<int64_t>(), length);
}

// Shapes, dtypes, devices and window of a mask op's elements and documents (no device data).
inline void check_mask_element_args(const char* op, const at::Tensor& anchors, const at::Tensor& depths,
                                    const at::Tensor& document_ids, const c10::optional<int64_t>& window) {
  check_rank(op, "anchors", anchors, 1, "[N]");
  check_rank(op, "depths", depths, 1, "[N]");
  check_rank(op, "document_ids", document_ids, 1, "[T]");
  check_integer(op, "anchors", anchors);
  check_integer(op, "depths", depths);
  check_integer(op, "document_ids", document_ids);
  TORCH_CHECK(anchors.size(0) == depths.size(0), "peagle.", op, ": anchors and depths must have the same length N, ",
              "got ", anchors.size(0), " and ", depths.size(0));
  check_same_device(op, "depths", depths, anchors, "anchors");
  check_same_device(op, "document_ids", document_ids, anchors, "anchors");
  TORCH_CHECK(!window.has_value() || *window >= 1, "peagle.", op, ": window must be None or >= 1, got ",
              window.value_or(0));
}

// The values (anchors index document_ids); on CUDA these synchronise (deferred checks: csrc/cuda/mask_cuda.cpp).
inline void check_mask_element_values(const char* op, const at::Tensor& anchors, const at::Tensor& depths,
                                      const at::Tensor& document_ids) {
  const int64_t length = document_ids.size(0);
  if (anchors.numel() > 0) {
    const auto [amin, amax] = at::aminmax(anchors);
    const int64_t lo = amin.item<int64_t>();
    const int64_t hi = amax.item<int64_t>();
    if (lo < 0 || hi >= length) raise_mask_anchors(op, length, lo, hi);
    const int64_t dmin = depths.min().item<int64_t>();
    if (dmin < 0) raise_mask_negative_depth(op, dmin);
    check_depths_inside_row(op, depths, length);
  }
  check_document_ids(op, document_ids);
}

// Checks the elements and documents of a mask op; values are checked too (anchors index document_ids).
inline void check_mask_elements(const char* op, const at::Tensor& anchors, const at::Tensor& depths,
                                const at::Tensor& document_ids, const c10::optional<int64_t>& window) {
  check_mask_element_args(op, anchors, depths, document_ids, window);
  check_mask_element_values(op, anchors, depths, document_ids);
}

// block_size sizes the per-block buffers: bounded so that an absurd value is an error, not an allocation.
inline void check_block_size(const char* op, int64_t block_size) {
  TORCH_CHECK(block_size >= 1 && block_size <= kMaxMaskBlockSize, "peagle.", op, ": block_size must be in [1, ",
              kMaxMaskBlockSize, "], got ", block_size);
}

inline void check_mask_block_args(const at::Tensor& anchors, const at::Tensor& depths, const at::Tensor& document_ids,
                                  int64_t block_size, const c10::optional<int64_t>& window) {
  check_mask_elements("mask_block", anchors, depths, document_ids, window);
  check_block_size("mask_block", block_size);
}

// mask_slice_*: the table [K, L] (L = max_length) of the lowest depth-0 anchor each (anchor, depth) may see, and
// elements with anchors < L and depths < K (besides the checks of every mask op; window arithmetic lives in the table).
inline void check_mask_slice_table(const char* op, const at::Tensor& table, const at::Tensor& anchors) {
  check_rank(op, "table", table, 2, "[num_depths, max_length]");
  check_integer(op, "table", table);
  check_same_device(op, "table", table, anchors, "anchors");
}

inline void check_mask_slice_values(const char* op, const at::Tensor& table, const at::Tensor& anchors,
                                    const at::Tensor& depths) {
  if (anchors.numel() == 0) return;
  const int64_t amax = anchors.max().item<int64_t>();
  if (amax >= table.size(1)) raise_slice_anchors(op, table.size(1), amax);
  const int64_t dmax = depths.max().item<int64_t>();
  if (dmax >= table.size(0)) raise_slice_depths(op, table.size(0), dmax);
}

inline void check_mask_slice_args(const char* op, const at::Tensor& table, const at::Tensor& anchors,
                                  const at::Tensor& depths, const at::Tensor& document_ids) {
  check_mask_elements(op, anchors, depths, document_ids, c10::nullopt);
  check_mask_slice_table(op, table, anchors);
  check_mask_slice_values(op, table, anchors, depths);
}

// Per-element causal lower bounds (int64 [N]; see mask::causal_low): from the window (mask_dense, mask_block) or looked
// up in a mask_slice table. Defined in csrc/cpu/mask_cpu.cpp with ATen ops, shared by both backends.
at::Tensor window_lows(const at::Tensor& anchors_c, const at::Tensor& depths_c, const c10::optional<int64_t>& window);
at::Tensor table_lows(const at::Tensor& table, const at::Tensor& anchors_c, const at::Tensor& depths_c);

// [nb, block_size]: each block's valid anchors sorted ascending, then padding (defined in csrc/cpu/mask_cpu.cpp with
// ATen ops, so both backends use it).
at::Tensor sorted_block_anchors(const at::Tensor& anchors_c, const at::Tensor& edoc, int64_t block_size);

}  // namespace peagle
