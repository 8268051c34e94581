#include "cpu/large_buffers.h"

#include <c10/util/accumulate.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <emmintrin.h>
#define PEAGLE_STREAMING_STORES 1
#endif

namespace peagle {
namespace cpu {
namespace {

constexpr size_t kMinCachedBytes = size_t{4} << 20;
constexpr size_t kHugePageBytes = size_t{2} << 20;
constexpr size_t kMaxCachedBlocks = 4;

struct Block {
  void* ptr;
  size_t bytes;
};

bool cache_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("PEAGLE_CPU_BUFFER_CACHE");
    return value == nullptr || std::string(value) != "0";
  }();
  return enabled;
}

class BlockCache {
 public:
  // Leaked on purpose: tensors holding blocks may be freed during interpreter shutdown, after static destructors.
  static BlockCache& instance() {
    static BlockCache* cache = new BlockCache();
    return *cache;
  }

  Block acquire(size_t bytes) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      // Best fit among blocks no more than twice the request, so a small output never pins a huge block.
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].bytes >= bytes && free_[i].bytes <= 2 * bytes &&
            (best == free_.size() || free_[i].bytes < free_[best].bytes)) {
          best = i;
        }
      }
      if (best != free_.size()) {
        const Block block = free_[best];
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        return block;
      }
    }
    const size_t rounded = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    void* ptr = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) return {nullptr, 0};
#if defined(MADV_HUGEPAGE)
    madvise(ptr, rounded, MADV_HUGEPAGE);  // 512x fewer first-touch faults where THP is in "madvise" mode
#endif
    return {ptr, rounded};
  }

  void release(Block block) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (free_.size() < kMaxCachedBlocks) {
        free_.push_back(block);
        return;
      }
    }
    munmap(block.ptr, block.bytes);
  }

  int64_t clear() {
    std::vector<Block> blocks;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      blocks.swap(free_);
    }
    int64_t released = 0;
    for (const Block& block : blocks) {
      munmap(block.ptr, block.bytes);
      released += static_cast<int64_t>(block.bytes);
    }
    return released;
  }

 private:
  std::mutex mutex_;
  std::vector<Block> free_;
};

}  // namespace

at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  if (bytes < kMinCachedBytes || !cache_enabled()) return at::empty(sizes, options);
  const Block block = BlockCache::instance().acquire(bytes);
  if (block.ptr == nullptr) return at::empty(sizes, options);
  return at::from_blob(
      block.ptr, sizes, [block](void*) { BlockCache::instance().release(block); }, options.device(at::kCPU));
}

int64_t release_large_buffers() { return BlockCache::instance().clear(); }

void copy_streaming(void* dst, const void* src, size_t bytes) {
#if defined(PEAGLE_STREAMING_STORES)
  if (bytes >= 4096 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    auto* out = static_cast<__m128i*>(dst);
    const auto* in = static_cast<const __m128i*>(src);
    const size_t vectors = bytes / 16;
    size_t i = 0;
    for (; i + 4 <= vectors; i += 4) {
      const __m128i v0 = _mm_loadu_si128(in + i);
      const __m128i v1 = _mm_loadu_si128(in + i + 1);
      const __m128i v2 = _mm_loadu_si128(in + i + 2);
      const __m128i v3 = _mm_loadu_si128(in + i + 3);
      _mm_stream_si128(out + i, v0);
      _mm_stream_si128(out + i + 1, v1);
      _mm_stream_si128(out + i + 2, v2);
      _mm_stream_si128(out + i + 3, v3);
    }
    for (; i < vectors; ++i) _mm_stream_si128(out + i, _mm_loadu_si128(in + i));
    const size_t done = vectors * 16;
    if (done < bytes) std::memcpy(static_cast<char*>(dst) + done, static_cast<const char*>(src) + done, bytes - done);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

void streaming_fence() {
#if defined(PEAGLE_STREAMING_STORES)
  _mm_sfence();
#endif
}

}  // namespace cpu
}  // namespace peagle

// Device-independent (no tensor argument to dispatch on): one composite kernel serves every backend.
TORCH_LIBRARY_IMPL(peagle, CompositeImplicitAutograd, m) {
  m.impl("release_cpu_buffers", &peagle::cpu::release_large_buffers);
}
