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
