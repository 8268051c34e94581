"""kv_compact: the op against vectorised PyTorch compaction of the same paged cache, ratios measured in one run.

    .venv-cpu/bin/python -m pytest benchmarks/bench_kv.py -q -s        # pytest-benchmark; ratios in extra_info
    .venv-cpu/bin/python benchmarks/bench_kv.py                         # prints a markdown table
    PEAGLE_BENCH_SMOKE=1 ...                                            # tiny sizes (CI smoke run, a few seconds)

Baseline: ``kv_compact_reference``, what a user writes without the op: the (request, move) index tensors built once
per round, then per layer and per k/v cache one ``index_select`` of the source rows and one ``index_copy_`` into the
destinations (sources read before any write), and the lengths updated. Case: a Llama-3-8B-like cache (32 layers,
8 KV heads x 128, bf16, blocks of 16 slots), a 32-node tree per request after a ragged committed prefix, 7 accepted
drafts along a path with gaps. On CUDA also the effective bandwidth of the op (bytes moved: read + write of every moved
row) against the card's device-to-device copy bandwidth.
"""

from __future__ import annotations

import os

import pytest
import torch
from common import best_time, copy_bandwidth, cuda_time

import peagle  # noqa: F401  (registers the ops)
from peagle.ops import kv_compact, kv_compact_reference

SMOKE = os.environ.get("PEAGLE_BENCH_SMOKE", "0") not in ("", "0")
# layers, block_size, kv_heads, head_dim, tree nodes, accepted drafts
SHAPE = (2, 4, 2, 16, 8, 3) if SMOKE else (32, 16, 8, 128, 32, 7)
BATCHES = [1, 4] if SMOKE else [1, 8, 32]


def make_case(batch: int, device: str = "cpu", dtype=torch.bfloat16):
    """Caches with only the blocks the batch needs, shuffled; returns (args, moved rows per cache)."""
    layers, block_size, kv_heads, head_dim, nodes, accepted = SHAPE
    gen = torch.Generator().manual_seed(batch)
    seq = torch.randint(0, 4 * block_size, (batch,), generator=gen)
    per_request = [-(-(int(s) + nodes) // block_size) for s in seq]
    max_blocks = max(per_request)
    physical = torch.randperm(sum(per_request), generator=gen)
    table = torch.full((batch, max_blocks), -1, dtype=torch.long)
    start = 0
    for b, count in enumerate(per_request):
        table[b, :count] = physical[start : start + count]
        start += count
    nodes_picked = torch.stack([torch.randperm(nodes - 1, generator=gen)[:accepted] + 1 for _ in range(batch)])
    path = torch.cat([torch.zeros(batch, 1, dtype=torch.long), nodes_picked.sort(dim=1).values], dim=1)
    count = torch.full((batch,), accepted, dtype=torch.long)
    shape = (sum(per_request), block_size, kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2 * layers)]
    moved = int((path[:, 1:] != torch.arange(1, accepted + 1)).sum())
    args = [caches[:layers], caches[layers:], table, seq, path, count]
    return [[c.to(device) for c in a] if isinstance(a, list) else a.to(device) for a in args], moved


def runners(args):
    """The op and the baseline on the same caches; each call starts from the same lengths (the moves themselves are
    idempotent in cost: the same rows move every time)."""
    k, v, table, seq, path, count = args
    lengths = seq.clone()

    def op():
        lengths.copy_(seq)
        kv_compact(k, v, table, lengths, path, count)

    def baseline():
        lengths.copy_(seq)
        kv_compact_reference(k, v, table, lengths, path, count)

    return op, baseline


@pytest.mark.parametrize("batch", BATCHES)
def test_cpu_vs_pytorch_compaction(benchmark, batch):
    args, _ = make_case(batch)
    op, baseline = runners(args)
    baseline()
    ref_s = best_time(baseline, 5 if SMOKE else 20)
    benchmark.pedantic(op, rounds=5 if SMOKE else 20, warmup_rounds=1)
    ours = benchmark.stats.stats.min
    benchmark.extra_info.update(
        impl="peagle", case=f"B={batch}", baseline_s=ref_s, speedup_vs_pytorch=ref_s / ours, shape=str(SHAPE)
    )
    print(
        f"B={batch}: index_select/index_copy_ {ref_s * 1e6:.1f} us, kv_compact {ours * 1e6:.1f} us: {ref_s / ours:.1f}x"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", BATCHES)
def test_cuda_vs_pytorch_compaction(benchmark, batch):
    args, moved = make_case(batch, "cuda")
    op, baseline = runners(args)
    ours, ref_s = cuda_time(op), cuda_time(baseline)
    k = args[0][0]
    moved_bytes = 2 * moved * k.shape[2] * k.shape[3] * k.element_size() * 2 * len(args[0])  # read + write, k and v
    bandwidth = copy_bandwidth()
    benchmark.extra_info.update(
        impl="peagle",
        case=f"cuda B={batch}",
        baseline_s=ref_s,
        speedup_vs_pytorch=ref_s / ours,
        effective_gbps=moved_bytes / ours / 1e9,
        copy_gbps=bandwidth / 1e9,
    )
    benchmark.pedantic(lambda: (op(), torch.cuda.synchronize()), rounds=5)
    print(
        f"cuda B={batch}: PyTorch {ref_s * 1e6:.1f} us, kv_compact {ours * 1e6:.1f} us ({ref_s / ours:.1f}x), "
        f"{moved_bytes / ours / 1e9:.1f} GB/s moved (copy {bandwidth / 1e9:.0f} GB/s)"
    )


def main() -> None:
    layers, block_size, kv_heads, head_dim, nodes, accepted = SHAPE
    print(
        f"{layers} layers, blocks of {block_size}, {kv_heads} x {head_dim} bf16, {nodes}-node trees, {accepted} "
        f"accepted; threads = {torch.get_num_threads()}"
    )
    print("| device | B | index_select/index_copy_ (us) | kv_compact (us) | speedup |")
    print("|---|---|---|---|---|")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for batch in BATCHES:
            op, baseline = runners(make_case(batch, device)[0])
            if device == "cuda":
                ours, ref_s = cuda_time(op), cuda_time(baseline)
            else:
                baseline(), op()
                ref_s, ours = best_time(baseline, 20), best_time(op, 20)
            print(f"| {device} | {batch} | {ref_s * 1e6:.1f} | {ours * 1e6:.1f} | {ref_s / ours:.1f}x |")


if __name__ == "__main__":
    main()
