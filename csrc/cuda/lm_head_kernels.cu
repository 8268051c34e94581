// CUDA kernels of efficient_lm_head (see lm_head_kernels.h). No torch headers here (compile time).
//
// 1. z_kernel: one warp per (row, rank) entry of z = down @ h (float32 lanes, shuffle reduction), rounded to T.
// 2. Per vocabulary chunk [v0, v0 + width): the low-rank scores [N, width] float32 by a CUTLASS GEMM (tensor cores
//    for 16-bit operands whose rank and addresses meet its 128-bit alignment; SIMT float32 otherwise), or by
//    score_tile_kernel when peagle was built without CUTLASS headers. The kernel after it, select_kernel, takes one
//    block per row and finds the C-th largest ranking key among the row's running C keys and the chunk's width
//    scores by an 8-bit radix select (8 passes over 64-bit keys: unique keys, so the C-th is exact), then writes the
//    keys >= it (exactly C) as the row's new running set. [N, V] scores never exist: only [N, chunk].
// 3. cub's segmented radix sort orders each row's C keys descending (score, then lower id), and rescore_kernel (one
//    warp per candidate) computes the exact logit weight[id] . h in float32.
#include <cuda_runtime.h>
#include <cub/device/device_segmented_radix_sort.cuh>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "float_convert.cuh"
#include "lm_head_kernels.h"
#include "peagle/lm_head.h"

#if defined(PEAGLE_WITH_CUTLASS)
#include <cutlass/bfloat16.h>
#include <cutlass/gemm/device/gemm.h>
#include <cutlass/half.h>
#endif

namespace peagle {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kSelectThreads = 512;
constexpr int64_t kChunkScores = int64_t{1} << 25;  // floats in one chunk of scores (128 MiB)
constexpr int64_t kMaxGrid = 65535;

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__global__ void z_kernel(const T* hidden, const T* down, T* z, int64_t rows, int64_t rank, int64_t hidden_size) {
  const int64_t warp = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (warp >= rows * rank) return;
  const T* h = hidden + (warp / rank) * hidden_size;
  const T* d = down + (warp % rank) * hidden_size;
  float acc = 0.f;
  for (int64_t k = lane; k < hidden_size; k += kWarp) acc += to_acc(h[k]) * to_acc(d[k]);
  acc = warp_sum(acc);
  if (lane == 0) z[warp] = from_acc<T>(acc);
}

// scores[n, v] = sum_k z[n, k] up[v, k] for a 32 x 32 tile per block (256 threads, 4 outputs each).
template <typename T>
__global__ void score_tile_kernel(const T* z, const T* up, float* scores, int64_t rows, int64_t width, int64_t rank) {
  __shared__ float zs[32][33], us[32][33];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int64_t row0 = int64_t{blockIdx.y} * 32, col0 = int64_t{blockIdx.x} * 32;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t k0 = 0; k0 < rank; k0 += 32) {
    for (int i = ty; i < 32; i += 8) {
      const int64_t k = k0 + tx;
      zs[i][tx] = (row0 + i < rows && k < rank) ? to_acc(z[(row0 + i) * rank + k]) : 0.f;
      us[i][tx] = (col0 + i < width && k < rank) ? to_acc(up[(col0 + i) * rank + k]) : 0.f;
    }
    __syncthreads();
    for (int kk = 0; kk < 32; ++kk) {
      for (int q = 0; q < 4; ++q) acc[q] += zs[ty + 8 * q][kk] * us[tx][kk];
    }
    __syncthreads();
  }
  for (int q = 0; q < 4; ++q) {
    const int64_t n = row0 + ty + 8 * q, v = col0 + tx;
    if (n < rows && v < width) scores[n * width + v] = acc[q];
  }
}

#if defined(PEAGLE_WITH_CUTLASS)
using cutlass::layout::ColumnMajor;
using cutlass::layout::RowMajor;
// up[v0 : v0 + width] [width, r] row-major is the column-major [r, width] B operand; scores [N, width] row-major.
using GemmSimt = cutlass::gemm::device::Gemm<float, RowMajor, float, ColumnMajor, float, RowMajor, float,
                                             cutlass::arch::OpClassSimt, cutlass::arch::Sm80>;
template <typename T>
using GemmTensorOp =
    cutlass::gemm::device::Gemm<T, RowMajor, T, ColumnMajor, float, RowMajor, float, cutlass::arch::OpClassTensorOp,
                                cutlass::arch::Sm80, cutlass::gemm::GemmShape<128, 128, 32>,
                                cutlass::gemm::GemmShape<64, 64, 32>, cutlass::gemm::GemmShape<16, 8, 16>,
                                cutlass::epilogue::thread::LinearCombination<float, 4, float, float>,
                                cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, 3>;

// kCannotTake: CUTLASS rejected the operands before launching anything (the caller falls back). A GEMM that accepted
// them and then failed to run is an error, not a silent fallback: it means a kernel configuration this GPU cannot run.
enum class GemmOutcome { kRan, kCannotTake, kFailed };

template <typename Gemm, typename E>
GemmOutcome cutlass_scores(const E* z, const E* up, float* scores, int64_t rows, int64_t width, int64_t rank,
                           cudaStream_t stream, const char** gemm_failure) {
  const cutlass::gemm::GemmCoord size(static_cast<int>(rows), static_cast<int>(width), static_cast<int>(rank));
  typename Gemm::Arguments arguments(size, {z, rank}, {up, rank}, {scores, width}, {scores, width}, {1.f, 0.f});
  Gemm gemm;
  if (gemm.can_implement(arguments) != cutlass::Status::kSuccess) return GemmOutcome::kCannotTake;
  const cutlass::Status status = gemm(arguments, nullptr, stream);
  if (status == cutlass::Status::kSuccess) return GemmOutcome::kRan;
  *gemm_failure = cutlass::cutlassGetStatusString(status);
  return GemmOutcome::kFailed;
}

template <typename T>
struct CutlassType {
  using type = T;
};
template <>
struct CutlassType<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassType<__half> {
  using type = cutlass::half_t;
};

// Scores one chunk with CUTLASS when its kernels can take these operands.
template <typename T>
GemmOutcome try_cutlass_scores(const T* z, const T* up, float* scores, int64_t rows, int64_t width, int64_t rank,
                               cudaStream_t stream, const char** gemm_failure) {
  if (rows > INT32_MAX || width > INT32_MAX || rank > INT32_MAX) return GemmOutcome::kCannotTake;
  // can_implement checks the extents' alignment, not the addresses': the tensor-op kernels load 16 bytes at a time.
  const auto address_bits =
      reinterpret_cast<uintptr_t>(z) | reinterpret_cast<uintptr_t>(up) | reinterpret_cast<uintptr_t>(scores);
  if (!std::is_same_v<T, float> && address_bits % 16 != 0) return GemmOutcome::kCannotTake;
  using E = typename CutlassType<T>::type;
  const auto* ze = reinterpret_cast<const E*>(z);
  const auto* ue = reinterpret_cast<const E*>(up);
  if constexpr (std::is_same_v<T, float>) {
    return cutlass_scores<GemmSimt>(ze, ue, scores, rows, width, rank, stream, gemm_failure);
  } else {
    return cutlass_scores<GemmTensorOp<E>>(ze, ue, scores, rows, width, rank, stream, gemm_failure);
  }
}
#endif

template <typename T>
cudaError_t chunk_scores(const T* z, const T* up, float* scores, int64_t rows, int64_t width, int64_t rank,
                         cudaStream_t stream, const char** gemm_failure) {
#if defined(PEAGLE_WITH_CUTLASS)
  switch (try_cutlass_scores(z, up, scores, rows, width, rank, stream, gemm_failure)) {
    case GemmOutcome::kRan:
      return cudaGetLastError();
    case GemmOutcome::kFailed:
      return cudaErrorLaunchFailure;  // the launcher reports *gemm_failure
    case GemmOutcome::kCannotTake:
      break;
  }
#else
  (void)gemm_failure;
#endif
  const dim3 grid(static_cast<unsigned>((width + 31) / 32), static_cast<unsigned>((rows + 31) / 32));
  score_tile_kernel<T><<<grid, 256, 0, stream>>>(z, up, scores, rows, width, rank);
  return cudaGetLastError();
}

// One block per row: the C largest keys among running_in[n] (num_running keys) and the chunk's width scores.
__global__ void select_kernel(const float* scores, int64_t width, int64_t v0, const uint64_t* running_in,
                              int64_t num_running, uint64_t* running_out, int64_t candidates) {
  __shared__ unsigned int hist[256];
  __shared__ uint64_t prefix_shared;
  __shared__ int64_t remaining_shared;
  __shared__ unsigned int out_count;
  const int64_t n = blockIdx.x, total = num_running + width;
  const uint64_t* running = running_in + n * candidates;
  const float* row_scores = scores + n * width;
  auto key_at = [&](int64_t i) {
    return i < num_running ? running[i] : lm_head::make_key(row_scores[i - num_running], v0 + i - num_running);
  };
  uint64_t prefix = 0, mask = 0;
  int64_t remaining = candidates;  // rank (from the top) of the wanted key among the keys matching prefix
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
      const uint64_t key = key_at(i);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t above = 0;
      int digit = 255;
      for (; digit > 0 && above + hist[digit] < remaining; --digit) above += hist[digit];
      prefix_shared = prefix | (static_cast<uint64_t>(digit) << shift);
      remaining_shared = remaining - above;
      out_count = 0;
    }
    __syncthreads();
    prefix = prefix_shared;
    remaining = remaining_shared;
    mask |= uint64_t{0xff} << shift;
    __syncthreads();  // every thread read the shared values before thread 0 writes them again
  }
  uint64_t* out = running_out + n * candidates;
  for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
    const uint64_t key = key_at(i);
    if (key >= prefix) out[atomicAdd(&out_count, 1u)] = key;  // exactly C keys (unique keys)
  }
}

__global__ void offsets_kernel(int64_t* offsets, int64_t rows, int64_t candidates) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i <= rows) offsets[i] = i * candidates;
}

template <typename T>
__global__ void rescore_kernel(const T* weight, const T* hidden, const uint64_t* sorted, int64_t rows,
                               int64_t candidates, int64_t hidden_size, int64_t* ids, float* logits) {
  const int64_t lane_count = rows * candidates;
  const int lane = threadIdx.x % kWarp;
  for (int64_t warp = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / kWarp; warp < lane_count;
       warp += int64_t{gridDim.x} * blockDim.x / kWarp) {
    const int64_t id = lm_head::key_id(sorted[warp]);
    const T* w = weight + id * hidden_size;
    const T* h = hidden + (warp / candidates) * hidden_size;
    float acc = 0.f;
    for (int64_t k = lane; k < hidden_size; k += kWarp) acc += to_acc(w[k]) * to_acc(h[k]);
    acc = warp_sum(acc);
    if (lane == 0) {
      ids[warp] = id;
      logits[warp] = acc;
    }
  }
}

unsigned blocks_for(int64_t threads, int threads_per_block) {
  return static_cast<unsigned>(std::min<int64_t>((threads + threads_per_block - 1) / threads_per_block, kMaxGrid));
}

template <typename T>
cudaError_t run(const LmHeadArgs& a, cudaStream_t stream, const char** gemm_failure) {
  const int block = kWarp * kWarpsPerBlock;
  auto* z = static_cast<T*>(a.z);
  const auto* up = static_cast<const T*>(a.up);
  // z: one warp per entry; N * r warps can pass the grid limit, so launch in slices of rows.
  const int64_t rows_per_launch = std::max<int64_t>(1, kMaxGrid * kWarpsPerBlock / a.rank);
  for (int64_t r0 = 0; r0 < a.rows; r0 += rows_per_launch) {
    const int64_t count = std::min(rows_per_launch, a.rows - r0);
    z_kernel<T><<<blocks_for(count * a.rank * kWarp, block), block, 0, stream>>>(
        static_cast<const T*>(a.hidden) + r0 * a.hidden_size, static_cast<const T*>(a.down), z + r0 * a.rank, count,
        a.rank, a.hidden_size);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  int current = 0;
  for (int64_t v0 = 0; v0 < a.vocab; v0 += a.chunk) {
    const int64_t width = std::min(a.chunk, a.vocab - v0);
    err = chunk_scores<T>(z, up + v0 * a.rank, a.scores, a.rows, width, a.rank, stream, gemm_failure);
    if (err != cudaSuccess) return err;
    const int64_t num_running = v0 == 0 ? 0 : a.candidates;
    // Rows beyond the grid limit: one launch per slice of rows.
    for (int64_t r0 = 0; r0 < a.rows; r0 += kMaxGrid) {
      const int64_t count = std::min<int64_t>(kMaxGrid, a.rows - r0);
      select_kernel<<<static_cast<unsigned>(count), kSelectThreads, 0, stream>>>(
          a.scores + r0 * width, width, v0, a.keys[current] + r0 * a.candidates, num_running,
          a.keys[1 - current] + r0 * a.candidates, a.candidates);
    }
    current = 1 - current;
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }

  offsets_kernel<<<blocks_for(a.rows + 1, block), block, 0, stream>>>(a.offsets, a.rows, a.candidates);
  size_t temp_bytes = a.sort_temp_bytes;
  err = cub::DeviceSegmentedRadixSort::SortKeysDescending(a.sort_temp, temp_bytes, a.keys[current], a.sorted,
                                                          a.rows * a.candidates, a.rows, a.offsets, a.offsets + 1, 0,
                                                          64, stream);
  if (err != cudaSuccess) return err;
  rescore_kernel<T><<<blocks_for(a.rows * a.candidates * kWarp, block), block, 0, stream>>>(
      static_cast<const T*>(a.weight), static_cast<const T*>(a.hidden), a.sorted, a.rows, a.candidates, a.hidden_size,
      a.ids, a.logits);
  return cudaGetLastError();
}

}  // namespace

int64_t lm_head_chunk(int64_t rows, int64_t vocab, int64_t candidates) {
  const int64_t by_budget = std::max<int64_t>(256, kChunkScores / std::max<int64_t>(rows, 1));
  return std::min(vocab, std::max(by_budget, candidates));
}

size_t lm_head_sort_temp_bytes(int64_t rows, int64_t candidates) {
  size_t bytes = 0;
  cub::DeviceSegmentedRadixSort::SortKeysDescending(
      nullptr, bytes, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr), rows * candidates, rows,
      static_cast<const int64_t*>(nullptr), static_cast<const int64_t*>(nullptr), 0, 64);
  return bytes;
}

cudaError_t efficient_lm_head(const LmHeadArgs& args, cudaStream_t stream, const char** gemm_failure) {
  *gemm_failure = nullptr;
  if (args.rows == 0) return cudaSuccess;
  switch (args.dtype) {
    case HeadDtype::kFloat:
      return run<float>(args, stream, gemm_failure);
    case HeadDtype::kBFloat16:
      return run<__nv_bfloat16>(args, stream, gemm_failure);
    default:
      return run<__half>(args, stream, gemm_failure);
  }
}

}  // namespace cuda
}  // namespace peagle
