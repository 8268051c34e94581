"""EAGLE-4 drafter options: the drafter step with a sliding window against full attention as the context grows, and
the recall of a trained low-rank (efficient) LM head on the demo target's drafter; ratios measured in one run.

    OMP_NUM_THREADS=1 .venv-cpu/bin/python -m pytest benchmarks/bench_drafter_options.py -q -s    # extra_info
    PEAGLE_DEMO_RUN=/tmp/demo-full/demo-default-XXXX ...                          # the demo run for the recall row
    PEAGLE_BENCH_SMOKE=1 ...                                                       # tiny sizes (a few seconds)

One thread: on a shared 2-core machine two threads per matmul wait for each other often enough to make these small
steps' times bimodal (a 7 ms step then takes 300 ms), which hides the trend.

Sliding window: one P-EAGLE drafting pass (``PEagleDrafting._pass``: one new element committed, K - 1 = 3 mask
elements, logits of the K depths) of one request whose draft cache already holds C committed entries, C in
{2K, 8K, 32K}; drafter of 2 layers, hidden 512, 8 heads of 64 (4 KV heads), vocabulary 4096, float32, W = 1024,
blocks of 16. Full attention reads and attends to all C cached entries, the window to the blocks of the last W - 1.

Recall: the demo run's trained P-EAGLE drafter (``drafters-*/peagle-k*/final``) over its training and held-out rows
(every position, depths 0..K-1 as in training); its final states and full LM head give the reference top-1. A
low-rank head (r, C below) starts from the SVD of the LM head weighted by the training rows' token counts
(``token_freq``), is trained with KL(full head || low-rank head) on the training rows' states (Adam), and recall is
measured on the held-out rows' states (the first 24 training and 12 held-out rows of the demo data).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import torch
from common import best_time

import peagle  # noqa: F401  (registers the ops)
from peagle.decode.drafting import PEagleDrafting
from peagle.model import DrafterConfig, PEagleDrafter
from peagle.ops import efficient_lm_head

SMOKE = os.environ.get("PEAGLE_BENCH_SMOKE", "0") not in ("", "0")
torch.set_flush_denormal(True)  # denormal activations of the random drafter would slow every CPU kernel many times
CONTEXTS = [256, 1024] if SMOKE else [2048, 8192, 32768]
WINDOW = 64 if SMOKE else 1024
HIDDEN, LAYERS, VOCAB, DEPTHS, BLOCK = (64, 1, 512, 4, 16) if SMOKE else (512, 2, 4096, 4, 16)


def windowed_drafting(window: int | None, capacity: int) -> PEagleDrafting:
    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=LAYERS, num_heads=HIDDEN // 64,
                           num_kv_heads=max(1, HIDDEN // 128), head_dim=64, intermediate_size=2 * HIDDEN,
                           aux_layer_ids=[1, 2, 3], mask_token_id=VOCAB - 1, num_depths=DEPTHS,
                           sliding_window=window)  # fmt: skip
    drafting = PEagleDrafting(PEagleDrafter(config).eval(), VOCAB, "chain", DEPTHS, [1] * DEPTHS, DEPTHS + 1)
    drafting.allocate(1, capacity + 64, 4, block_size=BLOCK)
    return drafting


def fill_cache(drafting: PEagleDrafting, context: int) -> None:
    """``context`` committed entries: random keys/values written straight into the cache (a 32K prefill through the
    drafter would only slow the set-up)."""
    gen = torch.Generator().manual_seed(context)
    for store in (*drafting.cache.k, *drafting.cache.v):
        store.view(-1, *store.shape[2:])[:context].copy_(torch.randn(context, *store.shape[2:], generator=gen))


def one_pass(drafting: PEagleDrafting, context: int) -> None:
    """One drafting pass after ``context`` committed entries (the lengths are reset first: a pass commits one)."""
    cache, rows = drafting.cache, torch.arange(1)
    cache.seq_len.fill_(context)
    cache.host_len[0] = context
    drafting.set_pending(rows, [0], torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, 3 * HIDDEN), [1])
    drafting.run_pending(rows, [0], DEPTHS - 1, DEPTHS)


@pytest.mark.parametrize("context", CONTEXTS)
@torch.no_grad()
def test_cpu_sliding_window_step_vs_full_attention(benchmark, context):
    repeat = 3 if SMOKE else 20
    full = windowed_drafting(None, context)
    fill_cache(full, context)
    full_s = best_time(lambda: one_pass(full, context), repeat)
    drafting = windowed_drafting(WINDOW, context)
    fill_cache(drafting, context)
    benchmark.pedantic(lambda: one_pass(drafting, context), rounds=repeat, warmup_rounds=2)
    ours = benchmark.stats.stats.min
    benchmark.extra_info.update(
        impl="peagle-window",
        case=f"drafter step, context {context}, W = {WINDOW}",
        baselines={"full attention": full_s},
        speedup_vs_full=full_s / ours,
        note=f"{LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}, K = {DEPTHS}; the window's time stays flat, full "
        "attention's grows with the context",
    )
    print(f"context {context}: full attention {full_s * 1e3:.2f} ms, window {WINDOW} {ours * 1e3:.2f} ms")


# ---------------------------------------------------------------------------------------------------------------------
# Recall of a trained low-rank head on the demo target


def demo_drafter_states(run: Path, split: str, limit_rows: int) -> tuple[PEagleDrafter, torch.Tensor, torch.Tensor]:
    """The demo's trained P-EAGLE drafter, its final states [N, H] over ``split``'s rows (every element of depths
    0..K-1; the held-out split is one directory per prompt category, which share ``limit_rows``) and the target-token
    counts of the prepared training data."""
    from safetensors.torch import load_file

    from peagle.model import from_pretrained
    from peagle.train.dataset import ExtractedData

    # The demo's P-EAGLE drafter (peagle-kK), not its deeper one (peagle-kK-lL), which sorts first.
    drafters = sorted(glob.glob(str(run / "drafters-*" / "peagle-k*" / "final")))
    final = next(f for f in drafters if "-l" not in Path(f).parent.name)
    model = from_pretrained(final, dtype=torch.float32).eval()
    data_dir = sorted(glob.glob(str(run / "data-*")))[0]
    splits = [ExtractedData(path) for path in sorted(glob.glob(os.path.join(data_dir, f"states-{split}*")))]
    if not splits:
        raise FileNotFoundError(f"no states-{split}* directory in {data_dir}: a finished demo run was expected")
    per_split = -(-limit_rows // len(splits))
    rows = [data.row(i) for data in splits for i in range(min(len(data), per_split))][:limit_rows]
    states = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: states.append(inp[0].detach()))
    k = model.config.num_depths
    with torch.no_grad():
        for row in rows:
            length = row.input_ids.numel()
            anchors = torch.arange(length).repeat(k)
            depths = torch.arange(k).repeat_interleave(length)
            keep = (
                (anchors + depths < length)
                & (row.document_ids[anchors] >= 0)
                & row.loss_mask[(anchors + depths).clamp(max=length - 1)]
            )
            model.forward_train(row.input_ids, row.hidden.float(), anchors[keep], depths[keep], row.document_ids)
    counts = load_file(os.path.join(data_dir, "prepared-train", "token_freq.safetensors"))["counts"]
    return model, torch.cat(states), counts


def train_low_rank(model: PEagleDrafter, states: torch.Tensor, counts: torch.Tensor, rank: int, candidates: int,
                   steps: int) -> PEagleDrafter:  # fmt: skip
    config = model.config.replace(efficient_lm_head_rank=rank, efficient_lm_head_candidates=candidates)
    head = PEagleDrafter(config)
    head.load_state_dict(model.state_dict(), strict=False)
    head.init_efficient_lm_head(torch.nn.functional.pad(counts.double(), (0, config.vocab_size - counts.numel())))
    params = [head.lm_head_down.weight, head.lm_head_up.weight]
    optimizer = torch.optim.Adam(params, lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        full_logp = torch.log_softmax(head.lm_head(states), -1)
    for _ in range(steps):
        batch = torch.randint(0, states.shape[0], (4096,), generator=gen)
        logq = torch.log_softmax(head.low_rank_logits(states[batch]), -1)
        p = full_logp[batch]
        loss = (p.exp() * (p - logq)).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


def recall(head: PEagleDrafter, states: torch.Tensor) -> float:
    """Share of rows whose full-head top-1 is among the C candidates the fused op picks."""
    cfg = head.config
    with torch.no_grad():
        full = head.lm_head(states).argmax(-1)
        ids, _ = efficient_lm_head(states, head.lm_head_down.weight, head.lm_head_up.weight, head.lm_head.weight,
                                   cfg.efficient_lm_head_candidates)  # fmt: skip
    return float((ids == full[:, None]).any(-1).double().mean())


RECALL_CASES = [(8, 16), (16, 32)]


@pytest.fixture(scope="module")
def demo_states():
    run = os.environ.get("PEAGLE_DEMO_RUN")
    if not run:
        pytest.skip("set PEAGLE_DEMO_RUN to a finished demo run")
    model, train_states, counts = demo_drafter_states(Path(run), "train", 4 if SMOKE else 24)
    _, held_states, _ = demo_drafter_states(Path(run), "heldout", 2 if SMOKE else 12)
    return model, train_states, counts, held_states


@pytest.mark.parametrize(("rank", "candidates"), RECALL_CASES)
def test_cpu_low_rank_head_recall_on_the_demo_target(benchmark, demo_states, rank, candidates):
    model, train_states, counts, held_states = demo_states
    steps = 20 if SMOKE else 400
    untrained = train_low_rank(model, train_states, counts, rank, candidates, 0)
    head = train_low_rank(model, train_states, counts, rank, candidates, steps)
    result = {"svd": recall(untrained, held_states), "trained": recall(head, held_states)}
    rows = held_states[:1024]
    with torch.no_grad():
        full_s = best_time(lambda: head.lm_head(rows), 5)
        benchmark.pedantic(lambda: head.head(rows), rounds=5, warmup_rounds=1)  # the fused op (eval mode)
    vocab = model.config.draft_vocab_size
    benchmark.extra_info.update(
        impl="peagle-efficient-head",
        case=f"low-rank head recall, demo target, r = {rank}, C = {candidates}",
        baselines={"full head": full_s},
        recall=result["trained"],
        recall_svd_init=result["svd"],
        heldout_rows=held_states.shape[0],
        note=f"recall {result['trained']:.4f} (SVD init {result['svd']:.4f}, goal >= 0.98); V = {vocab}, "
        f"H = {model.config.hidden_size}; SVD weighted by token counts, then {steps} Adam steps of KL(full || "
        f"low-rank) on {train_states.shape[0]} training states; times: 1024 rows",
    )
    print(f"recall r={rank} C={candidates}: SVD init {result['svd']:.4f}, trained {result['trained']:.4f}")
    assert result["trained"] >= result["svd"] - 0.01
