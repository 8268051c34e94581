// CUDA kernels of the tree construction family (see tree_build_kernels.h). Exactness: every order is the CPU kernel's
// (tree::prob_before, score_before, node_before), every score the same chain of IEEE double multiplications
// (tree::mul_rn), so the outputs equal csrc/cpu/tree_build_cpu.cpp's bit for bit. The top-k sets come from a radix
// select on tree::prob_key / score_key, whose order is the value order, with ties taken in index order; the selected
// items are then ranked by counting, with the comparison the CPU sorts with (quadratic in k: meant for k up to a few
// thousand, as draft trees are).
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "peagle/deferred.h"
#include "peagle/tree.h"
#include "tree_build_kernels.h"

namespace peagle {
namespace cuda {
namespace {

constexpr int kRowThreads = 512;     // per draft row: streams V entries
constexpr int kSelectThreads = 256;  // per request: N nodes
static_assert(kRowThreads % 32 == 0 && kSelectThreads % 32 == 0, "select_top works on whole warps");
constexpr int64_t kMaxGrid = int64_t{1} << 30;

template <int kThreads>
struct SelectShared {
  typename cub::BlockScan<int32_t, kThreads>::TempStorage scan;
  unsigned int hist[256];
  uint64_t prefix;            // the threshold key's digits found so far
  int64_t want;               // rank of the threshold among the keys that share `prefix`
  unsigned long long filled;  // items written so far
  int64_t equal_seen;         // keys equal to the threshold seen so far, in index order
  unsigned long long first;   // first bad index (row check) or failing candidate
  int32_t ok;
};

// Writes the k items of [begin, end) that rank first by (key descending, then the smaller index) to out[0, k), in no
// particular order. key_of(i) is an unsigned key of `key_bits` bits (a multiple of 8). Called by the whole block.
template <int kThreads, typename KeyOf>
__device__ void select_top(const KeyOf& key_of, int key_bits, int64_t begin, int64_t end, int64_t k, int64_t* out,
                           SelectShared<kThreads>& s) {
  if (k == 0) return;
  if (k == end - begin) {  // everything is kept: no select
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) out[i - begin] = i;
    __syncthreads();
    return;
  }
  if (threadIdx.x == 0) {
    s.prefix = 0;
    s.want = k;
    s.filled = 0;
    s.equal_seen = 0;
  }
  uint64_t mask = 0;
  for (int shift = key_bits - 8; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) s.hist[i] = 0;
    __syncthreads();
    const uint64_t prefix = s.prefix;
    // Warp-aggregated counts: probability rows put most keys in a few bins, and one shared atomic per lane on the
    // same bin would serialise the warp. Every lane runs every iteration (the bound is the block's), so the full mask
    // is valid; a lane without a key takes a value no other lane has.
    const unsigned lane = threadIdx.x % 32;
    for (int64_t base = begin; base < end; base += blockDim.x) {
      const int64_t i = base + threadIdx.x;
      unsigned bin = 256 + lane;
      if (i < end) {
        const uint64_t key = key_of(i);
        if ((key & mask) == prefix) bin = static_cast<unsigned>((key >> shift) & 255u);
      }
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (bin < 256 && lane == static_cast<unsigned>(__ffs(peers) - 1))
        atomicAdd(&s.hist[bin], static_cast<unsigned>(__popc(peers)));
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the digit holding the want-th largest key (digit 0 when no larger one does)
      int64_t above = 0;
      int digit = 255;
      for (; digit > 0 && above + s.hist[digit] < s.want; --digit) above += s.hist[digit];
      s.want -= above;
      s.prefix |= static_cast<uint64_t>(digit) << shift;
    }
    mask |= uint64_t{255} << shift;
    __syncthreads();
  }
  // Keys above the threshold are all kept; of those equal to it, the first `want` in index order.
  const uint64_t threshold = s.prefix;
  const int64_t want_equal = s.want;
  using Scan = cub::BlockScan<int32_t, kThreads>;
  for (int64_t base = begin; base < end; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const bool inside = i < end;
    const uint64_t key = inside ? key_of(i) : 0;
    const int32_t equal = inside && key == threshold ? 1 : 0;
    int32_t before = 0, total = 0;
    Scan(s.scan).ExclusiveSum(equal, before, total);
    if (inside && (key > threshold || (equal && s.equal_seen + before < want_equal))) {
      out[atomicAdd(&s.filled, 1ULL)] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) s.equal_seen += total;
    __syncthreads();
  }
}

// Ranks items 0 .. count-1 by counting: item e goes to rank #{f : before(f, e)} (before is a strict total order), and
// write(rank, e) stores it. Called by the whole block after the items are visible.
template <typename Before, typename Write>
__device__ void rank_sort(int64_t count, const Before& before, const Write& write) {
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
    int64_t rank = 0;
    for (int64_t f = 0; f < count; ++f) rank += before(f, e) ? 1 : 0;
    write(rank, e);
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------------------------------
// Per-row top-k.

__global__ void __launch_bounds__(kRowThreads) row_topk_kernel(RowTopkArgs a) {
  __shared__ SelectShared<kRowThreads> s;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const float* row = a.probs + r * a.vocab;
    if (threadIdx.x == 0) s.first = static_cast<unsigned long long>(a.vocab);
    __syncthreads();
    for (int64_t y = threadIdx.x; y < a.vocab; y += blockDim.x) {
      if (!tree::draft_entry_ok(row[y])) atomicMin(&s.first, static_cast<unsigned long long>(y));
    }
    __syncthreads();
    const int64_t bad = static_cast<int64_t>(s.first);
    if (threadIdx.x == 0) a.bad[r] = bad < a.vocab ? bad : -1;
    if (bad < a.vocab) {  // the request fails; its ids are never read
      __syncthreads();
      continue;
    }
    const int64_t d = r % a.depths, k = a.levels != nullptr ? a.levels[d].k : a.k;
    int64_t* ids = a.levels != nullptr ? a.ids + (r / a.depths) * a.ids_stride + a.levels[d].ids_offset : a.ids + r * k;
    int64_t* chosen = a.scratch + r * a.scratch_stride;
    select_top([row](int64_t y) { return static_cast<uint64_t>(tree::prob_key(row[y])); }, 32, 0, a.vocab, k, chosen,
               s);
    __syncthreads();
    rank_sort(
        k,
        [row, chosen](int64_t e, int64_t f) {
          return tree::prob_before(row[chosen[e]], chosen[e], row[chosen[f]], chosen[f]);
        },
        [ids, chosen](int64_t rank, int64_t e) { ids[rank] = chosen[e]; });
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// Tree layout of the kept candidates (the CPU kernel's select_request, after its selection).

// Lays out request b's tree from the `keep` chosen candidates (depth and score of each in the scratch): nodes by
// depth, then score, then candidate index. Candidates: token(c) and parent(c) of candidate index c.
template <typename Candidates>
__device__ void write_tree(const Candidates& c, int64_t b, int64_t keep, const SpecOut& o, const SelectScratch& sc,
                           SelectShared<kSelectThreads>& s) {
  const int64_t n = o.nodes;
  const int64_t* chosen = sc.chosen + b * n;
  const int64_t* depth = sc.depth + b * n;
  const double* score = sc.score + b * n;
  int64_t* order = sc.order + b * n;
  rank_sort(
      keep,
      [=](int64_t e, int64_t f) {
        return tree::node_before(depth[e], score[e], chosen[e], depth[f], score[f], chosen[f]);
      },
      [=](int64_t rank, int64_t e) { order[rank] = e; });
  int64_t* parent = o.parent + b * n;
  int32_t* has_child = sc.has_child + b * n;
  for (int64_t k = threadIdx.x; k < keep; k += blockDim.x) {
    const int64_t e = order[k];
    int64_t p = -1;
    if (k > 0) {
      const int64_t parent_candidate = c.parent(chosen[e]);
      for (int64_t q = 0; q < keep && p < 0; ++q) p = chosen[order[q]] == parent_candidate ? q : -1;
    }
    o.tokens[b * n + k] = c.token(chosen[e]);
    parent[k] = p;
    o.depth[b * n + k] = depth[e];
    o.scores[b * n + k] = score[e];
    has_child[k] = 0;
  }
  if (threadIdx.x == 0) o.num_nodes[b] = keep;
  __syncthreads();
  bool* mask = o.mask + b * n * n;
  int32_t* packed = o.packed + b * n * o.words;
  for (int64_t k = threadIdx.x; k < keep; k += blockDim.x) {  // row k: k and its ancestors
    for (int64_t node = k; node >= 0; node = parent[node]) {
      mask[k * n + node] = true;
      packed[k * o.words + node / 32] |= static_cast<int32_t>(uint32_t{1} << (node % 32));
    }
    if (k > 0) has_child[parent[k]] = 1;
  }
  __syncthreads();
  // Leaves in node order; the path of a leaf holds each ancestor at its depth.
  using Scan = cub::BlockScan<int32_t, kSelectThreads>;
  int64_t leaves = 0;
  for (int64_t base = 0; base < keep; base += blockDim.x) {
    const int64_t k = base + threadIdx.x;
    const int32_t leaf = k < keep && has_child[k] == 0 ? 1 : 0;
    int32_t before = 0, total = 0;
    Scan(s.scan).ExclusiveSum(leaf, before, total);
    if (leaf) {
      int64_t* path = o.paths + (b * n + leaves + before) * o.path_len;
      for (int64_t node = k, level = o.depth[b * n + k]; node >= 0; node = parent[node], --level) path[level] = node;
    }
    leaves += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) o.num_paths[b] = leaves;
}

// ---------------------------------------------------------------------------------------------------------------------
// P-EAGLE parallel trees: the Cartesian candidate tree of request b, computed from a candidate's index (never stored).

struct Cartesian {
  const float* probs;  // request b's [K, V] rows
  const int64_t* ids;  // request b's top-k ids, level d's at levels[d].ids_offset
  const Level* levels;
  int64_t depths;
  int64_t vocab;

  // Depth - 1 of candidate i >= 1: the last level starting at or before i.
  __device__ int64_t level_of(int64_t i) const {
    int64_t lo = 0, hi = depths - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (levels[mid].start <= i) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }
  // Level l's top-k rank on the path to candidate i (at level d, offset o): the CPU pushes children rank-minor.
  __device__ int64_t rank_at(int64_t l, int64_t d, int64_t o) const {
    return (o / (levels[d].size / levels[l].size)) % levels[l].k;
  }
  __device__ int64_t token(int64_t i) const {
    if (i == 0) return -1;
    const int64_t d = level_of(i);
    return ids[levels[d].ids_offset + (i - levels[d].start) % levels[d].k];
  }
  __device__ int64_t parent(int64_t i) const {
    const int64_t d = level_of(i);
    return d == 0 ? 0 : levels[d - 1].start + (i - levels[d].start) / levels[d].k;
  }
  // The root's score 1, times each path token's probability, root to leaf (the CPU's parent score * p).
  __device__ double score(int64_t i) const {
    if (i == 0) return 1.0;
    const int64_t d = level_of(i), o = i - levels[d].start;
    double s = 1.0;
    for (int64_t l = 0; l <= d; ++l) {
      const int64_t token = ids[levels[l].ids_offset + rank_at(l, d, o)];
      s = tree::mul_rn(s, static_cast<double>(probs[l * vocab + token]));
    }
    return s;
  }
};

__global__ void __launch_bounds__(kSelectThreads) build_parallel_kernel(BuildParallelArgs a) {
  __shared__ SelectShared<kSelectThreads> s;
  const int64_t b = blockIdx.x;
  if (threadIdx.x == 0) {  // the first depth whose row has a bad entry fails the request
    s.ok = 1;
    for (int64_t d = 0; d < a.depths && s.ok; ++d) {
      const int64_t bad = a.bad[b * a.depths + d];
      if (bad >= 0) {
        tree::set_error(a.errors, b, tree::kDraftRow, d, bad);
        s.ok = 0;
      }
    }
  }
  __syncthreads();
  if (!s.ok) return;
  const Cartesian c{a.probs + b * a.depths * a.vocab, a.ids + b * a.ids_stride, a.levels, a.depths, a.vocab};
  const int64_t n = a.out.nodes, keep = n < a.candidates ? n : a.candidates;
  int64_t* chosen = a.scratch.chosen + b * n;
  if (threadIdx.x == 0) chosen[0] = 0;
  select_top([c](int64_t i) { return tree::score_key(c.score(i)); }, 64, 1, a.candidates, keep - 1, chosen + 1, s);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < keep; e += blockDim.x) {
    const int64_t i = chosen[e];
    a.scratch.depth[b * n + e] = i == 0 ? 0 : c.level_of(i) + 1;
    a.scratch.score[b * n + e] = c.score(i);
  }
  __syncthreads();
  write_tree(c, b, keep, a.out, a.scratch, s);
}

__global__ void store_levels_kernel(LevelChunk chunk, Level* levels) {
  for (int i = threadIdx.x; i < chunk.count; i += blockDim.x) levels[i] = chunk.levels[i];
}

// ---------------------------------------------------------------------------------------------------------------------
// tree_select: explicit candidates.

struct Explicit {
  const int64_t* tokens;  // request b's rows
  const int64_t* parents;
  __device__ int64_t token(int64_t i) const { return tokens[i]; }
  __device__ int64_t parent(int64_t i) const { return parents[i]; }
};

__global__ void __launch_bounds__(kSelectThreads) tree_select_kernel(TreeSelectArgs a) {
  __shared__ SelectShared<kSelectThreads> s;
  const int64_t b = blockIdx.x;
  const int64_t count = a.count[b];
  const int64_t* parent = a.parent + b * a.m;
  const double* scores = a.scores + b * a.m;
  if (count < 1 || count > a.m) {
    if (threadIdx.x == 0) tree::set_error(a.errors, b, tree::kCandidateCount, 0, count);
    return;
  }
  if (parent[0] != -1) {
    if (threadIdx.x == 0) tree::set_error(a.errors, b, tree::kCandidateRoot, 0, 0);
    return;
  }
  if (threadIdx.x == 0) s.first = static_cast<unsigned long long>(count);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    if (tree::check_candidate(parent, scores, i) != tree::kBuildOk) {
      atomicMin(&s.first, static_cast<unsigned long long>(i));
    }
  }
  __syncthreads();
  const int64_t first = static_cast<int64_t>(s.first);
  if (first < count) {
    if (threadIdx.x == 0) tree::set_error(a.errors, b, tree::check_candidate(parent, scores, first), first, 0);
    return;
  }
  const int64_t n = a.out.nodes, keep = n < count ? n : count;
  int64_t* chosen = a.scratch.chosen + b * n;
  if (threadIdx.x == 0) chosen[0] = 0;
  select_top([scores](int64_t i) { return tree::score_key(scores[i]); }, 64, 1, count, keep - 1, chosen + 1, s);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < keep; e += blockDim.x) {
    int64_t depth = 0;  // the kept set holds every kept node's ancestors, so this walk stays inside it
    for (int64_t i = chosen[e]; i > 0; i = parent[i]) ++depth;
    a.scratch.depth[b * n + e] = depth;
    a.scratch.score[b * n + e] = scores[chosen[e]];
  }
  __syncthreads();
  write_tree(Explicit{a.tokens + b * a.m, parent}, b, keep, a.out, a.scratch, s);
}

// ---------------------------------------------------------------------------------------------------------------------
// tree_expand_topk.

__global__ void __launch_bounds__(kSelectThreads) expand_kernel(ExpandArgs a) {
  __shared__ SelectShared<kSelectThreads> s;
  const int64_t b = blockIdx.x, f_count = a.width, m = a.width * a.topk;
  const double* frontier = a.frontier + b * f_count;
  if (threadIdx.x == 0) {  // frontier scores first, then the rows in order (the CPU kernel's order)
    s.ok = 1;
    for (int64_t f = 0; f < f_count && s.ok; ++f) {
      if (!tree::frontier_score_ok(frontier[f])) {
        tree::set_error(a.errors, b, tree::kFrontierScore, f, 0);
        s.ok = 0;
      }
    }
    for (int64_t f = 0; f < f_count && s.ok; ++f) {
      const int64_t bad = a.bad[b * f_count + f];
      if (bad >= 0) {
        tree::set_error(a.errors, b, tree::kDraftRow, f, bad);
        s.ok = 0;
      }
    }
  }
  __syncthreads();
  if (!s.ok) return;
  const int64_t* ids = a.ids + b * m;  // [F, topk]
  double* flat = a.flat_scores + b * m;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    const int64_t f = i / a.topk;
    const float p = a.probs[(b * f_count + f) * a.vocab + ids[i]];
    flat[i] = tree::mul_rn(frontier[f], static_cast<double>(p));
  }
  __syncthreads();
  const int64_t topk = a.topk;
  int64_t* tokens = a.tokens + b * m;
  int64_t* slots = a.slots + b * m;
  double* scores = a.scores + b * m;
  rank_sort(
      m, [flat](int64_t e, int64_t f) { return tree::score_before(flat[e], e, flat[f], f); },
      [=](int64_t rank, int64_t e) {
        tokens[rank] = ids[e];
        slots[rank] = e / topk;
        scores[rank] = flat[e];
      });
}

// One thread: requests in order, so the recorded error is the one the immediate check raises.
__global__ void publish_error_kernel(const int64_t* errors, int64_t batch, int64_t op, int64_t* record) {
  for (int64_t b = 0; b < batch; ++b) {
    if (errors[3 * b] == tree::kBuildOk) continue;
    auto* claimed = reinterpret_cast<unsigned long long*>(record + deferred::kClaimed);
    if (atomicCAS(claimed, 0ULL, 1ULL) == 0ULL) {
      record[deferred::kOp] = op;
      record[deferred::kCode] = errors[3 * b];
      record[deferred::kRow] = b;
      record[deferred::kIndex] = errors[3 * b + 1];
      record[deferred::kDetail] = errors[3 * b + 2];
    }
    return;
  }
}

unsigned grid(int64_t blocks) { return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid); }

}  // namespace

cudaError_t row_topk(const RowTopkArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return cudaSuccess;
  row_topk_kernel<<<grid(args.rows), kRowThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t store_levels(const LevelChunk& chunk, Level* levels, int64_t first, cudaStream_t stream) {
  store_levels_kernel<<<1, kLevelChunk, 0, stream>>>(chunk, levels + first);
  return cudaGetLastError();
}

cudaError_t build_parallel_select(const BuildParallelArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  build_parallel_kernel<<<static_cast<unsigned>(args.batch), kSelectThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t tree_select(const TreeSelectArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  tree_select_kernel<<<static_cast<unsigned>(args.batch), kSelectThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t expand_topk(const ExpandArgs& args, cudaStream_t stream) {
  if (args.batch == 0) return cudaSuccess;
  expand_kernel<<<static_cast<unsigned>(args.batch), kSelectThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t build_publish_error(const int64_t* errors, int64_t batch, int64_t op, int64_t* record,
                                cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  publish_error_kernel<<<1, 1, 0, stream>>>(errors, batch, op, record);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace peagle
