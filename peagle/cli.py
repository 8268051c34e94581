"""`peagle <command>`: the command-line entry point."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch


def _best_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def cmd_example(args: argparse.Namespace) -> int:
    """COD sampling + fused gather of one packed training row on the CPU, checked against the PyTorch reference."""
    from peagle.ops import cod_gather, cod_gather_reference, cod_sample, cod_sample_reference
    from peagle.testing import random_packed_row

    gen = torch.Generator().manual_seed(args.seed)
    row = random_packed_row(gen, args.length, mean_document_length=args.length / 8)
    input_ids = torch.randint(0, args.vocab, (args.length,), generator=gen)
    hidden = torch.randn(args.length, args.width, generator=gen).to(torch.bfloat16)
    mask_hidden = torch.randn(args.width, generator=gen).to(torch.bfloat16)
    sample_args = (row.loss_mask, row.document_ids, args.depths, args.ratio, args.ratio_min, args.max_anchors)

    anchors, depths = cod_sample(*sample_args, args.seed)
    inputs = cod_gather(input_ids, hidden, mask_hidden, anchors, depths, args.vocab)
    ref_anchors, ref_depths = cod_sample_reference(*sample_args, args.seed)
    ref = cod_gather_reference(input_ids, hidden, mask_hidden, ref_anchors, ref_depths, args.vocab)
    same = torch.equal(anchors, ref_anchors) and all(torch.equal(a, b) for a, b in zip(inputs, ref, strict=True))

    documents = int(row.document_ids.max()) + 1
    print(f"packed row: T = {args.length} positions, {documents} documents, {int(row.loss_mask.sum())} trained labels")
    print(f"COD: K = {args.depths}, ratio {args.ratio}, ratio_min {args.ratio_min}, max_anchors {args.max_anchors}")
    print(f"{'depth':>5}  {'elements':>8}")
    counts = torch.bincount(depths, minlength=args.depths)
    for d, n in enumerate(counts.tolist()):
        print(f"{d:>5}  {n:>8}")
    print(f"total N = {anchors.numel()} elements ({anchors.numel() / args.length:.2f} x T)")
    print(f"cod_gather: ids {tuple(inputs.ids.shape)}, feats {tuple(inputs.feats.shape)} {inputs.feats.dtype}")
    print(f"equal to the PyTorch reference: {same}")

    ours = _best_ms(lambda: cod_gather(input_ids, hidden, mask_hidden, *cod_sample(*sample_args, 1), args.vocab))
    theirs = _best_ms(
        lambda: cod_gather_reference(input_ids, hidden, mask_hidden, *cod_sample_reference(*sample_args, 1), args.vocab)
    )
    print(f"sample + gather: peagle {ours:.2f} ms, reference {theirs:.2f} ms ({theirs / ours:.1f}x)")
    return 0 if same else 1


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def cmd_prepare_data(args: argparse.Namespace) -> int:
    """Step 1: tokenize jsonl chats/text (or hf:NAME[:SPLIT]) with loss masks and pack them into T-length rows."""
    from peagle.train.data import prepare_data

    manifest = prepare_data(
        args.input, args.tokenizer, args.out, args.seq_len, args.rows_per_shard, args.max_records, not args.quiet
    )
    print(
        f"prepared {manifest['num_rows']} rows of T = {manifest['seq_len']} ({manifest['trained_tokens']} trained "
        f"tokens) in {args.out}"
    )
    return 0


def cmd_extract(args: argparse.Namespace) -> int:
    """Step 2: run the target (transformers or vLLM) over prepared rows; store aux-layer hidden states and outputs."""
    from peagle.train.extract import extract

    manifest = extract(
        args.data,
        args.target,
        args.out,
        _ints(args.layers) if args.layers else None,
        args.dtype,
        args.rows_per_shard,
        args.device,
        not args.quiet,
        args.backend,
    )
    print(f"extracted {manifest['num_rows']} rows (aux layers {manifest['aux_layer_ids']}) into {args.out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Step 3: train a P-EAGLE drafter (K = --depths; K = 1 trains an EAGLE-3 drafter) on extracted data."""
    from peagle.train.trainer import TrainArgs, train

    train_args = TrainArgs(
        data=args.data,
        out=args.out,
        num_layers=args.layers,
        num_depths=args.depths,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        layer_style=args.layer_style,
        fc_norm=args.fc_norm,
        norm_before_fc=args.norm_before_fc,
        norm_output=args.norm_output,
        draft_vocab_size=args.draft_vocab_size,
        mask_token_id=args.mask_token_id,
        reuse_special_token_as_mask=args.reuse_special_token_as_mask,
        ratio=args.ratio,
        ratio_min=args.ratio_min,
        max_anchors=args.max_anchors,
        segments=args.segments,
        memory_budget_mb=args.memory_budget_mb,
        loss=args.loss,
        depth_weights=_floats(args.depth_weights) if args.depth_weights else None,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        seed=args.seed,
        attention=args.attention,
        save_every=args.save_every,
        log_every=args.log_every,
        resume=args.resume,
        tensorboard=args.tensorboard,
        save_grads_step=args.save_grads_step,
        progress=not args.quiet,
    )
    records = train(train_args)
    if records and int(__import__("os").environ.get("RANK", "0")) == 0:
        last = records[-1]
        print(f"step {last['step']}: loss {last['loss']:.4f}, depth-0 accuracy {last['acc_0']:.3f}")
        print(f"checkpoint: {args.out}/final")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Step 4: offline acceptance (Pos 1..K conditional acceptance, acceptance length) and per-depth accuracy."""
    import json

    from peagle.model import from_pretrained
    from peagle.train.evaluate import evaluate, format_table

    model = from_pretrained(args.checkpoint, dtype=torch.float32)
    rows = list(range(args.max_rows)) if args.max_rows else None
    if rows is not None:
        from peagle.train.dataset import ExtractedData

        rows = rows[: len(ExtractedData(args.data))]
    result = evaluate(model, args.data, rows, args.depths, autoregressive=args.autoregressive)
    print(format_table(result))
    if args.json:
        from peagle.model.checkpoint import atomic_write_json

        atomic_write_json(args.json, result)
    else:
        print(json.dumps(result))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Print the `vllm serve` command that serves a drafter beside its target, then run it (unless --dry-run)."""
    import os
    import subprocess

    from peagle.vllm.serve import format_command, serve_command

    argv = serve_command(args.drafter, args.target, args.num_speculative_tokens, args.vllm_args)
    print(format_command(argv, args.peagle_verify), flush=True)
    if args.dry_run:
        return 0
    env = {**os.environ, **({"PEAGLE_VLLM_VERIFY": "1"} if args.peagle_verify else {})}
    return subprocess.call(argv, env=env)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on an embedded default (or --target/--data): target -> prepare-data -> extract -> train P-EAGLE
    and an EAGLE-3 baseline -> eval -> serve with vLLM -> report (markdown, JSON, plots)."""
    from peagle.demo import run_demo

    report = run_demo(
        workdir=args.workdir,
        quick=args.quick,
        target=args.target,
        data=args.data,
        depths=args.depths,
        fresh=args.fresh,
        serve=not args.no_serve,
        progress=not args.quiet,
    )
    return 0 if report["lossless"] in (True, None) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peagle", description="P-EAGLE parallel-drafting speculative decoding toolkit"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    example = commands.add_parser("example", help=cmd_example.__doc__, description=cmd_example.__doc__)
    example.add_argument("--length", type=int, default=4096, help="positions T of the packed row (default 4096)")
    example.add_argument("--depths", type=int, default=8, help="parallel depths K (default 8)")
    example.add_argument("--ratio", type=float, default=0.7, help="COD keep ratio per depth (default 0.7)")
    example.add_argument("--ratio-min", type=float, default=0.2, help="floor of the keep ratio (default 0.2)")
    example.add_argument("--max-anchors", type=int, default=None, help="cap on seed chains (default: none)")
    example.add_argument("--width", type=int, default=3 * 512, help="hidden width D = 3 x H (default 1536)")
    example.add_argument("--vocab", type=int, default=32000, help="vocabulary size; mask token = vocab (default 32000)")
    example.add_argument("--seed", type=int, default=0)
    example.set_defaults(func=cmd_example)

    prep = commands.add_parser("prepare-data", help=cmd_prepare_data.__doc__, description=cmd_prepare_data.__doc__)
    prep.add_argument(
        "--input",
        required=True,
        help="a .jsonl file ({'messages': [...]}, {'conversations': [...]} "
        "or {'text': ...} per line) or hf:NAME[:SPLIT] (needs the datasets package)",
    )
    prep.add_argument("--tokenizer", required=True, help="the target's tokenizer directory (chat template for chats)")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument("--seq-len", type=int, default=2048, help="positions T of a packed row (default 2048)")
    prep.add_argument("--rows-per-shard", type=int, default=256, help="rows per output shard (default 256)")
    prep.add_argument("--max-records", type=int, default=None, help="stop after this many records")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(func=cmd_prepare_data)

    ext = commands.add_parser("extract", help=cmd_extract.__doc__, description=cmd_extract.__doc__)
    ext.add_argument("--data", required=True, help="a prepare-data output directory")
    ext.add_argument("--target", required=True, help="the target model directory (Hugging Face format)")
    ext.add_argument("--out", required=True, help="output directory (an interrupted run there resumes)")
    ext.add_argument(
        "--layers",
        default=None,
        help="aux target layer ids, e.g. 2,16,29 (default: early, middle, late as vLLM: 2, L/2, L-3)",
    )
    ext.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32", "float64"],
        help="storage dtype of hidden states (default bfloat16)",
    )
    ext.add_argument("--rows-per-shard", type=int, default=64, help="rows per shard (default 64)")
    ext.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="target device (hf)")
    ext.add_argument(
        "--backend",
        default="hf",
        choices=["hf", "vllm"],
        help="hf: transformers in this process; vllm: vLLM's hidden-state extraction (default hf)",
    )
    ext.add_argument("--quiet", action="store_true", help="no progress bar")
    ext.set_defaults(func=cmd_extract)

    tr = commands.add_parser(
        "train",
        help=cmd_train.__doc__,
        description=cmd_train.__doc__ + " Run it under "
        "torchrun for data parallel training (gloo on CPU, NCCL on GPUs).",
    )
    tr.add_argument("--data", required=True, help="an extract output directory")
    tr.add_argument("--out", required=True, help="output directory: checkpoints, metrics.jsonl, final/")
    tr.add_argument("--layers", type=int, default=4, help="drafter decoder layers (default 4)")
    tr.add_argument("--depths", type=int, default=8, help="parallel depths K (default 8; 1 = EAGLE-3)")
    tr.add_argument("--heads", type=int, default=None, help="attention heads (default: the target's)")
    tr.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: the target's)")
    tr.add_argument("--head-dim", type=int, default=None, help="head dim (default: the target's)")
    tr.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")
    tr.add_argument("--layer-style", choices=["llama", "qwen3"], default=None, help="default: from the target")
    tr.add_argument("--fc-norm", action="store_true", help="EAGLE-3.1: RMSNorm each aux hidden state before fc")
    tr.add_argument("--norm-before-fc", action="store_true", help="one RMSNorm over the concatenated aux states")
    tr.add_argument("--norm-output", action="store_true", help="EAGLE-3.1 norm_output flag (recorded for serving)")
    tr.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="draft vocabulary (most frequent trained tokens; d2t/t2d); default: the full target vocabulary",
    )
    tr.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="mask token id (default: the tokenizer's mask token, else a new token in an unused embedding slot)",
    )
    tr.add_argument(
        "--reuse-special-token-as-mask",
        action="store_true",
        help="if no mask token and no free "
        "embedding slot exist, reuse pad/eos/unk as the mask token. RISK: training then changes that real "
        "token's embedding row, so the drafter's view of that token (e.g. end of sequence) drifts",
    )
    tr.add_argument("--ratio", type=float, default=0.7, help="COD keep ratio per depth (default 0.7)")
    tr.add_argument("--ratio-min", type=float, default=0.2, help="floor of the COD keep ratio (default 0.2)")
    tr.add_argument("--max-anchors", type=int, default=None, help="cap on COD seed chains per row")
    tr.add_argument("--segments", type=int, default=1, help="sequence partitioning: segments S per row (default 1)")
    tr.add_argument("--memory-budget-mb", type=float, default=None, help="choose S per row from this budget")
    tr.add_argument(
        "--loss",
        choices=["kl", "ce"],
        default="kl",
        help="KL to the target distribution or CE to its argmax (default kl)",
    )
    tr.add_argument("--depth-weights", default=None, help="per-depth loss weights, e.g. 1,0.9,0.8 (default all 1)")
    tr.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    tr.add_argument("--batch-size", type=int, default=1, help="rows per step, all processes together (default 1)")
    tr.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    tr.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    tr.add_argument("--warmup-steps", type=int, default=10, help="linear warmup steps (default 10)")
    tr.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    tr.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip, 0 = off (default 1)")
    tr.add_argument("--seed", type=int, default=0, help="seed of init, data order and COD sampling")
    tr.add_argument(
        "--attention",
        choices=["sdpa", "sdpa-full", "flex"],
        default=None,
        help="sdpa: dense mask per "
        "document; sdpa-full: one N x N mask; flex: BlockMask (default: flex on GPU, sdpa on CPU)",
    )
    tr.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (default: only at the end)")
    tr.add_argument("--log-every", type=int, default=1, help="metrics.jsonl record every N steps")
    tr.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    tr.add_argument("--tensorboard", action="store_true", help="also log to TensorBoard (needs tensorboard)")
    tr.add_argument("--save-grads-step", type=int, default=None, help=argparse.SUPPRESS)
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.set_defaults(func=cmd_train)

    ev = commands.add_parser("eval", help=cmd_eval.__doc__, description=cmd_eval.__doc__)
    ev.add_argument("--checkpoint", required=True, help="a drafter checkpoint directory (e.g. OUT/final)")
    ev.add_argument("--data", required=True, help="held-out extract output directory")
    ev.add_argument("--depths", type=int, default=None, help="chain length K (default: the drafter's)")
    ev.add_argument(
        "--autoregressive",
        action="store_true",
        help="draft the K tokens one after another, feeding back the drafter's own hidden state and token (vLLM's "
        "eagle3 proposer without parallel_drafting: how an EAGLE-3 / K = 1 drafter is served)",
    )
    ev.add_argument("--max-rows", type=int, default=None, help="evaluate the first N rows only")
    ev.add_argument("--json", default=None, help="also write the result to this JSON file")
    ev.set_defaults(func=cmd_eval)

    sv = commands.add_parser("serve", help=cmd_serve.__doc__, description=cmd_serve.__doc__)
    sv.add_argument("--drafter", required=True, help="drafter checkpoint directory (e.g. OUT/final)")
    sv.add_argument("--target", default=None, help="target model (default: the verifier named in the drafter)")
    sv.add_argument("--num-speculative-tokens", type=int, default=None, help="K (default: the drafter's depths)")
    sv.add_argument("--peagle-verify", action="store_true", help="verify drafts with peagle's kernels (vLLM plugin)")
    sv.add_argument("--dry-run", action="store_true", help="print the command only")
    sv.add_argument("vllm_args", nargs=argparse.REMAINDER, help="further `vllm serve` arguments, after --")
    sv.set_defaults(func=cmd_serve)

    demo = commands.add_parser("demo", help=cmd_demo.__doc__, description=cmd_demo.__doc__)
    demo.add_argument("--quick", action="store_true", help="a smaller target and budgets (about 2-3 minutes)")
    demo.add_argument("--target", default=None, help="your target model directory (Hugging Face format)")
    demo.add_argument("--data", default=None, help="your .jsonl data (chat, text or token-id records); with --target")
    demo.add_argument("--workdir", default=None, help="cache and output directory (default ~/.cache/peagle)")
    demo.add_argument("--depths", type=int, default=None, help="P-EAGLE parallel depths K (default 5; --quick 4)")
    demo.add_argument("--fresh", action="store_true", help="ignore the cache and redo every stage")
    demo.add_argument("--no-serve", action="store_true", help="skip the vLLM measurement")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as err:
        # Missing files and mismatched configs: one clear line, not a traceback.
        parser.exit(2, f"peagle {args.command}: error: {err}\n")


if __name__ == "__main__":
    raise SystemExit(main())
