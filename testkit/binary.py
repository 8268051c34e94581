"""Checks of a built shared object: whether it carries its own copy of libstdc++, and whether it opens OpenMP
parallel regions.

An extension that links libstdc++ statically while the process (Python, torch) runs the shared one holds two copies of
the library: its own functions, but the process's locale data. On the GPU machine (whose g++ linked libstdc++
statically) every op error with a number in its message then crashed the process: std::ostream formatting reached a
facet of the other copy. setup.py links the process's shared libstdc++ first; this check proves the build did.
"""

from __future__ import annotations

import shutil
import subprocess

# Defined by libstdc++ itself, never by code that only includes its headers: std::locale::classic() and
# std::ios_base::Init::Init(), the locale and stream set-up a bundled copy brings with it.
LIBSTDCXX_CORE_SYMBOLS = ("_ZNSt6locale7classicEv", "_ZNSt8ios_base4InitC1Ev")


def _symbols(path: str, *flags: str) -> set[str]:
    """The symbol names (version suffixes dropped) ``nm FLAGS path`` lists; empty for a table the object lacks (a
    stripped object has no static table, "no symbols"). Needs binutils' ``nm``."""
    nm = shutil.which("nm")
    if nm is None:
        raise RuntimeError("testkit.binary needs binutils' nm on PATH")
    result = subprocess.run([nm, *flags, path], capture_output=True, text=True, check=False)
    if result.returncode != 0 and "no symbols" not in result.stderr:
        raise RuntimeError(f"nm {' '.join(flags)} {path} failed: {result.stderr.strip()}")
    return {line.split()[-1].split("@")[0] for line in result.stdout.splitlines() if line.strip()}


def bundled_libstdcxx(path: str) -> list[str]:
    """The libstdc++ core symbols (LIBSTDCXX_CORE_SYMBOLS) that the shared object at ``path`` defines itself, from
    both its static and dynamic symbol tables; empty when it uses a shared libstdc++."""
    defined = _symbols(path, "--defined-only") | _symbols(path, "--defined-only", "--dynamic")
    return [name for name in LIBSTDCXX_CORE_SYMBOLS if name in defined]


def opens_openmp_regions(path: str) -> bool:
    """Whether the shared object at ``path`` starts OpenMP parallel regions (imports libgomp's GOMP_parallel, which
    every ``#pragma omp parallel`` compiled with -fopenmp calls). A torch extension whose at::parallel_for was compiled
    without OpenMP never imports it: its loops run on one thread."""
    return "GOMP_parallel" in _symbols(path, "--dynamic", "--undefined-only")
