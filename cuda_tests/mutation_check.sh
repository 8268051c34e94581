#!/usr/bin/env bash
# Mutation check (issue 15; opt-in, see run_gpu.sh): a deliberately wrong kernel must fail cuda_tests. Copies the
# sources to a scratch directory, applies cuda_tests/mutation.py there (an off-by-one in the CUDA verification walk),
# builds the copy and runs cuda_tests/test_tree_verify_cuda.py against it. Exits 0 only when those tests FAIL on the
# mutated build; 1 when they pass (or stop for another reason); 2 when the check could not run (no CUDA device, the
# mutation no longer applies, the copy does not build). Never touches the checkout. Needs a CUDA device; a full build
# of the copy (a few minutes). Logs and result.txt in $OUT/mutation (OUT default build/gpu-run).
#   bash cuda_tests/mutation_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/build/gpu-run}
LOGS=$OUT/mutation
mkdir -p "$LOGS"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

report() {
  echo "mutation check: $*" | tee "$LOGS/result.txt" >&2
}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >"$LOGS/device.log" 2>&1; then
  report "NOT RUN (no CUDA device for $PY)"
  exit 2
fi
command -v ninja >/dev/null || PATH="$("$PY" -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null):$PATH"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability()
print(f"{m}.{n}" + ("a" if m == 9 else ""))')}

SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/peagle-mutation.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
# Sources only: no build outputs, no compiled extension, no virtual environments, no VCS data.
if ! tar -C "$ROOT" --exclude=./build --exclude=./.git --exclude='./.venv*' --exclude='*.so' --exclude=__pycache__ \
  -cf - . | tar -C "$SCRATCH" -xf -; then
  report "NOT RUN (copying the sources failed)"
  exit 2
fi
if ! "$PY" cuda_tests/mutation.py "$SCRATCH" >"$LOGS/apply.log" 2>&1; then
  report "NOT RUN ($(tail -1 "$LOGS/apply.log"))"
  exit 2
fi
if ! (cd "$SCRATCH" && timeout "${MUTATION_BUILD_SECONDS:-600}" "$PY" setup.py build_ext --inplace) >"$LOGS/build.log" 2>&1; then
  report "NOT RUN (the mutated copy did not build, see $LOGS/build.log)"
  exit 2
fi
cd "$SCRATCH" || exit 2
export PYTHONPATH=$SCRATCH
if ! "$PY" -c 'import peagle, sys; sys.exit(0 if peagle.__file__.startswith(sys.argv[1]) else 1)' "$SCRATCH"; then
  report "NOT RUN (python imports peagle from outside the mutated copy)"
  exit 2
fi
timeout "${MUTATION_TEST_SECONDS:-300}" "$PY" -m pytest cuda_tests/test_tree_verify_cuda.py -q -p no:cacheprovider -rf \
  >"$LOGS/tests.log" 2>&1
rc=$?
counts=$(grep -E "[0-9]+ (passed|failed)" "$LOGS/tests.log" | tail -1)
case $rc in
  1)
    report "ok: the mutated kernel fails cuda_tests ($counts)"
    exit 0
    ;;
  0)
    report "FAILED: the mutated kernel passes cuda_tests ($counts)"
    exit 1
    ;;
  *)
    report "FAILED: pytest stopped with exit $rc, not a test failure (see $LOGS/tests.log)"
    exit 1
    ;;
esac
