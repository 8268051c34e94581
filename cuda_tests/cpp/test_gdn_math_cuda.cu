// The GDN math gives the same bits on the device as on the host (csrc/include/peagle/gdn.h): the exp, the norm
// factors, the Gram entries and the decayed coefficients, over inputs that span their ranges.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "peagle/gdn.h"

namespace {

namespace gdn = peagle::gdn;

bool has_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// kResults results per input x: exp_rn(x), row_factor(x^2 * 37, true, 0.3), gram_entry(x, x / 3, 1.7), decayed(x,
// 0.5, x / 7), each after a chain of mac steps over x; and the fused steps over a state (state_step, commit_step and
// state_mac: one rounding each for their multiply-add).
constexpr int kResults = 6;
__host__ __device__ void gdn_ops(float x, float* out) {
  out[0] = gdn::exp_rn(x);
  out[1] = gdn::row_factor(gdn::mac(gdn::mac(0.0f, x, x), x, 36.0f * x), true, 0.3f);
  out[2] = gdn::gram_entry(x, gdn::div_rn(x, 3.0f), 1.7f);
  out[3] = gdn::decayed(x, 0.5f, gdn::div_rn(x, 7.0f));
  out[4] = gdn::state_step(x, 0.7f, gdn::div_rn(x, 3.0f), 1.3f);
  out[5] = gdn::state_mac(gdn::commit_step(x, 0.3f, x, 1.1f), x, gdn::div_rn(x, 7.0f));
}

__global__ void gdn_ops_kernel(const float* x, int n, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) gdn_ops(x[i], out + kResults * i);
}

TEST(GdnMathCuda, DeviceMatchesHostBitForBit) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  std::vector<float> x;
  for (float v = -110.0f; v < 95.0f; v += 0.0371f) x.push_back(v);
  x.push_back(0.0f);
  x.push_back(-0.0f);
  const int n = static_cast<int>(x.size());
  float* d_x = nullptr;
  float* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_x, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, kResults * n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_x, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  gdn_ops_kernel<<<(n + 255) / 256, 256>>>(d_x, n, d_out);
  std::vector<float> device(kResults * n);
  ASSERT_EQ(cudaMemcpy(device.data(), d_out, kResults * n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d_x);
  cudaFree(d_out);
  for (int i = 0; i < n; ++i) {
    float host[kResults];
    gdn_ops(x[i], host);
    for (int e = 0; e < kResults; ++e) {
      uint32_t want = 0, got = 0;
      std::memcpy(&want, &host[e], sizeof want);
      std::memcpy(&got, &device[kResults * i + e], sizeof got);
      ASSERT_EQ(got, want) << "x = " << x[i] << ", result " << e;
    }
  }
}

}  // namespace
