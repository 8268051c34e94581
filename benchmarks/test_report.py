"""benchmarks/report.py: the strongest baseline of each case, the ratio, losses said plainly, machine and command."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("bench_report", Path(__file__).with_name("report.py"))
report = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = report  # dataclasses look their module up there
_spec.loader.exec_module(report)


def bench(case: str, impl: str, seconds: float, **extra) -> dict:
    return {
        "name": f"test[{impl}]",
        "fullname": f"benchmarks/bench_x.py::test[{impl}]",
        "group": None,
        "stats": {"min": seconds, "mean": 3 * seconds},  # the best round counts, as baselines' best-of-rounds
        "extra_info": {"case": case, "impl": impl, **extra},
    }


RUN = {
    "datetime": "2026-11-30T18:00:00",
    "machine_info": {
        "cpu": {"count": 2, "brand_raw": "Test CPU"},
        "peagle": {"command": "python -m pytest benchmarks/bench_x.py", "loadavg_start": "1.00/2.00/3.00"},
    },
    "benchmarks": [
        bench("win", "peagle", 0.001, baselines={"slow": 0.1, "fast": 0.004}, note="why it wins"),
        bench("win", "peagle-op", 0.002, floors={"copy": 0.0005}),
        bench("lose", "peagle", 0.006),
        bench("lose", "rival", 0.002),
    ],
}


def test_markdown_names_the_strongest_baseline_and_says_where_peagle_loses():
    text = report.markdown_report([("run.json", RUN)])
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| bench_x.py")}
    win = rows["win"].split(" | ")
    assert win[2] == "peagle 1.000" and win[3] == "fast" and win[4] == "4.000" and win[5] == "4.0x faster"
    assert "slow 100.000 (100.0x)" in win[6]
    assert "floor: copy 0.500 (peagle 2.00x it)" in win[6]  # a floor is shown, never the strongest baseline
    lose = rows["lose"].split(" | ")
    assert lose[3] == "rival" and "peagle loses: 3.0x slower" in lose[5]
    assert (
        "2 cores (Test CPU)" in text and "1.00/2.00/3.00" in text and "python -m pytest benchmarks/bench_x.py" in text
    )
    assert "- why it wins (first: win)" in text


def test_plain_table_lists_every_implementation_fastest_first():
    rows = report.ratio_rows(RUN)
    assert [r["impl"] for r in rows if r["case"] == "win"] == ["peagle", "peagle-op", "fast", "slow"]
    slow = next(r for r in rows if r["impl"] == "slow")
    assert round(slow["peagle x faster"]) == 100 and round(slow["peagle-op x faster"]) == 50


def test_value_cases_compare_the_largest_value():
    """Cases that report a value (higher is better, e.g. the longest trainable T) compare values, not times."""

    def longest(impl, value, seconds):
        return bench("longest", impl, seconds, value=value, unit="tokens", better="higher")

    run = dict(RUN, benchmarks=[longest("peagle-S1", 4096, 1.0), longest("peagle-S4", 16384, 9.0),
                                longest("spec", 2048, 0.1), longest("other", 1024, 0.01)])  # fmt: skip
    row = next(line for line in report.markdown_report([("r.json", run)]).splitlines() if "| longest |" in line)
    cells = row.split(" | ")
    assert cells[2] == "peagle-S4 16384 tokens" and cells[3] == "spec" and cells[4] == "2048 tokens"
    assert cells[5] == "8.0x more tokens" and "other 1024 tokens (16.0x)" in cells[6]
    losing = dict(run, benchmarks=[longest("peagle-S1", 1024, 1.0), longest("spec", 4096, 1.0)])
    row = next(line for line in report.markdown_report([("r.json", losing)]).splitlines() if "| longest |" in line)
    assert "**peagle loses: 4.0x fewer tokens**" in row


def test_a_case_measured_by_two_peer_benchmarks_is_one_row_against_the_strongest():
    """bench_peers_cuda.py times the same chain case once per peer (flashinfer's, vLLM's): one row, both baselines."""
    flashinfer = bench("chain", "peagle", 0.002, baselines={"flashinfer": 0.004})
    vllm = bench("chain", "peagle", 0.002, baselines={"vllm core": 0.003, "vllm forward": 0.01})
    run = dict(RUN, benchmarks=[flashinfer, vllm])
    rows = [line for line in report.markdown_report([("r.json", run)]).splitlines() if "| chain |" in line]
    assert len(rows) == 1
    cells = rows[0].split(" | ")
    assert cells[3] == "vllm core" and cells[5] == "1.5x faster", cells
    assert "flashinfer 4.000 (2.0x)" in cells[6] and "vllm forward 10.000 (5.0x)" in cells[6], cells


def test_skipped_peers_are_said_beside_their_case_or_in_a_row_of_their_own():
    skipped = [
        {"source": "bench_x.py", "case": "win", "peer": "flashinfer", "why": "flashinfer not installed"},
        {"source": "bench_x.py", "case": "gdn", "peer": "fla", "why": "fla not installed"},
    ]
    run = dict(RUN, skipped_peers=skipped)
    rows = {line.split(" | ")[1]: line for line in report.markdown_report([("r.json", run)]).splitlines()
            if line.startswith("| bench_x.py")}  # fmt: skip
    win = rows["win"].split(" | ")
    assert win[3] == "fast" and "flashinfer: skipped (flashinfer not installed)" in win[6], win
    gdn = rows["gdn"].split(" | ")
    assert gdn[2] == "-" and gdn[3] == "fla: skipped (fla not installed)", gdn
    plain = [r for r in report.ratio_rows(run) if r.get("skipped")]
    assert [(r["case"], r["impl"]) for r in plain] == [("win", "flashinfer"), ("gdn", "fla")]


def test_a_run_puts_its_skipped_peers_in_the_json(tmp_path):
    """common.skip_peer skips the benchmark and conftest.py writes why into the --benchmark-json file."""
    here = Path(__file__).parent
    (tmp_path / "bench_skips.py").write_text(
        "from common import skip_peer\n\n"
        "def test_timed(benchmark):\n"
        "    benchmark.extra_info.update(impl='peagle', case='c')\n"
        "    benchmark(lambda: None)\n\n"
        "def test_peer(benchmark):\n"
        "    skip_peer(__file__, 'c', 'rival', 'rival not installed')\n"
    )
    out = tmp_path / "run.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path / "bench_skips.py"), "-q", "-rs", "-p", "conftest",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "--benchmark-json", str(out)],
        capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0 and "skipped: rival not installed" in run.stdout, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert data["skipped_peers"] == [
        {"source": "bench_skips.py", "case": "c", "peer": "rival", "why": "rival not installed"}
    ]
    assert "rival: skipped (rival not installed)" in report.markdown_report([("run.json", data)])


def test_markdown_keeps_the_hand_written_part_of_the_file(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# old tables\n| stale |\n\n" + report.KEEP_MARKER + "\n## By hand\nno figures yet\n")
    report.write_markdown([("run.json", RUN)], str(path))
    text = path.read_text()
    assert "| stale |" not in text and "| bench_x.py | win |" in text
    assert text.endswith(report.KEEP_MARKER + "\n## By hand\nno figures yet\n")
    report.write_markdown([("run.json", RUN)], str(path))  # again: the hand-written part is not doubled
    assert path.read_text() == text


def test_rows_measured_above_the_core_count_are_noisy_and_never_headline():
    """A row's own load (recorded per benchmark by conftest.py) decides; a file without per-row loads falls back to
    the run's start and end load. Noisy cases leave the main table for the "Noisy rows" section."""
    quiet = bench("quiet", "peagle", 0.001, baselines={"rival": 0.002}, load_before=[0.5, 0.4, 0.3],
                  load_after=[1.2, 0.5, 0.3], cores=2)  # fmt: skip
    loaded = bench("loaded", "peagle", 0.001, baselines={"rival": 0.1}, load_before=[1.0, 1, 1],
                   load_after=[3.5, 2, 1], cores=2)  # fmt: skip
    run = dict(RUN, benchmarks=[quiet, loaded])
    text = report.markdown_report([("run.json", run)])
    main, _, noisy = text.partition("## Noisy rows")
    assert "| quiet |" in main and "| loaded |" not in main
    assert "| bench_x.py (**noisy**: load 3.5 on 2 cores) | loaded |" in noisy and "| quiet |" not in noisy
    # An older file: no per-row loads, the run's load (8.5 at the start on 2 cores) marks every case noisy.
    old = dict(RUN, benchmarks=[bench("old", "peagle", 0.001, baselines={"rival": 0.002})])
    old["machine_info"] = {**RUN["machine_info"], "peagle": {**RUN["machine_info"]["peagle"],
                                                             "loadavg_start": "8.50/7.62/6.15"}}  # fmt: skip
    main, _, noisy = report.markdown_report([("old.json", old)]).partition("## Noisy rows")
    assert "| old |" not in main and "load 8.5 on 2 cores" in noisy
    assert report.markdown_report([("run.json", RUN)]).count("## Noisy rows") == 0  # load 1.0 on 2 cores: fine
    assert [r["noisy"] for r in report.ratio_rows(run) if r["impl"] == "peagle"] == [False, True]


def test_conftest_records_the_load_and_threads_of_every_benchmark(tmp_path):
    """A benchmark run through benchmarks/conftest.py gets load_before / load_after / torch_threads / cores."""
    test = tmp_path / "bench_probe.py"
    test.write_text(
        "def test_probe(benchmark):\n    benchmark.extra_info['case'] = 'probe'\n    benchmark(sum, [1, 2])\n"
    )
    (tmp_path / "conftest.py").write_text((Path(__file__).with_name("conftest.py")).read_text())
    (tmp_path / "common.py").write_text("SKIPPED_PEERS = []\n")
    out = tmp_path / "probe.json"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider", "--benchmark-json", str(out)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    info = json.loads(out.read_text())["benchmarks"][0]["extra_info"]
    assert len(info["load_before"]) == 3 and len(info["load_after"]) == 3
    assert info["torch_threads"] >= 1 and info["cores"] >= 1 and info["case"] == "probe"


def test_compare_lists_the_ratios_that_changed_by_more_than_2x():
    old = report.markdown_report([("run.json", RUN)])  # win: 4.0x faster; lose: 3.0x slower
    faster = dict(RUN, benchmarks=[
        bench("win", "peagle", 0.001, baselines={"fast": 0.0015}),  # 1.5x: changed 2.7x down
        bench("lose", "peagle", 0.006), bench("lose", "rival", 0.004),  # 1.5x slower: changed 2x up (not more)
    ])  # fmt: skip
    assert report.markdown_ratios(old) == {("bench_x.py", "win"): 4.0, ("bench_x.py", "lose"): 1 / 3}
    lines = report.changed_ratios(old, [("new.json", faster)])
    assert lines[2:] == ["| bench_x.py | win | 4.00x | 1.50x | 0.38x |"]
