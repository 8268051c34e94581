"""Step 3, train: COD sampling + fused gather + P-EAGLE masks + sequence partitioning, distillation to the target.

One optimizer step takes ``batch_size`` rows (global). Row slot j of the run (step k holds slots kB .. kB + B - 1) is a
fixed training row of a seeded per-epoch permutation, and its COD elements come from a seed derived from j: the data
and the elements of a step do not depend on the number of processes, the micro-batch size or on where a run was
resumed. Each process takes the slots of its rank (B must divide by the world size) and runs them in micro-batches of
``micro_batch_size`` rows packed side by side, accumulating gradients; each row's loss is its weighted mean over its
elements divided by B, so a step's gradient is that of the mean row loss of the global batch whatever the split.
DistributedDataParallel or FSDP2 reduce the gradients across processes (:mod:`peagle.train.parallel`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
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
from peagle.model import DrafterConfig, DraftOutput, PEagleDrafter, load_state_dict, save_pretrained, warm_start
from peagle.ops import cod_sample
from peagle.train.data import load_tokenizer, resolve_mask_token
from peagle.train.dataset import ExtractedData, TrainRow
from peagle.train.evaluate import evaluate
from peagle.train.loss import OPTION_STATS, element_loss, new_stats
from peagle.train.parallel import ParallelDrafter
from peagle.train.partition import partition_elements
from peagle.train.step import element_weights, loss_step
from peagle.train.stream import (
    ProducerFailed,
    StreamArgs,
    StreamSource,
    check_resume,
    launch_producers,
    run_producer,
    stream_ranks,
)
from peagle.train.ttt import step_weights, train_ttt_row

__all__ = ["TrainArgs", "Trainer", "element_loss", "new_stats", "option", "pack_rows", "slot_row", "train", "train_row"]


def option(default: Any = MISSING, help: str = "", *, flag: str | None = None, hidden: bool = False) -> Any:
    """A :class:`TrainArgs` field whose metadata describes its ``peagle train`` option: the help text, the flag when it
    is not ``--field-name`` (a bool field that defaults to True is switched off by its flag), and whether the option
    is left out of ``--help``. The CLI builds the option from the field: name, type, choices, default and help."""
    return field(default=default, metadata={"help": help, "flag": flag, "hidden": hidden})


@dataclass
class TrainArgs:
    """Settings of one training run: the fields of ``peagle train`` (each field's metadata holds its option)."""

    data: str = option(
        help="an extract output directory; with --stream the prompts the producers answer (.jsonl or "
        "hf:NAME[:SPLIT], as peagle regenerate reads them)"
    )
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
    init_from: str | None = option(
        None,
        "warm start from an EAGLE-3 checkpoint (speculators format, by peagle or speculators): shared weights copied, "
        "mask_hidden and the mask token's embedding row initialised (OUT/init_from.json lists which)",
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
    ttt_steps: int = option(
        1, "EAGLE-3 training-time test: unroll S autoregressive steps (own hidden state and drafted token fed back)"
    )
    ttt_step_weight: float = option(1.0, "loss weight of unrolled step s is W^s")
    steps: int | None = option(None, "optimizer steps (default 1000, or from --epochs)")
    epochs: float | None = option(
        None, "passes over the training rows instead of --steps: steps = ceil(epochs x rows / batch size)"
    )
    batch_size: int = option(1, "rows per step, all processes together")
    micro_batch_size: int = option(
        1,
        "rows per forward pass on each process, packed side by side (no row sees another); a step accumulates the "
        "gradients of its ceil(batch size / (processes x this)) micro-batches",
    )
    lr: float = option(3e-4, "peak learning rate")
    min_lr_ratio: float = option(0.1, "cosine floor as a fraction of --lr")
    warmup_steps: int = option(10, "linear warmup steps")
    weight_decay: float = option(0.0, "AdamW weight decay")
    grad_clip: float = option(1.0, "gradient norm clip, 0 = off")
    seed: int = option(0, "seed of init, data order and COD sampling")
    row_order: Literal["shuffled", "stored"] = option(
        "shuffled",
        "shuffled: each epoch visits the training rows in a seeded permutation; stored: in the order of --data (the "
        "order --stream trains rows in, as they arrive)",
    )
    attention: Literal["sdpa", "sdpa-full", "flex"] | None = option(
        None,
        "sdpa: dense mask per document; sdpa-full: one N x N mask; flex: BlockMask (default: flex on GPU, sdpa on CPU)",
    )
    eval_every: int = option(
        0, "every N steps (and after the last) log the held-out loss and acceptance length to metrics.jsonl, 0 = off"
    )
    eval_data: str | None = option(None, "held-out rows: an extract directory (default: rows held out of --data)")
    eval_rows: int = option(
        16,
        "held-out rows: the first N of --eval-data, or N rows of --data that are then never trained on (a permutation "
        "with a fixed seed: the same rows for every run on the same data)",
    )
    eval_ar_depths: int = option(4, "drafts per chain of the held-out autoregressive acceptance of --depths 1")
    fsdp: bool = option(
        False, "under torchrun: shard the drafter with FSDP2 (fully_shard) instead of replicating it (DDP)"
    )
    save_every: int = option(0, "checkpoint every N steps, 0 = only at the end")
    log_every: int = option(1, "metrics.jsonl record every N steps")
    resume: bool = option(False, "continue from the latest complete checkpoint in --out")
    stream: bool = option(
        False,
        "streaming training: producer processes answer the prompts of --data with the target and send the rows "
        "(tokens and hidden states) straight to this trainer, no files between them (the --stream options below)",
    )
    overwrite: bool = option(False, "clear a non-empty --out first (without it or --resume, a used --out is refused)")
    tensorboard: bool = option(False, "also log to TensorBoard (needs tensorboard)")
    # Drawn by `peagle train` (the command), not by the trainer: plotting needs matplotlib (the demo extra).
    plot: bool = option(False, "after training, draw loss, accuracy and held-out acceptance to OUT/training.png")
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
            ("ttt_steps", 1 <= self.ttt_steps <= 64, "in [1, 64]"),
            ("ttt_step_weight", 0 < self.ttt_step_weight < math.inf, "positive"),
            ("memory_budget_mb", optional(self.memory_budget_mb, lambda v: 0 < v < math.inf), "positive"),
            ("steps", optional(self.steps, lambda v: v >= 0), "at least 0"),
            ("epochs", optional(self.epochs, lambda v: 0 < v < math.inf), "positive"),
            ("batch_size", self.batch_size >= 1, "at least 1"),
            ("micro_batch_size", self.micro_batch_size >= 1, "at least 1"),
            ("eval_every", self.eval_every >= 0, "at least 0 (0 = off)"),
            ("eval_rows", self.eval_rows >= 1, "at least 1"),
            ("eval_ar_depths", self.eval_ar_depths >= 1, "at least 1"),
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
        if self.ttt_steps > 1:
            clash = [
                (self.num_depths != 1, "--depths 1 (TTT unrolls an autoregressive EAGLE-3 drafter)"),
                (self.segments != 1 or self.memory_budget_mb is not None, "no --segments / --memory-budget-mb"),
                (weights is not None, "--ttt-step-weight instead of --depth-weights"),
                (
                    self.moe_num_experts > 0 or self.efficient_lm_head_rank > 0,
                    "no --moe-experts / --lm-head-rank (their extra losses are not unrolled)",
                ),
            ]
            for bad, needed in clash:
                if bad:
                    raise ValueError(f"--ttt-steps {self.ttt_steps} needs {needed}")
        if self.steps is not None and self.epochs is not None:
            raise ValueError(f"give --steps ({self.steps}) or --epochs ({self.epochs}), not both")
        if self.stream:
            clash = [
                (self.epochs is not None, "--steps instead of --epochs (the stream's row count is not known before)"),
                (
                    self.draft_vocab_size is not None or self.efficient_lm_head_rank > 0,
                    "no --draft-vocab-size / --lm-head-rank (they count the training tokens before training)",
                ),
                (self.fsdp, "no --fsdp (one trainer process)"),
            ]
            for bad, needed in clash:
                if bad:
                    raise ValueError(f"--stream needs {needed}")
            if not self.data.startswith("hf:") and not Path(self.data).is_file():
                raise FileNotFoundError(f"--data {self.data} (the prompts of --stream) is not a file")
        if self.resume and self.overwrite:
            raise ValueError("--overwrite clears --out, --resume continues it: give one of them")
        inputs = {"--data": self.data, **({"--eval-data": self.eval_data} if self.eval_data else {})}
        check_output_directory(self.out, inputs)


def _flag(name: str) -> str:
    """The ``peagle train`` option of a TrainArgs field."""
    meta = next(f.metadata for f in fields(TrainArgs) if f.name == name)
    return meta.get("flag") or "--" + name.replace("_", "-")


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


def pack_rows(
    rows: list[TrainRow], elements: list[tuple[Tensor, Tensor]]
) -> tuple[TrainRow, Tensor, Tensor, Tensor, Tensor]:
    """Several rows side by side as one micro-batch row: documents renumbered so that none spans two rows (the mask
    never lets an element see another row), each row's anchors shifted by its start. Returns the packed row, its
    anchors and depths, ``positions`` (each index's position within its own row, the RoPE positions it has alone)
    and ``row_index`` (the row of each index, for per-row loss means)."""
    packed, anchors, depths, positions, row_index = [], [], [], [], []
    start = doc_offset = 0
    for j, (row, (a, d)) in enumerate(zip(rows, elements, strict=True)):
        docs = row.document_ids
        packed.append(row._replace(document_ids=torch.where(docs >= 0, docs + doc_offset, docs)))
        doc_offset += int(docs.max()) + 1 if docs.numel() else 0
        anchors.append(a + start)
        depths.append(d)
        length = docs.numel()
        positions.append(torch.arange(length, device=docs.device))
        row_index.append(torch.full((length,), j, dtype=torch.long, device=docs.device))
        start += length
    row = TrainRow(*(torch.cat(parts) for parts in zip(*packed, strict=True)))
    return row, torch.cat(anchors), torch.cat(depths), torch.cat(positions), torch.cat(row_index)


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
    positions: Tensor | None = None,
    row_index: Tensor | None = None,
    forward: Callable[..., DraftOutput] | None = None,
    backward: bool = True,
    moe_balance_weight: float = 0.0,
    lm_head_kl_weight: float = 1.0,
) -> dict[str, Any]:
    """Forward (+ backward) of one row's COD elements (S segments one after another), the row's loss being the
    weighted mean over its valid elements, times ``scale``. Returns (and accumulates into) ``stats``.

    Several rows packed by :func:`pack_rows` pass their ``positions`` and ``row_index``: the loss is then the sum of
    the rows' own means. ``forward`` runs ``model.forward_train`` (default: that method; a DDP / FSDP wrapper's
    forward when distributed). ``backward=False`` only measures (under ``torch.no_grad``, e.g. held-out loss)."""
    stats = stats if stats is not None else new_stats(depth_weights.numel())
    forward = forward or model.forward_train
    stats["elements"] += anchors.numel()
    weighed = element_weights(row, anchors, depths, depth_weights, row_index)
    if weighed is None:
        return stats
    valid, weight = weighed
    # Drop elements that influence no loss: padding, and depth-0 elements after the last loss-carrying anchor of
    # their document (every query sees only keys at or before its own anchor). Exact: no kept element's keys change.
    dev = anchors.device
    docs = row.document_ids
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
    for index, seg_anchors, seg_depths, owned in parts:
        w = weight[index] * owned
        keep = torch.nonzero(w > 0).squeeze(1)
        if keep.numel() == 0:
            continue
        # LM head only on the elements that carry loss (padding / untrained rows need no logits).
        run = partial(forward, row.input_ids, row.hidden, seg_anchors, seg_depths, docs, attention=attention,
                      logit_rows=keep, positions=positions)  # fmt: skip
        loss_step(
            model, run, row, w[keep], seg_depths[keep], target_lm_head, draft_ids,
            loss_kind=loss_kind, scale=scale, stats=stats, backward=backward,
            moe_balance_weight=moe_balance_weight, lm_head_kl_weight=lm_head_kl_weight,
        )  # fmt: skip
    return stats


class Trainer:
    """One training run of ``args``: from an extract directory, or with ``stream`` from producers (the rows arrive
    from :class:`peagle.train.stream.StreamSource`; its producers are started by :func:`train`)."""

    def __init__(self, args: TrainArgs, stream: StreamArgs | None = None) -> None:
        # Before any work, and before the process group forms: no rank has written to --out yet.
        args.check()
        if args.stream != (stream is not None):
            raise ValueError("--stream and its settings (StreamArgs) go together")
        if stream is not None:
            stream.check()
            if args.eval_every and not (args.eval_data or stream.eval_input):
                raise ValueError(
                    "--eval-every with --stream needs --eval-input (held-out prompts the producers answer) or "
                    "--eval-data (an extract directory)"
                )
        if not (args.resume or args.overwrite or is_empty_directory(args.out)):
            raise ValueError(
                f"output (--out) {args.out} is not empty (an earlier run?); pass --resume to continue it or "
                "--overwrite to start over"
            )
        self.args = args
        # A stream's process group holds the producers: this process trains alone.
        self.world = 1 if stream else int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = 0 if stream else int(os.environ.get("RANK", "0"))
        if args.fsdp and self.world < 2:
            raise ValueError("--fsdp shards the drafter over processes: run it under torchrun with 2 or more")
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
        self.out = Path(args.out)
        self.source: StreamSource | None = None
        self.stream_state: dict[str, Any] | None = None  # the resumed checkpoint's (cursors per producer)
        if stream is None:
            self.data = ExtractedData(args.data)
            self.train_rows, self.held_out = self._split_rows()
            self.eval_data = ExtractedData(args.eval_data) if args.eval_data else self.data
            manifest = self.data.manifest
            head = self.data.target_head()
            self.tokenizer = None
            tok_dir = Path(manifest["data"]) / "tokenizer"
            if tok_dir.exists():
                self.tokenizer = load_tokenizer(tok_dir)
        else:
            self.source = StreamSource(stream)
            self.train_rows, self.held_out = [], []
            # Held-out rows from an extract directory, or (set when the producers connect) those of --eval-input.
            self.eval_data = ExtractedData(args.eval_data) if args.eval_data else None
            manifest, head, self.tokenizer = self.source.manifest, self.source.head, self.source.tokenizer
        self.manifest = manifest
        self.eval_rows = self.held_out or (
            list(range(min(args.eval_rows, len(self.eval_data)))) if self.eval_data is not None else []
        )
        self.total_steps = args.steps if args.steps is not None else 1000
        if args.epochs is not None:
            self.total_steps = math.ceil(args.epochs * len(self.train_rows) / args.batch_size)
        self.target_lm_head = head["lm_head.weight"].to(self.device)
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
        if args.ttt_steps > 1:
            weights = step_weights(args.ttt_steps, args.ttt_step_weight)
        self.depth_weights = torch.tensor(weights, dtype=torch.float32, device=self.device)
        torch.manual_seed(args.seed)
        self.model = PEagleDrafter(self.config).to(self.device)
        self._init_from_target(head)
        self.warm_start = warm_start(self.model, args.init_from) if args.init_from else None
        self.draft_ids = self.model.draft_ids()
        mode = "fsdp" if args.fsdp else "ddp" if self.world > 1 else "single"
        self.parallel = ParallelDrafter(self.model, mode, self.world, self.device)  # before the optimizer: shards
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: _lr_lambda(s, args.warmup_steps, self.total_steps, args.min_lr_ratio)
        )
        self.step = 0
        self.saved_step = -1  # the step of the newest checkpoint this run wrote or resumed
        self.best: dict[str, Any] | None = None  # the checkpoint_best so far: step, metric, value
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
        freq_path = Path(self.manifest["data"]) / "token_freq.safetensors"
        if not freq_path.exists():
            raise FileNotFoundError(f"{purpose} needs token frequencies: {freq_path} is missing")
        from safetensors.torch import load_file

        counts = load_file(freq_path)["counts"].double()
        return torch.nn.functional.pad(counts, (0, self.config.vocab_size - counts.numel())).to(self.device)

    def _split_rows(self) -> tuple[list[int], list[int]]:
        """(training rows, held-out rows) of --data. Rows are held out only for held-out evaluation without
        --eval-data: the first --eval-rows of a permutation with the fixed seed HOLDOUT_SEED (not --seed, so runs
        with other seeds or settings on the same data share them), in increasing order."""
        a, rows = self.args, len(self.data)
        if not a.eval_every or a.eval_data is not None:
            return list(range(rows)), []
        if a.eval_rows >= rows:
            raise ValueError(f"--eval-rows ({a.eval_rows}) must leave rows to train on: --data has {rows}")
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(HOLDOUT_SEED))
        held = set(order[: a.eval_rows].tolist())
        return [r for r in range(rows) if r not in held], sorted(held)

    # -----------------------------------------------------------------------------------------------------------------

    def row_slot(self, slot: int) -> int:
        """The --data row of slot ``slot`` (see :func:`slot_row`; in the stored order with ``--row-order stored``)."""
        if self.args.row_order == "stored":
            return self.train_rows[slot % len(self.train_rows)]
        return slot_row(self.train_rows, self.args.seed, slot)

    def slot_train_row(self, slot: int) -> TrainRow:
        """The training row of slot ``slot`` on the device: from --data, or the stream's next row."""
        if self.source is not None:
            return self.source.row(slot, self.device)
        return TrainRow(*(t.to(self.device) for t in self.data.row(self.row_slot(slot))))

    def row_elements(self, row: TrainRow, slot: int) -> tuple[Tensor, Tensor]:
        a = self.args
        seed = (a.seed * 1_000_003 + slot) % (2**31 - 1)
        depths = max(a.num_depths, a.ttt_steps)  # TTT: step s of the unroll is depth s
        return cod_sample(row.loss_mask, row.document_ids, depths, a.ratio, a.ratio_min, a.max_anchors, seed)

    def micro_batch_backward(self, slots: list[int], scale: float, stats: dict[str, Any]) -> None:
        """Forward + backward of the rows of ``slots`` packed into one row (segment by segment), each row's loss
        scaled by ``scale``; fills ``stats``."""
        rows = [self.slot_train_row(slot) for slot in slots]
        elements = [self.row_elements(row, slot) for row, slot in zip(rows, slots, strict=True)]
        if self.args.ttt_steps > 1:  # the unroll runs row by row
            for row, (anchors, depths) in zip(rows, elements, strict=True):
                train_ttt_row(
                    self.model, row, anchors, depths, self.target_lm_head, self.draft_ids, self.depth_weights,
                    loss_kind=self.args.loss, scale=scale, stats=stats,
                )  # fmt: skip
            return
        positions = row_index = None
        if len(rows) == 1:
            row, (anchors, depths) = rows[0], elements[0]
        else:
            row, anchors, depths, positions, row_index = pack_rows(rows, elements)
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
            positions=positions,
            row_index=row_index,
            forward=self.parallel.forward,
            moe_balance_weight=self.args.moe_balance_weight,
            lm_head_kl_weight=self.args.lm_head_kl_weight,
        )

    def train_step(self) -> dict[str, Any]:
        args = self.args
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        stats = new_stats(self.depth_weights.numel())
        slots = list(range(self.step * args.batch_size, (self.step + 1) * args.batch_size))[self.rank :: self.world]
        # Each row's loss / B, times the process count that DDP / FSDP divide the summed gradients by.
        scale = self.world / args.batch_size
        with self.parallel.accumulate():
            for first in range(0, len(slots), args.micro_batch_size):
                self.micro_batch_backward(slots[first : first + args.micro_batch_size], scale, stats)
        self.parallel.sync()
        for p in self.model.parameters():
            if p.grad is None:  # a drafter part no row reached still takes its (zero-gradient) AdamW step
                p.grad = torch.zeros_like(p)
        if self.world > 1:
            _all_reduce_stats(stats)
        stats["loss"] /= self.world
        if args.save_grads_step is not None and self.step == args.save_grads_step:
            grads = self.parallel.full_gradients()  # every process: a collective under FSDP
            if self.rank == 0:
                atomic_torch_save(self.out / f"grads-{self.step}.pt", grads)
        grad_norm = self.parallel.clip_grad_norm(args.grad_clip if args.grad_clip > 0 else float("inf"))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        if self.source is not None:
            self.source.commit()  # the step's rows are trained: a checkpoint from now on claims them
        elapsed = time.perf_counter() - start
        acc = (stats["correct"] / stats["count"].clamp(min=1)).tolist()
        return {
            "step": self.step,
            "epoch": self.source.epoch() if self.source else self.step * args.batch_size / len(self.train_rows),
            "loss": stats["loss"],
            "lr": lr,
            "grad_norm": grad_norm,
            "elements": stats["elements"],
            "elements_per_s": stats["elements"] / elapsed,
            "tokens_per_s": args.batch_size * self.manifest["seq_len"] / elapsed,
            **{f"acc_{d}": acc[d] for d in range(len(acc))},
            **option_metrics(stats),
        }

    # -----------------------------------------------------------------------------------------------------------------

    def evaluate_held_out(self) -> dict[str, float]:
        """Held-out loss (the training objective on fixed COD elements per row) and offline acceptance length of the
        current weights on the held-out rows (see TrainArgs.eval_rows): chains drafted in parallel, and for K = 1
        also autoregressively (``--eval-ar-depths`` drafts, as EAGLE-3 serves). Computed on rank 0."""
        args = self.args
        drafter = self.parallel.full_drafter()  # every process: a collective under FSDP
        record: dict[str, float] = {}
        if drafter is not None:
            record["eval_loss"] = self.held_out_loss(drafter)
            chain = evaluate(drafter, self.eval_data, rows=self.eval_rows)
            record["eval_acceptance_length"] = chain["acceptance_length"]
            record |= {f"eval_acc_{d}": v for d, v in enumerate(chain["top1_accuracy"])}
            if args.num_depths == 1:
                served = evaluate(
                    drafter, self.eval_data, rows=self.eval_rows, depth=args.eval_ar_depths, autoregressive=True
                )
                record["eval_ar_acceptance_length"] = served["acceptance_length"]
        if self.world > 1:
            dist.barrier()
        return record

    @torch.no_grad()
    def held_out_loss(self, drafter: PEagleDrafter) -> float:
        """Mean per-row loss over the held-out rows; row r's COD elements come from a seed of r alone, so every
        evaluation of a run scores the same elements."""
        args = self.args
        drafter.eval()
        stats = new_stats(args.num_depths)
        for index in self.eval_rows:
            row = TrainRow(*(t.to(self.device) for t in self.eval_data.row(index)))
            seed = (HOLDOUT_SEED + index) % (2**31 - 1)
            anchors, depths = cod_sample(
                row.loss_mask, row.document_ids, args.num_depths, args.ratio, args.ratio_min, args.max_anchors, seed
            )
            train_row(
                drafter,
                row,
                anchors,
                depths,
                self.target_lm_head,
                self.draft_ids,
                self.depth_weights,
                loss_kind=args.loss,
                segments=args.segments,
                attention=self.attention,
                scale=1.0 / len(self.eval_rows),
                stats=stats,
                backward=False,
            )
        return stats["loss"]

    # -----------------------------------------------------------------------------------------------------------------

    def save(self, final: bool = False) -> Path:
        """Writes ``final`` or ``checkpoint-STEP`` whole: built in a staging directory, published by one rename, and
        only then named by ``latest.json``. A save killed at any point leaves the previous checkpoint the latest.
        Weights and optimizer state are whole (gathered on rank 0 when sharded)."""
        name = "final" if final else f"checkpoint-{self.step:07d}"
        directory = self.out / name
        drafter = self.parallel.full_drafter()  # every process: collectives under FSDP
        optimizer = self.parallel.optimizer_state(self.optimizer)
        if self.rank == 0:
            staging = staging_directory(directory)
            save_pretrained(drafter, staging)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(staging / "tokenizer"))
            state = {
                "step": self.step,
                "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict(),
                "args": asdict(self.args),
                "held_out": self.held_out,
                "best": self.best,
                **({"stream": self.source.state()} if self.source is not None else {}),
            }
            atomic_torch_save(staging / TRAINER_STATE, state)
            publish_directory(staging, directory)
            if not final:
                atomic_write_json(self.out / "latest.json", {"step": self.step, "checkpoint": name})
        if self.world > 1:
            dist.barrier()
        self.saved_step = self.step
        return directory

    def save_best_if_improved(self, record: dict[str, Any]) -> bool:
        """After a held-out evaluation: publishes the weights as ``checkpoint_best`` (whole, in one rename, beside
        the latest checkpoint) when their held-out acceptance length is the best so far (the served one of a
        ``--depths 1`` drafter, drafting autoregressively). Returns whether it did."""
        metric = "eval_ar_acceptance_length" if self.args.num_depths == 1 else "eval_acceptance_length"
        improved = torch.tensor([0.0], device=self.device)  # NCCL broadcasts device tensors
        if self.rank == 0 and metric in record:
            value = float(record[metric])
            if self.best is None or value > self.best["value"]:
                improved[0] = 1.0
                self.best = {"step": self.step, "metric": metric, "value": value}
        if self.world > 1:
            dist.broadcast(improved, 0)
        if not improved.item():
            return False
        drafter = self.parallel.full_drafter()  # every process: a collective under FSDP
        if self.rank == 0:
            staging = staging_directory(self.out / BEST)
            save_pretrained(drafter, staging)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(staging / "tokenizer"))
            atomic_write_json(staging / BEST_RECORD, self.best)
            publish_directory(staging, self.out / BEST)
        if self.world > 1:
            dist.barrier()
        return True

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
        state = torch.load(directory / TRAINER_STATE, map_location="cpu", weights_only=False)
        # Settings that change what a step computes must match, or the run would not continue exactly.
        current = asdict(self.args)
        changed = {
            k: (v, current.get(k)) for k, v in state["args"].items() if k not in RESUME_FREE and current.get(k) != v
        }
        if changed:
            detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise ValueError(f"--resume with settings that differ from the checkpoint's ({detail})")
        if state.get("held_out", []) != self.held_out:
            raise ValueError(
                "--resume must train on the rows the checkpoint's run trained on: it held out "
                f"{len(state.get('held_out', []))} rows of --data, this run {len(self.held_out)} (--eval-every, "
                "--eval-data, --eval-rows)"
            )
        if self.source is not None:
            if "stream" not in state:
                raise ValueError(f"--resume --stream: {directory} is the checkpoint of a run that trained from files")
            check_resume(state["stream"], self.source.stream)
            self.stream_state = state["stream"]
        elif "stream" in state:
            raise ValueError(
                f"--resume: {directory} is the checkpoint of a --stream run; pass --stream and its settings"
            )
        self.parallel.load_full_state_dict(load_state_dict(directory))
        self.parallel.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = self.saved_step = state["step"]
        self.best = state.get("best")
        return True

    def _drop_abandoned_best(self) -> None:
        """On --resume: a checkpoint_best written after the resumed checkpoint belongs to the steps this run does
        again; it goes with them (the next evaluation that beats the resumed run's best writes it again)."""
        record = self.out / BEST / BEST_RECORD
        if self.rank == 0 and record.exists() and json.loads(record.read_text())["step"] > self.step:
            shutil.rmtree(self.out / BEST)

    def log(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step":
                    self.writer.add_scalar(key, value, record["step"])

    def _prepare_output(self) -> None:
        """Clears (--overwrite) or resumes --out; metrics of steps after the resumed checkpoint are dropped."""
        args = self.args
        if self.rank == 0:
            if args.overwrite and self.out.exists():
                clear_directory(self.out)
            remove_temporaries(self.out)  # what killed saves left
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "metrics.jsonl"
        if args.resume and self.load_latest():
            self._drop_abandoned_best()
            # Drop metrics of steps after the checkpoint (an interrupted run may have logged them).
            if path.exists() and self.rank == 0:
                kept = [ln for ln in path.read_text().splitlines() if json.loads(ln)["step"] <= self.step]
                atomic_write_json_lines(path, kept)
        elif self.rank == 0:
            if path.exists():
                path.unlink()
            if (self.out / BEST).exists():  # a --resume that found no checkpoint starts over
                shutil.rmtree(self.out / BEST)
            if self.warm_start is not None:  # a run that starts from the warm-started weights
                atomic_write_json(self.out / "init_from.json", self.warm_start)
                print(f"[peagle train] warm start from {args.init_from}: initialised {self.warm_start['initialised']}")
        if args.tensorboard and self.rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ValueError("--tensorboard needs the tensorboard package (pip install tensorboard)") from err

            self.writer = SummaryWriter(str(self.out / "tensorboard"))

    def run(self) -> list[dict[str, Any]]:
        from tqdm import tqdm

        args = self.args
        self._prepare_output()
        if self.source is not None:
            first_slot = self.step * args.batch_size
            self.source.connect(self.stream_state, first_slot, args.eval_rows if args.eval_every else 0)
            if self.eval_data is None and self.source.eval_rows is not None:
                self.eval_data = self.source.eval_rows
                self.eval_rows = list(range(min(args.eval_rows, len(self.eval_data))))
        records = []
        total = self.total_steps
        bar = tqdm(total=total, initial=self.step, desc="train", disable=not args.progress or self.rank != 0)
        while self.step < total:
            try:
                record = self.train_step()
            except ProducerFailed:
                # The step in progress is dropped; what the completed steps trained is kept (their rows only).
                if self.step > max(0, self.saved_step):
                    self.save()
                raise
            evaluated = bool(args.eval_every) and (self.step % args.eval_every == 0 or self.step == total)
            if evaluated:
                record |= self.evaluate_held_out()
                self.save_best_if_improved(record)
            records.append(record)
            if evaluated or self.step % max(1, args.log_every) == 0 or self.step == total:
                self.log(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", acc0=f"{record['acc_0']:.3f}")
            if args.save_every and self.step % args.save_every == 0:
                self.save()
        bar.close()
        self.save(final=True)
        return records


TRAINER_STATE = "trainer_state.pt"
# The weights of the best held-out acceptance length so far, and what it was (step, metric, value).
BEST = "checkpoint_best"
BEST_RECORD = "best.json"
# The held-out rows of --data (see Trainer._split_rows) and the COD seeds of the held-out loss.
HOLDOUT_SEED = 20_251_130
# Settings --resume may change: they do not change what a step computes (steps / epochs: how long the run goes).
RESUME_FREE = {
    "init_from",  # resumed weights come from the checkpoint
    "steps",
    "epochs",
    "save_every",
    "log_every",
    "resume",
    "overwrite",
    "progress",
    "out",
    "tensorboard",
    "plot",
    "save_grads_step",
    "eval_every",
    "eval_data",
    "eval_rows",
    "eval_ar_depths",
    "fsdp",
}
# A stream's own settings are checked apart (peagle.train.stream.check_resume).


def slot_row(train_rows: list[int], seed: int, slot: int) -> int:
    """The row trained in slot ``slot`` of a run with ``seed``: epoch e = slot // len(train_rows) visits the training
    rows in a permutation seeded with (seed, e), so an epoch sees every training row once and the order does not
    depend on where a run resumed."""
    epoch, offset = divmod(slot, len(train_rows))
    generator = torch.Generator().manual_seed((seed * 7919 + epoch) % 2**63)  # the same seeds as ever below 2^63/7919
    return train_rows[int(torch.randperm(len(train_rows), generator=generator)[offset])]


def _all_reduce_stats(stats: dict[str, Any]) -> None:
    """Sums the step's loss, element count, per-depth accuracy counts and option statistics over the processes
    (metrics only)."""
    k = stats["correct"].numel()
    head = torch.tensor([stats["loss"], stats["elements"]], dtype=torch.float64)
    packed = torch.cat([head, stats["correct"], stats["count"], stats["options"]])
    dist.all_reduce(packed)
    stats["loss"], stats["elements"] = float(packed[0]), int(packed[1])
    stats["correct"], stats["count"] = packed[2 : 2 + k], packed[2 + k : 2 + 2 * k]
    stats["options"] = packed[2 + 2 * k :]


def _complete_checkpoint(directory: Path) -> bool:
    return directory.is_dir() and (directory / TRAINER_STATE).is_file() and (directory / "config.json").is_file()


def atomic_write_json_lines(path: Path, lines: list[str]) -> None:
    atomic_write_bytes(path, "".join(line + "\n" for line in lines).encode())


def train(args: TrainArgs, stream: StreamArgs | None = None, register: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Runs ``args``. With ``stream``: on one machine this process trains and starts ``stream.producers`` producer
    processes; under torchrun rank 0 trains and every other rank is a producer (``register``: modules a producer
    imports first, which register its backends, e.g. ``peagle.vllm.regenerate``). Returns the step records (none on
    a producer)."""
    if stream is None:
        trainer = Trainer(args)
        try:
            return trainer.run()
        finally:
            if trainer.world > 1 and dist.is_initialized():
                dist.destroy_process_group()
    ranks = stream_ranks()
    if ranks is not None and ranks[0] > 0:
        code = run_producer(ranks[0], ranks[1], args.data, stream, register)
        if code:
            raise SystemExit(code)
        return []
    if ranks is not None and ranks[1] - 1 != stream.producers:
        raise ValueError(
            f"--producers ({stream.producers}) must be the torchrun world size - 1 ({ranks[1] - 1}): rank 0 trains, "
            "every other rank produces"
        )
    trainer = Trainer(args, stream)  # every check before a producer starts
    local = launch_producers(args.data, stream, register) if ranks is None else None
    try:
        if local is not None:
            local.watch(dist.is_initialized)
        return trainer.run()
    finally:
        connected = dist.is_initialized()
        trainer.source.stop()
        if local is not None:
            local.join(grace=60.0 if connected else 0.0)  # unconnected producers wait in the rendezvous: end them
