#!/usr/bin/env bash
# peagle's main job on this machine: sets up the CPU environment, builds peagle, and runs `peagle example`
# (COD sampling + the fused gather on a packed training row, checked against the PyTorch reference).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
ensure_cpu_env
build_cpu
step "peagle example"
exec "$ROOT/.venv-cpu/bin/peagle" example "$@"
