// Torch-facing launcher of harness_decide on CUDA: host checks of shapes/dtypes/devices only (the value checks would
// need a host synchronisation; the kernel treats bad entries as padding), then one kernel on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks/cuda.h"
#include "checks/harness.h"
#include "harness_kernels.h"

namespace peagle {
namespace {

void harness_decide_cuda(const at::Tensor& frontier_scores, const at::Tensor& calibration, const at::Tensor& widths,
                         const at::Tensor& draft_cost, const at::Tensor& verify_cost, const at::Tensor& expected,
                         const at::Tensor& draft_time, const at::Tensor& num_nodes, const at::Tensor& width,
                         const at::Tensor& stop, const at::Tensor& go) {
  const HarnessDims d = check_harness_decide_args(frontier_scores, calibration, widths, draft_cost, verify_cost,
                                                  expected, draft_time, num_nodes, width, stop, go);
  TORCH_CHECK(frontier_scores.is_cuda(), "peagle.harness_decide: expected CUDA tensors, got frontier_scores on ",
              frontier_scores.device());
  const c10::cuda::CUDAGuard guard(frontier_scores.device());
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
  check_cuda(cuda::harness_decide(args, c10::cuda::getCurrentCUDAStream()), "harness_decide");
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CUDA, m) { m.impl("harness_decide", &peagle::harness_decide_cuda); }
