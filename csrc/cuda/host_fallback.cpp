// The one implementation of a host-fallback CUDA registration (see host_fallback.h), as a boxed kernel: it works for
// any schema, so no op copies its inputs to the host by hand.
#include "host_fallback.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <mutex>

#include "checks/common.h"

namespace peagle {
namespace cuda {
namespace {

struct Registry {
  std::mutex lock;
  std::vector<std::string> names;
};

Registry& registry() {
  static Registry r;  // filled by the static registrations of the extension's CUDA files
  return r;
}

// Moves the tensors of one stack entry to `device`; a tensor argument (not a return) is first checked against the
// first tensor argument's device.
void move_tensors(c10::IValue& value, const c10::Device& device, const char* op, const char* name,
                  const at::Tensor* ref, const char* ref_name) {
  if (value.isTensor()) {
    const at::Tensor t = value.toTensor();
    if (ref != nullptr) check_same_device(op, name, t, *ref, ref_name);
    value = t.to(device);
  } else if (value.isTensorList()) {
    const c10::List<at::Tensor> list = value.toTensorList();
    c10::List<at::Tensor> moved;  // a new list: the caller's list is left as it was
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor t = list.get(i);
      if (ref != nullptr) check_same_device(op, name, t, *ref, ref_name);
      moved.push_back(t.to(device));
    }
    value = moved;
  } else {
    TORCH_CHECK(!value.isList(), "peagle.", op, ": a CUDA host fallback takes Tensor and Tensor[] arguments only, got ",
                value.tagKind(), " for ", name);
  }
}

void run_on_host(const c10::OperatorHandle& handle, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = handle.schema();
  const std::string full_name = schema.name();
  const char* op = full_name.c_str() + full_name.find("::") + 2;
  const auto& arguments = schema.arguments();
  const auto first = stack->end() - static_cast<std::ptrdiff_t>(arguments.size());
  // The device of the first tensor argument: every tensor must be on it, and the outputs go back to it.
  at::Tensor ref;
  const char* ref_name = nullptr;
  for (size_t i = 0; i < arguments.size() && !ref.defined(); ++i) {
    const c10::IValue& value = first[static_cast<std::ptrdiff_t>(i)];
    if (value.isTensor()) {
      ref = value.toTensor();
      ref_name = arguments[i].name().c_str();
    } else if (value.isTensorList() && !value.toTensorList().empty()) {
      ref = value.toTensorList().get(0);
      ref_name = arguments[i].name().c_str();
    }
  }
  TORCH_CHECK(ref.defined(), "peagle.", op, ": a CUDA host fallback needs a tensor argument");
  const c10::Device device = ref.device();
  for (size_t i = 0; i < arguments.size(); ++i) {
    move_tensors(first[static_cast<std::ptrdiff_t>(i)], at::kCPU, op, arguments[i].name().c_str(), &ref, ref_name);
  }
  handle.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  const auto outputs = stack->end() - static_cast<std::ptrdiff_t>(schema.returns().size());
  for (auto it = outputs; it != stack->end(); ++it) move_tensors(*it, device, op, "an output", nullptr, nullptr);
}

}  // namespace

void register_host_fallback(torch::Library& m, const char* op) {
  m.impl(op, torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
  Registry& r = registry();
  const std::lock_guard<std::mutex> guard(r.lock);
  r.names.emplace_back(op);
}

std::vector<std::string> host_fallbacks() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> guard(r.lock);
  return r.names;
}

}  // namespace cuda
}  // namespace peagle

// A diagnostic op of CUDA builds only (CPU builds register no host fallbacks): read by scripts/check_cuda_build.py.
TORCH_LIBRARY_FRAGMENT(peagle, m) { m.def("cuda_host_fallbacks() -> str[]", &peagle::cuda::host_fallbacks); }
