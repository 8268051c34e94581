"""The command-line entry point."""

import pytest

from peagle.cli import main


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
