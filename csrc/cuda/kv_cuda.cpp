// Torch-facing launcher of kv_compact on CUDA: host checks of shapes/dtypes/devices (free), int64 index views, the
// scratch and the current stream; the value checks and the moves run on the device (kv_kernels.cu).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "checks/cuda.h"
#include "checks/deferred.h"
#include "checks/kv.h"
#include "deferred_cuda.h"
#include "kv_kernels.h"

namespace peagle {
namespace {

// The one host synchronisation of kv_compact (immediate checks): reads the device's error table and raises the first
// bad request's error (the kernels changed nothing then). Deferred checks skip it (kv_publish_error instead).
void raise_device_errors(const at::Tensor& errors, const KvDims& d) {
  const at::Tensor host = errors.cpu();
  const int64_t* e = host.data_ptr<int64_t>();
  if (e[4 * d.batch] == 0) return;
  for (int64_t b = 0; b < d.batch; ++b) {
    if (e[4 * b] != kv::kOk) raise_kv_error(b, kv::Check{e[4 * b], e[4 * b + 1], e[4 * b + 2], e[4 * b + 3]}, d);
  }
}

void kv_compact_cuda(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_table,
                     const at::Tensor& seq_len, const at::Tensor& accepted_path, const at::Tensor& num_accepted) {
  const KvDims d = check_kv_compact_args(k_caches, v_caches, block_table, seq_len, accepted_path, num_accepted);
  TORCH_CHECK(k_caches[0].is_cuda(), "peagle.kv_compact: expected CUDA tensors, got k_caches[0] on ",
              k_caches[0].device());
  if (d.batch == 0) return;
  const c10::cuda::CUDAGuard guard(k_caches[0].device());
  const at::Tensor table = block_table.to(at::kLong).contiguous(), path = accepted_path.to(at::kLong).contiguous();
  const at::Tensor count = num_accepted.to(at::kLong).contiguous();
  const auto long_opts = block_table.options().dtype(at::kLong);
  at::Tensor errors = at::zeros({4 * d.batch + 1}, long_opts);
  at::Tensor plan = at::empty({d.batch, 2}, long_opts);
  at::Tensor owner = at::empty({d.geometry.num_blocks}, long_opts);

  std::vector<void*> caches;
  uint64_t address_bits = 0;
  for (const at::TensorList list : {k_caches, v_caches}) {
    for (const at::Tensor& c : list) {
      caches.push_back(c.data_ptr());
      address_bits |= reinterpret_cast<uintptr_t>(c.data_ptr());
    }
  }
  const kv::Geometry& g = d.geometry;
  const cuda::KvCompactArgs args{table.data_ptr<int64_t>(),
                                 path.data_ptr<int64_t>(),
                                 count.data_ptr<int64_t>(),
                                 seq_len.data_ptr(),
                                 seq_len.stride(0),
                                 seq_len.scalar_type() == at::kInt,
                                 d.batch,
                                 g.num_blocks,
                                 g.block_size,
                                 g.max_blocks,
                                 g.path_len,
                                 d.len_max,
                                 d.row_bytes,
                                 kv::unit_bytes(d.row_bytes, address_bits),
                                 plan.data_ptr<int64_t>(),
                                 owner.data_ptr<int64_t>(),
                                 errors.data_ptr<int64_t>()};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_cuda(cuda::kv_compact(args, caches.data(), static_cast<int64_t>(caches.size()), stream), "kv_compact");
  if (deferred_checks_enabled()) {
    check_cuda(cuda::kv_publish_error(args, deferred_record(block_table.get_device(), stream), stream), "kv_compact");
    return;
  }
  check_not_capturing("kv_compact", stream);
  raise_device_errors(errors, d);
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CUDA, m) { m.impl("kv_compact", &peagle::kv_compact_cuda); }
