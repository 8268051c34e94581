// Unit tests of the Gated DeltaNet tree math shared by the CPU and CUDA kernels (csrc/include/peagle/gdn.h): the
// closed form over a tree (build_tree, tree_coefficients, solve_delta_columns, output_columns) against the step-by-step
// delta-rule recurrence, and the conv1d windows of tree nodes against a walk over the root-to-node sequence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "peagle/gdn.h"

namespace {

namespace gdn = peagle::gdn;

// A random tree of n nodes: parent[i] in [-1, i), node 0 a root; some nodes start a new root (parent -1).
std::vector<int64_t> random_tree(int n, std::mt19937& rng) {
  std::vector<int64_t> parent(n, -1);
  for (int i = 1; i < n; ++i) {
    std::uniform_int_distribution<int> pick(-1, i - 1);
    parent[i] = pick(rng);
  }
  return parent;
}

struct GdnCase {
  int n, key_dim, value_dim;
  std::vector<int64_t> parent;
  std::vector<float> q, k, v, g, beta, s0;  // q [n, K] pre-scaled, k [n, K], v [n, V], g/beta [n], s0 [K, V]
};

GdnCase random_case(std::vector<int64_t> parent, int key_dim, int value_dim, std::mt19937& rng) {
  const int n = static_cast<int>(parent.size());
  GdnCase c{n, key_dim, value_dim, std::move(parent), {}, {}, {}, {}, {}, {}};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> gate(-1.0f, 0.0f), rate(0.05f, 1.0f);
  const float key_scale = 1.0f / std::sqrt(static_cast<float>(key_dim));
  auto fill = [&](std::vector<float>& x, size_t count, float scale) {
    x.resize(count);
    for (float& e : x) e = scale * normal(rng);
  };
  fill(c.q, static_cast<size_t>(n) * key_dim, key_scale);
  fill(c.k, static_cast<size_t>(n) * key_dim, key_scale);
  fill(c.v, static_cast<size_t>(n) * value_dim, 1.0f);
  fill(c.s0, static_cast<size_t>(key_dim) * value_dim, 0.5f);
  c.g.resize(n);
  c.beta.resize(n);
  for (int i = 0; i < n; ++i) {
    c.g[i] = gate(rng);
    c.beta[i] = rate(rng);
  }
  return c;
}

// The GDN recurrence node by node, in double, with an explicit state per node:
//   S = exp(g_i) S_parent (S0 at a root);  u_i = beta_i (v_i - S^T k_i);  S_i = S + k_i u_i^T;  o_i = S_i^T q_i.
void recurrence(const GdnCase& c, std::vector<double>& u, std::vector<double>& o) {
  const int n = c.n, K = c.key_dim, V = c.value_dim;
  std::vector<std::vector<double>> state(n, std::vector<double>(static_cast<size_t>(K) * V));
  u.assign(static_cast<size_t>(n) * V, 0.0);
  o.assign(static_cast<size_t>(n) * V, 0.0);
  for (int i = 0; i < n; ++i) {
    std::vector<double>& s = state[i];
    const double decay = std::exp(static_cast<double>(c.g[i]));
    for (int e = 0; e < K * V; ++e) s[e] = decay * (c.parent[i] < 0 ? c.s0[e] : state[c.parent[i]][e]);
    for (int col = 0; col < V; ++col) {
      double projection = 0.0;
      for (int r = 0; r < K; ++r) projection += s[r * V + col] * c.k[i * K + r];
      u[i * V + col] = c.beta[i] * (c.v[i * V + col] - projection);
    }
    for (int r = 0; r < K; ++r) {
      for (int col = 0; col < V; ++col) s[r * V + col] += c.k[i * K + r] * u[i * V + col];
    }
    for (int col = 0; col < V; ++col) {
      double out = 0.0;
      for (int r = 0; r < K; ++r) out += s[r * V + col] * c.q[i * K + r];
      o[i * V + col] = out;
    }
  }
}

float dot(const float* x, const float* y, int len) {
  float acc = 0.0f;
  for (int e = 0; e < len; ++e) acc += x[e] * y[e];
  return acc;
}

// The kernels' closed form: tree structure and gate sums, Gram entries, projections of S0, then forward substitution
// over value columns [c0, c1) (every column in one call, or split as the CUDA kernel splits them across threads).
void closed_form(const GdnCase& c, const std::vector<std::pair<int, int>>& column_ranges, std::vector<float>& u,
                 std::vector<float>& o) {
  const int n = c.n, K = c.key_dim, V = c.value_dim;
  std::vector<uint64_t> anc(n);
  std::vector<float> gate_sum(n);
  ASSERT_EQ(gdn::build_tree(c.parent.data(), n, c.g.data(), 1, anc.data(), nullptr, gate_sum.data()), -1);
  std::vector<float> kk(static_cast<size_t>(n) * n), qk(static_cast<size_t>(n) * n);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      kk[i * n + j] = dot(&c.k[i * K], &c.k[j * K], K);
      qk[i * n + j] = dot(&c.q[i * K], &c.k[j * K], K);
    }
  }
  u.assign(static_cast<size_t>(n) * V, 0.0f);
  o.assign(static_cast<size_t>(n) * V, 0.0f);
  for (int i = 0; i < n; ++i) {
    for (int r = 0; r < K; ++r) {
      for (int col = 0; col < V; ++col) {
        u[i * V + col] += c.k[i * K + r] * c.s0[r * V + col];
        o[i * V + col] += c.q[i * K + r] * c.s0[r * V + col];
      }
    }
  }
  const int tri = std::max(gdn::triangle_size(n), 1);
  std::vector<float> root(n), self(n), a(tri), b(tri);
  gdn::tree_coefficients(n, anc.data(), gate_sum.data(), kk.data(), qk.data(), root.data(), a.data(), b.data(),
                         self.data());
  const auto v_at = [&](int i, int col) { return c.v[i * V + col]; };
  for (const auto& [c0, c1] : column_ranges) {
    gdn::solve_delta_columns(n, anc.data(), root.data(), c.beta.data(), a.data(), v_at, u.data(), V, c0, c1);
    for (int i = 0; i < n; ++i) {
      gdn::output_columns(i, anc.data(), root.data(), b.data(), self.data(), u.data(), V, &o[i * V], c0, c1);
    }
  }
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t e = 0; e < got.size(); ++e) {
    ASSERT_NEAR(got[e], want[e], 1e-5 + 1e-5 * std::fabs(want[e])) << what << " entry " << e;
  }
}

TEST(GdnMath, BuildTreeDerivesAncestorsDepthsAndGateSums) {
  // Two roots: 0 -> {1, 2}, 1 -> 3 -> 4, 2 -> 5; 6 -> 7. Gates interleaved with another head (stride 2).
  const int64_t parent[] = {-1, 0, 0, 1, 3, 2, -1, 6};
  const float g[] = {-0.5f, 9.0f, -0.25f, 9.0f, -1.0f, 9.0f, -0.125f, 9.0f,
                     -2.0f, 9.0f, -4.0f,  9.0f, -0.5f, 9.0f, -1.5f,   9.0f};
  uint64_t anc[8];
  int depth[8];
  float gate_sum[8];
  ASSERT_EQ(gdn::build_tree(parent, 8, g, 2, anc, depth, gate_sum), -1);
  const uint64_t want_anc[] = {0b1, 0b11, 0b101, 0b1011, 0b11011, 0b100101, 0b1000000, 0b11000000};
  const int want_depth[] = {0, 1, 1, 2, 3, 2, 0, 1};
  const float want_sum[] = {-0.5f, -0.75f, -1.5f, -0.875f, -2.875f, -5.5f, -0.5f, -2.0f};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(anc[i], want_anc[i]) << i;
    EXPECT_EQ(depth[i], want_depth[i]) << i;
    EXPECT_EQ(gate_sum[i], want_sum[i]) << i;  // sums of dyadic numbers: exact
  }
  // Without gates the cumulative gate is not written; without depth only the masks are.
  ASSERT_EQ(gdn::build_tree(parent, 8, nullptr, 1, anc, nullptr, nullptr), -1);
  EXPECT_EQ(anc[4], want_anc[4]);
}

TEST(GdnMath, BuildTreeReturnsTheFirstBadNode) {
  uint64_t anc[4];
  const int64_t self_parent[] = {-1, 0, 2, 0};
  EXPECT_EQ(gdn::build_tree(self_parent, 4, nullptr, 1, anc, nullptr, nullptr), 2);
  const int32_t below_root[] = {-1, -2, 0, 0};
  EXPECT_EQ(gdn::build_tree(below_root, 4, nullptr, 1, anc, nullptr, nullptr), 1);
  const int64_t first[] = {0};
  EXPECT_EQ(gdn::build_tree(first, 1, nullptr, 1, anc, nullptr, nullptr), 0);
}

TEST(GdnMath, ClosedFormMatchesTheRecurrenceOnRandomTrees) {
  std::mt19937 rng(2024);
  struct Shape {
    int n, key_dim, value_dim;
  };
  const Shape shapes[] = {{1, 4, 3}, {5, 8, 6}, {17, 16, 8}, {40, 32, 16}, {64, 8, 4}};
  for (const Shape& shape : shapes) {
    const GdnCase c = random_case(random_tree(shape.n, rng), shape.key_dim, shape.value_dim, rng);
    std::vector<double> u_ref, o_ref;
    recurrence(c, u_ref, o_ref);
    std::vector<float> u, o;
    closed_form(c, {{0, c.value_dim}}, u, o);
    SCOPED_TRACE(testing::Message() << "n " << shape.n << " K " << shape.key_dim << " V " << shape.value_dim);
    expect_close(u, u_ref, "u");
    expect_close(o, o_ref, "o");
  }
}

TEST(GdnMath, ClosedFormOverAChainIsTheSequentialRecurrence) {
  // A chain (parent[i] = i - 1) is an ordinary token sequence: the chunked closed form must reproduce it.
  std::mt19937 rng(7);
  for (const int n : {2, 16, 64}) {
    std::vector<int64_t> chain(n);
    for (int i = 0; i < n; ++i) chain[i] = i - 1;
    const GdnCase c = random_case(chain, 16, 8, rng);
    std::vector<double> u_ref, o_ref;
    recurrence(c, u_ref, o_ref);
    std::vector<float> u, o;
    closed_form(c, {{0, c.value_dim}}, u, o);
    SCOPED_TRACE(testing::Message() << "chain of " << n);
    expect_close(u, u_ref, "u");
    expect_close(o, o_ref, "o");
  }
}

TEST(GdnMath, ClosedFormMatchesTheRecurrenceThroughFullForgets) {
  // g = -inf (exp = 0: the state is forgotten) and a huge finite g gave NaN / decay-1 closed forms before their
  // clamp to kMinLogDecay; the recurrence stays finite and exact. A forget at a root, in a chain and under a branch.
  std::mt19937 rng(11);
  const std::vector<int64_t> tree = {-1, 0, 1, 1, 3, 2, -1, 6, 7, 4};
  for (const float forget : {-INFINITY, -1e30f, -300.0f}) {
    for (const std::vector<int>& at : std::vector<std::vector<int>>{{0}, {1}, {3, 4}, {1, 2, 7}, {6, 8}}) {
      GdnCase c = random_case(tree, 8, 5, rng);
      for (const int i : at) c.g[i] = forget;
      std::vector<double> u_ref, o_ref;
      recurrence(c, u_ref, o_ref);
      std::vector<float> u, o;
      closed_form(c, {{0, c.value_dim}}, u, o);
      SCOPED_TRACE(testing::Message() << "g " << forget << " at " << at.size() << " nodes from " << at[0]);
      expect_close(u, u_ref, "u");
      expect_close(o, o_ref, "o");
    }
  }
  EXPECT_TRUE(std::isnan(gdn::summed_log_decay(NAN)));
  EXPECT_EQ(gdn::summed_log_decay(-0.5f), -0.5f);
  EXPECT_EQ(gdn::exp_rn(gdn::kMinLogDecay), 0.0f);
}

TEST(GdnMath, ColumnSplitsGiveTheSameBits) {
  // The CUDA kernel runs one value column per thread, the CPU kernel all columns at once: columns are independent.
  std::mt19937 rng(31);
  const GdnCase c = random_case(random_tree(23, rng), 8, 7, rng);
  std::vector<float> u_all, o_all, u_split, o_split;
  closed_form(c, {{0, 7}}, u_all, o_all);
  closed_form(c, {{3, 7}, {0, 1}, {1, 3}}, u_split, o_split);
  EXPECT_EQ(u_all, u_split);
  EXPECT_EQ(o_all, o_split);
}

TEST(GdnMath, ExpWithinTwoUlpsOverTheFloatRange) {
  // exp_rn is the kernels' own exp (the same bits on both backends): within 2 ulps of the exact value wherever the
  // result is a normal float, 0 below and infinity above the float range.
  for (float x = -87.0f; x < 88.7f; x += 0.00731f) {
    const double want = std::exp(static_cast<double>(x));
    const double ulp = std::nextafter(static_cast<float>(want), INFINITY) - static_cast<float>(want);
    ASSERT_LE(std::fabs(gdn::exp_rn(x) - want), 2.0 * ulp) << x;
  }
  EXPECT_EQ(gdn::exp_rn(0.0f), 1.0f);
  EXPECT_EQ(gdn::exp_rn(-200.0f), 0.0f);
  EXPECT_EQ(gdn::exp_rn(100.0f), INFINITY);
  EXPECT_TRUE(std::isnan(gdn::exp_rn(NAN)));
}

TEST(GdnMath, InverseL2NormAndSilu) {
  EXPECT_EQ(gdn::inv_l2(4.0f, false), 1.0f);
  EXPECT_NEAR(gdn::inv_l2(4.0f, true), 0.5f, 1e-6f);
  EXPECT_NEAR(gdn::inv_l2(0.0f, true), 1.0f / std::sqrt(gdn::kL2NormEps), 1.0f);  // eps keeps zero rows finite
  for (const float x : {-20.0f, -1.5f, 0.0f, 0.3f, 4.0f}) {
    const double want = x / (1.0 + std::exp(-static_cast<double>(x)));
    EXPECT_NEAR(gdn::silu(x), want, 1e-6 + 1e-6 * std::fabs(want)) << x;
  }
}

// Window of width W at `node` by walking the whole sequence: the committed state columns 0..W-2 (oldest first,
// encoded -(s + 1)), then the root-to-node path; the window is its last W entries.
std::vector<int> window_by_sequence(const std::vector<int64_t>& parent, int node, int width) {
  std::vector<int> path;
  for (int cur = node; cur >= 0; cur = static_cast<int>(parent[cur])) path.insert(path.begin(), cur);
  std::vector<int> sequence;
  for (int s = 0; s < width - 1; ++s) sequence.push_back(-(s + 1));
  sequence.insert(sequence.end(), path.begin(), path.end());
  return std::vector<int>(sequence.end() - width, sequence.end());
}

TEST(GdnMath, ConvWindowIsTheTailOfTheRootToNodeSequence) {
  std::mt19937 rng(11);
  for (const int width : {2, 3, 4, 6}) {
    const std::vector<int64_t> parent = random_tree(30, rng);
    for (int node = 0; node < 30; ++node) {
      std::vector<int> src(width, 12345);
      ASSERT_TRUE(gdn::conv_window(parent.data(), node, width, src.data()));
      EXPECT_EQ(src, window_by_sequence(parent, node, width)) << "width " << width << " node " << node;
    }
  }
  // Hand-picked: chain 0 -> 1 -> 2, width 4: node 2 reads state column 2 (the newest) then nodes 0, 1, 2.
  const int64_t chain[] = {-1, 0, 1};
  int src[4];
  ASSERT_TRUE(gdn::conv_window(chain, 2, 4, src));
  EXPECT_EQ(std::vector<int>(src, src + 4), (std::vector<int>{-3, 0, 1, 2}));
  ASSERT_TRUE(gdn::conv_window(chain, 0, 4, src));
  EXPECT_EQ(std::vector<int>(src, src + 4), (std::vector<int>{-1, -2, -3, 0}));
}

TEST(GdnMath, ConvWindowRefusesABrokenParentChain) {
  const int64_t forward[] = {-1, 2, 0};  // node 1 names a later parent
  int src[4];
  EXPECT_FALSE(gdn::conv_window(forward, 1, 4, src));
  const int64_t below[] = {-1, -3};
  EXPECT_FALSE(gdn::conv_window(below, 1, 4, src));
}

}  // namespace
