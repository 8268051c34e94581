// CUDA kernels of the Gated DeltaNet family. No torch headers here (compile time); see gdn_kernels.h for the
// contracts and peagle/gdn.h for the closed form over the tree that both backends share.
//
// Verification: one block per (tile of 64 value columns, value head, request), one thread per value column. The block
// derives the tree (ancestor masks, cumulative gates) and then walks K in chunks of 32 rows: the chunk's q/k rows of
// all nodes are staged in shared memory (coalesced), from which the block accumulates the q/k norms, the ancestor Gram
// entries q_i.k_j, k_i.k_j, and each thread the projections of its committed-state column onto every k_i and q_i
// (S0 is read exactly once per block, coalesced along its rows). Then each thread runs the shared forward
// substitution gdn::tree_delta_columns for its column. No per-node state is ever formed. The work is
// 2 n K V + n^2 (K + V) multiply-adds per head, on CUDA cores (tensor-core tiles are a later step, once GPU profiles
// show where the time goes).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "float_convert.cuh"
#include "gdn_kernels.h"
#include "peagle/deferred.h"
#include "peagle/gdn.h"

namespace peagle {
namespace cuda {
namespace {

constexpr int kColumns = 64;  // value columns per verification block (one per thread)

constexpr int kChunk = 32;           // K rows of q/k/S0 staged per step
constexpr int kStride = kChunk + 1;  // padded rows: Gram reads of different nodes hit different banks

size_t verify_smem_bytes(int64_t n) {
  // anc (u64) | gate_sum, beta, inv_q, inv_k | kk, qk | v, u, o column tiles | q, k chunks
  return sizeof(uint64_t) * n + sizeof(float) * (4 * n + 2 * n * n + 3 * n * kColumns + 2 * n * kStride);
}

template <typename T>
__global__ void __launch_bounds__(kColumns)
    gdn_tree_verify_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const float* __restrict__ g, const float* __restrict__ beta,
                           const int64_t* __restrict__ parent, const float* __restrict__ state_pool,
                           const int64_t* __restrict__ slots, GdnShape s, GdnStrides st, float scale, bool l2norm,
                           T* __restrict__ o, float* __restrict__ u, int64_t batch_offset) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int n = static_cast<int>(s.nodes);
  const int64_t K = s.key_dim, V = s.value_dim, H = s.qk_heads, HV = s.value_heads;
  const int64_t b = batch_offset + blockIdx.z, hv = blockIdx.y, h = hv / (HV / H);
  const int tid = threadIdx.x;
  const int64_t col = int64_t{blockIdx.x} * kColumns + tid;
  const bool active = col < V;

  uint64_t* anc = reinterpret_cast<uint64_t*>(smem);
  float* gate_sum = reinterpret_cast<float*>(anc + n);
  float* beta_s = gate_sum + n;
  float* inv_q = beta_s + n;  // sums of squares until the norms are final
  float* inv_k = inv_q + n;
  float* kk = inv_k + n;
  float* qk = kk + n * n;
  float* v_s = qk + n * n;
  float* u_s = v_s + n * kColumns;
  float* o_s = u_s + n * kColumns;
  float* q_c = o_s + n * kColumns;
  float* k_c = q_c + n * kStride;
  __shared__ int bad;

  if (tid == 0) {
    bad = slots[b] < 0 || slots[b] >= s.pool ||
          gdn::build_tree(parent + b * n, n, g + b * n * HV + hv, HV, anc, nullptr, gate_sum) >= 0;
  }
  for (int i = tid; i < n; i += blockDim.x) {
    beta_s[i] = beta[(b * n + i) * HV + hv];
    inv_q[i] = inv_k[i] = 0.0f;
  }
  for (int idx = tid; idx < n * n; idx += blockDim.x) kk[idx] = qk[idx] = 0.0f;
  for (int i = 0; i < n; ++i) u_s[i * kColumns + tid] = o_s[i * kColumns + tid] = 0.0f;
  __syncthreads();
  if (bad) {  // bad indices: NaN outputs, nothing read out of bounds
    if (active) {
      for (int i = 0; i < n; ++i) {
        const int64_t out = ((b * n + i) * HV + hv) * V + col;
        u[out] = __int_as_float(0x7fc00000);
        o[out] = from_acc<T>(__int_as_float(0x7fc00000));
      }
    }
    return;
  }

  const float* s0 = state_pool + st.pool.at(slots[b], hv, 0) + (active ? col : 0);
  for (int64_t r0 = 0; r0 < K; r0 += kChunk) {
    const int width = static_cast<int>(K - r0 < kChunk ? K - r0 : kChunk);
    // Stage raw q/k rows [r0, r0 + kChunk) of every node (zero-padded), coalesced along K.
    for (int idx = tid; idx < n * kChunk; idx += blockDim.x) {
      const int i = idx / kChunk, r = idx - (idx / kChunk) * kChunk;
      q_c[i * kStride + r] = r < width ? to_acc(q[st.q.at(b, i, h) + r0 + r]) : 0.0f;
      k_c[i * kStride + r] = r < width ? to_acc(k[st.k.at(b, i, h) + r0 + r]) : 0.0f;
    }
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
      float sq = 0.0f, sk = 0.0f;
      for (int r = 0; r < kChunk; ++r) {
        sq += q_c[i * kStride + r] * q_c[i * kStride + r];
        sk += k_c[i * kStride + r] * k_c[i * kStride + r];
      }
      inv_q[i] += sq;
      inv_k[i] += sk;
    }
    // Raw Gram entries of ancestor-or-self pairs.
    for (int idx = tid; idx < n * n; idx += blockDim.x) {
      const int i = idx / n, j = idx - (idx / n) * n;
      if (((anc[i] >> j) & 1ull) == 0) continue;
      float dq = 0.0f, dk = 0.0f;
      for (int r = 0; r < kChunk; ++r) {
        const float x = k_c[j * kStride + r];
        dq += q_c[i * kStride + r] * x;
        dk += k_c[i * kStride + r] * x;
      }
      qk[idx] += dq;
      kk[idx] += dk;
    }
    // Raw projections of this thread's committed-state column: S0 is read exactly once per block.
    if (active) {
      float sv[kChunk];
#pragma unroll
      for (int r = 0; r < kChunk; ++r) sv[r] = r < width ? s0[(r0 + r) * st.pool.inner] : 0.0f;
      for (int i = 0; i < n; ++i) {
        float pk = 0.0f, pq = 0.0f;
#pragma unroll
        for (int r = 0; r < kChunk; ++r) {
          pk += k_c[i * kStride + r] * sv[r];
          pq += q_c[i * kStride + r] * sv[r];
        }
        u_s[i * kColumns + tid] += pk;
        o_s[i * kColumns + tid] += pq;
      }
    }
    __syncthreads();  // before the next chunk overwrites q_c / k_c
  }
  for (int i = tid; i < n; i += blockDim.x) {
    inv_q[i] = gdn::inv_l2(inv_q[i], l2norm) * scale;
    inv_k[i] = gdn::inv_l2(inv_k[i], l2norm);
  }
  __syncthreads();
  for (int idx = tid; idx < n * n; idx += blockDim.x) {
    const int i = idx / n, j = idx - (idx / n) * n;
    qk[idx] *= inv_q[i] * inv_k[j];
    kk[idx] *= inv_k[i] * inv_k[j];
  }
  if (active) {
    for (int i = 0; i < n; ++i) {
      u_s[i * kColumns + tid] *= inv_k[i];
      o_s[i * kColumns + tid] *= inv_q[i];
      v_s[i * kColumns + tid] = to_acc(v[st.v.at(b, i, hv) + col]);
    }
  }
  __syncthreads();
  if (!active) return;
  gdn::tree_delta_columns(n, anc, gate_sum, beta_s, kk, qk, v_s, kColumns, u_s, kColumns, o_s, kColumns, tid, tid + 1);
  for (int i = 0; i < n; ++i) {
    const int64_t out = ((b * n + i) * HV + hv) * V + col;
    u[out] = u_s[i * kColumns + tid];
    o[out] = from_acc<T>(o_s[i * kColumns + tid]);
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
    for (int64_t r = 0; r < K; ++r) sk += to_acc(kj[r]) * to_acc(kj[r]);
    coef[j] = expf(gate_sum[a] - gate_sum[j]) * gdn::inv_l2(sk, l2norm);
  }
  __syncthreads();
  const float root = expf(gate_sum[a]);
  float* state = state_pool + st.pool.at(slots[b], hv, 0);
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < K * V; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = e / V, c = e - r * V;
    float& element = state[r * st.pool.inner + c];
    float value = root * element;
    uint64_t bits = path;
    while (bits != 0) {
      const int j = __ffsll(static_cast<long long>(bits)) - 1;
      bits &= bits - 1;
      value += coef[j] * to_acc(k[st.k.at(b, j, h) + r]) * u[((b * n + j) * HV + hv) * V + c];
    }
    element = value;
  }
}

constexpr int kConvThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kConvThreads)
    conv_tree_kernel(const T* __restrict__ x, const int64_t* __restrict__ parent, const T* __restrict__ conv_state,
                     const float* __restrict__ weight, const float* __restrict__ bias, int64_t nodes, int64_t channels,
                     int width, int activation, T* __restrict__ out, int64_t batch_offset) {
  const int64_t b = batch_offset + blockIdx.z, i = blockIdx.y;
  const int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  int src[gdn::kMaxConvWidth];
  if (!gdn::conv_window(parent + b * nodes, static_cast<int>(i), width, src)) {
    out[(b * nodes + i) * channels + c] = from_acc<T>(__int_as_float(0x7fc00000));
    return;
  }
  float acc = bias == nullptr ? 0.0f : bias[c];
  for (int w = 0; w < width; ++w) {
    const float value = src[w] >= 0 ? to_acc(x[(b * nodes + src[w]) * channels + c])
                                    : to_acc(conv_state[(b * channels + c) * (width - 1) + (-src[w] - 1)]);
    acc += weight[c * width + w] * value;
  }
  out[(b * nodes + i) * channels + c] = from_acc<T>(activation == 1 ? gdn::silu(acc) : acc);
}

template <typename T>
__global__ void __launch_bounds__(kConvThreads)
    conv_commit_kernel(const T* __restrict__ x, const int64_t* __restrict__ parent,
                       const int64_t* __restrict__ last_accepted, T* __restrict__ conv_state, int64_t nodes,
                       int64_t channels, int width, int64_t batch_offset) {
  const int64_t b = batch_offset + blockIdx.y;
  const int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t a = last_accepted[b];
  if (c >= channels || a < 0 || a >= nodes) return;
  int src[gdn::kMaxConvWidth];
  if (!gdn::conv_window(parent + b * nodes, static_cast<int>(a), width, src)) return;
  T* row = conv_state + (b * channels + c) * (width - 1);
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

constexpr int kMaxDevices = 64;

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

cudaError_t gdn_tree_verify(GdnType type, const void* q, const void* k, const void* v, const float* g,
                            const float* beta, const int64_t* parent, const float* state_pool, const int64_t* slots,
                            GdnShape shape, GdnStrides strides, float scale, bool use_qk_l2norm, void* o, float* u,
                            cudaStream_t stream) {
  if (shape.batch == 0) return cudaSuccess;
  const size_t smem = verify_smem_bytes(shape.nodes);
  const unsigned column_tiles = grid_dim((shape.value_dim + kColumns - 1) / kColumns);
  return dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    auto kernel = gdn_tree_verify_kernel<T>;
    // Opt in to the largest tree's shared memory once per device (not per call: keeps CUDA graph capture clean).
    static bool configured[kMaxDevices] = {};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    if (device >= kMaxDevices || !configured[device]) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(verify_smem_bytes(gdn::kMaxNodes)));
      if (err != cudaSuccess) return err;
      if (device < kMaxDevices) configured[device] = true;
    }
    return over_batch(shape.batch, [&](int64_t offset, unsigned requests) {
      const dim3 grid(column_tiles, grid_dim(shape.value_heads), requests);
      kernel<<<grid, kColumns, smem, stream>>>(static_cast<const T*>(q), static_cast<const T*>(k),
                                               static_cast<const T*>(v), g, beta, parent, state_pool, slots, shape,
                                               strides, scale, use_qk_l2norm, static_cast<T*>(o), u, offset);
    });
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
                               const float* weight, const float* bias, int64_t batch, int64_t nodes, int64_t channels,
                               int64_t width, int activation, void* out, cudaStream_t stream) {
  if (batch == 0 || channels == 0) return cudaSuccess;
  return dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    return over_batch(batch, [&](int64_t offset, unsigned requests) {
      const dim3 grid(grid_dim((channels + kConvThreads - 1) / kConvThreads), grid_dim(nodes), requests);
      conv_tree_kernel<T><<<grid, kConvThreads, 0, stream>>>(
          static_cast<const T*>(x), parent, static_cast<const T*>(conv_state), weight, bias, nodes, channels,
          static_cast<int>(width), activation, static_cast<T*>(out), offset);
    });
  });
}

cudaError_t causal_conv1d_commit(GdnType type, const void* x, const int64_t* parent, const int64_t* last_accepted,
                                 void* conv_state, int64_t batch, int64_t nodes, int64_t channels, int64_t width,
                                 cudaStream_t stream) {
  if (batch == 0 || channels == 0) return cudaSuccess;
  return dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    return over_batch(batch, [&](int64_t offset, unsigned requests) {
      const dim3 grid(grid_dim((channels + kConvThreads - 1) / kConvThreads), requests);
      conv_commit_kernel<T><<<grid, kConvThreads, 0, stream>>>(static_cast<const T*>(x), parent, last_accepted,
                                                               static_cast<T*>(conv_state), nodes, channels,
                                                               static_cast<int>(width), offset);
    });
  });
}

namespace {

// Sequential on purpose: the first error in the host checks' order (parents row-major, then last_accepted, then the
// active slots, then the smallest shared slot). Small inputs: B * n parents and B^2 slot pairs.
__global__ void gdn_validate_kernel(const int64_t* parent, const int64_t* last_accepted, const int64_t* slots,
                                    int64_t batch, int64_t nodes, int64_t pool, int64_t op, int64_t* record) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < nodes; ++i) {
      const int64_t p = parent[b * nodes + i];
      if (p < -1 || p >= i) return record_gdn_error(record, op, deferred::kGdnParent, b, i, p, -1, i);
    }
  }
  if (last_accepted != nullptr) {
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t a = last_accepted[b];
      if (a < -1 || a >= nodes) return record_gdn_error(record, op, deferred::kGdnLastAccepted, b, 0, a, -1, nodes);
    }
  }
  if (slots == nullptr) return;
  for (int64_t b = 0; b < batch; ++b) {
    if (last_accepted != nullptr && last_accepted[b] < 0) continue;
    const int64_t s = slots[b];
    if (s < 0 || s >= pool) return record_gdn_error(record, op, deferred::kGdnSlots, b, 0, s, 0, pool);
  }
  if (last_accepted == nullptr) return;
  int64_t shared = -1;
  for (int64_t b = 0; b < batch; ++b) {
    if (last_accepted[b] < 0 || (shared >= 0 && slots[b] >= shared)) continue;
    for (int64_t c = b + 1; c < batch; ++c) {
      if (last_accepted[c] >= 0 && slots[c] == slots[b]) {
        shared = slots[b];
        break;
      }
    }
  }
  if (shared >= 0) record_gdn_error(record, op, deferred::kGdnSharedSlot, 0, 0, shared, 0, pool);
}

}  // namespace

cudaError_t gdn_validate(const int64_t* parent, const int64_t* last_accepted, const int64_t* slots, int64_t batch,
                         int64_t nodes, int64_t pool, int64_t op, int64_t* record, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  gdn_validate_kernel<<<1, 1, 0, stream>>>(parent, last_accepted, slots, batch, nodes, pool, op, record);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace peagle
