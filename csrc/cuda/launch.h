// What every torch-facing CUDA launcher does around its kernel, in one place: the op's tensors must be on CUDA (one
// named tensor is checked; the op's argument checks already put all of them on one device), its kernels run on that
// device and its current stream, and a CUDA error raises naming the op. The launch-argument structs themselves stay
// written out field by field in each launcher: they say what each kernel gets.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "checks/cuda.h"

namespace peagle {

class CudaLaunch {
 public:
  // Checks that `t` (called `name` in op `op`'s message) is a CUDA tensor and makes its device current.
  CudaLaunch(const char* op, const char* name, const at::Tensor& t) : op_(op), guard_(cuda_device(op, name, t)) {}

  cudaStream_t stream() const { return c10::cuda::getCurrentCUDAStream(); }

  // Raises naming the op when a kernel launch (or a CUDA call) failed.
  void check(cudaError_t status) const { check_cuda(status, op_); }

 private:
  static c10::Device cuda_device(const char* op, const char* name, const at::Tensor& t) {
    TORCH_CHECK(t.is_cuda(), "peagle.", op, ": expected CUDA tensors, got ", name, " on ", t.device());
    return t.device();
  }

  const char* op_;
  c10::cuda::CUDAGuard guard_;
};

// A typed data pointer of an optional tensor for a launch-argument struct, or nullptr where it is absent.
template <typename T>
T* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

}  // namespace peagle
