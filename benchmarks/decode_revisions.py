"""`peagle bench decode` of two checkouts of peagle, taking turns on the same models and prompts, and each
configuration's tokens/s of the second over the first: a change that must not change decoding speed (a restructuring)
shows ratios at 1 within the noise, which the spread of the repeats of one checkout against itself gives.

    python benchmarks/decode_revisions.py BEFORE_DIR AFTER_DIR --target T --drafter P [--eagle3 E] [--prompts F]
        [--repeats 3] [--out DIR] [--max-new-tokens 88] [--batch-size 1]

Each checkout runs with itself first on PYTHONPATH (its own peagle package; both need a built peagle._C), one thread,
the vLLM rows left out; the runs alternate BEFORE, AFTER, BEFORE, AFTER, ... so that the machine's drift falls on both.
The load average before and after each run is printed: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run_bench(checkout: Path, args: argparse.Namespace, out: Path) -> dict:
    command = [sys.executable, "-m", "peagle.cli", "bench", "decode", "--target", args.target]
    command += ["--drafter", args.drafter, "--no-vllm", "--quiet", "--out", str(out)]
    command += ["--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens)]
    command += ["--batch-size", str(args.batch_size)]
    if args.eagle3:
        command += ["--eagle3", args.eagle3]
    if args.prompts:
        command += ["--prompts", args.prompts]
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    before = os.getloadavg()[0]
    subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    report = json.loads((out / "bench.json").read_text())
    report["load"] = (before, os.getloadavg()[0])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--eagle3", default=None)
    parser.add_argument("--prompts", default=None)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=88)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("build/decode-revisions"))
    args = parser.parse_args(argv)
    speeds: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for repeat in range(args.repeats):
        for name, checkout in (("before", args.before), ("after", args.after)):
            report = run_bench(checkout, args, args.out / f"{name}-{repeat}")
            print(f"{name} run {repeat + 1}: load average {report['load'][0]:.2f} -> {report['load'][1]:.2f}")
            for row in report["rows"]:
                speeds[name].setdefault(row["config"], []).append(row["tokens_per_second"])
    print("\n| config | before tokens/s (runs) | after tokens/s (runs) | after / before (medians) |")
    print("|---|---|---|---|")
    for config, before in speeds["before"].items():
        after = speeds["after"].get(config, [])
        if not after:
            continue
        ratio = statistics.median(after) / statistics.median(before)
        cells = [", ".join(f"{v:.1f}" for v in values) for values in (before, after)]
        print(f"| {config} | {cells[0]} | {cells[1]} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
