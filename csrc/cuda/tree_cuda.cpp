// Torch-facing launcher of the tree verification CUDA kernels: checks, allocation and the current stream; the kernels
// live in tree_kernels.cu (no torch headers there). Tree construction runs on the CPU kernels (its work is tiny next
// to the drafter pass): the CUDA registrations copy the inputs to the host and the results back.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks/tree.h"
#include "tree_kernels.h"

namespace peagle {
namespace {

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

void check_cuda(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "peagle.", op, ": CUDA error: ", cudaGetErrorString(err));
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
  at::Tensor residual;
  if (sampling) residual = at::empty({s.batch, s.vocab}, long_opts);
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
                            residual.defined() ? residual.data_ptr<int64_t>() : nullptr,
                            path.data_ptr<int64_t>(),
                            num_accepted.data_ptr<int64_t>(),
                            emitted.data_ptr<int64_t>(),
                            last.data_ptr<int64_t>(),
                            errors.data_ptr<int64_t>()};
  check_cuda(sampling ? cuda::tree_rejection_sample(args, stream) : cuda::tree_verify_greedy(args, stream), op);
  // Bad values are found by the kernels: one device-to-host copy of the error table (a synchronisation).
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

// Construction on CUDA tensors: the CPU kernels on host copies.
using SpecOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                               at::Tensor, at::Tensor>;

SpecOutputs to_device(const SpecOutputs& o, const at::Device& device) {
  return {std::get<0>(o).to(device), std::get<1>(o).to(device), std::get<2>(o).to(device),
          std::get<3>(o).to(device), std::get<4>(o).to(device), std::get<5>(o).to(device),
          std::get<6>(o).to(device), std::get<7>(o).to(device), std::get<8>(o).to(device)};
}

SpecOutputs tree_select_cuda(const at::Tensor& cand_tokens, const at::Tensor& cand_parent,
                             const at::Tensor& cand_scores, const at::Tensor& num_candidates, int64_t num_nodes) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("peagle::tree_select", "")
          .typed<SpecOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  check_same_device("tree_select", "cand_parent", cand_parent, cand_tokens, "cand_tokens");
  check_same_device("tree_select", "cand_scores", cand_scores, cand_tokens, "cand_tokens");
  check_same_device("tree_select", "num_candidates", num_candidates, cand_tokens, "cand_tokens");
  return to_device(op.call(cand_tokens.cpu(), cand_parent.cpu(), cand_scores.cpu(), num_candidates.cpu(), num_nodes),
                   cand_tokens.device());
}

SpecOutputs tree_build_parallel_cuda(const at::Tensor& draft_probs, at::IntArrayRef topk, int64_t num_nodes) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("peagle::tree_build_parallel", "")
                             .typed<SpecOutputs(const at::Tensor&, at::IntArrayRef, int64_t)>();
  return to_device(op.call(draft_probs.cpu(), topk, num_nodes), draft_probs.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_expand_topk_cuda(const at::Tensor& frontier_scores,
                                                                     const at::Tensor& child_probs, int64_t topk) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("peagle::tree_expand_topk", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t)>();
  check_same_device("tree_expand_topk", "child_probs", child_probs, frontier_scores, "frontier_scores");
  const auto out = op.call(frontier_scores.cpu(), child_probs.cpu(), topk);
  const auto device = frontier_scores.device();
  return {std::get<0>(out).to(device), std::get<1>(out).to(device), std::get<2>(out).to(device)};
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("tree_verify_greedy", &peagle::tree_verify_greedy_cuda);
  m.impl("tree_rejection_sample", &peagle::tree_rejection_sample_cuda);
  m.impl("tree_select", &peagle::tree_select_cuda);
  m.impl("tree_build_parallel", &peagle::tree_build_parallel_cuda);
  m.impl("tree_expand_topk", &peagle::tree_expand_topk_cuda);
}
