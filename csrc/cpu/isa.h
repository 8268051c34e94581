// Run-time choice of the x86 instruction set for the CPU kernels' hot loops. The extension is built for baseline
// x86-64 (SSE2); a loop file (gdn_rows.h, argmax_rows.h) is included once per instruction set in its own namespace,
// each time with PEAGLE_CPU_TARGET set to a target attribute, and PEAGLE_CPU_DISPATCH calls the widest version this
// CPU runs. Since -ffp-contract=off keeps every multiply and add separately rounded, all versions compute the same
// bits. PEAGLE_CPU_ISA=generic|avx2|avx512 caps the choice (tests compare the versions). AVX-512 with BF16 conversions
// (Cooper Lake, Sapphire Rapids, Zen 4 and later) is a level of its own for the loops that round to bfloat16 (a file
// without such a loop passes its AVX-512 version for it).
#pragma once

#include <cstdlib>
#include <cstring>

namespace peagle {
namespace cpu {

enum class Isa { kGeneric, kAvx2, kAvx512, kAvx512Bf16 };

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PEAGLE_CPU_X86 1
#define PEAGLE_CPU_AVX2 __attribute__((target("avx2,fma")))
#define PEAGLE_CPU_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,prfchw")))
#define PEAGLE_CPU_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,prfchw")))
#endif

inline Isa detect_isa() {
  Isa isa = Isa::kGeneric;
#if defined(PEAGLE_CPU_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = Isa::kAvx2;
  if (isa == Isa::kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    isa = Isa::kAvx512;
    if (__builtin_cpu_supports("avx512bf16")) isa = Isa::kAvx512Bf16;
  }
#endif
  const char* cap = std::getenv("PEAGLE_CPU_ISA");
  if (cap != nullptr && std::strcmp(cap, "generic") == 0) isa = Isa::kGeneric;
  if (cap != nullptr && std::strcmp(cap, "avx2") == 0 && isa > Isa::kAvx2) isa = Isa::kAvx2;
  if (cap != nullptr && std::strcmp(cap, "avx512") == 0 && isa > Isa::kAvx512) isa = Isa::kAvx512;
  return isa;
}

inline Isa cpu_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

}  // namespace cpu
}  // namespace peagle

// `return NS::call` with NS the namespace of the widest version (generic_ns, avx2_ns, avx512_ns, avx512_bf16_ns).
#if defined(PEAGLE_CPU_X86)
#define PEAGLE_CPU_DISPATCH(generic_ns, avx2_ns, avx512_ns, avx512_bf16_ns, call) \
  switch (::peagle::cpu::cpu_isa()) {                                             \
    case ::peagle::cpu::Isa::kAvx512Bf16:                                         \
      return avx512_bf16_ns::call;                                                \
    case ::peagle::cpu::Isa::kAvx512:                                             \
      return avx512_ns::call;                                                     \
    case ::peagle::cpu::Isa::kAvx2:                                               \
      return avx2_ns::call;                                                       \
    default:                                                                      \
      return generic_ns::call;                                                    \
  }
#else
#define PEAGLE_CPU_DISPATCH(generic_ns, avx2_ns, avx512_ns, avx512_bf16_ns, call) return generic_ns::call;
#endif
