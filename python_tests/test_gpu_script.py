"""The GPU script (cuda_tests/run_gpu.sh) and its sanitizer cases, checked on a machine without a GPU: the cases are
valid inputs that cover every op with a CPU kernel, and the script's summary survives a failed preflight and a stage
that runs out of time (with fake device tools on PATH), with a non-zero exit either way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "cuda_tests" / "run_gpu.sh"


def test_sanitizer_cases_cover_every_cpu_kernel():
    run = subprocess.run(
        [sys.executable, str(ROOT / "cuda_tests" / "sanitizer_cases.py"), "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ops covered on cpu" in run.stdout


def run_script(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    full_env = {**os.environ, "OUT": str(out), **env}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full_env, timeout=240)


def test_no_device_fails_preflight_with_a_summary(tmp_path):
    run = run_script(tmp_path, {"PYTHON": sys.executable, "CUDA_HOME": str(tmp_path / "no-cuda")})
    assert run.returncode != 0
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "preflight (tools, device)" in summary and "FAILED" in summary, summary
    assert "a CUDA device" in summary and "result: FAILED" in summary, summary
    assert "peagle GPU summary" in run.stderr


@pytest.mark.skipif(not Path("/usr/local/cuda/bin/nvcc").exists(), reason="needs nvcc for the preflight")
def test_stage_timeout_keeps_the_summary(tmp_path):
    """A fake python (every check passes at once) reports a device and hangs in the build: the build stage is cut at
    what is left of the budget, and the summary (printed and in $OUT) says so; without a build the script stops."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text(
        "#!/bin/bash\n"
        'case "$*" in\n'
        "  *cuda.is_available*) exit 0;;\n"
        "  *get_device_capability*) echo 9.0a;;\n"
        "  *setup.py*) exec sleep 600;;\n"
        "  *) exit 0;;\n"
        "esac\n"
    )
    (fake / "nvidia-smi").write_text("#!/bin/bash\necho 'fake GPU, 1 MiB, 0'\n")
    for tool in fake.iterdir():
        tool.chmod(0o755)
    env = {
        "PYTHON": str(fake / "python"),
        "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "CUDA_HOME": "/usr/local/cuda",
        "PEAGLE_GPU_BUDGET": "45",
    }
    run = run_script(tmp_path, env)
    assert run.returncode != 0
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "fake GPU" in summary
    assert "build (archs 9.0a)" in summary and "TIMED OUT" in summary, summary
    assert "cuda_tests" not in summary, summary
    assert "peagle GPU summary" in run.stderr
    assert "result: FAILED" in summary
