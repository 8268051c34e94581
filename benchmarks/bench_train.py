"""One P-EAGLE training step (COD sampling, drafter forward over the elements, KL loss to the target, backward):
peagle's trainer path vs speculators 0.9.0's PEagleDraftModel.forward + backward, same drafter on the CPU.

Config (issue 4): SDPA attention, T = 2048, 2-layer drafter, hidden 256 (4 heads x 64), K = 8, r = 0.7 / 0.2,
512 anchors, vocabulary 8192, float32. Both drafters get identical weights. speculators builds its dense mask with
flex attention's `create_mask` and computes target logits for all T rows and drafter logits for all N elements;
peagle writes the mask with its mask op, runs fc on T rows + once on mask_hidden, and computes logits only for the
elements that carry loss. "peak_extra_mb" is the resident memory the step adds (Linux VmHWM).
Run: `.venv-cpu/bin/python -m pytest benchmarks/bench_train.py --benchmark-only -s` (one thread unless
PEAGLE_BENCH_THREADS says otherwise).
"""

from __future__ import annotations

import importlib
import os
import types

import pytest
import torch
from common import peak_extra_bytes, sizes

from peagle.model import DrafterConfig, PEagleDrafter
from peagle.ops import cod_sample
from peagle.train.dataset import TrainRow
from peagle.train.trainer import train_row
from testkit import random_packed_row

LENGTH = sizes(2048, 256)
HIDDEN = sizes(256, 128)
VOCAB = sizes(8192, 512)
K, RATIO, RATIO_MIN, ANCHORS = 8, 0.7, 0.2, 512


@pytest.fixture(scope="module")
def speculators(request):
    """speculators 0.9.0's P-EAGLE classes plus its KL loss config, or None when it is not installed."""
    try:
        spec = request.getfixturevalue("speculators_peagle")  # the root conftest's import shim
        loss = importlib.import_module("speculators.losses").resolve_loss_config("kl_div", "eager")
    except ImportError:
        return None
    return types.SimpleNamespace(**vars(spec), loss=loss)


def config(
    hidden: int = HIDDEN, vocab: int = VOCAB, layers: int = 2, depths: int = K, intermediate: int | None = None
) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        num_layers=layers,
        num_heads=hidden // 64,
        num_kv_heads=hidden // 64,
        head_dim=64,
        intermediate_size=intermediate or 4 * hidden,
        mask_token_id=vocab - 1,
        num_depths=depths,
        aux_layer_ids=[1, 2, 3],
    )


def inputs(length: int = LENGTH, hidden_size: int = HIDDEN, vocab: int = VOCAB):
    gen = torch.Generator().manual_seed(0)
    row = random_packed_row(gen, length, mean_document_length=length / 4)
    hidden = torch.randn(length, 3 * hidden_size, generator=gen)
    ids = torch.randint(0, vocab - 1, (length,), generator=gen)
    last = torch.randn(length, hidden_size, generator=gen)
    return row, hidden, ids, last


def make_models(spec, cfg: DrafterConfig | None = None):
    """peagle's drafter and, when speculators is installed, its PEagleDraftModel with the same weights."""
    cfg = cfg or config()
    torch.manual_seed(0)
    ours = PEagleDrafter(cfg)
    if spec is None:
        return ours, None, None
    d = cfg.to_speculators_dict()
    d["transformer_layer_config"]["attn_implementation"] = "sdpa"
    theirs = spec.PEagleDraftModel(spec.PEagleSpeculatorConfig.model_validate(d))
    verifier_head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.05
    with torch.no_grad():
        theirs.load_state_dict(ours.state_dict(), strict=False)
        theirs.verifier_lm_head.weight.copy_(verifier_head)
        theirs.verifier_norm.weight.fill_(1.0)
    for name, p in theirs.named_parameters():
        p.requires_grad_(not name.startswith("verifier_"))
    return ours, theirs, verifier_head


def peagle_step(model, row, hidden, ids, last, head, seed=0, segments=1, cod=(K, RATIO, RATIO_MIN, ANCHORS)):
    # The trainer consumes the target's final normalised hidden state; speculators normalises it inside its step.
    target_hidden = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + 1e-6)
    train_row_in = TrainRow(ids, hidden, target_hidden, row.document_ids, row.loss_mask)
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, *cod, seed)
    model.zero_grad(set_to_none=True)
    weights = torch.ones(cod[0])
    stats = train_row(model, train_row_in, anchors, depths, head, model.draft_ids(), weights, segments=segments)
    return stats["loss"], stats["elements"]


def speculators_step(model, row, hidden, ids, last, loss_config, cod=(K, RATIO, RATIO_MIN, ANCHORS)):
    depths, ratio, ratio_min, anchors = cod
    model.zero_grad(set_to_none=True)
    _, loss, _ = model(
        hidden[None], ids[None], row.document_ids[None], loss_mask=row.loss_mask[None].float(),
        verifier_last_hidden_states=last[None], loss_config=loss_config, max_anchors=anchors, num_depths=depths,
        down_sample_ratio=ratio, down_sample_ratio_min=ratio_min,
    )  # fmt: skip
    loss.backward()
    return float(loss), None


@pytest.mark.parametrize("impl", ["peagle", "speculators-0.9.0"])
def test_train_step(benchmark, impl, speculators):
    if impl.startswith("speculators") and speculators is None:
        pytest.skip("speculators 0.9.0 is not installed (pip install --no-deps speculators==0.9.0)")
    torch.set_flush_denormal(True)
    # PEAGLE_BENCH_THREADS (default 1): two contending threads on a shared 2-core machine make timings swing 3x.
    torch.set_num_threads(int(os.environ.get("PEAGLE_BENCH_THREADS", "1")))
    row, hidden, ids, last = inputs()
    ours, theirs, head = make_models(speculators)
    if impl == "peagle":
        head = head if head is not None else torch.randn(VOCAB, HIDDEN) * 0.05
        fn = lambda: peagle_step(ours, row, hidden, ids, last, head)  # noqa: E731
    else:
        fn = lambda: speculators_step(theirs, row, hidden, ids, last, speculators.loss)  # noqa: E731
    fn()  # warm-up (allocator, oneDNN primitives)
    extra, (loss, elements) = peak_extra_bytes(fn)
    benchmark.group = f"train step T={LENGTH} H={HIDDEN} V={VOCAB} 2 layers K={K} sdpa cpu fp32"
    benchmark.extra_info.update(impl=impl, case=benchmark.group, peak_extra_mb=round(extra / 2**20, 1), loss=loss)
    if elements is not None:
        benchmark.extra_info["elements"] = elements
    print(f"\n{impl}: loss {loss:.6f}, peak extra {extra / 2**20:.1f} MiB")
    benchmark.pedantic(fn, rounds=sizes(5, 1), iterations=1, warmup_rounds=0)
