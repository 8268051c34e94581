"""Records what benchmarks/report.py puts in RESULTS.md beside the times: the command, torch's threads and version,
the load average at the start and the end of the run and of every benchmark (extra_info load_before / load_after /
torch_threads / cores: report.py marks a row measured above the core count as noisy), and the peers that could not be
measured (common.skip_peer)."""

from __future__ import annotations

import os
import shlex
import sys

import pytest

_LOAD_AT_START = "/".join(f"{x:.2f}" for x in os.getloadavg())


def pytest_benchmark_update_machine_info(config, machine_info):
    import torch

    smoke = os.environ.get("PEAGLE_BENCH_SMOKE", "0") not in ("", "0")
    machine_info["peagle"] = {
        "command": "".join(
            f"{k}={shlex.quote(v)} " for k, v in sorted(os.environ.items()) if k.startswith("PEAGLE_BENCH_")
        )
        + "python -m pytest "
        + shlex.join(sys.argv[1:]),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": _LOAD_AT_START,
        "loadavg_end": "/".join(f"{x:.2f}" for x in os.getloadavg()),
        "smoke": smoke,
    }


def pytest_benchmark_update_json(config, benchmarks, output_json):
    from common import SKIPPED_PEERS

    if SKIPPED_PEERS:
        output_json["skipped_peers"] = SKIPPED_PEERS


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Every benchmark row records the load average (1 / 5 / 15 min) before and after its test, torch's threads and
    the cores (the row is noisy when a load average passes the core count: other processes took its cores)."""
    before = [round(x, 2) for x in os.getloadavg()]
    yield
    benchmark = getattr(item, "funcargs", {}).get("benchmark")
    if benchmark is not None and hasattr(benchmark, "extra_info"):
        import torch

        benchmark.extra_info.setdefault("load_before", before)
        benchmark.extra_info.setdefault("load_after", [round(x, 2) for x in os.getloadavg()])
        benchmark.extra_info.setdefault("torch_threads", torch.get_num_threads())
        benchmark.extra_info.setdefault("cores", _cores())
