// Torch-facing launcher of the tree construction CUDA kernels: checks, allocation (outputs pre-filled with the CPU
// kernel's padding) and the current stream; the kernels live in tree_build_kernels.cu (no torch headers there).
// Verification: tree_verify_cuda.cpp. Errors: the kernels fill a [B, 3] table; immediate checks copy it to the host
// (a synchronisation) and raise the CPU kernel's message, deferred checks publish it to the device error record.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "checks/cuda.h"
#include "checks/deferred.h"
#include "checks/tree.h"
#include "deferred_cuda.h"
#include "launch.h"
#include "peagle/deferred.h"
#include "tree_build_kernels.h"

namespace peagle {
namespace {

// The outputs (TreeSpecTensors, with the CPU kernel's padding) and the selection scratch.
struct Spec {
  TreeSpecTensors outputs;
  at::Tensor chosen, chosen_depth, chosen_score, order, has_child;  // scratch
  cuda::SelectScratch scratch;
  const cuda::SpecOut& out() const { return outputs.view; }
  TreeSpecOutputs tuple() const { return outputs.tuple(); }
};

Spec make_spec(const at::TensorOptions& opts, int64_t batch, int64_t nodes, int64_t path_len) {
  Spec t;
  t.outputs = make_tree_spec(opts, batch, nodes, path_len);
  const auto long_opts = opts.dtype(at::kLong);
  t.chosen = at::empty({batch, nodes}, long_opts);
  t.chosen_depth = at::empty({batch, nodes}, long_opts);
  t.chosen_score = at::empty({batch, nodes}, opts.dtype(at::kDouble));
  t.order = at::empty({batch, nodes}, long_opts);
  t.has_child = at::empty({batch, nodes}, opts.dtype(at::kInt));
  t.scratch = cuda::SelectScratch{t.chosen.data_ptr<int64_t>(), t.chosen_depth.data_ptr<int64_t>(),
                                  t.chosen_score.data_ptr<double>(), t.order.data_ptr<int64_t>(),
                                  t.has_child.data_ptr<int32_t>()};
  return t;
}

// Raises (immediate checks) or records (deferred checks) the first failing request's error.
void finish(const char* op, int64_t deferred_op, const at::Tensor& errors, cudaStream_t stream) {
  if (deferred_checks_enabled()) {
    check_cuda(cuda::build_publish_error(errors.data_ptr<int64_t>(), errors.size(0), deferred_op,
                                         deferred_record(errors.get_device(), stream), stream),
               op);
    return;
  }
  check_not_capturing(op, stream);
  raise_build_error(op, errors.cpu());
}

TreeSpecOutputs tree_select_cuda(const at::Tensor& cand_tokens, const at::Tensor& cand_parent,
                                 const at::Tensor& cand_scores, const at::Tensor& num_candidates, int64_t num_nodes) {
  const char* op = "tree_select";
  const int64_t m = check_tree_select_args(cand_tokens, cand_parent, cand_scores, num_candidates, num_nodes);
  const CudaLaunch launch(op, "cand_tokens", cand_tokens);
  const cudaStream_t stream = launch.stream();
  const int64_t batch = cand_tokens.size(0);
  const at::Tensor tok = cand_tokens.to(at::kLong).contiguous();
  const at::Tensor par = cand_parent.to(at::kLong).contiguous();
  const at::Tensor sc = cand_scores.to(at::kDouble).contiguous();
  const at::Tensor cnt = num_candidates.to(at::kLong).contiguous();
  Spec spec = make_spec(cand_tokens.options(), batch, num_nodes, num_nodes);
  at::Tensor errors = at::zeros({batch, 3}, cand_tokens.options().dtype(at::kLong));
  const cuda::TreeSelectArgs args{tok.data_ptr<int64_t>(),
                                  par.data_ptr<int64_t>(),
                                  sc.data_ptr<double>(),
                                  cnt.data_ptr<int64_t>(),
                                  batch,
                                  m,
                                  spec.out(),
                                  spec.scratch,
                                  errors.data_ptr<int64_t>()};
  launch.check(cuda::tree_select(args, stream));
  finish(op, deferred::kTreeSelect, errors, stream);
  return spec.tuple();
}

// The level table of the Cartesian candidate tree of topk, stored on the device through kernel parameters (so the
// op stays capturable in a CUDA graph). Returns the candidate count M (the root included).
int64_t store_level_table(const char* op, at::IntArrayRef topk, const at::Tensor& levels, cudaStream_t stream) {
  auto* table = reinterpret_cast<cuda::Level*>(levels.data_ptr<int64_t>());
  int64_t start = 1, size = 1, ids_offset = 0;
  cuda::LevelChunk chunk{};
  const auto depths = static_cast<int64_t>(topk.size());
  for (int64_t d = 0; d < depths; ++d) {
    size *= topk[d];
    chunk.levels[chunk.count++] = cuda::Level{topk[d], size, start, ids_offset};
    start += size;
    ids_offset += topk[d];
    if (chunk.count == cuda::kLevelChunk || d == depths - 1) {
      check_cuda(cuda::store_levels(chunk, table, d + 1 - chunk.count, stream), op);
      chunk.count = 0;
    }
  }
  return start;
}

TreeSpecOutputs tree_build_parallel_cuda(const at::Tensor& draft_probs, at::IntArrayRef topk, int64_t num_nodes) {
  const char* op = "tree_build_parallel";
  check_tree_build_parallel_args(draft_probs, topk, num_nodes);
  const CudaLaunch launch(op, "draft_probs", draft_probs);
  const cudaStream_t stream = launch.stream();
  const int64_t batch = draft_probs.size(0), depths = draft_probs.size(1), vocab = draft_probs.size(2);
  const at::Tensor probs = draft_probs.contiguous();
  const auto long_opts = draft_probs.options().dtype(at::kLong);
  Spec spec = make_spec(draft_probs.options(), batch, num_nodes, std::min(num_nodes, depths + 1));
  at::Tensor errors = at::zeros({batch, 3}, long_opts);
  int64_t ids_per_request = 0, max_k = 1;
  for (const int64_t k : topk) {
    ids_per_request += k;
    max_k = std::max(max_k, k);
  }
  at::Tensor ids = at::empty({batch, ids_per_request}, long_opts);
  at::Tensor bad = at::empty({batch, depths}, long_opts);
  at::Tensor scratch = at::empty({batch * depths, max_k}, long_opts);
  static_assert(sizeof(cuda::Level) == 4 * sizeof(int64_t), "Level is four int64");
  at::Tensor levels = at::empty({std::max<int64_t>(depths, 1), 4}, long_opts);
  const int64_t candidates = store_level_table(op, topk, levels, stream);
  const float* p = probs.data_ptr<float>();
  const auto* table = reinterpret_cast<const cuda::Level*>(levels.data_ptr<int64_t>());
  const cuda::RowTopkArgs rows{p,
                               batch * depths,
                               vocab,
                               depths,
                               table,
                               0,
                               ids.data_ptr<int64_t>(),
                               ids_per_request,
                               bad.data_ptr<int64_t>(),
                               scratch.data_ptr<int64_t>(),
                               max_k};
  launch.check(cuda::row_topk(rows, stream));
  const cuda::BuildParallelArgs args{p,
                                     batch,
                                     depths,
                                     vocab,
                                     table,
                                     candidates,
                                     ids.data_ptr<int64_t>(),
                                     ids_per_request,
                                     bad.data_ptr<int64_t>(),
                                     spec.out(),
                                     spec.scratch,
                                     errors.data_ptr<int64_t>()};
  launch.check(cuda::build_parallel_select(args, stream));
  finish(op, deferred::kTreeBuildParallel, errors, stream);
  return spec.tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_expand_topk_cuda(const at::Tensor& frontier_scores,
                                                                     const at::Tensor& child_probs, int64_t topk) {
  const char* op = "tree_expand_topk";
  check_tree_expand_topk_args(frontier_scores, child_probs, topk);
  const CudaLaunch launch(op, "frontier_scores", frontier_scores);
  const cudaStream_t stream = launch.stream();
  const int64_t batch = child_probs.size(0), width = child_probs.size(1), vocab = child_probs.size(2);
  const at::Tensor probs = child_probs.contiguous();
  const at::Tensor scores = frontier_scores.to(at::kDouble).contiguous();
  const auto opts = child_probs.options();
  at::Tensor tokens = at::empty({batch, width * topk}, opts.dtype(at::kLong));
  at::Tensor slots = at::empty({batch, width * topk}, opts.dtype(at::kLong));
  at::Tensor out_scores = at::empty({batch, width * topk}, opts.dtype(at::kDouble));
  at::Tensor errors = at::zeros({batch, 3}, opts.dtype(at::kLong));
  at::Tensor ids = at::empty({batch, width, topk}, opts.dtype(at::kLong));
  at::Tensor bad = at::empty({batch, width}, opts.dtype(at::kLong));
  at::Tensor scratch = at::empty({batch * width, topk}, opts.dtype(at::kLong));
  at::Tensor flat = at::empty({batch, width * topk}, opts.dtype(at::kDouble));
  const cuda::RowTopkArgs rows{probs.data_ptr<float>(),
                               batch * width,
                               vocab,
                               1,
                               nullptr,
                               topk,
                               ids.data_ptr<int64_t>(),
                               topk,
                               bad.data_ptr<int64_t>(),
                               scratch.data_ptr<int64_t>(),
                               topk};
  launch.check(cuda::row_topk(rows, stream));
  const cuda::ExpandArgs args{scores.data_ptr<double>(),
                              probs.data_ptr<float>(),
                              batch,
                              width,
                              vocab,
                              topk,
                              ids.data_ptr<int64_t>(),
                              bad.data_ptr<int64_t>(),
                              flat.data_ptr<double>(),
                              tokens.data_ptr<int64_t>(),
                              slots.data_ptr<int64_t>(),
                              out_scores.data_ptr<double>(),
                              errors.data_ptr<int64_t>()};
  launch.check(cuda::expand_topk(args, stream));
  finish(op, deferred::kTreeExpandTopk, errors, stream);
  return {tokens, slots, out_scores};
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CUDA, m) {
  m.impl("tree_select", &peagle::tree_select_cuda);
  m.impl("tree_build_parallel", &peagle::tree_build_parallel_cuda);
  m.impl("tree_expand_topk", &peagle::tree_expand_topk_cuda);
}
