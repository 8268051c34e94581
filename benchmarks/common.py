"""Shared helpers of the microbenchmarks (pytest-benchmark).

PEAGLE_BENCH_SMOKE=1 shrinks every size so that CI runs each benchmark once in seconds; the real figures come from a
plain run (see README). Each benchmark tags itself with extra_info {"impl": ..., "case": ...}; benchmarks/report.py
turns a --benchmark-json file into the ratio table against the named baselines.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import NoReturn

import pytest
import torch

SMOKE = os.environ.get("PEAGLE_BENCH_SMOKE", "0") not in ("", "0")
# Peers a run could not measure, {"source", "case", "peer", "why"}; conftest.py puts them in the --benchmark-json file
# (key "skipped_peers") and report.py shows them beside the cases.
SKIPPED_PEERS: list[dict[str, str]] = []


def sizes(full: list, smoke: list) -> list:
    return smoke if SMOKE else full


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """Peak resident memory fn() adds above the current level (Linux: resets VmHWM through clear_refs)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _rss_kib("VmRSS")
    result = fn()
    return (_rss_kib("VmHWM") - before) * 1024, result


def load_module_file(package: str, relative_path: str) -> ModuleType | None:
    """Loads one file of an installed package without running the package's __init__ (peer packages installed with
    --no-deps cannot import their whole tree). None if the package is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), relative_path)
    module_spec = importlib.util.spec_from_file_location(f"_peer_{package}_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def record_skipped_peer(source: str, case: str, peer: str, why: str) -> None:
    """Records, for the JSON and the report, that ``peer`` could not be measured in ``case`` of ``source`` and why."""
    SKIPPED_PEERS.append({"source": os.path.basename(source), "case": case, "peer": peer, "why": why})


def skip_peer(source: str, case: str, peer: str, why: str) -> NoReturn:
    """Skips the running benchmark because ``peer`` cannot be measured, and records why (record_skipped_peer)."""
    record_skipped_peer(source, case, peer, why)
    pytest.skip(f"skipped: {why}")


def devices() -> list:
    """cpu always; cuda where a device exists (the GPU script runs `-k cuda`)."""
    import torch

    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def copy_bandwidth() -> float:
    """Device copy bandwidth (bytes read + written per second) of a 256 MiB buffer: the roof of copy-bound ops."""
    src = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)  # read + write bytes per second


def last_level_cache_bytes() -> int:
    """The size of one last-level CPU cache, from sysfs (glibc's sysconf can report the host's total inside a virtual
    machine: 384 MiB for a 32 MiB L3); 32 MiB where sysfs does not say."""
    index = "/sys/devices/system/cpu/cpu0/cache"
    sizes = []
    for entry in sorted(os.listdir(index)) if os.path.isdir(index) else []:
        try:
            with open(os.path.join(index, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


_EVICT_BUFFER: list[torch.Tensor] = []


def evict_caches() -> None:
    """Writes a buffer of twice the last-level cache, so that the next call finds none of its data in the caches, as
    one layer of a served model finds its state cache after every other layer has run."""
    if not _EVICT_BUFFER:
        _EVICT_BUFFER.append(torch.empty(2 * last_level_cache_bytes(), dtype=torch.uint8))
    _EVICT_BUFFER[0].fill_(1)


def best_time(
    fn: Callable[[], object], repeat: int, warmup: bool = False, before: Callable[[], object] | None = None
) -> float:
    """The fastest wall time (seconds) of ``repeat`` calls, after one untimed call when ``warmup``; ``before`` (e.g.
    :func:`evict_caches`) runs untimed before each timed call."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeat):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def cuda_time(fn: Callable[[], object], repeat: int = 20) -> float:
    """Mean wall time (seconds) per call on a CUDA device after one warm-up call, synchronised before and after, so
    host synchronisations inside the op count too."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def cuda_round_time(fn: Callable[[], object], rounds: int = 10, warmup: int = 1) -> float:
    """Mean wall time (seconds) of ``rounds`` calls, each followed by a device synchronisation, after ``warmup``
    untimed calls: the protocol of ``benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=rounds,
    warmup_rounds=warmup)``, so a peer timed with it and peagle timed by pytest-benchmark compare like for like."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        total += time.perf_counter() - start
    return total / rounds
