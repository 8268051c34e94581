#!/usr/bin/env bash
# peagle's whole test suite, from a fresh machine: creates the environments it needs, then
#   lint (ruff, clang-format) -> CPU build -> C++ unit tests (ctest) -> CUDA build from a removed build/cuda-lib (every
#   .cu compiles, links, imports; every op has a CUDA kernel or is a listed host fallback) -> benchmark smoke run ->
#   pytest over python_tests/ and cuda_tests/.
# cuda_tests skip without a CUDA device; on a GPU machine use cuda_tests/run_gpu.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
start=$(date +%s)

step "CPU environment"
ensure_cpu_env
CPU_PY="$ROOT/.venv-cpu/bin/python"

step "lint: ruff check, ruff format --check, clang-format"
"$CPU_PY" -m ruff check .
"$CPU_PY" -m ruff format --check .
mapfile -t cxx_files < <(find csrc cuda_tests \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) | sort)
"$ROOT/.venv-cpu/bin/clang-format" --dry-run -Werror "${cxx_files[@]}"

build_cpu

step "C++ unit tests (ctest)"
if [ ! -f /usr/include/gtest/gtest.h ]; then
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libgtest-dev >/dev/null
fi
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" >/dev/null
cmake --build build/cmake -j "$MAX_JOBS"
(cd build/cmake && ctest --output-on-failure)

step "CUDA build: torch 2.14.1 + CUDA $("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), archs ${TORCH_CUDA_ARCH_LIST:-setup.py default}"
ensure_cuda_env
build_cuda
"$ROOT/.venv-cuda/bin/python" scripts/check_cuda_build.py build/cuda-lib

step "benchmark smoke run (PEAGLE_BENCH_SMOKE=1)"
PEAGLE_BENCH_SMOKE=1 "$CPU_PY" -m pytest benchmarks -q -p no:cacheprovider --benchmark-json build/bench-smoke.json
"$CPU_PY" benchmarks/report.py build/bench-smoke.json

step "pytest: python_tests and cuda_tests"
set +e
"$CPU_PY" -m pytest python_tests cuda_tests -q -p no:cacheprovider --durations=10
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: the suite is broken" >&2
  exit 1
fi
echo "total time: $(($(date +%s) - start)) s"
exit "$rc"
