// Harness decision math (cost-aware dynamic drafting), shared by the CPU and CUDA kernels of harness_decide and
// mirrored operation for operation by the reference in peagle/ops/harness.py. No torch includes.
//
// Goal. A round drafts a tree, verifies it in one target forward and emits the accepted drafts plus one token. With
// E = the expected number of accepted drafts, T_draft the drafting time and T_verify(N) the target's time for N tree
// nodes (root included), the round emits (1 + E) tokens in (T_draft + T_verify(N)) seconds; the harness maximises
//     R = (1 + E) / (T_draft + T_verify(N)).                                                                    (1)
//
// Expected acceptance. A drafted node is accepted iff every node on its path is, so the number of accepted drafts is
// the sum over nodes of the indicator "node accepted" and E = sum over nodes of P(node accepted). The drafter's path
// score p (product of the draft probabilities along the path) estimates that probability; it is calibrated online by
// one scale per request,
//     c = clamp((observed + kPrior) / (predicted + kPrior), kMinScale, kMaxScale),                              (2)
// where observed / predicted are decayed sums of accepted drafts and of the E the harness predicted for the verified
// trees (kPrior pseudo-rounds of perfect calibration keep c near 1 until evidence accumulates). A node contributes
//     s = min(1, c * p).                                                                                        (3)
//
// Depth decision (autoregressive drafters, EAGLE-2-style trees). Before depth d's nodes are added, the request has
// drafted N nodes (root included) with expected acceptance E in T seconds of drafting; its current ratio is
// R0 = (1 + E) / (T + V[N]) with V[n] = T_verify(n). The candidates are the children of the frontier (their path
// scores p, known from the last drafter forward). Adding the best w of them (by p; ties to the smaller index) and
// running the drafter on them costs t_d(w) (the cost-table row of this depth) and gives
//     R(w) = (1 + (E + S_w)) / ((T + t_d(w)) + V[N + w]),   S_w = s_(1) + ... + s_(w) in descending order of p.  (4)
// The chosen width is the first w of the table's widths (ascending) with the largest R(w) among those with R(w) > R0;
// when none beats R0 the request stops (width 0) - another depth would lower the expected tokens per second. Since s
// is non-increasing along the descending order, S_w is concave in w, so the table's widths cover the useful choices
// without searching every w. go = some request has not stopped.
//
// Verify budget. Path scores never grow along a path (probabilities <= 1), so the best n nodes by score with ties to
// the smaller index always contain their parents; the budget maximises (1) over n with E = S_(n-1) (the root is not a
// draft): see harness_budget in peagle/decode/harness/policy.py (same formula, vectorised).
//
// Bit-for-bit agreement. Every quantity is a float64 sum, product or quotient evaluated in the order written in (2)-(4)
// (S_w sequentially from the best candidate). CUDA would contract a * b + c into one fused multiply-add with one
// rounding instead of two; mul_rn / add_rn below forbid that, so the device computes the same bits as the host and as
// torch.
#pragma once

#include <cmath>
#include <cstdint>

#include "peagle/common.h"

namespace peagle {
namespace harness {

constexpr double kPrior = 2.0;  // pseudo-rounds of perfect calibration in (2)
constexpr double kMinScale = 0.125;
constexpr double kMaxScale = 4.0;

PEAGLE_HD double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

PEAGLE_HD double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// (2): the calibration scale of a request from its decayed observed / predicted accepted drafts.
PEAGLE_HD double calibration_scale(double observed, double predicted) {
  const double c = add_rn(observed, kPrior) / add_rn(predicted, kPrior);
  return c < kMinScale ? kMinScale : (c > kMaxScale ? kMaxScale : c);
}

// A candidate path score takes part unless it is padding (-inf) or NaN.
PEAGLE_HD bool candidate(double p) { return p >= 0.0; }

// Index of the best candidate after (prev_score, prev_index) in the order "score descending, then index ascending";
// -1 when none is left. prev_index = -1 starts at the best one.
PEAGLE_HD int64_t next_best(const double* p, int64_t count, double prev_score, int64_t prev_index) {
  int64_t best = -1;
  for (int64_t i = 0; i < count; ++i) {
    const double v = p[i];
    if (!candidate(v)) continue;
    const bool after = prev_index < 0 || v < prev_score || (v == prev_score && i > prev_index);
    if (after && (best < 0 || v > p[best])) best = i;  // ties keep the smaller index (first seen)
  }
  return best;
}

struct Running {
  double expected;    // E: expected accepted drafts of the nodes drafted so far
  double draft_time;  // T: drafting seconds spent so far this round
  int64_t nodes;      // N: nodes drafted so far, root included
};

struct Decision {
  int32_t width;  // nodes added at this depth (0: stop)
  Running next;   // the running state after adding them
};

// (4) for one request. scores [count] are the candidates' raw path scores; widths [num_widths] ascending, >= 1;
// draft_cost [num_widths] = t_d(w); verify_cost [max_nodes + 1] = V[n] (n nodes, root included; V[0] unused).
PEAGLE_HD Decision decide(const double* scores, int64_t count, double scale, const int64_t* widths,
                          const double* draft_cost, int64_t num_widths, const double* verify_cost, int64_t max_nodes,
                          Running state) {
  Decision out{0, state};
  if (state.nodes > max_nodes) return out;
  double best = add_rn(1.0, state.expected) / add_rn(state.draft_time, verify_cost[state.nodes]);
  double sum = 0.0, prev_score = 0.0;
  int64_t taken = 0, prev_index = -1;
  for (int64_t j = 0; j < num_widths; ++j) {
    const int64_t w = widths[j];
    if (state.nodes + w > max_nodes) break;
    while (taken < w) {
      const int64_t i = next_best(scores, count, prev_score, prev_index);
      if (i < 0) return out;  // fewer candidates than w (widths ascend: no later width fits either)
      const double s = mul_rn(scale, scores[i]);
      sum = add_rn(sum, s < 1.0 ? s : 1.0);
      prev_score = scores[i];
      prev_index = i;
      ++taken;
    }
    const double e = add_rn(state.expected, sum);
    const double t = add_rn(state.draft_time, draft_cost[j]);
    const double r = add_rn(1.0, e) / add_rn(t, verify_cost[state.nodes + w]);
    if (r > best) {
      best = r;
      out = Decision{static_cast<int32_t>(w), Running{e, t, state.nodes + w}};
    }
  }
  return out;
}

}  // namespace harness
}  // namespace peagle
