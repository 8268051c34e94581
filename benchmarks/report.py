"""Turns a pytest-benchmark JSON file into the ratio table: for each case, every implementation's mean time and how
many times faster each peagle variant ("peagle", "peagle-...") is than it (ratios measured in the same run, so machine
noise mostly cancels).

    python benchmarks/report.py results.json [--markdown]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

OURS = "peagle"


def ratio_rows(data: dict) -> list[dict]:
    cases: dict[str, dict[str, dict]] = defaultdict(dict)
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        cases[info.get("case", bench["group"] or bench["name"])][info.get("impl", bench["name"])] = {
            "mean_ms": bench["stats"]["mean"] * 1e3,
            **{k: v for k, v in info.items() if k not in ("impl", "case")},
        }
    rows = []
    for case, impls in cases.items():
        ours = {k: v["mean_ms"] for k, v in impls.items() if k.startswith(OURS)}
        for impl, stats in sorted(impls.items(), key=lambda kv: kv[1]["mean_ms"]):
            speedups = {f"{name} x faster": stats["mean_ms"] / ms for name, ms in ours.items() if name != impl}
            rows.append({"case": case, "impl": impl, **stats, **speedups})
    return rows


def format_table(rows: list[dict], markdown: bool) -> str:
    speed_keys = sorted({k for r in rows for k in r if k.endswith(" x faster")})
    extra_keys = sorted({k for r in rows for k in r} - {"case", "impl", "mean_ms", *speed_keys})
    header = ["case", "impl", "mean ms", *speed_keys, *extra_keys]
    lines = [
        [
            r["case"],
            r["impl"],
            f"{r['mean_ms']:.3f}",
            *[f"{r[k]:.1f}x" if k in r else "" for k in speed_keys],
            *[str(r.get(k, "")) for k in extra_keys],
        ]
        for r in rows
    ]
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), *(fmt.format(*line) for line in lines)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json_file")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    with open(args.json_file) as f:
        print(format_table(ratio_rows(json.load(f)), args.markdown))


if __name__ == "__main__":
    main()
