"""Step 4, eval: offline acceptance of a drafter on held-out extracted rows.

For every anchor a whose K-chain lies in one document with trained labels, the drafter drafts K tokens in one pass
(depth d from the element (a, d), exactly what the server runs) and the chain is verified greedily against the
target's argmax at a + d (teacher-forced context, the offline proxy used by the P-EAGLE papers). Reported: per-depth
top-1 accuracy (every valid element), the conditional acceptance rate at position d + 1 (accepted at d given all of
0..d-1 accepted) and the average acceptance length 1 + E[accepted drafts].
"""

from __future__ import annotations

from typing import Any

import torch

from peagle.model import PEagleDrafter
from peagle.train.dataset import ExtractedData
from peagle.train.extract import load_target_head

__all__ = ["check_compatible", "evaluate", "format_table"]


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


@torch.no_grad()
def evaluate(model: PEagleDrafter, data_dir: str, rows: list[int] | None = None, depth: int | None = None) -> dict:
    data = ExtractedData(data_dir)
    cfg = model.config
    check_compatible(cfg, data.manifest)
    k = depth or cfg.num_depths
    lm_head = load_target_head(data_dir)["lm_head.weight"]
    device = next(model.parameters()).device
    draft_ids = model.draft_ids()
    model.eval()
    correct = torch.zeros(k, dtype=torch.float64)
    count = torch.zeros(k, dtype=torch.float64)
    accepted_at = torch.zeros(k, dtype=torch.float64)  # chains with depths 0..d all accepted
    chains_total = 0
    for index in rows if rows is not None else range(len(data)):
        row = data.row(index)
        anchors, depths, chains = chain_elements(row.document_ids, row.loss_mask, k)
        if chains.numel() == 0:
            continue
        out = model.forward_train(
            row.input_ids.to(device),
            row.hidden.to(device).to(model.fc.weight.dtype),
            anchors.to(device),
            depths.to(device),
            row.document_ids.to(device),
        )
        label = (anchors + depths).to(device)
        target = (row.target_hidden.to(device).float()[label] @ lm_head.to(device).T).argmax(-1)
        hit = draft_ids[out.logits.argmax(-1)] == target
        valid = row.loss_mask.to(device)[label] & (row.document_ids.to(device)[anchors.to(device)] >= 0)
        d = depths.to(device)
        correct += torch.bincount(d[valid], weights=hit[valid].double(), minlength=k).cpu()
        count += torch.bincount(d[valid], minlength=k).double().cpu()
        # hits of every chain, [chains, K]: depth 0 from the T leading rows, deeper from the chain blocks.
        n = chains.numel()
        grid = torch.stack(
            [hit[chains.to(device)], *(hit[row.input_ids.numel() + (j - 1) * n :][:n] for j in range(1, k))], dim=1
        )
        accepted_at += grid.long().cumprod(1).sum(0).double().cpu()
        chains_total += n
    acc = (correct / count.clamp(min=1)).tolist()
    conditional = []
    previous = float(chains_total)
    for d in range(k):
        conditional.append(float(accepted_at[d]) / previous if previous else 0.0)
        previous = float(accepted_at[d])
    return {
        "depths": k,
        "chains": chains_total,
        "top1_accuracy": acc,
        "conditional_acceptance": conditional,
        "acceptance_length": 1.0 + float(accepted_at.sum()) / max(1, chains_total),
    }


def format_table(result: dict[str, Any]) -> str:
    k = result["depths"]
    head = " | ".join(f"Pos {d + 1:>2}" for d in range(k))
    lines = [
        f"{'':<22}| {head} |   AL",
        f"{'conditional acceptance':<22}| "
        + " | ".join(f"{v:6.3f}" for v in result["conditional_acceptance"])
        + f" | {result['acceptance_length']:.3f}",
        f"{'top-1 accuracy':<22}| " + " | ".join(f"{v:6.3f}" for v in result["top1_accuracy"]) + " |",
        f"({result['chains']} chains of {k} drafts)",
    ]
    return "\n".join(lines)
