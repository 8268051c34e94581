// Torch-facing launcher of efficient_lm_head on CUDA: the shared argument checks, contiguous inputs, one workspace
// allocation and the current stream; the kernels are lm_head_kernels.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "checks/cuda.h"
#include "checks/lm_head.h"
#include "lm_head_kernels.h"

namespace peagle {
namespace {

int64_t aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }

std::tuple<at::Tensor, at::Tensor> efficient_lm_head_cuda(const at::Tensor& hidden, const at::Tensor& down,
                                                          const at::Tensor& up, const at::Tensor& weight,
                                                          int64_t num_candidates) {
  const LmHeadDims d = check_efficient_lm_head_args(hidden, down, up, weight, num_candidates);
  TORCH_CHECK(hidden.is_cuda(), "peagle.efficient_lm_head: expected CUDA tensors, got hidden on ", hidden.device());
  const c10::cuda::CUDAGuard guard(hidden.device());
  at::Tensor ids = at::empty({d.rows, d.candidates}, hidden.options().dtype(at::kLong));
  at::Tensor logits = at::empty({d.rows, d.candidates}, hidden.options().dtype(at::kFloat));
  if (d.rows == 0) return {ids, logits};
  const at::Tensor h = hidden.contiguous(), dn = down.contiguous(), u = up.contiguous(), w = weight.contiguous();

  cuda::LmHeadArgs a{};
  a.dtype = hidden.scalar_type() == at::kFloat      ? cuda::HeadDtype::kFloat
            : hidden.scalar_type() == at::kBFloat16 ? cuda::HeadDtype::kBFloat16
                                                    : cuda::HeadDtype::kHalf;
  a.hidden = h.data_ptr();
  a.down = dn.data_ptr();
  a.up = u.data_ptr();
  a.weight = w.data_ptr();
  a.rows = d.rows;
  a.hidden_size = d.hidden;
  a.rank = d.rank;
  a.vocab = d.vocab;
  a.candidates = d.candidates;
  a.chunk = cuda::lm_head_chunk(d.rows, d.vocab, d.candidates);
  a.sort_temp_bytes = cuda::lm_head_sort_temp_bytes(d.rows, d.candidates);

  const int64_t keys = d.rows * d.candidates * static_cast<int64_t>(sizeof(uint64_t));
  const int64_t parts[] = {aligned(d.rows * d.rank * h.element_size()),
                           aligned(d.rows * a.chunk * static_cast<int64_t>(sizeof(float))),
                           aligned(keys),
                           aligned(keys),
                           aligned(keys),
                           aligned((d.rows + 1) * static_cast<int64_t>(sizeof(int64_t))),
                           aligned(static_cast<int64_t>(a.sort_temp_bytes))};
  int64_t total = 0;
  for (const int64_t p : parts) total += p;
  at::Tensor workspace = at::empty({total}, hidden.options().dtype(at::kByte));
  char* base = static_cast<char*>(workspace.data_ptr());
  void* slots[7];
  for (int i = 0; i < 7; ++i) {
    slots[i] = base;
    base += parts[i];
  }
  a.z = slots[0];
  a.scores = static_cast<float*>(slots[1]);
  a.keys[0] = static_cast<uint64_t*>(slots[2]);
  a.keys[1] = static_cast<uint64_t*>(slots[3]);
  a.sorted = static_cast<uint64_t*>(slots[4]);
  a.offsets = static_cast<int64_t*>(slots[5]);
  a.sort_temp = slots[6];
  a.ids = ids.data_ptr<int64_t>();
  a.logits = logits.data_ptr<float>();
  const char* gemm_failure = nullptr;
  const cudaError_t err = cuda::efficient_lm_head(a, c10::cuda::getCurrentCUDAStream(), &gemm_failure);
  TORCH_CHECK(
      gemm_failure == nullptr,
      "peagle.efficient_lm_head: the CUTLASS GEMM accepted the operands and then failed to run: ", gemm_failure);
  check_cuda(err, "efficient_lm_head");
  return {ids, logits};
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CUDA, m) { m.impl("efficient_lm_head", &peagle::efficient_lm_head_cuda); }
