"""Builds peagle._C: a CUDAExtension (CPU + CUDA kernels) when torch has CUDA and nvcc is found, else CPU only.

Environment:
  PEAGLE_FORCE_CPU=1       build the CPU-only extension even where CUDA is available.
  TORCH_CUDA_ARCH_LIST     CUDA archs (default "8.0+PTX;9.0a": sm_80, sm_90a, and PTX for newer cards).
  MAX_JOBS                 parallel compile jobs (torch's BuildExtension honours it).
  PEAGLE_NO_DLINK=1        skip relocatable device code and the device-link step (needs no ninja; no tail launch).
  PEAGLE_CUTLASS_INCLUDE   CUTLASS headers (the folder holding cutlass/); default: the nvidia-cutlass package's
                           cutlass_library/source/include when installed. Without them, efficient_lm_head scores the
                           vocabulary with its own tiled kernel instead of CUTLASS GEMMs.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sysconfig

# torch guesses CUDA_HOME from the nvcc on PATH; on our machines that is a wrapper script in /usr/local/bin.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch
from setuptools import setup
from torch.utils.cpp_extension import (
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
    is_ninja_available,
)

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0+PTX;9.0a"


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def _with_cuda() -> bool:
    if _flag("PEAGLE_FORCE_CPU") or torch.version.cuda is None or CUDA_HOME is None:
        return False
    return os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


# Where scripts/stage_cutlass.py copies the headers for a machine without the pip package (the GPU machine).
STAGED_CUTLASS = os.path.join(ROOT, "build", "cutlass", "include")


def _cutlass_include() -> str | None:
    """The CUTLASS / CuTe headers: $PEAGLE_CUTLASS_INCLUDE, else the nvidia-cutlass package's, else the staged copy."""
    path = os.environ.get("PEAGLE_CUTLASS_INCLUDE")
    if not path:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is not None and spec.submodule_search_locations:
            path = os.path.join(next(iter(spec.submodule_search_locations)), "source", "include")
        else:
            path = STAGED_CUTLASS
    return path if os.path.isfile(os.path.join(path, "cutlass", "gemm", "device", "gemm.h")) else None


def _runtime_libstdcxx() -> list[str]:
    """The shared libstdc++ this process (Python with torch) runs with, as a link input ahead of the compiler's own
    -lstdc++ (empty where /proc/self/maps is missing). Some toolchains' g++ link libstdc++ statically by default (the
    GPU machine's /opt/gcc did): the extension then held a copy of its functions while sharing the process's locale
    data, and every error message with a number in it crashed (std::ostream reached a facet of the other copy)."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return []
    paths = sorted({f[5].strip() for f in fields if len(f) == 6 and "/libstdc++.so" in f[5]})
    return paths[:1]


def _openmp_flags() -> list[str]:
    """-fopenmp where torch runs its intra-op threads on OpenMP (the Linux wheels). ATen defines at::parallel_for's
    parallel path inline in its headers, under _OPENMP: a kernel compiled without the flag runs every parallel_for on
    the calling thread alone. The extension then shares torch's OpenMP runtime (libgomp.so.1, loaded by torch first)."""
    import torch

    return ["-fopenmp"] if torch.backends.openmp.is_available() else []


def _extension():
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]
    # No fused multiply-adds on the host either (GCC contracts a * b + c where the target has FMA, e.g. aarch64): the
    # CPU kernels must round like the CUDA ones, which pin every operation (peagle/gdn.h, peagle/harness.h).
    cxx_flags = ["-O3", "-fvisibility=hidden", "-ffp-contract=off", *_openmp_flags()]
    sources = _sources("csrc/ops.cpp") + _sources("csrc/cpu/*.cpp")
    if not _with_cuda():
        return CppExtension(
            "peagle._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=[*_runtime_libstdcxx(), *_openmp_flags()],
        )

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    # Toolkits with only nvcc + cudart lack the cuBLAS/cuSPARSE headers some torch CUDA headers include; torch's pip
    # dependencies ship them here.
    nvidia_include = os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu13", "include")
    if os.path.isdir(nvidia_include):
        include_dirs.append(nvidia_include)
    dlink = not _flag("PEAGLE_NO_DLINK")
    nvcc_flags = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-DPEAGLE_WITH_CUDA"]
    cutlass = _cutlass_include()
    # cuda_tests/run_gpu.sh reads this line: without the headers the tensor-core paths are not built.
    print(f"peagle: CUTLASS headers: {cutlass or 'none (tensor-core paths not built)'}", flush=True)
    if cutlass:
        include_dirs.append(cutlass)
        nvcc_flags.append("-DPEAGLE_WITH_CUTLASS")
    if dlink:
        nvcc_flags.append("-rdc=true")
    ext = CUDAExtension(
        "peagle._C",
        sources + _sources("csrc/cuda/*.cpp") + _sources("csrc/cuda/*.cu"),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": [*cxx_flags, "-DPEAGLE_WITH_CUDA"], "nvcc": nvcc_flags},
        extra_link_args=[*_runtime_libstdcxx(), *_openmp_flags()],
        # Device graph tail launch (later kernels) needs relocatable device code and a device-link step with cudadevrt.
        dlink=dlink,
        dlink_libraries=["cudadevrt"] if dlink else [],
    )
    if dlink:
        # torch adds -dlto to the device link; nvlink then needs libnvvm, which nvcc-only toolkits lack.
        dlink_flags = [f for f in ext.extra_compile_args.get("nvcc_dlink", []) if f != "-dlto"]
        ext.extra_compile_args["nvcc_dlink"] = dlink_flags
    return ext


# Guarded so that python_tests/test_extension_binary.py can load _runtime_libstdcxx (pip's setuptools backend runs this
# file as __main__ too).
if __name__ == "__main__":
    if _with_cuda() and not _flag("PEAGLE_NO_DLINK") and not is_ninja_available():
        raise SystemExit(
            "peagle: the CUDA build's device-link step needs ninja on PATH (pip install ninja), "
            "or set PEAGLE_NO_DLINK=1"
        )
    setup(ext_modules=[_extension()], cmdclass={"build_ext": BuildExtension})
