"""`peagle bench decode` end to end on a tiny target and tiny drafters (no vLLM): every configuration's row, the
lossless check against an independent greedy reference, the table, the plot and the JSON."""

from __future__ import annotations

import json
import re

import pytest

from peagle.cli import main
from peagle.decode import GenerateMetrics, GenerateOutput, RequestStats
from peagle.demo.bench_decode import _engine_row, every_call_speed, fastest_calls, interleaved_calls
from peagle.demo.machine import OTHERS_NOISY_CORES
from peagle.model import save_pretrained
from testkit import greedy_reference, self_distilled_rows, tiny_target, train_tiny_drafter


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    model = tiny_target("llama", vocab_size=64, seed=1)
    rows = self_distilled_rows(model, sequences=8, length=48)
    model.save_pretrained(root / "target")
    save_pretrained(train_tiny_drafter(model, 3, rows, steps=40), root / "peagle")
    save_pretrained(train_tiny_drafter(model, 1, rows, steps=40), root / "eagle3")
    return root, model


def test_bench_decode_end_to_end(models, capsys):
    """Greedy and sampled groups per category: every configuration's row, the lossless checks (greedy: equal to an
    independent greedy reference; sampled: the two-sample test, whose power check rejects a biased verifier), the
    acceptance intervals, the load beside each row, the ratios, the goals, the table, the plot and the JSON."""
    root, model = models
    prompts = {"a": [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [9, 10]], "b": [[20, 21, 22], [30, 31]]}
    records = [{"prompt_ids": p, "category": c} for c, ps in prompts.items() for p in ps]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = root / "out"
    argv = ["bench", "decode", "--target", str(root / "target"), "--drafter", str(root / "peagle")]
    argv += ["--eagle3", str(root / "eagle3"), "--prompts", str(root / "prompts.jsonl"), "--num-prompts", "2"]
    argv += ["--max-new-tokens", "40", "--budgets", "6,12", "--batch-size", "2", "--out", str(out), "--no-vllm"]
    argv += ["--repeats", "2", "--quiet", "--temperature", "0,1", "--acceptance-requests", "12"]
    argv += ["--lossless-draws", "150"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "bench.json").read_text())
    groups = {}
    for r in report["rows"]:
        groups.setdefault((r["batch_size"], r["temperature"], r["category"]), {})[r["config"]] = r
    assert list(groups) == [(2, 0.0, "a"), (2, 0.0, "b"), (2, 1.0, "a"), (2, 1.0, "b")]
    for (_, temperature, category), rows in groups.items():
        names = list(rows)
        assert names[:2] == ["target alone", "P-EAGLE chain"]
        assert [n.split(" (")[0] for n in names[2:4]] == ["P-EAGLE tree 6 nodes", "P-EAGLE tree 12 nodes"]
        assert names[4] == "EAGLE-3 chain" and names[5] == "P-EAGLE harness (cost-aware)"
        assert names[6].startswith("EAGLE-3 tree ") and len(names) == 7
        for name, row in rows.items():
            assert row["generated_tokens"] == 2 * 40 and row["tokens_per_second"] > 0, name
            assert sum(row["split"].values()) == pytest.approx(1.0)
            assert len(row["load_before"]) == 3 and len(row["load_after"]) == 3 and row["threads"] >= 1
            assert row["others_busy_cores"] >= 0  # Linux: /proc/stat
            assert row["noisy"] == (row["others_busy_cores"] > OTHERS_NOISY_CORES)
            assert row["lossless"] is True, (name, row["identical_outputs"])
        target = rows["target alone"]
        assert target["acceptance_length"] == 1.0 and target["speedup"] == 1.0
        assert target["rounds"] == 2 * 39
        if temperature == 0:
            assert all(row["identical_outputs"] == "2/2" for row in rows.values())
            expected = [greedy_reference(model, p, 40) for p in prompts[category][:2]]
            assert report["reference_outputs"][category] == expected
        else:
            # Drafting rows: the acceptance from the acceptance pass (12 requests), with an interval.
            chain = rows["P-EAGLE chain"]
            assert chain["acceptance_requests"] == 12 and 0 < chain["acceptance_interval"] < 1.0
            assert chain["identical_outputs"].startswith("p = ")
            assert len(chain["conditional_acceptance"]) == 3
    assert any(rows["P-EAGLE chain"]["acceptance_length"] > 1.0 for rows in groups.values())
    # The lossless test has power: the P-EAGLE chain with a biased verifier is rejected.
    (power,) = report["lossless_power"]
    assert power["rejected"] is True and power["p_value"] < 1e-3 and power["temperature"] == 1.0
    # Ratios per group and over the categories together; the goals table.
    ratios = report["ratios"]
    assert set(ratios) == {f"batch 2, T={t}, {c}" for t in (0, 1) for c in "ab"} | {
        f"batch 2, T={t}, mixed" for t in (0, 1)
    }
    rows = groups[2, 0.0, "a"]
    group = ratios["batch 2, T=0, a"]
    trees = [n for n in rows if n.startswith("P-EAGLE tree")]
    best_al = max(trees, key=lambda n: rows[n]["acceptance_length"])
    assert group["tree_al_over_chain_al"] == pytest.approx(
        rows[best_al]["acceptance_length"] / rows["P-EAGLE chain"]["acceptance_length"]
    )
    fixed = max(["target alone", "P-EAGLE chain", *trees], key=lambda n: rows[n]["tokens_per_second"])
    assert group["best_fixed"] == fixed
    mixed = ratios["batch 2, T=0, mixed"]

    def speed(name: str) -> float:  # over both categories
        members = [groups[2, 0.0, c][name] for c in "ab"]
        return sum(m["generated_tokens"] for m in members) / sum(m["seconds"] for m in members)

    totals = {n: speed(n) for n in ["target alone", "P-EAGLE chain", *trees]}
    harness = speed("P-EAGLE harness (cost-aware)")
    assert mixed["best_fixed"] == max(totals, key=totals.get)
    assert mixed["harness_tps_over_best_fixed_tps"] == pytest.approx(harness / max(totals.values()))
    goals = {(g["goal"], g["group"]): g for g in report["goals"]}
    assert goals["every configuration lossless", "all"]["met"] is True
    assert any(group.endswith("mixed") and g["bound"] is not None for (_, group), g in goals.items())
    # Each row counts each batch's fastest of the two passes: at least every call's mean speed.
    for rows in groups.values():
        assert all(r["tokens_per_second"] >= r["every_call_tokens_per_second"] * (1 - 1e-9) for r in rows.values())
    settings = report["settings"]
    assert settings["prompts"] == 2 and settings["depth"] == 3 and settings["repeats"] == 2
    assert settings["categories"] == ["a", "b"] and settings["temperatures"] == [0.0, 1.0]
    assert "### Goals" in printed and "| P-EAGLE chain | a | 1 | 2 |" in printed
    assert "| P-EAGLE chain | b | 0 | 2 |" in (out / "bench.md").read_text()
    assert (out / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "costs.json").is_file()


def test_bench_decode_rejects_bad_arguments(models, capsys):
    root, _ = models
    base = ["bench", "decode", "--target", str(root / "target"), "--drafter", str(root / "peagle"), "--no-vllm"]
    cases = [
        (["--budgets", "1,8"], "--budgets must be node budgets >= 2"),
        (["--prompts", str(root / "missing.jsonl")], "prompts file"),
        (["--temperature", "-0.5"], "--temperature must be finite numbers >= 0"),
        (["--temperature", "1,x"], "--temperature must be comma-separated numbers"),
        (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
        (["--top-p", "1.2"], r"--top-p must be in \(0, 1\]"),
        (["--categories", "code"], "--categories must name distinct categories among random, got code"),
        (["--batch-size", "0"], "--batch-size must be ints >= 1"),
        (["--lossless-draws", "-1"], "--lossless-draws must be an int >= 0"),
        # Past the target's positions (4096): refused before any configuration runs, naming the flag.
        (["--max-new-tokens", "4090"], "--max-new-tokens = 4090 asks for 4090 more: .* max_position_embeddings = 4096"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as err:
            main([*base, *extra, "--out", str(root / "bad")])
        assert err.value.code == 2 and re.search(message, capsys.readouterr().err), extra
    assert not (root / "bad" / "bench.json").exists()
    (root / "cats.jsonl").write_text(json.dumps({"prompt_ids": [1, 2], "category": "code"}) + "\n")
    with pytest.raises(SystemExit):
        main([*base, "--prompts", str(root / "cats.jsonl"), "--categories", "code,math", "--out", str(root / "bad")])
    assert "(unknown: math)" in capsys.readouterr().err


class _RecordingDecoder:
    """Stands in for a SpeculativeDecoder: records its calls in a shared log and echoes the prompts' first tokens
    (or, with ``drift``, a token that changes from call to call, as a decoder whose greedy output is not stable)."""

    def __init__(self, name: str, log: list[tuple[str, int]], drift: bool = False) -> None:
        self.name, self.log, self.drift, self.calls = name, log, drift, 0

    def generate(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        self.log.append((self.name, len(prompts[0])))
        self.calls += 1
        tokens = [[self.calls if self.drift else p[0]] * max_new_tokens for p in prompts]
        requests = [RequestStats(len(p), max_new_tokens, "length", [0] * max_new_tokens, 1) for p in prompts]
        n = max_new_tokens * len(prompts)
        metrics = GenerateMetrics(n, max_new_tokens, n, 1.0, [0.0], 0.0, 0.0, 0.0, 0.0, 1e-3, 1e3)
        return GenerateOutput(tokens, requests, metrics)


def test_interleaved_calls_rotate_the_configurations_call_by_call():
    log: list[tuple[str, int]] = []
    decoders = {name: _RecordingDecoder(name, log) for name in "abc"}
    prompts = [[1] * 2, [2] * 3, [3] * 4, [4] * 5]  # prompt i has length i + 2: the log tells the batches apart
    calls = interleaved_calls(decoders, prompts, 2, 5, passes=2)
    assert log[:3] == [("a", 2), ("b", 2), ("c", 2)]  # the warm-ups: each decoder once, on the first batch
    order = [name for name, _ in log[3:]]
    # Pass 0: batch 0 in order a b c, batch 2 shifted by one; pass 1 starts one further.
    assert order == list("abcbcabcacab")
    assert [length for _, length in log[3:]] == [2] * 3 + [4] * 3 + [2] * 3 + [4] * 3
    assert sorted(calls) == sorted((n, s, t) for n in "abc" for s in (0, 2) for t in (0, 1))
    assert calls["b", 2, 1].tokens == [[3] * 5, [4] * 5] and calls["b", 2, 1].new_tokens == 10


def test_fastest_calls_and_every_call_speed():
    log: list[tuple[str, int]] = []
    calls = interleaved_calls({"a": _RecordingDecoder("a", log)}, [[1], [2]], 1, 4, passes=3)
    seconds = {(0, 0): 3.0, (0, 1): 1.0, (0, 2): 2.0, (1, 0): 1.0, (1, 1): 5.0, (1, 2): 4.0}
    calls = {
        (n, s, t): c._replace(seconds=seconds[s, t], cpu_seconds=9 - seconds[s, t]) for (n, s, t), c in calls.items()
    }
    fastest = fastest_calls(calls, "a", range(3))
    assert [c.seconds for c in fastest] == [1.0, 1.0]  # each batch's fastest pass
    assert [c.cpu_seconds for c in fastest] == [6.0, 4.0]  # ... with the least CPU time of its passes
    assert [c.seconds for c in fastest_calls(calls, "a", [2])] == [2.0, 4.0]
    assert every_call_speed(calls) == {"a": pytest.approx(6 * 4 / 16.0)}


def test_greedy_passes_that_disagree_are_an_error():
    log: list[tuple[str, int]] = []
    calls = interleaved_calls({"a": _RecordingDecoder("a", log, drift=True)}, [[1], [2]], 1, 3, passes=2)
    with pytest.raises(RuntimeError, match="a: greedy passes over the same prompts generated different tokens"):
        _engine_row(calls, "a", 2)
