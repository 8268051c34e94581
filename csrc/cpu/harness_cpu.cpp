// CPU kernel of harness_decide (math: csrc/include/peagle/harness.h). Parallel over requests; writes the next depth's
// width, the stop flags, the running state and the go flag in place.
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

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) { m.impl("harness_decide", &peagle::harness_decide_cpu); }
