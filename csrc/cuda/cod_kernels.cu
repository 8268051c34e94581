// CUDA kernels of the COD family. No torch headers here (compile time); see cod_kernels.h for the contracts.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "cod_kernels.h"
#include "float_convert.cuh"
#include "peagle/cod.h"

namespace peagle {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kNotCandidate = ~0ull;  // sorts after every 63-bit key

// Scan operator whose int64 result makes cub accumulate the uint8 flags in int64.
struct AddAsInt64 {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a + b; }
};

inline unsigned blocks_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 * 8 ? 65535 * 8 : blocks));
}

size_t align256(size_t bytes) { return (bytes + 255) & ~size_t{255}; }

// Hands out consecutive 256-byte-aligned parts of one scratch buffer (the *_scratch_bytes functions size it).
struct ScratchCarver {
  char* next;
  char* take(size_t bytes) {
    char* part = next;
    next += align256(bytes);
    return part;
  }
};

size_t cub_temp_bytes(int64_t length, int64_t num_depths) {
  size_t sort_bytes = 0, scan_bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const uint64_t*>(nullptr),
                                  static_cast<uint64_t*>(nullptr), static_cast<const int64_t*>(nullptr),
                                  static_cast<int64_t*>(nullptr), static_cast<int>(length));
  const int64_t scanned = (num_depths - 1) * length;
  cub::DeviceScan::ExclusiveScan(nullptr, scan_bytes, static_cast<const uint8_t*>(nullptr),
                                 static_cast<int64_t*>(nullptr), AddAsInt64{}, int64_t{0},
                                 static_cast<int>(scanned > 0 ? scanned : 1));
  return sort_bytes > scan_bytes ? sort_bytes : scan_bytes;
}

// Candidates of the next selection: seeds (depth 1) or kept chains of depth - 1 that extend to depth. Writes their
// keys (others get kNotCandidate) and counts them into *pool_size.
__global__ void candidate_keys_kernel(const bool* loss_mask, const int64_t* document_ids, int64_t length,
                                      const uint8_t* previous_kept, int64_t depth, int64_t key_depth, int64_t seed,
                                      uint64_t* keys, int64_t* anchors, int64_t* pool_size) {
  for (int64_t a = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; a < length; a += int64_t{gridDim.x} * blockDim.x) {
    const bool in_pool =
        (previous_kept == nullptr || previous_kept[a]) && cod::extends(document_ids, loss_mask, length, a, depth);
    keys[a] = in_pool ? static_cast<uint64_t>(cod::key(seed, key_depth, a)) : kNotCandidate;
    anchors[a] = a;
    if (in_pool) atomicAdd(reinterpret_cast<unsigned long long*>(pool_size), 1ull);
  }
}

// Marks the `limit` candidates with the smallest keys as kept. limit = pool size capped by max_anchors (seeds) or by
// the depth's count; computed here so that the host never waits.
__global__ void keep_smallest_kernel(const int64_t* sorted_anchors, int64_t length, int64_t* pool_size, int64_t* counts,
                                     int64_t depth, int64_t max_anchors, double ratio, double ratio_min,
                                     uint8_t* kept) {
  const int64_t pool = *pool_size;
  int64_t limit;
  if (depth == 0) {
    limit = (max_anchors >= 0 && max_anchors < pool) ? max_anchors : pool;
  } else {
    const int64_t count = cod::depth_count(counts[0], ratio, ratio_min, depth);
    limit = count < pool ? count : pool;
  }
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < limit; i += int64_t{gridDim.x} * blockDim.x) {
    kept[sorted_anchors[i]] = 1;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) counts[depth] = limit;
}

__global__ void reset_kernel(int64_t* value) { *value = 0; }

__global__ void emit_kernel(const uint8_t* kept, const int64_t* scan, int64_t length, int64_t num_depths,
                            int64_t* anchors, int64_t* depths) {
  const int64_t total = num_depths * length;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t depth = i / length;
    const int64_t a = i - depth * length;
    if (depth == 0) {
      anchors[a] = a;
      depths[a] = 0;
    } else if (kept[i]) {
      const int64_t slot = length + scan[i - length];
      anchors[slot] = a;
      depths[slot] = depth;
    }
  }
}

// One block per row (grid-stride), threads copy `Unit`s (16 bytes when the row and pointers allow it).
template <typename Unit, typename Id>
__global__ void gather_kernel(const Id* input_ids, const Unit* hidden, const Unit* mask_hidden, const int64_t* anchors,
                              const int64_t* depths, int64_t count, int64_t length, int64_t units_per_row,
                              Id mask_token_id, Id* ids, Unit* feats, int64_t* position_ids, int64_t* label_index,
                              int32_t* bad_element) {
  for (int64_t row = blockIdx.x; row < count; row += gridDim.x) {
    const int64_t a = anchors[row];
    const int64_t d = depths[row];
    Unit* out = feats + row * units_per_row;
    if (!cod::element_in_range(a, d, length)) {
      for (int64_t u = threadIdx.x; u < units_per_row; u += blockDim.x) out[u] = Unit{};
      if (threadIdx.x == 0) {
        *bad_element = 1;
        ids[row] = 0;
        position_ids[row] = label_index[row] = 0;
      }
      continue;
    }
    const Unit* src = d == 0 ? hidden + a * units_per_row : mask_hidden;
    for (int64_t u = threadIdx.x; u < units_per_row; u += blockDim.x) out[u] = src[u];
    if (threadIdx.x == 0) {
      ids[row] = d == 0 ? input_ids[a] : mask_token_id;
      position_ids[row] = label_index[row] = a + d;
    }
  }
}

template <typename Unit, typename Id>
cudaError_t launch_gather(const void* input_ids, const void* hidden, const void* mask_hidden, const int64_t* anchors,
                          const int64_t* depths, int64_t count, int64_t length, int64_t row_bytes,
                          int64_t mask_token_id, void* ids, void* feats, int64_t* position_ids, int64_t* label_index,
                          int32_t* bad_element, cudaStream_t stream) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(Unit));
  const int threads = units >= 256 ? 256 : (units >= 64 ? 128 : 32);
  const unsigned grid = static_cast<unsigned>(count < 65535 * 4 ? (count < 1 ? 1 : count) : 65535 * 4);
  gather_kernel<Unit, Id><<<grid, threads, 0, stream>>>(
      static_cast<const Id*>(input_ids), static_cast<const Unit*>(hidden), static_cast<const Unit*>(mask_hidden),
      anchors, depths, count, length, units, static_cast<Id>(mask_token_id), static_cast<Id*>(ids),
      static_cast<Unit*>(feats), position_ids, label_index, bad_element);
  return cudaGetLastError();
}

template <typename Id>
cudaError_t gather_by_alignment(const void* input_ids, const void* hidden, const void* mask_hidden,
                                const int64_t* anchors, const int64_t* depths, int64_t count, int64_t length,
                                int64_t row_bytes, int64_t mask_token_id, void* ids, void* feats, int64_t* position_ids,
                                int64_t* label_index, int32_t* bad_element, cudaStream_t stream) {
  const auto aligned = [&](uintptr_t alignment) {
    return row_bytes % alignment == 0 && reinterpret_cast<uintptr_t>(hidden) % alignment == 0 &&
           reinterpret_cast<uintptr_t>(mask_hidden) % alignment == 0 &&
           reinterpret_cast<uintptr_t>(feats) % alignment == 0;
  };
#define PEAGLE_GATHER(UNIT)                                                                                         \
  launch_gather<UNIT, Id>(input_ids, hidden, mask_hidden, anchors, depths, count, length, row_bytes, mask_token_id, \
                          ids, feats, position_ids, label_index, bad_element, stream)
  if (aligned(16)) return PEAGLE_GATHER(uint4);
  if (aligned(8)) return PEAGLE_GATHER(uint2);
  if (aligned(4)) return PEAGLE_GATHER(uint32_t);
  return PEAGLE_GATHER(uint16_t);
#undef PEAGLE_GATHER
}

// Sort key of a backward row: its anchor for depth-0 rows (they are summed per anchor), `length` for the others (they
// sort last and are skipped).
__global__ void backward_keys_kernel(const int64_t* anchors, const int64_t* depths, int64_t count, int64_t length,
                                     int64_t* keys, int64_t* rows) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const bool scattered = depths[i] == 0 && cod::element_in_range(anchors[i], 0, length);
    keys[i] = scattered ? anchors[i] : length;
    rows[i] = i;
  }
}

constexpr int kBackwardThreads = 128;  // columns per block of the backward kernels

// grid.x: column tiles, grid.y: sorted rows (grid-stride). The first sorted row of each anchor sums its anchor's rows
// in row order (the stable sort kept it) and writes grad_hidden[anchor] once: no atomics, the order of cod.h.
template <typename T>
__global__ void backward_hidden_kernel(const T* grad_feats, const int64_t* sorted_keys, const int64_t* sorted_rows,
                                       int64_t count, int64_t width, int64_t length, T* grad_hidden) {
  using Acc = typename AccOf<T>::type;
  const int64_t col = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (col >= width) return;
  for (int64_t j = blockIdx.y; j < count; j += gridDim.y) {
    const int64_t anchor = sorted_keys[j];
    if (anchor >= length || (j > 0 && sorted_keys[j - 1] == anchor)) continue;
    Acc sum = Acc(0);
    for (int64_t r = j; r < count && sorted_keys[r] == anchor; ++r)
      sum += to_acc(grad_feats[sorted_rows[r] * width + col]);
    grad_hidden[anchor * width + col] = from_acc<T>(sum);
  }
}

// grid.x: column tiles, grid.y: chunks of cod::kBackwardChunk rows (grid-stride): each chunk's deeper-row sum S_c.
template <typename T>
__global__ void backward_chunk_kernel(const T* grad_feats, const int64_t* depths, int64_t count, int64_t width,
                                      typename AccOf<T>::type* chunk_sums) {
  using Acc = typename AccOf<T>::type;
  const int64_t col = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (col >= width) return;
  const int64_t chunks = (count + cod::kBackwardChunk - 1) / cod::kBackwardChunk;
  for (int64_t c = blockIdx.y; c < chunks; c += gridDim.y) {
    const int64_t begin = c * cod::kBackwardChunk;
    const int64_t end = begin + cod::kBackwardChunk < count ? begin + cod::kBackwardChunk : count;
    chunk_sums[c * width + col] = cod::deeper_rows_sum<Acc>(
        depths, begin, end, [&](int64_t row) { return to_acc(grad_feats[row * width + col]); });
  }
}

// grad_mask_hidden = the chunk sums added in chunk order.
template <typename T>
__global__ void backward_mask_kernel(const typename AccOf<T>::type* chunk_sums, int64_t chunks, int64_t width,
                                     T* grad_mask_hidden) {
  using Acc = typename AccOf<T>::type;
  for (int64_t col = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; col < width;
       col += int64_t{gridDim.x} * blockDim.x) {
    Acc total = Acc(0);
    for (int64_t c = 0; c < chunks; ++c) total += chunk_sums[c * width + col];
    grad_mask_hidden[col] = from_acc<T>(total);
  }
}

unsigned grid_rows(int64_t n) { return static_cast<unsigned>(n < 1 ? 1 : (n < 65535 ? n : 65535)); }

size_t backward_sort_bytes(int64_t count) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
                                  static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr),
                                  static_cast<int>(count));
  return bytes;
}

size_t accumulator_bytes(FloatType type) { return type == FloatType::kFloat64 ? sizeof(double) : sizeof(float); }

template <typename T>
cudaError_t launch_backward(const void* grad_feats, const int64_t* anchors, const int64_t* depths, int64_t count,
                            int64_t width, int64_t length, const CodBackwardScratch& s, void* grad_hidden,
                            void* grad_mask_hidden, cudaStream_t stream) {
  using Acc = typename AccOf<T>::type;
  const T* grad = static_cast<const T*>(grad_feats);
  cudaError_t err = cudaMemsetAsync(grad_hidden, 0, static_cast<size_t>(length * width) * sizeof(T), stream);
  if (err != cudaSuccess || width == 0) return err;
  const unsigned column_tiles = static_cast<unsigned>((width + kBackwardThreads - 1) / kBackwardThreads);
  if (count > 0) {
    backward_keys_kernel<<<blocks_for(count), kThreads, 0, stream>>>(anchors, depths, count, length, s.keys_in,
                                                                     s.rows_in);
    int end_bit = 1;
    while (end_bit < 63 && (int64_t{1} << end_bit) <= length) ++end_bit;  // keys are in [0, length]
    size_t temp_bytes = s.cub_temp_bytes;
    err = cub::DeviceRadixSort::SortPairs(s.cub_temp, temp_bytes, s.keys_in, s.keys_out, s.rows_in, s.rows_out,
                                          static_cast<int>(count), 0, end_bit, stream);
    if (err != cudaSuccess) return err;
    backward_hidden_kernel<T><<<dim3(column_tiles, grid_rows(count)), kBackwardThreads, 0, stream>>>(
        grad, s.keys_out, s.rows_out, count, width, length, static_cast<T*>(grad_hidden));
  }
  const int64_t chunks = (count + cod::kBackwardChunk - 1) / cod::kBackwardChunk;
  Acc* chunk_sums = static_cast<Acc*>(s.chunk_sums);
  if (chunks > 0) {
    backward_chunk_kernel<T><<<dim3(column_tiles, grid_rows(chunks)), kBackwardThreads, 0, stream>>>(
        grad, depths, count, width, chunk_sums);
  }
  backward_mask_kernel<T>
      <<<blocks_for(width), kThreads, 0, stream>>>(chunk_sums, chunks, width, static_cast<T*>(grad_mask_hidden));
  return cudaGetLastError();
}

}  // namespace

size_t cod_sample_scratch_bytes(int64_t length, int64_t num_depths) {
  const size_t n = static_cast<size_t>(length);
  const size_t k = static_cast<size_t>(num_depths);
  return 2 * align256(n * sizeof(uint64_t)) + 2 * align256(n * sizeof(int64_t)) + align256(k * n) +
         align256((k > 1 ? k - 1 : 1) * n * sizeof(int64_t)) + align256((k + 1) * sizeof(int64_t)) +
         align256(cub_temp_bytes(length, num_depths));
}

CodSampleScratch cod_sample_scratch(void* buffer, int64_t length, int64_t num_depths) {
  const size_t n = static_cast<size_t>(length);
  const size_t k = static_cast<size_t>(num_depths);
  ScratchCarver carver{static_cast<char*>(buffer)};
  CodSampleScratch s;
  s.keys_in = reinterpret_cast<uint64_t*>(carver.take(n * sizeof(uint64_t)));
  s.keys_out = reinterpret_cast<uint64_t*>(carver.take(n * sizeof(uint64_t)));
  s.anchors_in = reinterpret_cast<int64_t*>(carver.take(n * sizeof(int64_t)));
  s.anchors_out = reinterpret_cast<int64_t*>(carver.take(n * sizeof(int64_t)));
  s.kept = reinterpret_cast<uint8_t*>(carver.take(k * n));
  s.scan = reinterpret_cast<int64_t*>(carver.take((k > 1 ? k - 1 : 1) * n * sizeof(int64_t)));
  s.counts = reinterpret_cast<int64_t*>(carver.take((k + 1) * sizeof(int64_t)));
  s.cub_temp_bytes = cub_temp_bytes(length, num_depths);
  s.cub_temp = carver.take(s.cub_temp_bytes);
  return s;
}

size_t cod_backward_scratch_bytes(int64_t count, int64_t width, FloatType type) {
  const size_t n = static_cast<size_t>(count);
  const size_t chunks = static_cast<size_t>((count + cod::kBackwardChunk - 1) / cod::kBackwardChunk);
  return 4 * align256(n * sizeof(int64_t)) + align256(chunks * static_cast<size_t>(width) * accumulator_bytes(type)) +
         align256(backward_sort_bytes(count));
}

CodBackwardScratch cod_backward_scratch(void* buffer, int64_t count, int64_t width, FloatType type) {
  const size_t n = static_cast<size_t>(count);
  const size_t chunks = static_cast<size_t>((count + cod::kBackwardChunk - 1) / cod::kBackwardChunk);
  ScratchCarver carver{static_cast<char*>(buffer)};
  CodBackwardScratch s;
  s.keys_in = reinterpret_cast<int64_t*>(carver.take(n * sizeof(int64_t)));
  s.keys_out = reinterpret_cast<int64_t*>(carver.take(n * sizeof(int64_t)));
  s.rows_in = reinterpret_cast<int64_t*>(carver.take(n * sizeof(int64_t)));
  s.rows_out = reinterpret_cast<int64_t*>(carver.take(n * sizeof(int64_t)));
  s.chunk_sums = carver.take(chunks * static_cast<size_t>(width) * accumulator_bytes(type));
  s.cub_temp_bytes = backward_sort_bytes(count);
  s.cub_temp = carver.take(s.cub_temp_bytes);
  return s;
}

cudaError_t cod_sample_select(const bool* loss_mask, const int64_t* document_ids, int64_t length, int64_t num_depths,
                              double ratio, double ratio_min, int64_t max_anchors, int64_t seed,
                              const CodSampleScratch& s, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(s.kept, 0, static_cast<size_t>(num_depths * length), stream);
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(s.counts, 0, static_cast<size_t>(num_depths + 1) * sizeof(int64_t), stream);
  if (err != cudaSuccess) return err;
  if (length == 0) return cudaSuccess;
  int64_t* pool_size = s.counts + num_depths;
  // Row 0 of `kept` holds the seeds (key depth 0); row d the elements kept at depth d.
  for (int64_t depth = 0; depth < num_depths; ++depth) {
    const uint8_t* previous = depth == 0 ? nullptr : s.kept + (depth - 1) * length;
    const int64_t extend_to = depth == 0 ? 1 : depth;
    reset_kernel<<<1, 1, 0, stream>>>(pool_size);
    candidate_keys_kernel<<<blocks_for(length), kThreads, 0, stream>>>(
        loss_mask, document_ids, length, previous, extend_to, depth, seed, s.keys_in, s.anchors_in, pool_size);
    size_t temp_bytes = s.cub_temp_bytes;
    // Stable: equal keys keep anchor order, the tie-break of the CPU kernel and the reference.
    err = cub::DeviceRadixSort::SortPairs(s.cub_temp, temp_bytes, s.keys_in, s.keys_out, s.anchors_in, s.anchors_out,
                                          static_cast<int>(length), 0, 64, stream);
    if (err != cudaSuccess) return err;
    keep_smallest_kernel<<<blocks_for(length), kThreads, 0, stream>>>(
        s.anchors_out, length, pool_size, s.counts, depth, max_anchors, ratio, ratio_min, s.kept + depth * length);
  }
  return cudaGetLastError();
}

cudaError_t cod_sample_emit(const CodSampleScratch& s, int64_t length, int64_t num_depths, int64_t* anchors,
                            int64_t* depths, cudaStream_t stream) {
  if (length == 0) return cudaSuccess;
  if (num_depths > 1) {
    size_t temp_bytes = s.cub_temp_bytes;
    const cudaError_t err =
        cub::DeviceScan::ExclusiveScan(s.cub_temp, temp_bytes, s.kept + length, s.scan, AddAsInt64{}, int64_t{0},
                                       static_cast<int>((num_depths - 1) * length), stream);
    if (err != cudaSuccess) return err;
  }
  emit_kernel<<<blocks_for(num_depths * length), kThreads, 0, stream>>>(s.kept, s.scan, length, num_depths, anchors,
                                                                        depths);
  return cudaGetLastError();
}

cudaError_t cod_gather(const void* input_ids, int id_bytes, const void* hidden, const void* mask_hidden,
                       const int64_t* anchors, const int64_t* depths, int64_t count, int64_t length, int64_t row_bytes,
                       int64_t mask_token_id, void* ids, void* feats, int64_t* position_ids, int64_t* label_index,
                       int32_t* bad_element, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (id_bytes == 4) {
    return gather_by_alignment<int32_t>(input_ids, hidden, mask_hidden, anchors, depths, count, length, row_bytes,
                                        mask_token_id, ids, feats, position_ids, label_index, bad_element, stream);
  }
  return gather_by_alignment<int64_t>(input_ids, hidden, mask_hidden, anchors, depths, count, length, row_bytes,
                                      mask_token_id, ids, feats, position_ids, label_index, bad_element, stream);
}

cudaError_t cod_gather_backward(FloatType type, const void* grad_feats, const int64_t* anchors, const int64_t* depths,
                                int64_t count, int64_t width, int64_t length, const CodBackwardScratch& scratch,
                                void* grad_hidden, void* grad_mask_hidden, cudaStream_t stream) {
  switch (type) {
    case FloatType::kFloat32:
      return launch_backward<float>(grad_feats, anchors, depths, count, width, length, scratch, grad_hidden,
                                    grad_mask_hidden, stream);
    case FloatType::kFloat64:
      return launch_backward<double>(grad_feats, anchors, depths, count, width, length, scratch, grad_hidden,
                                     grad_mask_hidden, stream);
    case FloatType::kBFloat16:
      return launch_backward<__nv_bfloat16>(grad_feats, anchors, depths, count, width, length, scratch, grad_hidden,
                                            grad_mask_hidden, stream);
    case FloatType::kFloat16:
      return launch_backward<__half>(grad_feats, anchors, depths, count, width, length, scratch, grad_hidden,
                                     grad_mask_hidden, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace peagle
