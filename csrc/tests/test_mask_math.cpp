// Unit tests of the P-EAGLE mask math shared by the CPU and CUDA kernels (csrc/include/peagle/mask.h): the predicate
// on hand-picked element pairs, and the block classification against the predicate evaluated on every pair.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "peagle/mask.h"

namespace {

namespace mask = peagle::mask;
constexpr int64_t kNoWindow = mask::kNoWindow;

// Query (aq, dq) and key (ak, dk), both in document `doc`.
bool same_doc(int64_t aq, int64_t dq, int64_t ak, int64_t dk, int64_t window = kNoWindow, int64_t doc = 0) {
  return mask::allowed(aq, dq, doc, ak, dk, doc, window);
}

TEST(MaskPredicate, DocumentsAndPadding) {
  EXPECT_TRUE(mask::allowed(5, 0, 2, 3, 0, 2, kNoWindow));
  EXPECT_FALSE(mask::allowed(5, 0, 2, 3, 0, 1, kNoWindow));    // earlier token of another document
  EXPECT_FALSE(mask::allowed(5, 1, 2, 5, 0, 3, kNoWindow));    // own anchor, but documents differ
  EXPECT_FALSE(mask::allowed(5, 0, -1, 5, 0, -1, kNoWindow));  // padding attends to nothing, not even itself
  EXPECT_FALSE(mask::allowed(5, 0, -1, 3, 0, 0, kNoWindow));
  EXPECT_FALSE(mask::allowed(5, 0, 0, 3, 0, -1, kNoWindow));  // nor is it attended to
}

TEST(MaskPredicate, DepthZeroIsCausal) {
  EXPECT_TRUE(same_doc(5, 0, 0, 0));
  EXPECT_TRUE(same_doc(5, 0, 4, 0));
  EXPECT_TRUE(same_doc(5, 0, 5, 0));  // itself
  EXPECT_FALSE(same_doc(5, 0, 6, 0));
  EXPECT_FALSE(same_doc(5, 0, 4, 1));  // a depth-0 query sees no deeper element, not even of an earlier anchor
  EXPECT_FALSE(same_doc(5, 0, 5, 1));  // nor the deeper elements of its own chain
}

TEST(MaskPredicate, DeepElementsSeeTheirContextAndOwnChain) {
  // Element (5, 2) predicts position 7 from the real tokens up to 5 and the mask elements (5, 1), (5, 2).
  EXPECT_TRUE(same_doc(5, 2, 5, 0));
  EXPECT_TRUE(same_doc(5, 2, 2, 0));
  EXPECT_TRUE(same_doc(5, 2, 5, 1));
  EXPECT_TRUE(same_doc(5, 2, 5, 2));   // itself
  EXPECT_FALSE(same_doc(5, 2, 5, 3));  // deeper on the own chain
  EXPECT_FALSE(same_doc(5, 2, 6, 0));  // real tokens after the anchor, though a + d reaches past them
  EXPECT_FALSE(same_doc(5, 2, 7, 0));
  EXPECT_FALSE(same_doc(5, 2, 4, 1));  // another chain, even one of an earlier anchor
  EXPECT_FALSE(same_doc(5, 2, 4, 2));
  EXPECT_FALSE(same_doc(5, 2, 6, 1));
}

TEST(MaskPredicate, SlidingWindowEdges) {
  // Depth 0 with window W: keys a_k in (a_q - W, a_q].
  EXPECT_TRUE(same_doc(10, 0, 10, 0, 4));
  EXPECT_TRUE(same_doc(10, 0, 7, 0, 4));
  EXPECT_FALSE(same_doc(10, 0, 6, 0, 4));
  EXPECT_TRUE(same_doc(10, 0, 10, 0, 1));  // W = 1: only itself
  EXPECT_FALSE(same_doc(10, 0, 9, 0, 1));
  // Depth d counts as position a + d: keys a_k in (a_q + d_q - W, a_q].
  EXPECT_TRUE(same_doc(10, 2, 9, 0, 4));
  EXPECT_FALSE(same_doc(10, 2, 8, 0, 4));
  // The own chain is never cut by the window: (10, 3) with W = 1 keeps its anchor and its chain.
  EXPECT_TRUE(same_doc(10, 3, 10, 0, 1));
  EXPECT_TRUE(same_doc(10, 3, 10, 2, 1));
  EXPECT_FALSE(same_doc(10, 3, 9, 0, 1));
  // No window reaches back to the document start.
  EXPECT_TRUE(same_doc(1000, 3, 0, 0));
}

TEST(MaskPredicate, CausalLowIsTheWindowsInclusiveBound) {
  EXPECT_EQ(mask::causal_low(10, 2, 4), 9);  // a_k > 10 + 2 - 4 = 8
  EXPECT_LT(mask::causal_low(10, 2, kNoWindow), -(int64_t{1} << 60));
  // allowed_from with a sliced bound: (10, 2) may see depth-0 anchors [7, 10] and its own chain.
  EXPECT_TRUE(mask::allowed_from(10, 2, 0, 7, 7, 0, 0));
  EXPECT_FALSE(mask::allowed_from(10, 2, 0, 7, 6, 0, 0));
  EXPECT_TRUE(mask::allowed_from(10, 2, 0, 20, 10, 1, 0));  // the own chain ignores the bound
  EXPECT_FALSE(mask::allowed_from(10, 2, 0, 7, 7, 0, 1));   // documents still apply
}

TEST(MaskBlocks, AnyInRangeFindsValuesInAClosedInterval) {
  const int64_t sorted[] = {2, 5, 5, 9, mask::kBig};
  EXPECT_TRUE(mask::any_in_range(sorted, 4, 5, 5));
  EXPECT_TRUE(mask::any_in_range(sorted, 4, 0, 2));
  EXPECT_TRUE(mask::any_in_range(sorted, 4, 9, 100));
  EXPECT_TRUE(mask::any_in_range(sorted, 4, 6, 9));
  EXPECT_FALSE(mask::any_in_range(sorted, 4, 6, 8));
  EXPECT_FALSE(mask::any_in_range(sorted, 4, 10, 100));  // the padding entry past count is not read
  EXPECT_FALSE(mask::any_in_range(sorted, 4, 0, 1));
  EXPECT_FALSE(mask::any_in_range(sorted, 0, 0, 100));
}

// A packed training row as COD lays it out: every position at depth 0, then a random subset of anchors per depth.
// Documents of random lengths, the tail padding (-1).
struct Elements {
  std::vector<int64_t> anchors, depths, docs;  // docs: document of each element's anchor
};

Elements random_elements(int positions, int num_depths, std::mt19937& rng) {
  std::vector<int64_t> position_doc(positions, -1);
  std::uniform_int_distribution<int> length(3, 20);
  const int used = positions - positions / 8;  // the last eighth is padding
  for (int start = 0, doc = 0; start < used; ++doc) {
    const int end = std::min(used, start + length(rng));
    for (int t = start; t < end; ++t) position_doc[t] = doc;
    start = end;
  }
  Elements e;
  std::bernoulli_distribution keep(0.4);
  for (int d = 0; d < num_depths; ++d) {
    for (int a = 0; a < positions; ++a) {
      if (d > 0 && !keep(rng)) continue;
      e.anchors.push_back(a);
      e.depths.push_back(d);
      e.docs.push_back(position_doc[a]);
    }
  }
  return e;
}

TEST(MaskBlocks, ClassificationIsExactInItsDirection) {
  // "empty" only when no pair of the two blocks is allowed, "full" only when every pair is; both must occur.
  std::mt19937 rng(77);
  int empty = 0, full = 0, partial = 0;
  for (const int64_t window : {kNoWindow, int64_t{5}, int64_t{16}}) {
    for (const int64_t block : {4, 8, 16}) {
      const Elements e = random_elements(96, 4, rng);
      const auto n = static_cast<int64_t>(e.anchors.size());
      const int64_t nb = (n + block - 1) / block;
      std::vector<int64_t> summary(nb * mask::kSummaryFields), sorted(nb * block, mask::kBig), lows(n);
      for (int64_t i = 0; i < n; ++i) lows[i] = mask::causal_low(e.anchors[i], e.depths[i], window);
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t begin = b * block, end = std::min(n, begin + block);
        mask::summarize(e.anchors.data(), e.depths.data(), e.docs.data(), lows.data(), begin, end,
                        &summary[b * mask::kSummaryFields]);
        int64_t count = 0;
        for (int64_t i = begin; i < end; ++i) {
          if (e.docs[i] != -1) sorted[b * block + count++] = e.anchors[i];
        }
        std::sort(sorted.begin() + b * block, sorted.begin() + b * block + count);
      }
      for (int64_t qb = 0; qb < nb; ++qb) {
        for (int64_t kb = 0; kb < nb; ++kb) {
          bool any = false, all = true;
          for (int64_t q = qb * block; q < std::min(n, (qb + 1) * block); ++q) {
            for (int64_t k = kb * block; k < std::min(n, (kb + 1) * block); ++k) {
              const bool ok =
                  mask::allowed(e.anchors[q], e.depths[q], e.docs[q], e.anchors[k], e.depths[k], e.docs[k], window);
              any |= ok;
              all &= ok;
            }
          }
          const int8_t kind = mask::classify(&summary[qb * mask::kSummaryFields], &summary[kb * mask::kSummaryFields],
                                             &sorted[qb * block]);
          SCOPED_TRACE(testing::Message() << "window " << window << " block " << block << " q " << qb << " kv " << kb);
          if (kind == mask::kEmpty) {
            ASSERT_FALSE(any);
            ++empty;
          } else if (kind == mask::kFull) {
            ASSERT_TRUE(all);
            ++full;
          } else {
            ASSERT_EQ(kind, mask::kPartial);
            ++partial;
          }
        }
      }
    }
  }
  EXPECT_GT(empty, 0);
  EXPECT_GT(full, 0);
  EXPECT_GT(partial, 0);
}

TEST(MaskBlocks, SummaryOfAShortBlockWithPadding) {
  // Elements (anchor, depth, doc): (3, 0, 1), (4, 0, -1), (2, 2, 1), (3, 1, 1) -> padding (4, 0) is not valid.
  const int64_t anchors[] = {3, 4, 2, 3};
  const int64_t depths[] = {0, 0, 2, 1};
  const int64_t docs[] = {1, -1, 1, 1};
  int64_t lows[4];
  for (int i = 0; i < 4; ++i) lows[i] = mask::causal_low(anchors[i], depths[i], 2);  // window 2: a + d - 1
  int64_t s[mask::kSummaryFields];
  mask::summarize(anchors, depths, docs, lows, 0, 4, s);
  EXPECT_EQ(s[mask::kCount], 4);
  EXPECT_EQ(s[mask::kValid], 3);
  EXPECT_EQ(s[mask::kAnchorMin], 2);
  EXPECT_EQ(s[mask::kAnchorMax], 3);
  EXPECT_EQ(s[mask::kDepthMin], 0);
  EXPECT_EQ(s[mask::kDepthMax], 2);
  EXPECT_EQ(s[mask::kLowMin], 2);
  EXPECT_EQ(s[mask::kLowMax], 3);
  EXPECT_EQ(s[mask::kDocMin], 1);
  EXPECT_EQ(s[mask::kDocMax], 1);
  EXPECT_EQ(s[mask::kRoot], 1);
  EXPECT_EQ(s[mask::kRootAnchorMin], 3);
  EXPECT_EQ(s[mask::kRootAnchorMax], 3);
  EXPECT_EQ(s[mask::kDeep], 2);
  EXPECT_EQ(s[mask::kDeepAnchorMin], 2);
  EXPECT_EQ(s[mask::kDeepAnchorMax], 3);
  EXPECT_EQ(s[mask::kDeepDepthMax], 2);
  // A block of padding only has no valid element and classifies as empty against anything.
  int64_t pad[mask::kSummaryFields];
  mask::summarize(anchors, depths, docs, lows, 1, 2, pad);
  EXPECT_EQ(pad[mask::kValid], 0);
  const int64_t sorted[] = {2, 3, 3};
  EXPECT_EQ(mask::classify(s, pad, sorted), mask::kEmpty);
  EXPECT_EQ(mask::classify(pad, s, sorted), mask::kEmpty);
}

}  // namespace
