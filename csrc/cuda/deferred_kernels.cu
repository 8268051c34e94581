// Kernels shared by the deferred checks of several ops (see deferred_cuda.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "deferred_cuda.h"
#include "peagle/deferred.h"

namespace peagle {
namespace {

__global__ void publish_flag_kernel(const int32_t* bad, int64_t op, int64_t code, int64_t dim0, int64_t* record) {
  if (*bad == 0) return;
  auto* claimed = reinterpret_cast<unsigned long long*>(record + deferred::kClaimed);
  if (atomicCAS(claimed, 0ULL, 1ULL) != 0ULL) return;
  record[deferred::kOp] = op;
  record[deferred::kCode] = code;
  record[deferred::kDim0] = dim0;
}

}  // namespace

cudaError_t deferred_publish_flag(const int32_t* bad, int64_t op, int64_t code, int64_t dim0, int64_t* record,
                                  cudaStream_t stream) {
  publish_flag_kernel<<<1, 1, 0, stream>>>(bad, op, code, dim0, record);
  return cudaGetLastError();
}

}  // namespace peagle
