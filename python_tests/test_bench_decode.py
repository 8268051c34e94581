"""`peagle bench decode` end to end on a tiny target and tiny drafters (no vLLM): every configuration's row, the
lossless check against an independent greedy reference, the table, the plot and the JSON."""

from __future__ import annotations

import json

import pytest

from peagle.cli import main
from peagle.decode import GenerateMetrics, GenerateOutput, RequestStats
from peagle.demo.bench_decode import _engine_row, every_call_speed, fastest_calls, interleaved_calls
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
    root, model = models
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [9, 10], [20, 21, 22]]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    out = root / "out"
    argv = ["bench", "decode", "--target", str(root / "target"), "--drafter", str(root / "peagle")]
    argv += ["--eagle3", str(root / "eagle3"), "--prompts", str(root / "prompts.jsonl"), "--num-prompts", "3"]
    argv += ["--max-new-tokens", "40", "--budgets", "6,12", "--batch-size", "2", "--out", str(out), "--no-vllm"]
    argv += ["--repeats", "2", "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "bench.json").read_text())
    rows = {r["config"]: r for r in report["rows"]}
    names = list(rows)
    assert names[:2] == ["target alone", "P-EAGLE chain"]
    assert [n.split(" (")[0] for n in names[2:4]] == ["P-EAGLE tree 6 nodes", "P-EAGLE tree 12 nodes"]
    assert names[4] == "EAGLE-3 chain" and names[5] == "P-EAGLE harness (cost-aware)" and (out / "costs.json").exists()
    assert names[6].startswith("EAGLE-3 tree ") and len(names) == 7
    # The target alone is the target's own greedy text (Hugging Face generate), and every row reproduces it.
    expected = [greedy_reference(model, p, 40) for p in prompts[:3]]
    assert report["lossless"] is True
    for name, row in rows.items():
        assert row["lossless"] is True and row["identical_outputs"] == "3/3", name
        assert row["generated_tokens"] == 3 * 40 and row["tokens_per_second"] > 0
        assert sum(row["split"].values()) == pytest.approx(1.0)
        assert f"| {name} |" in printed and f"| {name} |" in (out / "bench.md").read_text()
    target = rows["target alone"]
    assert target["acceptance_length"] == 1.0 and target["speedup"] == 1.0 and target["rounds"] == 3 * 39
    # Drafters trained (briefly) on the target's own text get drafts accepted.
    assert all(rows[name]["acceptance_length"] >= 1.0 for name in names[1:])
    assert max(rows[name]["acceptance_length"] for name in names[1:]) > 1.0
    assert len(rows["P-EAGLE chain"]["conditional_acceptance"]) == 3
    assert report["reference_outputs"] == expected
    ratios = report["ratios"]
    assert ratios["tree_al_over_chain_al"] == pytest.approx(
        max(rows[n]["acceptance_length"] for n in names[2:4]) / rows["P-EAGLE chain"]["acceptance_length"]
    )
    assert ratios["vllm_target_tps_over_engine_target_tps"] is None
    # The harness against the fastest fixed configuration it chooses among: plain decoding, the chain, the trees.
    fixed = max(names[:4], key=lambda n: rows[n]["tokens_per_second"])
    assert ratios["best_fixed"] == fixed
    harness = rows[names[5]]
    assert ratios["harness_tps_over_best_fixed_tps"] == pytest.approx(
        harness["tokens_per_second"] / rows[fixed]["tokens_per_second"]
    )
    assert ratios["harness_every_call_over_best_fixed"] == pytest.approx(
        harness["every_call_tokens_per_second"] / rows[fixed]["every_call_tokens_per_second"]
    )
    # Each row counts each batch's fastest of the two passes: at least every call's mean speed.
    assert all(r["tokens_per_second"] >= r["every_call_tokens_per_second"] * (1 - 1e-9) for r in rows.values())
    assert (
        report["settings"]["prompts"] == 3 and report["settings"]["depth"] == 3 and report["settings"]["repeats"] == 2
    )
    assert (out / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_decode_rejects_bad_arguments(models, capsys):
    root, _ = models
    base = ["bench", "decode", "--target", str(root / "target"), "--drafter", str(root / "peagle"), "--no-vllm"]
    with pytest.raises(SystemExit) as err:
        main([*base, "--budgets", "1,8", "--out", str(root / "bad")])
    assert err.value.code == 2 and "--budgets must be node budgets >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--prompts", str(root / "missing.jsonl"), "--out", str(root / "bad")])
    assert "prompts file" in capsys.readouterr().err
    # Past the target's positions (4096): refused before any configuration runs, naming the flag.
    with pytest.raises(SystemExit) as err:
        main([*base, "--max-new-tokens", "4090", "--out", str(root / "bad")])
    message = capsys.readouterr().err
    assert err.value.code == 2 and "--max-new-tokens = 4090 asks for 4090 more" in message
    assert "max_position_embeddings = 4096" in message and not (root / "bad" / "bench.json").exists()


class _RecordingDecoder:
    """Stands in for a SpeculativeDecoder: records its calls in a shared log and echoes the prompts' first tokens
    (or, with ``drift``, a token that changes from call to call, as a decoder whose greedy output is not stable)."""

    def __init__(self, name: str, log: list[tuple[str, int]], drift: bool = False) -> None:
        self.name, self.log, self.drift, self.calls = name, log, drift, 0

    def generate(self, prompts, max_new_tokens, temperature=0.0, seed=0):
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
