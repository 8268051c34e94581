"""`peagle profile` on the CPU: a versioned cost table with the machine and model identity and a positive time at
every point of its axes, greedy and sampled (how the times compare is the benchmarks' business: a tiny target on a
loaded CPU is noise); the engine decodes with it in mode "harness" (greedy output equal to the target's own)."""

from __future__ import annotations

import json

import pytest
import torch

from peagle.cli import main
from peagle.decode import SpeculativeDecoder
from peagle.decode.harness import COST_TABLE_VERSION, CostTable
from peagle.decode.harness.profile import _draft_times, _timer
from peagle.decode.target import TargetRunner
from peagle.model import save_pretrained
from testkit import greedy_reference, self_distilled_rows, tiny_target, train_tiny_drafter


def test_profile_command_writes_a_cost_table_the_engine_uses(tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_target("llama", seed=5)
        model.save_pretrained(tmp_path / "target")
        drafter = train_tiny_drafter(model, 3, self_distilled_rows(model, sequences=6, length=48, seed=5), steps=20)
        save_pretrained(drafter, tmp_path / "drafter")
        out = tmp_path / "costs.json"
        argv = ["profile", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter")]
        options = ["--batch-sizes", "1,2", "--contexts", "8,24", "--nodes", "1,4,16", "--widths", "1,2"]
        assert main([*argv, *options, "--depths", "2", "--repeats", "2", "--out", str(out), "--quiet"]) == 0
        assert f"cost table (version {COST_TABLE_VERSION}, peagle) written: {out}" in capsys.readouterr().out
        data = json.loads(out.read_text())
        assert data["version"] == COST_TABLE_VERSION
        assert data["machine"]["torch"] == torch.__version__ and data["machine"]["device"] == "cpu"
        assert data["target"]["path"].endswith("target") and data["drafter"]["path"].endswith("drafter")
        assert data["machine"]["backend"] == "peagle" and len(data["target"]["config_sha256"]) == 64
        assert data["drafter"]["weights_bytes"] == (tmp_path / "drafter" / "model.safetensors").stat().st_size
        table = CostTable.load(out)
        assert table.batch_sizes == [1, 2] and table.contexts == [8, 24] and table.verify_nodes == [1, 4, 16]
        verify = torch.tensor(table.verify_s)
        assert list(verify.shape) == [2, 2, 3] and bool((verify > 0).all())
        assert list(torch.tensor(table.draft_s).shape) == [2, 2, 2] and bool((torch.tensor(table.draft_s) > 0).all())
        assert list(torch.tensor(table.pass_s).shape) == [2, 3]
        sampled_verify, sampled_pass = torch.tensor(table.sampled_verify_s), torch.tensor(table.sampled_pass_s)
        assert list(sampled_verify.shape) == [2, 2, 3] and bool((sampled_verify > 0).all())
        assert list(sampled_pass.shape) == [2, 3] and bool((sampled_pass > 0).all())

        prompt = [3, 9, 1, 4]
        decoder = SpeculativeDecoder(model, drafter, "harness", cost_table=out)
        assert decoder.generate([prompt], 24).tokens[0] == greedy_reference(model, prompt, 24)
    finally:
        torch.set_num_threads(threads)


def test_profile_refuses_contexts_past_the_targets_positions(tmp_path, capsys):
    model = tiny_target("llama", seed=5, max_position_embeddings=64)
    model.save_pretrained(tmp_path / "target")
    drafter = train_tiny_drafter(model, 2, self_distilled_rows(model, sequences=2, length=16, seed=5), steps=1)
    save_pretrained(drafter, tmp_path / "drafter")
    argv = ["profile", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--quiet"]
    with pytest.raises(SystemExit) as err:
        main([*argv, "--contexts", "8,56", "--nodes", "1,16", "--out", str(tmp_path / "costs.json")])
    message = capsys.readouterr().err
    assert err.value.code == 2 and "--contexts[1] has 56 tokens and the most --nodes = 16 asks for 16 more" in message
    assert "max_position_embeddings = 64" in message and not (tmp_path / "costs.json").exists()


class _Bar:
    def __init__(self) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n


def test_the_points_of_a_row_take_turns_and_keep_their_places():
    """Each point is the fastest of its timed calls, the row's calls alternating (drift touches them alike), each timed
    call right after an untimed one of the same point (warm, as the engine runs a shape round after round); the draft
    table maps its width-major calls back to [depth][width]."""
    order: list[int] = []
    calls = [lambda i=i: order.append(i) for i in range(3)]
    bar = _Bar()
    times = _timer(torch.device("cpu"), 4, bar)(calls)
    assert order == [0, 1, 2] + [0, 0, 1, 1, 2, 2] * 4 and bar.n == 3  # a warm-up round, then 4 timed rounds
    assert len(times) == 3 and all(t > 0 for t in times)

    model = tiny_target("llama", seed=5)
    drafter = train_tiny_drafter(model, 1, self_distilled_rows(model, sequences=2, length=16, seed=5), steps=1)
    runner = TargetRunner(model, drafter.config.aux_layer_ids)
    table = _draft_times(runner, drafter, 2, [1, 2, 4], 3, lambda calls: [float(i) for i in range(len(calls))])
    assert table == [[float(j * 3 + d) for j in range(3)] for d in range(3)]
