"""Longest trainable sequence: under a fixed memory cap, the longest row T at which one forward + backward of the
demo-sized drafter fits, speculators 0.9.0 (PEagleDraftModel) against peagle's trainer with S in {1, 2, 4, 8} segments.

Drafter as the demo trains it: hidden 128 (2 heads x 64), 1 layer, intermediate 384, vocabulary 2048, K = 5,
ratio 0.7 / 0.2, 128 anchors, SDPA on the CPU, float32. Each probe runs one step in a fresh subprocess and measures the
resident memory the step adds above the level after setup (Linux VmHWM reset through clear_refs; tracemalloc does not
see torch's allocations); a probe fits when that peak is within the cap. An address-space limit of 4x the cap above
the setup level stops a runaway probe (its allocation failure counts as "does not fit"). T doubles from 512 until a
probe does not fit, then bisects to a multiple of 256.

    .venv-cpu/bin/python -m pytest benchmarks/bench_longest.py -q -p no:cacheprovider --benchmark-json=longest.json
    .venv-cpu/bin/python benchmarks/bench_longest.py            # the table

PEAGLE_BENCH_MEMORY_CAP_MIB (default 512) sets the cap; PEAGLE_BENCH_SMOKE=1 uses 64 MiB, two implementations and
T <= 1024. RESULTS.md's row used a 128 MiB cap (a few minutes per implementation on 2 loaded cores).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import pytest
from common import SMOKE

CAP_MIB = float(os.environ.get("PEAGLE_BENCH_MEMORY_CAP_MIB", "64" if SMOKE else "512"))
HIDDEN, LAYERS, INTERMEDIATE, VOCAB = 128, 1, 384, 2048
COD = (5, 0.7, 0.2, 128)  # K, ratio, ratio_min, max_anchors (the demo's)
IMPLS = (
    ["speculators-0.9.0", "peagle-S2"]
    if SMOKE
    else ["speculators-0.9.0", "peagle-S1", "peagle-S2", "peagle-S4", "peagle-S8"]
)
START, GRANULE, LIMIT = 512, 256, 1024 if SMOKE else 1 << 18  # smoke: at most three probes per implementation

_CHILD = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from bench_longest import probe
print(json.dumps(probe(sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))))
"""


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def import_speculators_peagle():
    """The root conftest's import shim of speculators' P-EAGLE classes, in a probe's own process (benchmarks/conftest.py
    shadows the name; under pytest use the ``speculators_peagle`` fixture, which must not run twice)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")
    spec = importlib.util.spec_from_file_location("_peagle_root_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.import_speculators_peagle()


def probe(impl: str, length: int, cap_mib: float) -> dict:
    """One forward + backward of ``impl`` at T = ``length``, in this (fresh) process: its peak extra memory."""
    import torch
    from bench_train import config, inputs, make_models, peagle_step, speculators_step
    from common import peak_extra_bytes

    torch.set_flush_denormal(True)
    spec = None
    if impl.startswith("speculators"):
        import importlib

        spec = import_speculators_peagle()
        loss = importlib.import_module("speculators.losses").resolve_loss_config("kl_div", "eager")
    ours, theirs, head = make_models(spec, config(HIDDEN, VOCAB, LAYERS, COD[0], INTERMEDIATE))
    row, hidden, ids, last = inputs(length, HIDDEN, VOCAB)
    if spec is None:
        head = torch.randn(VOCAB, HIDDEN) * 0.05
        segments = int(impl.rsplit("S", 1)[1])
        step = lambda: peagle_step(ours, row, hidden, ids, last, head, segments=segments, cod=COD)  # noqa: E731
    else:
        step = lambda: speculators_step(theirs, row, hidden, ids, last, loss, cod=COD)  # noqa: E731
    guard = (_vm_kib("VmSize") * 1024) + int(4 * cap_mib * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (guard, guard))
    start = time.perf_counter()
    try:
        extra, _ = peak_extra_bytes(step)
    except (RuntimeError, MemoryError) as err:  # the address-space guard: far past the cap
        return {"impl": impl, "T": length, "fits": False, "error": str(err).splitlines()[0][:80]}
    peak = extra / 2**20
    return {"impl": impl, "T": length, "fits": peak <= cap_mib, "peak_mib": round(peak, 1),
            "step_s": round(time.perf_counter() - start, 2)}  # fmt: skip


def run_probe(impl: str, length: int, cap_mib: float = CAP_MIB) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    args = [sys.executable, "-c", _CHILD, here, root, impl, str(length), str(cap_mib)]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["?"]
        return {"impl": impl, "T": length, "fits": False, "error": f"exit {proc.returncode}: {tail[0][:80]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def longest(impl: str, cap_mib: float = CAP_MIB, log=print) -> tuple[int, list[dict]]:
    """The longest T (a multiple of GRANULE) whose step fits in cap_mib, and every probe made to find it."""
    probes: list[dict] = []

    def fits(length: int) -> bool:
        probes.append(run_probe(impl, length, cap_mib))
        log(probes[-1])
        return probes[-1]["fits"]

    good, bad = 0, START
    while bad <= LIMIT and fits(bad):
        good, bad = bad, 2 * bad
    while bad - good > GRANULE and bad - good > good // 16:  # to GRANULE or 1/16 of T
        mid = (good + bad) // 2 // GRANULE * GRANULE
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good, probes


def case_name() -> str:
    return (
        f"longest T, forward + backward within {CAP_MIB:g} MiB (demo drafter: hidden {HIDDEN}, {LAYERS} layer, "
        f"vocab {VOCAB}, K={COD[0]}, {COD[3]} anchors)"
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_longest_sequence(benchmark, request, impl):
    if impl.startswith("speculators"):
        try:
            request.getfixturevalue("speculators_peagle")  # the root conftest's shim, once per session
        except ImportError:
            pytest.skip("speculators 0.9.0 is not installed")
    result = {}

    def search():
        result["T"], result["probes"] = longest(impl)

    benchmark.pedantic(search, rounds=1, iterations=1)
    fitting = [p for p in result["probes"] if p["fits"] and p["T"] == result["T"]]
    benchmark.extra_info.update(
        impl=impl,
        case=case_name(),
        value=result["T"],
        unit="tokens",
        better="higher",
        peak_mib=fitting[0]["peak_mib"] if fitting else None,
        probes=len(result["probes"]),
        note="Longest trainable sequence: the largest T whose one forward + backward adds at most the cap in resident "
        "memory (measured per probe in a fresh subprocess); peagle splits the row into S segments "
        "(peagle.train.partition), speculators 0.9.0 builds one dense mask over all elements and logits for all rows.",
    )


def main() -> None:
    print(case_name())
    print("| implementation | longest T | probes |")
    print("|---|---|---|")
    for impl in IMPLS:
        length, probes = longest(impl, log=lambda p: print("  ", p, file=sys.stderr))
        print(f"| {impl} | {length} | {len(probes)} |", flush=True)


if __name__ == "__main__":
    main()
