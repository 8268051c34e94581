"""COD sample + gather: peagle's op vs the pure-PyTorch reference vs speculators 0.9.0's path.

"peagle" reuses the CPU output blocks of the previous step (csrc/cpu/large_buffers.h), as a training loop does;
"peagle-cold" returns them to the OS before every call, so it pays the first-touch page faults each time.
The speculators path is `generate_cod_sample_indices` plus the indexing its PEagleDraftModel forward does to build the
drafter inputs (token ids and hidden rows, mask token / mask_hidden beyond depth 0). Figures: README "Benchmarks".
"""

from __future__ import annotations

import pytest
import torch
from common import devices, load_module_file, peak_extra_bytes, sizes

from peagle.ops import cod_gather, cod_gather_reference, cod_sample, cod_sample_reference
from testkit import random_packed_row

NUM_DEPTHS, RATIO, RATIO_MIN, MAX_ANCHORS, MASK_ID = 8, 0.7, 0.2, 512, 128000
WIDTH = sizes(3 * 4096, 3 * 64)
LENGTHS = sizes([2048, 8192, 16384], [256])
speculators_data = load_module_file("speculators", "models/peagle/data.py")


def make_row(length: int, device: str):
    gen = torch.Generator().manual_seed(length)
    row = random_packed_row(gen, length, mean_document_length=length / 4)
    input_ids = torch.randint(0, MASK_ID, (length,), generator=gen)
    hidden = torch.randn(length, WIDTH, generator=gen).to(torch.bfloat16)
    mask_hidden = torch.randn(WIDTH, generator=gen).to(torch.bfloat16)
    return [t.to(device) for t in (row.loss_mask, row.document_ids, input_ids, hidden, mask_hidden)]


def peagle_path(loss_mask, document_ids, input_ids, hidden, mask_hidden, seed=0):
    anchors, depths = cod_sample(loss_mask, document_ids, NUM_DEPTHS, RATIO, RATIO_MIN, MAX_ANCHORS, seed)
    return cod_gather(input_ids, hidden, mask_hidden, anchors, depths, MASK_ID)


def peagle_cold_path(*inputs):
    # Every call starts from memory the OS must fault in again, as with torch's own CPU allocator.
    torch.ops.peagle.release_cpu_buffers()
    return peagle_path(*inputs)


def reference_path(loss_mask, document_ids, input_ids, hidden, mask_hidden, seed=0):
    anchors, depths = cod_sample_reference(loss_mask, document_ids, NUM_DEPTHS, RATIO, RATIO_MIN, MAX_ANCHORS, seed)
    return cod_gather_reference(input_ids, hidden, mask_hidden, anchors, depths, MASK_ID)


def speculators_sample(loss_mask):
    """speculators' COD sampling (anchors, depths) at this file's settings."""
    return speculators_data.generate_cod_sample_indices(
        loss_mask.shape[0], loss_mask[None].float(), NUM_DEPTHS, RATIO, RATIO_MIN, max_anchors=MAX_ANCHORS
    )


def speculators_gather(input_ids, hidden, mask_hidden, anchors, depths):
    """What PEagleDraftModel.forward does with speculators' elements (speculators 0.9.0, models/peagle/core.py)."""
    positions = anchors + depths
    real = depths == 0
    ids = torch.where(real, input_ids[None][0, positions], torch.tensor(MASK_ID, device=input_ids.device))
    feats = torch.where(real[:, None], hidden[None][0, positions], mask_hidden.expand(positions.shape[0], -1))
    return ids, feats, positions


def speculators_path(loss_mask, document_ids, input_ids, hidden, mask_hidden, seed=0):
    anchors, depths = speculators_sample(loss_mask)
    return speculators_gather(input_ids, hidden, mask_hidden, anchors, depths)


IMPLS = {
    "peagle": peagle_path,
    "peagle-cold": peagle_cold_path,
    "reference": reference_path,
    "speculators-0.9.0": speculators_path,
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_cod_sample_gather(benchmark, impl, length, device):
    if impl == "speculators-0.9.0" and speculators_data is None:
        pytest.skip("speculators is not installed (pip install --no-deps speculators==0.9.0)")
    inputs = make_row(length, device)
    fn = IMPLS[impl]
    extra, out = peak_extra_bytes(lambda: fn(*inputs)) if device == "cpu" else (None, fn(*inputs))
    out_bytes = sum(t.numel() * t.element_size() for t in out)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run():
        fn(*inputs)
        sync()

    benchmark.group = f"cod sample+gather T={length} D={WIDTH} bf16 {device}"
    benchmark.extra_info.update(impl=impl, case=benchmark.group, elements=int(out[0].shape[0]), output_bytes=out_bytes)
    if extra is not None:
        benchmark.extra_info["peak_extra_over_output"] = round(extra / out_bytes, 2)
    benchmark.pedantic(run, rounds=sizes(5, 1), iterations=1, warmup_rounds=sizes(1, 0))
