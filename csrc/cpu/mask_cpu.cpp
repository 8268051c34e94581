// CPU kernels of the attention-mask family: the dense boolean mask and the block-sparse classification, from the
// window (mask_dense, mask_block) or sliced from a max-length table (mask_slice_dense, mask_slice_block).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <tuple>

#include "checks/mask.h"
#include "peagle/mask.h"

namespace peagle {
namespace {

// Document of every element's anchor (the predicate only looks at doc(a)).
at::Tensor element_documents(const at::Tensor& anchors_c, const at::Tensor& document_ids) {
  return document_ids.to(at::kLong).index_select(0, anchors_c).contiguous();
}

}  // namespace

// [nb, block_size]: each block's valid anchors sorted ascending, then padding (kBig). ATen ops, shared with CUDA.
at::Tensor sorted_block_anchors(const at::Tensor& anchors_c, const at::Tensor& edoc, int64_t block_size) {
  const int64_t n = anchors_c.size(0);
  const int64_t nb = (n + block_size - 1) / block_size;
  at::Tensor keyed = at::where(edoc.ne(-1), anchors_c, at::scalar_tensor(mask::kBig, anchors_c.options()));
  keyed = at::constant_pad_nd(keyed, {0, nb * block_size - n}, mask::kBig).view({nb, block_size});
  return std::get<0>(keyed.sort(1)).contiguous();
}

at::Tensor window_lows(const at::Tensor& anchors_c, const at::Tensor& depths_c, const c10::optional<int64_t>& window) {
  if (!window.has_value()) return at::full_like(anchors_c, -mask::kBig);
  return anchors_c + depths_c - (*window - 1);
}

at::Tensor table_lows(const at::Tensor& table, const at::Tensor& anchors_c, const at::Tensor& depths_c) {
  // Bounds past +-kBig mean what +-kBig means (anchors are far inside): clamped so summaries stay in their range.
  const at::Tensor flat = table.to(at::kLong).reshape(-1).index_select(0, depths_c * table.size(1) + anchors_c);
  return flat.clamp(-mask::kBig, mask::kBig).contiguous();
}

namespace {

// The general per-cell predicate over int64 fields: only for inputs whose values do not fit the 32-bit row kernel.
void mask_dense_rows_int64(bool* o, int64_t n, const int64_t* a, const int64_t* d, const int64_t* doc,
                           const int64_t* low) {
  at::parallel_for(0, n, std::max<int64_t>(1, 4096 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      bool* row = o + q * n;
      const int64_t aq = a[q], dq = d[q], docq = doc[q], lowq = low[q];
      for (int64_t k = 0; k < n; ++k) row[k] = mask::allowed_from(aq, dq, docq, lowq, a[k], d[k], doc[k]);
    }
  });
}

bool fits_int32(const at::Tensor& t) {
  return t.numel() == 0 || (t.min().item<int64_t>() >= INT32_MIN + 1 && t.max().item<int64_t>() <= INT32_MAX - 1);
}

at::Tensor zeroed_bool_matrix(int64_t n, const at::TensorOptions& options) {
  void* data = std::calloc(static_cast<size_t>(std::max<int64_t>(n * n, 1)), 1);
  TORCH_CHECK(data != nullptr, "peagle: out of memory for a ", n, " x ", n, " mask");
  return at::from_blob(data, {n, n}, [](void* p) { std::free(p); }, options.dtype(at::kBool));
}

// Maximal runs of consecutive elements of one document, grouped by document (runs ascending within a group): a dense
// row evaluates the predicate on its own document's runs only and zero-fills the rest. COD lays out each depth sorted
// by anchor, so a document has about one run per depth.
struct DocumentRuns {
  bool worthwhile = false;   // runs long enough on average for the run walk to beat whole-row evaluation
  at::Tensor begin, end;     // [R] element ranges, grouped by document
  at::Tensor group_start;    // [G + 1] each document's first run
  at::Tensor element_group;  // [N] the group of each element's document
};

DocumentRuns document_runs(const at::Tensor& doc_c) {
  DocumentRuns runs;
  const int64_t n = doc_c.size(0);
  if (n == 0) return runs;
  at::Tensor change = at::ones({n}, doc_c.options().dtype(at::kBool));
  change.slice(0, 1).copy_(doc_c.slice(0, 1).ne(doc_c.slice(0, 0, n - 1)));
  const at::Tensor begin = change.nonzero().view(-1);
  const int64_t count = begin.size(0);
  if (count * 64 > n) return runs;  // under 64 elements per run: per-run overhead would dominate
  const at::Tensor end = at::cat({begin.slice(0, 1), at::full({1}, n, begin.options())});
  const at::Tensor run_doc = doc_c.index_select(0, begin);
  const at::Tensor order = std::get<1>(run_doc.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor sorted_doc = run_doc.index_select(0, order);
  const auto [unique, inverse, counts] = at::unique_consecutive(sorted_doc, false, true);
  runs.worthwhile = true;
  runs.begin = begin.index_select(0, order).contiguous();
  runs.end = end.index_select(0, order).contiguous();
  runs.group_start = at::cat({at::zeros({1}, counts.options()), counts.cumsum(0)}).to(at::kLong).contiguous();
  runs.element_group = at::searchsorted(unique, doc_c).contiguous();
  return runs;
}

// The dense mask of N elements given each query's causal lower bound low[q] (int64 [N]).
at::Tensor dense_from_lows(const at::Tensor& a_c, const at::Tensor& d_c, const at::Tensor& doc_c,
                           const at::Tensor& low) {
  const int64_t n = a_c.size(0);
  if (!(fits_int32(a_c) && fits_int32(d_c) && fits_int32(doc_c))) {
    at::Tensor out = at::empty({n, n}, a_c.options().dtype(at::kBool));
    mask_dense_rows_int64(out.data_ptr<bool>(), n, a_c.data_ptr<int64_t>(), d_c.data_ptr<int64_t>(),
                          doc_c.data_ptr<int64_t>(), low.data_ptr<int64_t>());
    return out;
  }
  const at::Tensor a32 = a_c.to(at::kInt), d32 = d_c.to(at::kInt), doc32 = doc_c.to(at::kInt);
  const at::Tensor root32 = at::where(d_c.eq(0), a_c, at::scalar_tensor(INT32_MAX, a_c.options())).to(at::kInt);
  // Causal keys need a_k >= low: the exclusive bound low - 1, clamped into int32 (anchors fit in int32).
  const at::Tensor lo32 = (low.clamp(INT64_MIN + 1) - 1).clamp(INT32_MIN, INT32_MAX).to(at::kInt);
  const int32_t* a = a32.data_ptr<int32_t>();
  const int32_t* d = d32.data_ptr<int32_t>();
  const int32_t* doc = doc32.data_ptr<int32_t>();
  const int32_t* root = root32.data_ptr<int32_t>();
  const int32_t* lo = lo32.data_ptr<int32_t>();
  const DocumentRuns runs = document_runs(doc_c);
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(n, 1));
  if (!runs.worthwhile) {
    at::Tensor out = at::empty({n, n}, a_c.options().dtype(at::kBool));
    bool* o = out.data_ptr<bool>();
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t q = begin; q < end; ++q) mask::dense_row(o + q * n, n, a[q], d[q], doc[q], lo[q], doc, a, d, root);
    });
    return out;
  }
  // Zeroed by calloc: a large calloc maps fresh zero pages without writing them, and a row writes only its own
  // document's runs, so the other documents' cells cost nothing until read.
  at::Tensor out = zeroed_bool_matrix(n, a_c.options());
  bool* o = out.data_ptr<bool>();
  const int64_t* run_begin = runs.begin.data_ptr<int64_t>();
  const int64_t* run_end = runs.end.data_ptr<int64_t>();
  const int64_t* group_start = runs.group_start.data_ptr<int64_t>();
  const int64_t* group = runs.element_group.data_ptr<int64_t>();
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      if (doc[q] == -1) continue;
      bool* row = o + q * n;
      for (int64_t r = group_start[group[q]]; r < group_start[group[q] + 1]; ++r) {
        const int64_t b = run_begin[r], e = run_end[r];
        mask::dense_row(row + b, e - b, a[q], d[q], doc[q], lo[q], doc + b, a + b, d + b, root + b);
      }
    }
  });
  return out;
}

using Blocks = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The block-sparse tensors of N elements given each element's causal lower bound low[i] (int64 [N]).
Blocks blocks_from_lows(const at::Tensor& a_c, const at::Tensor& d_c, const at::Tensor& doc_c, const at::Tensor& low,
                        int64_t block_size) {
  const int64_t n = a_c.size(0);
  const int64_t nb = (n + block_size - 1) / block_size;
  const int64_t* a = a_c.data_ptr<int64_t>();
  const int64_t* d = d_c.data_ptr<int64_t>();
  const int64_t* doc = doc_c.data_ptr<int64_t>();
  const int64_t* lows = low.data_ptr<int64_t>();

  // O(N): one summary per block.
  at::Tensor summary = at::empty({nb, mask::kSummaryFields}, a_c.options());
  int64_t* s = summary.data_ptr<int64_t>();
  at::parallel_for(0, nb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      mask::summarize(a, d, doc, lows, b * block_size, std::min(n, (b + 1) * block_size), s + b * mask::kSummaryFields);
    }
  });

  const at::Tensor q_sorted = sorted_block_anchors(a_c, doc_c, block_size);
  const int64_t* q_sorted_p = q_sorted.data_ptr<int64_t>();

  // O(blocks^2 log block_size): classify every pair from the summaries, compacting partial and full kv blocks per q
  // block.
  const auto int_opts = a_c.options().dtype(at::kInt);
  at::Tensor kv_num = at::empty({nb}, int_opts);
  at::Tensor kv_idx = at::zeros({nb, nb}, int_opts);
  at::Tensor full_num = at::empty({nb}, int_opts);
  at::Tensor full_idx = at::zeros({nb, nb}, int_opts);
  int32_t* kv_num_p = kv_num.data_ptr<int32_t>();
  int32_t* kv_idx_p = kv_idx.data_ptr<int32_t>();
  int32_t* full_num_p = full_num.data_ptr<int32_t>();
  int32_t* full_idx_p = full_idx.data_ptr<int32_t>();
  at::parallel_for(0, nb, std::max<int64_t>(1, 2048 / std::max<int64_t>(nb, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t qb = begin; qb < end; ++qb) {
      const int64_t* qs = s + qb * mask::kSummaryFields;
      int32_t partial = 0, full = 0;
      int32_t* kv_row = kv_idx_p + qb * nb;
      int32_t* full_row = full_idx_p + qb * nb;
      for (int64_t kb = 0; kb < nb; ++kb) {
        const int8_t kind = mask::classify(qs, s + kb * mask::kSummaryFields, q_sorted_p + qb * block_size);
        if (kind == mask::kPartial) kv_row[partial++] = static_cast<int32_t>(kb);
        if (kind == mask::kFull) full_row[full++] = static_cast<int32_t>(kb);
      }
      kv_num_p[qb] = partial;
      full_num_p[qb] = full;
    }
  });
  return {kv_num, kv_idx, full_num, full_idx};
}

at::Tensor mask_dense_cpu(const at::Tensor& anchors, const at::Tensor& depths, const at::Tensor& document_ids,
                          c10::optional<int64_t> window) {
  check_mask_elements("mask_dense", anchors, depths, document_ids, window);
  const at::Tensor a_c = anchors.to(at::kLong).contiguous();
  const at::Tensor d_c = depths.to(at::kLong).contiguous();
  return dense_from_lows(a_c, d_c, element_documents(a_c, document_ids), window_lows(a_c, d_c, window));
}

Blocks mask_block_cpu(const at::Tensor& anchors, const at::Tensor& depths, const at::Tensor& document_ids,
                      int64_t block_size, c10::optional<int64_t> window) {
  check_mask_block_args(anchors, depths, document_ids, block_size, window);
  const at::Tensor a_c = anchors.to(at::kLong).contiguous();
  const at::Tensor d_c = depths.to(at::kLong).contiguous();
  return blocks_from_lows(a_c, d_c, element_documents(a_c, document_ids), window_lows(a_c, d_c, window), block_size);
}

at::Tensor mask_slice_dense_cpu(const at::Tensor& table, const at::Tensor& anchors, const at::Tensor& depths,
                                const at::Tensor& document_ids) {
  check_mask_slice_args("mask_slice_dense", table, anchors, depths, document_ids);
  const at::Tensor a_c = anchors.to(at::kLong).contiguous();
  const at::Tensor d_c = depths.to(at::kLong).contiguous();
  return dense_from_lows(a_c, d_c, element_documents(a_c, document_ids), table_lows(table, a_c, d_c));
}

Blocks mask_slice_block_cpu(const at::Tensor& table, const at::Tensor& anchors, const at::Tensor& depths,
                            const at::Tensor& document_ids, int64_t block_size) {
  check_mask_slice_args("mask_slice_block", table, anchors, depths, document_ids);
  check_block_size("mask_slice_block", block_size);
  const at::Tensor a_c = anchors.to(at::kLong).contiguous();
  const at::Tensor d_c = depths.to(at::kLong).contiguous();
  return blocks_from_lows(a_c, d_c, element_documents(a_c, document_ids), table_lows(table, a_c, d_c), block_size);
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_IMPL(peagle, CPU, m) {
  m.impl("mask_dense", &peagle::mask_dense_cpu);
  m.impl("mask_block", &peagle::mask_block_cpu);
  m.impl("mask_slice_dense", &peagle::mask_slice_dense_cpu);
  m.impl("mask_slice_block", &peagle::mask_slice_block_cpu);
}
