// The CUDA launchers' check of a CUDA runtime status (CUDA builds only: this header includes the CUDA runtime).
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

namespace peagle {

inline void check_cuda(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "peagle.", op, ": CUDA error: ", cudaGetErrorString(err));
}

}  // namespace peagle
