// Argument checks of the COD family (cod_sample, cod_gather, cod_gather_backward), shared by the CPU and CUDA launchers
// (same messages on both).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "checks/common.h"
#include "peagle/cod.h"

namespace peagle {

inline void check_cod_sample_args(const at::Tensor& loss_mask, const at::Tensor& document_ids, int64_t num_depths,
                                  double ratio, double ratio_min, const c10::optional<int64_t>& max_anchors) {
  const char* op = "cod_sample";
  check_rank(op, "loss_mask", loss_mask, 1, "[T]");
  check_rank(op, "document_ids", document_ids, 1, "[T]");
  TORCH_CHECK(loss_mask.scalar_type() == at::kBool || c10::isIntegralType(loss_mask.scalar_type(), false) ||
                  c10::isFloatingType(loss_mask.scalar_type()),
              "peagle.cod_sample: loss_mask must be bool, integer or floating (nonzero = trained), got ",
              loss_mask.scalar_type());
  check_integer(op, "document_ids", document_ids);
  TORCH_CHECK(loss_mask.size(0) == document_ids.size(0), "peagle.cod_sample: loss_mask and document_ids must have ",
              "the same length T, got ", loss_mask.size(0), " and ", document_ids.size(0));
  check_same_device(op, "document_ids", document_ids, loss_mask, "loss_mask");
  TORCH_CHECK(num_depths >= 1, "peagle.cod_sample: num_depths must be >= 1, got ", num_depths);
  TORCH_CHECK(ratio > 0.0 && ratio <= 1.0, "peagle.cod_sample: ratio must be in (0, 1], got ", ratio);
  TORCH_CHECK(ratio_min >= 0.0 && ratio_min <= ratio, "peagle.cod_sample: ratio_min must be in [0, ratio] = [0, ",
              ratio, "], got ", ratio_min);
  TORCH_CHECK(!max_anchors.has_value() || *max_anchors >= 1, "peagle.cod_sample: max_anchors must be None or >= 1, ",
              "got ", max_anchors.value_or(0));
  check_document_ids(op, document_ids);
}

// Returns the number of positions T.
inline int64_t check_cod_gather_args(const at::Tensor& input_ids, const at::Tensor& hidden,
                                     const at::Tensor& mask_hidden, const at::Tensor& anchors, const at::Tensor& depths,
                                     int64_t mask_token_id, const c10::optional<int64_t>& vocab_size) {
  const char* op = "cod_gather";
  check_rank(op, "input_ids", input_ids, 1, "[T]");
  check_rank(op, "hidden", hidden, 2, "[T, D]");
  check_rank(op, "mask_hidden", mask_hidden, 1, "[D]");
  check_rank(op, "anchors", anchors, 1, "[N]");
  check_rank(op, "depths", depths, 1, "[N]");
  check_integer(op, "input_ids", input_ids);
  check_integer(op, "anchors", anchors);
  check_integer(op, "depths", depths);
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble,
              "peagle.cod_gather: hidden must be float32, bfloat16, float16 or float64, got ", dtype);
  TORCH_CHECK(mask_hidden.scalar_type() == dtype, "peagle.cod_gather: mask_hidden must have hidden's dtype ", dtype,
              ", got ", mask_hidden.scalar_type());
  TORCH_CHECK(input_ids.size(0) == hidden.size(0), "peagle.cod_gather: input_ids [T] and hidden [T, D] must agree on ",
              "T, got ", input_ids.size(0), " and ", hidden.size(0));
  TORCH_CHECK(mask_hidden.size(0) == hidden.size(1),
              "peagle.cod_gather: mask_hidden must be [D] with D = ", hidden.size(1), ", got shape ",
              shape_str(mask_hidden));
  TORCH_CHECK(anchors.size(0) == depths.size(0), "peagle.cod_gather: anchors and depths must have the same length N, ",
              "got ", anchors.size(0), " and ", depths.size(0));
  check_same_device(op, "hidden", hidden, input_ids, "input_ids");
  check_same_device(op, "mask_hidden", mask_hidden, input_ids, "input_ids");
  check_same_device(op, "anchors", anchors, input_ids, "input_ids");
  check_same_device(op, "depths", depths, input_ids, "input_ids");
  const int64_t id_max =
      input_ids.scalar_type() == at::kInt ? std::numeric_limits<int32_t>::max() : std::numeric_limits<int64_t>::max();
  TORCH_CHECK(mask_token_id >= 0 && mask_token_id <= id_max, "peagle.cod_gather: mask_token_id must be in [0, ", id_max,
              "] for ", input_ids.scalar_type(), " input_ids, got ", mask_token_id);
  if (vocab_size.has_value()) {
    TORCH_CHECK(mask_token_id < *vocab_size, "peagle.cod_gather: mask_token_id must be < vocab_size = ", *vocab_size,
                ", got ", mask_token_id);
    if (input_ids.numel() > 0) {
      const auto [lo, hi] = at::aminmax(input_ids);
      const int64_t low = lo.item<int64_t>(), high = hi.item<int64_t>();
      TORCH_CHECK(low >= 0 && high < *vocab_size, "peagle.cod_gather: input_ids must be in [0, vocab_size) = [0, ",
                  *vocab_size, "), got values in [", low, ", ", high, "]");
    }
  }
  return hidden.size(0);
}

// num_positions (T) sizes the [T, D] gradient the backward allocates: bounded so that an absurd value is an error, not
// an allocation (2^24 positions is far beyond any trained row: prepare-data caps --seq-len at 2^20).
constexpr int64_t kMaxCodPositions = int64_t{1} << 24;

inline void check_cod_gather_backward_args(const at::Tensor& grad_feats, const at::Tensor& anchors,
                                           const at::Tensor& depths, int64_t num_positions) {
  const char* op = "cod_gather_backward";
  check_rank(op, "grad_feats", grad_feats, 2, "[N, D]");
  check_rank(op, "anchors", anchors, 1, "[N]");
  check_rank(op, "depths", depths, 1, "[N]");
  check_integer(op, "anchors", anchors);
  check_integer(op, "depths", depths);
  TORCH_CHECK(anchors.size(0) == grad_feats.size(0) && depths.size(0) == grad_feats.size(0),
              "peagle.cod_gather_backward: grad_feats, anchors and depths must agree on N, got ", grad_feats.size(0),
              ", ", anchors.size(0), " and ", depths.size(0));
  TORCH_CHECK(num_positions >= 0 && num_positions <= kMaxCodPositions,
              "peagle.cod_gather_backward: num_positions must be in [0, ", kMaxCodPositions, "], got ", num_positions);
  check_same_device(op, "anchors", anchors, grad_feats, "grad_feats");
  check_same_device(op, "depths", depths, grad_feats, "grad_feats");
}

// Value check of COD elements on the host: names the first element outside the range rule.
inline void check_elements_in_range(const char* op, const int64_t* anchors, const int64_t* depths, int64_t count,
                                    int64_t length) {
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(cod::element_in_range(anchors[i], depths[i], length), "peagle.", op, ": element ", i, " (anchor ",
                anchors[i], ", depth ", depths[i], ") is out of range for T = ", length,
                ": expected 0 <= anchor, 0 <= depth and anchor + depth < T");
  }
}

// The same rule when the device found the violation (`all_in_range` read back from it).
inline void check_elements_in_range(const char* op, bool all_in_range, int64_t length) {
  TORCH_CHECK(all_in_range, "peagle.", op, ": some element is out of range for T = ", length,
              ": expected 0 <= anchor, 0 <= depth and anchor + depth < T");
}

// The CUDA sampler indexes its per-depth scratch with int32.
inline void check_cod_sample_cuda_length(int64_t length, int64_t num_depths) {
  TORCH_CHECK(length < (int64_t{1} << 31) / std::max<int64_t>(num_depths, 1),
              "peagle.cod_sample: T * num_depths must be < 2^31 on CUDA, got T = ", length,
              ", num_depths = ", num_depths);
}

}  // namespace peagle
