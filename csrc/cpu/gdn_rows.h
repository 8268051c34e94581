// The hot row loops of the CPU GDN kernels (state projections, node-state steps, state cache conversions), compiled
// once per x86 instruction set and picked at run time (isa.h: gdn_cpu.cpp includes this file in several namespaces,
// each time with PEAGLE_GDN_TARGET set to a target attribute). Every version computes the same bits (peagle/gdn.h's
// operation order).
//
// Only raw-pointer code here, with internal linkage: a template of the standard library or ATen instantiated under a
// target attribute could be shared by the linker with code that runs on any CPU. No include guard: included on purpose
// once per instruction set.

// A start-state value as fp32: a float32 state as it is, a bfloat16 one from its bits (exact), so that both caches'
// start states are read where they are.
static inline PEAGLE_GDN_TARGET float start_value(const float* p) { return *p; }
static inline PEAGLE_GDN_TARGET float start_value(const c10::BFloat16* p) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16);
}

// project_kq for M nodes over one whole block of kCols columns (s0, out_k and out_q at the block's first column):
// constant trip counts, so that the 2 M kCols accumulators stay in vector registers.
template <int64_t M, int64_t kCols, typename start_t>
static inline PEAGLE_GDN_TARGET void project_nodes(const float* k, const float* fk, const float* q, const float* fq,
                                                   const start_t* s0, int64_t row_stride, int64_t K, int64_t V,
                                                   float* out_k, float* out_q) {
  float acc_k[M][kCols] = {}, acc_q[M][kCols] = {};
  for (int64_t r = 0; r < K; ++r) {
    // Each node converts a bfloat16 row again (two vector instructions): a row converted once into a block array made
    // no measurable difference for bfloat16, and for float32 (a copy) it made B = 8 and 32 15-20% slower.
    const start_t* srow = s0 + r * row_stride;
    for (int64_t m = 0; m < M; ++m) {
      const float kr = k[m * K + r], qr = q[m * K + r];
      for (int64_t j = 0; j < kCols; ++j) {
        acc_k[m][j] = gdn::state_mac(acc_k[m][j], kr, start_value(srow + j));
        acc_q[m][j] = gdn::state_mac(acc_q[m][j], qr, start_value(srow + j));
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < kCols; ++j) {
      out_k[m * V + j] = gdn::mul_rn(acc_k[m][j], fk[m]);
      out_q[m * V + j] = gdn::mul_rn(acc_q[m][j], fq[m]);
    }
  }
}

// out_k[i, c] = (sum_r k[i, r] S0[r, c]) f^k_i and out_q[i, c] = (sum_r q[i, r] S0[r, c]) f^q_i, every sum in
// increasing r (as gdn.h's projections); S0 rows row_stride apart.
template <typename start_t>
static PEAGLE_GDN_TARGET void project_kq(const float* k, const float* fk, const float* q, const float* fq,
                                         const start_t* s0, int64_t row_stride, int64_t n, int64_t K, int64_t V,
                                         float* out_k, float* out_q) {
  constexpr int64_t kBlock = PEAGLE_GDN_BLOCK;
  if (kBlock == 0) {  // baseline x86-64 (no FMA instruction: each state_mac is a call of the C library's fmaf)
    for (int64_t i = 0; i < n; ++i) {
      float* ok = out_k + i * V;
      float* oq = out_q + i * V;
      for (int64_t c = 0; c < V; ++c) ok[c] = oq[c] = 0.0f;
      for (int64_t r = 0; r < K; ++r) {
        const float kr = k[i * K + r], qr = q[i * K + r];
        const start_t* srow = s0 + r * row_stride;
        for (int64_t c = 0; c < V; ++c) ok[c] = gdn::state_mac(ok[c], kr, start_value(srow + c));
        for (int64_t c = 0; c < V; ++c) oq[c] = gdn::state_mac(oq[c], qr, start_value(srow + c));
      }
      for (int64_t c = 0; c < V; ++c) ok[c] = gdn::mul_rn(ok[c], fk[i]);
      for (int64_t c = 0; c < V; ++c) oq[c] = gdn::mul_rn(oq[c], fq[i]);
    }
    return;
  }
  // Wide vectors: up to kNodes nodes at a time over blocks of kCols columns, so that each S0 row segment loaded
  // serves 2 kNodes accumulator rows (2 kNodes kCols floats: three quarters of AVX-512's vector registers, half of
  // AVX2's).
  constexpr int64_t kNodes = kBlock == 64 ? 6 : 4;
  constexpr int64_t kFiveNodes = kNodes < 5 ? kNodes : 5;  // (unreachable when kNodes < 5)
  constexpr int64_t kCols = kBlock > 0 ? kBlock / 2 : 1;
  for (int64_t i0 = 0; i0 < n; i0 += kNodes) {
    const int64_t nodes = n - i0 < kNodes ? n - i0 : kNodes;
    const float* ki = k + i0 * K;
    const float* qi = q + i0 * K;
    for (int64_t c0 = 0; c0 < V; c0 += kCols) {
      const auto whole = [&](auto count) {
        project_nodes<decltype(count)::value, kCols>(ki, fk + i0, qi, fq + i0, s0 + c0, row_stride, K, V,
                                                     out_k + i0 * V + c0, out_q + i0 * V + c0);
      };
      if (c0 + kCols <= V) {  // constant trip counts: the accumulators stay in registers
        switch (nodes) {
          case 1:
            whole(std::integral_constant<int64_t, 1>{});
            continue;
          case 2:
            whole(std::integral_constant<int64_t, 2>{});
            continue;
          case 3:
            whole(std::integral_constant<int64_t, 3>{});
            continue;
          case 4:
            whole(std::integral_constant<int64_t, 4>{});
            continue;
          case 5:
            whole(std::integral_constant<int64_t, kFiveNodes>{});
            continue;
          default:
            whole(std::integral_constant<int64_t, kNodes>{});
            continue;
        }
      }
      const int64_t width = V - c0;
      float acc_k[kNodes][kCols] = {}, acc_q[kNodes][kCols] = {};
      for (int64_t r = 0; r < K; ++r) {
        const start_t* srow = s0 + r * row_stride + c0;
        for (int64_t m = 0; m < nodes; ++m) {
          const float kr = ki[m * K + r], qr = qi[m * K + r];
          for (int64_t j = 0; j < width; ++j) {
            acc_k[m][j] = gdn::state_mac(acc_k[m][j], kr, start_value(srow + j));
            acc_q[m][j] = gdn::state_mac(acc_q[m][j], qr, start_value(srow + j));
          }
        }
      }
      for (int64_t m = 0; m < nodes; ++m) {
        const int64_t i = i0 + m;
        for (int64_t j = 0; j < width; ++j) {
          out_k[i * V + c0 + j] = gdn::mul_rn(acc_k[m][j], fk[i]);
          out_q[i * V + c0 + j] = gdn::mul_rn(acc_q[m][j], fq[i]);
        }
      }
    }
  }
}

// One path node of gdn_commit on a state of K rows of V floats, row_stride apart:
// s[r, c] = gdn::commit_step(s[r, c], coef, k[r], u[c]).
static PEAGLE_GDN_TARGET void commit_rows(float* s, int64_t row_stride, float coef, const float* k, const float* u,
                                          int64_t K, int64_t V) {
  for (int64_t r = 0; r < K; ++r) {
    float* row = s + r * row_stride;
    for (int64_t c = 0; c < V; ++c) row[c] = gdn::commit_step(row[c], coef, k[r], u[c]);
  }
}

// float32 and bf16 rows as start_value converts them (bf16 from the bits: exact).
template <typename state_t>
static PEAGLE_GDN_TARGET void to_float_row(const state_t* src, int64_t V, float* dst) {
  for (int64_t c = 0; c < V; ++c) dst[c] = start_value(src + c);
}

static PEAGLE_GDN_TARGET void to_float_row(const c10::Half* src, int64_t V, float* dst) {
  for (int64_t c = 0; c < V; ++c) dst[c] = static_cast<float>(src[c]);
}

static PEAGLE_GDN_TARGET void from_float_row(const float* src, int64_t V, float* dst) {
  for (int64_t c = 0; c < V; ++c) dst[c] = src[c];
}

// fp32 -> bf16 bits, rounded to nearest even, NaN to the quiet NaN 0x7FC0 (as c10::BFloat16 and torch's .to round).
// From the value, not through a pointer cast, so that a caller's values can stay in vector registers.
static PEAGLE_GDN_TARGET uint16_t bf16_bits(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? 0x7FC0u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#if PEAGLE_GDN_BF16
// 32 floats (lo, then hi) -> one cache line of their bf16 bits, as bf16_bits rounds them. vcvtne2ps2bf16 rounds to
// nearest even as bf16_bits does, in one instruction instead of eight per vector, but it reads a subnormal input as
// zero and keeps a NaN's payload: a line holding either (vfpclassps: quiet NaN 0x01, subnormal 0x20, signalling NaN
// 0x80) takes bf16_bits.
static inline PEAGLE_GDN_TARGET __m512i bf16x32_bits(__m512 lo, __m512 hi) {
  constexpr int kOdd = 0x01 | 0x20 | 0x80;
  if (__builtin_expect((_mm512_fpclass_ps_mask(lo, kOdd) | _mm512_fpclass_ps_mask(hi, kOdd)) == 0, 1)) {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  }
  alignas(64) float value[32];
  alignas(64) uint16_t bits[32];
  _mm512_store_ps(value, lo);
  _mm512_store_ps(value + 16, hi);
  for (int j = 0; j < 32; ++j) bits[j] = bf16_bits(value[j]);
  return _mm512_load_si512(bits);
}
#endif

static PEAGLE_GDN_TARGET void from_float_row(const float* src, int64_t V, c10::BFloat16* dst) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);  // c10::BFloat16 is its 16 bits
  int64_t c = 0;
#if PEAGLE_GDN_BF16
  for (; c + 32 <= V; c += 32) {
    _mm512_storeu_si512(out + c, bf16x32_bits(_mm512_loadu_ps(src + c), _mm512_loadu_ps(src + c + 16)));
  }
#endif
  for (; c < V; ++c) out[c] = bf16_bits(src[c]);
}

// One value into a state cache entry, rounded as from_float_row rounds.
static PEAGLE_GDN_TARGET void store_value(float x, float* dst) { *dst = x; }
static PEAGLE_GDN_TARGET void store_value(float x, c10::BFloat16* dst) {
  *reinterpret_cast<uint16_t*>(dst) = bf16_bits(x);
}
static PEAGLE_GDN_TARGET void store_value(float x, c10::Half* dst) { *dst = static_cast<c10::Half>(x); }

static PEAGLE_GDN_TARGET void from_float_row(const float* src, int64_t V, c10::Half* dst) {
  for (int64_t c = 0; c < V; ++c) dst[c] = static_cast<c10::Half>(src[c]);
}

// A state row into the cache. With PEAGLE_GDN_STREAM (AVX-512) and `stream` (the call writes more than a cache holds),
// rows of whole aligned cache lines go out as streaming stores: the written slots are not read first (no read for
// ownership), which halves the memory traffic of the writes; node_states fences (stream_fence) before returning.
template <typename state_t>
static PEAGLE_GDN_TARGET void store_state_row(const float* src, int64_t V, state_t* dst, bool stream) {
#if PEAGLE_GDN_STREAM
  constexpr int64_t kPerLine = 64 / sizeof(state_t);
  if (stream && reinterpret_cast<uintptr_t>(dst) % 64 == 0 && V % kPerLine == 0) {
    for (int64_t c0 = 0; c0 < V; c0 += kPerLine) {
      alignas(64) state_t line[kPerLine];
      from_float_row(src + c0, kPerLine, line);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + c0), _mm512_load_si512(line));
    }
    return;
  }
#else
  (void)stream;
#endif
  from_float_row(src, V, dst);
}

static PEAGLE_GDN_TARGET void stream_fence() {
#if PEAGLE_GDN_STREAM
  _mm_sfence();
#endif
}

// The start state of one value head as fp32 rows of V: s0[r, :] = head[r * row_stride, :].
template <typename state_t>
static PEAGLE_GDN_TARGET void load_head(const state_t* head, int64_t row_stride, int64_t K, int64_t V, float* s0) {
  for (int64_t r = 0; r < K; ++r) to_float_row(head + r * row_stride, V, s0 + r * V);
}

#if PEAGLE_GDN_BLOCK == 64
// chain_states' whole blocks on AVX-512, in intrinsics, for the caches that convert in registers (float32, and
// bfloat16 with PEAGLE_GDN_BF16): the compiler kept chain_states' block arrays on the stack, storing and reloading
// every vector between nodes.
template <typename state_t>
constexpr bool kVectorChain =
    std::is_same_v<state_t, float> || (PEAGLE_GDN_BF16 && std::is_same_v<state_t, c10::BFloat16>);

// 64 state values (4 vectors) into a cache row as store_state_row stores them, streaming when `stream` and dst is
// cache-line aligned.
static inline PEAGLE_GDN_TARGET void store_block(const __m512* s, float* dst, bool stream) {
  if (stream && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) _mm512_stream_ps(dst + 16 * g, s[g]);
  } else {
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(dst + 16 * g, s[g]);
  }
}

#if PEAGLE_GDN_BF16
static inline PEAGLE_GDN_TARGET void store_block(const __m512* s, c10::BFloat16* dst, bool stream) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);  // c10::BFloat16 is its 16 bits
  const __m512i first = bf16x32_bits(s[0], s[1]), second = bf16x32_bits(s[2], s[3]);
  if (stream && reinterpret_cast<uintptr_t>(out) % 64 == 0) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(out), first);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(out + 32), second);
  } else {
    _mm512_storeu_si512(out, first);
    _mm512_storeu_si512(out + 32, second);
  }
}
#endif

// 16 start-state values as fp32 (start_value's conversion, in a vector).
static inline PEAGLE_GDN_TARGET __m512 load_start16(const float* p) { return _mm512_loadu_ps(p); }
static inline PEAGLE_GDN_TARGET __m512 load_start16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, wide, 16));
}

// One block of 64 columns of one state row through the chain: node i's values from node i - 1's (the start row's for
// a root) by gdn::state_step, into dest[i] + offset when dest[i] is not null.
template <typename state_t, typename start_t>
static PEAGLE_GDN_TARGET void chain_block(const start_t* start, int64_t n, const int64_t* parent, const float* decay,
                                          const float* row_coef, int64_t coef_stride, const float* u, int64_t V,
                                          state_t* const* dest, int64_t offset, bool stream) {
  __m512 s[4] = {};
  for (int64_t i = 0; i < n; ++i) {
    const __m512 d = _mm512_set1_ps(decay[i]), a = _mm512_set1_ps(row_coef[i * coef_stride]);
    const float* ui = u + i * V;
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m512 from = parent[i] < 0 ? load_start16(start + 16 * g) : s[g];
      s[g] = _mm512_fmadd_ps(a, _mm512_loadu_ps(ui + 16 * g), _mm512_mul_ps(d, from));  // gdn::state_step
    }
    if (dest[i] != nullptr) store_block(s, dest[i] + offset, stream);
  }
}
#endif

// Prefetches for the rows after row r of a head's node states, so that the memory's latency overlaps the arithmetic
// (each head's states are K rows of V values row_stride apart): dest[i]'s row r + kWriteAhead for writing, unless
// stores stream (their lines are never read), and row r of next_start, the start state of the head this thread
// verifies next, if any. With caches evicted between calls (as in serving, where every other layer runs between two
// steps of one layer), the read for ownership of each written line and the next head's start state otherwise wait on
// memory one line at a time: on a Xeon, B = 1 K = 3 with evicted caches took 0.59-0.63 ms without them and
// 0.53-0.58 ms with them (bf16 states; float32 0.71-0.76 -> 0.64-0.68 ms).
template <typename state_t>
static PEAGLE_GDN_TARGET void prefetch_rows(int64_t r, int64_t n, state_t* const* dest, int64_t row_stride, int64_t K,
                                            int64_t V, bool stream, const state_t* next_start) {
  constexpr int64_t kWriteAhead = 6;
  constexpr int64_t kPerLine = 64 / sizeof(state_t);
  if (!stream && r + kWriteAhead < K) {
    for (int64_t i = 0; i < n; ++i) {
      if (dest[i] == nullptr) continue;
      const state_t* row = dest[i] + (r + kWriteAhead) * row_stride;
      for (int64_t c = 0; c < V; c += kPerLine) __builtin_prefetch(row + c, 1, 3);
    }
  }
  if (next_start != nullptr) {
    for (int64_t c = 0; c < V; c += kPerLine) __builtin_prefetch(next_start + r * row_stride + c, 0, 2);
  }
}

// Prefetches a value head's start state into L2 (K rows of V values, row_stride apart) before it is read where it is,
// so that the projections' column-block passes over it find it there rather than waiting on memory line by line (a
// scratch copy used to read it in one sequential pass). Xeon, bfloat16 states read in place: B = 8 K = 3 2.29 ms
// without it, 1.87 ms with it; B = 1 K = 3 0.21 -> 0.18 ms.
template <typename state_t>
static PEAGLE_GDN_TARGET void prefetch_head(const state_t* head, int64_t row_stride, int64_t K, int64_t V) {
  constexpr int64_t kPerLine = 64 / sizeof(state_t);
  for (int64_t r = 0; r < K; ++r) {
    for (int64_t c = 0; c < V; c += kPerLine) __builtin_prefetch(head + r * row_stride + c, 0, 2);
  }
}

// Chains and forests of chains (every parent[i] is -1 or i - 1: vLLM's speculative batches): node i's row follows from
// node i - 1's, so each block of kCols columns of a row goes from node to node in registers and straight into the
// cache, with no scratch row written and read back. Same operations in the same order as node_states' general loop.
template <typename state_t, typename start_t>
static PEAGLE_GDN_TARGET void chain_states(const start_t* s0, int64_t s0_stride, int64_t n, const int64_t* parent,
                                           const float* decay, const float* row_coef, const float* u,
                                           state_t* const* dest, int64_t row_stride, int64_t K, int64_t V, bool stream,
                                           const state_t* next_start) {
  constexpr int64_t kCols = PEAGLE_GDN_BLOCK > 0 ? PEAGLE_GDN_BLOCK : 16;
  for (int64_t r = 0; r < K; ++r) {
    const start_t* start_row = s0 + r * s0_stride;
    prefetch_rows(r, n, dest, row_stride, K, V, stream, next_start);
    for (int64_t c0 = 0; c0 < V; c0 += kCols) {
      float s[kCols], converted[kCols];
#if PEAGLE_GDN_BLOCK == 64
      if constexpr (kVectorChain<state_t>) {
        if (c0 + kCols <= V) {
          chain_block(start_row + c0, n, parent, decay, row_coef + r, K, u + c0, V, dest, r * row_stride + c0, stream);
          continue;
        }
      }
#endif
      const float* start = converted;  // the start row's block from c0 on, as fp32
      if constexpr (std::is_same_v<start_t, float>) {
        start = start_row + c0;
      } else {
        const int64_t width = V - c0 < kCols ? V - c0 : kCols;
        for (int64_t j = 0; j < width; ++j) converted[j] = start_value(start_row + c0 + j);
      }
      if (c0 + kCols <= V) {  // a whole block: constant trip counts, held in vector registers
        for (int64_t i = 0; i < n; ++i) {
          const float* from = parent[i] < 0 ? start : s;
          const float d = decay[i], a = row_coef[i * K + r];
          const float* ui = u + i * V + c0;
          if (dest[i] == nullptr || stream) {
            for (int64_t j = 0; j < kCols; ++j) s[j] = gdn::state_step(from[j], d, a, ui[j]);
            if (dest[i] != nullptr) store_state_row(s, kCols, dest[i] + r * row_stride + c0, stream);
          } else {  // each value stored as it is computed: the block never leaves the registers
            state_t* out = dest[i] + r * row_stride + c0;
            for (int64_t j = 0; j < kCols; ++j) {
              s[j] = gdn::state_step(from[j], d, a, ui[j]);
              store_value(s[j], out + j);
            }
          }
        }
      } else {
        const int64_t width = V - c0;
        for (int64_t i = 0; i < n; ++i) {
          const float* from = parent[i] < 0 ? start : s;
          const float d = decay[i], a = row_coef[i * K + r];
          const float* ui = u + i * V + c0;
          for (int64_t j = 0; j < width; ++j) s[j] = gdn::state_step(from[j], d, a, ui[j]);
          if (dest[i] != nullptr) store_state_row(s, width, dest[i] + r * row_stride + c0, stream);
        }
      }
    }
  }
  stream_fence();
}

// The node states of one value head, row by row (gdn::state_step from the parent's row; the start state's row for a
// root), for the nodes marked `needed`; node i's row goes to dest[i] + r * row_stride when dest[i] is not null.
// s0: the start state's K rows, s0_stride apart (a float32 or bfloat16 cache's own rows, or a converted copy); each
// row is read before that row of any node is written. row_coef [n, K] = f^k_i k_i[r]; u [n, V]; rows: (n + 1) x V
// floats of scratch; stream: see store_state_row; next_start: see prefetch_rows. Chains take chain_states.
template <typename state_t, typename start_t>
static PEAGLE_GDN_TARGET void node_states(const start_t* s0, int64_t s0_stride, int64_t n, const int64_t* parent,
                                          const char* needed, const float* decay, const float* row_coef, const float* u,
                                          state_t* const* dest, int64_t row_stride, int64_t K, int64_t V, float* rows,
                                          bool stream, const state_t* next_start) {
  bool chains = true;
  for (int64_t i = 0; i < n; ++i) chains = chains && (parent[i] == -1 || parent[i] == i - 1);
  if (chains) {
    int64_t written = n;  // nodes after the last written one (vLLM's padding) need no state
    while (written > 0 && dest[written - 1] == nullptr) --written;
    return chain_states(s0, s0_stride, written, parent, decay, row_coef, u, dest, row_stride, K, V, stream, next_start);
  }
  float* start = rows + n * V;
  for (int64_t r = 0; r < K; ++r) {
    prefetch_rows(r, n, dest, row_stride, K, V, stream, next_start);
    for (int64_t c = 0; c < V; ++c) start[c] = start_value(s0 + r * s0_stride + c);
    for (int64_t i = 0; i < n; ++i) {
      if (!needed[i]) continue;
      const float* from = parent[i] < 0 ? start : rows + parent[i] * V;
      const float d = decay[i], a = row_coef[i * K + r];
      const float* ui = u + i * V;
      float* to = rows + i * V;
      for (int64_t c = 0; c < V; ++c) to[c] = gdn::state_step(from[c], d, a, ui[c]);
      if (dest[i] != nullptr) store_state_row(to, V, dest[i] + r * row_stride, stream);
    }
  }
  stream_fence();
}
