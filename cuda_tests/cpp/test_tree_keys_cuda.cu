// The tree construction math gives the same bits on the device as on the host (csrc/include/peagle/tree.h): the radix
// keys of the CUDA top-k (the device takes __float_as_uint / __double_as_longlong, the host memcpy), the draft entry
// check on denormals (no flush to zero) and the path-score product.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "peagle/tree.h"

namespace {

namespace tree = peagle::tree;

bool has_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

__global__ void tree_keys(const float* probs, const double* scores, int n, uint32_t* prob_keys, uint64_t* score_keys,
                          int32_t* entry_ok, double* products) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  prob_keys[i] = tree::prob_key(probs[i]);
  score_keys[i] = tree::score_key(scores[i]);
  entry_ok[i] = tree::draft_entry_ok(probs[i]) ? 1 : 0;
  products[i] = tree::mul_rn(scores[i], static_cast<double>(probs[i]));
}

TEST(TreeKeysCuda, DeviceMatchesHost) {
  if (!has_device()) GTEST_SKIP() << "no CUDA device";
  const float fmin = std::numeric_limits<float>::denorm_min();
  const double dmin = std::numeric_limits<double>::denorm_min();
  std::vector<float> probs = {0.0f, -0.0f, fmin, -fmin, 3 * fmin, 1e-30f, 0.25f, 0.5f, 1.0f, 1.0000001f, -1.0f};
  std::vector<double> scores = {0.0, -0.0, dmin, -dmin, 1e-300, 0.125, 1.0, -2.0, 3.5, 1e300, -1e300};
  for (int i = 0; i < 1000; ++i) {  // a sweep of ordinary values
    probs.push_back(static_cast<float>(i) / 997.0f);
    scores.push_back(static_cast<double>(i - 500) / 37.0);
  }
  const int n = static_cast<int>(probs.size());
  float* d_probs = nullptr;
  double *d_scores = nullptr, *d_products = nullptr;
  uint32_t* d_prob_keys = nullptr;
  uint64_t* d_score_keys = nullptr;
  int32_t* d_ok = nullptr;
  ASSERT_EQ(cudaMalloc(&d_probs, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_scores, n * sizeof(double)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_products, n * sizeof(double)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_prob_keys, n * sizeof(uint32_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_score_keys, n * sizeof(uint64_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_ok, n * sizeof(int32_t)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_probs, probs.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_scores, scores.data(), n * sizeof(double), cudaMemcpyHostToDevice), cudaSuccess);
  tree_keys<<<(n + 255) / 256, 256>>>(d_probs, d_scores, n, d_prob_keys, d_score_keys, d_ok, d_products);
  std::vector<uint32_t> prob_keys(n);
  std::vector<uint64_t> score_keys(n);
  std::vector<int32_t> ok(n);
  std::vector<double> products(n);
  ASSERT_EQ(cudaMemcpy(prob_keys.data(), d_prob_keys, n * sizeof(uint32_t), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(score_keys.data(), d_score_keys, n * sizeof(uint64_t), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(ok.data(), d_ok, n * sizeof(int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(products.data(), d_products, n * sizeof(double), cudaMemcpyDeviceToHost), cudaSuccess);
  for (void* p : {static_cast<void*>(d_probs), static_cast<void*>(d_scores), static_cast<void*>(d_products),
                  static_cast<void*>(d_prob_keys), static_cast<void*>(d_score_keys), static_cast<void*>(d_ok)}) {
    cudaFree(p);
  }
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(prob_keys[i], tree::prob_key(probs[i])) << i;
    ASSERT_EQ(score_keys[i], tree::score_key(scores[i])) << i;
    ASSERT_EQ(ok[i], tree::draft_entry_ok(probs[i]) ? 1 : 0) << i;
    const double expected = tree::mul_rn(scores[i], static_cast<double>(probs[i]));
    ASSERT_EQ(std::memcmp(&products[i], &expected, sizeof(double)), 0) << i;
  }
}

}  // namespace
