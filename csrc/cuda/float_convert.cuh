// Device conversions between the storage dtypes of peagle's CUDA kernels (fp32, fp64, bf16, fp16) and their
// accumulation type: fp64 accumulates in fp64, everything else in fp32. One place for every kernel family.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace peagle {
namespace cuda {

template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_acc(typename AccOf<T>::type v);
template <>
__device__ __forceinline__ float from_acc<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ double from_acc<double>(double v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) {
  return __float2half(v);
}

}  // namespace cuda
}  // namespace peagle
