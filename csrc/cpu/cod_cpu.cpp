// CPU kernels of the COD family: sampling of (anchor, depth) elements and the fused drafter-input gather.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "checks/cod.h"
#include "cpu/large_buffers.h"
#include "peagle/cod.h"

namespace peagle {
namespace {

// Keeps the `count` candidates with the smallest selection keys at `depth`; `candidates` stays sorted by anchor.
void keep_smallest_keys(std::vector<int64_t>& candidates, int64_t count, int64_t seed, int64_t depth) {
  if (count >= static_cast<int64_t>(candidates.size())) return;
  std::vector<std::pair<int64_t, int64_t>> keyed(candidates.size());
  for (size_t i = 0; i < candidates.size(); ++i) keyed[i] = {cod::key(seed, depth, candidates[i]), candidates[i]};
  // std::pair orders by key, then anchor: the same tie-break as cod::key_less and the CUDA stable sort.
  std::nth_element(keyed.begin(), keyed.begin() + count, keyed.end());
  candidates.resize(count);
  for (int64_t i = 0; i < count; ++i) candidates[i] = keyed[i].second;
  std::sort(candidates.begin(), candidates.end());
}

std::tuple<at::Tensor, at::Tensor> cod_sample_cpu(const at::Tensor& loss_mask, const at::Tensor& document_ids,
                                                  int64_t num_depths, double ratio, double ratio_min,
                                                  c10::optional<int64_t> max_anchors, int64_t seed) {
  check_cod_sample_args(loss_mask, document_ids, num_depths, ratio, ratio_min, max_anchors);
  const at::Tensor trained = loss_mask.ne(0).contiguous();
  const at::Tensor docs = document_ids.to(at::kLong).contiguous();
  const int64_t length = loss_mask.size(0);
  const bool* trained_ptr = trained.data_ptr<bool>();
  const int64_t* doc_ptr = docs.data_ptr<int64_t>();

  // Seeds: anchors whose chain reaches depth 1, capped at max_anchors by the depth-0 keys.
  std::vector<int64_t> pool;
  for (int64_t a = 0; a < length; ++a) {
    if (cod::extends(doc_ptr, trained_ptr, length, a, 1)) pool.push_back(a);
  }
  if (max_anchors.has_value()) keep_smallest_keys(pool, *max_anchors, seed, 0);
  const int64_t n_seeds = static_cast<int64_t>(pool.size());

  std::vector<std::vector<int64_t>> kept;
  int64_t total = length;
  for (int64_t d = 1; d < num_depths; ++d) {
    const int64_t count =
        std::min<int64_t>(cod::depth_count(n_seeds, ratio, ratio_min, d), static_cast<int64_t>(pool.size()));
    if (count <= 0) break;  // counts and pools only shrink with depth
    keep_smallest_keys(pool, count, seed, d);
    kept.push_back(pool);
    total += count;
    std::vector<int64_t> next;
    for (const int64_t a : pool) {
      if (cod::extends(doc_ptr, trained_ptr, length, a, d + 1)) next.push_back(a);
    }
    pool = std::move(next);
  }

  const auto long_opts = loss_mask.options().dtype(at::kLong);
  at::Tensor anchors = at::empty({total}, long_opts);
  at::Tensor depths = at::empty({total}, long_opts);
  int64_t* anchor_out = anchors.data_ptr<int64_t>();
  int64_t* depth_out = depths.data_ptr<int64_t>();
  for (int64_t a = 0; a < length; ++a) {
    anchor_out[a] = a;
    depth_out[a] = 0;
  }
  int64_t offset = length;
  for (size_t d = 0; d < kept.size(); ++d) {
    for (const int64_t a : kept[d]) {
      anchor_out[offset] = a;
      depth_out[offset] = static_cast<int64_t>(d) + 1;
      ++offset;
    }
  }
  return {anchors, depths};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cod_gather_cpu(
    const at::Tensor& input_ids, const at::Tensor& hidden, const at::Tensor& mask_hidden, const at::Tensor& anchors,
    const at::Tensor& depths, int64_t mask_token_id, c10::optional<int64_t> vocab_size) {
  const int64_t length =
      check_cod_gather_args(input_ids, hidden, mask_hidden, anchors, depths, mask_token_id, vocab_size);
  const at::Tensor hidden_c = hidden.contiguous();
  const at::Tensor mask_hidden_c = mask_hidden.contiguous();
  const at::Tensor ids_c = input_ids.contiguous();
  const at::Tensor anchors_c = anchors.to(at::kLong).contiguous();
  const at::Tensor depths_c = depths.to(at::kLong).contiguous();
  const int64_t count = anchors.size(0);
  const int64_t width = hidden.size(1);
  const int64_t* anchor_ptr = anchors_c.data_ptr<int64_t>();
  const int64_t* depth_ptr = depths_c.data_ptr<int64_t>();
  check_elements_in_range("cod_gather", anchor_ptr, depth_ptr, count, length);

  at::Tensor ids = at::empty({count}, input_ids.options());
  at::Tensor feats = cpu::empty_large({count, width}, hidden.options());
  at::Tensor position_ids = at::empty({count}, anchors_c.options());
  at::Tensor label_index = at::empty({count}, anchors_c.options());
  const int64_t row_bytes = width * static_cast<int64_t>(hidden.element_size());
  const char* hidden_bytes = static_cast<const char*>(hidden_c.data_ptr());
  const char* mask_bytes = static_cast<const char*>(mask_hidden_c.data_ptr());
  char* feat_bytes = static_cast<char*>(feats.data_ptr());
  int64_t* position_ptr = position_ids.data_ptr<int64_t>();
  int64_t* label_ptr = label_index.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(row_bytes, 1));

  AT_DISPATCH_INDEX_TYPES(input_ids.scalar_type(), "cod_gather_cpu", [&] {
    const index_t* id_in = ids_c.data_ptr<index_t>();
    index_t* id_out = ids.data_ptr<index_t>();
    const index_t mask_id = static_cast<index_t>(mask_token_id);
    at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t a = anchor_ptr[i];
        id_out[i] = depth_ptr[i] == 0 ? id_in[a] : mask_id;
        position_ptr[i] = label_ptr[i] = a + depth_ptr[i];
      }
      // Depth-0 rows with consecutive anchors (all of depth 0 for cod_sample output) are one contiguous copy.
      for (int64_t i = begin; i < end;) {
        int64_t run = 1;
        if (depth_ptr[i] == 0) {
          while (i + run < end && depth_ptr[i + run] == 0 && anchor_ptr[i + run] == anchor_ptr[i] + run) ++run;
        }
        const char* src = depth_ptr[i] == 0 ? hidden_bytes + anchor_ptr[i] * row_bytes : mask_bytes;
        cpu::copy_streaming(feat_bytes + i * row_bytes, src, static_cast<size_t>(run * row_bytes));
        i += run;
      }
      cpu::streaming_fence();
    });
  });
  return {feats, ids, position_ids, label_index};
}

std::tuple<at::Tensor, at::Tensor> cod_gather_backward_cpu(const at::Tensor& grad_feats, const at::Tensor& anchors,
                                                           const at::Tensor& depths, int64_t num_positions) {
  check_cod_gather_backward_args(grad_feats, anchors, depths, num_positions);
  const at::Tensor grad_c = grad_feats.contiguous();
  const at::Tensor anchors_c = anchors.to(at::kLong).contiguous();
  const at::Tensor depths_c = depths.to(at::kLong).contiguous();
  const int64_t count = grad_feats.size(0);
  const int64_t width = grad_feats.size(1);
  const int64_t* anchor_ptr = anchors_c.data_ptr<int64_t>();
  const int64_t* depth_ptr = depths_c.data_ptr<int64_t>();
  check_elements_in_range("cod_gather_backward", anchor_ptr, depth_ptr, count, num_positions);

  at::Tensor grad_hidden = cpu::empty_large({num_positions, width}, grad_feats.options());
  at::Tensor grad_mask_hidden = at::empty({width}, grad_feats.options());
  // Each task owns a block of columns and adds every row's contribution to it in opmath (fp32 for half types), in
  // the fixed order of csrc/include/peagle/cod.h (the CUDA kernels add in the same order): duplicate anchors need no
  // atomics, and the result depends neither on the thread count nor on the backend.
  constexpr int64_t kBlock = 64;
  const int64_t num_blocks = (width + kBlock - 1) / kBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_feats.scalar_type(), "cod_gather_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* grad = grad_c.data_ptr<scalar_t>();
    scalar_t* out_hidden = grad_hidden.data_ptr<scalar_t>();
    scalar_t* out_mask = grad_mask_hidden.data_ptr<scalar_t>();
    at::parallel_for(0, num_blocks, 1, [&](int64_t block_begin, int64_t block_end) {
      std::vector<acc_t> hidden_acc(static_cast<size_t>(num_positions) * kBlock);
      std::vector<acc_t> mask_acc(kBlock);
      std::vector<acc_t> chunk_acc(kBlock);
      for (int64_t block = block_begin; block < block_end; ++block) {
        const int64_t col0 = block * kBlock;
        const int64_t cols = std::min(kBlock, width - col0);
        std::fill(hidden_acc.begin(), hidden_acc.end(), acc_t(0));
        std::fill(mask_acc.begin(), mask_acc.end(), acc_t(0));
        for (int64_t chunk = 0; chunk < count; chunk += cod::kBackwardChunk) {
          std::fill(chunk_acc.begin(), chunk_acc.end(), acc_t(0));
          const int64_t chunk_end = std::min(count, chunk + cod::kBackwardChunk);
          for (int64_t i = chunk; i < chunk_end; ++i) {
            const scalar_t* src = grad + i * width + col0;
            acc_t* dst = depth_ptr[i] == 0 ? hidden_acc.data() + anchor_ptr[i] * cols : chunk_acc.data();
            for (int64_t j = 0; j < cols; ++j) dst[j] += static_cast<acc_t>(src[j]);
          }
          for (int64_t j = 0; j < cols; ++j) mask_acc[j] += chunk_acc[j];
        }
        for (int64_t t = 0; t < num_positions; ++t) {
          for (int64_t j = 0; j < cols; ++j) out_hidden[t * width + col0 + j] = hidden_acc[t * cols + j];
        }
        for (int64_t j = 0; j < cols; ++j) out_mask[col0 + j] = mask_acc[j];
      }
    });
  });
  return {grad_hidden, grad_mask_hidden};
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("cod_sample", &peagle::cod_sample_cpu);
  m.impl("cod_gather", &peagle::cod_gather_cpu);
  m.impl("cod_gather_backward", &peagle::cod_gather_backward_cpu);
}
