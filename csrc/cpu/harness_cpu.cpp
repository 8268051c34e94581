// CPU kernels of the harness ops (math: csrc/include/peagle/harness.h). harness_decide: parallel over requests; writes
// the next depth's width, the stop flags, the running state and the go flag in place. harness_pass_decide: the pass
// budget and next depth per request. harness_observe: the calibration sums and exponents of the rows, in place.
// harness_edge_scores / harness_edge_observe: P-EAGLE's edge-calibrated path scores, and their update in place.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks/harness.h"
#include "peagle/harness.h"

namespace peagle {
namespace {

void harness_decide_cpu(const at::Tensor& frontier_scores, const at::Tensor& calibration, const at::Tensor& widths,
                        const at::Tensor& draft_cost, const at::Tensor& verify_cost, const at::Tensor& expected,
                        const at::Tensor& draft_time, const at::Tensor& num_nodes, const at::Tensor& width,
                        const at::Tensor& stop, const at::Tensor& go) {
  const HarnessDims d = check_harness_decide_args(frontier_scores, calibration, widths, draft_cost, verify_cost,
                                                  expected, draft_time, num_nodes, width, stop, go);
  const double* scores = frontier_scores.data_ptr<double>();
  const double* calib = calibration.data_ptr<double>();
  const int64_t* w = widths.data_ptr<int64_t>();
  const double* dc = draft_cost.data_ptr<double>();
  const double* vc = verify_cost.data_ptr<double>();
  double* e = expected.data_ptr<double>();
  double* t = draft_time.data_ptr<double>();
  int64_t* n = num_nodes.data_ptr<int64_t>();
  int32_t* out_width = width.data_ptr<int32_t>();
  int32_t* out_stop = stop.data_ptr<int32_t>();
  check_harness_values(d, scores, calib, w, dc, vc, n);
  at::parallel_for(0, d.batch, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (out_stop[b] != 0) {
        out_width[b] = 0;
        continue;
      }
      const double scale = harness::calibration_scale(calib[2 * b], calib[2 * b + 1]);
      const harness::Decision r = harness::decide(scores + b * d.frontier, d.frontier, scale, w, dc, d.num_widths, vc,
                                                  d.max_nodes, harness::Running{e[b], t[b], n[b]});
      out_width[b] = r.width;
      out_stop[b] = r.width == 0 ? 1 : 0;
      e[b] = r.next.expected;
      t[b] = r.next.draft_time;
      n[b] = r.next.nodes;
    }
  });
  int32_t any = 0;
  for (int64_t b = 0; b < d.batch; ++b) any |= out_stop[b] == 0 ? 1 : 0;
  go.data_ptr<int32_t>()[0] = any;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> harness_pass_decide_cpu(
    const at::Tensor& scores, const at::Tensor& depth, const at::Tensor& num_nodes, const at::Tensor& calibration,
    const at::Tensor& pass_time, const at::Tensor& verify_cost, int64_t drafted_depth) {
  const PassDims d = check_harness_pass_args(scores, depth, num_nodes, calibration, pass_time, verify_cost,
                                             drafted_depth, harness::kMaxPassDepth);
  const double* p = scores.data_ptr<double>();
  const int64_t* k = depth.data_ptr<int64_t>();
  const int64_t* n = num_nodes.data_ptr<int64_t>();
  const double* calib = calibration.data_ptr<double>();
  const double* pass = pass_time.data_ptr<double>();
  const double* vc = verify_cost.data_ptr<double>();
  check_harness_pass_values(d, p, k, n, calib, pass, vc, drafted_depth);
  at::Tensor budget = at::empty({d.batch}, num_nodes.options());
  at::Tensor next_depth = at::empty({d.batch}, num_nodes.options());
  at::Tensor predicted = at::empty({d.batch}, scores.options());
  int64_t* out_budget = budget.data_ptr<int64_t>();
  int64_t* out_next = next_depth.data_ptr<int64_t>();
  double* out_predicted = predicted.data_ptr<double>();
  at::parallel_for(0, d.batch, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const double scale = harness::calibration_scale(calib[2 * b], calib[2 * b + 1]);
      const harness::PassDecision r = harness::pass_decide(p + b * d.nodes, k + b * d.nodes, n[b], scale, pass,
                                                           d.num_pass, drafted_depth, vc, d.max_nodes);
      out_budget[b] = r.budget;
      out_next[b] = r.next_depth;
      out_predicted[b] = r.predicted;
    }
  });
  return {budget, next_depth, predicted};
}

template <typename Accepted>
void observe_rows(const ObserveDims& d, double* calib, double* gamma, const double* predicted, const Accepted* accepted,
                  const int64_t* rows, double decay, double gamma_min, double gamma_max) {
  for (int64_t r = 0; r < d.rows; ++r) {
    const int64_t b = rows != nullptr ? rows[r] : r;
    const harness::Calibration c =
        harness::observe(harness::Calibration{calib[2 * b], calib[2 * b + 1], gamma[b]},
                         static_cast<double>(accepted[r]), predicted[b], decay, gamma_min, gamma_max);
    calib[2 * b] = c.observed;
    calib[2 * b + 1] = c.predicted;
    gamma[b] = c.gamma;
  }
}

// A few flops per request: a plain loop (a parallel_for would cost more than the work at decoding batch sizes).
void harness_observe_cpu(const at::Tensor& calibration, const at::Tensor& gamma, const at::Tensor& predicted,
                         const at::Tensor& accepted, const std::optional<at::Tensor>& rows, double decay,
                         double gamma_min, double gamma_max) {
  const ObserveDims d =
      check_harness_observe_args(calibration, gamma, predicted, accepted, rows, decay, gamma_min, gamma_max);
  const int64_t* row = rows.has_value() ? rows->data_ptr<int64_t>() : nullptr;
  if (row != nullptr) check_harness_observe_rows(d, row);
  double* calib = calibration.data_ptr<double>();
  double* g = gamma.data_ptr<double>();
  const double* p = predicted.data_ptr<double>();
  if (accepted.scalar_type() == at::kLong) {
    observe_rows(d, calib, g, p, accepted.data_ptr<int64_t>(), row, decay, gamma_min, gamma_max);
  } else {
    observe_rows(d, calib, g, p, accepted.data_ptr<int32_t>(), row, decay, gamma_min, gamma_max);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> harness_edge_scores_cpu(const at::Tensor& scores,
                                                                       const at::Tensor& parent,
                                                                       const at::Tensor& num_nodes,
                                                                       const at::Tensor& table, const at::Tensor& prior,
                                                                       const at::Tensor& thresholds) {
  const EdgeDims d = check_harness_edge_scores_args(scores, parent, num_nodes, table, prior, thresholds);
  const double* p = scores.data_ptr<double>();
  const int64_t* up = parent.data_ptr<int64_t>();
  const int64_t* n = num_nodes.data_ptr<int64_t>();
  const double* t = table.data_ptr<double>();
  const double* pr = prior.data_ptr<double>();
  const double* th = thresholds.data_ptr<double>();
  check_edge_table_values("harness_edge_scores", d, t, pr, th);
  check_harness_edge_scores_values(d, p, up, n);
  at::Tensor path = at::empty({d.batch, d.nodes}, scores.options());
  at::Tensor q = at::empty({d.batch, d.nodes}, scores.options());
  at::Tensor kind = at::empty({d.batch, d.nodes}, parent.options());
  double* out_path = path.data_ptr<double>();
  double* out_q = q.data_ptr<double>();
  int64_t* out_kind = kind.data_ptr<int64_t>();
  const harness::EdgeTable edges{t, t + d.kinds, pr, pr + d.kinds, th, d.num_thresholds};
  at::parallel_for(0, d.batch, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o = b * d.nodes;
      harness::edge_scores(p + o, up + o, n[b], d.nodes, edges, out_path + o, out_q + o, out_kind + o);
    }
  });
  return {path, q, kind};
}

// A few flops per node: plain loops, in the order of (8) (the table's sums add in order of row, then node).
void harness_edge_observe_cpu(const at::Tensor& table, const at::Tensor& calibration, const at::Tensor& q,
                              const at::Tensor& kind, const at::Tensor& path, const at::Tensor& parent,
                              const at::Tensor& accepted_path, const at::Tensor& num_accepted,
                              const std::optional<at::Tensor>& rows, double edge_decay, double path_decay) {
  const EdgeObserveDims d = check_harness_edge_observe_args(table, calibration, q, kind, path, parent, accepted_path,
                                                            num_accepted, rows, edge_decay, path_decay);
  const int64_t* row = rows.has_value() ? rows->data_ptr<int64_t>() : nullptr;
  const int64_t* k = kind.data_ptr<int64_t>();
  check_harness_edge_observe_values(d, k, row);
  double* accepted = table.data_ptr<double>();
  double* drafted = accepted + d.kinds;
  for (int64_t e = 0; e < d.kinds; ++e) {
    accepted[e] = harness::mul_rn(accepted[e], edge_decay);
    drafted[e] = harness::mul_rn(drafted[e], edge_decay);
  }
  double* calib = calibration.data_ptr<double>();
  const double* edge = q.data_ptr<double>();
  const double* value = path.data_ptr<double>();
  const int64_t* up = parent.data_ptr<int64_t>();
  const int64_t* accepted_nodes = accepted_path.data_ptr<int64_t>();
  const int64_t* count = num_accepted.data_ptr<int64_t>();
  for (int64_t r = 0; r < d.rows; ++r) {
    const int64_t o = r * d.nodes;
    const double predicted =
        harness::edge_observe(edge + o, k + o, value + o, up + o, d.nodes, accepted_nodes + r * d.path_len, d.path_len,
                              count[r], d.kinds, -1, accepted, drafted);
    const int64_t b = row != nullptr ? row[r] : r;
    calib[2 * b] = harness::add_rn(harness::mul_rn(calib[2 * b], path_decay), static_cast<double>(count[r]));
    calib[2 * b + 1] = harness::add_rn(harness::mul_rn(calib[2 * b + 1], path_decay), predicted);
  }
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("harness_edge_scores", &peagle::harness_edge_scores_cpu);
  m.impl("harness_edge_observe", &peagle::harness_edge_observe_cpu);
  m.impl("harness_decide", &peagle::harness_decide_cpu);
  m.impl("harness_pass_decide", &peagle::harness_pass_decide_cpu);
  m.impl("harness_observe", &peagle::harness_observe_cpu);
}
