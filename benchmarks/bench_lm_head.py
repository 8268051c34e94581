"""efficient_lm_head against the full LM head, time and memory per drafted token, ratios measured in one run.

    .venv-cpu/bin/python -m pytest benchmarks/bench_lm_head.py -q -s --benchmark-json build/bench-lm-head.json
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 ...                                  # how RESULTS.md's figures ran (below)
    .venv-cpu/bin/python benchmarks/report.py build/bench-lm-head.json      # the ratio table
    PEAGLE_BENCH_SMOKE=1 ...                                                 # tiny sizes (CI smoke run, seconds)

Case (issue 17): V = 151936, H = 4096, rank r = 128, C = 128 candidates, N in {1, 64, 1024} rows (drafted tokens),
float32 weights (the full head then runs MKL's float32 GEMM; bfloat16 was not compared on the CPU). Baseline, the
strongest alternative without the op: ``F.linear`` over the whole vocabulary (the [N, V] logits) and ``topk(C)`` of
them, which gives the same kind of output (the best C tokens of the full head with their exact logits). The op scores
the vocabulary with the rank-128 head and rescores only its 128 candidates.
Memory: the peak resident memory each call adds above the inputs (the [N, V] logits for the full head; the blocked
scores and the top-C buffers for the op), per drafted token. Goal on the CPU: >= 5x faster at N >= 64.

Threads: on the shared 2-core project machine (load average ~10 from other jobs) two-thread timings of either head
mostly measure OpenMP/MKL threads waiting for a core (a 2-thread [64, 128] x [128, 151936] GEMM ran 8x slower than on
one thread), so the recorded figures run both heads on one thread (OMP_NUM_THREADS=1; RESULTS.md lists the threads).
On CUDA (``-k cuda``, bfloat16): the same case against cuBLAS's full head, timed with synchronisation, and the peak
allocated memory each call adds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from common import SMOKE, best_time, cuda_time, peak_extra_bytes, sizes

import peagle  # noqa: F401  (registers the ops)
from peagle.ops import efficient_lm_head

VOCAB, HIDDEN, RANK, CANDIDATES = (2000, 64, 16, 16) if SMOKE else (151936, 4096, 128, 128)
ROWS = sizes([1, 64, 1024], [1, 8])


@pytest.fixture(scope="module")
def heads():
    """A full head and a rank-r head (float32), built once: the full head alone is 2.5 GB."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * HIDDEN**-0.5
    down = torch.randn(RANK, HIDDEN, generator=gen) * HIDDEN**-0.5
    up = torch.randn(VOCAB, RANK, generator=gen) * RANK**-0.5
    return weight, down, up


def full_head(hidden, weight):
    logits = F.linear(hidden, weight)  # [N, V]
    return torch.topk(logits, CANDIDATES, dim=1)


@pytest.mark.parametrize("rows", ROWS)
def test_cpu_efficient_vs_full_head(benchmark, heads, rows):
    weight, down, up = heads
    hidden = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    ours = lambda: efficient_lm_head(hidden, down, up, weight, CANDIDATES)  # noqa: E731
    theirs = lambda: full_head(hidden, weight)  # noqa: E731
    with torch.no_grad():
        ours_bytes, _ = peak_extra_bytes(ours)
        theirs_bytes, _ = peak_extra_bytes(theirs)
        repeat = 2 if rows >= 1024 else 5
        theirs_s = best_time(theirs, repeat)
        benchmark.pedantic(ours, rounds=repeat, warmup_rounds=0)
    ours_s = benchmark.stats.stats.min
    name = f"full head F.linear+topk (H={HIDDEN})"
    benchmark.extra_info.update(
        impl="peagle",
        case=f"lm head N={rows} V={VOCAB} r={RANK} C={CANDIDATES} fp32",
        baselines={name: theirs_s},
        speedup_vs_full_head=round(theirs_s / ours_s, 2),
        ms_per_token=round(ours_s * 1e3 / rows, 4),
        full_head_ms_per_token=round(theirs_s * 1e3 / rows, 4),
        peak_kib_per_token=round(ours_bytes / 1024 / rows, 1),
        full_head_peak_kib_per_token=round(theirs_bytes / 1024 / rows, 1),
    )
    print(
        f"N={rows}: full head {theirs_s * 1e3:.1f} ms ({theirs_bytes / 2**20:.1f} MiB), efficient head "
        f"{ours_s * 1e3:.1f} ms ({ours_bytes / 2**20:.1f} MiB): {theirs_s / ours_s:.1f}x faster, per token "
        f"{ours_s * 1e3 / rows:.3f} vs {theirs_s * 1e3 / rows:.3f} ms, "
        f"{ours_bytes / 1024 / rows:.0f} vs {theirs_bytes / 1024 / rows:.0f} KiB"
    )


def cuda_peak_extra_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", ROWS)
def test_cuda_efficient_vs_full_head(benchmark, heads, rows):
    """bfloat16 on the GPU (the serving dtype; cuBLAS bf16 GEMM is the full head's strongest form there)."""
    weight, down, up = (t.to("cuda", torch.bfloat16) for t in heads)
    hidden = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to("cuda", torch.bfloat16)
    ours = lambda: efficient_lm_head(hidden, down, up, weight, CANDIDATES)  # noqa: E731
    theirs = lambda: full_head(hidden, weight)  # noqa: E731
    with torch.no_grad():
        ours_s, theirs_s = cuda_time(ours), cuda_time(theirs)
        ours_bytes, theirs_bytes = cuda_peak_extra_bytes(ours), cuda_peak_extra_bytes(theirs)
        benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=5)
    benchmark.extra_info.update(
        impl="peagle",
        case=f"cuda lm head N={rows} V={VOCAB} r={RANK} C={CANDIDATES} bf16",
        baselines={f"full head F.linear+topk (H={HIDDEN}, bf16)": theirs_s},
        speedup_vs_full_head=round(theirs_s / ours_s, 2),
        ms_per_token=round(ours_s * 1e3 / rows, 5),
        full_head_ms_per_token=round(theirs_s * 1e3 / rows, 5),
        peak_kib_per_token=round(ours_bytes / 1024 / rows, 1),
        full_head_peak_kib_per_token=round(theirs_bytes / 1024 / rows, 1),
    )
    print(
        f"cuda N={rows}: full head {theirs_s * 1e3:.3f} ms ({theirs_bytes / 2**20:.1f} MiB), efficient head "
        f"{ours_s * 1e3:.3f} ms ({ours_bytes / 2**20:.1f} MiB): {theirs_s / ours_s:.1f}x faster"
    )
