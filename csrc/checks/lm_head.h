// Argument checks of efficient_lm_head, shared by the CPU and CUDA launchers (same messages on both).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "checks/common.h"
#include "peagle/lm_head.h"

namespace peagle {

struct LmHeadDims {
  int64_t rows, hidden, rank, vocab, candidates;
};

inline LmHeadDims check_efficient_lm_head_args(const at::Tensor& hidden, const at::Tensor& down, const at::Tensor& up,
                                               const at::Tensor& weight, int64_t num_candidates) {
  const char* op = "efficient_lm_head";
  check_rank(op, "hidden", hidden, 2, "[N, H]");
  check_rank(op, "down", down, 2, "[r, H]");
  check_rank(op, "up", up, 2, "[V, r]");
  check_rank(op, "weight", weight, 2, "[V, H]");
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "peagle.", op,
              ": hidden must be float32, bfloat16 or float16, got ", dtype);
  const char* names[] = {"down", "up", "weight"};
  const at::Tensor* tensors[] = {&down, &up, &weight};
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK(tensors[i]->scalar_type() == dtype, "peagle.", op, ": ", names[i], " must have hidden's dtype ", dtype,
                ", got ", tensors[i]->scalar_type());
    check_same_device(op, names[i], *tensors[i], hidden, "hidden");
  }
  const int64_t h = hidden.size(1), r = down.size(0), v = up.size(0);
  TORCH_CHECK(h >= 1, "peagle.", op, ": hidden must be [N, H] with H >= 1, got shape ", shape_str(hidden));
  TORCH_CHECK(r >= 1, "peagle.", op, ": down must be [r, H] with rank r >= 1, got shape ", shape_str(down));
  TORCH_CHECK(down.size(1) == h, "peagle.", op, ": down must be [r, H] with H = ", h, " (hidden's columns), got shape ",
              shape_str(down));
  TORCH_CHECK(up.size(1) == r, "peagle.", op, ": up must be [V, r] with r = ", r, " (down's rows), got shape ",
              shape_str(up));
  TORCH_CHECK(v >= 1 && v <= lm_head::kMaxVocab, "peagle.", op,
              ": up must be [V, r] with 1 <= V <= ", lm_head::kMaxVocab, ", got shape ", shape_str(up));
  TORCH_CHECK(weight.size(0) == v && weight.size(1) == h, "peagle.", op, ": weight must be [V, H] = [", v, ", ", h,
              "] (up's rows, hidden's columns), got shape ", shape_str(weight));
  TORCH_CHECK(num_candidates >= 1 && num_candidates <= v, "peagle.", op, ": num_candidates must be in [1, V] = [1, ", v,
              "], got ", num_candidates);
  return {hidden.size(0), h, r, v, num_candidates};
}

}  // namespace peagle
