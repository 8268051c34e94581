"""Step 3, train: COD sampling + fused gather + P-EAGLE masks + sequence partitioning, distillation to the target.

One optimizer step takes ``batch_size`` rows (global). Row slot j of the run (step k holds slots kB .. kB + B - 1) is a
fixed row of a seeded per-epoch permutation, and its COD elements come from a seed derived from j: the data and the
elements of a step do not depend on the number of processes or on where a run was resumed. Under torchrun each process
takes the slots of its rank (B must divide by the world size), and the gradients are summed across processes after
the local rows (and their segments) are accumulated, each row's loss already divided by B: the result is the
single-process gradient of the same global batch.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from peagle.io import (
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_json,
    check_output_directory,
    clear_directory,
    is_empty_directory,
    publish_directory,
    remove_temporaries,
    staging_directory,
)
from peagle.model import DrafterConfig, DraftOutput, PEagleDrafter, load_state_dict, save_pretrained
from peagle.ops import cod_sample
from peagle.train.data import load_tokenizer, resolve_mask_token
from peagle.train.dataset import ExtractedData, TrainRow
from peagle.train.extract import load_target_head
from peagle.train.partition import partition_elements

__all__ = ["TrainArgs", "Trainer", "element_loss", "new_stats", "option", "train", "train_row"]


def option(default: Any = MISSING, help: str = "", *, flag: str | None = None, hidden: bool = False) -> Any:
    """A :class:`TrainArgs` field whose metadata describes its ``peagle train`` option: the help text, the flag when it
    is not ``--field-name`` (a bool field that defaults to True is switched off by its flag), and whether the option
    is left out of ``--help``. The CLI builds the option from the field: name, type, choices, default and help."""
    return field(default=default, metadata={"help": help, "flag": flag, "hidden": hidden})


@dataclass
class TrainArgs:
    """Settings of one training run: the fields of ``peagle train`` (each field's metadata holds its option)."""

    data: str = option(help="an extract output directory")
    out: str = option(
        help="output directory: checkpoints, metrics.jsonl, final/; new or empty unless --resume or --overwrite"
    )
    num_layers: int = option(4, "drafter decoder layers", flag="--layers")
    num_depths: int = option(8, "parallel depths K, 1 = EAGLE-3", flag="--depths")
    num_heads: int | None = option(None, "attention heads (default: the target's)", flag="--heads")
    num_kv_heads: int | None = option(None, "key/value heads (default: the target's)", flag="--kv-heads")
    head_dim: int | None = option(None, "head dim (default: the target's)")
    intermediate_size: int | None = option(None, "MLP width (default: the target's)")
    layer_style: Literal["llama", "qwen3"] | None = option(None, "default: from the target")
    fc_norm: bool = option(False, "EAGLE-3.1: RMSNorm each aux hidden state before fc")
    norm_before_fc: bool = option(False, "one RMSNorm over the concatenated aux states")
    norm_output: bool = option(False, "EAGLE-3.1 norm_output flag (recorded for serving)")
    eh_proj: bool = option(False, "pre-attention norms and a 2H -> H projection instead of the 2H-wide first layer")
    nope: bool = option(False, "no rotary position encoding in the drafter layers (NoPE)")
    sliding_window: int | None = option(None, "attend to the last W positions only (default: all)")
    moe_num_experts: int = option(0, "mixture-of-experts MLP with E experts, 0 = dense MLP", flag="--moe-experts")
    moe_top_k: int = option(2, "experts per element (with --moe-experts)")
    moe_balance_weight: float = option(0.01, "weight of the MoE load-balancing loss")
    efficient_lm_head_rank: int = option(
        0, "efficient LM head: rank r of its low-rank head, 0 = off", flag="--lm-head-rank"
    )
    efficient_lm_head_candidates: int = option(
        128, "efficient LM head: candidates C the full head rescores", flag="--lm-head-candidates"
    )
    lm_head_kl_weight: float = option(1.0, "weight of KL(full head || low-rank head) (with --lm-head-rank)")
    draft_vocab_size: int | None = option(
        None, "draft vocabulary (most frequent trained tokens; d2t/t2d); default: the full target vocabulary"
    )
    mask_token_id: int | None = option(
        None, "mask token id (default: the tokenizer's mask token, else a new token in an unused embedding slot)"
    )
    reuse_special_token_as_mask: bool = option(
        False,
        "if no mask token and no free embedding slot exist, reuse pad/eos/unk as the mask token. RISK: training then "
        "changes that real token's embedding row, so the drafter's view of that token (e.g. end of sequence) drifts",
    )
    ratio: float = option(0.7, "COD keep ratio per depth")
    ratio_min: float = option(0.2, "floor of the COD keep ratio")
    max_anchors: int | None = option(None, "cap on COD seed chains per row")
    segments: int = option(1, "sequence partitioning: segments S per row")
    memory_budget_mb: float | None = option(None, "choose S per row from this budget")
    loss: Literal["kl", "ce"] = option("kl", "KL to the target distribution or CE to its argmax")
    depth_weights: list[float] | None = option(  # noqa: RUF009 (option() returns a field, not a shared list)
        None, "per-depth loss weights, e.g. 1,0.9,0.8 (default all 1)"
    )
    steps: int = option(1000, "optimizer steps")
    batch_size: int = option(1, "rows per step, all processes together")
    lr: float = option(3e-4, "peak learning rate")
    min_lr_ratio: float = option(0.1, "cosine floor as a fraction of --lr")
    warmup_steps: int = option(10, "linear warmup steps")
    weight_decay: float = option(0.0, "AdamW weight decay")
    grad_clip: float = option(1.0, "gradient norm clip, 0 = off")
    seed: int = option(0, "seed of init, data order and COD sampling")
    attention: Literal["sdpa", "sdpa-full", "flex"] | None = option(
        None,
        "sdpa: dense mask per document; sdpa-full: one N x N mask; flex: BlockMask (default: flex on GPU, sdpa on CPU)",
    )
    save_every: int = option(0, "checkpoint every N steps, 0 = only at the end")
    log_every: int = option(1, "metrics.jsonl record every N steps")
    resume: bool = option(False, "continue from the latest complete checkpoint in --out")
    overwrite: bool = option(False, "clear a non-empty --out first (without it or --resume, a used --out is refused)")
    tensorboard: bool = option(False, "also log to TensorBoard (needs tensorboard)")
    # Tests: write the summed gradients of this step to OUT/grads-STEP.pt (partitioned == whole-row gradients).
    save_grads_step: int | None = option(None, "write the gradients of this step", hidden=True)
    progress: bool = option(True, "no progress bar", flag="--quiet")

    def check(self) -> None:
        """ValueError naming the option of the first setting out of range; runs before any work."""
        optional = lambda value, ok: value is None or ok(value)  # noqa: E731
        rules = [
            ("num_layers", self.num_layers >= 1, "at least 1"),
            ("num_depths", self.num_depths >= 1, "at least 1"),
            ("num_heads", optional(self.num_heads, lambda v: v >= 1), "at least 1"),
            ("num_kv_heads", optional(self.num_kv_heads, lambda v: v >= 1), "at least 1"),
            ("head_dim", optional(self.head_dim, lambda v: v >= 1), "at least 1"),
            ("intermediate_size", optional(self.intermediate_size, lambda v: v >= 1), "at least 1"),
            ("draft_vocab_size", optional(self.draft_vocab_size, lambda v: v >= 1), "at least 1"),
            ("mask_token_id", optional(self.mask_token_id, lambda v: v >= 0), "at least 0"),
            ("sliding_window", optional(self.sliding_window, lambda v: v >= 1), "at least 1"),
            ("moe_num_experts", self.moe_num_experts >= 0, "at least 0"),
            (
                "moe_top_k",
                self.moe_top_k >= 1 and (not self.moe_num_experts or self.moe_top_k <= self.moe_num_experts),
                "in [1, --moe-experts]",
            ),
            ("moe_balance_weight", 0 <= self.moe_balance_weight < math.inf, "at least 0"),
            ("efficient_lm_head_rank", self.efficient_lm_head_rank >= 0, "at least 0"),
            ("efficient_lm_head_candidates", self.efficient_lm_head_candidates >= 1, "at least 1"),
            ("lm_head_kl_weight", 0 <= self.lm_head_kl_weight < math.inf, "at least 0"),
            ("ratio", 0 < self.ratio <= 1, "in (0, 1]"),
            ("ratio_min", 0 <= self.ratio_min <= 1, "in [0, 1]"),
            ("max_anchors", optional(self.max_anchors, lambda v: v >= 1), "at least 1"),
            ("segments", 1 <= self.segments <= 1024, "in [1, 1024]"),
            ("memory_budget_mb", optional(self.memory_budget_mb, lambda v: 0 < v < math.inf), "positive"),
            ("steps", self.steps >= 0, "at least 0"),
            ("batch_size", self.batch_size >= 1, "at least 1"),
            ("lr", 0 < self.lr < math.inf, "positive"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("warmup_steps", self.warmup_steps >= 0, "at least 0"),
            ("weight_decay", 0 <= self.weight_decay < math.inf, "at least 0"),
            ("grad_clip", 0 <= self.grad_clip < math.inf, "at least 0 (0 = off)"),
            ("seed", 0 <= self.seed < 2**63, "in [0, 2^63)"),
            ("save_every", self.save_every >= 0, "at least 0"),
            ("log_every", self.log_every >= 0, "at least 0"),
        ]
        for name, ok, expected in rules:
            if not ok:
                raise ValueError(f"{_flag(name)} must be {expected}, got {getattr(self, name)!r}")
        weights = self.depth_weights
        if weights is not None and (len(weights) != self.num_depths or not all(0 <= w < math.inf for w in weights)):
            raise ValueError(
                f"--depth-weights must be {self.num_depths} (--depths) finite weights >= 0, got {list(weights)}"
            )
        if self.resume and self.overwrite:
            raise ValueError("--overwrite clears --out, --resume continues it: give one of them")
        check_output_directory(self.out, {"--data": self.data})


def _flag(name: str) -> str:
    """The ``peagle train`` option of a TrainArgs field."""
    meta = next(f.metadata for f in fields(TrainArgs) if f.name == name)
    return meta.get("flag") or "--" + name.replace("_", "-")


def element_loss(logits: Tensor, target_logits: Tensor, kind: str) -> Tensor:
    """Per-element loss [n]: KL(target || draft) or cross-entropy to the target's argmax (both over the draft vocab)."""
    work = torch.promote_types(logits.dtype, torch.float32)
    logq = F.log_softmax(logits.to(work), dim=-1)
    if kind == "kl":
        logp = F.log_softmax(target_logits.to(work), dim=-1)
        return (logp.exp() * (logp - logq)).sum(-1)
    if kind == "ce":
        return -logq.gather(-1, target_logits.argmax(-1, keepdim=True)).squeeze(-1)
    raise ValueError(f"loss must be 'kl' or 'ce', got {kind!r}")


class _WeightedKL(torch.autograd.Function):
    """sum_e w_e KL(p_{u(e)} || softmax(logits_e)) with the targets p stored once per distinct label row u.

    Elements of overlapping chains share label rows, so the target side is computed for the distinct rows only;
    the backward is the closed form w_e (softmax(logits_e) - p_{u(e)}).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, logp: Tensor, inverse: Tensor, weight: Tensor) -> Tensor:
        # KL_e = sum_v p (log p - z_v + lse_e) = -H_u - p_u . z_e + lse_e  (sum_v p = 1).
        # lse from the fused log-softmax (lse = z_0 - log q_0); the [n, V] log-softmax itself is not kept.
        lse = logits[:, 0] - F.log_softmax(logits, dim=-1)[:, 0]
        p = logp.exp()
        neg_entropy = (p * logp).sum(-1)
        p_e = p[inverse]
        dot = torch.einsum("nv,nv->n", p_e, logits)
        ctx.save_for_backward(logits, p_e, weight)
        return (weight * (neg_entropy[inverse] - dot + lse)).sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, p_e, weight = ctx.saved_tensors
        g = torch.softmax(logits, dim=-1)
        g.sub_(p_e)
        g.mul_((grad * weight)[:, None])
        return g, None, None, None


def weighted_kl(logits: Tensor, target_logp: Tensor, inverse: Tensor, weight: Tensor) -> Tensor:
    """Weighted KL sum over elements; ``target_logp`` [U, V] log-probabilities, ``inverse`` [n] element -> row."""
    return _WeightedKL.apply(logits, target_logp, inverse, weight)


def _lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def choose_segments(num_elements: int, config: DrafterConfig, budget_mb: float) -> int:
    """Smallest S whose per-segment estimate (dense mask + activations kept for backward + logits) fits the budget."""
    per_element = 4 * (config.num_layers * (14 * config.hidden_size + 2 * config.intermediate_size))
    per_element += 4 * 3 * config.draft_vocab_size
    for s in range(1, 1025):
        n = 1.25 * num_elements / s  # segments also hold context rows
        if (n * n + n * per_element) / 2**20 <= budget_mb:
            return s
    return 1024


def new_stats(num_depths: int) -> dict[str, Any]:
    return {
        "loss": 0.0,
        "elements": 0,
        "correct": torch.zeros(num_depths, dtype=torch.float64),
        "count": torch.zeros(num_depths, dtype=torch.float64),
        # Options: sums of the MoE balance loss and imbalance over forwards, the low-rank head's KL and recall hits.
        "options": torch.zeros(len(OPTION_STATS), dtype=torch.float64),
    }


OPTION_STATS = ("moe_forwards", "moe_balance_loss", "moe_imbalance", "lm_head_kl", "lm_head_hits", "lm_head_rows")


def _option_losses(
    model: PEagleDrafter, out: DraftOutput, weight: Tensor, denominator: float, stats: dict[str, Any], **weights: float
) -> Tensor:
    """The options' extra training loss of one forward (scaled like the row's loss), their statistics into
    ``stats["options"]``: the MoE load-balancing loss (``moe_balance_weight``) and KL(full head || low-rank head)
    over the loss-carrying elements (``lm_head_kl_weight``), with the low-rank head's recall (the full head's top-1
    among its C candidates)."""
    extra = out.logits.new_zeros(())
    acc = stats["options"]
    balance = model.moe_balance()
    if balance is not None:
        extra = extra + weights["moe_balance_weight"] * balance[0] * float(weight.sum()) / denominator
        acc[:3] += torch.tensor([1.0, balance[0].item(), balance[1].item()], dtype=torch.float64)
    if out.low_rank_logits is not None:
        full = out.logits.detach()
        kl = (element_loss(out.low_rank_logits, full, "kl") * weight).sum() / denominator
        extra = extra + weights["lm_head_kl_weight"] * kl
        with torch.no_grad():
            candidates = out.low_rank_logits.topk(model.config.efficient_lm_head_candidates, dim=-1).indices
            hits = (candidates == full.argmax(-1, keepdim=True)).any(-1)
        acc[3:] += torch.tensor([kl.item(), hits.sum().item(), hits.numel()], dtype=torch.float64)
    return extra


def option_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """Per-step metrics of the options that ran: mean MoE balance loss and imbalance (max / mean expert load), the
    low-rank head's KL and recall."""
    acc = dict(zip(OPTION_STATS, stats["options"].tolist(), strict=True))
    metrics = {}
    if acc["moe_forwards"]:
        metrics["moe_balance_loss"] = acc["moe_balance_loss"] / acc["moe_forwards"]
        metrics["moe_imbalance"] = acc["moe_imbalance"] / acc["moe_forwards"]
    if acc["lm_head_rows"]:
        metrics["lm_head_kl"] = acc["lm_head_kl"]
        metrics["lm_head_recall"] = acc["lm_head_hits"] / acc["lm_head_rows"]
    return metrics


def train_row(
    model: PEagleDrafter,
    row: TrainRow,
    anchors: Tensor,
    depths: Tensor,
    target_lm_head: Tensor,
    draft_ids: Tensor,
    depth_weights: Tensor,
    *,
    loss_kind: str = "kl",
    segments: int = 1,
    attention: str = "sdpa",
    scale: float = 1.0,
    stats: dict[str, Any] | None = None,
    moe_balance_weight: float = 0.0,
    lm_head_kl_weight: float = 1.0,
) -> dict[str, Any]:
    """Forward + backward of one row's COD elements (S segments one after another), the row's loss being the
    weighted mean over its valid elements, times ``scale``. Returns (and accumulates into) ``stats``."""
    num_depths = depth_weights.numel()
    stats = stats if stats is not None else new_stats(num_depths)
    dev = anchors.device
    label = anchors + depths
    docs = row.document_ids
    valid = row.loss_mask[label] & (docs[anchors] >= 0) & (docs[label] == docs[anchors])
    weight = valid.float() * depth_weights[depths]
    denominator = float(weight.sum())
    stats["elements"] += anchors.numel()
    if denominator == 0:
        return stats
    # Drop elements that influence no loss: padding, and depth-0 elements after the last loss-carrying anchor of
    # their document (every query sees only keys at or before its own anchor). Exact: no kept element's keys change.
    elem_docs = docs[anchors]
    last = torch.full((int(docs.max()) + 2,), -1, dtype=torch.long, device=dev)
    carrying = (weight > 0) | (depths > 0)
    last.scatter_reduce_(0, (elem_docs + 1)[carrying], anchors[carrying], reduce="amax")
    needed = (elem_docs >= 0) & (carrying | (anchors <= last[elem_docs + 1]))
    if not bool(needed.all()):
        anchors, depths, weight, valid = anchors[needed], depths[needed], weight[needed], valid[needed]
    if segments > 1:
        parts = partition_elements(anchors, depths, docs, segments, num_layers=model.config.num_layers)
    else:
        parts = [(torch.arange(anchors.numel(), device=dev), anchors, depths, torch.ones_like(valid))]
    autocast = torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda")
    for index, seg_anchors, seg_depths, owned in parts:
        w = weight[index] * owned
        keep = torch.nonzero(w > 0).squeeze(1)
        if keep.numel() == 0:
            continue
        with autocast:
            # LM head only on the elements that carry loss (padding / untrained rows need no logits).
            out = model.forward_train(
                row.input_ids, row.hidden, seg_anchors, seg_depths, docs, attention=attention, logit_rows=keep
            )
        logits = out.logits.to(torch.promote_types(out.logits.dtype, torch.float32))
        with torch.no_grad():
            # Target logits once per distinct label row (overlapping chains share them).
            rows, inverse = torch.unique(out.label_index, return_inverse=True)
            target = row.target_hidden[rows].to(target_lm_head.dtype) @ target_lm_head.T
            target_best = target.argmax(-1)[inverse]
            if draft_ids.numel() != target.shape[1]:
                target = target[:, draft_ids]
        if loss_kind == "kl":
            loss = weighted_kl(logits, F.log_softmax(target, dim=-1), inverse, w[keep]) / denominator
        else:
            loss = (element_loss(logits, target[inverse], loss_kind) * w[keep]).sum() / denominator
        weights = dict(moe_balance_weight=moe_balance_weight, lm_head_kl_weight=lm_head_kl_weight)
        extra = _option_losses(model, out._replace(logits=logits), w[keep], denominator, stats, **weights)
        ((loss + extra) * scale).backward()
        with torch.no_grad():
            stats["loss"] += float(loss) * scale
            correct = (draft_ids[logits.argmax(-1)] == target_best).float()
            d = seg_depths[keep]
            stats["correct"] += torch.bincount(d, weights=correct, minlength=num_depths).cpu().double()
            stats["count"] += torch.bincount(d, minlength=num_depths).cpu().double()
    return stats


class Trainer:
    def __init__(self, args: TrainArgs) -> None:
        # Before any work, and before the process group forms: no rank has written to --out yet.
        args.check()
        if not (args.resume or args.overwrite or is_empty_directory(args.out)):
            raise ValueError(
                f"output (--out) {args.out} is not empty (an earlier run?); pass --resume to continue it or "
                "--overwrite to start over"
            )
        self.args = args
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = torch.device(
            f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
        )
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)  # denormal activations make CPU kernels many times slower
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        if args.batch_size % self.world:
            raise ValueError(f"batch_size ({args.batch_size}) must be a multiple of the process count ({self.world})")
        self.attention = args.attention or ("flex" if self.device.type == "cuda" else "sdpa")
        self.data = ExtractedData(args.data)
        self.out = Path(args.out)
        manifest = self.data.manifest
        head = load_target_head(args.data)
        self.target_lm_head = head["lm_head.weight"].to(self.device)
        self.tokenizer = None
        tok_dir = Path(manifest["data"]) / "tokenizer"
        if tok_dir.exists():
            self.tokenizer = load_tokenizer(tok_dir)
        mask_id, how = resolve_mask_token(
            self.tokenizer, manifest["vocab_size"], args.mask_token_id, args.reuse_special_token_as_mask
        )
        self.mask_how = how
        self.config = DrafterConfig.from_manifest(
            manifest,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            intermediate_size=args.intermediate_size,
            layer_style=args.layer_style,
            draft_vocab_size=args.draft_vocab_size,
            mask_token_id=mask_id,
            num_depths=args.num_depths,
            fc_norm=args.fc_norm,
            norm_before_fc=args.norm_before_fc,
            norm_output=args.norm_output,
            eh_proj=args.eh_proj,
            nope=args.nope,
            sliding_window=args.sliding_window,
            moe_num_experts=args.moe_num_experts,
            moe_top_k=args.moe_top_k,
            efficient_lm_head_rank=args.efficient_lm_head_rank,
            efficient_lm_head_candidates=args.efficient_lm_head_candidates,
        )
        weights = list(args.depth_weights or [1.0] * args.num_depths)
        self.depth_weights = torch.tensor(weights, dtype=torch.float32, device=self.device)
        torch.manual_seed(args.seed)
        self.model = PEagleDrafter(self.config).to(self.device)
        self._init_from_target(head)
        self.draft_ids = self.model.draft_ids()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: _lr_lambda(s, args.warmup_steps, args.steps, args.min_lr_ratio)
        )
        self.step = 0
        self.writer = None

    @torch.no_grad()
    def _init_from_target(self, head: dict[str, Tensor]) -> None:
        cfg = self.config
        if cfg.uses_draft_vocab:
            counts = self._token_counts("a draft vocabulary")
            # Most frequent trained tokens; ties go to lower ids (stable order).
            order = torch.sort(-counts, stable=True).indices[: cfg.draft_vocab_size]
            self.model.set_draft_vocab(order.sort().values)
        self.model.embed_tokens.weight.copy_(head["embed_tokens.weight"][: cfg.vocab_size])
        self.model.lm_head.weight.copy_(head["lm_head.weight"][self.model.draft_ids().cpu()])
        if cfg.efficient_lm_head:
            self.model.init_efficient_lm_head(self._token_counts("the efficient LM head's initialisation"))

    def _token_counts(self, purpose: str) -> Tensor:
        """Counts [vocab_size] of the trained tokens of the prepared data (token_freq.safetensors)."""
        freq_path = Path(self.data.manifest["data"]) / "token_freq.safetensors"
        if not freq_path.exists():
            raise FileNotFoundError(f"{purpose} needs token frequencies: {freq_path} is missing")
        from safetensors.torch import load_file

        counts = load_file(freq_path)["counts"].double()
        return torch.nn.functional.pad(counts, (0, self.config.vocab_size - counts.numel())).to(self.device)

    # -----------------------------------------------------------------------------------------------------------------

    def row_slot(self, slot: int) -> int:
        rows = len(self.data)
        epoch, offset = divmod(slot, rows)
        seed = (self.args.seed * 7919 + epoch) % 2**63  # the same seeds as ever below 2^63 / 7919
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        return int(perm[offset])

    def row_elements(self, row: TrainRow, slot: int) -> tuple[Tensor, Tensor]:
        a = self.args
        seed = (a.seed * 1_000_003 + slot) % (2**31 - 1)
        return cod_sample(row.loss_mask, row.document_ids, a.num_depths, a.ratio, a.ratio_min, a.max_anchors, seed)

    def row_loss_backward(self, row: TrainRow, slot: int, scale: float, stats: dict[str, Any]) -> None:
        """Forward + backward of one row (segment by segment), loss scaled by ``scale``; fills ``stats``."""
        row = TrainRow(*(t.to(self.device) for t in row))
        anchors, depths = self.row_elements(row, slot)
        segments = self.args.segments
        if self.args.memory_budget_mb:
            segments = choose_segments(anchors.numel(), self.config, self.args.memory_budget_mb)
        train_row(
            self.model,
            row,
            anchors,
            depths,
            self.target_lm_head,
            self.draft_ids,
            self.depth_weights,
            loss_kind=self.args.loss,
            segments=segments,
            attention=self.attention,
            scale=scale,
            stats=stats,
            moe_balance_weight=self.args.moe_balance_weight,
            lm_head_kl_weight=self.args.lm_head_kl_weight,
        )

    def train_step(self) -> dict[str, Any]:
        args = self.args
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        stats = new_stats(args.num_depths)
        slots = range(self.step * args.batch_size, (self.step + 1) * args.batch_size)
        for slot in list(slots)[self.rank :: self.world]:
            self.row_loss_backward(self.data.row(self.row_slot(slot)), slot, 1.0 / args.batch_size, stats)
        params = list(self.model.parameters())
        for p in params:
            if p.grad is None:  # a rank whose rows carried no loss must still join the same all-reduce
                p.grad = torch.zeros_like(p)
        if self.world > 1:
            flat = torch.cat([p.grad.flatten() for p in params])
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            packed = torch.cat(
                [
                    torch.tensor([stats["loss"], stats["elements"]], dtype=torch.float64),
                    stats["correct"],
                    stats["count"],
                    stats["options"],
                ]
            )
            dist.all_reduce(packed)
            stats["loss"], stats["elements"] = float(packed[0]), int(packed[1])
            k = args.num_depths
            stats["correct"], stats["count"] = packed[2 : 2 + k], packed[2 + k : 2 + 2 * k]
            stats["options"] = packed[2 + 2 * k :]
        if args.save_grads_step is not None and self.step == args.save_grads_step and self.rank == 0:
            atomic_torch_save(
                self.out / f"grads-{self.step}.pt", {n: p.grad.clone() for n, p in self.model.named_parameters()}
            )
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), args.grad_clip if args.grad_clip > 0 else float("inf")
        )
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        elapsed = time.perf_counter() - start
        acc = (stats["correct"] / stats["count"].clamp(min=1)).tolist()
        return {
            "step": self.step,
            "loss": stats["loss"],
            "lr": lr,
            "grad_norm": float(grad_norm),
            "elements": stats["elements"],
            "elements_per_s": stats["elements"] / elapsed,
            "tokens_per_s": args.batch_size * self.data.manifest["seq_len"] / elapsed,
            **{f"acc_{d}": acc[d] for d in range(args.num_depths)},
            **option_metrics(stats),
        }

    # -----------------------------------------------------------------------------------------------------------------

    def save(self, final: bool = False) -> Path:
        """Writes ``final`` or ``checkpoint-STEP`` whole: built in a staging directory, published by one rename, and
        only then named by ``latest.json``. A save killed at any point leaves the previous checkpoint the latest."""
        name = "final" if final else f"checkpoint-{self.step:07d}"
        directory = self.out / name
        if self.rank == 0:
            staging = staging_directory(directory)
            save_pretrained(self.model, staging)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(staging / "tokenizer"))
            state = {
                "step": self.step,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "args": asdict(self.args),
            }
            atomic_torch_save(staging / TRAINER_STATE, state)
            publish_directory(staging, directory)
            if not final:
                atomic_write_json(self.out / "latest.json", {"step": self.step, "checkpoint": name})
        if self.world > 1:
            dist.barrier()
        return directory

    def resumable_checkpoint(self) -> Path | None:
        """The checkpoint ``--resume`` continues from: the one ``latest.json`` names when it is complete (has its
        trainer state), else the newest complete ``checkpoint-*``; None when there is none."""
        latest = self.out / "latest.json"
        if latest.exists():
            named = self.out / json.loads(latest.read_text())["checkpoint"]
            if _complete_checkpoint(named):
                return named
        complete = sorted(d for d in self.out.glob("checkpoint-*") if _complete_checkpoint(d))
        return complete[-1] if complete else None

    def load_latest(self) -> bool:
        directory = self.resumable_checkpoint()
        if directory is None:
            return False
        state = torch.load(directory / TRAINER_STATE, map_location=self.device, weights_only=False)
        # Settings that change what a step computes must match, or the run would not continue exactly.
        free = {"steps", "save_every", "log_every", "resume", "overwrite", "progress", "out", "tensorboard"}
        free.add("save_grads_step")
        current = asdict(self.args)
        changed = {k: (v, current.get(k)) for k, v in state["args"].items() if k not in free and current.get(k) != v}
        if changed:
            detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise ValueError(f"--resume with settings that differ from the checkpoint's ({detail})")
        weights = load_state_dict(directory)
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(f"{directory} does not match this drafter: missing {missing}, unexpected {unexpected}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        return True

    def log(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step":
                    self.writer.add_scalar(key, value, record["step"])

    def run(self) -> list[dict[str, Any]]:
        from tqdm import tqdm

        args = self.args
        if self.rank == 0:
            if args.overwrite and self.out.exists():
                clear_directory(self.out)
            remove_temporaries(self.out)  # what killed saves left
        self.out.mkdir(parents=True, exist_ok=True)
        if args.resume and self.load_latest():
            # Drop metrics of steps after the checkpoint (an interrupted run may have logged them).
            path = self.out / "metrics.jsonl"
            if path.exists() and self.rank == 0:
                kept = [ln for ln in path.read_text().splitlines() if json.loads(ln)["step"] <= self.step]
                atomic_write_json_lines(path, kept)
        elif self.rank == 0 and (self.out / "metrics.jsonl").exists():
            (self.out / "metrics.jsonl").unlink()
        if args.tensorboard and self.rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ValueError("--tensorboard needs the tensorboard package (pip install tensorboard)") from err

            self.writer = SummaryWriter(str(self.out / "tensorboard"))
        records = []
        bar = tqdm(total=args.steps, initial=self.step, desc="train", disable=not args.progress or self.rank != 0)
        while self.step < args.steps:
            record = self.train_step()
            records.append(record)
            if self.step % max(1, args.log_every) == 0 or self.step == args.steps:
                self.log(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", acc0=f"{record['acc_0']:.3f}")
            if args.save_every and self.step % args.save_every == 0:
                self.save()
        bar.close()
        self.save(final=True)
        return records


TRAINER_STATE = "trainer_state.pt"


def _complete_checkpoint(directory: Path) -> bool:
    return directory.is_dir() and (directory / TRAINER_STATE).is_file() and (directory / "config.json").is_file()


def atomic_write_json_lines(path: Path, lines: list[str]) -> None:
    atomic_write_bytes(path, "".join(line + "\n" for line in lines).encode())


def train(args: TrainArgs) -> list[dict[str, Any]]:
    trainer = Trainer(args)
    try:
        return trainer.run()
    finally:
        if trainer.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
