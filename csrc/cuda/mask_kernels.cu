// CUDA kernels of the attention-mask family; the math is csrc/include/peagle/mask.h, shared with the CPU kernels.
#include <cuda_runtime.h>

#include <algorithm>

#include "mask_kernels.h"
#include "peagle/deferred.h"
#include "peagle/mask.h"

namespace peagle {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__global__ void mask_dense_kernel(const int64_t* __restrict__ anchors, const int64_t* __restrict__ depths,
                                  const int64_t* __restrict__ edoc, const int64_t* __restrict__ low, int64_t n,
                                  bool* __restrict__ out) {
  const int64_t total = n * n;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t q = i / n;
    const int64_t k = i - q * n;
    out[i] = mask::allowed_from(anchors[q], depths[q], edoc[q], low[q], anchors[k], depths[k], edoc[k]);
  }
}

__global__ void mask_summary_kernel(const int64_t* __restrict__ anchors, const int64_t* __restrict__ depths,
                                    const int64_t* __restrict__ edoc, const int64_t* __restrict__ low, int64_t n,
                                    int64_t block_size, int64_t nb, int64_t* __restrict__ summary) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nb) return;
  const int64_t begin = b * block_size;
  const int64_t end = begin + block_size < n ? begin + block_size : n;
  mask::summarize(anchors, depths, edoc, low, begin, end, summary + b * mask::kSummaryFields);
}

// One warp per q block: each round classifies 32 kv blocks and appends the partial / full ones in ascending order.
__global__ void mask_classify_kernel(const int64_t* __restrict__ summary, const int64_t* __restrict__ sorted_anchors,
                                     int64_t nb, int64_t block_size, int32_t* __restrict__ kv_num,
                                     int32_t* __restrict__ kv_idx, int32_t* __restrict__ full_num,
                                     int32_t* __restrict__ full_idx) {
  const int lane = threadIdx.x & 31;
  const int64_t qb = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (qb >= nb) return;  // whole warps exit together: qb is uniform within a warp
  const int64_t* qs = summary + qb * mask::kSummaryFields;
  const unsigned lower = (1u << lane) - 1u;
  int32_t partial = 0, full = 0;
  for (int64_t base = 0; base < nb; base += 32) {
    const int64_t kb = base + lane;
    const int8_t kind = kb < nb
                            ? mask::classify(qs, summary + kb * mask::kSummaryFields, sorted_anchors + qb * block_size)
                            : mask::kEmpty;
    const unsigned p = __ballot_sync(0xffffffffu, kind == mask::kPartial);
    const unsigned f = __ballot_sync(0xffffffffu, kind == mask::kFull);
    if (kind == mask::kPartial) kv_idx[qb * nb + partial + __popc(p & lower)] = static_cast<int32_t>(kb);
    if (kind == mask::kFull) full_idx[qb * nb + full + __popc(f & lower)] = static_cast<int32_t>(kb);
    partial += __popc(p);
    full += __popc(f);
  }
  if (lane == 0) {
    kv_num[qb] = partial;
    full_num[qb] = full;
  }
}

int grid_for(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 65535));
}

}  // namespace

cudaError_t mask_dense(const int64_t* anchors, const int64_t* depths, const int64_t* edoc, const int64_t* low,
                       int64_t n, bool* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  mask_dense_kernel<<<grid_for(n * n, kThreads), kThreads, 0, stream>>>(anchors, depths, edoc, low, n, out);
  return cudaGetLastError();
}

cudaError_t mask_block_summaries(const int64_t* anchors, const int64_t* depths, const int64_t* edoc, const int64_t* low,
                                 int64_t n, int64_t block_size, int64_t* summary, cudaStream_t stream) {
  const int64_t nb = (n + block_size - 1) / block_size;
  if (nb == 0) return cudaSuccess;
  const int blocks = static_cast<int>((nb + kThreads - 1) / kThreads);
  mask_summary_kernel<<<blocks, kThreads, 0, stream>>>(anchors, depths, edoc, low, n, block_size, nb, summary);
  return cudaGetLastError();
}

cudaError_t mask_block_classify(const int64_t* summary, const int64_t* sorted_anchors, int64_t nb, int64_t block_size,
                                int32_t* kv_num_blocks, int32_t* kv_indices, int32_t* full_kv_num_blocks,
                                int32_t* full_kv_indices, cudaStream_t stream) {
  if (nb == 0) return cudaSuccess;
  constexpr int64_t kWarpsPerBlock = kThreads / 32;
  const int blocks = static_cast<int>((nb + kWarpsPerBlock - 1) / kWarpsPerBlock);
  mask_classify_kernel<<<blocks, kThreads, 0, stream>>>(summary, sorted_anchors, nb, block_size, kv_num_blocks,
                                                        kv_indices, full_kv_num_blocks, full_kv_indices);
  return cudaGetLastError();
}

namespace {

__global__ void mask_validate_kernel(const int64_t* stats, bool has_elements, int64_t length, int64_t num_depths,
                                     int64_t max_length, int64_t op, int64_t* record) {
  using namespace deferred;
  int64_t code = 0, index = 0, detail = 0, extra = 0, dim = length;
  if (has_elements && (stats[kAnchorMin] < 0 || stats[kAnchorMax] >= length)) {
    code = kMaskAnchors, detail = stats[kAnchorMin], extra = stats[kAnchorMax];
  } else if (has_elements && stats[kDepthMin] < 0) {
    code = kMaskNegativeDepth, detail = stats[kDepthMin];
  } else if (has_elements && stats[kFirstOutside] >= 0) {
    code = kMaskDepthOutsideRow, index = stats[kFirstOutside], detail = stats[kFirstOutsideDepth];
  } else if (stats[kDocumentMin] < -1) {
    code = kMaskDocumentIds, detail = stats[kDocumentMin];
  } else if (has_elements && max_length >= 0 && stats[kAnchorMax] >= max_length) {
    code = kMaskSliceAnchors, detail = stats[kAnchorMax], dim = max_length;
  } else if (has_elements && num_depths >= 0 && stats[kDepthMax] >= num_depths) {
    code = kMaskSliceDepths, detail = stats[kDepthMax], dim = num_depths;
  } else {
    return;
  }
  auto* claimed = reinterpret_cast<unsigned long long*>(record + kClaimed);
  if (atomicCAS(claimed, 0ULL, 1ULL) != 0ULL) return;
  record[kOp] = op;
  record[kCode] = code;
  record[kIndex] = index;
  record[kDetail] = detail;
  record[kExtra] = extra;
  record[kDim0] = dim;
}

}  // namespace

cudaError_t mask_validate(const int64_t* stats, bool has_elements, int64_t length, int64_t num_depths,
                          int64_t max_length, int64_t op, int64_t* record, cudaStream_t stream) {
  mask_validate_kernel<<<1, 1, 0, stream>>>(stats, has_elements, length, num_depths, max_length, op, record);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace peagle
