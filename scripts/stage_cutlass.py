"""Copies the CUTLASS / CuTe headers of the nvidia-cutlass package (in the build environment, e.g. .venv-cuda) to
build/cutlass/include, where setup.py finds them on a machine without the package: the GPU machine has no package
registry, so a session carries build/cutlass there (27 MB) and cuda_tests/run_gpu.sh then builds the tensor-core
paths.

    .venv-cuda/bin/python scripts/stage_cutlass.py [DEST]
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

DEFAULT_DEST = Path(__file__).resolve().parents[1] / "build" / "cutlass" / "include"


def main() -> int:
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DEST
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        print("no nvidia-cutlass package in this environment (pip install nvidia-cutlass==4.2.0.0)", file=sys.stderr)
        return 1
    source = Path(next(iter(spec.submodule_search_locations))) / "source" / "include"
    if not (source / "cutlass" / "gemm" / "device" / "gemm.h").is_file():
        print(f"no CUTLASS headers under {source}", file=sys.stderr)
        return 1
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"CUTLASS headers copied to {dest} ({size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
