"""`python scripts/check_cuda_build.py BUILD_LIB_DIR`: the peagle._C built into BUILD_LIB_DIR is newer than every
extension source under csrc/ (csrc/tests are ctest's), imports against torch's CUDA build, and every peagle op with a
CPU kernel also has a CUDA registration. On a machine without a CUDA device, the deferred-check ops also run (they must
make no CUDA call there).

A CUDA registration that copies the inputs to the host and runs the CPU kernel (csrc/cuda/host_fallback.h; the build
lists them in torch.ops.peagle.cuda_host_fallbacks()) is reported as a host fallback, apart from the CUDA kernels and
never counted among them; it does not fail the check. Device-independent helpers such as release_cpu_buffers are
composite, and so are the CUDA-only graph chain ops (graph_chain_*, csrc/cuda/graph_chain_cuda.cpp: one catch-all
kernel each, defined by the CUDA build only). The build must also use the process's shared libstdc++, not a static copy
of its own (testkit/binary.py)."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[1])
import peagle._C

ROOT = Path(__file__).resolve().parents[1]

if not peagle._C.__file__.startswith(os.path.abspath(sys.argv[1])):
    sys.exit(f"imported {peagle._C.__file__}, not the build in {sys.argv[1]}")
built = os.path.getmtime(peagle._C.__file__)
sources = [p for p in (ROOT / "csrc").rglob("*") if p.is_file() and "tests" not in p.relative_to(ROOT / "csrc").parts]
newer = [str(p.relative_to(ROOT)) for p in sources if p.stat().st_mtime > built]
if newer:
    sys.exit(f"{peagle._C.__file__} is older than {', '.join(sorted(newer))}: a stale build, rebuild it")
sys.path.insert(1, str(ROOT))
from testkit.binary import bundled_libstdcxx  # noqa: E402  (the repository root is on sys.path only now)

bundled = bundled_libstdcxx(peagle._C.__file__)
if bundled:
    sys.exit(
        f"{peagle._C.__file__} defines libstdc++'s own {', '.join(bundled)}: it bundles a static libstdc++ beside the "
        "process's shared one (op errors then crash); setup.py's _runtime_libstdcxx link input should have prevented it"
    )
print("links the shared libstdc++ (bundles no copy)")


def has(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


def short(names: list[str]) -> str:
    return ", ".join(n.split("::")[1] for n in names) or "none"


ops = sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("peagle::"))
composite = [n for n in ops if has(n, "CompositeImplicitAutograd") or has(n, "CompositeExplicitAutograd")]
kernels = [n for n in ops if n not in composite]
if "peagle::cuda_host_fallbacks" not in ops:
    sys.exit("this build has no peagle::cuda_host_fallbacks op (csrc/cuda/host_fallback.cpp): is it a CUDA build?")
fallbacks = sorted(f"peagle::{n}" for n in torch.ops.peagle.cuda_host_fallbacks())
unknown = [n for n in fallbacks if n not in kernels or not has(n, "CUDA")]
cuda_kernels = [n for n in kernels if has(n, "CUDA") and n not in fallbacks]
no_cuda = [n for n in kernels if not has(n, "CUDA")]
no_cpu = [n for n in kernels if not has(n, "CPU")]
print(f"peagle._C with torch {torch.__version__}: {len(kernels)} kernel ops, {len(composite)} composite ops")
print(f"{len(cuda_kernels)} ops with CUDA kernels: {short(cuda_kernels)}")
print(f"{len(fallbacks)} host fallbacks (CUDA tensors run the CPU kernel on host copies): {short(fallbacks)}")
if not cuda_kernels or no_cuda or no_cpu or unknown:
    sys.exit(
        f"ops without a CUDA registration: {short(no_cuda)}; without a CPU kernel: {short(no_cpu)}; "
        f"listed host fallbacks that are no registered CUDA kernel op: {short(unknown)}"
    )
print("every kernel op has a CPU kernel, and a CUDA kernel or a listed host fallback")

# A CUDA build serves CPU tensors too, also on machines without a driver (such as the one running this check): the
# deferred-check calls the engine makes every call must then not touch CUDA.
if not torch.cuda.is_available():
    previous = torch.ops.peagle.set_deferred_checks(True)
    torch.ops.peagle.check_errors()
    torch.ops.peagle.set_deferred_checks(previous)
    print("without a CUDA device: set_deferred_checks and check_errors make no CUDA call")
