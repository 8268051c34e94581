// CPU kernels of the harness ops (math: csrc/include/peagle/harness.h). harness_decide: parallel over requests; writes
// the next depth's width, the stop flags, the running state and the go flag in place. harness_pass_decide: the pass
// budget and next depth per request. harness_observe: the calibration sums and exponents of the rows, in place.
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

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("harness_decide", &peagle::harness_decide_cpu);
  m.impl("harness_pass_decide", &peagle::harness_pass_decide_cpu);
  m.impl("harness_observe", &peagle::harness_observe_cpu);
}
