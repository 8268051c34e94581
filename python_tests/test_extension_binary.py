"""peagle._C uses the process's shared libstdc++ and bundles no copy of its own (testkit/binary.py says why a copy
crashed every op error on the GPU machine); the check finds a bundled copy, and setup.py's link input prevents one
even where the compiler links libstdc++ statically. Its CPU kernels' at::parallel_for loops run on torch's OpenMP
threads (compiled with -fopenmp where torch uses OpenMP; without it every loop ran on one thread)."""

from __future__ import annotations

import runpy
import shutil
import subprocess
from pathlib import Path

import peagle._C
import pytest
import torch

from testkit.binary import bundled_libstdcxx, opens_openmp_regions

ROOT = Path(__file__).resolve().parents[1]
PARALLEL_SOURCE = """void scale(float* x, long n) {
#pragma omp parallel for
  for (long i = 0; i < n; ++i) x[i] *= 2.0f;
}
"""
SOURCE = """#include <sstream>
#include <string>
std::string show(long x) { std::ostringstream s; s << x; return s.str(); }
"""


def test_extension_bundles_no_libstdcxx():
    assert bundled_libstdcxx(peagle._C.__file__) == []


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    if shutil.which("g++") is None:
        pytest.fail("g++ is needed to build the test's shared objects (it also builds peagle)")
    path = tmp_path_factory.mktemp("libstdcxx") / "show.cpp"
    path.write_text(SOURCE)
    return path


def link(source: Path, name: str, *args: str) -> str:
    out = source.with_name(name)
    subprocess.run(["g++", "-shared", "-fPIC", str(source), *args, "-o", str(out)], check=True)
    return str(out)


def test_the_check_finds_a_statically_linked_libstdcxx(source):
    """The power check: a toolchain that links libstdc++ statically (as the GPU machine's g++ did) is caught."""
    assert bundled_libstdcxx(link(source, "static.so", "-static-libstdc++")) != []
    assert bundled_libstdcxx(link(source, "shared.so")) == []


def test_setup_links_the_shared_libstdcxx_first(source):
    """setup.py's link input (the process's libstdc++.so) leaves nothing for a static -lstdc++ to add."""
    runtime = runpy.run_path(str(ROOT / "setup.py"), run_name="peagle_setup")["_runtime_libstdcxx"]()
    assert len(runtime) == 1 and "libstdc++.so" in runtime[0]
    assert bundled_libstdcxx(link(source, "fixed.so", *runtime, "-static-libstdc++")) == []


@pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="torch runs its threads without OpenMP here")
def test_cpu_kernels_open_openmp_regions():
    """at::parallel_for's parallel path is compiled into peagle._C (setup.py's -fopenmp), so torch's threads run it."""
    assert opens_openmp_regions(peagle._C.__file__)


def test_the_openmp_check_tells_a_serial_build(source):
    """The power check: the same loop compiled without -fopenmp (as peagle was before) opens no region."""
    parallel = source.with_name("parallel.cpp")
    parallel.write_text(PARALLEL_SOURCE)
    assert opens_openmp_regions(link(parallel, "with_openmp.so", "-fopenmp"))
    assert not opens_openmp_regions(link(parallel, "without_openmp.so"))
