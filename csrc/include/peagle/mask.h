// Kernel math of the P-EAGLE attention masks, shared by the CPU and CUDA backends (no torch headers).
//
// Element (a, d) of a document; query q may attend to key k when (DESIGN.md)
//   doc(a_q) != -1 and doc(a_q) == doc(a_k) and
//   ((d_k == 0 and a_k <= a_q and (no window or a_k > a_q + d_q - W)) or (a_k == a_q and d_k <= d_q)).
// Block classification never evaluates this per element pair: each block of elements is summarised once (ranges of
// anchors, depths and documents over its valid elements) and a (q block, kv block) pair is classified from the two
// summaries. The tests are exact in one direction each: "empty" only when no pair can be allowed, "full" only when
// every pair is allowed; everything else is "partial" (the mask_mod decides per element).
#pragma once

#include <cstdint>

#include "peagle/common.h"

namespace peagle {
namespace mask {

constexpr int64_t kNoWindow = -1;
constexpr int64_t kBig = INT64_MAX / 4;

// Kinds of a (q block, kv block) pair.
constexpr int8_t kEmpty = 0;
constexpr int8_t kPartial = 1;
constexpr int8_t kFull = 2;

// Lowest depth-0 anchor that query (a, d) may see through the causal term: with window W, a_k > a + d - W.
PEAGLE_HD int64_t causal_low(int64_t a, int64_t d, int64_t window) {
  return window == kNoWindow ? -kBig : a + d - window + 1;
}

// The predicate with the query's causal lower bound given (lowq = causal_low(aq, dq, W), or a mask_slice table entry).
PEAGLE_HD bool allowed_from(int64_t aq, int64_t dq, int64_t docq, int64_t lowq, int64_t ak, int64_t dk, int64_t dock) {
  if (docq == -1 || docq != dock) return false;
  if (ak == aq && dk <= dq) return true;
  return dk == 0 && ak <= aq && ak >= lowq;
}

PEAGLE_HD bool allowed(int64_t aq, int64_t dq, int64_t docq, int64_t ak, int64_t dk, int64_t dock, int64_t window) {
  return allowed_from(aq, dq, docq, causal_low(aq, dq, window), ak, dk, dock);
}

// One row of the dense mask, branch-free over 32-bit key arrays so that the compiler vectorises it (the predicate then
// costs about as much as writing the row). Per key k: doc[k] (-1 = padding), anchor[k], depth[k] and root[k] =
// anchor[k] for depth-0 keys, INT32_MAX otherwise. lo: the window's exclusive lower bound on causal anchors (INT32_MIN:
// none). Callers guarantee anchors, depths and documents fit in int32 (see mask_dense_cpu).
inline void dense_row(bool* row, int64_t n, int32_t aq, int32_t dq, int32_t docq, int32_t lo, const int32_t* doc,
                      const int32_t* anchor, const int32_t* depth, const int32_t* root) {
  if (docq == -1) {
    for (int64_t k = 0; k < n; ++k) row[k] = false;
    return;
  }
  for (int64_t k = 0; k < n; ++k) {
    const int32_t causal = (root[k] <= aq) & (root[k] > lo);
    const int32_t chain = (anchor[k] == aq) & (depth[k] <= dq);
    row[k] = static_cast<bool>((doc[k] == docq) & (causal | chain));
  }
}

// Summary fields of one block, stored as int64 rows of kSummaryFields (valid = document != -1).
enum SummaryField : int {
  kCount = 0,  // elements in the block (the last block may be short)
  kValid,      // valid elements
  kAnchorMin,  // over valid elements
  kAnchorMax,
  kDepthMin,
  kDepthMax,
  kLowMin,  // min of the causal lower bound (causal_low or a mask_slice table entry)
  kLowMax,  // max of it
  kDocMin,
  kDocMax,
  kRoot,           // valid depth-0 elements
  kRootAnchorMin,  // over valid depth-0 elements
  kRootAnchorMax,
  kDeep,           // valid elements of depth >= 1
  kDeepAnchorMin,  // over valid deep elements
  kDeepAnchorMax,
  kDeepDepthMax,
  kSummaryFields
};

PEAGLE_HD int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }
PEAGLE_HD int64_t max64(int64_t x, int64_t y) { return x > y ? x : y; }

// Summarises elements [begin, end) into out[kSummaryFields]; edoc[i] = document of element i's anchor, low[i] = the
// lowest depth-0 anchor it may see causally.
PEAGLE_HD void summarize(const int64_t* anchors, const int64_t* depths, const int64_t* edoc, const int64_t* low,
                         int64_t begin, int64_t end, int64_t* out) {
  int64_t valid = 0, root = 0, deep = 0;
  int64_t amin = kBig, amax = -kBig, dmin = kBig, dmax = -kBig, lmin = kBig, lmax = -kBig;
  int64_t docmin = kBig, docmax = -kBig, rmin = kBig, rmax = -kBig, emin = kBig, emax = -kBig, edmax = -kBig;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t doc = edoc[i];
    if (doc == -1) continue;
    const int64_t a = anchors[i];
    const int64_t d = depths[i];
    ++valid;
    amin = min64(amin, a);
    amax = max64(amax, a);
    dmin = min64(dmin, d);
    dmax = max64(dmax, d);
    lmin = min64(lmin, low[i]);
    lmax = max64(lmax, low[i]);
    docmin = min64(docmin, doc);
    docmax = max64(docmax, doc);
    if (d == 0) {
      ++root;
      rmin = min64(rmin, a);
      rmax = max64(rmax, a);
    } else {
      ++deep;
      emin = min64(emin, a);
      emax = max64(emax, a);
      edmax = max64(edmax, d);
    }
  }
  out[kCount] = end - begin;
  out[kValid] = valid;
  out[kAnchorMin] = amin;
  out[kAnchorMax] = amax;
  out[kDepthMin] = dmin;
  out[kDepthMax] = dmax;
  out[kLowMin] = lmin;
  out[kLowMax] = lmax;
  out[kDocMin] = docmin;
  out[kDocMax] = docmax;
  out[kRoot] = root;
  out[kRootAnchorMin] = rmin;
  out[kRootAnchorMax] = rmax;
  out[kDeep] = deep;
  out[kDeepAnchorMin] = emin;
  out[kDeepAnchorMax] = emax;
  out[kDeepDepthMax] = edmax;
}

// Whether sorted[0..count) holds a value in [lo, hi].
PEAGLE_HD bool any_in_range(const int64_t* sorted, int64_t count, int64_t lo, int64_t hi) {
  int64_t first = 0, last = count;  // lower bound of lo
  while (first < last) {
    const int64_t mid = first + (last - first) / 2;
    if (sorted[mid] < lo) {
      first = mid + 1;
    } else {
      last = mid;
    }
  }
  return first < count && sorted[first] <= hi;
}

// Kind of the pair (q block summary q, kv block summary k). q_anchors: the q block's valid anchors sorted ascending
// (q[kValid] of them), so the own-chain term (which needs a_q == a_k) is ruled out when no q anchor lies in the kv
// block's anchor range: O(log block_size) per pair instead of a range-overlap guess.
PEAGLE_HD int8_t classify(const int64_t* q, const int64_t* k, const int64_t* q_anchors) {
  if (q[kValid] == 0 || k[kValid] == 0) return kEmpty;
  if (q[kDocMax] < k[kDocMin] || k[kDocMax] < q[kDocMin]) return kEmpty;
  // Some allowed pair is possible through the causal depth-0 term or through the own-chain term.
  const bool causal = k[kRoot] > 0 && k[kRootAnchorMin] <= q[kAnchorMax] && k[kRootAnchorMax] >= q[kLowMin];
  const bool chain = k[kDepthMin] <= q[kDepthMax] && any_in_range(q_anchors, q[kValid], k[kAnchorMin], k[kAnchorMax]);
  if (!causal && !chain) return kEmpty;
  // Every pair allowed: all elements valid and in one document, every depth-0 key causally visible (and inside the
  // window) for every query, every deeper key on the query's own chain at a depth not above the query's.
  const bool one_doc = q[kValid] == q[kCount] && k[kValid] == k[kCount] && q[kDocMin] == q[kDocMax] &&
                       k[kDocMin] == k[kDocMax] && q[kDocMin] == k[kDocMin];
  if (!one_doc) return kPartial;
  if (k[kRoot] > 0 && !(k[kRootAnchorMax] <= q[kAnchorMin] && k[kRootAnchorMin] >= q[kLowMax])) {
    return kPartial;
  }
  if (k[kDeep] > 0 && !(q[kAnchorMin] == q[kAnchorMax] && k[kDeepAnchorMin] == q[kAnchorMin] &&
                        k[kDeepAnchorMax] == q[kAnchorMin] && k[kDeepDepthMax] <= q[kDepthMin])) {
    return kPartial;
  }
  return kFull;
}

}  // namespace mask
}  // namespace peagle
