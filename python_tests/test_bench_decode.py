"""`peagle bench decode` end to end on a tiny target and tiny drafters (no vLLM): every configuration's row, the
lossless check against an independent greedy reference, the table, the plot and the JSON."""

from __future__ import annotations

import json

import pytest

from peagle.cli import main
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
    argv += ["--quiet"]
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
    fixed = max(rows[n]["tokens_per_second"] for n in names[1:4])
    assert ratios["harness_tps_over_best_fixed_tps"] == pytest.approx(rows[names[5]]["tokens_per_second"] / fixed)
    assert report["settings"]["prompts"] == 3 and report["settings"]["depth"] == 3
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
