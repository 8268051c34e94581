"""The four training steps on a tiny random Llama target: CLI end to end, resume exactness, DDP == single process,
sequence partitioning inside the trainer, data preparation, extraction and mask-token resolution."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peagle.cli import main
from peagle.train.data import MASK_TOKEN, MaskTokenError, load_tokenizer, resolve_mask_token, tokenize_record
from peagle.train.dataset import ExtractedData
from peagle.train.trainer import TrainArgs, Trainer
from testkit import tiny_chat_jsonl, tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 128


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def work(tmp_path_factory, one_thread) -> Path:
    """Tokenizer + tiny Llama target (4 free embedding slots) + prepared and extracted train / held-out data."""
    root = tmp_path_factory.mktemp("train")
    tok = tiny_tokenizer(root / "target")
    tiny_llama(root / "target", vocab_size=len(tok) + 4, seed=1)
    tiny_chat_jsonl(root / "train.jsonl", 120, seed=2)
    tiny_chat_jsonl(root / "held.jsonl", 30, seed=3)
    for name in ("train", "held"):
        assert main(["prepare-data", "--input", str(root / f"{name}.jsonl"), "--tokenizer", str(root / "target"),
                     "--out", str(root / f"prep-{name}"), "--seq-len", str(SEQ_LEN), "--rows-per-shard", "8",
                     "--quiet"]) == 0  # fmt: skip
        assert main(["extract", "--data", str(root / f"prep-{name}"), "--target", str(root / "target"), "--out",
                     str(root / f"ext-{name}"), "--dtype", "float32", "--rows-per-shard", "8", "--layers", "1,2,4",
                     "--quiet"]) == 0  # fmt: skip
    return root


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_cli(work: Path, out: Path, *extra: str) -> None:
    args = ["train", "--data", str(work / "ext-train"), "--out", str(out), "--layers", "1", "--depths", "3",
            "--quiet", *extra]  # fmt: skip
    assert main(args) == 0


def majority_baseline(data_dir: Path) -> float:
    """Accuracy of always predicting the most common target argmax (the best input-blind guess) on trained labels."""
    data = ExtractedData(data_dir)
    head = load_file(data_dir / "target_head.safetensors")["lm_head.weight"]
    labels = []
    for i in range(len(data)):
        row = data.row(i)
        labels.append((row.target_hidden[row.loss_mask] @ head.T).argmax(-1))
    labels = torch.cat(labels)
    return float(torch.bincount(labels).max()) / labels.numel()


def test_cli_end_to_end_lowers_loss_and_lifts_depth0_accuracy(work):
    run = work / "run-e2e"
    train_cli(work, run, "--steps", "150", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "5")
    metrics = read_metrics(run)
    assert len(metrics) == 150
    first = sum(m["loss"] for m in metrics[:5]) / 5
    last = sum(m["loss"] for m in metrics[-5:]) / 5
    print(f"loss {first:.4f} -> {last:.4f}")
    assert last < 0.6 * first
    config = json.loads((run / "final" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    assert (run / "final" / "model.safetensors").exists()
    # Held-out offline evaluation from the CLI.
    assert main(["eval", "--checkpoint", str(run / "final"), "--data", str(work / "ext-held"), "--json",
                 str(run / "eval.json")]) == 0  # fmt: skip
    result = json.loads((run / "eval.json").read_text())
    baseline = majority_baseline(work / "ext-held")
    acc0 = result["top1_accuracy"][0]
    print(f"held-out depth-0 accuracy {acc0:.3f}, majority baseline {baseline:.3f}, result {result}")
    # The drafter must beat the best input-blind guess on unseen rows by a wide margin: 2x the majority-class rate
    # (and at least 10 points above it) can only come from using the target's hidden states and the tokens.
    assert acc0 > max(2 * baseline, baseline + 0.10)
    # Acceptance bookkeeping: AL = 1 + sum over d of the product of the conditional rates up to d.
    expected, running = 1.0, 1.0
    for rate in result["conditional_acceptance"]:
        running *= rate
        expected += running
    assert result["acceptance_length"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    ("settings", "stop"),
    [
        (dict(steps=8, batch_size=2), 4),
        (dict(epochs=1.5, batch_size=4, micro_batch_size=3), 7),
        (dict(steps=8, batch_size=2, num_depths=1, ttt_steps=3, ttt_step_weight=0.8), 4),
    ],
    ids=["steps", "epochs-micro-batches", "ttt"],
)
def test_resume_continues_exactly(work, tmp_path, settings, stop):
    """An interrupted and resumed run gives the uninterrupted run's losses and weights exactly; the second case
    stops in the middle of the second epoch (25 rows, 4 a step) with micro-batches of 3 and 1 rows; the third trains
    EAGLE-3 with training-time test."""
    common = dict(data=str(work / "ext-train"), num_layers=1, num_depths=3, lr=3e-3, warmup_steps=2, progress=False)
    common.update(settings)
    full = Trainer(TrainArgs(out=str(tmp_path / "full"), **common))
    full.run()
    # Interrupted run: a checkpoint, then the process "dies" (the trainer object is dropped).
    part = Trainer(TrainArgs(out=str(tmp_path / "part"), save_every=4, **common))
    (tmp_path / "part").mkdir()
    for _ in range(stop):
        part.log(part.train_step())
    part.save()
    part.log(part.train_step())  # a step after the checkpoint that the resumed run must redo
    del part
    resumed = Trainer(TrainArgs(out=str(tmp_path / "part"), resume=True, **common))
    resumed.run()
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part")
    assert [m["step"] for m in b] == list(range(1, full.total_steps + 1))
    with pytest.raises(ValueError, match=r"lr: 0\.003 -> 0\.001"):
        Trainer(TrainArgs(out=str(tmp_path / "part"), resume=True, **{**common, "lr": 1e-3})).run()
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    for key, value in full.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    assert all(0 <= m["acc_2"] <= 1 for m in a)  # P-EAGLE depth 2, or TTT step 2: logged either way


def test_epochs_visit_every_training_row_once_and_schedule_the_real_step_count(work, tmp_path):
    """--epochs 2 of 20 training rows (5 held out for --eval-every) at 4 rows a step is 10 steps; each epoch trains
    every training row once and never a held-out row; the learning rate follows warmup + cosine over the 10 steps;
    every --eval-every steps the held-out loss and acceptance length of the weights of that step are logged."""
    from peagle.model import from_pretrained
    from peagle.ops import cod_sample
    from peagle.train.evaluate import evaluate
    from peagle.train.trainer import HOLDOUT_SEED, _lr_lambda, element_loss

    args = TrainArgs(data=str(work / "ext-train"), out=str(tmp_path / "run"), num_layers=1, num_depths=3, epochs=2,
                     batch_size=4, micro_batch_size=2, lr=3e-3, warmup_steps=3, eval_every=5, eval_rows=5,
                     progress=False)  # fmt: skip
    trainer = Trainer(args)
    assert trainer.total_steps == 10 and len(trainer.held_out) == 5 and len(trainer.train_rows) == 20
    assert sorted(trainer.held_out + trainer.train_rows) == list(range(25))
    other = Trainer(TrainArgs(**{**vars(args), "seed": 9, "out": str(tmp_path / "other")}))
    assert other.held_out == trainer.held_out  # the same held-out rows whatever the seed
    for epoch in range(2):
        rows = sorted(trainer.row_slot(s) for s in range(20 * epoch, 20 * (epoch + 1)))
        assert rows == trainer.train_rows
    assert [trainer.row_slot(s) for s in range(20)] != [trainer.row_slot(s) for s in range(20, 40)]
    trainer.run()
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(1, 11)) and metrics[-1]["epoch"] == 2.0
    expected = [3e-3 * _lr_lambda(s, 3, 10, 0.1) for s in range(10)]
    assert [m["lr"] for m in metrics] == pytest.approx(expected, rel=1e-12)
    assert [m["step"] for m in metrics if "eval_loss" in m] == [5, 10]
    # The last evaluation scored the final weights on the held-out rows: the acceptance of `peagle eval`'s function,
    # and the loss of the plain weighted-mean KL over each row's fixed COD elements with one dense mask.
    model = from_pretrained(tmp_path / "run" / "final", dtype=torch.float32)
    last = metrics[-1]
    result = evaluate(model, str(work / "ext-train"), rows=trainer.held_out)
    assert last["eval_acceptance_length"] == pytest.approx(result["acceptance_length"], abs=1e-12) and result["chains"]
    assert [last[f"eval_acc_{d}"] for d in range(3)] == pytest.approx(result["top1_accuracy"], abs=1e-12)
    data, head, losses = (
        ExtractedData(work / "ext-train"),
        load_file(work / "ext-train" / "target_head.safetensors"),
        [],
    )
    with torch.no_grad():
        for index in trainer.held_out:
            row = data.row(index)
            anchors, depths = cod_sample(row.loss_mask, row.document_ids, 3, 0.7, 0.2, None, HOLDOUT_SEED + index)
            out = model.forward_train(row.input_ids, row.hidden, anchors, depths, row.document_ids,
                                      attention="sdpa-full")  # fmt: skip
            label, docs = anchors + depths, row.document_ids
            w = (row.loss_mask[label] & (docs[anchors] >= 0) & (docs[label] == docs[anchors])).float()
            kl = element_loss(out.logits, row.target_hidden[label] @ head["lm_head.weight"].T, "kl")
            losses.append(float((kl * w).sum() / w.sum()))
    assert last["eval_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4)
    assert metrics[4]["eval_loss"] > last["eval_loss"]
    # `peagle plot-train RUN`: the curves of the run as a PNG.
    image = pytest.importorskip("matplotlib.image")
    assert main(["plot-train", str(tmp_path / "run"), "--png", str(tmp_path / "curves.png")]) == 0
    pixels = image.imread(tmp_path / "curves.png")
    assert pixels.shape[:2] == (400, 1400) and float(pixels[..., :3].std()) > 0.05
    with pytest.raises(SystemExit):
        main(["plot-train", str(tmp_path)])


@pytest.mark.parametrize(
    "split",
    [dict(segments=3), dict(memory_budget_mb=1.0), dict(micro_batch_size=3), dict(micro_batch_size=2, segments=3)],
)
def test_sequence_partitioning_and_micro_batches_give_the_same_gradients(work, tmp_path, split):
    from peagle.train.trainer import choose_segments

    grads = []
    for name, options in (("whole", {}), ("split", split)):
        trainer = Trainer(TrainArgs(data=str(work / "ext-train"), out=str(tmp_path / name), num_layers=2,
                                    num_depths=4, steps=1, batch_size=4, save_grads_step=0, ratio=0.9,
                                    progress=False, **options))  # fmt: skip
        trainer.out.mkdir(parents=True)
        trainer.train_step()
        grads.append(torch.load(tmp_path / name / "grads-0.pt"))
    if "memory_budget_mb" in split:
        assert choose_segments(300, trainer.config, 1.0) > 1  # the budget really splits these rows
        assert choose_segments(300, trainer.config, 1e6) == 1
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_ddp_and_fsdp_on_two_gloo_processes_equal_single_process(work, tmp_path):
    """DistributedDataParallel and FSDP2 (--fsdp) on 2 gloo processes: the gradients of both steps and the weights
    after them equal one process on the same global batch (micro-batches and accumulation included), and the
    sharded run's checkpoints are whole: they load unsharded and a single process resumes from them."""
    common = [sys.executable, "-m", "peagle.cli", "train", "--data", str(work / "ext-train"), "--layers", "1",
              "--depths", "3", "--batch-size", "8", "--lr", "1e-3", "--quiet"]  # fmt: skip
    base = [*common, "--steps", "2", "--save-grads-step", "1", "--save-every", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    single = subprocess.run([*base, "--micro-batch-size", "3", "--out", str(tmp_path / "one")], env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    runs = {"ddp": ["--micro-batch-size", "1"], "fsdp": ["--fsdp", "--micro-batch-size", "2"]}
    one = torch.load(tmp_path / "one" / "grads-1.pt")
    weights = load_file(tmp_path / "one" / "final" / "model.safetensors")
    for mode, extra in runs.items():
        out = tmp_path / mode
        two = subprocess.run([*torchrun, *base[1:], *extra, "--out", str(out)], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert two.returncode == 0, two.stderr[-3000:]
        grads = torch.load(out / "grads-1.pt")
        assert one.keys() == grads.keys()
        for name, g in one.items():
            assert g.abs().sum() > 0 or name.startswith("embed"), name
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{mode} {name}")
        final = load_file(out / "final" / "model.safetensors")
        # Adam's step lr * m / sqrt(v) turns rounding-level gradient differences (summation order across ranks) into
        # larger ones where a weight's two gradients nearly cancel: one of 32768 weights of an FSDP run was 3.5e-7 off
        # on this machine. A wrong sharding is off by about a step, lr = 1e-3: the bound is 1e-3 of the two steps.
        for name, w in weights.items():
            torch.testing.assert_close(final[name], w, rtol=1e-5, atol=2e-6, msg=f"{mode} {name}")
        a, b = read_metrics(tmp_path / "one"), read_metrics(out)
        assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-6)
    from peagle.model import from_pretrained

    assert set(from_pretrained(tmp_path / "fsdp" / "final").state_dict()) == set(weights)
    # The sharded run's checkpoint-2 (whole weights and name-keyed optimizer state) resumes on one process.
    resumed = subprocess.run([*common, "--steps", "4", "--micro-batch-size", "2", "--resume", "--out",
                              str(tmp_path / "fsdp")], env=env, capture_output=True, text=True)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "fsdp")] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------------------------------
# prepare-data / extract


def test_chat_loss_mask_is_the_assistant_turns(tmp_path):
    tok = tiny_tokenizer(tmp_path)
    record = {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4 w5"},
                           {"role": "user", "content": "w6"}, {"role": "assistant", "content": "w7"}]}  # fmt: skip
    doc = tokenize_record(tok, record)
    words = tok.convert_ids_to_tokens(doc.ids)
    trained = [w for w, m in zip(words, doc.loss, strict=True) if m]
    assert trained == ["w3", "w4", "w5", "<|end|>", "w7", "<|end|>"]
    text = tokenize_record(tok, {"text": "w1 w2 w3"})
    assert all(text.loss) and len(text.ids) == 3


def test_token_id_records_train_the_completion_only(tmp_path):
    from peagle.train.data import iter_prepared_rows

    tok = tiny_tokenizer(tmp_path / "tok")
    gen = torch.Generator().manual_seed(5)
    records = []
    for _ in range(12):
        prompt = torch.randint(0, len(tok), (int(torch.randint(0, 9, (1,), generator=gen)),), generator=gen)
        completion = torch.randint(0, len(tok), (int(torch.randint(1, 14, (1,), generator=gen)),), generator=gen)
        records.append({"prompt_ids": prompt.tolist(), "completion_ids": completion.tolist()})
    records.append({"completion_ids": [9, 10, 11]})  # no prompt: every token trained
    doc = tokenize_record(tok, records[-1])
    assert doc.ids == [9, 10, 11] and doc.loss == [True, True, True]  # ids as given, no BOS added
    with open(tmp_path / "ids.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    assert main(["prepare-data", "--input", str(tmp_path / "ids.jsonl"), "--tokenizer", str(tmp_path / "tok"),
                 "--out", str(tmp_path / "prep"), "--seq-len", "32", "--quiet"]) == 0  # fmt: skip
    # Unpack the rows into documents: each is prompt + completion, in order, trained exactly on the completion.
    docs = []
    for row in iter_prepared_rows(tmp_path / "prep"):
        ids, loss, doc_ids = row["input_ids"].tolist(), row["loss_mask"].tolist(), row["document_ids"].tolist()
        for d in sorted(set(doc_ids) - {-1}):
            docs.append(([i for i, k in zip(ids, doc_ids, strict=True) if k == d],
                         [m for m, k in zip(loss, doc_ids, strict=True) if k == d]))  # fmt: skip
    expected = [(r.get("prompt_ids", []) + r["completion_ids"], [0] * len(r.get("prompt_ids", [])) +
                 [1] * len(r["completion_ids"])) for r in records]  # fmt: skip
    assert docs == [e for e in expected if len(e[0]) >= 2]
    for bad, message in (({"prompt_ids": [1, 2]}, "needs completion_ids"),
                         ({"completion_ids": [1, len(tok)]}, "outside the tokenizer"),
                         ({"completion_ids": [1, -1]}, "outside the tokenizer"),
                         ({"completion_ids": "1 2"}, "list of integer token ids"),
                         ({"prompt_ids": [1.5], "completion_ids": [1]}, "list of integer token ids")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            tokenize_record(tok, bad)


def test_prepare_data_packs_rows_and_counts_tokens(work):
    from peagle.train.data import iter_prepared_rows, read_manifest

    manifest = read_manifest(work / "prep-train", "peagle-prepared")
    rows = list(iter_prepared_rows(work / "prep-train"))
    assert len(rows) == manifest["num_rows"] > 1
    counts = torch.zeros(manifest["vocab_size"], dtype=torch.long)
    for row in rows:
        docs = row["document_ids"].long()
        used = docs >= 0
        # Documents are contiguous, numbered from 0 in order, and padding only at the tail.
        assert torch.equal(used, torch.arange(SEQ_LEN) < int(used.sum()))
        assert bool((docs[used][1:] - docs[used][:-1] >= 0).all()) and int(docs[0]) == 0
        trained = row["loss_mask"].bool() & used
        counts += torch.bincount(row["input_ids"].long()[trained], minlength=counts.numel())
    freq = load_file(work / "prep-train" / "token_freq.safetensors")["counts"]
    assert torch.equal(freq, counts)


def test_extract_matches_the_target_and_resumes(work, tmp_path):
    from transformers import AutoModelForCausalLM

    data = ExtractedData(work / "ext-train")
    raw = data.raw(0)
    docs = raw["document_ids"]
    end = int((docs == 0).sum())
    target = AutoModelForCausalLM.from_pretrained(str(work / "target"))
    # Layer id i = the residual stream after i decoder layers (vLLM's aux hidden states): transformers' last
    # hidden_states entry is after the final norm, so the last layer's is read at the norm's input.
    final_input = []
    target.model.norm.register_forward_pre_hook(lambda module, args: final_input.append(args[0]))
    with torch.no_grad():
        out = target(raw["input_ids"][:end].long()[None], output_hidden_states=True)
    ids = data.manifest["aux_layer_ids"]
    layers = target.config.num_hidden_layers
    assert layers in ids
    expected = torch.cat([(final_input[0] if i == layers else out.hidden_states[i])[0] for i in ids], -1)
    torch.testing.assert_close(raw["aux_hidden"][:end], expected, rtol=1e-4, atol=1e-5)
    logits = raw["final_hidden"][:end] @ load_file(work / "ext-train" / "target_head.safetensors")["lm_head.weight"].T
    torch.testing.assert_close(logits, out.logits[0], rtol=1e-4, atol=1e-5)
    # Resume: forget the last shard, run again, get the same files.
    copy = tmp_path / "ext"
    shutil.copytree(work / "ext-train", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    dropped = manifest["shards"].pop()
    manifest["complete"] = False
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / dropped["file"]).unlink()
    assert main(["extract", "--data", str(work / "prep-train"), "--target", str(work / "target"), "--out", str(copy),
                 "--dtype", "float32", "--rows-per-shard", "8", "--layers", "1,2,4", "--quiet"]) == 0  # fmt: skip
    again, original = load_file(copy / dropped["file"]), load_file(work / "ext-train" / dropped["file"])
    for key in original:
        assert torch.equal(again[key], original[key]), key


class TokenStates:
    """An extraction backend whose states are the token ids (aux) and their negatives (final), recording its calls."""

    calls: list[int]

    def __init__(self, target) -> None:
        self.width = 3 * target.config.hidden_size, target.config.hidden_size
        self.vocab = target.config.vocab_size

    def states(self, documents):
        TokenStates.calls.append(len(documents))
        return [(d.float()[:, None].expand(-1, self.width[0]), -d.float()[:, None].expand(-1, self.width[1]))
                for d in documents]  # fmt: skip

    def target_head(self):
        return {
            "lm_head.weight": torch.ones(self.vocab, self.width[1]),
            "embed_tokens.weight": torch.zeros(self.vocab, 2),
        }

    def close(self):
        pass


@pytest.mark.parametrize("batch_shards", [False, True])
def test_extract_runs_the_registered_backend(work, tmp_path, monkeypatch, batch_shards):
    from peagle.train import extract as extraction

    monkeypatch.setattr(extraction, "_BACKENDS", dict(extraction._BACKENDS))  # registrations end with the test
    monkeypatch.setattr(TokenStates, "calls", [], raising=False)
    extraction.register_extraction_backend("tokens", TokenStates, batch_shards=batch_shards)
    assert {"hf", "tokens"} <= set(extraction.extraction_backends())
    manifest = extraction.extract(work / "prep-held", work / "target", tmp_path, [1, 2, 4], "float32", 3,
                                  progress=False, backend="tokens")  # fmt: skip
    assert manifest["backend"] == "tokens" and manifest["complete"]
    rows = sum(shard["rows"] for shard in manifest["shards"])
    assert rows > len(manifest["shards"]) > 1
    # One states() call per row, or per shard of 3 rows with batch_shards; every document of a row goes in one call.
    assert len(TokenStates.calls) == (len(manifest["shards"]) if batch_shards else rows)
    data = ExtractedData(tmp_path)
    for i in range(len(data)):
        raw = data.raw(i)
        ids, docs = raw["input_ids"].float(), raw["document_ids"]
        expected = torch.where(docs >= 0, ids, torch.zeros_like(ids))
        assert torch.equal(raw["aux_hidden"], expected[:, None].expand(-1, 3 * 128))
        assert torch.equal(raw["final_hidden"], -expected[:, None].expand(-1, 128))
    head = load_file(tmp_path / "target_head.safetensors")["lm_head.weight"]
    assert torch.equal(head, torch.ones(manifest["vocab_size"], 128))


def test_unknown_or_unregistered_extraction_backend_is_named(work, tmp_path, monkeypatch):
    from peagle.train import extract as extraction

    monkeypatch.setattr(extraction, "_BACKENDS", {k: v for k, v in extraction._BACKENDS.items() if k != "vllm"})
    args = (work / "prep-held", work / "target", tmp_path / "x")
    with pytest.raises(ValueError, match=r"backend \(--backend\) must be one of \['hf'\], got 'onnx'$"):
        extraction.extract(*args, backend="onnx")
    # vllm before peagle.vllm.extract registered it: say how it gets registered and which extra it needs.
    with pytest.raises(ValueError, match=r"got 'vllm'; .*peagle\.vllm\.extract .*pip install 'peagle\[vllm\]'"):
        extraction.extract(*args, backend="vllm")
    assert not (tmp_path / "x").exists()


def test_cli_errors_are_clear(work, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["prepare-data", "--input", str(tmp_path / "nope.jsonl"), "--tokenizer", str(work / "target"),
              "--out", str(tmp_path / "x")])  # fmt: skip
    assert info.value.code == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--data", str(work / "prep-train"), "--out", str(tmp_path / "y"), "--quiet"])
    assert "expected 'peagle-extracted'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["extract", "--data", str(work / "prep-train"), "--target", str(work / "target"), "--out",
              str(tmp_path / "z"), "--layers", "1,2,99", "--quiet"])  # fmt: skip
    assert "outside the target's layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_cli(work, tmp_path / "w", "--depths", "3", "--depth-weights", "1,1")
    assert "--depth-weights" in capsys.readouterr().err
    for extra, needed in (
        (["--ttt-steps", "2"], "needs --depths 1"),
        (["--depths", "1", "--ttt-steps", "2", "--segments", "2"], "no --segments"),
        (["--ttt-steps", "0"], "--ttt-steps must be in"),
    ):
        with pytest.raises(SystemExit):
            train_cli(work, tmp_path / "w", *extra)
        assert needed in capsys.readouterr().err
    # A drafter for another target: clear refusal instead of a shape error deep inside the forward.
    from peagle.model import DrafterConfig, PEagleDrafter, save_pretrained

    other = DrafterConfig(hidden_size=64, vocab_size=300, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=64,
                          aux_layer_ids=[1, 2, 3])  # fmt: skip
    save_pretrained(PEagleDrafter(other), tmp_path / "other")
    with pytest.raises(SystemExit):
        main(["eval", "--checkpoint", str(tmp_path / "other"), "--data", str(work / "ext-held")])
    err = capsys.readouterr().err
    assert "does not match this data's target" in err and "hidden size 64 != the target's 128" in err


# ---------------------------------------------------------------------------------------------------------------------
# mask token resolution


def test_mask_token_resolution_paths(tmp_path):
    plain = tiny_tokenizer(tmp_path / "plain")
    size = len(plain)
    assert resolve_mask_token(plain, size + 2, mask_token_id=5) == (5, "explicit")
    with pytest.raises(MaskTokenError, match="outside the target vocabulary"):
        resolve_mask_token(plain, size, mask_token_id=size)
    masked = tiny_tokenizer(tmp_path / "masked", mask_token=True)
    assert resolve_mask_token(masked, len(masked)) == (masked.mask_token_id, "tokenizer mask token")
    # An unused embedding slot: a new token is added there and the tokenizer records it.
    token_id, how = resolve_mask_token(plain, size + 2)
    assert token_id == size and MASK_TOKEN in how
    plain.save_pretrained(str(tmp_path / "saved"))
    assert load_tokenizer(tmp_path / "saved").convert_tokens_to_ids(MASK_TOKEN) == size
    # No slot left: an error, unless reusing a special token is explicitly allowed.
    full = tiny_tokenizer(tmp_path / "full")
    with pytest.raises(MaskTokenError, match="reuse-special-token-as-mask"):
        resolve_mask_token(full, len(full))
    assert resolve_mask_token(full, len(full), allow_special_reuse=True) == (full.pad_token_id, "reused pad_token")


def test_trainer_saves_the_added_mask_token(work, tmp_path):
    trainer = Trainer(TrainArgs(data=str(work / "ext-train"), out=str(tmp_path), num_layers=1, num_depths=2, steps=1,
                                progress=False))  # fmt: skip
    vocab_words = len(load_tokenizer(work / "target"))
    assert trainer.config.mask_token_id == vocab_words and MASK_TOKEN in trainer.mask_how
    trainer.run()
    saved = load_tokenizer(tmp_path / "final" / "tokenizer")
    assert saved.convert_tokens_to_ids(MASK_TOKEN) == trainer.config.mask_token_id
    assert json.loads((tmp_path / "final" / "config.json").read_text())["mask_token_id"] == vocab_words


def test_autoregressive_eval_counts_the_served_chains(work, tmp_path):
    """`peagle eval --autoregressive` on a K = 1 drafter: Pos 1 equals the parallel evaluation's, and Pos 1..K and
    the acceptance length equal a per-chain count over the chains drafted step by step."""
    from peagle.model import from_pretrained
    from peagle.train.evaluate import chain_drafts, chain_elements, evaluate

    args = TrainArgs(data=str(work / "ext-train"), out=str(tmp_path / "k1"), num_layers=1, num_depths=1, steps=40,
                     batch_size=2, lr=3e-3, warmup_steps=2, progress=False, eval_every=20,
                     eval_data=str(work / "ext-held"), eval_rows=1000, eval_ar_depths=3)  # fmt: skip
    Trainer(args).run()
    assert main(["eval", "--checkpoint", str(tmp_path / "k1" / "final"), "--data", str(work / "ext-held"),
                 "--depths", "3", "--autoregressive", "--json", str(tmp_path / "ar.json")]) == 0  # fmt: skip
    ar = json.loads((tmp_path / "ar.json").read_text())
    model = from_pretrained(tmp_path / "k1" / "final", dtype=torch.float32)
    parallel = evaluate(model, str(work / "ext-held"), depth=3)
    assert ar["drafting"] == "autoregressive" and ar["depths"] == 3 and ar["chains"] == parallel["chains"] > 0
    assert ar["top1_accuracy"][0] == parallel["top1_accuracy"][0]
    assert ar["conditional_acceptance"][0] == pytest.approx(parallel["conditional_acceptance"][0], abs=1e-12)
    # Per-chain count: accepted drafts of each chain = the length of its matching prefix against the target argmax.
    data = ExtractedData(work / "ext-held")
    head = load_file(work / "ext-held" / "target_head.safetensors")["lm_head.weight"]
    reach, chains = [0, 0, 0], 0
    for i in range(len(data)):
        row = data.row(i)
        _, _, anchors = chain_elements(row.document_ids, row.loss_mask, 3)
        if anchors.numel() == 0:
            continue
        _, drafts = chain_drafts(model, row.input_ids, row.hidden, row.document_ids, anchors, 3)
        for a, chain in zip(anchors.tolist(), drafts.tolist(), strict=True):
            for d in range(3):
                if chain[d] != int((row.target_hidden[a + d] @ head.T).argmax()):
                    break
                reach[d] += 1
            chains += 1
    conditional = [reach[0] / chains, reach[1] / reach[0], reach[2] / reach[1]]
    print(f"autoregressive {ar}; parallel {parallel}")
    assert ar["conditional_acceptance"] == pytest.approx(conditional, abs=1e-9)
    assert ar["acceptance_length"] == pytest.approx(1 + sum(reach) / chains, abs=1e-9)
    # Held-out evaluation during training (every held-out row, 3 drafts autoregressively): the same figure.
    logged = [m for m in read_metrics(tmp_path / "k1") if "eval_ar_acceptance_length" in m]
    assert [m["step"] for m in logged] == [20, 40]
    assert logged[-1]["eval_ar_acceptance_length"] == pytest.approx(ar["acceptance_length"], abs=1e-12)
    walk = ar["serving_walk"]
    assert 0 < walk["drafts"] < chains and 1.0 <= walk["acceptance_length"] <= 4.0


@pytest.mark.parametrize("k", [1, 2, 5])
def test_chain_acceptance_is_the_matching_prefix(generator, k):
    """Eval scores a chain by greedy tree verification: its accepted drafts are the prefix where every draft is the
    target's argmax. A 3-token vocabulary makes tokens repeat within chains, and drafts equal the target of another
    depth."""
    from peagle.train.evaluate import greedy_chain_acceptance

    targets = torch.randint(0, 3, (400, k), generator=generator)
    accepted = torch.arange(400) % (k + 1)  # by construction: drafts match up to here, then one misses
    depth = torch.arange(k)
    miss = (targets + torch.randint(1, 3, (400, k), generator=generator)) % 3
    after = torch.randint(0, 3, (400, k), generator=generator)  # past the miss: anything
    drafts = torch.where(depth < accepted[:, None], targets, torch.where(depth == accepted[:, None], miss, after))
    assert torch.equal(greedy_chain_acceptance(drafts, targets), accepted)


def test_serving_walk_drafts_where_a_greedy_server_drafts():
    from peagle.train.evaluate import _serving_walk

    # Two documents; trained labels at 2..7 (document 0) and 8..10 (document 1, a new request).
    docs = torch.tensor([0] * 8 + [1] * 4)
    trained = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    accepted = torch.tensor([-1, -1, -1, 0, 0, 1, -1, -1, -1, 1, -1, -1])
    # Document 0: the target makes the token of anchor 2 itself; drafts from 3 (0 accepted: next 4), 4 (next 5),
    # 5 (1 accepted: next 7), 7 has no full chain. Document 1: drafts from 9 (1 accepted: next 11, none).
    assert _serving_walk(accepted, trained, docs) == [0, 0, 1, 1]
    assert _serving_walk(torch.full((12,), -1), trained, docs) == []
    # A server generating 3 tokens per request drafts from anchors 3 (1 token out) and 4 (2 out) of document 0, then
    # has its 3 tokens; with 2, only from 3; with 1 (the target's own first token), never.
    assert _serving_walk(accepted, trained, docs, max_tokens=3) == [0, 0, 1]
    assert _serving_walk(accepted, trained, docs, max_tokens=2) == [0, 1]
    assert _serving_walk(accepted, trained, docs, max_tokens=1) == []


def test_weighted_kl_matches_autograd_of_the_plain_formula():
    from peagle.train.loss import element_loss, weighted_kl

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randn(3, 11, generator=gen, dtype=torch.float64)
    inverse = torch.tensor([0, 2, 1, 1, 0, 2, 2])
    weight = torch.rand(7, generator=gen, dtype=torch.float64)
    ours = weighted_kl(logits, torch.log_softmax(target, -1), inverse, weight)
    (g_ours,) = torch.autograd.grad(ours, logits)
    plain = (element_loss(logits, target[inverse], "kl") * weight).sum()
    (g_plain,) = torch.autograd.grad(plain, logits)
    torch.testing.assert_close(ours, plain)
    torch.testing.assert_close(g_ours, g_plain)


def test_train_row_equals_the_plain_loss_over_all_elements():
    """train_row (element pruning, document-blocked attention, distinct-label targets, fused KL) == the plain
    weighted-mean KL over every COD element with one dense N x N mask, in loss and in every gradient (float64)."""
    from peagle.model import DrafterConfig, PEagleDrafter
    from peagle.ops import cod_sample
    from peagle.train.dataset import TrainRow
    from peagle.train.trainer import element_loss, train_row
    from testkit import random_packed_row

    gen = torch.Generator().manual_seed(5)
    cfg = DrafterConfig(hidden_size=32, vocab_size=40, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                        intermediate_size=48, mask_token_id=39, num_depths=4, aux_layer_ids=[1, 2, 3])  # fmt: skip
    torch.manual_seed(0)
    model = PEagleDrafter(cfg).double()
    length = 160
    packed = random_packed_row(gen, length, mean_document_length=30)
    row = TrainRow(torch.randint(0, 39, (length,), generator=gen), torch.randn(length, 96, generator=gen).double(),
                   torch.randn(length, 32, generator=gen).double(), packed.document_ids, packed.loss_mask)  # fmt: skip
    head = torch.randn(40, 32, generator=gen).double()
    anchors, depths = cod_sample(row.loss_mask, row.document_ids, 4, 0.8, 0.3, None, 1)
    weights = torch.tensor([1.0, 0.9, 0.7, 0.5], dtype=torch.float64)
    stats = train_row(model, row, anchors, depths, head, model.draft_ids(), weights)
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = model.forward_train(row.input_ids, row.hidden, anchors, depths, row.document_ids, attention="sdpa-full")
    label = anchors + depths
    docs = row.document_ids
    w = (row.loss_mask[label] & (docs[anchors] >= 0)).double() * weights[depths]
    target = row.target_hidden[label] @ head.T
    loss = (element_loss(out.logits, target, "kl") * w).sum() / w.sum()
    loss.backward()
    assert stats["loss"] == pytest.approx(float(loss), rel=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-8, atol=1e-10, msg=name)


def test_tree_eval_with_top1_is_the_chain_and_full_trees_accept_more(work, tmp_path):
    """`peagle eval --tree-budget/--tree-topk`: top-1 trees are the chains (identical figures), and a full tree
    contains the chain, so its acceptance is at least the chain's at every position."""
    from peagle.model import from_pretrained
    from peagle.train.evaluate import evaluate

    args = TrainArgs(data=str(work / "ext-train"), out=str(tmp_path / "k3"), num_layers=1, num_depths=3, steps=40,
                     batch_size=2, lr=3e-3, warmup_steps=2, progress=False)  # fmt: skip
    Trainer(args).run()
    model = from_pretrained(tmp_path / "k3" / "final", dtype=torch.float32)
    held = str(work / "ext-held")
    chain = evaluate(model, held, tree_budget=64, tree_topk=1)
    assert chain["tree"]["num_nodes"] == 4 and chain["tree"]["topk"] == [1, 1, 1]
    assert chain["tree"]["acceptance_length"] == chain["acceptance_length"] > 1.0
    assert chain["tree"]["conditional_acceptance"] == chain["conditional_acceptance"]
    wide = evaluate(model, held, tree_budget=15, tree_topk=[2, 2, 2])  # 1 + 2 + 4 + 8: the full tree
    assert wide["acceptance_length"] == chain["acceptance_length"]
    reach_chain = torch.tensor(chain["conditional_acceptance"]).cumprod(0)
    reach_tree = torch.tensor(wide["tree"]["conditional_acceptance"]).cumprod(0)
    assert (reach_tree >= reach_chain - 1e-12).all()
    assert wide["tree"]["acceptance_length"] > chain["acceptance_length"]
    assert main(["eval", "--checkpoint", str(tmp_path / "k3" / "final"), "--data", held, "--tree-budget", "8",
                 "--tree-topk", "3,2,1", "--json", str(tmp_path / "tree.json")]) == 0  # fmt: skip
    tree = json.loads((tmp_path / "tree.json").read_text())["tree"]
    assert tree["num_nodes"] == 8 and tree["topk"] == [3, 2, 1] and 1.0 <= tree["acceptance_length"] <= 4.0
    with pytest.raises(ValueError, match="tree_topk"):
        evaluate(model, held, tree_topk=[2, 2])
    with pytest.raises(ValueError, match="tree_budget"):
        evaluate(model, held, tree_budget=1)
    with pytest.raises(ValueError, match="autoregressive"):
        evaluate(model, held, autoregressive=True, tree_budget=8)


def test_sampled_eval_is_the_expected_acceptance_of_sampled_chains(work, tmp_path, capsys):
    """`peagle eval --temperature T --top-p P`: a sampled draft at depth d is accepted with probability
    sum_v min(p_v, q_v) (checked by drawing), a chain reaches depth d with the product, and the figures are those
    expectations over every chain, recomputed here chain by chain from the drafter's logits and the target's head;
    near temperature 0 they become the greedy figures."""
    from peagle.model import from_pretrained
    from peagle.train.evaluate import chain_elements, evaluate

    args = TrainArgs(data=str(work / "ext-train"), out=str(tmp_path / "k3"), num_layers=1, num_depths=3, steps=40,
                     batch_size=2, lr=3e-3, warmup_steps=2, progress=False)  # fmt: skip
    Trainer(args).run()
    model = from_pretrained(tmp_path / "k3" / "final", dtype=torch.float32)
    held = str(work / "ext-held")
    sampled = evaluate(model, held, temperature=0.8, top_p=0.9)
    assert sampled["temperature"] == 0.8 and sampled["top_p"] == 0.9 and "serving_walk" not in sampled
    data = ExtractedData(work / "ext-held")
    head = load_file(work / "ext-held" / "target_head.safetensors")["lm_head.weight"].double()
    reach, chains, per_row, drawn = torch.zeros(3, dtype=torch.float64), 0, [], []
    repeats = torch.zeros(2, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    for i in range(len(data)):
        row = data.row(i)
        anchors, depths, starts = chain_elements(row.document_ids, row.loss_mask, 3)
        if starts.numel() == 0:
            continue
        with torch.no_grad():
            logits = model.forward_train(row.input_ids, row.hidden, anchors, depths, row.document_ids).logits.double()
        target = row.target_hidden.double()[anchors + depths] @ head.T / 0.8
        # top-p 0.9 by hand: keep the most likely tokens until their mass reaches 0.9.
        probs = target.softmax(-1)
        ordered, order = probs.sort(-1, descending=True)
        keep = (ordered.cumsum(-1) - ordered) < 0.9
        p = torch.zeros_like(probs).scatter(-1, order, ordered * keep)
        p = p / p.sum(-1, keepdim=True)
        q = (logits / 0.8).softmax(-1)
        alpha = torch.minimum(p[:, model.draft_ids()], q).sum(-1)
        # Depth d of chain c is element c (d = 0, position c) or T + (d - 1) * n + index of c.
        n, length = starts.numel(), row.input_ids.numel()
        grid = torch.stack([alpha[starts], *(alpha[length + (d - 1) * n :][:n] for d in range(1, 3))], 1)
        row_reach = grid.cumprod(1)
        drafts = model.draft_ids()[logits.argmax(-1)]
        chain_drafts_ = torch.stack([drafts[starts], *(drafts[length + (d - 1) * n :][:n] for d in range(1, 3))], 1)
        repeats += (chain_drafts_[:, 1:] == chain_drafts_[:, :-1]).sum(0).double()
        reach += row_reach.sum(0)
        chains += n
        per_row.append(float(row_reach.sum()))
        if len(drawn) < 3:  # accepted with probability min(1, p/q) after a draw from q
            c = starts[0]
            tokens = torch.multinomial(q[c].float(), 4000, replacement=True, generator=gen)
            ratio = (p[c, model.draft_ids()[tokens]] / q[c, tokens]).clamp(max=1)
            drawn.append((float((torch.rand(4000, generator=gen, dtype=torch.float64) < ratio).double().mean()),
                          float(alpha[c])))  # fmt: skip
    assert sampled["chains"] == chains and sampled["rows"] == len(per_row)
    assert sampled["repeated_draft"] == pytest.approx((repeats / chains).tolist())
    assert len(sampled["repeated_text"]) == 2 and all(0 <= v <= 1 for v in sampled["repeated_text"])
    expected = [float(reach[0] / chains), float(reach[1] / reach[0]), float(reach[2] / reach[1])]
    assert sampled["conditional_acceptance"] == pytest.approx(expected, rel=1e-4)
    assert sampled["acceptance_length"] == pytest.approx(1 + float(reach.sum()) / chains, rel=1e-4)
    assert 0 < sampled["acceptance_length_interval"] < 3
    for frequency, probability in drawn:
        assert frequency == pytest.approx(probability, abs=0.03)
    # Near temperature 0 the distributions are one-hot at their argmax: the greedy figures.
    greedy, cold = evaluate(model, held), evaluate(model, held, temperature=1e-4)
    assert cold["conditional_acceptance"] == pytest.approx(greedy["conditional_acceptance"], abs=2e-3)
    assert greedy["acceptance_length_interval"] > 0 and greedy["temperature"] == 0.0
    # The command line, and bad sampling options named by their flags.
    argv = ["eval", "--checkpoint", str(tmp_path / "k3" / "final"), "--data", held]
    assert main([*argv, "--temperature", "1", "--top-p", "0.95"]) == 0
    assert "sampled at temperature 1, top-p 0.95" in capsys.readouterr().out
    for bad, message in ((["--temperature", "-1"], "--temperature must be finite numbers >= 0"),
                         (["--temperature", "nan"], "--temperature must be"), (["--top-p", "0"], "--top-p must be"),
                         (["--top-p", "1.5"], r"--top-p must be in \(0, 1\]")):  # fmt: skip
        with pytest.raises(SystemExit) as err:
            main([*argv, *bad])
        assert err.value.code == 2 and re.search(message, capsys.readouterr().err), bad
    with pytest.raises(ValueError, match="greedy trees"):
        evaluate(model, held, temperature=1.0, tree_budget=8)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        evaluate(model, held, temperature=float("inf"))


def test_tree_acceptance_walks_the_matching_branch():
    """Hand-built tree (node: parent, token): 1: 0, 5; 2: 0, 7; 3: 2, 9; 4: 2, 4; 5: 1, 9; 6: 4, 1. A node is accepted
    when its parent is and its token is the target at its parent's depth."""
    from peagle.train.evaluate import greedy_tree_acceptance

    parent = torch.tensor([-1, 0, 0, 2, 2, 1, 4])
    tokens = torch.tensor([-1, 5, 7, 9, 4, 9, 1])
    depth = torch.tensor([0, 1, 1, 2, 2, 2, 3])
    cases = {  # targets at depths 0, 1, 2 -> accepted drafts
        (7, 4, 1): 3,  # 0 -> 2 -> 4 -> 6
        (7, 9, 1): 2,  # 0 -> 2 -> 3, a leaf
        (5, 9, 1): 2,  # 0 -> 1 -> 5 (token 9 also sits under node 2: only the accepted branch counts)
        (5, 4, 1): 1,  # node 1's only child has token 9
        (4, 7, 1): 0,  # targets of other depths do not count
        (3, 3, 3): 0,
    }
    n = len(cases)
    targets = torch.tensor(list(cases))
    expand = [t.expand(n, -1) for t in (parent, tokens, depth)]
    full = torch.full((n,), 7)
    assert greedy_tree_acceptance(*expand, full, targets).tolist() == list(cases.values())
    # Without node 6 (padding past num_nodes) the deepest path stops at node 4.
    assert greedy_tree_acceptance(*expand, full - 1, targets).tolist()[0] == 2


def test_warm_start_trains_a_peagle_drafter_from_an_eagle3_run(work, tmp_path):
    """--init-from: a P-EAGLE run starts from a (TTT-trained) EAGLE-3 run's weights, logs what it initialised, and
    a mismatched shape is refused naming the option."""
    from peagle.model import load_state_dict

    common = dict(data=str(work / "ext-train"), num_layers=1, batch_size=2, lr=3e-3, warmup_steps=1, progress=False)
    Trainer(TrainArgs(out=str(tmp_path / "eagle3"), num_depths=1, ttt_steps=2, steps=3, **common)).run()
    source = load_state_dict(tmp_path / "eagle3" / "final")
    init = str(tmp_path / "eagle3" / "final")
    warm = Trainer(TrainArgs(out=str(tmp_path / "peagle"), num_depths=3, steps=0, init_from=init, **common))
    mask_id = warm.config.mask_token_id
    state = warm.model.state_dict()
    for name, tensor in source.items():
        if name == "embed_tokens.weight":
            assert torch.equal(torch.cat([state[name][:mask_id], state[name][mask_id + 1 :]]),
                               torch.cat([tensor[:mask_id], tensor[mask_id + 1 :]]))  # fmt: skip
        elif name != "mask_hidden":
            assert torch.equal(state[name], tensor), name
    fresh = Trainer(TrainArgs(out=str(tmp_path / "fresh"), num_depths=3, steps=0, **common)).model.state_dict()
    assert torch.equal(state["mask_hidden"], fresh["mask_hidden"])  # initialised as a run from scratch does
    assert torch.equal(state["embed_tokens.weight"][mask_id], fresh["embed_tokens.weight"][mask_id])
    warm.run()
    report = json.loads((tmp_path / "peagle" / "init_from.json").read_text())
    assert report["initialised"] == ["mask_hidden", f"embed_tokens.weight[{mask_id}]"]
    assert "fc.weight" in report["copied"] and report["source_kind"] == "EAGLE-3"
    with pytest.raises(ValueError, match=r"num_layers 1 \(ours 2: --layers\)"):
        Trainer(TrainArgs(out=str(tmp_path / "bad"), init_from=init, **{**common, "num_layers": 2}))


@pytest.mark.parametrize(
    "options", [["--moe-experts", "4", "--moe-top-k", "1"], ["--lm-head-rank", "4", "--lm-head-candidates", "8"]]
)
def test_distributed_training_with_drafter_options(work, tmp_path, options):
    """Options whose parameters a pass may not reach (MoE experts no element routes to, the low-rank head that only
    its KL loss reaches) train under DDP and FSDP2 as on one process."""
    common = [sys.executable, "-m", "peagle.cli", "train", "--data", str(work / "ext-train"), "--layers", "1",
              "--depths", "3", "--batch-size", "4", "--lr", "1e-3", "--quiet", "--steps", "2",
              "--save-grads-step", "1", *options]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    single = subprocess.run([*common, "--out", str(tmp_path / "one")], env=env, capture_output=True, text=True)
    assert single.returncode == 0, single.stderr[-3000:]
    one = torch.load(tmp_path / "one" / "grads-1.pt")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for mode, extra in {"ddp": [], "fsdp": ["--fsdp"]}.items():
        out = tmp_path / mode
        two = subprocess.run([*torchrun, *common[1:], *extra, "--out", str(out)], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert two.returncode == 0, f"{mode}: {two.stderr[-3000:]}"
        grads = torch.load(out / "grads-1.pt")
        for name, g in one.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{mode} {name}")


def test_checkpoint_best_holds_the_best_served_acceptance_and_resume_drops_a_later_one(work, tmp_path):
    """--depths 1: checkpoint_best follows the autoregressive (served) held-out acceptance length; its weights are the
    checkpoint of that step's. A checkpoint_best newer than the checkpoint --resume continues goes with the redone
    steps."""
    args = dict(data=str(work / "ext-train"), out=str(tmp_path / "run"), num_layers=1, num_depths=1, steps=6,
                batch_size=2, lr=3e-3, warmup_steps=1, eval_every=2, eval_rows=4, eval_data=str(work / "ext-held"),
                save_every=2, progress=False)  # fmt: skip
    Trainer(TrainArgs(**args)).run()
    run = tmp_path / "run"
    metric = "eval_ar_acceptance_length"
    evaluated = [m for m in read_metrics(run) if metric in m]
    assert [m["step"] for m in evaluated] == [2, 4, 6]
    top = max(evaluated, key=lambda m: m[metric])  # the first of equal values wins
    best = json.loads((run / "checkpoint_best" / "best.json").read_text())
    assert best == {"step": top["step"], "metric": metric, "value": top[metric]}
    a = load_file(run / "checkpoint_best" / "model.safetensors")
    b = load_file(run / f"checkpoint-{top['step']:07d}" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # A run killed after step 4 had written a best of step 6: resuming from checkpoint 4 drops it.
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "checkpoint-0000006")
    (run / "latest.json").write_text(json.dumps({"step": 4, "checkpoint": "checkpoint-0000004"}))
    (run / "checkpoint_best" / "best.json").write_text(json.dumps({**best, "step": 6}))
    trainer = Trainer(TrainArgs(**{**args, "steps": 4, "resume": True}))
    trainer._prepare_output()
    assert trainer.step == 4 and not (run / "checkpoint_best").exists()
    early = max(evaluated[:2], key=lambda m: m[metric])  # the resumed checkpoint's own record: steps 2 and 4
    assert trainer.best == {"step": early["step"], "metric": metric, "value": early[metric]}


def test_drafters_trained_side_by_side_equal_drafters_trained_here_on_one_thread(work, tmp_path):
    """The demo trains its drafters in spawned processes of one thread each: the weights are those of the same
    training run here on one thread (with the demo's float settings), and each job's own seconds come back."""
    from peagle.demo.pipeline import train_side_by_side

    def args(name: str, **options) -> TrainArgs:
        return TrainArgs(data=str(work / "ext-train"), out=str(tmp_path / name), num_layers=1, steps=6, batch_size=2,
                         lr=3e-3, warmup_steps=2, progress=False, **options)  # fmt: skip

    jobs = {"p-eagle": dict(num_depths=3), "eagle3": dict(num_depths=1, ttt_steps=2)}
    seconds = train_side_by_side([(name, tmp_path / name, args(name, **o)) for name, o in jobs.items()], 2)
    assert set(seconds) == set(jobs) and all(s > 0 for s in seconds.values())
    torch.set_flush_denormal(True)
    try:
        for name, options in jobs.items():
            Trainer(TrainArgs(**{**vars(args(name, **options)), "out": str(tmp_path / f"{name}-here")})).run()
            there = load_file(str(tmp_path / name / "final" / "model.safetensors"))
            here = load_file(str(tmp_path / f"{name}-here" / "final" / "model.safetensors"))
            assert there.keys() == here.keys() and all(torch.equal(there[k], here[k]) for k in there), name
            losses = [[m["loss"] for m in read_metrics(tmp_path / n)] for n in (name, f"{name}-here")]
            assert len(losses[0]) == 6 and losses[0] == losses[1], name
    finally:
        torch.set_flush_denormal(False)
