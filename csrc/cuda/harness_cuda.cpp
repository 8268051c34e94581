// Torch-facing launchers of the harness ops on CUDA: host checks of shapes/dtypes/devices only (the value checks would
// need a host synchronisation; the kernels treat bad entries as padding and skip rows out of range), then one kernel
// on the current stream.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks/harness.h"
#include "harness_kernels.h"
#include "launch.h"
#include "peagle/harness.h"

namespace peagle {
namespace {

void harness_decide_cuda(const at::Tensor& frontier_scores, const at::Tensor& calibration, const at::Tensor& widths,
                         const at::Tensor& draft_cost, const at::Tensor& verify_cost, const at::Tensor& expected,
                         const at::Tensor& draft_time, const at::Tensor& num_nodes, const at::Tensor& width,
                         const at::Tensor& stop, const at::Tensor& go) {
  const HarnessDims d = check_harness_decide_args(frontier_scores, calibration, widths, draft_cost, verify_cost,
                                                  expected, draft_time, num_nodes, width, stop, go);
  const CudaLaunch launch("harness_decide", "frontier_scores", frontier_scores);
  const cuda::HarnessDecideArgs args{frontier_scores.data_ptr<double>(),
                                     calibration.data_ptr<double>(),
                                     widths.data_ptr<int64_t>(),
                                     draft_cost.data_ptr<double>(),
                                     verify_cost.data_ptr<double>(),
                                     expected.data_ptr<double>(),
                                     draft_time.data_ptr<double>(),
                                     num_nodes.data_ptr<int64_t>(),
                                     width.data_ptr<int32_t>(),
                                     stop.data_ptr<int32_t>(),
                                     go.data_ptr<int32_t>(),
                                     d.batch,
                                     d.frontier,
                                     d.num_widths,
                                     d.max_nodes};
  launch.check(cuda::harness_decide(args, launch.stream()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> harness_pass_decide_cuda(
    const at::Tensor& scores, const at::Tensor& depth, const at::Tensor& num_nodes, const at::Tensor& calibration,
    const at::Tensor& pass_time, const at::Tensor& verify_cost, int64_t drafted_depth) {
  const PassDims d = check_harness_pass_args(scores, depth, num_nodes, calibration, pass_time, verify_cost,
                                             drafted_depth, harness::kMaxPassDepth);
  const CudaLaunch launch("harness_pass_decide", "scores", scores);
  at::Tensor budget = at::empty({d.batch}, num_nodes.options());
  at::Tensor next_depth = at::empty({d.batch}, num_nodes.options());
  at::Tensor predicted = at::empty({d.batch}, scores.options());
  const cuda::HarnessPassArgs args{scores.data_ptr<double>(),
                                   depth.data_ptr<int64_t>(),
                                   num_nodes.data_ptr<int64_t>(),
                                   calibration.data_ptr<double>(),
                                   pass_time.data_ptr<double>(),
                                   verify_cost.data_ptr<double>(),
                                   budget.data_ptr<int64_t>(),
                                   next_depth.data_ptr<int64_t>(),
                                   predicted.data_ptr<double>(),
                                   d.batch,
                                   d.nodes,
                                   d.num_pass,
                                   d.max_nodes,
                                   drafted_depth};
  launch.check(cuda::harness_pass_decide(args, launch.stream()));
  return {budget, next_depth, predicted};
}

void harness_observe_cuda(const at::Tensor& calibration, const at::Tensor& gamma, const at::Tensor& predicted,
                          const at::Tensor& accepted, const std::optional<at::Tensor>& rows, double decay,
                          double gamma_min, double gamma_max) {
  const ObserveDims d =
      check_harness_observe_args(calibration, gamma, predicted, accepted, rows, decay, gamma_min, gamma_max);
  const CudaLaunch launch("harness_observe", "calibration", calibration);
  const bool long_accepted = accepted.scalar_type() == at::kLong;
  const cuda::HarnessObserveArgs args{calibration.data_ptr<double>(),
                                      gamma.data_ptr<double>(),
                                      predicted.data_ptr<double>(),
                                      long_accepted ? accepted.data_ptr<int64_t>() : nullptr,
                                      long_accepted ? nullptr : accepted.data_ptr<int32_t>(),
                                      data_or_null<int64_t>(rows),
                                      d.batch,
                                      d.rows,
                                      decay,
                                      gamma_min,
                                      gamma_max};
  launch.check(cuda::harness_observe(args, launch.stream()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> harness_edge_scores_cuda(
    const at::Tensor& scores, const at::Tensor& parent, const at::Tensor& num_nodes, const at::Tensor& table,
    const at::Tensor& prior, const at::Tensor& thresholds) {
  const EdgeDims d = check_harness_edge_scores_args(scores, parent, num_nodes, table, prior, thresholds);
  const CudaLaunch launch("harness_edge_scores", "scores", scores);
  at::Tensor path = at::empty({d.batch, d.nodes}, scores.options());
  at::Tensor q = at::empty({d.batch, d.nodes}, scores.options());
  at::Tensor kind = at::empty({d.batch, d.nodes}, parent.options());
  const cuda::HarnessEdgeScoresArgs args{scores.data_ptr<double>(),
                                         parent.data_ptr<int64_t>(),
                                         num_nodes.data_ptr<int64_t>(),
                                         table.data_ptr<double>(),
                                         prior.data_ptr<double>(),
                                         thresholds.data_ptr<double>(),
                                         path.data_ptr<double>(),
                                         q.data_ptr<double>(),
                                         kind.data_ptr<int64_t>(),
                                         d.batch,
                                         d.nodes,
                                         d.kinds,
                                         d.num_thresholds};
  launch.check(cuda::harness_edge_scores(args, launch.stream()));
  return {path, q, kind};
}

void harness_edge_observe_cuda(const at::Tensor& table, const at::Tensor& calibration, const at::Tensor& q,
                               const at::Tensor& kind, const at::Tensor& path, const at::Tensor& parent,
                               const at::Tensor& accepted_path, const at::Tensor& num_accepted,
                               const std::optional<at::Tensor>& rows, double edge_decay, double path_decay) {
  const EdgeObserveDims d = check_harness_edge_observe_args(table, calibration, q, kind, path, parent, accepted_path,
                                                            num_accepted, rows, edge_decay, path_decay);
  const CudaLaunch launch("harness_edge_observe", "table", table);
  const cuda::HarnessEdgeObserveArgs args{table.data_ptr<double>(),
                                          calibration.data_ptr<double>(),
                                          q.data_ptr<double>(),
                                          kind.data_ptr<int64_t>(),
                                          path.data_ptr<double>(),
                                          parent.data_ptr<int64_t>(),
                                          accepted_path.data_ptr<int64_t>(),
                                          num_accepted.data_ptr<int64_t>(),
                                          data_or_null<int64_t>(rows),
                                          d.batch,
                                          d.rows,
                                          d.nodes,
                                          d.path_len,
                                          d.kinds,
                                          edge_decay,
                                          path_decay};
  launch.check(cuda::harness_edge_observe(args, launch.stream()));
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("harness_edge_scores", &peagle::harness_edge_scores_cuda);
  m.impl("harness_edge_observe", &peagle::harness_edge_observe_cuda);
  m.impl("harness_decide", &peagle::harness_decide_cuda);
  m.impl("harness_pass_decide", &peagle::harness_pass_decide_cuda);
  m.impl("harness_observe", &peagle::harness_observe_cuda);
}
