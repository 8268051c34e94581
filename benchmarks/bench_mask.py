"""P-EAGLE attention masks: per-sample mask construction, and memory/time of partitioned training steps.

1. Per-sample mask construction (K = 8, ratio 0.8, ratio_min 0.2, block 128) for one packed row:
   - "peagle": BlockMaskBuilder.build (block summaries + pairwise classification, then BlockMask.from_kv_blocks);
   - "peagle-op": the mask_block op alone (the block tensors, without torch's BlockMask wrapper);
   - "peagle-slice" / "peagle-slice-op" / "peagle-slice-dense": the paper's amortized construction, MaskSlicer over
     the mask_slice ops (table precomputed once for the longest T, apart; each sample sliced out of it);
   - "create_block_mask": torch's create_block_mask with the equivalent mask_mod (what the peer does every step);
   - "create_block_mask-compiled": torch.compile(create_block_mask), steady state (compile time reported apart);
   - "dense-torch": the dense boolean mask from PyTorch ops (mask_dense_reference);
   - "peagle-dense": the dense boolean mask op (what CPU training with SDPA uses);
   - "fill-same-size": filling an N x N bool tensor, the floor of any dense mask (goal: peagle-dense within 2x).
2. One forward + backward of a 2-layer drafter-like stack (hidden 256, SDPA with dense masks on CPU) over a row split
   into S segments (peagle.train.partition); each configuration runs in a fresh subprocess capped at MEMORY_CAP_GIB of
   address space, reporting its peak resident memory (VmHWM) and time, or that it did not fit.

    .venv-cpu/bin/python -m pytest benchmarks/bench_mask.py --benchmark-json=mask.json   # pytest-benchmark
    .venv-cpu/bin/python benchmarks/bench_mask.py [all|build|step]                        # the tables, markdown

PEAGLE_BENCH_SMOKE=1 shrinks every size (CI smoke run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from common import best_time
from torch.nn.attention.flex_attention import create_block_mask

SMOKE = os.environ.get("PEAGLE_BENCH_SMOKE", "0") not in ("", "0")
NUM_DEPTHS, RATIO, RATIO_MIN, BLOCK = 8, 0.8, 0.2, 128
BUILD_LENGTHS = [256] if SMOKE else [2048, 8192, 16384]
STEP_LENGTHS = [256] if SMOKE else [4096, 16384]
SEGMENTS = [1, 2] if SMOKE else [1, 2, 4, 8]
HIDDEN, FEATURES, VOCAB, HEADS, LAYERS = (64, 48, 100, 2, 2) if SMOKE else (256, 3 * 256, 1000, 4, 2)
MEMORY_CAP_GIB = float(os.environ.get("PEAGLE_BENCH_MEMORY_CAP_GIB", "2" if SMOKE else "18"))
# Baselines materialise N x N masks; past this many pairs they are skipped (they would not fit beside other work).
MAX_BASELINE_PAIRS = 1.2e9


def make_sample(length: int, seed: int = 0):
    from peagle.ops import cod_sample
    from testkit import random_packed_row

    gen = torch.Generator().manual_seed(seed + length)
    row = random_packed_row(gen, length, mean_document_length=length / 4)
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, NUM_DEPTHS, RATIO, RATIO_MIN, None, seed)
    return row, anchors, depths


_slicers: list = []


def slicer():
    """The MaskSlicer of the longest T, made once (the amortized precomputation, outside every timing)."""
    from peagle.ops import MaskSlicer

    if not _slicers:
        _slicers.append(MaskSlicer(max(BUILD_LENGTHS), NUM_DEPTHS, None, BLOCK))
    return _slicers[0]


def construction_impls(anchors, depths, docs):
    from peagle.ops import BlockMaskBuilder, make_mask_mod, mask_block, mask_dense, mask_dense_reference

    n = anchors.numel()
    builder = BlockMaskBuilder(BLOCK)
    mask_mod = make_mask_mod(anchors, depths, docs)
    sliced = slicer()
    return {
        "peagle": lambda: builder.build(anchors, depths, docs),
        "peagle-op": lambda: mask_block(anchors, depths, docs, BLOCK),
        "peagle-slice": lambda: sliced.block_mask(anchors, depths, docs),
        "peagle-slice-op": lambda: sliced.blocks(anchors, depths, docs),
        "peagle-slice-dense": lambda: sliced.dense(anchors, depths, docs),
        "create_block_mask": lambda: create_block_mask(mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=BLOCK),
        "create_block_mask-compiled": lambda: compiled_create_block_mask()(
            mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=BLOCK
        ),
        "dense-torch": lambda: mask_dense_reference(anchors, depths, docs),
        "peagle-dense": lambda: mask_dense(anchors, depths, docs),
        "fill-same-size": lambda: torch.empty(n, n, dtype=torch.bool).fill_(True),
    }


_compiled: list = []


def compiled_create_block_mask():
    """torch.compile(create_block_mask), made once (each new N compiles once more: its time is reported apart)."""
    if not _compiled:
        _compiled.append(torch.compile(create_block_mask))
    return _compiled[0]


BLOCK_IMPLS = [
    "peagle",
    "peagle-op",
    "peagle-slice",
    "peagle-slice-op",
    "create_block_mask",
    "create_block_mask-compiled",
]
DENSE_IMPLS = ["peagle-dense", "peagle-slice-dense", "dense-torch", "fill-same-size"]
FAST_IMPLS = ("peagle", "peagle-op", "peagle-slice", "peagle-slice-op")  # sub-10 ms: many rounds
# Baselines that materialise N x N pairs (the dense ones are the output itself, so they always run).
MATERIALISING = ("create_block_mask", "dense-torch")
MASK_NOTES = {
    "block": "Block masks: `create_block_mask-compiled` is `torch.compile(create_block_mask)` in steady state (its "
    "compile time for each N is in extra_info compile_s, apart); eager `create_block_mask` and the dense PyTorch "
    "reference are skipped past 1.2e9 pairs (they materialise N x N). `-op` rows are the block tensors alone; "
    "`peagle` and `peagle-slice` include torch's BlockMask.from_kv_blocks (what create_block_mask returns). "
    "`peagle-slice*` is the paper's amortized construction (MaskSlicer: the table of the longest T made once, apart).",
    "dense": "Dense masks: `fill-same-size` is not an alternative but the floor (writing N x N bools); the goal is "
    "peagle-dense within 2x of it. A loss against it is expected, by how much is the figure.",
}


@pytest.mark.parametrize("length", BUILD_LENGTHS)
@pytest.mark.parametrize("impl", BLOCK_IMPLS + DENSE_IMPLS)
def test_mask_construction(benchmark, impl, length):
    row, anchors, depths = make_sample(length)
    n = anchors.numel()
    if impl in MATERIALISING and n * n > MAX_BASELINE_PAIRS:
        pytest.skip(f"{impl} materialises {n} x {n} pairs")
    fn = construction_impls(anchors, depths, row.document_ids)[impl]
    kind = "block" if impl in BLOCK_IMPLS else "dense"
    benchmark.extra_info.update(
        {"impl": impl, "case": f"mask ({kind}) T={length} N={n}", "elements": n, "note": MASK_NOTES[kind]}
    )
    if impl == "create_block_mask-compiled":
        if SMOKE:
            pytest.skip("compiling create_block_mask takes tens of seconds: full runs only")
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
        benchmark.extra_info["compile_s"] = round(time.perf_counter() - start, 1)
    rounds = 20 if impl in FAST_IMPLS else (2 if n * n > 2e8 else 3)
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)


# ---------------------------------------------------------------------------------------------------------------------
# Partitioned training step, one configuration per subprocess (clean peak-memory measurement and an address-space cap).

_STEP_CHILD = r"""
import json, resource, sys, time
cap = int(float(sys.argv[3]) * 2**30)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
import torch
sys.path.insert(0, sys.argv[4])
from bench_mask import step_once
print(json.dumps(step_once(int(sys.argv[1]), int(sys.argv[2]))))
"""


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def step_once(length: int, num_segments: int) -> dict:
    """One forward + backward over all segments of one row; peak RSS above the pre-step level and the times."""
    from peagle.ops import cod_gather
    from peagle.train import partition_elements, segment_masks
    from peagle.train.stack import DrafterLikeStack

    torch.manual_seed(0)
    row, anchors, depths = make_sample(length)
    model = DrafterLikeStack(HIDDEN, FEATURES, VOCAB, length + NUM_DEPTHS, num_layers=LAYERS, heads=HEADS)
    hidden = torch.randn(length, FEATURES)
    ids = torch.randint(0, VOCAB - 1, (length,))
    targets = torch.randint(0, VOCAB, (length + NUM_DEPTHS,))
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    base = _vm_kib("VmRSS")
    start = time.perf_counter()
    segments = partition_elements(anchors, depths, row.document_ids, num_segments, num_layers=LAYERS)
    largest = max(seg.index.numel() for seg in segments)
    mask_s = 0.0
    for seg in segments:
        t0 = time.perf_counter()
        (mask,) = segment_masks([seg], row.document_ids)
        mask_s += time.perf_counter() - t0
        inputs = cod_gather(ids, hidden, model.mask_hidden, seg.anchors, seg.depths, VOCAB - 1)
        logits = model(inputs.feats, inputs.ids, inputs.position_ids, mask)
        losses = torch.nn.functional.cross_entropy(logits, targets[inputs.label_index], reduction="none")
        (losses * seg.owned).sum().backward()
        del mask, logits, losses, inputs
    total_s = time.perf_counter() - start
    return {
        "T": length,
        "S": num_segments,
        "N": anchors.numel(),
        "largest_segment": largest,
        "peak_gib": (_vm_kib("VmHWM") - base) / 2**20,
        "step_s": total_s,
        "mask_s": mask_s,
    }


def run_step_child(length: int, num_segments: int) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _STEP_CHILD, str(length), str(num_segments), str(MEMORY_CAP_GIB), here],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["?"]
        return {"T": length, "S": num_segments, "error": f"did not fit in {MEMORY_CAP_GIB:g} GiB ({tail[0][:80]})"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("num_segments", SEGMENTS)
@pytest.mark.parametrize("length", STEP_LENGTHS)
def test_partitioned_step(benchmark, length, num_segments):
    result = benchmark.pedantic(run_step_child, args=(length, num_segments), rounds=1, iterations=1)
    benchmark.extra_info.update({"impl": f"peagle-S{num_segments}", "case": f"step T={length}", **result})
    print(result)


# ---------------------------------------------------------------------------------------------------------------------


def main(parts: str = "all") -> None:
    import peagle  # noqa: F401

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, smoke={SMOKE}\n")
    if parts in ("all", "build"):
        construction_table()
    if parts in ("all", "step"):
        step_table()


def construction_table() -> None:
    names = BLOCK_IMPLS + DENSE_IMPLS
    print("| T | N | blocks | " + " | ".join(f"{name} ms" for name in names) + " | best baseline / peagle (block) |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    for length in BUILD_LENGTHS:
        row, anchors, depths = make_sample(length)
        n = anchors.numel()
        impls = construction_impls(anchors, depths, row.document_ids)
        times = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in names:
                skip = name in MATERIALISING and n * n > MAX_BASELINE_PAIRS
                times[name] = (
                    float("nan") if skip else best_time(impls[name], 30 if name in FAST_IMPLS else 2, warmup=True) * 1e3
                )
        nb = -(-n // BLOCK)
        baseline = min(t for name, t in times.items() if name.startswith("create_block_mask") and t == t)
        cells = " | ".join(f"{times[name]:.2f}" for name in names)
        print(f"| {length} | {n} | {nb}x{nb} | {cells} | {baseline / min(times[name] for name in FAST_IMPLS):.0f} |")


def step_table() -> None:
    print("\n| T | S | N | largest segment | peak extra RSS GiB | fwd+bwd s | of which masks s |")
    print("|---|---|---|---|---|---|---|")
    for length in STEP_LENGTHS:
        for num_segments in SEGMENTS:
            r = run_step_child(length, num_segments)
            if "error" in r:
                print(f"| {length} | {num_segments} | | | {r['error']} | | |")
            else:
                print(
                    f"| {length} | {num_segments} | {r['N']} | {r['largest_segment']} | {r['peak_gib']:.2f} | "
                    f"{r['step_s']:.2f} | {r['mask_s']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
