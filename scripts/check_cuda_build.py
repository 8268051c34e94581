"""`python scripts/check_cuda_build.py BUILD_LIB_DIR`: the peagle._C built into BUILD_LIB_DIR imports against torch's
CUDA build, and every peagle op with a CPU kernel also has a CUDA kernel (device-independent helpers such as
release_cpu_buffers are composite)."""

import os
import sys

import torch

sys.path.insert(0, sys.argv[1])
import peagle._C

if not peagle._C.__file__.startswith(os.path.abspath(sys.argv[1])):
    sys.exit(f"imported {peagle._C.__file__}, not the build in {sys.argv[1]}")


def has(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


ops = sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("peagle::"))
composite = [n for n in ops if has(n, "CompositeImplicitAutograd") or has(n, "CompositeExplicitAutograd")]
kernels = [n for n in ops if n not in composite]
no_cuda = [n for n in kernels if not has(n, "CUDA")]
no_cpu = [n for n in kernels if not has(n, "CPU")]
print(f"peagle._C with torch {torch.__version__}: {len(kernels)} kernel ops, {len(composite)} composite ops")
if not kernels or no_cuda or no_cpu:
    sys.exit(f"ops without a CUDA kernel: {no_cuda}; without a CPU kernel: {no_cpu}")
print("every kernel op has CPU and CUDA kernels: " + ", ".join(n.split("::")[1] for n in kernels))
