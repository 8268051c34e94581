// CPU kernel of efficient_lm_head (contract: peagle/ops/lm_head.py).
//
// 1. z = down @ h in float32 (one BLAS call), rounded to the inputs' dtype.
// 2. at::parallel_for over rows, one region: each thread takes the vocabulary in blocks of at most kScoreBudget / N
//    tokens, scores a block for its rows with one BLAS call (a [rows, block] float32 buffer, reused), and offers the
//    scores to each row's bounded top-C buffer. Tokens arrive in increasing id order, so once a buffer has been pruned
//    to its C best keys, a later token can only enter with a strictly higher score than the C-th kept one (a tie would
//    lose on id): a 32-bit comparison rejects almost every token after the first blocks. A full buffer (2C + 64 keys)
//    is pruned back to its C best with nth_element, so the work per token stays O(1) amortised and the memory O(N (C +
//    block)).
// 3. Per row, in the same task: the C best keys sorted descending, their ids, and the exact logits weight[id] . h
//    (float32, 16 partial sums over H, then a fixed pairwise reduction: vectorisable and deterministic).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "checks/lm_head.h"
#include "peagle/lm_head.h"

namespace peagle {
namespace {

constexpr int64_t kScoreBudget = int64_t{1} << 22;  // floats in one block of scores (16 MiB)
constexpr int64_t kMinBlock = 256, kMaxBlock = 4096;
constexpr int kLanes = 16;

int64_t vocab_block(int64_t rows, int64_t vocab) {
  const int64_t block = std::clamp<int64_t>(kScoreBudget / std::max<int64_t>(rows, 1), kMinBlock, kMaxBlock);
  return std::min(block, vocab);
}

// One row's bounded candidate buffer: keys[0, count), and the score bits a new token must beat once it was pruned.
struct RowBuffer {
  uint64_t* keys;
  int64_t count;
  uint32_t floor_bits;  // 0 until the first prune: every token enters
};

void prune(RowBuffer& row, int64_t keep) {
  if (row.count <= keep) return;
  std::nth_element(row.keys, row.keys + keep - 1, row.keys + row.count, std::greater<uint64_t>());
  row.count = keep;
  row.floor_bits = static_cast<uint32_t>(row.keys[keep - 1] >> 32);
}

void offer(RowBuffer& row, const float* scores, int64_t first_id, int64_t count, int64_t keep, int64_t capacity) {
  for (int64_t i = 0; i < count; ++i) {
    if (lm_head::ordered_bits(scores[i]) <= row.floor_bits) continue;
    row.keys[row.count++] = lm_head::make_key(scores[i], first_id + i);
    if (row.count == capacity) prune(row, keep);
  }
}

template <typename T>
float dot(const T* w, const float* h, int64_t size) {
  float acc[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= size; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += static_cast<float>(w[k + l]) * h[k + l];
  }
  for (int l = 0; k < size; ++k, ++l) acc[l] += static_cast<float>(w[k]) * h[k];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  }
  return acc[0];
}

// Rows [begin, end): every vocabulary block scored by one BLAS call into `scores` and offered to the rows' buffers,
// then each row's C best sorted and rescored exactly.
template <typename T>
void rows_task(const LmHeadDims& d, const at::Tensor& z, const at::Tensor& up, const at::Tensor& weight,
               const at::Tensor& h32, std::vector<RowBuffer>& rows, int64_t begin, int64_t end, int64_t* out_ids,
               float* out_logits) {
  const int64_t count = end - begin, block = vocab_block(d.rows, d.vocab), capacity = 2 * d.candidates + 64;
  const at::Tensor z_rows = z.narrow(0, begin, count);
  at::Tensor scores_storage = at::empty({count * block}, z.options());
  for (int64_t v0 = 0; v0 < d.vocab; v0 += block) {
    const int64_t width = std::min(block, d.vocab - v0);
    at::Tensor scores = scores_storage.narrow(0, 0, count * width).view({count, width});
    at::mm_out(scores, z_rows, up.narrow(0, v0, width).to(at::kFloat).t());
    const float* s = scores.data_ptr<float>();
    for (int64_t n = begin; n < end; ++n) offer(rows[n], s + (n - begin) * width, v0, width, d.candidates, capacity);
  }
  const T* w = weight.data_ptr<T>();
  const float* h = h32.data_ptr<float>();
  const int64_t c = d.candidates;
  for (int64_t n = begin; n < end; ++n) {
    RowBuffer& row = rows[n];
    prune(row, c);
    std::sort(row.keys, row.keys + c, std::greater<uint64_t>());
    for (int64_t j = 0; j < c; ++j) {
      const int64_t id = lm_head::key_id(row.keys[j]);
      out_ids[n * c + j] = id;
      out_logits[n * c + j] = dot(w + id * d.hidden, h + n * d.hidden, d.hidden);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> efficient_lm_head_cpu(const at::Tensor& hidden, const at::Tensor& down,
                                                         const at::Tensor& up, const at::Tensor& weight,
                                                         int64_t num_candidates) {
  const LmHeadDims d = check_efficient_lm_head_args(hidden, down, up, weight, num_candidates);
  at::Tensor ids = at::empty({d.rows, d.candidates}, hidden.options().dtype(at::kLong));
  at::Tensor logits = at::empty({d.rows, d.candidates}, hidden.options().dtype(at::kFloat));
  if (d.rows == 0) return {ids, logits};

  const at::Tensor h32 = hidden.to(at::kFloat).contiguous();
  at::Tensor z = at::mm(h32, down.to(at::kFloat).t());
  if (hidden.scalar_type() != at::kFloat) z = z.to(hidden.scalar_type()).to(at::kFloat);

  const int64_t capacity = 2 * d.candidates + 64;
  std::vector<uint64_t> key_storage(static_cast<size_t>(d.rows * capacity));
  std::vector<RowBuffer> rows(d.rows);
  for (int64_t n = 0; n < d.rows; ++n) rows[n] = RowBuffer{key_storage.data() + n * capacity, 0, 0};
  const at::Tensor up_c = up.contiguous(), weight_c = weight.contiguous();
  int64_t* out_ids = ids.data_ptr<int64_t>();
  float* out_logits = logits.data_ptr<float>();
  // One parallel region: each thread scores and rescores its own rows (its BLAS calls run single-threaded inside).
  at::parallel_for(0, d.rows, 1, [&](int64_t begin, int64_t end) {
    // The kernel runs below autograd on the calling thread only: a worker thread's tensor ops (mm_out of inputs that
    // require grad) would reach autograd and be refused without this.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    switch (weight.scalar_type()) {
      case at::kFloat:
        rows_task<float>(d, z, up_c, weight_c, h32, rows, begin, end, out_ids, out_logits);
        break;
      case at::kBFloat16:
        rows_task<c10::BFloat16>(d, z, up_c, weight_c, h32, rows, begin, end, out_ids, out_logits);
        break;
      default:
        rows_task<c10::Half>(d, z, up_c, weight_c, h32, rows, begin, end, out_ids, out_logits);
    }
  });
  return {ids, logits};
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) { m.impl("efficient_lm_head", &peagle::efficient_lm_head_cpu); }
