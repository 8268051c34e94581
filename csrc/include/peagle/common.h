// Portability macros shared by the CPU (g++) and CUDA (nvcc) translation units.
// Nothing here includes torch: kernel .cu files stay free of ATen headers to keep builds fast.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PEAGLE_HOST_DEVICE __host__ __device__
#define PEAGLE_INLINE __forceinline__
#else
#define PEAGLE_HOST_DEVICE
#define PEAGLE_INLINE inline
#endif

#define PEAGLE_HD PEAGLE_HOST_DEVICE PEAGLE_INLINE
