// Unit tests of the COD math shared by the CPU and CUDA kernels (csrc/include/peagle/cod.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

#include "peagle/cod.h"

namespace {

using peagle::cod::deeper_rows_sum;
using peagle::cod::depth_count;
using peagle::cod::element_in_range;
using peagle::cod::extends;
using peagle::cod::key;
using peagle::cod::key_less;
using peagle::cod::mix64;

TEST(CodMath, Mix64IsSplitMix64) {
  // Published SplitMix64 outputs for state 0: the first two draws of the generator seeded with 0.
  EXPECT_EQ(mix64(0), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(mix64(0x9E3779B97F4A7C15ull), 0x6E789E6AA1B965F4ull);
}

TEST(CodMath, KeysAreNonNegativeDistinctAndBalanced) {
  std::set<int64_t> seen;
  double mean = 0.0;
  int64_t top_bit_set = 0;
  const int n = 100000;
  for (int64_t a = 0; a < n; ++a) {
    const int64_t k = key(12345, 3, a);
    ASSERT_GE(k, 0);
    seen.insert(k);
    mean += static_cast<double>(k) / 9223372036854775808.0;
    top_bit_set += (k >> 62) & 1;
  }
  EXPECT_EQ(static_cast<int>(seen.size()), n);
  EXPECT_NEAR(mean / n, 0.5, 0.01);  // uniform on [0, 1): sd of the mean is 0.0009
  EXPECT_NEAR(static_cast<double>(top_bit_set) / n, 0.5, 0.01);
}

TEST(CodMath, KeysDependOnSeedAndDepth) {
  EXPECT_NE(key(1, 1, 7), key(2, 1, 7));
  EXPECT_NE(key(1, 1, 7), key(1, 2, 7));
  EXPECT_EQ(key(-5, 4, 99), key(-5, 4, 99));
}

TEST(CodMath, DepthCountFollowsTheRatioScheduleWithFloor) {
  EXPECT_EQ(depth_count(100, 0.7, 0.2, 1), 70);
  EXPECT_EQ(depth_count(100, 0.7, 0.2, 2), 48);  // 0.7 * 0.7 = 0.48999999999999994 in double: floor gives 48
  EXPECT_EQ(depth_count(100, 0.7, 0.2, 5), 20);  // 0.7^5 = 0.168 < 0.2: the floor ratio applies
  EXPECT_EQ(depth_count(512, 1.0, 0.0, 7), 512);
  EXPECT_EQ(depth_count(3, 0.5, 0.0, 2), 0);
  EXPECT_EQ(depth_count(0, 0.7, 0.2, 1), 0);
}

TEST(CodMath, ExtendsStaysInsideOneTrainedDocument) {
  const std::vector<int64_t> docs = {0, 0, 0, 1, 1, -1};
  const bool trained[] = {true, true, false, true, true, true};
  EXPECT_TRUE(extends(docs.data(), trained, 6, 0, 1));
  EXPECT_FALSE(extends(docs.data(), trained, 6, 0, 2));  // label 2 not trained
  EXPECT_FALSE(extends(docs.data(), trained, 6, 2, 1));  // label 3 is in the next document
  EXPECT_TRUE(extends(docs.data(), trained, 6, 3, 1));
  EXPECT_FALSE(extends(docs.data(), trained, 6, 4, 1));  // label 5 is padding
  EXPECT_FALSE(extends(docs.data(), trained, 6, 5, 1));  // outside the row
}

TEST(CodMath, ElementRangeAndOrder) {
  EXPECT_TRUE(element_in_range(0, 0, 1));
  EXPECT_FALSE(element_in_range(0, 1, 1));
  EXPECT_FALSE(element_in_range(-1, 0, 4));
  EXPECT_FALSE(element_in_range(2, -1, 4));
  EXPECT_FALSE(element_in_range(INT64_MAX, 1, 4));
  EXPECT_TRUE(key_less(1, 9, 2, 0));
  EXPECT_TRUE(key_less(5, 1, 5, 2));
  EXPECT_FALSE(key_less(5, 2, 5, 2));
}

TEST(CodMath, DeeperRowsSumAddsOnlyDeeperRowsInRowOrder) {
  const int64_t depths[] = {0, 1, 2, 0, 3};
  const float values[] = {100.0f, 1.0f, 2.0f, 200.0f, 4.0f};
  const auto load = [&](int64_t row) { return values[row]; };
  EXPECT_EQ(deeper_rows_sum<float>(depths, 0, 5, load), 7.0f);
  EXPECT_EQ(deeper_rows_sum<float>(depths, 2, 4, load), 2.0f);
  EXPECT_EQ(deeper_rows_sum<float>(depths, 3, 4, load), 0.0f);
  // Row order: 2^24 then two ones loses both (each half an ulp, ties to even); the ones first would keep them.
  const int64_t deep[] = {1, 1, 1};
  const float order[] = {16777216.0f, 1.0f, 1.0f};
  EXPECT_EQ(deeper_rows_sum<float>(deep, 0, 3, [&](int64_t row) { return order[row]; }), 16777216.0f);
}

}  // namespace
