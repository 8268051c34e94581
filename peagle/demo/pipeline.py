"""`peagle demo`: the whole workflow - target, prepare-data -> extract -> train (P-EAGLE and an EAGLE-3 baseline with
the same budget) -> offline eval -> vLLM serving (with and without speculation) -> report.

Each stage writes its output directory under the work directory and is skipped when that output is complete, so a
rerun only redoes what is missing (``--fresh`` starts over).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from peagle.demo.target import QUICK_TARGET, TargetSpec, build_corpus, build_tokenizer, train_target

__all__ = ["DemoSpec", "run_demo"]


@dataclass
class DemoSpec:
    """Budgets of the drafter stages and the serving measurement."""

    depths: int = 5  # K of the P-EAGLE drafter (the baseline drafts K tokens autoregressively with a K = 1 drafter)
    drafter_layers: int = 1
    seq_len: int = 256  # T of a packed training row
    train_chars: int = 400_000  # text the drafters train on (a prefix of the training split)
    heldout_chars: int = 50_000
    steps: int = 600
    batch_size: int = 2
    lr: float = 2e-3
    max_anchors: int | None = 128
    eval_rows: int = 48
    prompts: int = 8
    prompt_tokens: int = 64
    max_tokens: int = 128
    target: TargetSpec = field(default_factory=TargetSpec)

    def drafter_key(self) -> str:
        fields = {
            k: v for k, v in asdict(self).items() if k not in ("target", "prompts", "prompt_tokens", "max_tokens")
        }
        return f"{zlib.crc32(json.dumps(fields, sort_keys=True).encode()):08x}"


QUICK = DemoSpec(
    depths=4,
    seq_len=128,
    train_chars=30_000,
    heldout_chars=20_000,
    steps=60,
    batch_size=2,
    lr=2e-3,
    max_anchors=64,
    eval_rows=16,
    prompts=4,
    prompt_tokens=32,
    max_tokens=48,
    target=QUICK_TARGET,
)


class Stages:
    """Prints one line per stage with its time, and keeps the timings for the report."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.cached: list[str] = []

    def run(self, name: str, done: bool, fn):
        if done:
            print(f"[peagle demo] {name}: cached", flush=True)
            self.cached.append(name)
            self.times[name] = 0.0
            return None
        print(f"[peagle demo] {name} ...", flush=True)
        start = time.perf_counter()
        result = fn()
        self.times[name] = time.perf_counter() - start
        print(f"[peagle demo] {name}: {self.times[name]:.1f} s", flush=True)
        return result


def _threads() -> int:
    """Intra-op threads: the free cores. On a small shared machine, a thread per core while other processes also run
    makes every op wait for a descheduled thread (measured 3x slower target steps here than one thread)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, cores - round(os.getloadavg()[0])))


def _complete(directory: Path, marker: str = "manifest.json") -> bool:
    path = directory / marker
    if not path.exists():
        return False
    if marker == "manifest.json":
        manifest = json.loads(path.read_text())
        return manifest.get("complete", True)
    return True


def _write_capped(source: Path, out: Path, max_chars: int, every: int | None = None, keep: int = 0) -> int:
    """Copies jsonl records until ``max_chars`` of text; with ``every``, only records whose index % every == keep
    (a deterministic record split of user data). Returns the records written."""
    written, used = 0, 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with source.open() as f, out.open("w") as g:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            if every is not None and (index % every == 0) != (keep == 0):
                continue
            record = json.loads(line)
            size = len(json.dumps(record))
            if "text" in record:
                record = {"text": record["text"][: max(200, max_chars - used)]}
                size = len(record["text"])
            g.write(json.dumps(record) + "\n")
            written += 1
            used += size
            if used >= max_chars:
                break
    return written


def _prompts(heldout_jsonl: Path, target_dir: Path, spec: DemoSpec) -> list[list[int]]:
    """Prompts from held-out records: the first ``prompt_tokens`` tokens of a text / the rendered chat's first user
    turn."""
    from peagle.train.data import load_tokenizer, tokenize_record

    tokenizer = load_tokenizer(target_dir)
    prompts = []
    with heldout_jsonl.open() as f:
        for line in f:
            if not line.strip():
                continue
            ids = tokenize_record(tokenizer, json.loads(line)).ids
            # Several prompts per long held-out document, taken at different offsets.
            for lo in range(0, len(ids) - spec.prompt_tokens, 4 * spec.prompt_tokens):
                prompts.append(ids[lo : lo + spec.prompt_tokens])
                if len(prompts) == spec.prompts:
                    return prompts
    if not prompts:
        raise ValueError(f"no held-out record in {heldout_jsonl} has {spec.prompt_tokens} tokens for a prompt")
    return prompts


def _serve(name: str, request: dict[str, Any], out: Path, log: Path) -> dict[str, Any]:
    """Runs one vLLM measurement in a fresh process (vLLM spawns workers and keeps global engine state)."""
    req_path = out.with_suffix(".request.json")
    req_path.write_text(json.dumps(request))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    with log.open("w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "peagle.demo.serve", str(req_path), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"vLLM run '{name}' failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    return json.loads(out.read_text())


def run_demo(
    workdir: str | os.PathLike | None = None,
    quick: bool = False,
    target: str | None = None,
    data: str | None = None,
    depths: int | None = None,
    fresh: bool = False,
    serve: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Runs the demo and returns the report (also written as report.md / report.json / PNG plots)."""
    from peagle.demo.report import write_report
    from peagle.model import from_pretrained
    from peagle.train.data import prepare_data
    from peagle.train.evaluate import evaluate
    from peagle.train.extract import extract
    from peagle.train.trainer import TrainArgs, train

    if (target is None) != (data is None):
        raise ValueError("--target and --data go together (a model and a .jsonl data set)")
    spec = DemoSpec(**{**asdict(QUICK), "target": QUICK.target}) if quick else DemoSpec()
    if depths is not None:
        if not 2 <= depths <= 16:
            raise ValueError(f"--depths must be in [2, 16], got {depths}")
        spec.depths = depths
    base = Path(workdir) if workdir else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "peagle"
    total_start = time.perf_counter()
    stages = Stages()
    torch.set_flush_denormal(True)
    threads = _threads()
    torch.set_num_threads(threads)
    print(
        f"[peagle demo] {threads} CPU thread(s) (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)", flush=True
    )

    # --- the target and its corpus -------------------------------------------------------------------------------
    if target is None:
        root = base / f"demo-{'quick' if quick else 'default'}-{spec.target.key()}"
        if fresh and root.exists():
            shutil.rmtree(root)
        corpus, target_dir = root / "corpus", root / "target"
        stages.run(
            "corpus (Python standard library)",
            _complete(corpus, "done.json"),
            lambda: build_corpus(corpus, spec.target, progress),
        )
        stages.run(
            "tokenizer (byte-level BPE)",
            _complete(root / "tokenizer", "done.json"),
            lambda: build_tokenizer(corpus, root / "tokenizer", spec.target),
        )
        stages.run(
            f"target (Llama, trained {spec.target.train_seconds:.0f} s)",
            _complete(target_dir, "done.json"),
            lambda: train_target(corpus, root / "tokenizer", target_dir, spec.target, progress),
        )
        corpus_info = json.loads((corpus / "done.json").read_text())
        trained = json.loads((target_dir / "done.json").read_text())
        target_info = {
            "kind": "embedded default",
            "path": str(target_dir),
            **{k: v for k, v in trained.items() if k != "spec"},
            "config": trained["spec"],
            "corpus": {k: v for k, v in corpus_info.items() if k != "heldout_files"},
        }
        heldout_source, train_source = corpus / "heldout.jsonl", corpus / "train.jsonl"
        split_kw: dict[str, Any] = {}
        heldout_kw: dict[str, Any] = {}
        # Aux layers early / middle / late of the 4-layer target (vLLM's default formula repeats a layer when L = 4).
        n = spec.target.num_layers
        layer_ids = [1, n // 2, n - 1]
    else:
        target_dir, data_path = Path(target), Path(data)
        if not target_dir.exists():
            raise FileNotFoundError(f"target model directory {target} does not exist")
        if not data_path.exists():
            raise FileNotFoundError(f"data file {data} does not exist")
        key = zlib.crc32(f"{target_dir.resolve()}|{data_path.resolve()}".encode())
        root = base / f"demo-user-{key:08x}"
        if fresh and root.exists():
            shutil.rmtree(root)
        target_info = {"kind": "user model", "path": str(target_dir.resolve()), "data": str(data_path.resolve())}
        heldout_source = train_source = data_path
        # Every 10th record is held out.
        split_kw = {"every": 10, "keep": 1}
        heldout_kw = {"every": 10, "keep": 0}
        layer_ids = None

    drafter_root = root / f"drafters-{spec.drafter_key()}"
    texts = drafter_root / "text"
    if not (texts / "heldout.jsonl").exists():
        _write_capped(train_source, texts / "train.jsonl.tmp", spec.train_chars, **split_kw)
        _write_capped(heldout_source, texts / "heldout.jsonl.tmp", spec.heldout_chars, **heldout_kw)
        os.replace(texts / "train.jsonl.tmp", texts / "train.jsonl")
        os.replace(texts / "heldout.jsonl.tmp", texts / "heldout.jsonl")

    # --- 1. prepare-data, 2. extract --------------------------------------------------------------------------------
    for split in ("train", "heldout"):
        prepared, states = drafter_root / f"data-{split}", drafter_root / f"states-{split}"
        stages.run(
            f"prepare-data ({split})",
            _complete(prepared),
            lambda split=split, prepared=prepared: prepare_data(
                str(texts / f"{split}.jsonl"), target_dir, prepared, spec.seq_len, 256, None, progress
            ),
        )
        stages.run(
            f"extract ({split})",
            _complete(states),
            lambda prepared=prepared, states=states: extract(
                prepared, target_dir, states, layer_ids, "bfloat16", 64, "cpu", progress
            ),
        )

    # --- 3. train P-EAGLE and the EAGLE-3 baseline with the same budget ---------------------------------------------
    runs = {"P-EAGLE": (drafter_root / f"peagle-k{spec.depths}", spec.depths), "EAGLE-3": (drafter_root / "eagle3", 1)}
    train_seconds = {}
    for name, (out, k) in runs.items():
        args = TrainArgs(
            data=str(drafter_root / "states-train"),
            out=str(out),
            num_layers=spec.drafter_layers,
            num_depths=k,
            steps=spec.steps,
            batch_size=spec.batch_size,
            lr=spec.lr,
            warmup_steps=max(1, spec.steps // 20),
            max_anchors=spec.max_anchors,
            seed=0,
            progress=progress,
        )
        label = f"train {name} (K = {k}, {spec.steps} steps x {spec.batch_size} rows)"
        stages.run(label, _complete(out / "final", "config.json"), lambda args=args: train(args))
        train_seconds[name] = stages.times[label]

    # --- 4. offline eval on the held-out split ----------------------------------------------------------------------
    offline = {}
    for name, (out, k) in runs.items():
        path = drafter_root / f"eval-{'peagle' if k > 1 else 'eagle3'}.json"

        def run_eval(out=out, path=path):
            from peagle.model.checkpoint import atomic_write_json
            from peagle.train.dataset import ExtractedData

            model = from_pretrained(out / "final", dtype=torch.float32)
            rows = list(range(min(spec.eval_rows, len(ExtractedData(drafter_root / "states-heldout")))))
            atomic_write_json(path, evaluate(model, str(drafter_root / "states-heldout"), rows))

        stages.run(f"eval {name} (held-out)", path.exists(), run_eval)
        offline[name] = json.loads(path.read_text())

    # --- serving with vLLM --------------------------------------------------------------------------------------------
    served: dict[str, Any] = {}
    if serve:
        prompts = _prompts(texts / "heldout.jsonl", target_dir, spec)
        common = {
            "target": str(target_dir.resolve()),
            "prompts": prompts,
            "max_tokens": spec.max_tokens,
            "max_model_len": spec.prompt_tokens + spec.max_tokens + 2 * spec.depths + 16,
        }
        configs = {
            "no speculation": None,
            "P-EAGLE": {
                "method": "eagle3",
                "parallel_drafting": True,
                "model": str((runs["P-EAGLE"][0] / "final").resolve()),
                "num_speculative_tokens": spec.depths,
            },
            "EAGLE-3": {
                "method": "eagle3",
                "model": str((runs["EAGLE-3"][0] / "final").resolve()),
                "num_speculative_tokens": spec.depths,
            },
        }
        serve_dir = drafter_root / f"vllm-p{spec.prompts}x{spec.prompt_tokens}-g{spec.max_tokens}"
        serve_dir.mkdir(parents=True, exist_ok=True)
        for name, config in configs.items():
            slug = name.lower().replace(" ", "-")
            out = serve_dir / f"{slug}.json"
            stages.run(
                f"vLLM-CPU serve: {name}",
                out.exists(),
                lambda name=name, config=config, out=out, slug=slug: _serve(
                    name, {**common, "speculative_config": config}, out, serve_dir / f"{slug}.log"
                ),
            )
            served[name] = json.loads(out.read_text())

    report_dir = root / "report"
    report = write_report(
        report_dir,
        spec=spec,
        target_info=target_info,
        offline=offline,
        served=served,
        stages=stages.times,
        cached=stages.cached,
        total_seconds=time.perf_counter() - total_start,
        train_seconds=train_seconds,
    )
    print(f"[peagle demo] report: {report_dir / 'report.md'}", flush=True)
    return report
