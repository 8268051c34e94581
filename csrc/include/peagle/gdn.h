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
#pragma once

#include <cmath>
#include <cstdint>

#include "peagle/common.h"

namespace peagle {
namespace gdn {

constexpr int kMaxNodes = 64;        // ancestor sets are 64-bit masks
constexpr int kMaxConvWidth = 64;    // conv windows live in a fixed-size array on the GPU
constexpr float kL2NormEps = 1e-6f;  // as FLA / transformers: x * rsqrt(sum(x^2) + eps)

// Element strides of a [B, n, H, D] (or pool [P, HV, K, V]) tensor whose last dim is contiguous: the row of
// (b, i, h) starts at at(b, i, h). The strided q/k/v splits of a fused projection (vLLM, FLA) need no copy.
struct RowStrides {
  int64_t outer, middle, inner;
  PEAGLE_HD int64_t at(int64_t b, int64_t i, int64_t h) const { return b * outer + i * middle + h * inner; }
};

// Validates a tree's parent array and derives, per node, its ancestor-or-self bitmask, its depth and the cumulative
// gate G. Returns the first bad node index, or -1 when the tree is valid (parent[i] in [-1, i)).
template <typename Index>
PEAGLE_HD int build_tree(const Index* parent, int n, const float* g, int64_t g_stride, uint64_t* anc, int* depth,
                         float* gate_sum) {
  for (int i = 0; i < n; ++i) {
    const int64_t p = static_cast<int64_t>(parent[i]);
    if (p < -1 || p >= i) return i;
    const float gi = g == nullptr ? 0.0f : g[i * g_stride];
    const uint64_t self = uint64_t{1} << i;
    if (p < 0) {
      anc[i] = self;
      if (depth != nullptr) depth[i] = 0;
      if (gate_sum != nullptr) gate_sum[i] = gi;
    } else {
      anc[i] = anc[p] | self;
      if (depth != nullptr) depth[i] = depth[p] + 1;
      if (gate_sum != nullptr) gate_sum[i] = gate_sum[p] + gi;
    }
  }
  return -1;
}

// 1 / sqrt(sum x^2 + eps) when l2-normalising, else 1.
PEAGLE_HD float inv_l2(float sum_sq, bool use_l2norm) { return use_l2norm ? 1.0f / sqrtf(sum_sq + kL2NormEps) : 1.0f; }

// Forward substitution and outputs of the tree delta rule for value columns [c0, c1).
//   kk[i * n + j] = k_i . k_j and qk[i * n + j] = q_i . k_j (only j in anc(i) + {i} is read),
//   v: row i at v + i * ldv (fp32), beta[i], gate_sum[i] = G_i.
//   u: on entry row i holds S0^T k_i, on exit u_i.  o: on entry row i holds S0^T q_i, on exit o_i.
PEAGLE_HD void tree_delta_columns(int n, const uint64_t* anc, const float* gate_sum, const float* beta, const float* kk,
                                  const float* qk, const float* v, int64_t ldv, float* u, int64_t ldu, float* o,
                                  int64_t ldo, int c0, int c1) {
  for (int i = 0; i < n; ++i) {
    const float gi = gate_sum[i];
    const float root = expf(gi);
    float* ui = u + i * ldu;
    float* oi = o + i * ldo;
    const float* vi = v + i * ldv;
    for (int c = c0; c < c1; ++c) ui[c] = vi[c] - root * ui[c];
    for (int c = c0; c < c1; ++c) oi[c] *= root;
    // Strict ancestors, in increasing index order (their u are final).
    uint64_t bits = anc[i] & ~(uint64_t{1} << i);
    while (bits != 0) {
#if defined(__CUDA_ARCH__)
      const int j = __ffsll(static_cast<long long>(bits)) - 1;
#else
      const int j = __builtin_ctzll(bits);
#endif
      bits &= bits - 1;
      const float decay = expf(gi - gate_sum[j]);
      const float a = decay * kk[i * n + j];
      const float b = decay * qk[i * n + j];
      const float* uj = u + j * ldu;
      for (int c = c0; c < c1; ++c) ui[c] -= a * uj[c];
      for (int c = c0; c < c1; ++c) oi[c] += b * uj[c];
    }
    const float bi = beta[i];
    const float self = qk[i * n + i];
    for (int c = c0; c < c1; ++c) {
      ui[c] *= bi;
      oi[c] += self * ui[c];
    }
  }
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
