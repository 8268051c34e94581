#!/usr/bin/env bash
# peagle's main job on this machine: sets up the CPU environment, builds peagle, and runs `peagle demo` (trains a
# P-EAGLE drafter and an EAGLE-3 baseline for a small target built from the Python standard library, measures them
# offline and served by vLLM on the CPU, and writes a report). Arguments go to `peagle demo` (e.g. --quick).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
ensure_cpu_env
build_cpu
step "peagle demo"
exec "$ROOT/.venv-cpu/bin/python" -m peagle.cli demo "$@"
