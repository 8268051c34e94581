// Gated DeltaNet (GDN) tree math, shared by the CPU and CUDA kernels. No torch includes.
//
// Per value head, state S [K, V] fp32, token t:  S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;
// o_t = S^T (scale q_t). In a draft tree node i starts from its parent's state and node 0 (and any node whose parent
// is -1) from the committed state S0.
//
// Closed form over a tree (one "chunk" of n <= 64 nodes). With G_i = sum of g over the root-to-i path (inclusive) and
// anc(i) the strict ancestors of i, the state after node i is
//     S_i = exp(G_i) S0 + sum_{j in anc(i) + {i}} exp(G_i - G_j) k_j u_j^T,
// so the delta values u solve a unit lower-triangular system (parent[i] < i) by forward substitution:
//     u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j in anc(i)} exp(G_i - G_j) (k_i . k_j) u_j)
// and the outputs are
//     o_i = exp(G_i) S0^T q_i + sum_{j in anc(i) + {i}} exp(G_i - G_j) (q_i . k_j) u_j      (q pre-scaled).
// Verification therefore reads S0 once per head and never materialises a per-node state; commit rebuilds the state
// of the last accepted node a from S0 and the u of its path (the closed form above with i = a).
// Decay factors are always exp(G_i - G_j) with j an ancestor of i, i.e. <= 1 for g <= 0: nothing overflows.
// A full forget (g = -inf, or any g whose exp is 0 in fp32) enters the sums as kMinLogDecay: with g = -inf itself
// every G below it would be -inf and their differences -inf + inf = NaN, and with a huge finite g (-1e30) they would
// all round to the same value (decay 1 instead of exp(sum of the g between)). exp(kMinLogDecay) is 0 like exp(g), so
// nothing above the forget reaches below it, yet 0 * NaN still carries a NaN from above, as the recurrence does.
#pragma once

#include <cmath>
#include <cstdint>

#include "peagle/common.h"
#include "peagle/rounding.h"

namespace peagle {
namespace gdn {

constexpr int kMaxNodes = 64;        // ancestor sets are 64-bit masks
constexpr int kMaxConvWidth = 64;    // conv windows live in a fixed-size array on the GPU
constexpr float kL2NormEps = 1e-6f;  // as FLA / transformers: x * rsqrt(sum(x^2) + eps)
// Log decays below this are a full forget: exp_rn is 0 below -104, and sums near -105 keep 2^-17 absolute precision.
constexpr float kMinLogDecay = -105.0f;

// Element strides of a [B, n, H, D] (or pool [P, HV, K, V]) tensor whose last dim is contiguous: the row of
// (b, i, h) starts at at(b, i, h). The strided q/k/v splits of a fused projection (vLLM, FLA) need no copy.
struct RowStrides {
  int64_t outer, middle, inner;
  PEAGLE_HD int64_t at(int64_t b, int64_t i, int64_t h) const { return b * outer + i * middle + h * inner; }
};

// Exact fp32 arithmetic (peagle/rounding.h), so that the CPU and CUDA kernels compute the same bits: every operation
// of the math below goes through these.
using ::peagle::add_rn;
using ::peagle::div_rn;
using ::peagle::fma_rn;
using ::peagle::mul_rn;
using ::peagle::sqrt_rn;
using ::peagle::sub_rn;

// One step of every sum over K: sums run in increasing index order from 0 as acc = mac(acc, a, b).
PEAGLE_HD float mac(float acc, float a, float b) { return add_rn(acc, mul_rn(a, b)); }
// The same step in the sums over a state's K rows (the projections S0^T k and S0^T q), which with the state steps below
// are the bulk of the arithmetic: one fused multiply-add, one instruction where two separately rounded ones were.
PEAGLE_HD float state_mac(float acc, float a, float b) { return fma_rn(a, b, acc); }

// 2^e as a float for e in [-126, 127].
PEAGLE_HD float pow2(int e) {
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// exp(x) within ~2 ulp from the operations above only (identical on both backends): x = k ln2 + r with |r| <= ln2 / 2
// (ln2 split in two so that k * kLn2Hi is exact), exp(r) by its Taylor series to r^7, then times 2^k in two steps.
PEAGLE_HD float exp_rn(float x) {
  if (!(x == x)) return x;  // NaN
  if (x < -104.0f) return 0.0f;
  if (x > 89.0f) return HUGE_VALF;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // 355 / 512: 9 significant bits
  constexpr float kLn2Lo = -2.12194440e-4f;
  const float kf = rintf(mul_rn(x, kLog2e));
  const float r = sub_rn(sub_rn(x, mul_rn(kf, kLn2Hi)), mul_rn(kf, kLn2Lo));
  float p = 1.0f / 5040.0f;
  p = add_rn(mul_rn(p, r), 1.0f / 720.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 120.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 24.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 6.0f);
  p = add_rn(mul_rn(p, r), 0.5f);
  p = add_rn(mul_rn(p, r), 1.0f);
  p = add_rn(mul_rn(p, r), 1.0f);
  const int k = static_cast<int>(kf);  // in [-151, 129]: each half of 2^k is a normal float
  const int half = k / 2;
  return mul_rn(mul_rn(p, pow2(half)), pow2(k - half));
}

// A log decay as it enters the gate sums: at least kMinLogDecay (see the header comment); NaN stays NaN.
PEAGLE_HD float summed_log_decay(float g) { return g < kMinLogDecay ? kMinLogDecay : g; }

// Validates a tree's parent array and derives, per node, its ancestor-or-self bitmask, its depth and the cumulative
// gate G (of the summed log decays). Returns the first bad node index, or -1 when the tree is valid (parent[i] in
// [-1, i)).
template <typename Index>
PEAGLE_HD int build_tree(const Index* parent, int n, const float* g, int64_t g_stride, uint64_t* anc, int* depth,
                         float* gate_sum) {
  for (int i = 0; i < n; ++i) {
    const int64_t p = static_cast<int64_t>(parent[i]);
    if (p < -1 || p >= i) return i;
    const float gi = g == nullptr ? 0.0f : summed_log_decay(g[i * g_stride]);
    const uint64_t self = uint64_t{1} << i;
    if (p < 0) {
      anc[i] = self;
      if (depth != nullptr) depth[i] = 0;
      if (gate_sum != nullptr) gate_sum[i] = gi;
    } else {
      anc[i] = anc[p] | self;
      if (depth != nullptr) depth[i] = depth[p] + 1;
      if (gate_sum != nullptr) gate_sum[i] = add_rn(gate_sum[p], gi);
    }
  }
  return -1;
}

// The kernels' operation order (both backends, bit for bit). Per request and q/k head, over raw (unnormalised) fp32
// rows q_i, k_i:
//   norms      f^q_i = inv_l2(sum_r q_i[r]^2) * scale,  f^k_i = inv_l2(sum_r k_i[r]^2)            (sums: mac)
//   Gram       qk_ij = (sum_r q_i[r] k_j[r]) * (f^q_i * f^k_j),  kk_ij = (sum_r k_i[r] k_j[r]) * (f^k_i * f^k_j)
// per value head (gates G, beta, state S0):
//   projections  pk_i[c] = (sum_r k_i[r] S0[r, c]) * f^k_i,  pq_i[c] = (sum_r q_i[r] S0[r, c]) * f^q_i
//   coefficients root_i = exp(G_i), for strict ancestors j of i: a_ij = exp(G_i - G_j) kk_ij, b_ij = exp(G_i - G_j)
//   qk_ij then solve_delta_columns and output_columns below.

// 1 / sqrt(sum x^2 + eps) when l2-normalising, else 1.
PEAGLE_HD float inv_l2(float sum_sq, bool use_l2norm) {
  return use_l2norm ? div_rn(1.0f, sqrt_rn(add_rn(sum_sq, kL2NormEps))) : 1.0f;
}

// f^q_i (scale = the q scale) or f^k_i (scale = 1) from the row's sum of squares.
PEAGLE_HD float row_factor(float sum_sq, bool use_l2norm, float scale) {
  return mul_rn(inv_l2(sum_sq, use_l2norm), scale);
}

PEAGLE_HD float gram_entry(float raw, float factor_i, float factor_j) {
  return mul_rn(raw, mul_rn(factor_i, factor_j));
}

// Strict ancestor pairs (j < i) are stored in a packed lower triangle.
PEAGLE_HD int triangle_index(int i, int j) { return i * (i - 1) / 2 + j; }
PEAGLE_HD int triangle_size(int n) { return n * (n - 1) / 2; }

PEAGLE_HD float decayed(float gate_i, float gate_j, float gram) { return mul_rn(exp_rn(sub_rn(gate_i, gate_j)), gram); }

// The coefficients of one value head from the normalised Gram matrices (full n x n, row i = node i): root, a and b in
// packed triangles (strict ancestor entries only), self[i] = qk_ii. The CUDA kernel computes the same entries in
// parallel with `decayed`.
PEAGLE_HD void tree_coefficients(int n, const uint64_t* anc, const float* gate_sum, const float* kk, const float* qk,
                                 float* root, float* a, float* b, float* self) {
  for (int i = 0; i < n; ++i) {
    root[i] = exp_rn(gate_sum[i]);
    self[i] = qk[i * n + i];
    for (int j = 0; j < i; ++j) {
      if (((anc[i] >> j) & 1u) == 0) continue;
      a[triangle_index(i, j)] = decayed(gate_sum[i], gate_sum[j], kk[i * n + j]);
      b[triangle_index(i, j)] = decayed(gate_sum[i], gate_sum[j], qk[i * n + j]);
    }
  }
}

PEAGLE_HD int lowest_bit(uint64_t bits) {
#if defined(__CUDA_ARCH__)
  return __ffsll(static_cast<long long>(bits)) - 1;
#else
  return __builtin_ctzll(bits);
#endif
}

// Forward substitution of the delta values for value columns [c0, c1):
//   u_i = beta_i (v_i - root_i pk_i - sum_{j in anc(i), increasing} a_ij u_j).
// u: on entry row i (at u + i * ldu) holds pk_i, on exit u_i. v_at(i, c) returns v_i[c] as float.
template <typename LoadV>
PEAGLE_HD void solve_delta_columns(int n, const uint64_t* anc, const float* root, const float* beta, const float* a,
                                   LoadV v_at, float* u, int64_t ldu, int c0, int c1) {
  for (int i = 0; i < n; ++i) {
    float* ui = u + i * ldu;
    for (int c = c0; c < c1; ++c) ui[c] = sub_rn(v_at(i, c), mul_rn(root[i], ui[c]));
    for (uint64_t bits = anc[i] & ~(uint64_t{1} << i); bits != 0; bits &= bits - 1) {
      const int j = lowest_bit(bits);
      const float aij = a[triangle_index(i, j)];
      const float* uj = u + j * ldu;
      for (int c = c0; c < c1; ++c) ui[c] = sub_rn(ui[c], mul_rn(aij, uj[c]));
    }
    for (int c = c0; c < c1; ++c) ui[c] = mul_rn(ui[c], beta[i]);
  }
}

// Output of node i for value columns [c0, c1), once every u is final:
//   o_i = root_i pq_i + sum_{j in anc(i), increasing} b_ij u_j + self_i u_i.
// o_i: on entry pq_i, on exit o_i.
PEAGLE_HD void output_columns(int i, const uint64_t* anc, const float* root, const float* b, const float* self,
                              const float* u, int64_t ldu, float* o_i, int c0, int c1) {
  for (int c = c0; c < c1; ++c) o_i[c] = mul_rn(o_i[c], root[i]);
  for (uint64_t bits = anc[i] & ~(uint64_t{1} << i); bits != 0; bits &= bits - 1) {
    const int j = lowest_bit(bits);
    const float bij = b[triangle_index(i, j)];
    const float* uj = u + j * ldu;
    for (int c = c0; c < c1; ++c) o_i[c] = add_rn(o_i[c], mul_rn(bij, uj[c]));
  }
  const float* ui = u + i * ldu;
  for (int c = c0; c < c1; ++c) o_i[c] = add_rn(o_i[c], mul_rn(self[i], ui[c]));
}

// Commit: the state after the last accepted node a, element (r, c), from the committed S0 and the path's k and u:
//   S[r, c] = root_a S0[r, c] + sum_{j on the path, increasing} (coef_j k_j[r]) u_j[c],  coef_j = exp(G_a - G_j) f^k_j.
PEAGLE_HD float commit_coefficient(float gate_a, float gate_j, float factor_k) {
  return mul_rn(exp_rn(sub_rn(gate_a, gate_j)), factor_k);
}
PEAGLE_HD float commit_step(float acc, float coef, float k, float u) { return fma_rn(mul_rn(coef, k), u, acc); }

// Node states written into slots (gdn_tree_verify_slots): the state after node i from its parent's state S_p (S0 for
// a root), one step of the recurrence with the u the verification solved,
//   S_i[r, c] = exp(g_i) S_p[r, c] + (f^k_i k_i[r]) u_i[c],
// i.e. exactly gdn_commit of the single node i on S_p (its root decay exp(G) with G = the summed log decay of g_i,
// its coefficient exp(0) f^k_i = f^k_i), so a chain written node by node equals one gdn_commit per position.
PEAGLE_HD float node_decay(float g) { return exp_rn(summed_log_decay(g)); }
// row_coef = mul_rn(f^k_i, k_i[r]), computed once per row; the sum is fused as commit_step's (so it equals gdn_commit).
PEAGLE_HD float state_step(float parent_state, float decay, float row_coef, float u) {
  return fma_rn(row_coef, u, mul_rn(decay, parent_state));
}

// Window of a causal conv1d of width W at `node` of a tree: src[w] for w in [0, W) (oldest first) is the node whose
// input sits there (>= 0), or -(s + 1) for column s of the committed conv state [.., W - 1] (s = W - 2 is the newest).
// Returns false (src incomplete) when a parent on the way breaks parent[i] in [-1, i): callers that skipped the host
// validation never read out of bounds.
template <typename Index>
PEAGLE_HD bool conv_window(const Index* parent, int node, int width, int* src) {
  int cur = node;
  int w = width - 1;
  for (; w >= 0 && cur >= 0; --w) {
    src[w] = cur;
    const int64_t p = static_cast<int64_t>(parent[cur]);
    if (p < -1 || p >= cur) return false;
    cur = static_cast<int>(p);
  }
  // The remaining (older) taps read the committed state from its newest column backwards.
  for (int s = width - 2; w >= 0; --w, --s) src[w] = -(s + 1);
  return true;
}

PEAGLE_HD float silu(float x) { return x / (1.0f + expf(-x)); }

}  // namespace gdn
}  // namespace peagle
