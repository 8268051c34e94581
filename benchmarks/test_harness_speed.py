"""benchmarks/harness_speed.py: each call's fastest pass counts, the held-out pick of the best fixed configuration
(no winner's curse), the ratio with every call counted, and a run of the whole script on the demo-sized random
models."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.decode import GenerateMetrics, RequestStats
from peagle.decode.harness import CostTable

_spec = importlib.util.spec_from_file_location("harness_speed", Path(__file__).with_name("harness_speed.py"))
harness_speed = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = harness_speed  # NamedTuples look their module up there
_spec.loader.exec_module(harness_speed)
Call = harness_speed.Call


def call(seconds: float, tokens: int = 100, harness_call: str = "") -> Call:
    """A call of one request that accepted one draft a round (two tokens a round)."""
    rounds = tokens // 2
    request = RequestStats(4, tokens, "length", [1] * rounds, 3)
    third = seconds / 3
    metrics = GenerateMetrics(
        tokens, rounds, rounds, 2.0, [1.0, 0.0, 0.0], 0.0, third, third, third, seconds, tokens / seconds,
        harness_call=harness_call,
    )  # fmt: skip
    return Call(seconds, seconds, [[0] * tokens], [request], metrics)


def test_each_call_counts_its_fastest_pass():
    calls = {("a", 0, 0): call(2.0), ("a", 0, 1): call(1.0), ("a", 8, 0): call(1.0), ("a", 8, 1): call(3.0)}
    result = harness_speed.summarize(calls, range(2))["a"]
    assert result.tokens_per_s == pytest.approx(200 / 2.0)
    assert harness_speed.summarize(calls, [1])["a"].tokens_per_s == pytest.approx(200 / 4.0)


def test_held_out_pick_is_scored_on_the_other_passes():
    # Two equally fast chains; each is lucky on one half of the passes. In hindsight the harness looks slower than the
    # best of them; picked on one half and scored on the other, it is as fast as either.
    seconds = {"chain 1": [0.8, 1.0, 1.0, 1.0], "chain 2": [1.0, 0.8, 1.0, 1.0], "harness": [1.0, 1.0, 1.0, 1.0]}
    calls = {(name, 0, turn): call(s) for name, times in seconds.items() for turn, s in enumerate(times)}
    hindsight = harness_speed.summarize(calls, range(4))
    best = harness_speed.best_of(hindsight, "chain")
    assert hindsight["harness"].tokens_per_s / hindsight[best].tokens_per_s == pytest.approx(0.8)
    ratio, picks = harness_speed.held_out_ratio(calls, 4, "chain")
    # Halves: passes {0, 2} pick chain 1 (0.8 s), scored on {1, 3}: 1.0 s; passes {1, 3} pick chain 2, scored on
    # {0, 2}: 1.0 s. Both ratios are 1.
    assert picks == ["chain 1", "chain 2"] and ratio == pytest.approx(1.0)
    with pytest.raises(ValueError, match="passes >= 2"):
        harness_speed.held_out_ratio(calls, 1, "chain")


def test_every_call_ratio_counts_the_slow_passes_that_the_fastest_pass_hides():
    # The harness's first pass of each prompt is a slow probe; its other pass is as fast as the best chain's.
    seconds = {"chain 1": [1.0, 1.0], "chain 2": [1.2, 1.2], "harness": [3.0, 1.0], "tree 8": [2.0, 2.0]}
    calls = {(name, 0, turn): call(s) for name, times in seconds.items() for turn, s in enumerate(times)}
    calls.update({(name, 8, turn): c for (name, _, turn), c in list(calls.items())})  # a second prompt alike
    fastest = harness_speed.summarize(calls, range(2))
    assert fastest["harness"].tokens_per_s == pytest.approx(fastest["chain 1"].tokens_per_s)
    assert harness_speed.every_call_ratio(calls, "chain") == (pytest.approx(2.0 / 4.0), "chain 1")
    assert harness_speed.every_call_ratio(calls, "tree") == (pytest.approx(4.0 / 4.0), "tree 8")


def test_the_script_runs_on_the_random_models(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), str(Path(__file__).parent)]))
    args = ["--prompts", "2", "--new-tokens", "6", "--batch-sizes", "1", "--passes", "2", "--budgets", "8"]
    args += ["--pruned-budgets", "8", "--temperature", "0,1"]
    args += ["--costs-out", str(tmp_path / "costs.json"), "--trace"]
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("harness_speed.py")), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "costs.json").is_file()
    lines = out.stdout.splitlines()
    rows = [line.split() for line in lines if len(line.split()) > 5]
    # batch, temperature, category, config...
    assert any(row[1:5] == ["0", "random", "chain", "0"] for row in rows)
    assert any(row[1:6] == ["1", "random", "tree", "8", "pruned"] for row in rows)
    held_out = [line for line in lines if "picked on the other passes" in line]
    assert len(held_out) == 2 * 2 and all(math.isfinite(float(line.split(": ")[1].split("x")[0])) for line in held_out)
    every_call = [line for line in lines if "every call of every pass counted" in line]
    assert len(every_call) == 2 * 2
    assert all(math.isfinite(float(line.split(": ")[1].split("x")[0])) for line in every_call)
    traced = [line.split()[7] for line in lines if " prompt " in line and line.split()[3] == "pass"]
    assert len(traced) == 2 * 2 * 2 and set(traced) <= {"draft", "probe", "plain", "control"}  # 2 T x 2 passes x 2
    loads = [line for line in lines if "load average" in line and "thread(s)" in line]
    assert len(loads) == 2  # one per group (batch, temperature, category)
    mixed = [line for line in lines if "best single fixed configuration over the categories" in line]
    assert len(mixed) == 2 and all("goal >= 1.05x" in line for line in mixed)


def test_bad_sampling_options_are_refused_naming_the_option(tmp_path):
    script = str(Path(__file__).with_name("harness_speed.py"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), str(Path(__file__).parent)]))
    for extra, message in ((["--temperature", "-1"], "--temperature must be"), (["--top-p", "0"], "--top-p must")):
        out = subprocess.run([sys.executable, script, *extra], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 2 and message in out.stderr, out.stderr[-1000:]


def test_the_trace_lists_every_harness_call_against_the_fixed_configuration():
    calls = {
        ("chain 1", 0, 0): call(1.0),
        ("harness", 0, 0): call(2.0, harness_call="draft"),
        ("chain 1", 8, 0): call(1.0),
        ("harness", 8, 0): call(0.5, harness_call="control"),
    }
    lines = harness_speed.call_trace(calls, "chain 1")
    assert [line.split()[4] for line in lines] == ["draft", "control"]
    assert lines[0].endswith("(0.50x)") and lines[1].endswith("(2.00x)") and " prompt   8 " in lines[1]


def test_a_loaded_cost_table_names_the_batch_sizes_it_was_not_profiled_at():
    table = CostTable([4, 16], [0], [1], [[[1.0]], [[2.0]]], [1], [[[1.0]], [[2.0]]])
    assert harness_speed.unprofiled_warning(table, [4, 16], "costs.json") is None
    warning = harness_speed.unprofiled_warning(table, [1, 4, 32], "costs.json")
    assert "profiled at batch sizes [4, 16]" in warning
    assert "batch sizes [1, 32] plan with the costs of batch sizes [4, 16]" in warning
