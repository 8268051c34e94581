// Unit tests of the tree math shared by the CPU and CUDA kernels (csrc/include/peagle/tree.h): Philox draws against
// published and reference vectors, the exactness of the 40-bit fixed point and 24-bit uniforms, the rounded
// acceptance/sampling arithmetic, structure checks and the construction orders.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "peagle/tree.h"

namespace {

namespace tree = peagle::tree;

constexpr int64_t kOne = int64_t{1} << 40;       // 1.0 in fixed point
constexpr int64_t kUniforms = int64_t{1} << 24;  // number of 24-bit uniforms

// floor(p * 2^shift) for a finite p >= 0, from p's mantissa and exponent in integer arithmetic (independent of the
// double multiplication the header uses).
int64_t exact_floor_scaled(float p, int shift) {
  if (p == 0.0f) return 0;
  int exponent = 0;
  const float mantissa = std::frexp(p, &exponent);                // p = mantissa * 2^exponent, mantissa in [0.5, 1)
  const auto m = static_cast<int64_t>(std::ldexp(mantissa, 24));  // exact: floats carry 24 significant bits
  const int e = exponent - 24 + shift;                            // p * 2^shift = m * 2^e
  if (e >= 0) return m << e;
  return e <= -63 ? 0 : m >> -e;
}

// ---------------------------------------------------------------------------------------------------------------------
// Philox 4x32-10.

struct PhiloxKat {
  uint32_t counter[4];
  uint32_t key[2];
  uint32_t out[4];
};

// Known-answer vectors of Philox4x32-10 from Random123's tests/kat_vectors (D. E. Shaw Research,
// github.com/DEShawResearch/random123), the three "philox4x32 10" lines: counter[4], key[2] -> output[4].
constexpr PhiloxKat kPhiloxKats[] = {
    {{0x00000000u, 0x00000000u, 0x00000000u, 0x00000000u},
     {0x00000000u, 0x00000000u},
     {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
    {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
     {0xffffffffu, 0xffffffffu},
     {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
    {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
     {0xa4093822u, 0x299f31d0u},
     {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
};

TEST(TreePhilox, FirstWordMatchesRandom123KnownAnswers) {
  for (const PhiloxKat& kat : kPhiloxKats) {
    EXPECT_EQ(
        tree::philox4x32_10(kat.counter[0], kat.counter[1], kat.counter[2], kat.counter[3], kat.key[0], kat.key[1]),
        kat.out[0]);
  }
}

TEST(TreePhilox, RoundFunctionGivesAllFourKnownAnswerWords) {
  // The Random123 schedule written out: ten rounds, the key bumped by the Weyl constants before rounds 2..10.
  for (const PhiloxKat& kat : kPhiloxKats) {
    uint32_t c0 = kat.counter[0], c1 = kat.counter[1], c2 = kat.counter[2], c3 = kat.counter[3];
    uint32_t k0 = kat.key[0], k1 = kat.key[1];
    for (int round = 0; round < 10; ++round) {
      if (round > 0) {
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
      }
      tree::philox_round(c0, c1, c2, c3, k0, k1);
    }
    EXPECT_EQ(c0, kat.out[0]);
    EXPECT_EQ(c1, kat.out[1]);
    EXPECT_EQ(c2, kat.out[2]);
    EXPECT_EQ(c3, kat.out[3]);
  }
}

TEST(TreePhilox, Uniform24LaysOutSeedOffsetRequestIndex) {
  // counter = (index, request, offset lo, offset hi), key = (seed lo, seed hi); the draw is the top 24 bits of word 0.
  // Laid out on the Random123 vectors above: 0x6627e8d5 >> 8, 0x408f276d >> 8, 0xd16cfe09 >> 8.
  EXPECT_EQ(tree::philox_uniform24(0, 0, 0, 0), 0x6627e8);
  EXPECT_EQ(tree::philox_uniform24(-1, -1, 0xffffffff, 0xffffffff), 0x408f27);
  EXPECT_EQ(tree::philox_uniform24(0x299f31d0a4093822, 0x0370734413198a2e, 0x85a308d3, 0x243f6a88), 0xd16cfe);
}

TEST(TreePhilox, Uniform24MatchesThePythonReference) {
  // Expected values printed by the PyTorch reference peagle.ops.tree.philox_uniforms(seed, offset, request, index),
  // which emulates the uint32 arithmetic on int64 tensors (an independent implementation of the same definition).
  struct Draw {
    int64_t seed, offset, request, index, expected;
  };
  const Draw draws[] = {
      {0, 0, 0, 1, 16311500},
      {0, 0, 1, 0, 7000261},
      {42, 0, 3, 5, 11397502},
      {-1, 0, 0, 0, 7513207},
      {123456789012345, 987654321098765, 7, 63, 6489898},
      {INT64_MAX, -1, int64_t{1} << 31, int64_t{1} << 20, 10699679},
      {5, int64_t{1} << 32, 0, 1, 12634769},
  };
  for (const Draw& d : draws) {
    EXPECT_EQ(tree::philox_uniform24(d.seed, d.offset, d.request, d.index), d.expected)
        << "seed " << d.seed << " offset " << d.offset << " request " << d.request << " index " << d.index;
  }
}

TEST(TreePhilox, Uniform24IsInRangeAndBalanced) {
  double mean = 0.0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const int64_t u = tree::philox_uniform24(7, 11, i % 97, i / 97);
    ASSERT_GE(u, 0);
    ASSERT_LT(u, kUniforms);
    mean += static_cast<double>(u) / static_cast<double>(kUniforms);
  }
  EXPECT_NEAR(mean / n, 0.5, 0.005);  // uniform on [0, 1): sd of the mean is 0.0009
}

// ---------------------------------------------------------------------------------------------------------------------
// Fixed point and uniforms.

TEST(TreeFixedPoint, FixedIsTheExactFloorOfPTimes2To40) {
  EXPECT_EQ(tree::fixed(0.0f), 0);
  EXPECT_EQ(tree::fixed(1.0f), kOne);
  EXPECT_EQ(tree::fixed(0.5f), kOne / 2);
  EXPECT_EQ(tree::fixed(std::nextafter(1.0f, 0.0f)), kOne - (int64_t{1} << 16));  // 1 - 2^-24
  EXPECT_EQ(tree::fixed(std::ldexp(1.0f, -40)), 1);
  EXPECT_EQ(tree::fixed(std::ldexp(1.0f, -41)), 0);  // truncation, not rounding
  EXPECT_EQ(tree::fixed(std::ldexp(3.0f, -41)), 1);  // 1.5 units -> 1
  EXPECT_EQ(tree::fixed(std::numeric_limits<float>::denorm_min()), 0);
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> unit(0.0f, 1.001f);
  std::uniform_int_distribution<int> scale(0, 60);
  for (int i = 0; i < 100000; ++i) {
    const float p = std::ldexp(unit(rng), -scale(rng));  // every binade down to 2^-60
    ASSERT_EQ(tree::fixed(p), exact_floor_scaled(p, 40)) << p;
  }
}

TEST(TreeFixedPoint, RowSumsDoNotDependOnTheReductionOrder) {
  // The CPU kernel sums a row left to right, the CUDA kernel per lane then across a warp: the sums must agree bit for
  // bit, and so must the prefix sums the sampler scans.
  std::mt19937 rng(99);
  std::normal_distribution<float> logit(0.0f, 3.0f);
  for (const int vocab : {1, 7, 1000, 4099}) {
    std::vector<float> row(vocab);
    float total = 0.0f;
    for (float& p : row) total += (p = std::exp(logit(rng)));
    for (float& p : row) p /= total;

    int64_t forward = 0, backward = 0, strided = 0;
    for (int y = 0; y < vocab; ++y) forward += tree::fixed(row[y]);
    for (int y = vocab - 1; y >= 0; --y) backward += tree::fixed(row[y]);
    std::vector<int64_t> lanes(32, 0);
    for (int y = 0; y < vocab; ++y) lanes[y % 32] += tree::fixed(row[y]);
    for (int width = 16; width >= 1; width /= 2) {  // tree reduction across the lanes
      for (int lane = 0; lane < width; ++lane) lanes[lane] += lanes[lane + width];
    }
    strided = lanes[0];
    EXPECT_EQ(forward, backward);
    EXPECT_EQ(forward, strided);

    std::vector<float> shuffled = row;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    int64_t permuted = 0;
    for (const float p : shuffled) permuted += tree::fixed(p);
    EXPECT_EQ(forward, permuted);

    // Truncation loses less than one unit per entry against the real-valued sum.
    long double exact = 0.0L;
    for (const float p : row) exact += static_cast<long double>(p);
    const long double scaled = exact * static_cast<long double>(kOne);
    EXPECT_LE(static_cast<long double>(forward), scaled + 1.0L);
    EXPECT_GT(static_cast<long double>(forward), scaled - static_cast<long double>(vocab) - 1.0L);
    EXPECT_TRUE(tree::sum_ok(forward));

    // Blocked inclusive scan (block partials, then block offsets) equals the sequential prefix sums.
    std::vector<int64_t> sequential(vocab), blocked(vocab);
    int64_t acc = 0;
    for (int y = 0; y < vocab; ++y) sequential[y] = acc += tree::fixed(row[y]);
    const int block = 32;
    int64_t offset = 0;
    for (int begin = 0; begin < vocab; begin += block) {
      const int end = std::min(vocab, begin + block);
      int64_t local = 0;
      for (int y = begin; y < end; ++y) blocked[y] = local += tree::fixed(row[y]);
      for (int y = begin; y < end; ++y) blocked[y] += offset;
      offset += local;
    }
    EXPECT_EQ(sequential, blocked);
  }
}

TEST(TreeFixedPoint, SumToleranceBoundaries) {
  const auto hi = static_cast<int64_t>((1.0 + tree::kSumTolerance) * tree::kFixedOne);
  const auto lo = static_cast<int64_t>(std::ceil((1.0 - tree::kSumTolerance) * tree::kFixedOne));
  EXPECT_TRUE(tree::sum_ok(kOne));
  EXPECT_TRUE(tree::sum_ok(hi - 1));
  EXPECT_FALSE(tree::sum_ok(hi + 2));
  EXPECT_TRUE(tree::sum_ok(lo + 1));
  EXPECT_FALSE(tree::sum_ok(lo - 2));
  EXPECT_FALSE(tree::sum_ok(0));
  EXPECT_FALSE(tree::sum_ok(kOne / 2));
  EXPECT_FALSE(tree::sum_ok(2 * kOne));
}

TEST(TreeFixedPoint, ProbabilityEntryValidity) {
  EXPECT_TRUE(tree::prob_ok(0.0f));
  EXPECT_TRUE(tree::prob_ok(-0.0f));
  EXPECT_TRUE(tree::prob_ok(1.0f));
  EXPECT_TRUE(tree::prob_ok(1.0009f));
  EXPECT_FALSE(tree::prob_ok(1.002f));
  EXPECT_FALSE(tree::prob_ok(-std::numeric_limits<float>::denorm_min()));
  EXPECT_FALSE(tree::prob_ok(std::numeric_limits<float>::quiet_NaN()));
  EXPECT_FALSE(tree::prob_ok(std::numeric_limits<float>::infinity()));
}

TEST(TreeFixedPoint, ExplicitUniformsMapExactlyTo24Bits) {
  EXPECT_EQ(tree::uniform24(0.0f), 0);
  EXPECT_EQ(tree::uniform24(0.5f), kUniforms / 2);
  EXPECT_EQ(tree::uniform24(std::nextafter(1.0f, 0.0f)), kUniforms - 1);
  EXPECT_EQ(tree::uniform24(std::ldexp(1.0f, -24)), 1);
  EXPECT_EQ(tree::uniform24(std::ldexp(1.0f, -25)), 0);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int i = 0; i < 100000; ++i) {
    const float u = unit(rng);
    ASSERT_EQ(tree::uniform24(u), exact_floor_scaled(u, 24)) << u;
  }
  EXPECT_TRUE(tree::uniform_ok(0.0f));
  EXPECT_TRUE(tree::uniform_ok(std::nextafter(1.0f, 0.0f)));
  EXPECT_FALSE(tree::uniform_ok(1.0f));
  EXPECT_FALSE(tree::uniform_ok(-std::numeric_limits<float>::denorm_min()));
  EXPECT_FALSE(tree::uniform_ok(std::numeric_limits<float>::quiet_NaN()));
}

// ---------------------------------------------------------------------------------------------------------------------
// Acceptance and sampling arithmetic.

TEST(TreeSampling, AcceptIsTheExactComparisonWhenProductsAreExact) {
  // u * M < r * 2^24 with every product below 2^53: the double arithmetic is exact, so it must equal the integer test.
  std::mt19937_64 rng(17);
  std::uniform_int_distribution<int64_t> uniform(0, kUniforms - 1);
  std::uniform_int_distribution<int64_t> mass(0, (int64_t{1} << 29) - 1);
  for (int i = 0; i < 100000; ++i) {
    const int64_t u = uniform(rng), m = mass(rng);
    const int64_t r = i % 3 == 0 ? (u * m) >> 24 : mass(rng);  // many cases on the boundary
    ASSERT_EQ(tree::accept(u, m, r), u * m < (r << 24)) << u << " " << m << " " << r;
  }
}

TEST(TreeSampling, AcceptIsMonotoneAndCertainAtFullMass) {
  const int64_t masses[] = {1, 3, kOne - 1, kOne, kOne + (kOne >> 10), 2 * kOne - 7};
  for (const int64_t m : masses) {
    // A token holding all of the mass is always accepted, one holding none never.
    EXPECT_TRUE(tree::accept(kUniforms - 1, m, m)) << m;
    EXPECT_TRUE(tree::accept(0, m, 1)) << m;
    EXPECT_FALSE(tree::accept(0, m, 0)) << m;
  }
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<int64_t> uniform(1, kUniforms - 1);
  std::uniform_int_distribution<int64_t> mass(kOne / 2, 2 * kOne);
  for (int i = 0; i < 100000; ++i) {
    const int64_t u = uniform(rng), m = mass(rng);
    std::uniform_int_distribution<int64_t> part(0, m);
    const int64_t r = part(rng);
    // Rounded products keep the order: accepting a draw accepts every smaller draw and every larger residual.
    if (tree::accept(u, m, r)) {
      ASSERT_TRUE(tree::accept(u - 1, m, r));
      ASSERT_TRUE(tree::accept(u, m, r + 1));
    }
  }
}

TEST(TreeSampling, SampleTargetStaysBelowTheMass) {
  const int64_t masses[] = {1, 2, 255, kOne - 1, kOne, kOne + (kOne >> 10), 2 * kOne};
  for (const int64_t m : masses) {
    EXPECT_EQ(tree::sample_target(0, m), 0);
    const int64_t top = tree::sample_target(kUniforms - 1, m);
    EXPECT_GE(top, 0);
    EXPECT_LT(top, m) << m;  // the largest draw still lands on a token with mass
  }
  std::mt19937_64 rng(8);
  std::uniform_int_distribution<int64_t> uniform(0, kUniforms - 1);
  std::uniform_int_distribution<int64_t> mass(1, (int64_t{1} << 29) - 1);
  for (int i = 0; i < 100000; ++i) {
    const int64_t u = uniform(rng), m = mass(rng);
    ASSERT_EQ(tree::sample_target(u, m), (u * m) >> 24) << u << " " << m;  // exact below 2^53
  }
}

TEST(TreeSampling, DraftScaleMapsDraftMassOntoResidualMass) {
  EXPECT_EQ(tree::draft_scale(kOne, 0), 0.0);
  EXPECT_EQ(tree::draft_scale(kOne, kOne / 2), 2.0);
  EXPECT_EQ(tree::draft_scale(kOne / 4, kOne), 0.25);
  EXPECT_EQ(tree::scaled_draft(kOne / 2, 2.0), kOne);
  EXPECT_EQ(tree::scaled_draft(kOne, 0.0), 0);
  EXPECT_EQ(tree::scaled_draft(7, 0.5), 3);  // truncation
}

// ---------------------------------------------------------------------------------------------------------------------
// Structure checks and orders.

TEST(TreeChecks, RequestStructureErrorsNameTheFirstBadNode) {
  // Tree: 0 -> {1, 2}, 1 -> {3}; vocab 10.
  const int64_t parent[] = {-1, 0, 0, 1};
  const int64_t tokens[] = {0, 4, 5, 4};
  int64_t node = -7, detail = -7;
  EXPECT_EQ(tree::check_request(parent, tokens, 4, 4, 10, &node, &detail), tree::kOk);
  EXPECT_EQ(node, 0);
  EXPECT_EQ(detail, 0);

  EXPECT_EQ(tree::check_request(parent, tokens, 0, 4, 10, &node, &detail), tree::kNumNodes);
  EXPECT_EQ(detail, 0);
  EXPECT_EQ(tree::check_request(parent, tokens, 5, 4, 10, &node, &detail), tree::kNumNodes);
  EXPECT_EQ(detail, 5);

  const int64_t bad_root[] = {2, 0, 0, 1};
  EXPECT_EQ(tree::check_request(bad_root, tokens, 4, 4, 10, &node, &detail), tree::kRootParent);
  EXPECT_EQ(detail, 2);

  const int64_t forward[] = {-1, 0, 3, 1};
  EXPECT_EQ(tree::check_request(forward, tokens, 4, 4, 10, &node, &detail), tree::kParent);
  EXPECT_EQ(node, 2);
  EXPECT_EQ(detail, 3);
  // A bad node beyond num_nodes is padding and not checked.
  EXPECT_EQ(tree::check_request(forward, tokens, 2, 4, 10, &node, &detail), tree::kOk);

  const int64_t big_token[] = {0, 4, 10, 4};
  EXPECT_EQ(tree::check_request(parent, big_token, 4, 4, 10, &node, &detail), tree::kToken);
  EXPECT_EQ(node, 2);
  EXPECT_EQ(detail, 10);

  const int64_t twins[] = {0, 4, 4, 4};  // nodes 1 and 2 are siblings with token 4; node 3 (child of 1) is fine
  EXPECT_EQ(tree::check_request(parent, twins, 4, 4, 10, &node, &detail), tree::kDuplicate);
  EXPECT_EQ(node, 2);
  EXPECT_EQ(detail, 4);

  const int32_t parent32[] = {-1, 0, 0, 1};
  const int32_t tokens32[] = {0, 4, 5, -1};
  EXPECT_EQ(tree::check_request(parent32, tokens32, 4, 4, 10, &node, &detail), tree::kToken);
  EXPECT_EQ(node, 3);
  EXPECT_EQ(detail, -1);
}

TEST(TreeOrders, TiesBreakTowardsTheSmallerIndex) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(tree::argmax_better(0.6f, 9, 0.5f, 0));
  EXPECT_TRUE(tree::argmax_better(0.5f, 1, 0.5f, 2));
  EXPECT_FALSE(tree::argmax_better(0.5f, 2, 0.5f, 1));
  EXPECT_FALSE(tree::argmax_better(0.5f, 2, 0.5f, 2));
  EXPECT_FALSE(tree::argmax_better(nan, 0, 0.5f, 1));

  EXPECT_TRUE(tree::score_before(0.25, 5, 0.125, 1));
  EXPECT_TRUE(tree::score_before(0.25, 1, 0.25, 5));
  EXPECT_FALSE(tree::score_before(0.25, 5, 0.25, 1));
  EXPECT_FALSE(tree::score_before(0.25, 1, 0.25, 1));

  EXPECT_TRUE(tree::prob_before(0.3f, 7, 0.2f, 1));
  EXPECT_TRUE(tree::prob_before(0.3f, 1, 0.3f, 7));
  EXPECT_FALSE(tree::prob_before(0.2f, 1, 0.3f, 7));

  // Depth first, then score, then index.
  EXPECT_TRUE(tree::node_before(1, 0.01, 9, 2, 0.9, 0));
  EXPECT_FALSE(tree::node_before(2, 0.9, 0, 1, 0.01, 9));
  EXPECT_TRUE(tree::node_before(2, 0.5, 9, 2, 0.4, 0));
  EXPECT_TRUE(tree::node_before(2, 0.5, 3, 2, 0.5, 4));
  EXPECT_FALSE(tree::node_before(2, 0.5, 4, 2, 0.5, 4));
}

}  // namespace

TEST(TreeBuildChecks, NonFiniteScoresAndProbabilitiesAreRejected) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(tree::draft_entry_ok(0.0f));
  EXPECT_TRUE(tree::draft_entry_ok(1.0f));
  EXPECT_FALSE(tree::draft_entry_ok(1.0f + 1e-7f));  // a child would outscore its parent
  EXPECT_FALSE(tree::draft_entry_ok(inf));
  EXPECT_FALSE(tree::draft_entry_ok(nan));
  EXPECT_FALSE(tree::draft_entry_ok(-1e-30f));
  EXPECT_TRUE(tree::frontier_score_ok(0.25));
  EXPECT_FALSE(tree::frontier_score_ok(static_cast<double>(inf)));
  EXPECT_FALSE(tree::frontier_score_ok(static_cast<double>(nan)));
  EXPECT_FALSE(tree::frontier_score_ok(-0.5));
  const int64_t parent[3] = {-1, 0, 1};
  const double finite[3] = {1.0, 0.5, 0.25}, infinite[3] = {static_cast<double>(inf), static_cast<double>(inf), 1.0};
  int64_t node = -1;
  EXPECT_EQ(tree::check_candidates(parent, finite, 3, &node), tree::kBuildOk);
  EXPECT_EQ(tree::check_candidates(parent, infinite, 3, &node), tree::kCandidateScore);
  EXPECT_EQ(node, 0);
}

// The radix keys of the CUDA top-k order values exactly as prob_before / score_before do: key(a) > key(b) iff a > b,
// equal keys iff equal values (-0 == +0), over valid draft entries (denormals included) and finite scores.
TEST(TreeBuildChecks, RadixKeysOrderLikeTheValues) {
  const float denormal = std::numeric_limits<float>::denorm_min();
  const std::vector<float> probs = {0.0f, -0.0f, denormal, 2 * denormal, 1e-30f, 0.25f, 0.5f, 0.5f, 0.75f, 1.0f};
  for (const float a : probs) {
    for (const float b : probs) {
      EXPECT_EQ(tree::prob_key(a) > tree::prob_key(b), a > b) << a << " " << b;
      EXPECT_EQ(tree::prob_key(a) == tree::prob_key(b), a == b) << a << " " << b;
    }
  }
  const double big = std::numeric_limits<double>::max(), tiny = std::numeric_limits<double>::denorm_min();
  const std::vector<double> scores = {-big, -2.0, -1.0, -tiny, -0.0, 0.0, tiny, 1e-300, 0.125, 1.0, 3.0, big};
  for (const double a : scores) {
    for (const double b : scores) {
      EXPECT_EQ(tree::score_key(a) > tree::score_key(b), a > b) << a << " " << b;
      EXPECT_EQ(tree::score_key(a) == tree::score_key(b), a == b) << a << " " << b;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// Chunked row statistics (the CUDA kernels' first phase): any reduction order within a chunk, then the chunks in order,
// must give the CPU's sequential row pass exactly.

namespace {

struct RowPass {
  int64_t argmax, first_nan, sum, first_bad;
};

// The sequential reference: the first index of the largest non-NaN entry, the first NaN, the fixed-point sum of the
// valid entries and the first invalid entry (kNoIndex where there is none).
RowPass sequential_pass(const std::vector<float>& row) {
  RowPass r{tree::kNoIndex, tree::kNoIndex, 0, tree::kNoIndex};
  float best = -std::numeric_limits<float>::infinity();
  for (size_t y = 0; y < row.size(); ++y) {
    if (std::isnan(row[y])) continue;
    if (r.argmax == tree::kNoIndex || row[y] > best) {
      best = row[y];
      r.argmax = static_cast<int64_t>(y);
    }
  }
  for (size_t y = 0; y < row.size(); ++y) {
    const auto i = static_cast<int64_t>(y);
    if (std::isnan(row[y]) && r.first_nan == tree::kNoIndex) r.first_nan = i;
    if (tree::prob_ok(row[y])) {
      r.sum += exact_floor_scaled(row[y], 40);
    } else if (r.first_bad == tree::kNoIndex) {
      r.first_bad = i;
    }
  }
  return r;
}

// One chunk as a block reduces it: 256 strided per-thread partials, folded in a random order.
template <typename Partial, typename Start, typename Add, typename Combine>
Partial chunk_partial(const std::vector<float>& row, int64_t chunk, std::mt19937& rng, Start start, Add add,
                      Combine combine) {
  constexpr int64_t kThreads = 256;
  const int64_t begin = chunk * tree::kVerifyChunk;
  const int64_t end = std::min<int64_t>(begin + tree::kVerifyChunk, static_cast<int64_t>(row.size()));
  std::vector<Partial> parts(kThreads, start());
  for (int64_t y = begin; y < end; ++y) add(parts[(y - begin) % kThreads], row[y], y);
  while (parts.size() > 1) {
    std::shuffle(parts.begin(), parts.end(), rng);
    const Partial merged = combine(parts[parts.size() - 2], parts.back());
    parts.pop_back();
    parts.back() = merged;
  }
  return parts[0];
}

}  // namespace

TEST(TreeChunks, ChunkedPartialsEqualTheSequentialRowPass) {
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const int64_t vocabs[] = {1, 3, 255, 4096, 4097, 3 * 4096 + 5, 151936};
  for (const int64_t vocab : vocabs) {
    for (int trial = 0; trial < 12; ++trial) {
      std::vector<float> row(static_cast<size_t>(vocab));
      for (float& p : row) p = unit(rng) / static_cast<float>(vocab);
      std::uniform_int_distribution<int64_t> pick(0, vocab - 1);
      if (trial % 3 == 0) {  // ties of the maximum, +0 / -0 ties, across chunks
        for (int k = 0; k < 4; ++k) row[pick(rng)] = 1.0f;
      }
      if (trial == 1) std::fill(row.begin(), row.end(), -0.0f);
      if (trial == 2) std::fill(row.begin(), row.end(), -inf);
      if (trial == 4) {
        row[pick(rng)] = 0.0f;
        row[0] = -0.0f;
      }
      if (trial == 5 || trial == 6) row[pick(rng)] = nan;
      if (trial == 6) row[pick(rng)] = -1e-3f;
      if (trial == 7) row[pick(rng)] = 1.5f;
      if (trial == 8) std::fill(row.begin(), row.end(), nan);
      const RowPass want = sequential_pass(row);
      const int64_t chunks = tree::verify_chunks(vocab);
      ASSERT_EQ(chunks, (vocab + 4095) / 4096);
      std::vector<tree::ArgmaxPartial> argmax_parts;
      std::vector<tree::SumPartial> sum_parts;
      for (int64_t c = 0; c < chunks; ++c) {
        argmax_parts.push_back(chunk_partial<tree::ArgmaxPartial>(row, c, rng, tree::argmax_start, tree::argmax_add,
                                                                  tree::argmax_combine));
        sum_parts.push_back(
            chunk_partial<tree::SumPartial>(row, c, rng, tree::sum_start, tree::sum_add, tree::sum_combine));
      }
      const tree::ArgmaxPartial argmax = tree::combine_argmax_chunks(argmax_parts.data(), chunks);
      const tree::SumPartial sum = tree::combine_sum_chunks(sum_parts.data(), chunks);
      ASSERT_EQ(argmax.index, want.argmax) << vocab << " " << trial;
      ASSERT_EQ(argmax.first_nan, want.first_nan) << vocab << " " << trial;
      ASSERT_EQ(sum.first_bad, want.first_bad) << vocab << " " << trial;
      ASSERT_EQ(sum.sum, want.sum) << vocab << " " << trial;
      int64_t detail = -1;
      const int32_t code = tree::row_check(sum, tree::kTargetValue, tree::kTargetSum, &detail);
      if (want.first_bad != tree::kNoIndex) {
        EXPECT_EQ(code, tree::kTargetValue);
        EXPECT_EQ(detail, want.first_bad);
      } else {
        EXPECT_EQ(code, tree::sum_ok(want.sum) ? tree::kOk : tree::kTargetSum);
        EXPECT_EQ(detail, want.sum);
      }
    }
  }
}

TEST(TreeChunks, ChildWithToken) {
  // Root 0 with children 1 (token 7) and 3 (token 9); node 2 (token 9) is a child of 1.
  const int64_t parent[4] = {-1, 0, 1, 0};
  const int64_t tokens[4] = {5, 7, 9, 9};
  EXPECT_EQ(tree::child_with_token(parent, tokens, 4, 0, 9), 3);
  EXPECT_EQ(tree::child_with_token(parent, tokens, 4, 0, 7), 1);
  EXPECT_EQ(tree::child_with_token(parent, tokens, 3, 0, 9), -1);  // node 3 is past num_nodes
  EXPECT_EQ(tree::child_with_token(parent, tokens, 4, 1, 9), 2);
  EXPECT_EQ(tree::child_with_token(parent, tokens, 4, 2, 9), -1);
  EXPECT_TRUE(tree::is_child_token(parent, tokens, 4, 0, 7));
  EXPECT_FALSE(tree::is_child_token(parent, tokens, 4, 0, 5));
}
