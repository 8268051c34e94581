"""The GPU script (cuda_tests/run_gpu.sh) and its sanitizer cases, checked on a machine without a GPU: the cases are
valid inputs that cover every op with a CPU kernel, and the script's summary survives a failed preflight and a stage
that runs out of time (with fake device tools on PATH), with a non-zero exit either way; the peer benchmarks are an
opt-in stage of their own."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import zipfile
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


def passing_tools(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """Fake device tools under which every stage passes at once; the fake python logs each call (with the peers'
    summary path it was given) to the returned file."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "bin"
    cuda_home = tmp_path / "cuda"
    (cuda_home / "bin").mkdir(parents=True)
    fake.mkdir()
    (fake / "python").write_text(
        "#!/bin/bash\n"
        f'echo "$* | summary=${{PEAGLE_PEERS_SUMMARY:-}}" >> {calls}\n'
        'case "$*" in\n'
        "  *get_device_capability*) echo 9.0a;;\n"
        "  *setup.py*) echo 'peagle: CUTLASS headers: /staged/include';;\n"
        '  *"-m pytest"*) echo "1 passed in 0.01s";;\n'
        "esac\n"
        "exit 0\n"
    )
    (fake / "nvidia-smi").write_text("#!/bin/bash\necho 'fake GPU, 1 MiB, 0'\n")
    (cuda_home / "bin" / "nvcc").write_text("#!/bin/bash\necho 'Cuda compilation tools, fake'\n")
    for tool in (fake / "python", fake / "nvidia-smi", cuda_home / "bin" / "nvcc"):
        tool.chmod(0o755)
    for tool in ("cmake", "compute-sanitizer"):  # the ctest and sanitizer stages run nothing real either
        (fake / tool).write_text("#!/bin/bash\nexit 0\n")
        (fake / tool).chmod(0o755)
    env = {
        "PYTHON": str(fake / "python"),
        "PATH": f"{fake}:{os.environ['PATH']}",
        "CUDA_HOME": str(cuda_home),
        "PEAGLE_GPU_BUDGET": "120",
    }
    return env, calls


@pytest.mark.parametrize("timings", ["0", "1"])
def test_peer_benchmarks_are_an_opt_in_stage(tmp_path, timings):
    """The side-by-side peer benchmarks run only with PEAGLE_GPU_TIMINGS, as their own stage whose JSON and summary
    table land in $OUT; the default benchmark stage leaves their file out."""
    env, calls = passing_tools(tmp_path)
    run_script(tmp_path, {**env, "PEAGLE_GPU_TIMINGS": timings})
    out = tmp_path / "out"
    summary = (out / "summary.txt").read_text()
    logged = calls.read_text().splitlines()
    default = [line for line in logged if "-m pytest benchmarks -q" in line]
    assert len(default) == 1 and "--ignore benchmarks/bench_peers_cuda.py" in default[0], logged
    peers = [line for line in logged if "-m pytest benchmarks/bench_peers_cuda.py" in line]
    stage = next(line for line in summary.splitlines() if line.startswith("GPU peer benchmarks"))
    if timings == "0":
        assert peers == [] and "not run (opt-in: PEAGLE_GPU_TIMINGS=1)" in stage, summary
        return
    assert len(peers) == 1 and "ok in" in stage, summary
    assert f"--benchmark-json {out}/bench_peers.json" in peers[0] and "-rs" in peers[0], peers
    assert peers[0].endswith(f"summary={out}/bench_peers.md"), peers
    assert "peer benchmark counts" in summary and "1 passed" in summary, summary


MUTATION = ROOT / "cuda_tests" / "mutation.py"


def test_mutation_still_applies_to_the_verification_walk(tmp_path):
    """The deliberately wrong kernel of mutation_check.sh: its one line is still in the current source, exactly once and
    inside the CUDA greedy walk, and applying it (to a copy) changes exactly that line."""
    spec = runpy.run_path(str(MUTATION))
    source = (ROOT / spec["FILE"]).read_text()
    start = source.index(f"void __launch_bounds__(kWalkThreads) {spec['KERNEL']}(")
    end = source.index("\n}\n", start)
    assert source.count(spec["BEFORE"]) == 1
    assert start < source.index(spec["BEFORE"]) < end, "the mutated line left the greedy walk"
    copy = tmp_path / spec["FILE"]
    copy.parent.mkdir(parents=True)
    copy.write_text(source)
    run = subprocess.run([sys.executable, str(MUTATION), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    changed = [(a, b) for a, b in zip(source.splitlines(), copy.read_text().splitlines(), strict=True) if a != b]
    assert changed == [(spec["BEFORE"].rstrip("\n"), spec["AFTER"].rstrip("\n"))]
    run = subprocess.run([sys.executable, str(MUTATION), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "exactly once, found it 0 times" in run.stderr  # a stale patch is an error


def test_mutation_check_is_opt_in_and_needs_a_device(tmp_path):
    """run_gpu.sh documents the check and runs it only when asked; without a CUDA device the check reports that it did
    not run (exit 2), and the checkout stays unmutated."""
    script = SCRIPT.read_text()
    assert "cuda_tests/mutation_check.sh" in script.split("set -uo pipefail")[0]  # in the header comment
    assert 'if [ "${PEAGLE_GPU_MUTATION:-0}" = 1 ]; then' in script
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        ["bash", str(ROOT / "cuda_tests" / "mutation_check.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 2, run.stderr
    assert "NOT RUN (no CUDA device" in (tmp_path / "mutation" / "result.txt").read_text()
    assert "MUTATION" not in (ROOT / "csrc" / "cuda" / "tree_verify_kernels.cu").read_text()


def test_graph_chain_is_sanitized_apart_and_device_launch_is_a_stage(tmp_path):
    """The cases under PYTORCH_NO_CUDA_MEMORY_CACHING leave the graph chain out (capturing a graph needs the caching
    allocator), which runs under memcheck in its own stage; a stage fails the run where device graph launch is off."""
    env, calls = passing_tools(tmp_path)
    sanitized = tmp_path / "sanitized.txt"
    sanitizer = Path(env["PATH"].split(":")[0]) / "compute-sanitizer"
    sanitizer.write_text(f'#!/bin/bash\necho "$* | caching_off=${{PYTORCH_NO_CUDA_MEMORY_CACHING:-}}" >> {sanitized}\n')
    run_script(tmp_path, env)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    runs = sanitized.read_text().splitlines()
    assert len(runs) == 3, runs
    for tool, line in zip(["memcheck", "racecheck"], runs[:2], strict=True):
        assert f"--tool {tool} " in line and line.endswith(
            "sanitizer_cases.py cuda --without-graph-chain | caching_off=1"
        )
    assert "--tool memcheck " in runs[2] and runs[2].endswith(
        "sanitizer_cases.py cuda --graph-chain-only | caching_off="
    )
    assert "compute-sanitizer graph chain" in summary, summary
    launch = [line for line in calls.read_text().splitlines() if "import device_launch_available" in line]
    assert len(launch) == 1 and "device graph launch available" in summary, summary


def test_a_build_without_device_graph_launch_fails_the_run(tmp_path):
    env, _ = passing_tools(tmp_path)
    python = Path(env["PYTHON"])
    script = python.read_text().replace('case "$*" in\n', 'case "$*" in\n  *device_launch_available*) exit 1;;\n')
    python.write_text(script)
    run = run_script(tmp_path, env)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    line = next(line for line in summary.splitlines() if line.startswith("device graph launch available"))
    assert "FAILED" in line and run.returncode != 0 and "result: FAILED" in summary, summary


@pytest.mark.parametrize("headers", [True, False])
def test_a_build_without_cutlass_fails_the_run(tmp_path, headers):
    """The tensor-core paths need the CUTLASS headers (carried to the GPU machine as build/cutlass): a build without
    them fails the run instead of letting their tests skip; with them the tests are told to expect the mma path."""
    env, calls = passing_tools(tmp_path)
    python = Path(env["PYTHON"])
    if not headers:
        python.write_text(python.read_text().replace("/staged/include", "none (tensor-core paths not built)"))
    python.write_text(python.read_text().replace(" | summary=", " | expect=${PEAGLE_EXPECT_CUTLASS:-} | summary="))
    run = run_script(tmp_path, env)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    line = next(line for line in summary.splitlines() if line.strip().startswith("CUTLASS"))
    tests = [line for line in calls.read_text().splitlines() if "-m pytest cuda_tests/" in line]
    expect = f"| expect={'1' if headers else ''} |"
    assert tests and all(expect in test for test in tests), (expect, tests)
    if headers:
        assert line.endswith("/staged/include"), line
    else:
        assert "FAILED: no headers" in line and "stage_cutlass.py" in line, line
        assert run.returncode != 0 and "result: FAILED" in summary


def test_a_crashing_test_file_costs_that_file_only(tmp_path):
    """Each cuda_tests file runs in its own pytest process: one that dies of a segfault (as every file with an error
    test did on the first GPU run) fails the stage and is named, and every other file still runs."""
    env, calls = passing_tools(tmp_path)
    python = Path(env["PYTHON"])
    python.write_text(python.read_text().replace('case "$*" in\n', 'case "$*" in\n  *test_kv_cuda*) kill -SEGV $$;;\n'))
    run = run_script(tmp_path, env)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    files = sorted(p.name for p in (ROOT / "cuda_tests").glob("test_*.py"))
    ran = [line for line in calls.read_text().splitlines() if "-m pytest cuda_tests/" in line]
    assert sorted(line.split("-m pytest cuda_tests/")[1].split()[0] for line in ran) == files
    line = next(line for line in summary.splitlines() if "cuda_tests files" in line)
    assert f"{len(files) - 1} of {len(files)} passed; FAILED test_kv_cuda exit 139" in line, summary
    assert run.returncode != 0 and "result: FAILED" in summary
    log = (tmp_path / "out" / "cuda_tests" / "test_kv_cuda.result").read_text()
    assert "crashed: see cuda_tests/test_kv_cuda.log" in log


@pytest.mark.parametrize("staged", [True, False])
def test_staged_peers_go_on_the_peer_benchmarks_path(tmp_path, staged):
    """Peers staged by scripts/stage_peers.py (carried as build/peers) lead the peer benchmarks' PYTHONPATH, and the
    summary names them; without them the stage runs on the machine's own packages and the summary says how to stage."""
    env, calls = passing_tools(tmp_path)
    python = Path(env["PYTHON"])
    python.write_text(python.read_text().replace(" | summary=", " | pythonpath=${PYTHONPATH:-} | summary="))
    site = tmp_path / "peers-site"
    if staged:
        site.mkdir()
        (site / "STAGED.txt").write_text("einops-0.8.2-py3-none-any.whl\nfla_core-0.6.0-py3-none-any.whl\n")
    run_script(tmp_path, {**env, "PEAGLE_GPU_TIMINGS": "1", "PEAGLE_PEERS_SITE": str(site)})
    summary = (tmp_path / "out" / "summary.txt").read_text()
    logged = calls.read_text().splitlines()
    peers = next(line for line in logged if "-m pytest benchmarks/bench_peers_cuda.py" in line)
    others = [line for line in logged if "pythonpath=" in line and "bench_peers_cuda" not in line]
    line = next(line for line in summary.splitlines() if line.strip().startswith("staged peers"))
    assert others and all(str(site) not in other for other in others), others  # only the peer stage sees them
    if staged:
        assert f"pythonpath={site}:{ROOT}" in peers, peers
        assert "einops-0.8.2-py3-none-any.whl fla_core-0.6.0-py3-none-any.whl" in line, summary
    else:
        assert str(site) not in peers and f"pythonpath={ROOT}" in peers, peers
        assert "none (scripts/stage_peers.py, carry build/peers)" in line, summary


def make_wheel(folder: Path, name: str, module: str, body: str) -> Path:
    wheel = folder / name
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{module}/__init__.py", body)
        archive.writestr(f"{module}-1.0.dist-info/METADATA", f"Name: {module}\nVersion: 1.0\n")
    return wheel


def test_stage_peers_unpacks_pure_python_wheels_importably(tmp_path):
    unpack_wheels = runpy.run_path(str(ROOT / "scripts" / "stage_peers.py"))["unpack_wheels"]
    wheels = [
        make_wheel(tmp_path, "peer_b-1.0-py3-none-any.whl", "peer_b", "VALUE = 'b'\n"),
        make_wheel(tmp_path, "peer_a-1.0-py3-none-any.whl", "peer_a", "from peer_b import VALUE\n"),
    ]
    site = tmp_path / "site"
    (site / "stale").mkdir(parents=True)  # an earlier staging is replaced, not merged
    names = unpack_wheels(wheels, site)
    assert names == ["peer_a-1.0-py3-none-any.whl", "peer_b-1.0-py3-none-any.whl"]
    assert (site / "STAGED.txt").read_text() == "".join(f"{name}\n" for name in names)
    assert not (site / "stale").exists()
    run = subprocess.run(
        [sys.executable, "-c", "import peer_a; print(peer_a.VALUE)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(site)},
        timeout=60,
    )
    assert run.returncode == 0 and run.stdout.strip() == "b", run.stderr
    compiled = make_wheel(tmp_path, "peer_c-1.0-cp311-cp311-linux_x86_64.whl", "peer_c", "")
    with pytest.raises(ValueError, match=r"peer_c-1.0-cp311-cp311-linux_x86_64.whl is not a pure-Python wheel"):
        unpack_wheels([compiled], tmp_path / "other")
