// Raw-pointer entry points of the attention-mask CUDA kernels. Implemented in mask_kernels.cu (no torch headers);
// the torch-facing launcher (mask_cuda.cpp) checks arguments, allocates and calls these on the current stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace peagle {
namespace cuda {

// out[q * n + k] = the predicate of (query q, key k); edoc[i] = document of element i's anchor, low[i] = the lowest
// depth-0 anchor element i may see causally (mask::causal_low, or a mask_slice table entry).
cudaError_t mask_dense(const int64_t* anchors, const int64_t* depths, const int64_t* edoc, const int64_t* low,
                       int64_t n, bool* out, cudaStream_t stream);

// summary[b * kSummaryFields ...] of every block of `block_size` elements (see peagle/mask.h).
cudaError_t mask_block_summaries(const int64_t* anchors, const int64_t* depths, const int64_t* edoc, const int64_t* low,
                                 int64_t n, int64_t block_size, int64_t* summary, cudaStream_t stream);

// Classifies every (q block, kv block) pair of nb blocks and compacts partial / full kv block indices per q block in
// ascending order (rows of kv_indices / full_kv_indices must be zeroed beforehand).
// sorted_anchors: [nb, block_size], each q block's valid anchors sorted ascending (sorted_block_anchors).
cudaError_t mask_block_classify(const int64_t* summary, const int64_t* sorted_anchors, int64_t nb, int64_t block_size,
                                int32_t* kv_num_blocks, int32_t* kv_indices, int32_t* full_kv_num_blocks,
                                int32_t* full_kv_indices, cudaStream_t stream);

// Deferred checks: decides from the device statistics `stats` (peagle/deferred.h MaskStat) in the host checks' order
// and records the first error as op `op` (has_elements: N > 0; num_depths / max_length: the slice table's, or -1).
cudaError_t mask_validate(const int64_t* stats, bool has_elements, int64_t length, int64_t num_depths,
                          int64_t max_length, int64_t op, int64_t* record, cudaStream_t stream);

}  // namespace cuda
}  // namespace peagle
