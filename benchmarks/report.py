"""Turns pytest-benchmark JSON files into the ratio table: for each case, every implementation's time and how many
times faster each peagle variant ("peagle", "peagle-...") is than it (ratios measured in the same run, so machine
noise mostly cancels).

    python benchmarks/report.py results.json [more.json ...]                  # plain table on stdout
    python benchmarks/report.py results.json [...] --markdown [--out PATH]    # writes benchmarks/RESULTS.md
    python benchmarks/report.py results.json [...] --compare OLD_RESULTS.md   # ratios that changed by more than 2x

A benchmark names its case and implementation in extra_info {"case": ..., "impl": ...}; its time is the benchmark's best
round (pytest-benchmark's min: baselines timed inside a benchmark are best-of-rounds too, and a mean beside a best would
charge one side alone with the rounds another process slowed down), unless it reports a measured quantity instead
(extra_info {"value": ..., "unit": ..., "better": "higher"}, e.g. the longest trainable sequence): then the row compares
values, the largest being the strongest. Baselines timed inside the same benchmark go in extra_info {"baselines": {name:
seconds}} (same case), and an optional extra_info {"note": ...} explains a row (e.g. what would change a loss). A memory
floor timed in the same run (e.g. a copy of the bytes the op must move) goes in extra_info {"floors": {name: seconds}}:
it is no competitor, so it is shown beside the row with the peagle time as a multiple of it. Peers a run could not
measure (not installed, another interface) are listed in the JSON's "skipped_peers" (see common.skip_peer) and said so
beside their case, or in a row of their own when nothing of the case ran. The markdown file has one row per case (a case
measured again in a later file takes the later times): the fastest peagle implementation against the strongest (fastest)
baseline, the ratio, the other baselines, and the machine (cores, load average at the start and end of the run), the
date and the command of each JSON file. What the file holds below KEEP_MARKER is written by hand and kept.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

OURS = "peagle"
DEFAULT_MARKDOWN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
# Text below this line in the markdown file is written by hand (e.g. what a GPU run will measure) and is kept when the
# tables above it are generated again.
KEEP_MARKER = "<!-- written by hand below this line: report.py --markdown keeps it -->"


def is_ours(impl: str) -> bool:
    return impl == OURS or impl.startswith(OURS + "-")


@dataclass
class Case:
    source: str  # the benchmark file
    name: str
    ms: dict[str, float] = field(default_factory=dict)  # implementation -> time (ms)
    info: dict[str, dict] = field(default_factory=dict)  # implementation -> its other extra_info
    notes: dict[str, str] = field(default_factory=dict)  # implementation -> note (a later run of it replaces it)
    unit: str | None = None  # set when the case compares values (higher is better) instead of times
    skipped: dict[str, str] = field(default_factory=dict)  # peer -> why it was not measured
    floors: dict[str, float] = field(default_factory=dict)  # floor name -> time (ms): what the op cannot beat
    load: float = 0.0  # the highest 1-minute load average its rows were measured under
    cores: int | None = None

    @property
    def noisy(self) -> bool:
        """Measured with the load average above the core count: other processes took the cores it was timed on."""
        return self.cores is not None and self.load > self.cores

    def strongest(self, values: dict[str, float]) -> str:
        return (max if self.unit else min)(values, key=values.get)

    def show(self, value: float) -> str:
        return f"{value:g} {self.unit}" if self.unit else f"{value:.3f}"


def _first_load(value) -> float | None:
    """The 1-minute load average of a recorded load: [1, 5, 15] or "1/5/15" (None when unknown)."""
    if isinstance(value, (list, tuple)) and value:
        return float(value[0])
    if isinstance(value, str) and value and value != "?":
        return float(value.split("/")[0])
    return None


def run_load(data: dict) -> tuple[float | None, int | None]:
    """The highest 1-minute load average a run recorded (start or end) and its core count."""
    machine = data.get("machine_info", {})
    extra = machine.get("peagle", {})
    loads = [_first_load(extra.get("loadavg_start")), _first_load(extra.get("loadavg_end"))]
    loads = [x for x in loads if x is not None]
    return (max(loads) if loads else None), machine.get("cpu", {}).get("count")


def collect_cases(runs: list[dict]) -> list[Case]:
    cases: dict[tuple[str, str], Case] = {}
    for data in runs:
        file_load, file_cores = run_load(data)
        for bench in data["benchmarks"]:
            info = dict(bench.get("extra_info", {}))
            source = bench.get("fullname", bench["name"]).split("::")[0]
            name = info.pop("case", bench.get("group") or bench["name"])
            case = cases.setdefault((source, name), Case(source, name))
            # The row's own load (before / after it ran); the run's, for files written before rows recorded theirs.
            row_loads = [_first_load(info.get(k)) for k in ("load_before", "load_after")]
            row_loads = [x for x in row_loads if x is not None] or ([file_load] if file_load is not None else [])
            if row_loads:
                case.load = max(case.load, *row_loads)
            case.cores = info.get("cores") or file_cores or case.cores
            impl = info.pop("impl", bench["name"])
            baselines = info.pop("baselines", {})
            case.floors.update({name: seconds * 1e3 for name, seconds in info.pop("floors", {}).items()})
            note = info.pop("note", None)
            if "value" in info:
                case.unit = info.pop("unit", "units")
                info.pop("better", None)
                case.ms[impl] = float(info.pop("value"))
            else:
                case.ms[impl] = bench["stats"]["min"] * 1e3
            case.info[impl] = info
            for base, seconds in baselines.items():
                case.ms[base] = seconds * 1e3
            if note:
                case.notes[impl] = note
        for skip in data.get("skipped_peers", []):
            _case_of(cases, skip["source"], skip["case"]).skipped[skip["peer"]] = skip["why"]
    return list(cases.values())


def _case_of(cases: dict[tuple[str, str], Case], file: str, name: str) -> Case:
    """The case of that name from that benchmark file (``file`` is a basename), a new one when none ran."""
    for (source, case_name), case in cases.items():
        if case_name == name and os.path.basename(source) == file:
            return case
    return cases.setdefault((file, name), Case(file, name))


def ratio_rows(data: dict) -> list[dict]:
    """Every implementation of every case, fastest first, with how many times faster each peagle variant is."""
    rows = []
    for case in collect_cases([data]):
        ours = {k: v for k, v in case.ms.items() if is_ours(k)}
        for impl, ms in sorted(case.ms.items(), key=lambda kv: kv[1]):
            speedups = {f"{name} x faster": ms / t for name, t in ours.items() if name != impl}
            rows.append(
                {
                    "case": case.name,
                    "impl": impl,
                    "best_ms": ms,
                    **case.info.get(impl, {}),
                    **speedups,
                    "noisy": case.noisy,
                }
            )
        for peer, why in case.skipped.items():
            rows.append({"case": case.name, "impl": peer, "best_ms": float("nan"), "skipped": why})
    return rows


def format_table(rows: list[dict]) -> str:
    speed_keys = sorted({k for r in rows for k in r if k.endswith(" x faster")})
    extra_keys = sorted({k for r in rows for k in r} - {"case", "impl", "best_ms", *speed_keys})
    header = ["case", "impl", "best ms", *speed_keys, *extra_keys]
    lines = [
        [
            r["case"],
            r["impl"],
            f"{r['best_ms']:.3f}",
            *[f"{r[k]:.1f}x" if k in r else "" for k in speed_keys],
            *[str(r.get(k, "")) for k in extra_keys],
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), *(fmt.format(*line) for line in lines)])


def verdict(baseline_ms: float, ours_ms: float, unit: str | None = None) -> str:
    if unit:  # values, higher is better
        ratio = ours_ms / baseline_ms if baseline_ms else float("inf")
        return f"{ratio:.1f}x more {unit}" if ratio >= 1 else f"**peagle loses: {1 / ratio:.1f}x fewer {unit}**"
    ratio = baseline_ms / ours_ms
    if ratio >= 1:
        return f"{ratio:.1f}x faster"
    return f"**peagle loses: {1 / ratio:.1f}x slower**"


def _ratio(case: Case, theirs: float, ours: float) -> float:
    return ours / theirs if case.unit else theirs / ours


def summary_row(case: Case) -> str:
    """The case's markdown row; a noisy case says so after its file name (load average / cores)."""
    row = _summary_cells(case)
    if case.noisy:
        row = row.replace(" | ", f" (**noisy**: load {case.load:.1f} on {case.cores} cores) | ", 1)
    return row


def _summary_cells(case: Case) -> str:
    ours = {k: v for k, v in case.ms.items() if is_ours(k)}
    theirs = {k: v for k, v in case.ms.items() if not is_ours(k)}
    best_ours = case.strongest(ours) if ours else None
    skipped = [f"{peer}: skipped ({why})" for peer, why in case.skipped.items()]
    cells = [os.path.basename(case.source), case.name]
    if not case.ms:  # nothing of the case ran: only its skipped peers
        return "| " + " | ".join([*cells, "-", "; ".join(skipped), "-", "-", ""]) + " |"
    cells.append(f"{best_ours} {case.show(ours[best_ours])}" if best_ours else "-")
    if best_ours:
        skipped += [f"floor: {k} {v:.3f} (peagle {ours[best_ours] / v:.2f}x it)" for k, v in case.floors.items()]
    if not theirs or best_ours is None:
        others = [f"{k} {case.show(v)}" for k, v in sorted(ours.items(), key=lambda kv: kv[1]) if k != best_ours]
        cells += ["no baseline in this case", "-", "-", ", ".join(others + skipped)]
    else:
        strongest = case.strongest(theirs)
        cells += [strongest, case.show(theirs[strongest]), verdict(theirs[strongest], ours[best_ours], case.unit)]
        others = sorted((k for k in theirs if k != strongest), key=theirs.get)
        cells.append(
            ", ".join(
                [f"{k} {case.show(theirs[k])} ({_ratio(case, theirs[k], ours[best_ours]):.1f}x)" for k in others]
                + skipped
            )
        )
    return "| " + " | ".join(cells) + " |"


def machine_lines(runs: list[tuple[str, dict]]) -> list[str]:
    lines = []
    for path, data in runs:
        machine = data.get("machine_info", {})
        cpu = machine.get("cpu", {})
        extra = machine.get("peagle", {})
        load = extra.get("loadavg_start", "?"), extra.get("loadavg_end", "?")
        lines.append(
            f"- `{path}`: {data.get('datetime', '?')}; {cpu.get('count', '?')} cores "
            f"({cpu.get('brand_raw', '?')}), torch threads {extra.get('torch_threads', '?')}, load average "
            f"(1/5/15 min) {load[0]} at the start and {load[1]} at the end; torch {extra.get('torch', '?')}; "
            f"command: `{extra.get('command', '?')}`"
        )
    return lines


def markdown_report(runs: list[tuple[str, dict]]) -> str:
    cases = collect_cases([data for _, data in runs])
    out = [
        "# peagle benchmark results",
        "",
        "Generated by `python benchmarks/report.py " + " ".join(p for p, _ in runs) + " --markdown` from these runs:",
        "",
        *machine_lines(runs),
        "",
        "Each row: the fastest peagle implementation of the case against the strongest (fastest) baseline measured in",
        "the same run (times in ms, each implementation's best round: pytest-benchmark's min, and baselines timed",
        "inside a benchmark best of a few rounds; rows with a unit compare that measured value instead, the largest",
        "being the strongest).",
        "Ratios come from one run each. A case measured with the load average above the core count is noisy: it is",
        "listed apart below, never as a headline figure.",
        "",
        "| file | case | peagle (ms) | strongest baseline | baseline ms | peagle vs strongest "
        "| other baselines (ms, ratio) |",
        "|---|---|---|---|---|---|---|",
        *(summary_row(case) for case in cases if not case.noisy),
    ]
    noisy = [case for case in cases if case.noisy]
    if noisy:
        out += [
            "",
            "## Noisy rows: measured with the load average above the core count (not headline figures)",
            "",
            "Other processes held the cores while these ran, so their times, and the ratios between times taken at "
            "different moments, are not to be trusted; measure them again on an otherwise idle machine.",
            "",
            "| file | case | peagle (ms) | strongest baseline | baseline ms | peagle vs strongest "
            "| other baselines (ms, ratio) |",
            "|---|---|---|---|---|---|---|",
            *(summary_row(case) for case in noisy),
        ]
    notes = [(case.name, note) for case in cases for note in case.notes.values()]
    if notes:
        out += ["", "## Notes", ""]
        seen = set()
        for name, note in notes:
            if note not in seen:
                seen.add(note)
                out.append(f"- {note} (first: {name})")
    return "\n".join(out) + "\n"


def write_markdown(runs: list[tuple[str, dict]], path: str) -> str:
    """Writes the markdown report to ``path``, keeping the hand-written part of the file there (KEEP_MARKER onward)."""
    text = markdown_report(runs)
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if KEEP_MARKER in old:
            text += "\n" + old[old.index(KEEP_MARKER) :]
    with open(path, "w") as f:
        f.write(text)
    return text


def _ratio_of(verdict_cell: str) -> float | None:
    """peagle's ratio to the strongest baseline from a verdict cell ("4.0x faster", "**peagle loses: 3.0x slower**",
    "8.0x more tokens"): above 1 when peagle wins."""
    text = verdict_cell.strip().strip("*")
    try:
        value = float(text.split("x")[0].split()[-1])
    except (ValueError, IndexError):
        return None
    return 1 / value if "loses" in text else value


def markdown_ratios(text: str) -> dict[tuple[str, str], float]:
    """{(file, case): peagle's ratio} of the rows of a RESULTS.md (its main table and its noisy rows)."""
    ratios = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) >= 7 and cells[0].split(" ")[0].endswith(".py"):
            ratio = _ratio_of(cells[5])
            if ratio is not None:
                ratios[cells[0].split(" ")[0], cells[1]] = ratio
    return ratios


def changed_ratios(old_text: str, runs: list[tuple[str, dict]], factor: float = 2.0) -> list[str]:
    """Markdown rows of the cases whose ratio to the strongest baseline changed by more than ``factor`` between an
    earlier RESULTS.md and these runs."""
    old = markdown_ratios(old_text)
    new = markdown_ratios("\n".join(summary_row(case) for case in collect_cases([data for _, data in runs])))
    lines = ["| file | case | earlier ratio | new ratio | change |", "|---|---|---|---|---|"]
    for key in sorted(old.keys() & new.keys()):
        change = new[key] / old[key]
        if change > factor or change < 1 / factor:
            lines.append(f"| {key[0]} | {key[1]} | {old[key]:.2f}x | {new[key]:.2f}x | {change:.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json_files", nargs="+")
    parser.add_argument("--markdown", action="store_true", help="write the markdown results file (see --out)")
    parser.add_argument("--out", default=DEFAULT_MARKDOWN, help="markdown output path (default: benchmarks/RESULTS.md)")
    parser.add_argument(
        "--compare", default=None, help="an earlier RESULTS.md: list the ratios that changed by more than 2x"
    )
    args = parser.parse_args()
    runs = []
    for path in args.json_files:
        with open(path) as f:
            runs.append((path, json.load(f)))
    if args.compare:
        with open(args.compare) as f:
            print("\n".join(changed_ratios(f.read(), runs)))
    elif args.markdown:
        print(write_markdown(runs, args.out))
    else:
        for _, data in runs:
            print(format_table(ratio_rows(data)))


if __name__ == "__main__":
    main()
