"""Stages the pure-Python public peers that the GPU peer benchmarks compare with (benchmarks/bench_peers_cuda.py) in
build/peers/site: the GPU machine has no package registry, so a session carries build/peers there (about 6 MB) and
cuda_tests/run_gpu.sh puts it on the peer benchmarks' PYTHONPATH. Today that is FLA's kernels (fla-core, Triton, which
the GPU machine has) with their one dependency, einops, and speculators (the benchmarks load only its COD file, which
needs torch alone). flashinfer (a 100 MB wheel) and vLLM do not fit the carry.

    .venv-cpu/bin/python scripts/stage_peers.py [DEST]

The wheels are downloaded (pinned, no dependencies) with this Python's pip and unpacked here, so the GPU machine needs
neither pip nor a network; DEST/STAGED.txt names what was staged.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_DEST = Path(__file__).resolve().parents[1] / "build" / "peers" / "site"
PINNED = ("fla-core==0.6.0", "einops==0.8.2", "speculators==0.9.0")
MANIFEST = "STAGED.txt"


def unpack_wheels(wheels: list[Path], dest: Path) -> list[str]:
    """Unpacks pure-Python wheels into ``dest`` (replacing it) and writes its manifest; returns the wheels' names."""
    for wheel in wheels:
        if not wheel.name.endswith("-none-any.whl"):
            raise ValueError(f"stage_peers: {wheel.name} is not a pure-Python wheel (expected *-none-any.whl)")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    names = sorted(wheel.name for wheel in wheels)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(dest)
    (dest / MANIFEST).write_text("".join(f"{name}\n" for name in names))
    return names


def main() -> int:
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DEST
    with tempfile.TemporaryDirectory() as download:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", download, *PINNED]
        if subprocess.run(command).returncode != 0:
            print(f"stage_peers: could not download {', '.join(PINNED)}", file=sys.stderr)
            return 1
        names = unpack_wheels(sorted(Path(download).glob("*.whl")), dest)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"peers staged in {dest} ({size / 2**20:.1f} MiB): {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
