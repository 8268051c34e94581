// CUDA kernels of the Gated DeltaNet family. No torch headers here (compile time); see gdn_kernels.h for the
// contracts and peagle/gdn.h for the closed form over the tree and the fp32 operation order both backends share (the
// results are bit-identical to the CPU kernels').
//
// Verification runs in two kernels:
//   1. gdn_qk_kernel, one block per (request, q/k head): the q/k norm factors and the normalised Gram entries
//      q_i.k_j, k_i.k_j of ancestor-or-self pairs. They depend on the q/k head only, so they are computed once and
//      shared (through a global scratch buffer) by every value head of the group and every column tile.
//   2. gdn_tree_verify_kernel, one block per (tile of 32 value columns, value head, request), 256 threads: each warp
//      projects the committed state's columns onto the k and q rows of every eighth node (S0 is read exactly once per
//      block, staged in shared memory with the q/k rows, chunk by chunk along K), the block derives the decayed
//      coefficients, one warp runs the forward substitution of its 32 columns, and all warps form the outputs.
// Shared memory is sized to the tree's n (under 40 KB at n = 64, so no opt-in above the 48 KB default is needed).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if defined(PEAGLE_WITH_CUTLASS)
#include <cute/arch/mma_sm80.hpp>
#endif

#include "float_convert.cuh"
#include "gdn_kernels.h"
#include "peagle/deferred.h"
#include "peagle/gdn.h"

namespace peagle {
namespace cuda {
namespace {

constexpr int kThreads = 256;              // both verification kernels
constexpr int kTile = 32;                  // value columns per verification block (a warp's width)
constexpr int kGroups = kThreads / kTile;  // node groups (one warp each) of the projections and outputs
constexpr int kNodesPerGroup = gdn::kMaxNodes / kGroups;
constexpr int kPairsPerThread = gdn::kMaxNodes * gdn::kMaxNodes / kThreads;  // Gram entries per thread
constexpr int kChunk = 32;                                                   // K rows of q/k/S0 staged per step
constexpr int kStride = kChunk + 1;  // padded rows: Gram reads of different nodes hit different banks

// Scratch of one (request, q/k head): f^q [n], f^k [n], qk [n, n], kk [n, n].
__host__ __device__ constexpr int64_t qk_scratch_floats(int64_t n) { return 2 * n + 2 * n * n; }

constexpr size_t qk_smem_bytes(int64_t n) { return sizeof(uint64_t) * n + sizeof(float) * (2 * n * kStride + 2 * n); }

constexpr size_t max_size(size_t a, size_t b) { return a > b ? a : b; }

// anc (u64) | gate_sum, beta, root, self | u, o column tiles | (q, k, S0 chunks) or (a, b triangles) overlaid.
constexpr size_t verify_smem_bytes(int64_t n) {
  return sizeof(uint64_t) * n + sizeof(float) * (4 * n + 2 * n * kTile) +
         sizeof(float) * max_size(2 * n * kStride + kChunk * kTile, 2 * static_cast<size_t>(n * (n - 1) / 2));
}
constexpr size_t kDefaultSmem = 48 * 1024;
static_assert(verify_smem_bytes(gdn::kMaxNodes) <= kDefaultSmem && qk_smem_bytes(gdn::kMaxNodes) <= kDefaultSmem,
              "the verification kernels would need a shared-memory opt-in");

// Stages raw rows [r0, r0 + width) of q and k of every node (fp32) at q_c / k_c with row stride kStride.
template <typename T>
__device__ void stage_qk(const T* __restrict__ q, const T* __restrict__ k, const GdnStrides& st, int64_t b, int64_t h,
                         int n, int64_t r0, int width, float* q_c, float* k_c) {
  for (int idx = threadIdx.x; idx < n * kChunk; idx += blockDim.x) {
    const int i = idx / kChunk, r = idx - (idx / kChunk) * kChunk;
    q_c[i * kStride + r] = r < width ? to_acc(q[st.q.at(b, i, h) + r0 + r]) : 0.0f;  // zero tail: the mma path reads it
    k_c[i * kStride + r] = r < width ? to_acc(k[st.k.at(b, i, h) + r0 + r]) : 0.0f;
  }
}

// The exact projections of one chunk: warp `group` accumulates, in increasing r, the columns of its nodes
// i = group + m * kGroups (the fp32 order of peagle/gdn.h).
__device__ void project_chunk_exact(int n, int width, int group, int lane, const float* q_c, const float* k_c,
                                    const float* s0_c, float* pk, float* pq) {
#pragma unroll
  for (int m = 0; m < kNodesPerGroup; ++m) {
    const int i = group + m * kGroups;
    if (i >= n) continue;
    for (int r = 0; r < width; ++r) {
      pk[m] = gdn::state_mac(pk[m], k_c[i * kStride + r], s0_c[r * kTile + lane]);
      pq[m] = gdn::state_mac(pq[m], q_c[i * kStride + r], s0_c[r * kTile + lane]);
    }
  }
}

#if defined(PEAGLE_WITH_CUTLASS)
// Tensor-core projections (TF32 inputs, fp32 accumulation; opt-in, tested against the exact path within a
// tolerance): warp w computes the 16-node tile w % 4 of the k rows (w < 4) or the q rows (w >= 4) times the S0 chunk
// [kChunk, kTile] with the m16n8k8 TF32 mma of CuTe, four 8-column tiles at a time. Fragment layouts: PTX ISA,
// mma.m16n8k8 .tf32 (groupID = lane / 4, tig = lane % 4).
constexpr int kMmaColumnTiles = kTile / 8;

__device__ uint32_t to_tf32(float x) {
  uint32_t bits;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
  return bits;
}

__device__ void project_chunk_mma(int n, int group, int lane, const float* q_c, const float* k_c, const float* s0_c,
                                  float (&acc)[kMmaColumnTiles][4]) {
  const int row0 = (group % 4) * 16;
  if (row0 >= n) return;
  const float* a = group < 4 ? k_c : q_c;
  const int gid = lane / 4, tig = lane % 4;
  // Rows past the tree read the last node (their results are never stored): no read outside the staging.
  const int r_lo = min(row0 + gid, n - 1), r_hi = min(row0 + gid + 8, n - 1);
#pragma unroll
  for (int k8 = 0; k8 < kChunk; k8 += 8) {
    const uint32_t a0 = to_tf32(a[r_lo * kStride + k8 + tig]), a1 = to_tf32(a[r_hi * kStride + k8 + tig]);
    const uint32_t a2 = to_tf32(a[r_lo * kStride + k8 + tig + 4]), a3 = to_tf32(a[r_hi * kStride + k8 + tig + 4]);
#pragma unroll
    for (int t = 0; t < kMmaColumnTiles; ++t) {
      const uint32_t b0 = to_tf32(s0_c[(k8 + tig) * kTile + t * 8 + gid]);
      const uint32_t b1 = to_tf32(s0_c[(k8 + tig + 4) * kTile + t * 8 + gid]);
      cute::SM80_16x8x8_F32TF32TF32F32_TN::fma(acc[t][0], acc[t][1], acc[t][2], acc[t][3], a0, a1, a2, a3, b0, b1,
                                               acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
    }
  }
}

// Scales the warp's accumulators by the norm factors and stores them as rows of u_s (k) or o_s (q).
__device__ void store_mma(int n, int group, int lane, const float (&acc)[kMmaColumnTiles][4], const float* fk,
                          const float* fq, float* u_s, float* o_s) {
  const int row0 = (group % 4) * 16, gid = lane / 4, tig = lane % 4;
  const float* factor = group < 4 ? fk : fq;
  float* out = group < 4 ? u_s : o_s;
#pragma unroll
  for (int t = 0; t < kMmaColumnTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + gid + (e >= 2 ? 8 : 0), column = t * 8 + 2 * tig + (e & 1);
      if (row < n) out[row * kTile + column] = gdn::mul_rn(acc[t][e], factor[row]);
    }
  }
}
#endif

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gdn_qk_kernel(const T* __restrict__ q, const T* __restrict__ k, const int64_t* __restrict__ parent, GdnShape s,
                  GdnStrides st, float scale, bool l2norm, float* __restrict__ scratch, int64_t batch_offset) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int n = static_cast<int>(s.nodes);
  const int64_t K = s.key_dim, b = batch_offset + blockIdx.y, h = blockIdx.x;
  const int tid = threadIdx.x;
  uint64_t* anc = reinterpret_cast<uint64_t*>(smem);
  float* q_c = reinterpret_cast<float*>(anc + n);
  float* k_c = q_c + n * kStride;
  float* fq_s = k_c + n * kStride;
  float* fk_s = fq_s + n;
  __shared__ int bad;
  if (tid == 0)
    bad = gdn::build_tree(parent + b * n, n, static_cast<const float*>(nullptr), 1, anc, nullptr, nullptr) >= 0;
  __syncthreads();
  if (bad) return;  // the verification kernel writes NaN for this request

  float raw_qk[kPairsPerThread] = {}, raw_kk[kPairsPerThread] = {};
  float ssq = 0.0f, ssk = 0.0f;
  for (int64_t r0 = 0; r0 < K; r0 += kChunk) {
    const int width = static_cast<int>(K - r0 < kChunk ? K - r0 : kChunk);
    stage_qk(q, k, st, b, h, n, r0, width, q_c, k_c);
    __syncthreads();
    if (tid < n) {
      for (int r = 0; r < width; ++r) {
        ssq = gdn::mac(ssq, q_c[tid * kStride + r], q_c[tid * kStride + r]);
        ssk = gdn::mac(ssk, k_c[tid * kStride + r], k_c[tid * kStride + r]);
      }
    }
#pragma unroll
    for (int m = 0; m < kPairsPerThread; ++m) {
      const int idx = tid + m * kThreads, i = idx / n, j = idx - (idx / n) * n;
      if (idx >= n * n || ((anc[i] >> j) & 1ull) == 0) continue;
      for (int r = 0; r < width; ++r) {
        raw_qk[m] = gdn::mac(raw_qk[m], q_c[i * kStride + r], k_c[j * kStride + r]);
        raw_kk[m] = gdn::mac(raw_kk[m], k_c[i * kStride + r], k_c[j * kStride + r]);
      }
    }
    __syncthreads();  // before the next chunk overwrites q_c / k_c
  }
  float* out = scratch + (b * s.qk_heads + h) * qk_scratch_floats(n);
  if (tid < n) {
    out[tid] = fq_s[tid] = gdn::row_factor(ssq, l2norm, scale);
    out[n + tid] = fk_s[tid] = gdn::row_factor(ssk, l2norm, 1.0f);
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < kPairsPerThread; ++m) {
    const int idx = tid + m * kThreads, i = idx / n, j = idx - (idx / n) * n;
    if (idx >= n * n || ((anc[i] >> j) & 1ull) == 0) continue;
    out[2 * n + idx] = gdn::gram_entry(raw_qk[m], fq_s[i], fk_s[j]);
    out[2 * n + n * n + idx] = gdn::gram_entry(raw_kk[m], fk_s[i], fk_s[j]);
  }
}

// S: the state type of the pool / cache. gdn_tree_verify: S = float, state_slots == nullptr (the pool is only read).
// gdn_tree_verify_slots: state_slots [B, n] (the cache is written there after the outputs' u is known; it may hold
// the start slot, whose elements each thread reads before it writes them), u == nullptr, claims as in
// gdn_kernels.h (nullable).
template <typename T, typename S, bool kTensorCores>
__global__ void __launch_bounds__(kThreads)
    gdn_tree_verify_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const float* __restrict__ g, const float* __restrict__ beta,
                           const int64_t* __restrict__ parent, S* state_pool, const int64_t* __restrict__ slots,
                           const int64_t* __restrict__ state_slots, const int32_t* __restrict__ claims, GdnShape s,
                           GdnStrides st, const float* __restrict__ scratch, T* __restrict__ o, float* __restrict__ u,
                           int64_t batch_offset) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int n = static_cast<int>(s.nodes);
  const int64_t K = s.key_dim, V = s.value_dim, H = s.qk_heads, HV = s.value_heads;
  const int64_t b = batch_offset + blockIdx.z, hv = blockIdx.y, h = hv / (HV / H);
  const int tid = threadIdx.x, lane = tid % kTile, group = tid / kTile;
  const int64_t col0 = int64_t{blockIdx.x} * kTile, col = col0 + lane;
  const bool active = col < V;

  uint64_t* anc = reinterpret_cast<uint64_t*>(smem);
  float* gate_sum = reinterpret_cast<float*>(anc + n);
  float* beta_s = gate_sum + n;
  float* root = beta_s + n;
  float* self = root + n;
  float* u_s = self + n;
  float* o_s = u_s + n * kTile;
  float* q_c = o_s + n * kTile;  // staging of the projections ...
  float* k_c = q_c + n * kStride;
  float* s0_c = k_c + n * kStride;
  float* coef_a = q_c;  // ... overlaid by the coefficients afterwards
  float* coef_b = coef_a + gdn::triangle_size(n);
  __shared__ int bad;
  __shared__ float decay_s[gdn::kMaxNodes];  // node decays of the written states (gdn_tree_verify_slots)
  __shared__ uint64_t needed;                // nodes whose state is written, or is a written node's ancestor

  if (tid == 0) {
    bad = slots[b] < 0 || slots[b] >= s.pool ||
          gdn::build_tree(parent + b * n, n, g + b * n * HV + hv, HV, anc, nullptr, gate_sum) >= 0;
    needed = 0;
    if (!bad && state_slots != nullptr) {
      // A request with a written slot out of range, or a slot the device claims found contested (written twice,
      // or another request's start slot), writes nothing (gdn_claim_state_slots_kernel, gdn_foreign_starts_kernel).
      bad = claims != nullptr && claims[slots[b]] < 0;
      for (int i = 0; i < n && !bad; ++i) {
        const int64_t slot = state_slots[b * n + i];
        bad = slot < -1 || slot >= s.pool || (slot >= 0 && claims != nullptr && claims[slot] < 0);
        if (slot >= 0) needed |= anc[i];
      }
    }
  }
  for (int i = tid; i < n; i += blockDim.x) beta_s[i] = beta[(b * n + i) * HV + hv];
  __syncthreads();
  if (bad) {  // bad indices: NaN outputs, nothing read out of bounds
    for (int idx = tid; idx < n * kTile; idx += blockDim.x) {
      const int64_t i = idx / kTile, c = col0 + idx % kTile;
      if (c >= V) continue;
      const int64_t out = ((b * n + i) * HV + hv) * V + c;
      if (u != nullptr) u[out] = __int_as_float(0x7fc00000);
      o[out] = from_acc<T>(__int_as_float(0x7fc00000));
    }
    return;
  }
  const float* products = scratch + (b * H + h) * qk_scratch_floats(n);
  const float *fq = products, *fk = products + n, *qk = products + 2 * n, *kk = qk + n * n;

  // Projections of the committed state's columns onto the raw k and q rows, every sum in increasing r.
  const S* s0 = state_pool + st.pool.at(slots[b], hv, 0);
  float pk[kNodesPerGroup] = {}, pq[kNodesPerGroup] = {};
#if defined(PEAGLE_WITH_CUTLASS)
  float acc[kMmaColumnTiles][4] = {};
  constexpr bool kUseMma = kTensorCores;
#else
  constexpr bool kUseMma = false;  // without the CuTe headers every launch takes the exact path
#endif
  for (int64_t r0 = 0; r0 < K; r0 += kChunk) {
    const int width = static_cast<int>(K - r0 < kChunk ? K - r0 : kChunk);
    stage_qk(q, k, st, b, h, n, r0, width, q_c, k_c);
    for (int idx = tid; idx < kChunk * kTile; idx += blockDim.x) {
      const int r = idx / kTile, c = idx % kTile;
      s0_c[idx] = r < width && col0 + c < V ? to_acc(s0[(r0 + r) * st.pool.inner + col0 + c]) : 0.0f;
    }
    __syncthreads();
#if defined(PEAGLE_WITH_CUTLASS)
    if constexpr (kTensorCores) project_chunk_mma(n, group, lane, q_c, k_c, s0_c, acc);
#endif
    if constexpr (!kUseMma) project_chunk_exact(n, width, group, lane, q_c, k_c, s0_c, pk, pq);
    __syncthreads();  // before the next chunk (or the coefficients) overwrite the staging
  }
#if defined(PEAGLE_WITH_CUTLASS)
  if constexpr (kTensorCores) store_mma(n, group, lane, acc, fk, fq, u_s, o_s);
#endif
  if constexpr (!kUseMma) {
#pragma unroll
    for (int m = 0; m < kNodesPerGroup; ++m) {
      const int i = group + m * kGroups;
      if (i >= n) continue;
      u_s[i * kTile + lane] = gdn::mul_rn(pk[m], fk[i]);
      o_s[i * kTile + lane] = gdn::mul_rn(pq[m], fq[i]);
    }
  }
  for (int i = tid; i < n; i += blockDim.x) {
    root[i] = gdn::exp_rn(gate_sum[i]);
    self[i] = qk[i * n + i];
  }
  for (int idx = tid; idx < n * n; idx += blockDim.x) {
    const int i = idx / n, j = idx - (idx / n) * n;
    if (j >= i || ((anc[i] >> j) & 1ull) == 0) continue;
    coef_a[gdn::triangle_index(i, j)] = gdn::decayed(gate_sum[i], gate_sum[j], kk[idx]);
    coef_b[gdn::triangle_index(i, j)] = gdn::decayed(gate_sum[i], gate_sum[j], qk[idx]);
  }
  __syncthreads();
  if (group == 0 && active) {
    const T* v_col = v + st.v.at(b, 0, hv) + col0;
    const auto v_at = [&](int i, int c) { return to_acc(v_col[i * st.v.middle + c]); };
    gdn::solve_delta_columns(n, anc, root, beta_s, coef_a, v_at, u_s, kTile, lane, lane + 1);
  }
  for (int i = tid; i < n && state_slots != nullptr; i += blockDim.x) {
    decay_s[i] = gdn::node_decay(g[(b * n + i) * HV + hv]);
  }
  __syncthreads();
  if (!active) return;
  if (state_slots != nullptr) {
    // The node states of this block's columns, one state row per warp at a time, each node from its parent's value
    // (the start state's for a root): gdn::state_step with the u just solved. Every state element is read (its start
    // value) and then written by this thread only, so a node written into the request's own start slot is safe.
    for (int64_t r = group; r < K; r += kGroups) {
      float node_value[gdn::kMaxNodes];
      const float start = to_acc(s0[r * st.pool.inner + col]);
      for (int i = 0; i < n; ++i) {
        if (((needed >> i) & 1ull) == 0) continue;
        const int64_t p = parent[b * n + i];
        const float coef = gdn::mul_rn(fk[i], to_acc(k[st.k.at(b, i, h) + r]));
        node_value[i] = gdn::state_step(p < 0 ? start : node_value[p], decay_s[i], coef, u_s[i * kTile + lane]);
        const int64_t slot = state_slots[b * n + i];
        if (slot >= 0) state_pool[st.pool.at(slot, hv, r) + col] = from_acc<S>(node_value[i]);
      }
    }
  }
  for (int i = group; i < n; i += kGroups) {
    gdn::output_columns(i, anc, root, coef_b, self, u_s, kTile, o_s + i * kTile, lane, lane + 1);
    const int64_t out = ((b * n + i) * HV + hv) * V + col;
    if (u != nullptr) u[out] = u_s[i * kTile + lane];
    o[out] = from_acc<T>(o_s[i * kTile + lane]);
  }
}

__device__ void record_gdn_error(int64_t* record, int64_t op, int64_t code, int64_t row, int64_t index, int64_t value,
                                 int64_t low, int64_t high) {
  auto* claimed = reinterpret_cast<unsigned long long*>(record + deferred::kClaimed);
  if (atomicCAS(claimed, 0ULL, 1ULL) != 0ULL) return;
  record[deferred::kOp] = op;
  record[deferred::kCode] = code;
  record[deferred::kRow] = row;
  record[deferred::kIndex] = index;
  record[deferred::kDetail] = value;
  record[deferred::kDim0] = low;
  record[deferred::kDim1] = high;
}

constexpr int kCommitThreads = 256;

// Slot claims of unvalidated commits: claims [pool + 1] int32, zero on entry. claims[s] becomes 1 when exactly one
// committing request targets slot s and 2 when several do (the slot is then left unchanged by all of them: no race, and
// the same state whichever request came first); claims[pool] = pool - (smallest contested slot), 0 when none.
__global__ void gdn_claim_slots_kernel(const int64_t* __restrict__ last_accepted, const int64_t* __restrict__ slots,
                                       int64_t batch, int64_t pool, int32_t* __restrict__ claims) {
  const int64_t b = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (b >= batch || last_accepted[b] < 0) return;
  const int64_t slot = slots[b];
  if (slot < 0 || slot >= pool) return;  // the commit kernel skips it
  if (atomicCAS(&claims[slot], 0, 1) == 0) return;
  atomicExch(&claims[slot], 2);
  atomicMax(&claims[pool], static_cast<int32_t>(pool - slot));
}

// Slot claims of unvalidated gdn_tree_verify_slots calls, claims [pool + 2] int32 zero on entry: claims[s] becomes
// b * n + i + 1 when node i of request b alone writes slot s, and -1 when several nodes do (claims[pool] = pool -
// (smallest such slot), 0 when none). Out-of-range slots are left to the verification kernel (it skips the request).
__global__ void gdn_claim_state_slots_kernel(const int64_t* __restrict__ state_slots, int64_t batch, int64_t nodes,
                                             int64_t pool, int32_t* __restrict__ claims) {
  const int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (e >= batch * nodes) return;
  const int64_t slot = state_slots[e];
  if (slot < 0 || slot >= pool) return;
  if (atomicCAS(&claims[slot], 0, static_cast<int32_t>(e + 1)) == 0) return;
  atomicExch(&claims[slot], -1);
  atomicMax(&claims[pool], static_cast<int32_t>(pool - slot));
}

// After the claims: a start slot that a node of another request writes is marked contested (-1), so neither that
// request nor the readers of the slot run; claims[pool + 1] = batch * nodes - (the first such node b * n + i, in
// row-major order, as the host check names it), 0 when none.
__global__ void gdn_foreign_starts_kernel(const int64_t* __restrict__ start_slots, int64_t batch, int64_t nodes,
                                          int64_t pool, int32_t* __restrict__ claims) {
  const int64_t b = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const int64_t slot = start_slots[b];
  if (slot < 0 || slot >= pool) return;
  const int32_t claim = atomicAdd(&claims[slot], 0);
  if (claim <= 0) return;
  const int64_t e = claim - 1;
  if (e / nodes == b) {  // the request writes its own start slot: fine unless another request reads it too
    bool shared = false;
    for (int64_t other = 0; other < batch && !shared; ++other) shared = other != b && start_slots[other] == slot;
    if (!shared) return;
  }
  atomicMax(&claims[pool + 1], static_cast<int32_t>(batch * nodes - e));
  atomicExch(&claims[slot], -1);
}

// The host check's error of contested claims, recorded by one thread: the smallest slot written twice first, then
// the first node (row-major) that writes another request's start slot, with the reader the host names (the first
// reader other than the writer, else the last).
__device__ void record_slot_claims(const int32_t* claims, const int64_t* start_slots, const int64_t* state_slots,
                                   int64_t batch, int64_t nodes, int64_t pool, int64_t* record) {
  if (claims[pool] != 0) {
    record_gdn_error(record, deferred::kGdnTreeVerifySlots, deferred::kGdnSharedStateSlot, 0, 0, pool - claims[pool], 0,
                     pool);
    return;
  }
  if (claims[pool + 1] == 0) return;
  const int64_t e = batch * nodes - claims[pool + 1], b = e / nodes, slot = state_slots[e];
  int64_t first = -1, last = -1;
  for (int64_t other = 0; other < batch; ++other) {
    if (start_slots[other] != slot) continue;
    if (first < 0) first = other;
    last = other;
  }
  const int64_t reader = first != b ? first : last;
  auto* claimed = reinterpret_cast<unsigned long long*>(record + deferred::kClaimed);
  if (atomicCAS(claimed, 0ULL, 1ULL) != 0ULL) return;
  record[deferred::kOp] = deferred::kGdnTreeVerifySlots;
  record[deferred::kCode] = deferred::kGdnForeignStartSlot;
  record[deferred::kRow] = b;
  record[deferred::kIndex] = e % nodes;
  record[deferred::kDetail] = slot;
  record[deferred::kExtra] = reader;
}

__global__ void gdn_record_slot_claims_kernel(const int32_t* __restrict__ claims, const int64_t* start_slots,
                                              const int64_t* state_slots, int64_t batch, int64_t nodes, int64_t pool,
                                              int64_t* record) {
  if (blockIdx.x == 0 && threadIdx.x == 0)
    record_slot_claims(claims, start_slots, state_slots, batch, nodes, pool, record);
}

// One block per (tile of K x V state elements, value head, request); each thread rebuilds its state elements. With
// claims (see gdn_claim_slots_kernel) a contested slot is skipped and the first block reports the smallest one.
template <typename T>
__global__ void __launch_bounds__(kCommitThreads)
    gdn_commit_kernel(const T* __restrict__ k, const float* __restrict__ g, const float* __restrict__ u,
                      const int64_t* __restrict__ parent, const int64_t* __restrict__ last_accepted,
                      float* __restrict__ state_pool, const int64_t* __restrict__ slots, GdnShape s, GdnStrides st,
                      bool l2norm, const int32_t* __restrict__ claims, int64_t* __restrict__ record,
                      int64_t batch_offset) {
  if (claims != nullptr && record != nullptr && batch_offset == 0 && blockIdx.x == 0 && blockIdx.y == 0 &&
      blockIdx.z == 0 && threadIdx.x == 0 && claims[s.pool] != 0) {
    record_gdn_error(record, deferred::kGdnCommit, deferred::kGdnSharedSlot, 0, 0, s.pool - claims[s.pool], 0, s.pool);
  }
  __shared__ uint64_t anc[gdn::kMaxNodes];
  __shared__ float gate_sum[gdn::kMaxNodes];
  __shared__ float coef[gdn::kMaxNodes];  // exp(G_a - G_j) / |k_j| for path nodes j
  __shared__ int bad;
  const int n = static_cast<int>(s.nodes);
  const int64_t K = s.key_dim, V = s.value_dim, H = s.qk_heads, HV = s.value_heads;
  const int64_t b = batch_offset + blockIdx.z, hv = blockIdx.y, h = hv / (HV / H);
  const int64_t a = last_accepted[b];
  if (a < 0) return;  // uniform across the block
  if (threadIdx.x == 0) {
    bad = slots[b] < 0 || slots[b] >= s.pool || (claims != nullptr && claims[slots[b]] != 1) ||
          gdn::build_tree(parent + b * n, n, g + b * n * HV + hv, HV, anc, nullptr, gate_sum) >= 0;
  }
  __syncthreads();
  if (bad || a >= n) return;
  const uint64_t path = anc[a];
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    if (((path >> j) & 1ull) == 0) continue;
    const T* kj = k + st.k.at(b, j, h);
    float sk = 0.0f;
    for (int64_t r = 0; r < K; ++r) sk = gdn::mac(sk, to_acc(kj[r]), to_acc(kj[r]));
    coef[j] = gdn::commit_coefficient(gate_sum[a], gate_sum[j], gdn::row_factor(sk, l2norm, 1.0f));
  }
  __syncthreads();
  const float root = gdn::exp_rn(gate_sum[a]);
  float* state = state_pool + st.pool.at(slots[b], hv, 0);
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < K * V; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = e / V, c = e - r * V;
    float& element = state[r * st.pool.inner + c];
    float value = gdn::mul_rn(root, element);
    for (uint64_t bits = path; bits != 0; bits &= bits - 1) {
      const int j = gdn::lowest_bit(bits);
      value = gdn::commit_step(value, coef[j], to_acc(k[st.k.at(b, j, h) + r]), u[((b * n + j) * HV + hv) * V + c]);
    }
    element = value;
  }
}

constexpr int kConvThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kConvThreads)
    conv_tree_kernel(const T* __restrict__ x, const int64_t* __restrict__ parent, const T* __restrict__ conv_state,
                     const int64_t* __restrict__ slots, int64_t rows, const float* __restrict__ weight,
                     const float* __restrict__ bias, int64_t nodes, int64_t channels, int width, int activation,
                     T* __restrict__ out, int64_t batch_offset) {
  const int64_t b = batch_offset + blockIdx.z, i = blockIdx.y;
  const int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int64_t row = slots == nullptr ? b : slots[b];
  int src[gdn::kMaxConvWidth];
  if (row < 0 || row >= rows || !gdn::conv_window(parent + b * nodes, static_cast<int>(i), width, src)) {
    out[(b * nodes + i) * channels + c] = from_acc<T>(__int_as_float(0x7fc00000));
    return;
  }
  float acc = bias == nullptr ? 0.0f : bias[c];
  for (int w = 0; w < width; ++w) {
    const float value = src[w] >= 0 ? to_acc(x[(b * nodes + src[w]) * channels + c])
                                    : to_acc(conv_state[(row * channels + c) * (width - 1) + (-src[w] - 1)]);
    acc += weight[c * width + w] * value;
  }
  out[(b * nodes + i) * channels + c] = from_acc<T>(activation == 1 ? gdn::silu(acc) : acc);
}

template <typename T>
__global__ void __launch_bounds__(kConvThreads)
    conv_commit_kernel(const T* __restrict__ x, const int64_t* __restrict__ parent,
                       const int64_t* __restrict__ last_accepted, T* __restrict__ conv_state,
                       const int64_t* __restrict__ slots, int64_t rows, const int32_t* __restrict__ claims,
                       int64_t* __restrict__ record, int64_t nodes, int64_t channels, int width, int64_t batch_offset) {
  if (claims != nullptr && record != nullptr && batch_offset == 0 && blockIdx.x == 0 && blockIdx.y == 0 &&
      threadIdx.x == 0 && claims[rows] != 0) {
    record_gdn_error(record, deferred::kCausalConv1dCommit, deferred::kGdnSharedSlot, 0, 0, rows - claims[rows], 0,
                     rows);
  }
  const int64_t b = batch_offset + blockIdx.y;
  const int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t a = last_accepted[b];
  if (c >= channels || a < 0 || a >= nodes) return;
  const int64_t state_row = slots == nullptr ? b : slots[b];
  if (state_row < 0 || state_row >= rows || (claims != nullptr && claims[state_row] != 1)) return;
  int src[gdn::kMaxConvWidth];
  if (!gdn::conv_window(parent + b * nodes, static_cast<int>(a), width, src)) return;
  T* row = conv_state + (state_row * channels + c) * (width - 1);
  // Column s reads an older column s' > s of the old state: increasing s is safe in place (see the CPU kernel).
  for (int s = 0; s < width - 1; ++s) {
    const int t = src[s + 1];
    row[s] = t >= 0 ? x[(b * nodes + t) * channels + c] : row[-t - 1];
  }
}

template <typename F>
cudaError_t dispatch(GdnType type, F&& f) {
  switch (type) {
    case GdnType::kFloat32:
      return f(float{});
    case GdnType::kBFloat16:
      return f(__nv_bfloat16{});
    case GdnType::kFloat16:
      return f(__half{});
  }
  return cudaErrorInvalidValue;
}

unsigned grid_dim(int64_t x) { return static_cast<unsigned>(x < 1 ? 1 : x); }

// The y and z grid dimensions stop at 65535: requests go in launches of at most that many, each with its offset.
constexpr int64_t kMaxGridYZ = 65535;

template <typename Launch>
cudaError_t over_batch(int64_t batch, Launch&& launch) {
  for (int64_t offset = 0; offset < batch; offset += kMaxGridYZ) {
    launch(offset, grid_dim(batch - offset < kMaxGridYZ ? batch - offset : kMaxGridYZ));
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

bool gdn_tensor_cores_available() {
#if defined(PEAGLE_WITH_CUTLASS)
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major >= 8;  // the TF32 mma needs sm_80
#else
  return false;
#endif
}

int64_t gdn_verify_scratch_floats(GdnShape shape) {
  return shape.batch * shape.qk_heads * qk_scratch_floats(shape.nodes);
}

cudaError_t gdn_tree_verify(GdnType type, const void* q, const void* k, const void* v, const float* g,
                            const float* beta, const int64_t* parent, const float* state_pool, const int64_t* slots,
                            GdnShape shape, GdnStrides strides, float scale, bool use_qk_l2norm, bool tensor_cores,
                            float* scratch, void* o, float* u, cudaStream_t stream) {
  if (shape.batch == 0) return cudaSuccess;
  const bool mma = tensor_cores && gdn_tensor_cores_available();
  const unsigned column_tiles = grid_dim((shape.value_dim + kTile - 1) / kTile);
  return dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    const cudaError_t err = over_batch(shape.batch, [&](int64_t offset, unsigned requests) {
      const dim3 grid(grid_dim(shape.qk_heads), requests);
      gdn_qk_kernel<T><<<grid, kThreads, qk_smem_bytes(shape.nodes), stream>>>(
          static_cast<const T*>(q), static_cast<const T*>(k), parent, shape, strides, scale, use_qk_l2norm, scratch,
          offset);
    });
    if (err != cudaSuccess) return err;
    return over_batch(shape.batch, [&](int64_t offset, unsigned requests) {
      const dim3 grid(column_tiles, grid_dim(shape.value_heads), requests);
      auto kernel = mma ? gdn_tree_verify_kernel<T, float, true> : gdn_tree_verify_kernel<T, float, false>;
      // The pool is only read here (no state slots): the kernel's pointer is not const because the slots op writes.
      kernel<<<grid, kThreads, verify_smem_bytes(shape.nodes), stream>>>(
          static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), g, beta, parent,
          const_cast<float*>(state_pool), slots, nullptr, nullptr, shape, strides, scratch, static_cast<T*>(o), u,
          offset);
    });
  });
}

cudaError_t gdn_tree_verify_slots(GdnType type, GdnType state_type, const void* q, const void* k, const void* v,
                                  const float* g, const float* beta, const int64_t* parent, void* state_cache,
                                  const int64_t* start_slots, const int64_t* state_slots, GdnShape shape,
                                  GdnStrides strides, float scale, bool use_qk_l2norm, float* scratch, void* o,
                                  int32_t* claims, int64_t* record, cudaStream_t stream) {
  if (shape.batch == 0) return cudaSuccess;
  if (claims != nullptr) {
    constexpr int kClaimThreads = 256;
    const int64_t entries = shape.batch * shape.nodes;
    gdn_claim_state_slots_kernel<<<grid_dim((entries + kClaimThreads - 1) / kClaimThreads), kClaimThreads, 0, stream>>>(
        state_slots, shape.batch, shape.nodes, shape.pool, claims);
    gdn_foreign_starts_kernel<<<grid_dim((shape.batch + kClaimThreads - 1) / kClaimThreads), kClaimThreads, 0,
                                stream>>>(start_slots, shape.batch, shape.nodes, shape.pool, claims);
    if (record != nullptr) {
      gdn_record_slot_claims_kernel<<<1, 32, 0, stream>>>(claims, start_slots, state_slots, shape.batch, shape.nodes,
                                                          shape.pool, record);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const unsigned column_tiles = grid_dim((shape.value_dim + kTile - 1) / kTile);
  return dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    const cudaError_t err = over_batch(shape.batch, [&](int64_t offset, unsigned requests) {
      const dim3 grid(grid_dim(shape.qk_heads), requests);
      gdn_qk_kernel<T><<<grid, kThreads, qk_smem_bytes(shape.nodes), stream>>>(
          static_cast<const T*>(q), static_cast<const T*>(k), parent, shape, strides, scale, use_qk_l2norm, scratch,
          offset);
    });
    if (err != cudaSuccess) return err;
    // The cache holds float32 states or states in q's dtype (the launcher checks it).
    const auto launch = [&](auto state_tag) {
      using S = decltype(state_tag);
      return over_batch(shape.batch, [&](int64_t offset, unsigned requests) {
        const dim3 grid(column_tiles, grid_dim(shape.value_heads), requests);
        gdn_tree_verify_kernel<T, S, false><<<grid, kThreads, verify_smem_bytes(shape.nodes), stream>>>(
            static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), g, beta, parent,
            static_cast<S*>(state_cache), start_slots, state_slots, claims, shape, strides, scratch, static_cast<T*>(o),
            nullptr, offset);
      });
    };
    return state_type == GdnType::kFloat32 ? launch(float{}) : launch(T{});
  });
}

cudaError_t gdn_commit(GdnType type, const void* k, const float* g, const float* u, const int64_t* parent,
                       const int64_t* last_accepted, float* state_pool, const int64_t* slots, GdnShape shape,
                       GdnStrides strides, bool use_qk_l2norm, int32_t* claims, int64_t* record, cudaStream_t stream) {
  if (shape.batch == 0) return cudaSuccess;
  if (claims != nullptr) {
    constexpr int kClaimThreads = 256;
    gdn_claim_slots_kernel<<<grid_dim((shape.batch + kClaimThreads - 1) / kClaimThreads), kClaimThreads, 0, stream>>>(
        last_accepted, slots, shape.batch, shape.pool, claims);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int64_t elements = shape.key_dim * shape.value_dim;
  int64_t tiles = (elements + kCommitThreads - 1) / kCommitThreads;
  if (tiles > 65535) tiles = 65535;
  return dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    return over_batch(shape.batch, [&](int64_t offset, unsigned requests) {
      const dim3 grid(grid_dim(tiles), grid_dim(shape.value_heads), requests);
      gdn_commit_kernel<T><<<grid, kCommitThreads, 0, stream>>>(static_cast<const T*>(k), g, u, parent, last_accepted,
                                                                state_pool, slots, shape, strides, use_qk_l2norm,
                                                                claims, record, offset);
    });
  });
}

cudaError_t causal_conv1d_tree(GdnType type, const void* x, const int64_t* parent, const void* conv_state,
                               const int64_t* slots, int64_t rows, const float* weight, const float* bias,
                               int64_t batch, int64_t nodes, int64_t channels, int64_t width, int activation, void* out,
                               cudaStream_t stream) {
  if (batch == 0 || channels == 0) return cudaSuccess;
  return dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    return over_batch(batch, [&](int64_t offset, unsigned requests) {
      const dim3 grid(grid_dim((channels + kConvThreads - 1) / kConvThreads), grid_dim(nodes), requests);
      conv_tree_kernel<T><<<grid, kConvThreads, 0, stream>>>(
          static_cast<const T*>(x), parent, static_cast<const T*>(conv_state), slots, rows, weight, bias, nodes,
          channels, static_cast<int>(width), activation, static_cast<T*>(out), offset);
    });
  });
}

cudaError_t causal_conv1d_commit(GdnType type, const void* x, const int64_t* parent, const int64_t* last_accepted,
                                 void* conv_state, const int64_t* slots, int64_t rows, int32_t* claims, int64_t* record,
                                 int64_t batch, int64_t nodes, int64_t channels, int64_t width, cudaStream_t stream) {
  if (batch == 0 || channels == 0) return cudaSuccess;
  if (claims != nullptr) {
    constexpr int kClaimThreads = 256;
    gdn_claim_slots_kernel<<<grid_dim((batch + kClaimThreads - 1) / kClaimThreads), kClaimThreads, 0, stream>>>(
        last_accepted, slots, batch, rows, claims);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    return over_batch(batch, [&](int64_t offset, unsigned requests) {
      const dim3 grid(grid_dim((channels + kConvThreads - 1) / kConvThreads), requests);
      conv_commit_kernel<T><<<grid, kConvThreads, 0, stream>>>(static_cast<const T*>(x), parent, last_accepted,
                                                               static_cast<T*>(conv_state), slots, rows, claims, record,
                                                               nodes, channels, static_cast<int>(width), offset);
    });
  });
}

namespace {

constexpr int kValidateThreads = 1024;
constexpr unsigned long long kNoError = ~0ULL;

// One block. Each check keeps its first failure in the host checks' order by an atomicMin (parents row-major, then
// last_accepted, then the active slots), so the record names the error the immediate checks raise; thread 0 records
// the first check that failed. Shared slots are not checked here: gdn_commit's slot claims (gdn_claim_slots_kernel)
// find the smallest one and record it after this kernel on the same stream, so an earlier error here still wins.
__global__ void __launch_bounds__(kValidateThreads)
    gdn_validate_kernel(const int64_t* parent, const int64_t* last_accepted, const int64_t* slots,
                        const int64_t* state_slots, int64_t batch, int64_t nodes, int64_t pool, int64_t op,
                        int64_t* record) {
  __shared__ unsigned long long first_parent, first_last, first_slot, first_state;
  if (threadIdx.x == 0) first_parent = first_last = first_slot = first_state = kNoError;
  __syncthreads();
  for (int64_t e = threadIdx.x; e < batch * nodes; e += blockDim.x) {
    const int64_t p = parent[e];
    if (p < -1 || p >= e % nodes) atomicMin(&first_parent, static_cast<unsigned long long>(e));
    if (state_slots != nullptr && (state_slots[e] < -1 || state_slots[e] >= pool)) {
      atomicMin(&first_state, static_cast<unsigned long long>(e));
    }
  }
  for (int64_t b = threadIdx.x; b < batch; b += blockDim.x) {
    if (last_accepted != nullptr && (last_accepted[b] < -1 || last_accepted[b] >= nodes)) {
      atomicMin(&first_last, static_cast<unsigned long long>(b));
    }
    // A request commits (its slot is checked) when last_accepted >= 0, or always without last_accepted.
    const bool committing = last_accepted == nullptr || last_accepted[b] >= 0;
    if (slots != nullptr && committing && (slots[b] < 0 || slots[b] >= pool)) {
      atomicMin(&first_slot, static_cast<unsigned long long>(b));
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (first_parent != kNoError) {
    const int64_t e = static_cast<int64_t>(first_parent), i = e % nodes;
    return record_gdn_error(record, op, deferred::kGdnParent, e / nodes, i, parent[e], -1, i);
  }
  if (first_last != kNoError) {
    const auto b = static_cast<int64_t>(first_last);
    return record_gdn_error(record, op, deferred::kGdnLastAccepted, b, 0, last_accepted[b], -1, nodes);
  }
  if (first_slot != kNoError) {
    const auto b = static_cast<int64_t>(first_slot);
    return record_gdn_error(record, op, deferred::kGdnSlots, b, 0, slots[b], 0, pool);
  }
  if (first_state != kNoError) {
    const auto e = static_cast<int64_t>(first_state);
    record_gdn_error(record, op, deferred::kGdnStateSlots, e / nodes, e % nodes, state_slots[e], -1, pool);
  }
}

}  // namespace

cudaError_t gdn_validate(const int64_t* parent, const int64_t* last_accepted, const int64_t* slots,
                         const int64_t* state_slots, int64_t batch, int64_t nodes, int64_t pool, int64_t op,
                         int64_t* record, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  gdn_validate_kernel<<<1, kValidateThreads, 0, stream>>>(parent, last_accepted, slots, state_slots, batch, nodes, pool,
                                                          op, record);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace peagle
