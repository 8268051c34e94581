// Argument checks every op family uses (rank, integer dtype, device), so all ops word their errors alike. The checks of
// each family (cod.h, mask.h, tree.h, gdn.h) build on these and are shared by its CPU and CUDA launchers, so both
// backends reject bad input with the same message.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace peagle {

inline std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

inline void check_rank(const char* op, const char* name, const at::Tensor& t, int64_t rank, const char* layout) {
  TORCH_CHECK(t.dim() == rank, "peagle.", op, ": ", name, " must be ", rank, "-D ", layout, ", got shape ",
              shape_str(t));
}

inline void check_integer(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, "peagle.", op, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "peagle.", op, ": ", name, " must be on the same device as ", ref_name, " (",
              ref.device(), "), got ", t.device());
}

// t in `dtype` and contiguous: t itself when it already is, with no dispatch (`.to(dtype).contiguous()` passes through
// the dispatcher twice even then, which costs microseconds per call with cold caches).
inline at::Tensor contiguous_as(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype && t.is_contiguous() ? t : t.to(dtype).contiguous();
}

// Document ids, one rule for every op (cod_sample, mask_dense, mask_block): -1 marks padding and every other id is a
// document, so ids below -1 are an error (they were padding for cod_sample but a document for the mask ops).
[[noreturn]] inline void raise_document_ids(const char* op, int64_t lowest) {
  TORCH_CHECK(false, "peagle.", op, ": document_ids must be >= -1 (-1 = padding), got ", lowest);
}

inline void check_document_ids(const char* op, const at::Tensor& document_ids) {
  if (document_ids.numel() == 0) return;
  const int64_t lowest = document_ids.min().item<int64_t>();
  if (lowest < -1) raise_document_ids(op, lowest);
}

}  // namespace peagle
