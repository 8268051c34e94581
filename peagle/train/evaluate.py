"""Step 4, eval: offline acceptance of a drafter on held-out extracted rows.

For every anchor a whose K-chain lies in one document with trained labels, the drafter drafts K tokens and the chain
is verified greedily against the target's argmax at a + d (teacher-forced context: on self-distilled data, the
target's own greedy continuation, this is the text a server verifies). Two ways of drafting, as vLLM serves them:

- parallel (P-EAGLE, ``parallel_drafting``): all K tokens in one pass, depth d from the element (a, d);
- autoregressive (EAGLE-3, vLLM's eagle3 proposer without parallel drafting): step 0 is the drafter on the real
  (token, target state) pairs up to a; step j >= 1 adds one element at position a + j whose token is the drafted
  token t_j and whose features are the hidden state the drafter output at step j - 1 (before its final norm; after
  it with ``norm_output``), attending to the real prefix and the chain's earlier steps. Every anchor's chain runs in
  the same passes (K passes over a row).

Reported: per-depth top-1 accuracy (every valid element), the conditional acceptance rate at position d + 1
(accepted at d given all of 0..d-1 accepted) and the average acceptance length 1 + E[accepted drafts], over every
chain start (the papers' offline measure) and, as ``serving_walk``, over only the chains a greedy server would draft
on the same text: from the first draft after the target's own first token, the next chain starting after the
accepted drafts and the bonus token. On the target's own greedy text the walk drafts where the server drafts.

At a temperature above 0 (and a top-p), the drafts are sampled as the engine samples them: the draft at depth d from
the drafter's distribution q at that temperature, verified against the target's distribution p after temperature and
top-p, so it is accepted with probability sum_v min(p_v, q_v) (rejection sampling). The figures are the expectations
of the chains' accepted drafts (the product of those probabilities along a chain), with the text's next tokens as the
accepted drafts' context; autoregressive drafting feeds back its argmax drafts. No serving walk (its steps depend on
each draw), no trees.

``repeated_draft`` / ``repeated_text`` (Pos 2 .. K): how often a chain's draft equals the draft one depth before,
and how often the text repeats its token there. Parallel drafts at depths >= 1 all read the same mask token and mask
hidden state, told apart only by their positions (rotary); a drafter too shallow to use them drafts the same token at
every depth (a Pos 2-3 dip in conditional acceptance where the text does not repeat).

Every acceptance length comes with its 95% interval (``acceptance_length_interval``: the half width), the rows being
independent clusters (:func:`peagle.stats.ratio_interval`): the chains of one text move together.

With a node budget and a top-k per depth (parallel drafting only), ``tree`` reports the same per-position acceptance
and AL for the P-EAGLE parallel tree each anchor's K distributions give (``tree_build_parallel``, as the engine
drafts), verified greedily with the same teacher forcing: a node at depth d + 1 is accepted when its parent is and its
token is the target's argmax at a + d, so the accepted path is the chain of the row's target argmaxes (on
self-distilled rows, the row's next tokens). With top-k 1 at every depth the tree is the chain and the figures agree.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from peagle.model import PEagleDrafter
from peagle.model.drafter import document_blocks
from peagle.ops.tree_build import tree_build_parallel
from peagle.ops.tree_verify import draft_distribution, target_probs, tree_verify_greedy
from peagle.stats import ratio_interval
from peagle.train.dataset import ExtractedData, MemoryRows

__all__ = [
    "chain_drafts",
    "chain_steps",
    "check_compatible",
    "evaluate",
    "format_table",
    "greedy_chain_acceptance",
    "greedy_tree_acceptance",
    "tree_options",
]

# Anchors per tree_build_parallel call (bounds the [anchors, K, draft_vocab] probabilities in memory).
TREE_BATCH = 512


def chain_elements(document_ids: torch.Tensor, loss_mask: torch.Tensor, depth: int) -> tuple[torch.Tensor, ...]:
    """All T depth-0 elements plus, for every anchor with a complete valid K-chain, its depths 1..K-1."""
    length = document_ids.numel()
    positions = torch.arange(length)
    ok = torch.ones(length, dtype=torch.bool)
    for d in range(depth):
        shifted = torch.full((length,), -2, dtype=torch.long)
        shifted[: length - d] = document_ids[d:]
        trained = torch.zeros(length, dtype=torch.bool)
        trained[: length - d] = loss_mask[d:]
        ok &= (shifted == document_ids) & trained & (document_ids >= 0)
    chains = positions[ok]
    anchors = torch.cat([positions, *(chains for _ in range(1, depth))])
    depths = torch.cat([torch.zeros(length, dtype=torch.long), *(torch.full_like(chains, d) for d in range(1, depth))])
    return anchors, depths, chains


def check_compatible(config, manifest: dict[str, Any]) -> None:
    """Raises ValueError when a drafter does not fit the target that produced extracted data."""
    problems = []
    if config.hidden_size != manifest["hidden_size"]:
        problems.append(f"hidden size {config.hidden_size} != the target's {manifest['hidden_size']}")
    if config.vocab_size != manifest["vocab_size"]:
        problems.append(f"vocabulary {config.vocab_size} != the target's {manifest['vocab_size']}")
    if list(config.aux_layer_ids) != list(manifest["aux_layer_ids"]):
        problems.append(f"aux layers {config.aux_layer_ids} != the extracted {manifest['aux_layer_ids']}")
    if problems:
        raise ValueError("the drafter does not match this data's target: " + "; ".join(problems))


def chain_steps(
    model: PEagleDrafter, input_ids: torch.Tensor, hidden: torch.Tensor, document_ids: torch.Tensor,
    anchors: torch.Tensor, k: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Autoregressive drafting (vLLM's eagle3 proposer) of K tokens from every anchor of one row, one step at a time.

    ``input_ids`` [T], ``hidden`` [T, num_aux * H], ``document_ids`` [T] are a row in the index layout (hidden row i
    pairs token x_{i+1} with the target states g_i). Yields per step j = 0..K-1 the logits [rows, draft_vocab] and the
    drafted target ids [rows]: step 0 at each of the T positions, step j >= 1 at the chain elements (a, j) of
    ``anchors`` [n].

    Step j runs the T real elements plus the chain elements (a, s), s = 1..j, under the P-EAGLE mask, whose predicate
    is exactly what a KV-cached server computes: (a, s) sees the real prefix up to a and (a, 1..s). Earlier outputs do
    not change when elements are added, so each pass recomputes them instead of keeping a cache.
    """
    draft_ids = model.draft_ids()
    dtype = model.fc.weight.dtype
    window = model.config.sliding_window
    length = input_ids.numel()
    positions = torch.arange(length, device=input_ids.device)
    zeros = torch.zeros_like(positions)
    real = model.project(hidden.to(dtype))
    logits, out = model.forward_features(
        input_ids, real, positions, document_blocks(positions, zeros, document_ids, window)
    )
    first = draft_ids[logits.argmax(-1)]
    yield logits, first
    n = anchors.numel()
    tokens, fed = [first[anchors]], [out[anchors]]  # t_1 and the features of step 1
    for j in range(1, k):
        depths = torch.arange(1, j + 1, device=anchors.device).repeat_interleave(n)
        elem_anchors = torch.cat([positions, anchors.repeat(j)])
        elem_depths = torch.cat([zeros, depths])
        mask = document_blocks(elem_anchors, elem_depths, document_ids, window)
        logits, out = model.forward_features(
            torch.cat([input_ids, *tokens]), torch.cat([real, *fed]), elem_anchors + elem_depths, mask
        )
        last = slice(length + (j - 1) * n, length + j * n)  # the elements (a, j)
        tokens.append(draft_ids[logits[last].detach().argmax(-1)])
        fed.append(out[last])
        yield logits[last], tokens[-1]


@torch.no_grad()
def chain_drafts(
    model: PEagleDrafter, input_ids: torch.Tensor, hidden: torch.Tensor, document_ids: torch.Tensor,
    anchors: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The drafts of :func:`chain_steps`: the depth-0 draft (a target token id) at each of the T positions and the
    drafts [n, K] of the chains from ``anchors`` [n]."""
    steps = [drafted for _, drafted in chain_steps(model, input_ids, hidden, document_ids, anchors, k)]
    return steps[0], torch.stack([steps[0][anchors], *steps[1:]], dim=1)


@torch.no_grad()
def evaluate(
    model: PEagleDrafter,
    data_dir: str | os.PathLike | ExtractedData | MemoryRows,
    rows: list[int] | None = None,
    depth: int | None = None,
    autoregressive: bool = False,
    max_tokens: int | None = None,
    tree_budget: int | None = None,
    tree_topk: int | Sequence[int] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> dict:
    """Offline acceptance on extracted rows (a directory, or its rows already open: ``ExtractedData``, or the
    ``MemoryRows`` a streaming run holds): K = ``depth`` (default the drafter's K) tokens drafted in parallel, or
    one after another with ``autoregressive`` (how vLLM serves a drafter without parallel drafting). ``max_tokens``:
    the serving walk stops where a server generating that many tokens per request stops drafting. ``tree_budget``
    (nodes, root included) / ``tree_topk`` (children per node: one int, or one per depth): also score the P-EAGLE
    parallel tree (parallel drafting; either option enables it, defaults 16 nodes and top-2 as the engine's).
    ``temperature`` / ``top_p``: sampled drafting and verification (see the module docstring; 0 = greedy)."""
    data = data_dir if isinstance(data_dir, (ExtractedData, MemoryRows)) else ExtractedData(data_dir)
    cfg = model.config
    check_compatible(cfg, data.manifest)
    k = depth or cfg.num_depths
    if k < 1:
        raise ValueError(f"depth must be >= 1, got {k}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    sampled = temperature > 0
    tree = None
    if tree_budget is not None or tree_topk is not None:
        if sampled:
            raise ValueError("tree_budget / tree_topk score greedy trees: at temperature 0 only")
        if autoregressive:
            raise ValueError("tree_budget / tree_topk score P-EAGLE parallel trees: not with autoregressive drafting")
        tree = tree_options(tree_budget, tree_topk, k, cfg.draft_vocab_size)
    tree_reached = torch.zeros(k, dtype=torch.float64)
    lm_head = data.target_head()["lm_head.weight"]
    device = next(model.parameters()).device
    draft_ids = model.draft_ids()
    model.eval()
    correct = torch.zeros(k, dtype=torch.float64)
    count = torch.zeros(k, dtype=torch.float64)
    accepted_at = torch.zeros(k, dtype=torch.float64)  # chains with depths 0..d all accepted
    chains_total = 0
    walk_reached = torch.zeros(k, dtype=torch.float64)  # the same over the drafts of a simulated serving walk
    walk_drafts = 0
    # Chains whose draft at depth d repeats the draft at d - 1, and whose text repeats its token there (d = 1 .. K-1).
    repeated_draft = torch.zeros(max(k - 1, 0), dtype=torch.float64)
    repeated_text = torch.zeros(max(k - 1, 0), dtype=torch.float64)
    clusters: list[tuple[float, int]] = []  # per row: accepted drafts over its chains (expected when sampled), chains
    for index in rows if rows is not None else range(len(data)):
        row = data.row(index)
        anchors, depths, chains = chain_elements(row.document_ids, row.loss_mask, k)
        if chains.numel() == 0:
            continue
        ids, docs, loss_mask = row.input_ids.to(device), row.document_ids.to(device), row.loss_mask.to(device)
        hidden = row.hidden.to(device).to(model.fc.weight.dtype)
        anchors, depths, chains = anchors.to(device), depths.to(device), chains.to(device)
        label = anchors + depths
        target_logits = row.target_hidden.to(device).float()[label] @ lm_head.to(device).T
        target = target_logits.argmax(-1)
        if autoregressive:
            steps = list(chain_steps(model, ids, hidden, docs, chains, k))
            logits = torch.cat([step_logits for step_logits, _ in steps])  # element order of chain_elements
            drafted = torch.cat([step_drafts for _, step_drafts in steps])
        else:
            logits = model.forward_train(ids, hidden, anchors, depths, docs).logits
            drafted = draft_ids[logits.argmax(-1)]
            if tree is not None:
                grid = _chain_grid(logits, chains, ids.numel(), k)
                tree_accepted = _tree_acceptance(grid, draft_ids, _chain_grid(target, chains, ids.numel(), k), *tree)
                tree_reached += (tree_accepted[:, None] > torch.arange(k, device=device)).sum(0).double().cpu()
        hit = drafted == target
        valid = loss_mask[label] & (docs[anchors] >= 0)
        correct += torch.bincount(depths[valid], weights=hit[valid].double(), minlength=k).cpu()
        count += torch.bincount(depths[valid], minlength=k).double().cpu()
        length = ids.numel()
        if k > 1:
            drafts, texts = _chain_grid(drafted, chains, length, k), _chain_grid(target, chains, length, k)
            repeated_draft += (drafts[:, 1:] == drafts[:, :-1]).sum(0).double().cpu()
            repeated_text += (texts[:, 1:] == texts[:, :-1]).sum(0).double().cpu()
        if sampled:
            # Acceptance probability of a sampled draft: sum_v min(p_v, q_v); a chain reaches depth d with the product.
            p = target_probs(target_logits, temperature, 0, top_p)
            alpha = torch.minimum(p[:, draft_ids], draft_distribution(logits, temperature)).sum(-1)
            reached = _chain_grid(alpha, chains, length, k).double().cumprod(1)
        else:
            chain_accepted = greedy_chain_acceptance(
                _chain_grid(drafted, chains, length, k), _chain_grid(target, chains, length, k)
            )
            reached = (chain_accepted[:, None] > torch.arange(k, device=device)).double()
            accepted = torch.full((length,), -1, dtype=torch.long)
            accepted[chains.cpu()] = chain_accepted.cpu()
            for count_walk in _serving_walk(accepted, row.loss_mask, row.document_ids, max_tokens):
                walk_reached[:count_walk] += 1
                walk_drafts += 1
        accepted_at += reached.sum(0).cpu()
        chains_total += chains.numel()
        clusters.append((float(reached.sum()), chains.numel()))
    acc = (correct / count.clamp(min=1)).tolist()
    interval = ratio_interval([a for a, _ in clusters], [c for _, c in clusters]) if clusters else None
    result = {
        "depths": k,
        "drafting": "autoregressive" if autoregressive else "parallel",
        "temperature": float(temperature),
        "top_p": float(top_p),
        "chains": chains_total,
        "rows": len(clusters),
        "top1_accuracy": acc,
        **_acceptance(accepted_at, chains_total),
        "acceptance_length_interval": interval.half_width if interval is not None else None,
        # Pos 2 .. K: the share of chains whose (greedy) draft repeats the one before it, and whose text does. A
        # drafter that cannot tell its depths apart repeats far more often than the text.
        "repeated_draft": (repeated_draft / max(1, chains_total)).tolist(),
        "repeated_text": (repeated_text / max(1, chains_total)).tolist(),
    }
    if not sampled:
        result["serving_walk"] = {"drafts": walk_drafts, **_acceptance(walk_reached, walk_drafts)}
    if tree is not None:
        result["tree"] = {"num_nodes": tree[1], "topk": tree[0], **_acceptance(tree_reached, chains_total)}
    return result


def tree_options(budget: int | None, topk: int | Sequence[int] | None, depth: int, draft_vocab: int) -> tuple:
    """Checked (top-k per depth, node budget) of a P-EAGLE tree of ``depth`` levels; the budget is capped at the full
    tree's size."""
    topk = [2] * depth if topk is None else [topk] * depth if isinstance(topk, int) else list(topk)
    if len(topk) == 1:
        topk = topk * depth
    if len(topk) != depth or not all(isinstance(c, int) and 1 <= c <= draft_vocab for c in topk):
        raise ValueError(
            f"tree_topk must be an int or {depth} ints in [1, {draft_vocab}] (one per depth), got {topk!r}"
        )
    budget = 16 if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 2:
        raise ValueError(f"tree_budget must be an int >= 2 (the root and at least one draft), got {budget!r}")
    full = 1 + sum(math.prod(topk[: d + 1]) for d in range(depth))
    return topk, min(budget, full)


def _tree_acceptance(
    logits: torch.Tensor, draft_ids: torch.Tensor, targets: torch.Tensor, topk: list[int], budget: int
) -> torch.Tensor:
    """Accepted drafts [n] of the parallel trees built from per-anchor draft logits [n, K, draft_vocab]."""
    accepted = []
    for start in range(0, logits.shape[0], TREE_BATCH):
        probs = logits[start : start + TREE_BATCH].float().softmax(-1)
        spec = tree_build_parallel(probs, topk, budget)
        tokens = torch.where(spec.tokens >= 0, draft_ids[spec.tokens.clamp(min=0)], -1)
        accepted.append(
            greedy_tree_acceptance(spec.parent, tokens, spec.depth, spec.num_nodes, targets[start : start + TREE_BATCH])
        )
    return torch.cat(accepted)


def greedy_tree_acceptance(
    parent: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor, num_nodes: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Accepted drafts [n] of n draft trees under greedy verification by :func:`peagle.ops.tree_verify_greedy`, with
    the target's argmax after any depth-d node being ``targets[c, d]`` [n, K] (teacher forcing along the text).

    Trees as :class:`peagle.ops.TreeSpec` lays them out ([n, N]; node 0 the root, whose token is not read). Greedy
    verification only compares a node's token with the argmax at its parent, so node i is renamed to id 0 when its
    token is the target at its parent's depth and to i + 1 otherwise (siblings keep distinct ids), and every target
    row is one-hot at id 0.
    """
    n, nodes = tokens.shape
    parent_depth = (depth - 1).clamp(0, targets.shape[1] - 1)
    index = torch.arange(1, nodes + 1, device=tokens.device).expand(n, nodes)
    renamed = torch.where(tokens == targets.gather(1, parent_depth), 0, index)
    rows = torch.zeros(n, nodes, nodes + 1, device=tokens.device)
    rows[..., 0] = 1.0
    return tree_verify_greedy(parent, renamed, num_nodes, rows).num_accepted


def _chain_grid(values: torch.Tensor, chains: torch.Tensor, length: int, k: int) -> torch.Tensor:
    """Per-chain values [chains, K] of elements in chain_elements' order: depth 0 from the T leading rows, deeper from
    the chain blocks."""
    n = chains.numel()
    return torch.stack([values[chains], *(values[length + (j - 1) * n :][:n] for j in range(1, k))], dim=1)


def greedy_chain_acceptance(drafts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Accepted drafts [n] of n chains under greedy verification, by :func:`peagle.ops.tree_verify_greedy` (the rule
    a server applies): chain c drafts ``drafts[c]`` [K], and the target's argmax after its first d drafts is
    ``targets[c, d]``.

    A chain is a tree with parent[i] = i - 1 (node 0: the last committed token). Greedy verification only compares a
    draft with the target's argmax there, so each chain's tokens are renamed into K + 1 ids (a target token: the first
    depth where the chain's target has it; any other token: K) and the target rows are one-hot over these ids, not
    over the whole vocabulary.
    """
    n, k = drafts.shape
    target_ids = (targets[:, :, None] == targets[:, None, :]).int().argmax(-1)  # first depth with the same token
    hit = drafts[:, :, None] == targets[:, None, :]
    draft_ids = torch.where(hit.any(-1), hit.int().argmax(-1), k)
    parent = torch.arange(-1, k, device=drafts.device).expand(n, k + 1)
    tokens = torch.cat([torch.zeros_like(draft_ids[:, :1]), draft_ids], 1)  # the root's token is not read
    # Row d: the target after node d; the leaf's row only picks the bonus token, which is not counted here.
    rows = torch.nn.functional.one_hot(torch.cat([target_ids, target_ids[:, -1:]], 1), k + 1).float()
    num_nodes = torch.full((n,), k + 1, dtype=torch.long, device=drafts.device)
    return tree_verify_greedy(parent, tokens, num_nodes, rows).num_accepted


def _acceptance(reached: torch.Tensor, drafts: int) -> dict[str, Any]:
    """Conditional acceptance per position and AL from the number of chains that reached each position."""
    conditional, previous = [], float(drafts)
    for value in reached.tolist():
        conditional.append(value / previous if previous else 0.0)
        previous = value
    return {"conditional_acceptance": conditional, "acceptance_length": 1.0 + float(reached.sum()) / max(1, drafts)}


def _serving_walk(
    accepted: torch.Tensor, loss_mask: torch.Tensor, document_ids: torch.Tensor, max_tokens: int | None = None
) -> list[int]:
    """Accepted drafts of each verification a server runs over the row's text (greedy, one request per run of
    trained labels): the target generates a run's first token itself, so drafting starts at the anchor after the
    run's first one, and after accepting n drafts the next draft starts n + 1 anchors later (the bonus token).
    ``accepted`` [T]: the accepted drafts of the chain from each anchor, -1 where no full chain starts. The walk
    stops at the first anchor without a full chain (the end of the run's text) or, with ``max_tokens``, once the
    request has generated that many tokens (a server drafts full chains until then: give the text K - 1 more)."""
    trained = (loss_mask.bool() & (document_ids >= 0)).tolist()
    docs, accepted = document_ids.tolist(), accepted.tolist()
    counts = []
    for start in range(len(trained)):
        if not trained[start] or (start > 0 and trained[start - 1] and docs[start - 1] == docs[start]):
            continue  # not the first anchor of a run
        a = start + 1  # tokens generated before drafting from anchor a: a - start
        limit = len(trained) if max_tokens is None else min(len(trained), start + max_tokens)
        while a < limit and accepted[a] >= 0:
            counts.append(accepted[a])
            a += accepted[a] + 1
    return counts


def format_table(result: dict[str, Any]) -> str:
    k = result["depths"]
    head = " | ".join(f"Pos {d + 1:>2}" for d in range(k))
    interval = result.get("acceptance_length_interval")
    temperature = result.get("temperature", 0.0)
    sampling = f"temperature {temperature:g}" + (f", top-p {result['top_p']:g}" if result.get("top_p", 1.0) < 1 else "")
    lines = [
        f"{'':<22}| {head} |   AL",
        f"{'conditional acceptance':<22}| "
        + " | ".join(f"{v:6.3f}" for v in result["conditional_acceptance"])
        + f" | {result['acceptance_length']:.3f}"
        + (f" +- {interval:.3f} (95%)" if interval is not None else ""),
        f"{'top-1 accuracy':<22}| " + " | ".join(f"{v:6.3f}" for v in result["top1_accuracy"]) + " |",
        f"({result['chains']} chains of {k} drafts, {result.get('drafting', 'parallel')} drafting, "
        + ("greedy" if not temperature else f"sampled at {sampling}: expected acceptance")
        + (f"; interval over {result['rows']} rows" if "rows" in result else "")
        + ")",
    ]
    tree = result.get("tree")
    if tree is not None:
        lines[2:2] = [
            f"{'tree acceptance':<22}| "
            + " | ".join(f"{v:6.3f}" for v in tree["conditional_acceptance"])
            + f" | {tree['acceptance_length']:.3f}",
        ]
        lines.append(f"(tree: {tree['num_nodes']} nodes, top-k {','.join(map(str, tree['topk']))} per depth)")
    return "\n".join(lines)
