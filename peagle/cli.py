"""`peagle <command>`: the command-line entry point."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import types
import typing
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


def _example_row(gen: torch.Generator, length: int, documents: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_mask [T] bool, document_ids [T] int64) of a packed row as prepare-data writes one: about ``documents``
    documents of random lengths, a padding tail (-1) of up to 10%, and trained labels in 32-position spans (7 in 10
    trained), as assistant turns are."""
    used = length - int(torch.randint(0, length // 10 + 1, (), generator=gen))
    starts = torch.zeros(used, dtype=torch.long)
    starts[torch.randint(1, used, (documents - 1,), generator=gen)] = 1  # coinciding starts merge documents
    document_ids = torch.full((length,), -1, dtype=torch.long)
    document_ids[:used] = starts.cumsum(0)
    spans = torch.rand(length // 32 + 1, generator=gen) < 0.7
    loss_mask = spans.repeat_interleave(32)[:length] & (document_ids >= 0)
    return loss_mask, document_ids


def cmd_example(args: argparse.Namespace) -> int:
    """COD sampling + fused gather of one packed training row on the CPU, checked against the PyTorch reference."""
    from peagle.ops import cod_gather, cod_gather_reference, cod_sample, cod_sample_reference

    if args.length < 2:
        raise ValueError(f"--length must be at least 2, got {args.length}")
    gen = torch.Generator().manual_seed(args.seed)
    loss_mask, document_ids = _example_row(gen, args.length)
    input_ids = torch.randint(0, args.vocab, (args.length,), generator=gen)
    hidden = torch.randn(args.length, args.width, generator=gen).to(torch.bfloat16)
    mask_hidden = torch.randn(args.width, generator=gen).to(torch.bfloat16)
    sample_args = (loss_mask, document_ids, args.depths, args.ratio, args.ratio_min, args.max_anchors)

    anchors, depths = cod_sample(*sample_args, args.seed)
    inputs = cod_gather(input_ids, hidden, mask_hidden, anchors, depths, args.vocab)
    ref_anchors, ref_depths = cod_sample_reference(*sample_args, args.seed)
    ref = cod_gather_reference(input_ids, hidden, mask_hidden, ref_anchors, ref_depths, args.vocab)
    same = torch.equal(anchors, ref_anchors) and all(torch.equal(a, b) for a, b in zip(inputs, ref, strict=True))

    documents = int(document_ids.max()) + 1
    print(f"packed row: T = {args.length} positions, {documents} documents, {int(loss_mask.sum())} trained labels")
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


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One option per field of the dataclass ``cls``, in field order: ``--field-name`` (or the metadata's ``flag``),
    type, choices (a Literal), default and help (the metadata's ``help`` plus the default) all from the field. A
    field without a default is a required option; a bool is a switch that flips its default; a ``list[float]``
    (``list[int]``) reads comma-separated numbers."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        kind = _without_none(hints[f.name])
        help_text = meta.get("help", "")
        if f.default is not dataclasses.MISSING and f.default is not None and kind is not bool:
            help_text += f" (default {f.default})"
        options: dict[str, typing.Any] = {
            "dest": f.name,
            "help": argparse.SUPPRESS if meta.get("hidden") else help_text,
        }
        if f.default is dataclasses.MISSING:
            options["required"] = True
        else:
            options["default"] = f.default
        metavar = flag.removeprefix("--").upper().replace("-", "_")
        if kind is bool:
            options["action"] = "store_false" if f.default else "store_true"
        elif typing.get_origin(kind) is typing.Literal:
            options["choices"] = typing.get_args(kind)
        elif typing.get_origin(kind) is list and typing.get_args(kind) == (float,):
            options |= {"type": _floats, "metavar": metavar}
        elif typing.get_origin(kind) is list and typing.get_args(kind) == (int,):
            options |= {"type": lambda text, flag=flag: _ints(text, flag), "metavar": metavar}
        elif kind in (int, float, str):
            options |= {"type": kind, "metavar": metavar}
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no command-line form for type {kind}")
        parser.add_argument(flag, **options)


def _without_none(hint: typing.Any) -> typing.Any:
    """``X`` for ``X | None``, else the hint itself."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def cmd_prepare_data(args: argparse.Namespace) -> int:
    """Step 1: tokenize jsonl chats/text (or hf:NAME[:SPLIT]) with loss masks and pack them into T-length rows."""
    from peagle.train.data import prepare_data

    manifest = prepare_data(
        args.input,
        args.tokenizer,
        args.out,
        args.seq_len,
        args.rows_per_shard,
        args.max_records,
        not args.quiet,
        args.overwrite,
    )
    if manifest["skipped_records"]:
        print(
            f"peagle prepare-data: skipped {manifest['skipped_records']} records with nothing to train (a chat "
            f"without an assistant turn, or an empty completion), first at {manifest['first_skipped']}",
            file=sys.stderr,
        )
    print(
        f"prepared {manifest['num_rows']} rows of T = {manifest['seq_len']} ({manifest['trained_tokens']} trained "
        f"tokens) in {args.out}"
    )
    return 0


# Per backend `peagle extract --backend` offers: the module whose import registers it, and the extra it needs.
EXTRACTION_BACKENDS = {"hf": ("peagle.train.extract", "train"), "vllm": ("peagle.vllm.extract", "vllm")}


def cmd_extract(args: argparse.Namespace) -> int:
    """Step 2: run the target (transformers or vLLM) over prepared rows; store aux-layer hidden states and outputs."""
    import importlib

    from peagle.train.extract import extract

    module, extra = EXTRACTION_BACKENDS[args.backend]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ValueError(
            f"--backend {args.backend} needs {err.name}: install peagle's {extra} extra (pip install 'peagle[{extra}]')"
        ) from err

    manifest = extract(
        args.data,
        args.target,
        args.out,
        _ints(args.layers, "--layers") if args.layers else None,
        args.dtype,
        args.rows_per_shard,
        args.device,
        not args.quiet,
        args.backend,
        args.overwrite,
    )
    print(f"extracted {manifest['num_rows']} rows (aux layers {manifest['aux_layer_ids']}) into {args.out}")
    return 0


# Per backend of `peagle regenerate --backend` and `peagle train --stream --producer-backend`: the modules whose import
# registers it (generation; extraction for a producer), and the extra it needs.
GENERATION_BACKENDS = {
    "hf": (("peagle.train.regenerate", "peagle.train.extract"), "train"),
    "vllm": (("peagle.vllm.regenerate", "peagle.vllm.extract"), "vllm"),
}


def _register(backend: str) -> tuple[str, ...]:
    """Imports the modules that register ``backend`` (a clear error when its extra is missing); returns them."""
    import importlib

    modules, extra = GENERATION_BACKENDS[backend]
    try:
        for module in modules:
            importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ValueError(
            f"backend {backend} needs {err.name}: install peagle's {extra} extra (pip install 'peagle[{extra}]')"
        ) from err
    return modules


def cmd_regenerate(args: argparse.Namespace) -> int:
    """The target answers the dataset's prompts itself (chats turn by turn, token-id and text prompts once), greedy
    or sampled: a .jsonl that prepare-data reads as it is (self-distillation data)."""
    from peagle.train.regenerate import Sampling, regenerate

    _register(args.backend)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed, args.ignore_eos)
    counts = regenerate(
        args.input,
        args.target,
        args.out,
        tokenizer=args.tokenizer,
        sampling=sampling,
        backend=args.backend,
        batch_size=args.batch_size,
        max_records=args.max_records,
        max_len=args.max_len,
        device=args.device,
        progress=not args.quiet,
        overwrite=args.overwrite,
    )
    print(f"regenerated {counts['records']} records ({counts['answers']} answers, {counts['answer_tokens']} tokens) "
          f"into {args.out}")  # fmt: skip
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Step 3: train a P-EAGLE drafter (K = --depths; K = 1 trains an EAGLE-3 drafter) on extracted data, or with
    --stream on rows that producer processes make from prompts as it trains (no files between them)."""
    from peagle.train.stream import ProducerFailed, StreamArgs
    from peagle.train.trainer import TrainArgs, train

    train_args = TrainArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainArgs)})
    stream = register = None
    if train_args.stream:
        stream = StreamArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(StreamArgs)})
        register = _register(stream.producer_backend)
    try:
        records = train(train_args, stream, register or ())
    except ProducerFailed as err:
        print(f"peagle train: error: {err}", file=sys.stderr)
        return 1
    if records and int(os.environ.get("RANK", "0")) == 0:
        last = records[-1]
        print(f"step {last['step']}: loss {last['loss']:.4f}, depth-0 accuracy {last['acc_0']:.3f}")
        print(f"checkpoint: {args.out}/final")
    if args.plot and records and int(os.environ.get("RANK", "0")) == 0:
        from peagle.demo.training_plot import plot_training

        print(f"curves: {plot_training(args.out)}")
    return 0


def cmd_plot_train(args: argparse.Namespace) -> int:
    """Draw a training run's loss, per-depth accuracy and held-out acceptance length against steps to a PNG."""
    from peagle.demo.training_plot import plot_training

    print(plot_training(args.run, args.png))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Step 4: offline acceptance (Pos 1..K conditional acceptance, acceptance length with its 95% interval) and
    per-depth accuracy, greedy or sampled (--temperature, --top-p: the expected acceptance of sampled drafts)."""
    import json

    from peagle.demo.workload import check_sampling
    from peagle.model import from_pretrained
    from peagle.train.evaluate import evaluate, format_table

    for flag, value in (("--max-rows", args.max_rows), ("--depths", args.depths)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1 (or left out), got {value}")
    check_sampling([args.temperature], args.top_p)
    model = from_pretrained(args.checkpoint, dtype=torch.float32)
    rows = list(range(args.max_rows)) if args.max_rows else None
    if rows is not None:
        from peagle.train.dataset import ExtractedData

        rows = rows[: len(ExtractedData(args.data))]
    result = evaluate(
        model, args.data, rows, args.depths, args.autoregressive, tree_budget=args.tree_budget,
        tree_topk=args.tree_topk, temperature=args.temperature, top_p=args.top_p,
    )  # fmt: skip
    print(format_table(result))
    if args.json:
        from peagle.io import atomic_write_json

        atomic_write_json(args.json, result)
    else:
        print(json.dumps(result))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Print the `vllm serve` command that serves a drafter beside its target, then run it (unless --dry-run)."""
    import subprocess

    from peagle.vllm.serve import format_command, serve_command

    argv = serve_command(args.drafter, args.target, args.num_speculative_tokens, args.vllm_args, args.harness)
    print(format_command(argv, args.peagle_verify), flush=True)
    if args.dry_run:
        return 0
    env = {**os.environ, **({"PEAGLE_VLLM_VERIFY": "1"} if args.peagle_verify else {})}
    return subprocess.call(argv, env=env)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on an embedded default (or --target/--data): target -> prepare-data -> extract -> train P-EAGLE
    and an EAGLE-3 baseline -> eval -> serve with vLLM -> the decoding engine -> report (markdown, JSON, plots), each
    figure per prompt category (code, prose, math) at temperature 0 and 1."""
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
        concurrency=_ints(args.concurrency, "--concurrency") if args.concurrency else None,
        harness=args.harness,
        temperatures=args.temperature,
        top_p=args.top_p,
        categories=args.categories,
    )
    return 0 if report["lossless"] in (True, None) else 1


def cmd_bench_decode(args: argparse.Namespace) -> int:
    """The decoding engine on the same prompts, per category, temperature and batch size: target alone, P-EAGLE chain
    and trees at several node budgets, the harness, EAGLE-3 chain and tree (--eagle3), vLLM-CPU for reference
    (greedy); prints the tables and the goals, writes bench.json / bench.md / decode.png under --out."""
    from peagle.demo.bench_decode import bench_decode
    from peagle.demo.tables import format_report

    report = bench_decode(
        args.target,
        args.drafter,
        args.eagle3,
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        budgets=_ints(args.budgets, "--budgets"),
        batch_size=_ints(args.batch_size, "--batch-size"),
        out=args.out,
        vllm=not args.no_vllm,
        repeats=args.repeats,
        progress=not args.quiet,
        temperatures=args.temperature,
        top_p=1.0 if args.top_p is None else args.top_p,
        categories=args.categories,
        acceptance_requests=args.acceptance_requests,
        lossless_draws=args.lossless_draws,
    )
    print(format_report(report))
    print(f"written: {args.out}/bench.json, bench.md, decode.png")
    return 0 if report["lossless"] else 1


def _add_sampling_options(parser: argparse.ArgumentParser, default: str = "0,1") -> None:
    """--temperature (a comma-separated list), --top-p and --categories, shared by the commands that measure."""
    parser.add_argument(
        "--temperature",
        default=default,
        help=f"temperatures to measure at, comma-separated (0 = greedy; default {default})",
    )
    parser.add_argument("--top-p", type=float, default=None, help="the target's top-p when sampling (default 1: off)")
    parser.add_argument(
        "--categories",
        default=None,
        help="prompt categories to measure, comma-separated (default: all; the embedded workload's are code, prose "
        "and math; a prompts file names them in each record's 'category')",
    )


def add_bench_parser(commands) -> None:
    """`peagle bench decode ...`."""
    bench = commands.add_parser("bench", help="benchmarks (decode: the speculative decoding engine)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    dec = kinds.add_parser("decode", help=cmd_bench_decode.__doc__, description=cmd_bench_decode.__doc__)
    dec.add_argument("--target", required=True, help="the target model directory (Hugging Face format)")
    dec.add_argument("--drafter", required=True, help="P-EAGLE drafter checkpoint directory (e.g. OUT/final)")
    dec.add_argument("--eagle3", default=None, help="EAGLE-3 (K = 1) drafter checkpoint directory: adds its rows")
    dec.add_argument(
        "--prompts",
        default=None,
        help="a .jsonl (token-id lists or records with prompt_ids and optionally category) or .json file of prompts "
        "(default: seeded random token ids, 32 per prompt)",
    )
    dec.add_argument("--num-prompts", type=int, default=8, help="prompts per category (the first N; default 8)")
    dec.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    dec.add_argument("--budgets", default="8,16,32", help="P-EAGLE tree node budgets, root included (default 8,16,32)")
    dec.add_argument("--batch-size", default="1", help="requests decoded at once, comma-separated sizes (default 1)")
    dec.add_argument("--repeats", type=int, default=1, help="timed passes per configuration; the fastest counts")
    _add_sampling_options(dec)
    dec.add_argument(
        "--acceptance-requests",
        type=int,
        default=64,
        help="sampled groups: requests per category whose rounds measure the acceptance (untimed; default 64)",
    )
    dec.add_argument(
        "--lossless-draws",
        type=int,
        default=200,
        help="sampled groups: draws per prompt of the two-sample lossless test (default 200; 0: off)",
    )
    dec.add_argument("--out", default="peagle-bench-decode", help="output directory (default ./peagle-bench-decode)")
    dec.add_argument("--no-vllm", action="store_true", help="skip the vLLM-CPU reference rows")
    dec.add_argument("--quiet", action="store_true", help="no progress bar")
    dec.set_defaults(func=cmd_bench_decode)


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile the target's verify time and the drafter's time on this machine: a cost table for the harness, of
    peagle's engine (`SpeculativeDecoder(mode="harness", cost_table=...)`) or, with --backend vllm, of vLLM serving the
    pair (its speculative config's "peagle_harness", `peagle serve --harness`)."""
    engine_only = {"--nodes": args.nodes, "--widths": args.widths, "--depths": args.depths, "--device": args.device}
    vllm_only = {"--num-speculative-tokens": args.num_speculative_tokens, "--steps": args.steps,
                 "--llm-args": args.llm_args}  # fmt: skip
    wrong = engine_only if args.backend == "vllm" else vllm_only
    given = [flag for flag, value in wrong.items() if value is not None]
    if given:
        other = "peagle" if args.backend == "vllm" else "vllm"
        raise ValueError(f"{', '.join(given)}: for --backend {other}, not --backend {args.backend}")
    if args.backend == "vllm":
        from peagle.vllm.profile import profile_vllm

        try:
            llm_args = json.loads(args.llm_args or "{}")
        except json.JSONDecodeError as error:
            raise ValueError(f"--llm-args must be a JSON object of vllm.LLM arguments: {error}") from None
        if not isinstance(llm_args, dict):
            raise ValueError(f"--llm-args must be a JSON object of vllm.LLM arguments, got {args.llm_args}")
        table = profile_vllm(
            args.target,
            args.drafter,
            num_speculative_tokens=args.num_speculative_tokens,
            batch_sizes=_ints(args.batch_sizes or "1,2,4,8,16,32", "--batch-sizes"),
            contexts=_ints(args.contexts, "--contexts"),
            repeats=args.repeats,
            steps=12 if args.steps is None else args.steps,
            llm_args=llm_args,
            progress=not args.quiet,
        )
    else:
        from peagle.decode.harness.profile import profile_costs

        table = profile_costs(
            args.target,
            args.drafter,
            batch_sizes=_ints(args.batch_sizes or "1,4,16", "--batch-sizes"),
            contexts=_ints(args.contexts, "--contexts"),
            verify_nodes=_ints(args.nodes or "1,2,4,8,16,32", "--nodes"),
            draft_widths=_ints(args.widths or "1,2,4", "--widths"),
            depths=6 if args.depths is None else args.depths,
            repeats=args.repeats,
            device=args.device,
            progress=not args.quiet,
        )
    path = table.save(args.out)
    print(f"cost table (version {table.version}, {table.backend}) written: {path}")
    return 0


def add_profile_parser(commands) -> None:
    """`peagle profile`: the harness's cost table."""
    prof = commands.add_parser("profile", help=cmd_profile.__doc__, description=cmd_profile.__doc__)
    prof.add_argument("--target", required=True, help="the target model directory (Hugging Face format)")
    prof.add_argument("--drafter", required=True, help="the drafter checkpoint directory")
    prof.add_argument("--out", default="peagle-costs.json", help="the cost table to write (default peagle-costs.json)")
    prof.add_argument(
        "--backend",
        choices=("peagle", "vllm"),
        default="peagle",
        help="what is timed: peagle's engine (default) or vLLM serving the pair (its whole step, as it serves)",
    )
    prof.add_argument(
        "--batch-sizes", default=None, help="batch-size buckets (default 1,4,16; --backend vllm: 1,2,4,8,16,32)"
    )
    prof.add_argument("--contexts", default="64", help="context interval starts in tokens (default 64)")
    prof.add_argument("--repeats", type=int, default=5, help="timed calls per point; the fastest counts (default 5)")
    prof.add_argument("--nodes", default=None, help="peagle: verified nodes per request (default 1,2,4,8,16,32)")
    prof.add_argument("--widths", default=None, help="peagle: drafted nodes per depth (default 1,2,4)")
    prof.add_argument("--depths", type=int, default=None, help="peagle: autoregressive draft depths (default 6)")
    prof.add_argument("--device", default=None, help="peagle: torch device (default: the target's)")
    prof.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="vllm: the served K (default: the drafter's depths)"
    )
    prof.add_argument("--steps", type=int, default=None, help="vllm: decode steps timed per call (default 12)")
    prof.add_argument(
        "--llm-args", default=None, help="vllm: JSON of further vllm.LLM arguments, as served (dtype, parallelism, ...)"
    )
    prof.add_argument("--quiet", action="store_true", help="no progress bar")
    prof.set_defaults(func=cmd_profile)


def add_example_parser(commands) -> None:
    """`peagle example`: COD + gather on a random packed row."""
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


def add_prepare_data_parser(commands) -> None:
    """`peagle prepare-data`: step 1."""
    prep = commands.add_parser("prepare-data", help=cmd_prepare_data.__doc__, description=cmd_prepare_data.__doc__)
    prep.add_argument(
        "--input",
        required=True,
        help="a .jsonl file, one record a line: {'messages': [{'role', 'content'}, ...]} or ShareGPT "
        "{'conversations': [{'from', 'value'}, ...]} (assistant turns trained), {'text': ...} (every token trained), "
        "or {'prompt_ids': [...], 'completion_ids': [...]} (token ids; the completion trained, prompt_ids optional); "
        "or hf:NAME[:SPLIT] (needs the datasets package)",
    )
    prep.add_argument("--tokenizer", required=True, help="the target's tokenizer directory (chat template for chats)")
    prep.add_argument(
        "--out",
        required=True,
        help="output directory: new or empty (built beside it and published whole when complete)",
    )
    prep.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (once the new data is done)")
    prep.add_argument("--seq-len", type=int, default=2048, help="positions T of a packed row (default 2048)")
    prep.add_argument("--rows-per-shard", type=int, default=256, help="rows per output shard (default 256)")
    prep.add_argument("--max-records", type=int, default=None, help="stop after this many records")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(func=cmd_prepare_data)


def add_extract_parser(commands) -> None:
    """`peagle extract`: step 2."""
    ext = commands.add_parser("extract", help=cmd_extract.__doc__, description=cmd_extract.__doc__)
    ext.add_argument("--data", required=True, help="a prepare-data output directory")
    ext.add_argument("--target", required=True, help="the target model directory (Hugging Face format)")
    ext.add_argument(
        "--out",
        required=True,
        help="output directory: new or empty; an interrupted extraction of the same data and settings there resumes",
    )
    ext.add_argument("--overwrite", action="store_true", help="clear a non-empty --out that holds anything else")
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
        choices=list(EXTRACTION_BACKENDS),
        help="hf: transformers in this process; vllm: vLLM's hidden-state extraction (default hf)",
    )
    ext.add_argument("--quiet", action="store_true", help="no progress bar")
    ext.set_defaults(func=cmd_extract)


def add_train_parser(commands) -> None:
    """`peagle train`: step 3 (options generated from TrainArgs)."""
    tr = commands.add_parser(
        "train",
        help=cmd_train.__doc__,
        description=cmd_train.__doc__ + " Run it under "
        "torchrun for data parallel training (gloo on CPU, NCCL on GPUs).",
    )
    from peagle.train.stream import StreamArgs
    from peagle.train.trainer import TrainArgs

    add_dataclass_options(tr, TrainArgs)
    add_dataclass_options(tr.add_argument_group("streaming (--stream)"), StreamArgs)
    tr.set_defaults(func=cmd_train)


def add_regenerate_parser(commands) -> None:
    """`peagle regenerate`: the target's own answers to a dataset's prompts."""
    rg = commands.add_parser("regenerate", help=cmd_regenerate.__doc__, description=cmd_regenerate.__doc__)
    rg.add_argument(
        "--input",
        required=True,
        help="a .jsonl file (or hf:NAME[:SPLIT]): chats {'messages': [...]} / ShareGPT {'conversations': [...]} "
        "(every assistant turn answered anew, turn by turn; a final user turn gets an answer), {'prompt_ids': [...]} "
        "or {'prompt': text}",
    )
    rg.add_argument("--target", required=True, help="the target model directory (Hugging Face format)")
    rg.add_argument("--out", required=True, help="the .jsonl to write (whole, when complete)")
    rg.add_argument("--tokenizer", default=None, help="the target's tokenizer directory (default: --target)")
    rg.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    rg.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer (default 256)")
    rg.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default 0)")
    rg.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    rg.add_argument("--seed", type=int, default=0, help="seed of the sampled answers (default 0)")
    rg.add_argument("--ignore-eos", action="store_true", help="answers do not end at the end-of-sequence token")
    rg.add_argument(
        "--backend",
        default="hf",
        choices=list(GENERATION_BACKENDS),
        help="hf: transformers in this process; vllm: vLLM, every prompt of a batch at once (default hf)",
    )
    rg.add_argument("--batch-size", type=int, default=64, help="records answered together (default 64)")
    rg.add_argument("--max-records", type=int, default=None, help="answer the first N records only")
    rg.add_argument("--max-len", type=int, default=4096, help="vllm: the longest prompt + answer (default 4096)")
    rg.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="target device (hf)")
    rg.add_argument("--quiet", action="store_true", help="no progress bar")
    rg.set_defaults(func=cmd_regenerate)


def add_plot_train_parser(commands) -> None:
    """`peagle plot-train RUN`: the curves of an existing (or running) training run."""
    pt = commands.add_parser("plot-train", help=cmd_plot_train.__doc__, description=cmd_plot_train.__doc__)
    pt.add_argument("run", help="a `peagle train` output directory (its metrics.jsonl)")
    pt.add_argument("--png", default=None, help="output image (default RUN/training.png)")
    pt.set_defaults(func=cmd_plot_train)


def add_eval_parser(commands) -> None:
    """`peagle eval`: step 4."""
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
    ev.add_argument("--max-rows", type=int, default=None, help="evaluate the first N rows only (N >= 1)")
    ev.add_argument("--tree-budget", type=int, default=None, help="also score P-EAGLE parallel trees of N nodes")
    ev.add_argument(
        "--tree-topk",
        type=lambda text: _ints(text, "--tree-topk"),
        default=None,
        help="the trees' children per node: K, or K,K,.. one per depth",
    )
    ev.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy drafts and verification (default); above 0: drafts sampled from the drafter at this "
        "temperature and verified by rejection sampling against the target's (expected acceptance)",
    )
    ev.add_argument("--top-p", type=float, default=1.0, help="the target's top-p when sampling (default 1: off)")
    ev.add_argument("--json", default=None, help="also write the result to this JSON file")
    ev.set_defaults(func=cmd_eval)


def add_serve_parser(commands) -> None:
    """`peagle serve`: the vllm serve command."""
    sv = commands.add_parser("serve", help=cmd_serve.__doc__, description=cmd_serve.__doc__)
    sv.add_argument("--drafter", required=True, help="drafter checkpoint directory (e.g. OUT/final)")
    sv.add_argument("--target", default=None, help="target model (default: the verifier named in the drafter)")
    sv.add_argument("--num-speculative-tokens", type=int, default=None, help="K (default: the drafter's depths)")
    sv.add_argument("--peagle-verify", action="store_true", help="verify drafts with peagle's kernels (vLLM plugin)")
    sv.add_argument(
        "--harness",
        default=None,
        metavar="COSTS.json",
        help="choose each request's draft length every step from this cost table (`peagle profile --backend vllm`)",
    )
    sv.add_argument("--dry-run", action="store_true", help="print the command only")
    sv.add_argument("vllm_args", nargs=argparse.REMAINDER, help="further `vllm serve` arguments, after --")
    sv.set_defaults(func=cmd_serve)


def add_demo_parser(commands) -> None:
    """`peagle demo`: the main job."""
    demo = commands.add_parser("demo", help=cmd_demo.__doc__, description=cmd_demo.__doc__)
    demo.add_argument("--quick", action="store_true", help="a smaller target and budgets (a few minutes)")
    demo.add_argument("--target", default=None, help="your target model directory (Hugging Face format)")
    demo.add_argument("--data", default=None, help="your .jsonl data (chat, text or token-id records); with --target")
    demo.add_argument("--workdir", default=None, help="cache and output directory (default ~/.cache/peagle)")
    demo.add_argument("--depths", type=int, default=None, help="P-EAGLE parallel depths K (default 5; --quick 4)")
    demo.add_argument("--fresh", action="store_true", help="ignore the cache and redo every stage")
    demo.add_argument("--no-serve", action="store_true", help="skip the vLLM measurement")
    demo.add_argument(
        "--concurrency", default=None, help="vLLM stage: requests decoded at once, one level or several (default 1)"
    )
    demo.add_argument(
        "--harness",
        action="store_true",
        help="vLLM stage: also P-EAGLE with the harness choosing draft lengths per step (profiles vLLM first)",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_sampling_options(demo)
    demo.set_defaults(func=cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peagle", description="P-EAGLE parallel-drafting speculative decoding toolkit"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (
        add_example_parser,
        add_regenerate_parser,
        add_prepare_data_parser,
        add_extract_parser,
        add_train_parser,
        add_plot_train_parser,
        add_eval_parser,
        add_serve_parser,
        add_demo_parser,
        add_bench_parser,
        add_profile_parser,
    ):
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, ValueError) as err:
        # Bad input, missing files and mismatched configs: one clear line, not a traceback.
        parser.exit(2, f"peagle {args.command}: error: {err}\n")


if __name__ == "__main__":
    raise SystemExit(main())
