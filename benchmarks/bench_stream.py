"""Streaming training vs the four file-based steps (issue 39): wall time from prompts to a trained drafter, and the
peak disk use of each, on the demo's target and prompts.

    python benchmarks/bench_stream.py [--quick] [--workdir DIR] [--smoke]

Files: ``peagle regenerate`` -> ``prepare-data`` -> ``extract`` -> ``train``, four processes one after another.
Stream: ``peagle train --stream --producers 1``, the producer and the trainer side by side. Every process runs one
thread (OMP_NUM_THREADS=1), so on a 2-core machine the stream's two processes each have a core while the file steps
take turns on one. Both train the same rows (one pass over the answered prompts, ``--row-order stored``, steps = rows
/ batch) with the same settings, so both make the same drafter (reported: equal weights). Wall time counts every
process from start to exit (Python and library start-up included, as a user waits for it). Disk: the bytes under each
run's directory, sampled every 0.2 s (files: the answers, the prepared rows, the hidden states, the checkpoints;
stream: the checkpoints), and the bytes of hidden states each wrote.

Goal: stream wall time <= 0.8 x the file steps' with one producer, no hidden state on disk. The demo's target (its
default, or ``--quick``'s) is built and cached by the demo's stages under --workdir. Timings are valid only on an
otherwise idle machine: the load average at start and end is in the output. Writes
WORKDIR/bench-stream-*/results.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=str(Path.home() / ".cache" / "peagle"), help="demo cache and outputs")
    p.add_argument("--quick", action="store_true", help="the quick demo's target and data (else the default demo's)")
    p.add_argument("--smoke", action="store_true", help="a few prompts and steps: checks the benchmark runs")
    p.add_argument("--batch", type=int, default=2, help="rows per step (default: the demo's, 2)")
    return p.parse_args(argv)


class DiskPeak:
    """Bytes under a directory, sampled in a thread every ``every`` seconds; ``peak`` is the largest."""

    def __init__(self, directory: Path, every: float = 0.2) -> None:
        self.directory, self.every, self.peak = directory, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def size(self) -> int:
        total = 0
        for path in self.directory.rglob("*"):
            try:
                total += path.stat().st_size if path.is_file() else 0
            except FileNotFoundError:  # renamed or removed while we looked (atomic writes)
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.size())
            time.sleep(self.every)

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.size())


def hidden_state_bytes(directory: Path) -> int:
    """Bytes of the safetensors files under ``directory`` that hold hidden states (extract's shards)."""
    from safetensors import safe_open

    total = 0
    for path in directory.rglob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            if {"aux_hidden", "final_hidden"} & set(f.keys()):
                total += path.stat().st_size
    return total


def peagle(args: list[str], log: Path) -> float:
    """Runs `peagle ARGS` in a fresh one-thread process; its wall time in seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    with log.open("w") as f:
        subprocess.run([sys.executable, "-m", "peagle.cli", *args], env=env, stdout=f, stderr=subprocess.STDOUT,
                       check=True)  # fmt: skip
    return time.perf_counter() - start


def demo_inputs(opts: argparse.Namespace) -> tuple[Any, Any, Path]:
    """The demo's spec and run (target built and cached by its stages) and the bench directory."""
    from peagle.demo.pipeline import QUICK, DemoSpec, Stages, stage_embedded_target

    spec = DemoSpec(**{**asdict(QUICK), "target": QUICK.target}) if opts.quick or opts.smoke else DemoSpec()
    if opts.smoke:
        spec.train_prompts, spec.completion_tokens, spec.train_chars = 8, 24, 20_000
    run = stage_embedded_target(spec, Path(opts.workdir), opts.quick or opts.smoke, False, Stages(), progress=False)
    name = "smoke" if opts.smoke else "quick" if opts.quick else "default"
    return spec, run, run.root / f"bench-stream-{name}"


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    from peagle.demo.distill import write_prompts
    from peagle.demo.pipeline import category_prompts
    from peagle.train.data import load_tokenizer, read_manifest

    spec, run, out = demo_inputs(opts)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    by_category = category_prompts(spec, load_tokenizer(run.target_dir), run.sources)
    prompts = [p for (split, _), part in by_category.items() if split == "train" for p in part]
    write_prompts(out / "prompts.jsonl", prompts)
    layers = ",".join(map(str, run.layer_ids))
    answer = ["--max-new-tokens", str(spec.completion_tokens), *(["--ignore-eos"] if run.ignore_eos else [])]
    train = ["--layers", str(spec.drafter_layers), "--depths", str(spec.depths), "--batch-size", str(opts.batch),
             "--lr", str(spec.lr), "--max-anchors", str(spec.max_anchors), "--row-order", "stored",
             "--quiet"]  # fmt: skip
    load_start = os.getloadavg()
    print(f"[bench_stream] {len(prompts)} prompts x {spec.completion_tokens} tokens, T = {spec.seq_len}, "
          f"load {load_start[0]:.2f}", flush=True)  # fmt: skip

    files, steps_seconds = out / "files", {}
    files.mkdir()
    with DiskPeak(files) as file_disk:
        steps_seconds["regenerate"] = peagle(["regenerate", "--input", str(out / "prompts.jsonl"), "--target",
                                              str(run.target_dir), "--out", str(files / "answers.jsonl"), *answer,
                                              "--quiet"], out / "regenerate.log")  # fmt: skip
        steps_seconds["prepare-data"] = peagle(["prepare-data", "--input", str(files / "answers.jsonl"), "--tokenizer",
                                                str(run.target_dir), "--out", str(files / "prepared"), "--seq-len",
                                                str(spec.seq_len), "--quiet"], out / "prepare.log")  # fmt: skip
        rows = read_manifest(files / "prepared", "peagle-prepared")["num_rows"]
        steps = max(1, rows // opts.batch)  # one pass over the rows
        steps_seconds["extract"] = peagle(["extract", "--data", str(files / "prepared"), "--target",
                                           str(run.target_dir), "--out", str(files / "states"), "--layers", layers,
                                           "--quiet"], out / "extract.log")  # fmt: skip
        steps_seconds["train"] = peagle(["train", "--data", str(files / "states"), "--out", str(files / "run"),
                                         "--steps", str(steps), *train], out / "train.log")  # fmt: skip
    file_seconds = sum(steps_seconds.values())
    print(f"[bench_stream] files: {file_seconds:.1f} s ({steps_seconds})", flush=True)

    stream = out / "stream"
    stream.mkdir()
    with DiskPeak(stream) as stream_disk:
        stream_seconds = peagle(["train", "--stream", "--data", str(out / "prompts.jsonl"), "--target",
                                 str(run.target_dir), "--out", str(stream / "run"), "--producers", "1",
                                 "--aux-layers", layers, "--seq-len", str(spec.seq_len), "--steps", str(steps),
                                 *answer, *train], out / "stream.log")  # fmt: skip
    print(f"[bench_stream] stream: {stream_seconds:.1f} s", flush=True)

    from safetensors.torch import load_file

    a, b = load_file(files / "run/final/model.safetensors"), load_file(stream / "run/final/model.safetensors")
    settings = {"prompts": len(prompts), "answer_tokens": spec.completion_tokens, "seq_len": spec.seq_len,
                "rows": rows, "steps": steps, "batch": opts.batch, "threads_per_process": 1,
                "target": str(run.target_dir), "smoke": opts.smoke, "quick": opts.quick}  # fmt: skip
    results = {
        "settings": settings,
        "cores": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "files": {
            "seconds": file_seconds,
            "steps": steps_seconds,
            "peak_disk_bytes": file_disk.peak,
            "hidden_state_bytes": hidden_state_bytes(files),
        },
        "stream": {
            "seconds": stream_seconds,
            "peak_disk_bytes": stream_disk.peak,
            "hidden_state_bytes": hidden_state_bytes(stream),
        },
        "stream_over_files": stream_seconds / file_seconds,
        "same_drafter": a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    mib = 2**20
    print(f"| run | wall s | peak disk MiB | hidden states on disk MiB |\n|---|---|---|---|\n"
          f"| files (4 steps) | {file_seconds:.1f} | {file_disk.peak / mib:.1f} | "
          f"{results['files']['hidden_state_bytes'] / mib:.1f} |\n"
          f"| stream (1 producer) | {stream_seconds:.1f} | {stream_disk.peak / mib:.1f} | "
          f"{results['stream']['hidden_state_bytes'] / mib:.1f} |")  # fmt: skip
    print(f"stream / files = {results['stream_over_files']:.3f} (goal <= 0.8); same drafter: "
          f"{results['same_drafter']}; load {load_start[0]:.2f} -> {results['loadavg_end'][0]:.2f} on "
          f"{results['cores']} cores; {out / 'results.json'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
