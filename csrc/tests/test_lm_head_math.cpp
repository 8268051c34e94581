// Unit tests of the efficient LM head's ranking keys (csrc/include/peagle/lm_head.h), shared by the CPU and CUDA
// kernels: key order == (score descending as floats with NaN as -inf and -0 == +0, then lower id), ids round-trip.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "peagle/lm_head.h"

namespace {

namespace lm = peagle::lm_head;

constexpr int64_t kIdsA[] = {0, 5, 4000000000}, kIdsB[] = {0, 6, 4000000001};

float ranked(float s) { return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s; }

TEST(LmHeadKeys, OrderMatchesScoreThenLowerId) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> scores = {-inf, -3.5f, -1e-38f, -0.0f, 0.0f, 1e-45f, 2.0f, 3e38f, inf, std::nanf("")};
  std::mt19937 gen(7);
  std::vector<float> values = scores;
  std::normal_distribution<float> normal;
  for (int i = 0; i < 200; ++i) values.push_back(normal(gen));
  for (size_t i = 0; i < values.size(); ++i) {
    for (size_t j = 0; j < values.size(); ++j) {
      for (const int64_t a : kIdsA) {
        for (const int64_t b : kIdsB) {
          const float x = ranked(values[i]), y = ranked(values[j]);
          const bool better = x > y || (x == y && a < b);
          EXPECT_EQ(lm::make_key(values[i], a) > lm::make_key(values[j], b), better)
              << values[i] << " id " << a << " vs " << values[j] << " id " << b;
        }
      }
    }
  }
}

TEST(LmHeadKeys, IdsRoundTrip) {
  for (int64_t id : {int64_t{0}, int64_t{1}, int64_t{151935}, lm::kMaxVocab - 1}) {
    EXPECT_EQ(lm::key_id(lm::make_key(1.5f, id)), id);
    EXPECT_EQ(lm::key_id(lm::make_key(std::nanf(""), id)), id);
  }
}

}  // namespace
