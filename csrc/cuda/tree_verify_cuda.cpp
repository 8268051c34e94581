// Torch-facing launcher of the tree verification CUDA kernels: checks, allocation and the current stream; the kernels
// live in tree_verify_kernels.cu (no torch headers there). Construction: tree_build_cuda.cpp.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks/cuda.h"
#include "checks/deferred.h"
#include "checks/tree.h"
#include "deferred_cuda.h"
#include "peagle/deferred.h"
#include "tree_verify_kernels.h"

namespace peagle {
namespace {

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// A byte scratch tensor as an array of partials (nullptr when not allocated).
template <typename Partial>
Partial* part_ptr(const at::Tensor& bytes) {
  return bytes.defined() ? reinterpret_cast<Partial*>(bytes.data_ptr<uint8_t>()) : nullptr;
}

Outputs run(const char* op, bool sampling, const at::Tensor& parent, const at::Tensor& tokens,
            const at::Tensor& num_nodes, const at::Tensor& target_probs, const c10::optional<at::Tensor>& draft_probs,
            const c10::optional<at::Tensor>& uniforms, int64_t seed, int64_t offset) {
  const TreeShape s = check_tree_args(op, parent, tokens, num_nodes, target_probs, draft_probs, uniforms);
  TORCH_CHECK(parent.is_cuda(), "peagle.", op, ": expected CUDA tensors, got ", parent.device());
  const c10::cuda::CUDAGuard guard(parent.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor par = parent.to(at::kLong).contiguous();
  const at::Tensor tok = tokens.to(at::kLong).contiguous();
  const at::Tensor cnt = num_nodes.to(at::kLong).contiguous();
  const at::Tensor target = tree_rows(target_probs);
  at::Tensor draft, u;
  if (draft_probs.has_value()) draft = tree_rows(*draft_probs);
  if (uniforms.has_value()) u = uniforms->contiguous();
  const auto long_opts = parent.options().dtype(at::kLong);
  at::Tensor path = at::full({s.batch, s.nodes}, -1, long_opts);
  at::Tensor emitted = at::full({s.batch, s.nodes}, -1, long_opts);
  at::Tensor num_accepted = at::zeros({s.batch}, long_opts);
  at::Tensor last = at::zeros({s.batch}, long_opts);
  at::Tensor errors = at::zeros({s.batch, 3}, long_opts);
  // Phase 1 partials (one kind per mode) and, for stochastic drafts only, one residual row per request.
  const int64_t partials = cuda::tree_verify_partials(s.batch, s.nodes, s.vocab);
  const auto scratch = [&](size_t bytes) {
    return at::empty({partials * static_cast<int64_t>(bytes)}, long_opts.dtype(at::kByte));
  };
  at::Tensor argmax_parts, target_parts, draft_parts, residual;
  if (sampling) {
    target_parts = scratch(sizeof(tree::SumPartial));
  } else {
    argmax_parts = scratch(sizeof(tree::ArgmaxPartial));
  }
  if (draft.defined()) {
    draft_parts = scratch(sizeof(tree::SumPartial));
    residual = at::empty({s.batch, s.vocab}, long_opts);
  }
  cuda::TreeVerifyArgs args{par.data_ptr<int64_t>(),
                            tok.data_ptr<int64_t>(),
                            cnt.data_ptr<int64_t>(),
                            target.data_ptr<float>(),
                            target.stride(0),
                            draft.defined() ? draft.data_ptr<float>() : nullptr,
                            draft.defined() ? draft.stride(0) : 0,
                            u.defined() ? u.data_ptr<float>() : nullptr,
                            seed,
                            offset,
                            s.batch,
                            s.nodes,
                            s.vocab,
                            part_ptr<tree::ArgmaxPartial>(argmax_parts),
                            part_ptr<tree::SumPartial>(target_parts),
                            part_ptr<tree::SumPartial>(draft_parts),
                            residual.defined() ? residual.data_ptr<int64_t>() : nullptr,
                            path.data_ptr<int64_t>(),
                            num_accepted.data_ptr<int64_t>(),
                            emitted.data_ptr<int64_t>(),
                            last.data_ptr<int64_t>(),
                            errors.data_ptr<int64_t>()};
  check_cuda(sampling ? cuda::tree_rejection_sample(args, stream) : cuda::tree_verify_greedy(args, stream), op);
  if (deferred_checks_enabled()) {
    // No synchronisation: the first error goes to the device record, raised by check_errors().
    const int64_t id = sampling ? deferred::kTreeRejectionSample : deferred::kTreeVerifyGreedy;
    check_cuda(cuda::tree_publish_error(args, id, deferred_record(parent.get_device(), stream), stream), op);
    return {path, num_accepted, emitted, last};
  }
  // Bad values are found by the kernels: one device-to-host copy of the error table (a synchronisation).
  check_not_capturing(op, stream);
  raise_tree_error(op, errors.cpu(), parent, tokens, num_nodes, target_probs, draft_probs, uniforms);
  return {path, num_accepted, emitted, last};
}

Outputs tree_verify_greedy_cuda(const at::Tensor& parent, const at::Tensor& tokens, const at::Tensor& num_nodes,
                                const at::Tensor& target_probs) {
  return run("tree_verify_greedy", false, parent, tokens, num_nodes, target_probs, c10::nullopt, c10::nullopt, 0, 0);
}

Outputs tree_rejection_sample_cuda(const at::Tensor& parent, const at::Tensor& tokens, const at::Tensor& num_nodes,
                                   const at::Tensor& target_probs, const c10::optional<at::Tensor>& draft_probs,
                                   const c10::optional<at::Tensor>& uniforms, int64_t seed, int64_t offset) {
  return run("tree_rejection_sample", true, parent, tokens, num_nodes, target_probs, draft_probs, uniforms, seed,
             offset);
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("tree_verify_greedy", &peagle::tree_verify_greedy_cuda);
  m.impl("tree_rejection_sample", &peagle::tree_rejection_sample_cuda);
}
