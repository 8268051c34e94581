// The COD math gives the same bits on the device as on the host (csrc/include/peagle/cod.h).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "peagle/cod.h"

namespace {

bool has_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

__global__ void keys_and_counts(int64_t seed, int n, int64_t* keys, int64_t* counts) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) keys[i] = peagle::cod::key(seed, i % 9, i);
  if (i < 16) counts[i] = peagle::cod::depth_count(1000 + i, 0.7, 0.2, i);
}

TEST(CodMathCuda, DeviceMatchesHost) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  const int n = 4096;
  int64_t* d_keys = nullptr;
  int64_t* d_counts = nullptr;
  ASSERT_EQ(cudaMalloc(&d_keys, n * sizeof(int64_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_counts, 16 * sizeof(int64_t)), cudaSuccess);
  keys_and_counts<<<(n + 255) / 256, 256>>>(-77, n, d_keys, d_counts);
  std::vector<int64_t> keys(n), counts(16);
  ASSERT_EQ(cudaMemcpy(keys.data(), d_keys, n * sizeof(int64_t), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(counts.data(), d_counts, 16 * sizeof(int64_t), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d_keys);
  cudaFree(d_counts);
  for (int i = 0; i < n; ++i) ASSERT_EQ(keys[i], peagle::cod::key(-77, i % 9, i)) << i;
  for (int i = 0; i < 16; ++i) ASSERT_EQ(counts[i], peagle::cod::depth_count(1000 + i, 0.7, 0.2, i)) << i;
}

}  // namespace
