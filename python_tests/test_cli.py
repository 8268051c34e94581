"""The command-line entry point."""

import pytest

from peagle.cli import build_parser, main


def test_example_command_runs_and_checks_against_the_reference(capsys):
    assert main(["example", "--length", "600", "--width", "48", "--depths", "4", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "equal to the PyTorch reference: True" in out
    assert "T = 600 positions" in out


def test_unknown_command_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2


def test_serve_prints_the_vllm_command_for_a_drafter(tmp_path, capsys):
    import json
    import shlex

    drafter = tmp_path / "final"
    drafter.mkdir()
    config = {
        "speculators_model_type": "peagle",
        "speculators_config": {
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
            "verifier": {"name_or_path": "/models/target"},
        },
    }
    (drafter / "config.json").write_text(json.dumps(config))
    assert main(["serve", "--drafter", str(drafter), "--peagle-verify", "--dry-run", "--", "--port", "8001"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("PEAGLE_VLLM_VERIFY=1 vllm serve /models/target --speculative-config ")
    argv = shlex.split(line.split(" ", 1)[1])
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 4, "parallel_drafting": True}
    assert argv[-2:] == ["--port", "8001"]
    with pytest.raises(SystemExit) as exc:  # more tokens than parallel depths
        main(["serve", "--drafter", str(drafter), "--num-speculative-tokens", "5", "--dry-run"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["serve", "--drafter", str(tmp_path / "missing"), "--dry-run"])
    # --harness: the cost table in the speculative config, and vLLM's synchronous scheduler (per-request lengths).
    assert main(["serve", "--drafter", str(drafter), "--harness", "costs.json", "--dry-run"]) == 0
    argv = shlex.split(capsys.readouterr().out.strip())
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["peagle_harness"] == "costs.json" and spec["num_speculative_tokens"] == 4
    assert argv[-1] == "--no-async-scheduling"
    assert (
        main(["serve", "--drafter", str(drafter), "--harness", "c.json", "--dry-run", "--", "--async-scheduling"]) == 0
    )
    argv = shlex.split(capsys.readouterr().out.strip())
    assert "--no-async-scheduling" not in argv and argv[-1] == "--async-scheduling"  # the user's choice stands


def test_profile_options_belong_to_their_backend(tmp_path, capsys):
    common = ["profile", "--target", str(tmp_path), "--drafter", str(tmp_path)]
    for argv, message in (
        ([*common, "--backend", "vllm", "--widths", "1,2"], "--widths: for --backend peagle, not --backend vllm"),
        ([*common, "--steps", "4"], "--steps: for --backend vllm, not --backend peagle"),
        ([*common, "--backend", "vllm", "--llm-args", "[1]"], "--llm-args must be a JSON object"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


# The options of `peagle train` (those from before they were generated from TrainArgs, and the later additions): none
# may go missing or change its name.
TRAIN_FLAGS = """
--data --out --layers --depths --heads --kv-heads --head-dim --intermediate-size --layer-style
--fc-norm --norm-before-fc --norm-output --eh-proj --nope --sliding-window --moe-experts --moe-top-k
--moe-balance-weight --lm-head-rank --lm-head-candidates --lm-head-kl-weight --draft-vocab-size --mask-token-id
--reuse-special-token-as-mask --init-from --ratio --ratio-min --max-anchors --segments --memory-budget-mb --loss
--depth-weights --ttt-steps --ttt-step-weight --steps --epochs --batch-size --micro-batch-size --lr --min-lr-ratio
--warmup-steps --weight-decay --grad-clip --seed --row-order --attention --eval-every --eval-data --eval-rows
--eval-ar-depths --fsdp --save-every --log-every --resume --stream --overwrite --tensorboard --plot --save-grads-step
--quiet""".split()
# The --stream options (StreamArgs), after TrainArgs's.
STREAM_FLAGS = """
--target --tokenizer --producers --producer-backend --queue-rows --seq-len --aux-layers --states-dtype
--max-new-tokens --temperature --top-p --regen-seed --ignore-eos --regen-batch-size --max-records --eval-input
--stream-timeout""".split()


def _train_parser():
    import argparse

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["train"]


def test_train_options_are_the_trainargs_fields():
    import dataclasses

    from peagle.train.stream import StreamArgs
    from peagle.train.trainer import TrainArgs

    actions = [a for a in _train_parser()._actions if a.option_strings != ["-h", "--help"]]
    assert [a.option_strings[0] for a in actions] == TRAIN_FLAGS + STREAM_FLAGS
    names = [f.name for cls in (TrainArgs, StreamArgs) for f in dataclasses.fields(cls)]
    assert [a.dest for a in actions] == names
    # Defaults: the dataclass's, once (no argparse default differs from the field's).
    defaults = {**vars(TrainArgs(data="d", out="o")), **vars(StreamArgs())}
    for action in actions[2:]:
        assert action.default == defaults[action.dest], action.dest
    assert {a.dest: a.choices for a in actions if a.choices} == {
        "layer_style": ("llama", "qwen3"),
        "loss": ("kl", "ce"),
        "row_order": ("shuffled", "stored"),
        "attention": ("sdpa", "sdpa-full", "flex"),
        "producer_backend": ("hf", "vllm"),
        "states_dtype": ("bfloat16", "float16", "float32", "float64"),
    }
    help_text = _train_parser().format_help()
    assert "--save-grads-step" not in help_text and "drafter decoder layers (default 4)" in help_text


def test_train_command_line_becomes_trainargs():
    import dataclasses

    from peagle.train.stream import StreamArgs
    from peagle.train.trainer import TrainArgs

    train_fields = {f.name for f in dataclasses.fields(TrainArgs)}

    argv = ["train", "--data", "ext", "--out", "run", "--layers", "2", "--depths", "5", "--heads", "4", "--kv-heads",
            "2", "--layer-style", "qwen3", "--fc-norm", "--depth-weights", "1,0.5,0.25,0.5,1", "--steps", "7", "--lr",
            "1e-3", "--attention", "sdpa-full", "--resume", "--quiet", "--save-grads-step", "3"]  # fmt: skip
    args = build_parser().parse_args(argv)
    fields = {k: v for k, v in vars(args).items() if k in train_fields}
    assert TrainArgs(**fields) == TrainArgs(
        data="ext", out="run", num_layers=2, num_depths=5, num_heads=4, num_kv_heads=2, layer_style="qwen3",
        fc_norm=True, depth_weights=[1.0, 0.5, 0.25, 0.5, 1.0], steps=7, lr=1e-3, attention="sdpa-full", resume=True,
        progress=False, save_grads_step=3,
    )  # fmt: skip
    plain = build_parser().parse_args(["train", "--data", "ext", "--out", "run"])
    fields = {k: v for k, v in vars(plain).items() if k in train_fields}
    assert TrainArgs(**fields) == TrainArgs("ext", "run")
    argv = ["train", "--stream", "--data", "p.jsonl", "--out", "run", "--target", "t", "--aux-layers", "1,3",
            "--temperature", "0.7", "--producers", "2"]  # fmt: skip
    streamed = build_parser().parse_args(argv)
    fields = {k: v for k, v in vars(streamed).items() if k not in ("command", "func") and k not in train_fields}
    assert StreamArgs(**fields) == StreamArgs(target="t", aux_layers=[1, 3], temperature=0.7, producers=2)
    for bad in (["--loss", "mse"], ["--layers", "two"], []):
        with pytest.raises(SystemExit) as exc:
            main(["train", "--data", "ext", *bad] + (["--out", "run"] if bad else []))
        assert exc.value.code == 2


def test_example_row_is_a_packed_row():
    import torch

    from peagle.cli import _example_row

    for length in (2, 37, 600):
        loss_mask, document_ids = _example_row(torch.Generator().manual_seed(length), length)
        assert loss_mask.shape == document_ids.shape == (length,) and loss_mask.dtype == torch.bool
        used = int((document_ids >= 0).sum())
        assert used >= length - length // 10 and (document_ids[used:] == -1).all()  # one padding tail
        steps = document_ids[1:used] - document_ids[: used - 1]
        assert document_ids[0] == 0 and ((steps == 0) | (steps == 1)).all()  # documents in order, contiguous
        assert not loss_mask[used:].any()
