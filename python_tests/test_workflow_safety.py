"""Issue 19: output directories that cannot mix two runs, arguments checked before any work, and records that name
their line. Every command runs through the CLI as a user would, on a tiny target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from peagle.cli import build_parser, main
from peagle.train.data import iter_prepared_rows
from peagle.train.dataset import ExtractedData
from peagle.train.trainer import TrainArgs, Trainer
from testkit import tiny_chat_jsonl, tiny_llama, tiny_tokenizer

SEQ_LEN = 48


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``peagle ARGV``; argparse-style exits become their code."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    for needle in needles:
        assert needle in err, err


def prepare_argv(work: Path, source: Path, out: Path, *extra: str) -> list[str]:
    return ["prepare-data", "--input", str(source), "--tokenizer", str(work / "target"), "--out", str(out),
            "--seq-len", str(SEQ_LEN), "--rows-per-shard", "2", "--quiet", *extra]  # fmt: skip


def extract_argv(work: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["extract", "--data", str(data), "--target", str(work / "target"), "--out", str(out), "--dtype", "float32",
            "--rows-per-shard", "2", "--layers", "1,2,4", "--quiet", *extra]  # fmt: skip


def train_argv(work: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(work / "ext"), "--out", str(out), "--layers", "1", "--depths", "2", "--quiet",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny target, its chats, their prepared rows and extracted states."""
    root = tmp_path_factory.mktemp("workflow")
    tok = tiny_tokenizer(root / "target")
    tiny_llama(root / "target", vocab_size=len(tok) + 4, hidden=64, seed=1)
    tiny_chat_jsonl(root / "chats.jsonl", 12, seed=2)
    tiny_chat_jsonl(root / "other.jsonl", 10, seed=3)
    assert main(prepare_argv(root, root / "chats.jsonl", root / "prep")) == 0
    assert main(extract_argv(root, root / "prep", root / "ext")) == 0
    return root


def prepared_rows(directory: Path) -> list[list[torch.Tensor]]:
    return [[row[k] for k in sorted(row)] for row in iter_prepared_rows(directory)]


def same_rows(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)
    )


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------------------------
# 1. Output directories that cannot mix two runs


def test_prepare_data_rerun_that_fails_leaves_the_old_data_whole(work, tmp_path, capsys):
    out = tmp_path / "prep"
    assert run_cli(capsys, prepare_argv(work, work / "chats.jsonl", out))[0] == 0
    before = prepared_rows(out)
    # Another dataset that fails at its last line, after several shards' worth of rows.
    bad = tmp_path / "bad.jsonl"
    bad.write_text((work / "other.jsonl").read_text() + "[1, 2]\n")
    for extra in ([], ["--overwrite"]):
        code, _, err = run_cli(capsys, prepare_argv(work, bad, out, *extra))
        assert code == 2, err
        assert same_rows(prepared_rows(out), before), f"{extra}: the directory now mixes two runs"
    # Refused without --overwrite, before anything is written.
    code, _, err = run_cli(capsys, prepare_argv(work, work / "other.jsonl", out))
    assert_one_line_error(code, err, str(out), "--overwrite")
    assert same_rows(prepared_rows(out), before)
    # --overwrite that succeeds replaces the data with exactly the new run's.
    assert run_cli(capsys, prepare_argv(work, work / "other.jsonl", out, "--overwrite"))[0] == 0
    assert run_cli(capsys, prepare_argv(work, work / "other.jsonl", tmp_path / "ref"))[0] == 0
    assert same_rows(prepared_rows(out), prepared_rows(tmp_path / "ref"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "prep", "ref"]  # no staging left behind


def _stray(directory: Path, pattern: str) -> str:
    shards = sorted(directory.glob(pattern))
    name = shards[-1].name.replace(shards[-1].stem[-5:], f"{len(shards) + 3:05d}")
    shutil.copy(shards[0], directory / name)
    return name


def _missing(directory: Path, pattern: str) -> str:
    shard = sorted(directory.glob(pattern))[0]
    shard.unlink()
    return shard.name


def _resized(directory: Path, pattern: str) -> str:
    shards = sorted(directory.glob(pattern))
    shutil.copy(shards[-1], shards[0])  # a shard of the same run that is not the one the manifest lists
    with shards[0].open("ab") as f:
        f.write(b" ")
    return shards[0].name


@pytest.mark.parametrize("damage", [_stray, _missing, _resized])
@pytest.mark.parametrize("kind", ["prepared", "extracted"])
def test_readers_refuse_files_that_differ_from_the_manifest(work, tmp_path, damage, kind):
    source, pattern = (work / "prep", "rows-*.safetensors") if kind == "prepared" else (work / "ext", "states-*")
    directory = tmp_path / kind
    shutil.copytree(source, directory)
    name = damage(directory, pattern)
    with pytest.raises(ValueError, match=name):
        if kind == "prepared":
            list(iter_prepared_rows(directory))
        else:
            ExtractedData(directory)


def test_extract_does_not_resume_over_data_that_changed(work, tmp_path, capsys):
    prep, ext = tmp_path / "prep", tmp_path / "ext"
    shutil.copytree(work / "prep", prep)
    assert run_cli(capsys, extract_argv(work, prep, ext))[0] == 0
    # Same data: the finished extraction stands.
    assert run_cli(capsys, extract_argv(work, prep, ext))[0] == 0
    assert run_cli(capsys, prepare_argv(work, work / "other.jsonl", prep, "--overwrite"))[0] == 0
    code, _, err = run_cli(capsys, extract_argv(work, prep, ext))
    assert_one_line_error(code, err, str(ext), "--overwrite")
    assert run_cli(capsys, extract_argv(work, prep, ext, "--overwrite"))[0] == 0
    data = ExtractedData(ext)
    assert [data.raw(i)["input_ids"].tolist() for i in range(len(data))] == [
        r["input_ids"].tolist() for r in iter_prepared_rows(prep)
    ]
    # A directory that is not an extraction is not written into.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, extract_argv(work, prep, other))
    assert_one_line_error(code, err, str(other), "--overwrite")
    assert (other / "keep.txt").read_text() == "mine"


def test_train_refuses_a_used_out_and_overwrite_starts_clean(work, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(capsys, train_argv(work, out, "--steps", "2", "--save-every", "1"))[0] == 0
    assert (out / "latest.json").exists()
    before = snapshot(out)
    code, _, err = run_cli(capsys, train_argv(work, out, "--steps", "1", "--seed", "1"))
    assert_one_line_error(code, err, str(out), "--overwrite", "--resume")
    assert snapshot(out) == before
    # --overwrite clears the earlier run: a later --resume cannot continue it.
    assert run_cli(capsys, train_argv(work, out, "--steps", "1", "--seed", "1", "--overwrite"))[0] == 0
    assert not (out / "latest.json").exists() and not list(out.glob("checkpoint-*"))
    assert run_cli(capsys, train_argv(work, out, "--steps", "2", "--seed", "1", "--resume"))[0] == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_resume_skips_a_checkpoint_without_trainer_state_and_cleans_temporaries(work, tmp_path):
    common = dict(data=str(work / "ext"), num_layers=1, num_depths=2, steps=4, lr=3e-3, warmup_steps=1,
                  progress=False)  # fmt: skip
    full = Trainer(TrainArgs(out=str(tmp_path / "full"), **common))
    full.run()
    out = tmp_path / "part"
    Trainer(TrainArgs(out=str(out), save_every=2, **common)).run()
    # A save of step 4 that died after its weights: no trainer state, temporaries beside it.
    (out / "checkpoint-0000004" / "trainer_state.pt").unlink()
    shutil.rmtree(out / "final")
    leftovers = [out / ".latest.json.x1.tmp", out / "checkpoint-0000004" / ".model.safetensors.x2.tmp"]
    for path in leftovers:
        path.write_bytes(b"partial")
    resumed = Trainer(TrainArgs(out=str(out), resume=True, **common))
    resumed.run()
    assert not any(path.exists() for path in leftovers)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    for key, value in full.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key


# ---------------------------------------------------------------------------------------------------------------------
# 2. Arguments checked before work starts


BAD_ARGUMENTS = {
    "batch-size 0": (lambda w, t: train_argv(w, t / "new", "--steps", "2", "--batch-size", "0"), "--batch-size"),
    "segments 0": (lambda w, t: train_argv(w, t / "new", "--steps", "2", "--segments", "0"), "--segments"),
    "ratio 2": (lambda w, t: train_argv(w, t / "new", "--steps", "2", "--ratio", "2"), "--ratio"),
    "ratio 0": (lambda w, t: train_argv(w, t / "new", "--steps", "2", "--ratio", "0"), "--ratio"),
    "max-anchors 0": (lambda w, t: train_argv(w, t / "new", "--steps", "2", "--max-anchors", "0"), "--max-anchors"),
    "seed 2^63": (lambda w, t: train_argv(w, t / "new", "--steps", "2", "--seed", str(2**63)), "--seed"),
    "seed -1": (lambda w, t: train_argv(w, t / "new", "--steps", "2", "--seed", "-1"), "--seed"),
    "resume and overwrite": (lambda w, t: train_argv(w, t / "new", "--resume", "--overwrite"), "--overwrite"),
    "train out a file": (lambda w, t: train_argv(w, t / "a-file", "--steps", "2"), "--out"),
    "rows-per-shard 0": (
        lambda w, t: prepare_argv(w, w / "chats.jsonl", t / "new", "--rows-per-shard", "0"),
        "--rows-per-shard",
    ),
    "seq-len 10^12": (
        lambda w, t: prepare_argv(w, w / "chats.jsonl", t / "new", "--seq-len", "1" + "0" * 12),
        "--seq-len",
    ),
    "max-records 0": (
        lambda w, t: prepare_argv(w, w / "chats.jsonl", t / "new", "--max-records", "0"),
        "--max-records",
    ),
    "input a directory": (lambda w, t: prepare_argv(w, w, t / "new"), "--input"),
    "prepare out a file": (lambda w, t: prepare_argv(w, w / "chats.jsonl", t / "a-file"), "--out"),
    "extract rows-per-shard 0": (
        lambda w, t: extract_argv(w, w / "prep", t / "new", "--rows-per-shard", "0"),
        "--rows-per-shard",
    ),
    "extract layers not integers": (lambda w, t: extract_argv(w, w / "prep", t / "new", "--layers", "1,x"), "--layers"),
    "extract out a file": (lambda w, t: extract_argv(w, w / "prep", t / "a-file"), "--out"),
    "prepare out holds the input": (lambda w, t: prepare_argv(w, w / "chats.jsonl", w, "--overwrite"), "--input"),
    "extract out is the data": (lambda w, t: extract_argv(w, w / "prep", w / "prep", "--overwrite"), "--data"),
    "train out holds the data": (lambda w, t: train_argv(w, w, "--overwrite"), "--data"),
    "eval max-rows 0": (
        lambda w, t: ["eval", "--checkpoint", str(t / "ckpt"), "--data", str(w / "ext"), "--max-rows", "0"],
        "--max-rows",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_get_one_line_naming_them_before_any_work(work, tmp_path, capsys, case):
    build, flag = BAD_ARGUMENTS[case]
    (tmp_path / "a-file").write_text("")
    code, _, err = run_cli(capsys, build(work, tmp_path))
    assert_one_line_error(code, err, flag)
    assert not (tmp_path / "new").exists()


def test_the_largest_seed_trains(work, tmp_path, capsys):
    code, _, err = run_cli(capsys, train_argv(work, tmp_path / "run", "--steps", "1", "--seed", str(2**63 - 1)))
    assert code == 0, err


# ---------------------------------------------------------------------------------------------------------------------
# 3. Records that name their line

GOOD = b'{"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4 w5 w6"}]}'
BAD_RECORDS = [
    (b"[1, 2]", "a JSON object"),
    (b'"w1 w2"', "a JSON object"),
    (b"{not json", "not valid JSON"),
    (b'{"messages": "w1 w2"}', "'messages'"),
    (b'{"messages": [{"role": "user", "content": 3}]}', "content"),
    (b'{"text": "w1 \xff w2"}', "UTF-8"),
    (b'{"completion_ids": [1, 100000]}', "outside"),
    (b'{"text": ["w1"]}', "'text'"),
]


@pytest.mark.parametrize(("line", "reason"), BAD_RECORDS)
def test_prepare_data_names_the_file_and_line_of_a_bad_record(work, tmp_path, capsys, line, reason):
    source = tmp_path / "data.jsonl"
    source.write_bytes(GOOD + b"\n\n" + line + b"\n" + GOOD + b"\n")
    code, _, err = run_cli(capsys, prepare_argv(work, source, tmp_path / "out"))
    assert_one_line_error(code, err, f"{source}:3: ", reason)
    assert not (tmp_path / "out").exists()


def test_chats_without_an_assistant_turn_are_counted_and_reported(work, tmp_path, capsys):
    user_only = b'{"messages": [{"role": "user", "content": "w1 w2 w3"}]}'
    source = tmp_path / "data.jsonl"
    source.write_bytes(b"\n".join([GOOD, user_only, GOOD, user_only]) + b"\n")
    code, _, err = run_cli(capsys, prepare_argv(work, source, tmp_path / "out"))
    assert code == 0, err
    assert "2 records" in err and f"{source}:2" in err and "assistant" in err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["skipped_records"] == 2
    # Nothing at all to train: a non-zero exit.
    source.write_bytes(user_only + b"\n" + user_only + b"\n")
    code, _, err = run_cli(capsys, prepare_argv(work, source, tmp_path / "none"))
    assert code == 2 and "Traceback" not in err and "no trained tokens" in err, err
    assert not (tmp_path / "none").exists()


def test_input_help_lists_every_record_form():
    import argparse

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    prep = commands.choices["prepare-data"]
    help_text = next(a.help for a in prep._actions if a.dest == "input")
    for form in ("messages", "conversations", "text", "prompt_ids", "completion_ids", "hf:NAME"):
        assert form in help_text, form
