"""``peagle profile``: measures a cost table (:class:`~peagle.decode.harness.cost.CostTable`) for a target and drafter
on this machine, with the engine's own components.

* verify: :meth:`TargetRunner.forward` over a chain of n nodes per request (plus the LM head and greedy verification)
  after a prefill of the context interval's length, for every batch-size bucket, context and node count;
* drafting: the autoregressive drafter forward of w nodes per request at each depth d (after d - 1 earlier forwards of
  w nodes, as a round drafts them) and the P-EAGLE pass drafting K depths, for every batch-size bucket;
* sampled rounds: the verify chain again with the target's probabilities at temperature 1 and rejection sampling
  against full-vocabulary draft rows, and the P-EAGLE pass drawing its drafts (Gumbel top-k), as the engine's sampled
  rounds do them.

Each point is the fastest of ``repeats`` timed calls after one warm-up call (other processes only ever add time, so
the minimum is the steadiest estimate on a shared machine), the points of a row taking turns call by call (a machine
whose speed drifts over seconds then touches every point of the row alike: the differences between node counts,
widths and depths are what the harness decides on), each timed call right after an untimed call of the same point:
the engine runs one shape round after round, with its caches warm, and a call timed cold after another point's ran
slower (a 1-node verify at batch 16 by 1.4x on this machine: 2.93 ms cold, 2.15 ms warm, the engine's plain rounds
2.1 ms, which made drafting look cheaper next to plain decoding than it is); CUDA timings synchronise around each
call. Costs cannot
fall as the work grows, so each row is made non-decreasing along its node / width / depth-count axis (a point above a
later one is lowered to it: a late spike of interference must not make fewer nodes look dearer).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from peagle.decode.drafting import Eagle3Drafting, NodeSteps, PEagleDrafting, Sampling
from peagle.decode.harness.cost import ENGINE_BACKEND, CostTable, machine_identity, model_identity, monotone
from peagle.decode.sampling import target_probs, uniforms
from peagle.decode.target import TargetRunner
from peagle.model import PEagleDrafter, check_context, context_limit, from_pretrained
from peagle.ops import ancestor_mask, tree_rejection_sample, tree_verify_greedy

__all__ = ["profile_costs"]


def _timer(device: torch.device, repeats: int, bar) -> Callable[[list[Callable[[], object]]], list[float]]:
    """measure(calls) -> the fastest of ``repeats`` timed runs of each call (each after an untimed run of it), the
    calls taking turns."""

    def once(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def measure(calls: list[Callable[[], object]]) -> list[float]:
        for fn in calls:  # warm-up
            fn()
        best = [float("inf")] * len(calls)
        for _ in range(repeats):
            for i, fn in enumerate(calls):
                fn()  # warm: the engine runs the same shape round after round; after the other points, caches are cold
                best[i] = min(best[i], once(fn))
        bar.update(len(calls))
        return best

    return measure


def _identity(source) -> dict[str, object]:
    if isinstance(source, (str, os.PathLike)):
        return model_identity(source)
    config = getattr(source, "config", None)
    return {"class": type(source).__name__, "config": config.to_dict() if hasattr(config, "to_dict") else repr(config)}


@torch.no_grad()
def profile_costs(
    target: str | os.PathLike | nn.Module,
    drafter: str | os.PathLike | PEagleDrafter,
    *,
    batch_sizes: Sequence[int] = (1, 4, 16),
    contexts: Sequence[int] = (64,),
    verify_nodes: Sequence[int] = (1, 2, 4, 8, 16, 32),
    draft_widths: Sequence[int] = (1, 2, 4),
    depths: int = 6,
    repeats: int = 5,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> CostTable:
    """Times the target and drafter on this machine; see the module docstring for what each entry means."""
    from tqdm.auto import tqdm

    if repeats < 1 or depths < 1:
        raise ValueError(f"repeats and depths must be >= 1, got {repeats} and {depths}")
    model = from_pretrained(drafter) if isinstance(drafter, (str, os.PathLike)) else drafter
    runner = TargetRunner(target, model.config.aux_layer_ids, device=device)
    model = model.to(runner.device).eval()
    check_context(contexts, max(verify_nodes), context_limit(runner.config), "the most --nodes", "--contexts")
    table_axes = dict(
        batch_sizes=sorted(set(batch_sizes)),
        contexts=sorted(set(contexts)),
        verify_nodes=sorted(set(verify_nodes)),
        draft_widths=sorted(set(draft_widths)),
    )
    passes = model.config.num_depths
    total = len(table_axes["batch_sizes"]) * (
        2 * len(table_axes["contexts"]) * len(table_axes["verify_nodes"])
        + depths * len(table_axes["draft_widths"])
        + 2 * passes
    )
    bar = tqdm(total=total, desc="profile", disable=not progress)
    measure = _timer(runner.device, repeats, bar)
    names = ("verify_s", "sampled_verify_s", "draft_s", "pass_s", "sampled_pass_s")
    grids: dict[str, list] = {name: [] for name in names}
    for batch in table_axes["batch_sizes"]:
        rows = [
            _verify_times(runner, batch, max(c, 2), table_axes["verify_nodes"], measure) for c in table_axes["contexts"]
        ]
        grids["verify_s"].append([monotone(greedy) for greedy, _ in rows])
        grids["sampled_verify_s"].append([monotone(sampled) for _, sampled in rows])
        draft = _draft_times(runner, model, batch, table_axes["draft_widths"], depths, measure)
        grids["draft_s"].append([monotone(row) for row in draft])
        grids["pass_s"].append(monotone(_pass_times(runner, model, batch, passes, measure, sampled=False)))
        grids["sampled_pass_s"].append(monotone(_pass_times(runner, model, batch, passes, measure, sampled=True)))
    bar.close()
    return CostTable(
        **table_axes,
        **grids,
        machine={**machine_identity(runner.device), "backend": ENGINE_BACKEND},
        target=_identity(target),
        drafter=_identity(drafter),
    )


def _verify_times(
    runner: TargetRunner, batch: int, context: int, nodes: list[int], measure
) -> tuple[list[float], list[float]]:
    """(greedy, sampled) verify seconds per node count, after one prefill of the context (the calls take turns)."""
    gen = torch.Generator().manual_seed(0)
    vocab, device = runner.vocab_size, runner.device
    runner.allocate(batch, context + max(nodes) + 1)
    runner.prefill(torch.randint(0, vocab, (batch, context), generator=gen).tolist())
    rows, host_rows = torch.arange(batch, device=device), list(range(batch))
    calls = []
    for n in nodes:
        index = torch.arange(n, device=device)
        tokens = torch.randint(0, vocab, (batch, n), generator=gen).to(device)
        parent = (index - 1).expand(batch, n)
        depth = index.expand(batch, n)
        mask = ancestor_mask(parent)
        count = torch.full((batch,), n, dtype=torch.long, device=device)

        draft_probs = torch.rand(batch, n, vocab, generator=gen).softmax(-1).to(device)
        sampled = functools.partial(_sampled_verify_step, draft_probs)
        for step in (_verify_step, sampled):
            calls.append(functools.partial(step, runner, rows, host_rows, tokens, depth, mask, parent, count))
    times = measure(calls)
    return times[0::2], times[1::2]


def _verify_step(runner: TargetRunner, rows, host_rows, tokens, depth, mask, parent, count) -> Tensor:
    final, _ = runner.forward(rows, host_rows, tokens, depth, mask, parent, count)
    return tree_verify_greedy(parent, tokens, count, runner.logits(final).float().softmax(-1))


def _sampled_verify_step(draft_probs, runner: TargetRunner, rows, host_rows, tokens, depth, mask, parent, count):
    final, _ = runner.forward(rows, host_rows, tokens, depth, mask, parent, count)
    probs = target_probs(runner.logits(final), 1.0)
    u = uniforms(host_rows, 0, tokens.shape[1], runner.device)
    return tree_rejection_sample(parent, tokens, count, probs, draft_probs, u)


def _drafting(cls, runner: TargetRunner, model: PEagleDrafter, batch: int, depth: int, num_nodes: int):
    """A drafting object whose cache holds a short committed context, with one pending element per request."""
    drafting = cls(model, runner.vocab_size, "tree", depth, 1 if cls is Eagle3Drafting else [1] * depth, num_nodes)
    context = 32
    drafting.allocate(batch, context + 512, context, runner.block_size)
    rows = torch.arange(batch, device=runner.device)
    aux = torch.zeros(batch, context, len(model.config.aux_layer_ids) * model.config.hidden_size, device=runner.device)
    tokens = torch.zeros(batch, context, dtype=torch.long, device=runner.device)
    drafting.set_pending(rows, list(range(batch)), tokens, aux, [context] * batch)
    drafting.run_pending(rows, list(range(batch)), 0, 1)
    drafting.set_pending(rows, list(range(batch)), tokens[:, :1], aux[:, :1], [1] * batch)
    return drafting, rows


def _draft_times(runner, model, batch: int, widths: list[int], depths: int, measure) -> list[list[float]]:
    """[depth][width] seconds of one autoregressive drafter forward of w nodes per request at that depth."""
    drafting, rows = _drafting(Eagle3Drafting, runner, model, batch, 1, 2)
    host_rows = list(range(batch))
    root_hidden = torch.zeros(batch, model.config.hidden_size, dtype=drafting.dtype, device=runner.device)
    calls = []  # width-major
    for w in widths:
        tokens = torch.zeros(batch, w, dtype=torch.long, device=runner.device)
        feats = torch.zeros(batch, w, model.config.hidden_size, dtype=drafting.dtype, device=runner.device)
        for d in range(1, depths + 1):
            steps = NodeSteps(drafting, rows, host_rows, root_hidden)
            for earlier in range(1, d):  # the temporary entries of the earlier depths
                hidden = torch.zeros(batch, w, (earlier - 1) * w, dtype=torch.bool, device=runner.device)
                steps.run(tokens, feats, earlier, hidden)
            sees = torch.zeros(batch, w, (d - 1) * w, dtype=torch.bool, device=runner.device)
            calls.append(functools.partial(_draft_step, steps, steps.temp, tokens, feats, d, sees))
    times = measure(calls)
    return [[times[j * depths + d] for j in range(len(widths))] for d in range(depths)]


def _draft_step(steps: NodeSteps, temp, tokens: Tensor, feats: Tensor, depth: int, sees: Tensor) -> None:
    steps.temp = temp  # the same earlier depths every call
    steps.run(tokens, feats, depth, sees)


def _pass_step(drafting: PEagleDrafting, rows: Tensor, host_rows: list[int], roots: Tensor, sampling) -> None:
    drafting.draft(rows, host_rows, roots, sampling)
    # Undo the pending element's commit: every call sees the same cache.
    drafting.cache.advance(rows, host_rows, -torch.ones_like(rows), [-1] * len(host_rows))


def _pass_times(runner, model, batch: int, passes: int, measure, sampled: bool) -> list[float]:
    """[K - 1] seconds of one P-EAGLE pass (one pending element, K - 1 mask elements) and its chain (``sampled``:
    drawn, with the draft rows rejection sampling reads)."""
    calls = []
    for k in range(1, passes + 1):
        drafting, rows = _drafting(PEagleDrafting, runner, model, batch, k, k + 1)
        host_rows = list(range(batch))
        roots = torch.zeros(batch, dtype=torch.long, device=runner.device)
        sampling = Sampling(1.0, True, list(range(batch)), 0) if sampled else Sampling(0.0, False, [0] * batch, 0)

        calls.append(functools.partial(_pass_step, drafting, rows, host_rows, roots, sampling))
    return measure(calls)
