// CUDA kernels of kv_compact (see kv_kernels.h). No torch headers here (compile time).
//
// 1. Validation: one thread per request runs kv::check_request and claims the physical blocks its moves touch
//    (atomicCAS on an owner table), records a kv::Check per bad request and raises the "any error" flag; it also
//    stores each request's committed length and first move in `plan`, so the move kernel never reads seq_len.
// 2. Moves: one launch for all layers (up to kMaxCachesPerLaunch k/v caches as a __grid_constant__ pointer array).
//    Each block takes (request, cache, column chunk) tasks from a 1-D grid-stride loop (no y/z grid dimension). Per
//    batch of kv::kBatch moves, kBatch threads compute the row offsets into shared memory, then every thread runs
//    kv::copy_batch on its own column (consecutive copy units: coalesced), which needs no synchronisation between
//    columns by the argument at the top of peagle/kv.h. The first launch also writes the new seq_len (lengths are
//    read from `plan`, so that write races with nothing). A raised error flag makes every block return before
//    writing anything.
#include <cuda_runtime.h>

#include <cstdint>

#include "kv_kernels.h"
#include "peagle/deferred.h"
#include "peagle/kv.h"

namespace peagle {
namespace cuda {
namespace {

constexpr int kValidateThreads = 128;
constexpr int kMaxMoveThreads = 256;
constexpr int64_t kMaxGrid = 65535;

struct CacheGroup {
  void* base[kMaxCachesPerLaunch];
  int count;
};

struct DeviceClaim {
  int64_t* owner;
  __device__ int64_t operator()(int64_t block, int64_t key) {
    auto* slot = reinterpret_cast<unsigned long long*>(owner + block);
    return static_cast<int64_t>(atomicCAS(slot, ~0ull, static_cast<unsigned long long>(key)));
  }
};

__device__ int64_t load_seq_len(const KvCompactArgs& a, int64_t b) {
  return a.seq_len_int32 ? static_cast<const int32_t*>(a.seq_len)[b * a.seq_len_stride]
                         : static_cast<const int64_t*>(a.seq_len)[b * a.seq_len_stride];
}

__global__ void validate_kernel(const KvCompactArgs a) {
  const int64_t b = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (b >= a.batch) return;
  const kv::Geometry g{a.num_blocks, a.block_size, a.max_blocks, a.path_len};
  const int64_t* row = a.block_table + b * a.max_blocks;
  const int64_t* path = a.path + b * a.path_len;
  const int64_t seq = load_seq_len(a, b), count = a.num_accepted[b];
  kv::Check c = kv::check_request(g, row, seq, path, count, a.len_max);
  if (c.code == kv::kOk) {
    DeviceClaim claim{a.owner};
    c = kv::claim_blocks(g, row, b, seq, path, count, claim);
  }
  if (c.code != kv::kOk) {
    int64_t* e = a.errors + 4 * b;
    e[0] = c.code;
    e[1] = c.index;
    e[2] = c.value;
    e[3] = c.bound;
    a.errors[4 * a.batch] = 1;  // every writer stores the same value
    return;
  }
  a.plan[2 * b] = seq;
  a.plan[2 * b + 1] = kv::first_move(path, count);
}

template <typename Unit>
__global__ void move_kernel(const KvCompactArgs a, const __grid_constant__ CacheGroup caches, bool commit_lengths) {
  if (a.errors[4 * a.batch] != 0) return;  // some request is bad: change nothing
  __shared__ kv::Move batch[kv::kBatch];   // row offsets of the current batch of moves, shared by the block
  const int64_t row_units = a.row_bytes / static_cast<int64_t>(sizeof(Unit));
  const int64_t chunks = (row_units + blockDim.x - 1) / blockDim.x;
  const int64_t tasks = a.batch * caches.count * chunks;
  for (int64_t t = blockIdx.x; t < tasks; t += gridDim.x) {
    const int64_t chunk = t % chunks, rest = t / chunks;
    const int cache = static_cast<int>(rest % caches.count);
    const int64_t b = rest / caches.count;
    const int64_t seq = a.plan[2 * b], first = a.plan[2 * b + 1], last = a.num_accepted[b];
    if (commit_lengths && cache == 0 && chunk == 0 && threadIdx.x == 0) {
      const int64_t length = seq + last + 1;
      if (a.seq_len_int32) {
        static_cast<int32_t*>(a.seq_len)[b * a.seq_len_stride] = static_cast<int32_t>(length);
      } else {
        static_cast<int64_t*>(a.seq_len)[b * a.seq_len_stride] = length;
      }
    }
    if (first > last) continue;  // uniform over the block, like every branch around the barriers below
    Unit* base = static_cast<Unit*>(caches.base[cache]);
    const int64_t* row = a.block_table + b * a.max_blocks;
    const int64_t* path = a.path + b * a.path_len;
    const int64_t c0 = chunk * blockDim.x + threadIdx.x;
    const int64_t c1 = (chunk + 1) * blockDim.x < row_units ? (chunk + 1) * blockDim.x : row_units;
    for (int64_t j0 = first; j0 <= last; j0 += kv::kBatch) {
      const int64_t count = last - j0 + 1 < kv::kBatch ? last - j0 + 1 : kv::kBatch;
      if (threadIdx.x < count)
        batch[threadIdx.x] = kv::move_offsets(row, a.block_size, seq, path, j0 + threadIdx.x, row_units);
      __syncthreads();
      kv::copy_batch(base, batch, count, c0, c1, int64_t{blockDim.x});
      __syncthreads();  // the batch's offsets are read before the next batch overwrites them
    }
  }
}

template <typename Unit>
cudaError_t launch_moves(const KvCompactArgs& a, void* const* caches, int64_t num_caches, cudaStream_t stream) {
  const int64_t row_units = a.row_bytes / static_cast<int64_t>(sizeof(Unit));
  const int64_t warps = (row_units + 31) / 32;
  const int threads = static_cast<int>(warps * 32 < kMaxMoveThreads ? warps * 32 : kMaxMoveThreads);
  const int64_t chunks = (row_units + threads - 1) / threads;
  for (int64_t start = 0; start < num_caches; start += kMaxCachesPerLaunch) {
    CacheGroup group;
    group.count = static_cast<int>(num_caches - start < kMaxCachesPerLaunch ? num_caches - start : kMaxCachesPerLaunch);
    for (int i = 0; i < group.count; ++i) group.base[i] = caches[start + i];
    const int64_t tasks = a.batch * group.count * chunks;
    const auto grid = static_cast<unsigned>(tasks < kMaxGrid ? tasks : kMaxGrid);
    move_kernel<Unit><<<grid, threads, 0, stream>>>(a, group, start == 0);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

// One thread: requests in order, so the recorded error is the one the immediate check raises.
__global__ void publish_error_kernel(KvCompactArgs a, int64_t* record) {
  if (a.errors[4 * a.batch] == 0) return;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t* e = a.errors + 4 * b;
    if (e[0] == kv::kOk) continue;
    auto* claimed = reinterpret_cast<unsigned long long*>(record + deferred::kClaimed);
    if (atomicCAS(claimed, 0ULL, 1ULL) == 0ULL) {
      record[deferred::kOp] = deferred::kKvCompact;
      record[deferred::kCode] = e[0];
      record[deferred::kRow] = b;
      record[deferred::kIndex] = e[1];
      record[deferred::kDetail] = e[2];
      record[deferred::kExtra] = e[3];
      record[deferred::kDim0] = a.block_size;
      record[deferred::kDim1] = a.max_blocks;
    }
    return;
  }
}

cudaError_t kv_publish_error(const KvCompactArgs& a, int64_t* record, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  publish_error_kernel<<<1, 1, 0, stream>>>(a, record);
  return cudaGetLastError();
}

cudaError_t kv_compact(const KvCompactArgs& a, void* const* caches, int64_t num_caches, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  cudaError_t err = cudaMemsetAsync(a.owner, 0xFF, sizeof(int64_t) * a.num_blocks, stream);  // every owner -1
  if (err != cudaSuccess) return err;
  const auto blocks = static_cast<unsigned>((a.batch + kValidateThreads - 1) / kValidateThreads);
  validate_kernel<<<blocks, kValidateThreads, 0, stream>>>(a);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  switch (a.unit) {
    case 16:
      return launch_moves<uint4>(a, caches, num_caches, stream);
    case 8:
      return launch_moves<uint2>(a, caches, num_caches, stream);
    case 4:
      return launch_moves<uint32_t>(a, caches, num_caches, stream);
    case 2:
      return launch_moves<uint16_t>(a, caches, num_caches, stream);
    default:
      return launch_moves<uint8_t>(a, caches, num_caches, stream);
  }
}

}  // namespace cuda
}  // namespace peagle
