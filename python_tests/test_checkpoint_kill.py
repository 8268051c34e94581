"""Kill-and-resume (issue 19): a training process killed at a random point of ``Trainer.save()`` (before any of its
file-system calls: temporary files, writes, fsyncs, renames, removals) resumes with ``--resume`` to exactly the
weights and metrics of a run that was never killed."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peagle.cli import main
from peagle.model import load_state_dict
from peagle.train.trainer import TrainArgs, Trainer
from testkit import fresh_seed, tiny_chat_jsonl, tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]

# Runs TrainArgs(**json argv[1]) and ends the process with os._exit (no cleanup, as a kill) just before the
# argv[2]-th file-system call made inside save() (counting from 0 across all saves); -1 counts them instead and
# prints the count.
KILLER = r"""
import json, os, shutil, sys, tempfile
import safetensors.torch, torch
import peagle.io
from peagle.train.trainer import TrainArgs, Trainer

kill_at, calls, saving = int(sys.argv[2]), [0], [False]

def wrap(owner, name):
    original = getattr(owner, name)
    def call(*args, **kwargs):
        if saving[0]:
            if calls[0] == kill_at:
                os._exit(9)
            calls[0] += 1
        return original(*args, **kwargs)
    setattr(owner, name, call)

for owner, name in [(os, "replace"), (os, "rename"), (os, "fsync"), (os, "unlink"), (os, "mkdir"), (os, "rmdir"),
                    (shutil, "rmtree"), (tempfile, "mkstemp"), (peagle.io, "save_file"), (torch, "save")]:
    wrap(owner, name)

save = Trainer.save
def counted_save(self, *args, **kwargs):
    saving[0] = True
    try:
        return save(self, *args, **kwargs)
    finally:
        saving[0] = False
Trainer.save = counted_save

Trainer(TrainArgs(**json.loads(sys.argv[1]))).run()
print(calls[0])
"""


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(one_thread, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kill")
    tok = tiny_tokenizer(root / "target")
    tiny_llama(root / "target", vocab_size=len(tok) + 4, hidden=64, seed=1)
    tiny_chat_jsonl(root / "chats.jsonl", 8, seed=2)
    common = ["--tokenizer", str(root / "target"), "--seq-len", "48", "--quiet"]
    assert main(["prepare-data", "--input", str(root / "chats.jsonl"), "--out", str(root / "prep"), *common]) == 0
    assert main(["extract", "--data", str(root / "prep"), "--target", str(root / "target"), "--out",
                 str(root / "ext"), "--dtype", "float32", "--layers", "1,2,4", "--quiet"]) == 0  # fmt: skip
    return root / "ext"


def run_killer(args: dict, kill_at: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", KILLER, json.dumps(args), str(kill_at)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        timeout=300,
    )


def losses(run: Path) -> list[tuple]:
    """(step, loss, grad norm, lr) per metrics record (the timings differ from run to run)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records]


def test_killed_saves_resume_exactly(data, tmp_path):
    common = dict(data=str(data), num_layers=1, num_depths=2, steps=4, save_every=2, lr=3e-3, warmup_steps=1,
                  progress=False)  # fmt: skip
    reference = run_killer({**common, "out": str(tmp_path / "reference")}, -1)
    assert reference.returncode == 0, reference.stderr
    total = int(reference.stdout.split()[-1])
    assert total >= 15  # three saves (steps 2 and 4, final), each several files
    expected = load_state_dict(tmp_path / "reference" / "final")
    expected_metrics = losses(tmp_path / "reference")
    seed = fresh_seed()
    points = sorted(random.Random(seed).sample(range(total), 3))
    print(f"seed {seed}: killed before file-system call {points} of {total}")
    for point in points:
        out = tmp_path / f"killed-{point}"
        killed = run_killer({**common, "out": str(out)}, point)
        assert killed.returncode == 9, (point, killed.stderr)
        Trainer(TrainArgs(out=str(out), resume=True, **common)).run()
        assert not [p for p in out.rglob(".*")], f"kill at {point}: temporaries left after the resumed run"
        weights = load_state_dict(out / "final")
        assert weights.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(weights[key], value), (point, key)
        assert losses(out) == expected_metrics, point
