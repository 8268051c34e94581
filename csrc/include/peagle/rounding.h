// Round-to-nearest arithmetic shared by the CPU and CUDA kernels, so that both compute the same bits. CUDA would
// contract a * b + c into one fused multiply-add (one rounding instead of two), and its default division / square root
// may differ from the host's in the last bit: the math headers (gdn.h, harness.h, tree.h) evaluate through these. On
// the host they are plain IEEE operations (setup.py compiles the CPU kernels with -ffp-contract=off, so the host
// compiler does not fuse them either). A fused multiply-add is asked for by name (fma_rn: a * b + c rounded once),
// which both sides compute exactly: one instruction on a GPU and on an x86 CPU with FMA (code compiled for it;
// elsewhere the C library's fmaf, also exact). No torch includes.
#pragma once

#include <cmath>

#include "peagle/common.h"

namespace peagle {

#if defined(__CUDA_ARCH__)
PEAGLE_HD float mul_rn(float a, float b) { return __fmul_rn(a, b); }
PEAGLE_HD float add_rn(float a, float b) { return __fadd_rn(a, b); }
PEAGLE_HD float sub_rn(float a, float b) { return __fsub_rn(a, b); }
PEAGLE_HD float div_rn(float a, float b) { return __fdiv_rn(a, b); }
PEAGLE_HD float sqrt_rn(float a) { return __fsqrt_rn(a); }
PEAGLE_HD float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
PEAGLE_HD double mul_rn(double a, double b) { return __dmul_rn(a, b); }
PEAGLE_HD double add_rn(double a, double b) { return __dadd_rn(a, b); }
PEAGLE_HD double div_rn(double a, double b) { return __ddiv_rn(a, b); }
PEAGLE_HD double sqrt_rn(double a) { return __dsqrt_rn(a); }
#else
PEAGLE_HD float mul_rn(float a, float b) { return a * b; }
PEAGLE_HD float add_rn(float a, float b) { return a + b; }
PEAGLE_HD float sub_rn(float a, float b) { return a - b; }
PEAGLE_HD float div_rn(float a, float b) { return a / b; }
PEAGLE_HD float sqrt_rn(float a) { return std::sqrt(a); }
PEAGLE_HD float fma_rn(float a, float b, float c) { return std::fma(a, b, c); }
PEAGLE_HD double mul_rn(double a, double b) { return a * b; }
PEAGLE_HD double add_rn(double a, double b) { return a + b; }
PEAGLE_HD double div_rn(double a, double b) { return a / b; }
PEAGLE_HD double sqrt_rn(double a) { return std::sqrt(a); }
#endif

}  // namespace peagle
