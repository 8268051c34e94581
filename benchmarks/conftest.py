"""Records what benchmarks/report.py puts in RESULTS.md beside the times: the command, torch's threads and version,
the load average at the start and the end of the run (the machine may be shared), and the peers that could not be
measured (common.skip_peer)."""

from __future__ import annotations

import os
import shlex
import sys

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
