// Harness decision math (cost-aware dynamic drafting), shared by the CPU and CUDA kernels of the harness ops and
// mirrored operation for operation by the references in peagle/ops/harness.py. No torch includes.
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
// Bit-for-bit agreement. Every quantity is a float64 sum, product, quotient or square root evaluated in the order
// written in (2)-(6) (S_w sequentially from the best candidate) through mul_rn / add_rn / div_rn / sqrt_rn
// (peagle/rounding.h), which keep CUDA from contracting a * b + c into one fused multiply-add, so the device computes
// the same bits as the host and as torch. The square root is IEEE's (correctly rounded) on both; torch's float64 sqrt
// on the CPU is not always (one ulp off for about 1% of inputs), so the reference of (6) takes Python's math.sqrt.
#pragma once

#include <cmath>
#include <cstdint>

#include "peagle/common.h"
#include "peagle/rounding.h"

namespace peagle {
namespace harness {

constexpr double kPrior = 2.0;  // pseudo-rounds of perfect calibration in (2)
constexpr double kMinScale = 0.125;
constexpr double kMaxScale = 4.0;

using ::peagle::add_rn;  // peagle/rounding.h
using ::peagle::div_rn;
using ::peagle::mul_rn;
using ::peagle::sqrt_rn;

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
  // Out-of-contract values (the CUDA op leaves them unchecked) stop instead of indexing outside verify_cost.
  if (state.nodes < 1 || state.nodes > max_nodes) return out;
  double best = add_rn(1.0, state.expected) / add_rn(state.draft_time, verify_cost[state.nodes]);
  double sum = 0.0, prev_score = 0.0;
  int64_t taken = 0, prev_index = -1;
  for (int64_t j = 0; j < num_widths; ++j) {
    const int64_t w = widths[j];
    if (w < 1) continue;
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

// P-EAGLE pass decision. One pass drafted D depths (cost pass[D - 1]) and the candidate tree holds its nodes with path
// scores p (node 0 = the root). For K' = 1 .. D, the nodes of depth <= K' in descending order of p (ties to the smaller
// index; at most M - 1 of them, M = max_nodes) give, for n = k + 1 nodes,
//     R_K'(k) = (1 + S_k) / (pass[K' - 1] + V[k + 1]),   S_k = s_(1) + ... + s_(k), s = min(1, c * p),          (5)
// the ratio (1) of a pass of depth K' verifying its best n nodes. The budget is 1 + the first k maximising R_D; the
// next round's depth is the first K' whose best R_K' is largest - or D + 1 (at most num_pass) when that K' is D and
// the budget keeps a node of depth D: the tree cannot show what a deeper pass would gain, so the harness tries one -
// and never below D - 1: one round's tree is a noisy sample of how deep the next round's accepted path goes, a depth
// more costs a pass little, and a pass too shallow caps the next round's acceptance (falling by one a round, as it
// grows, the depth follows the drafter's level instead of one round's luck).
// predicted = S_(budget - 1), the E of the budget's tree. Same order of evaluation as pass_budget in
// peagle/decode/harness/policy.py (S_k a running sum, sequential), so the results agree bit for bit.
constexpr int64_t kMaxPassDepth = 32;

struct PassDecision {
  int64_t budget;      // nodes to verify, root included
  int64_t next_depth;  // the next round's pass depth
  double predicted;    // S_(budget - 1)
};

// next_best over the drafted nodes of a candidate tree: index >= 1, a candidate score, 1 <= depth <= max_depth.
PEAGLE_HD int64_t next_drafted(const double* scores, const int64_t* depth, int64_t count, int64_t max_depth,
                               double prev_score, int64_t prev_index) {
  int64_t best = -1;
  for (int64_t j = 1; j < count; ++j) {
    const double v = scores[j];
    if (!candidate(v) || depth[j] < 1 || depth[j] > max_depth) continue;
    const bool after = prev_index < 0 || v < prev_score || (v == prev_score && j > prev_index);
    if (after && (best < 0 || v > scores[best])) best = j;
  }
  return best;
}

// scores / depth [count] of one request's candidate tree (node 0 = root; node i >= 1 takes part when scores[i] >= 0
// and 1 <= depth[i] <= drafted_depth); pass_time [num_pass]; verify_cost [max_nodes + 1]; 1 <= drafted_depth <=
// min(num_pass, kMaxPassDepth).
PEAGLE_HD PassDecision pass_decide(const double* scores, const int64_t* depth, int64_t count, double scale,
                                   const double* pass_time, int64_t num_pass, int64_t drafted_depth,
                                   const double* verify_cost, int64_t max_nodes) {
  const int64_t d_max = drafted_depth;
  double sum[kMaxPassDepth], best[kMaxPassDepth];
  int64_t taken[kMaxPassDepth];
  for (int64_t k = 0; k < d_max; ++k) {
    sum[k] = 0.0;
    taken[k] = 0;
    best[k] = 1.0 / add_rn(pass_time[k], verify_cost[1]);
  }
  int64_t budget_drafts = 0;
  double predicted = 0.0, prev_score = 0.0;
  int64_t prev_index = -1;
  // Walk the candidates best first; each one joins every K' at least as deep as it.
  for (;;) {
    const int64_t i = next_drafted(scores, depth, count, d_max, prev_score, prev_index);
    if (i < 0) break;
    prev_score = scores[i];
    prev_index = i;
    const double s0 = mul_rn(scale, scores[i]);
    const double s = s0 < 1.0 ? s0 : 1.0;
    for (int64_t k = depth[i] - 1; k < d_max; ++k) {
      if (taken[k] >= max_nodes - 1) continue;
      sum[k] = add_rn(sum[k], s);
      taken[k] += 1;
      const double r = add_rn(1.0, sum[k]) / add_rn(pass_time[k], verify_cost[taken[k] + 1]);
      if (r > best[k]) {
        best[k] = r;
        if (k == d_max - 1) {
          budget_drafts = taken[k];
          predicted = sum[k];
        }
      }
    }
  }
  int64_t best_depth = 1;
  for (int64_t k = 1; k < d_max; ++k) {
    if (best[k] > best[best_depth - 1]) best_depth = k + 1;
  }
  // The deepest node the budget keeps: its best budget_drafts candidates (all depths, same order).
  int64_t kept_depth = 0, seen = 0;
  prev_index = -1;
  while (seen < budget_drafts) {
    const int64_t i = next_drafted(scores, depth, count, d_max, prev_score, prev_index);
    if (i < 0) break;
    prev_score = scores[i];
    prev_index = i;
    kept_depth = depth[i] > kept_depth ? depth[i] : kept_depth;
    ++seen;
  }
  const bool grow = kept_depth >= d_max && best_depth == d_max && d_max < num_pass;
  const int64_t floor_depth = d_max > 1 ? d_max - 1 : 1;
  const int64_t next_depth = grow ? best_depth + 1 : (best_depth > floor_depth ? best_depth : floor_depth);
  return PassDecision{budget_drafts + 1, next_depth, predicted};
}

// Calibration update (harness_observe). After a verified round with A accepted drafts and E predicted for the verified
// tree, a request's sums decay by delta (the weight of the past) and add the round:
//     observed' = observed * delta + A,   predicted' = predicted * delta + E,                                    (6)
// and its path-score exponent gamma (scores p -> p^gamma before (3)) moves toward agreement of the two sums:
//     gamma' = clamp(gamma * sqrt(clamp((predicted' + kPrior) / (observed' + kPrior), 1/2, 2)), gamma_min, gamma_max).
// Over-prediction (predicted' > observed') raises gamma, which lowers every score p < 1 (and so E) - on all edges of
// a path at once, which c of (2) cannot do for a drafter whose probabilities are far too flat or too sharp. The square
// root of a ratio clamped to [1/2, 2] moves gamma by at most sqrt(2) per round, slowly next to c, which corrects what
// remains at once. Same order of evaluation as harness_observe_reference in peagle/ops/harness.py.
constexpr double kMinSharpnessRatio = 0.5;  // bounds of the ratio in (6): gamma moves by at most sqrt(2) a round
constexpr double kMaxSharpnessRatio = 2.0;

// clamp(x, low, high) like torch.clamp: a NaN stays NaN.
PEAGLE_HD double clamp_to(double x, double low, double high) { return x < low ? low : (x > high ? high : x); }

struct Calibration {
  double observed, predicted;  // decayed sums of accepted / predicted drafts
  double gamma;                // path-score exponent
};

// (6): one request's calibration after a round with `accepted` drafts accepted and `round_predicted` predicted.
PEAGLE_HD Calibration observe(Calibration c, double accepted, double round_predicted, double decay, double gamma_min,
                              double gamma_max) {
  const double observed = add_rn(mul_rn(c.observed, decay), accepted);
  const double predicted = add_rn(mul_rn(c.predicted, decay), round_predicted);
  const double ratio = div_rn(add_rn(predicted, kPrior), add_rn(observed, kPrior));
  const double step = sqrt_rn(clamp_to(ratio, kMinSharpnessRatio, kMaxSharpnessRatio));
  return Calibration{observed, predicted, clamp_to(mul_rn(c.gamma, step), gamma_min, gamma_max)};
}

// P-EAGLE edge calibration (harness_edge_scores, harness_edge_observe; the why: peagle/decode/harness/calibration.py).
// A P-EAGLE candidate tree gives every node of depth d - 1 the same top-k tokens of depth d's distribution, a marginal
// over the earlier depths, so the path score p of (2)-(3) predicts acceptance poorly; instead each edge's acceptance
// given its parent's is estimated by kind of edge. Node i >= 1 of a request's candidate tree (parent u = parent[i] < i)
// has the edge probability q = p_i / p_u (0 when p_u <= 0), the bin b = #{t in thresholds : t <= q}, and the kind
//     kind = (first ? 0 : 1) * (T + 1) + b,   first = no node j < i has parent u (siblings lie best first),       (7)
// T thresholds ascending. The kind's scale is a ratio of decayed sums with a prior (table and prior: [2, E] rows
// accepted, drafted; E = 2 (T + 1)),
//     c = (accepted[kind] + prior_accepted[kind]) / (drafted[kind] + prior_drafted[kind]),
// the edge's acceptance a = min(1, c * q), and the node's predicted acceptance is the product of its path's edges,
//     path[i] = path[u] * a,   path[0] = 1,   path = -1, q = 0, kind = -1 on the root's q / kind and on padding.
// After verification (8): the table decays by edge_decay, then every verified drafted node whose parent lies on the
// accepted path is one observation of its kind, in order of row, then node: drafted[kind] += q, and accepted[kind] += 1
// when the node lies on the accepted path too; each row's request b decays its (observed, predicted) sums by
// path_decay and adds its accepted drafts and predicted = the sum of its verified drafted nodes' path values, in node
// order. Same order of evaluation as the references in peagle/ops/harness.py, so the results agree bit for bit.

// (7): the bin of an edge probability.
PEAGLE_HD int64_t edge_bin(double q, const double* thresholds, int64_t num_thresholds) {
  int64_t bin = 0;
  while (bin < num_thresholds && thresholds[bin] <= q) ++bin;
  return bin;
}

struct EdgeTable {
  const double* accepted;        // [E]
  const double* drafted;         // [E]
  const double* prior_accepted;  // [E]
  const double* prior_drafted;   // [E]
  const double* thresholds;      // [T] ascending, E = 2 (T + 1)
  int64_t num_thresholds;
};

// (7) for one request: scores / parent [nodes] of its candidate tree, the first `count` of them real (count in
// [1, nodes]); writes path, q, kind [nodes]. A parent outside [0, i) makes the node padding (the CPU checks reject
// it; the CUDA kernel cannot raise).
PEAGLE_HD void edge_scores(const double* scores, const int64_t* parent, int64_t count, int64_t nodes,
                           const EdgeTable& t, double* path, double* q, int64_t* kind) {
  for (int64_t i = 0; i < nodes; ++i) {
    path[i] = i == 0 ? 1.0 : -1.0;
    q[i] = 0.0;
    kind[i] = -1;
    const int64_t up = parent[i];
    if (i == 0 || i >= count || up < 0 || up >= i || path[up] < 0.0) continue;
    const double above = scores[up];
    const double edge = above > 0.0 ? div_rn(scores[i], above) : 0.0;
    bool first = true;
    for (int64_t j = 1; j < i && first; ++j) first = parent[j] != up;
    const int64_t k = (first ? 0 : 1) * (t.num_thresholds + 1) + edge_bin(edge, t.thresholds, t.num_thresholds);
    const double scale = div_rn(add_rn(t.accepted[k], t.prior_accepted[k]), add_rn(t.drafted[k], t.prior_drafted[k]));
    const double a = mul_rn(scale, edge);
    path[i] = mul_rn(path[up], a < 1.0 ? a : 1.0);
    q[i] = edge;
    kind[i] = k;
  }
}

// Whether node x lies on a request's accepted path (path[0 .. last], -1 padded).
PEAGLE_HD bool on_accepted_path(int64_t x, const int64_t* accepted_path, int64_t last) {
  for (int64_t j = 0; j <= last; ++j) {
    if (accepted_path[j] == x) return true;
  }
  return false;
}

// (8) for one request's verified tree, kind `only` alone (or every kind with only = -1): adds its observations to
// accepted / drafted [E] and returns its predicted accepted drafts (the sum of its drafted nodes' path values). The
// accepted path's last index is min(num_accepted, path_len - 1).
PEAGLE_HD double edge_observe(const double* q, const int64_t* kind, const double* path, const int64_t* parent,
                              int64_t nodes, const int64_t* accepted_path, int64_t path_len, int64_t num_accepted,
                              int64_t num_kinds, int64_t only, double* accepted, double* drafted) {
  const int64_t last = num_accepted < 0 ? -1 : (num_accepted < path_len - 1 ? num_accepted : path_len - 1);
  double predicted = 0.0;
  for (int64_t i = 0; i < nodes; ++i) {
    const int64_t k = kind[i];
    if (k < 0 || k >= num_kinds) continue;
    predicted = add_rn(predicted, path[i]);
    if (only >= 0 && k != only) continue;
    const int64_t up = parent[i];
    if (up < 0 || up >= nodes || !on_accepted_path(up, accepted_path, last)) continue;
    drafted[k] = add_rn(drafted[k], q[i]);
    if (on_accepted_path(i, accepted_path, last)) accepted[k] = add_rn(accepted[k], 1.0);
  }
  return predicted;
}

}  // namespace harness
}  // namespace peagle
