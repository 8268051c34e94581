// Torch-facing launcher of the COD CUDA kernels: checks, allocation and the current stream; the kernels themselves
// live in cod_kernels.cu (no torch headers there).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks/cod.h"
#include "checks/cuda.h"
#include "checks/deferred.h"
#include "cod_kernels.h"
#include "deferred_cuda.h"
#include "peagle/deferred.h"

namespace peagle {
namespace {

std::tuple<at::Tensor, at::Tensor> cod_sample_cuda(const at::Tensor& loss_mask, const at::Tensor& document_ids,
                                                   int64_t num_depths, double ratio, double ratio_min,
                                                   c10::optional<int64_t> max_anchors, int64_t seed) {
  check_cod_sample_args(loss_mask, document_ids, num_depths, ratio, ratio_min, max_anchors);
  const c10::cuda::CUDAGuard guard(loss_mask.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor trained = loss_mask.ne(0).contiguous();
  const at::Tensor docs = document_ids.to(at::kLong).contiguous();
  const int64_t length = loss_mask.size(0);
  check_cod_sample_cuda_length(length, num_depths);

  at::Tensor buffer = at::empty({static_cast<int64_t>(cuda::cod_sample_scratch_bytes(length, num_depths))},
                                loss_mask.options().dtype(at::kByte));
  const cuda::CodSampleScratch scratch = cuda::cod_sample_scratch(buffer.data_ptr(), length, num_depths);
  check_cuda(cuda::cod_sample_select(trained.data_ptr<bool>(), docs.data_ptr<int64_t>(), length, num_depths, ratio,
                                     ratio_min, max_anchors.value_or(-1), seed, scratch, stream),
             "cod_sample");
  // The only host synchronisation: the output length depends on the draws.
  const at::Tensor counts =
      at::from_blob(scratch.counts, {num_depths}, loss_mask.options().dtype(at::kLong)).to(at::kCPU);
  int64_t total = length;
  for (int64_t d = 1; d < num_depths; ++d) total += counts.data_ptr<int64_t>()[d];

  const auto long_opts = loss_mask.options().dtype(at::kLong);
  at::Tensor anchors = at::empty({total}, long_opts);
  at::Tensor depths = at::empty({total}, long_opts);
  check_cuda(cuda::cod_sample_emit(scratch, length, num_depths, anchors.data_ptr<int64_t>(), depths.data_ptr<int64_t>(),
                                   stream),
             "cod_sample");
  return {anchors, depths};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cod_gather_cuda(
    const at::Tensor& input_ids, const at::Tensor& hidden, const at::Tensor& mask_hidden, const at::Tensor& anchors,
    const at::Tensor& depths, int64_t mask_token_id, c10::optional<int64_t> vocab_size) {
  const int64_t length =
      check_cod_gather_args(input_ids, hidden, mask_hidden, anchors, depths, mask_token_id, vocab_size);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor hidden_c = hidden.contiguous();
  const at::Tensor mask_hidden_c = mask_hidden.contiguous();
  const at::Tensor ids_c = input_ids.contiguous();
  const at::Tensor anchors_c = anchors.to(at::kLong).contiguous();
  const at::Tensor depths_c = depths.to(at::kLong).contiguous();
  const int64_t count = anchors.size(0);
  const int64_t width = hidden.size(1);

  at::Tensor ids = at::empty({count}, input_ids.options());
  at::Tensor feats = at::empty({count, width}, hidden.options());
  at::Tensor position_ids = at::empty({count}, anchors_c.options());
  at::Tensor label_index = at::empty({count}, anchors_c.options());
  at::Tensor bad_element = at::zeros({1}, anchors_c.options().dtype(at::kInt));
  check_cuda(cuda::cod_gather(ids_c.data_ptr(), static_cast<int>(input_ids.element_size()), hidden_c.data_ptr(),
                              mask_hidden_c.data_ptr(), anchors_c.data_ptr<int64_t>(), depths_c.data_ptr<int64_t>(),
                              count, length, width * static_cast<int64_t>(hidden.element_size()), mask_token_id,
                              ids.data_ptr(), feats.data_ptr(), position_ids.data_ptr<int64_t>(),
                              label_index.data_ptr<int64_t>(), bad_element.data_ptr<int32_t>(), stream),
             "cod_gather");
  if (deferred_checks_enabled()) {
    check_cuda(deferred_publish_flag(bad_element.data_ptr<int32_t>(), deferred::kCodGather, 1, length,
                                     deferred_record(hidden.get_device(), stream), stream),
               "cod_gather");
  } else {
    check_not_capturing("cod_gather", stream);
    check_elements_in_range("cod_gather", bad_element.item<int32_t>() == 0, length);
  }
  return {feats, ids, position_ids, label_index};
}

std::tuple<at::Tensor, at::Tensor> cod_gather_backward_cuda(const at::Tensor& grad_feats, const at::Tensor& anchors,
                                                            const at::Tensor& depths, int64_t num_positions) {
  check_cod_gather_backward_args(grad_feats, anchors, depths, num_positions);
  const c10::cuda::CUDAGuard guard(grad_feats.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor grad_c = grad_feats.contiguous();
  const at::Tensor anchors_c = anchors.to(at::kLong).contiguous();
  const at::Tensor depths_c = depths.to(at::kLong).contiguous();
  const int64_t count = grad_feats.size(0);
  const int64_t width = grad_feats.size(1);
  const auto dtype = grad_feats.scalar_type();
  const at::Tensor in_range = ((anchors_c >= 0) & (depths_c >= 0) & (anchors_c + depths_c < num_positions)).all();
  if (deferred_checks_enabled()) {
    const at::Tensor bad = in_range.logical_not().to(at::kInt);
    check_cuda(deferred_publish_flag(bad.data_ptr<int32_t>(), deferred::kCodGatherBackward, 1, num_positions,
                                     deferred_record(grad_feats.get_device(), stream), stream),
               "cod_gather_backward");
  } else {
    check_not_capturing("cod_gather_backward", stream);
    check_elements_in_range("cod_gather_backward", in_range.item<bool>(), num_positions);
  }

  cuda::FloatType type;
  switch (dtype) {
    case at::kFloat:
      type = cuda::FloatType::kFloat32;
      break;
    case at::kDouble:
      type = cuda::FloatType::kFloat64;
      break;
    case at::kBFloat16:
      type = cuda::FloatType::kBFloat16;
      break;
    case at::kHalf:
      type = cuda::FloatType::kFloat16;
      break;
    default:
      TORCH_CHECK(false, "peagle.cod_gather_backward: grad_feats must be float32, bfloat16, float16 or float64, got ",
                  dtype);
  }
  at::Tensor grad_hidden = at::empty({num_positions, width}, grad_feats.options());
  at::Tensor grad_mask_hidden = at::empty({width}, grad_feats.options());
  const at::Tensor scratch_buffer =
      at::empty({static_cast<int64_t>(cuda::cod_backward_scratch_bytes(count, width, type))},
                grad_feats.options().dtype(at::kByte));
  const cuda::CodBackwardScratch scratch = cuda::cod_backward_scratch(scratch_buffer.data_ptr(), count, width, type);
  check_cuda(cuda::cod_gather_backward(type, grad_c.data_ptr(), anchors_c.data_ptr<int64_t>(),
                                       depths_c.data_ptr<int64_t>(), count, width, num_positions, scratch,
                                       grad_hidden.data_ptr(), grad_mask_hidden.data_ptr(), stream),
             "cod_gather_backward");
  return {grad_hidden, grad_mask_hidden};
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("cod_sample", &peagle::cod_sample_cuda);
  m.impl("cod_gather", &peagle::cod_gather_cuda);
  m.impl("cod_gather_backward", &peagle::cod_gather_backward_cuda);
}
