"""Tables and plots shared by the demo's report and the decoding benchmark: vLLM's acceptance counters as the
published tables report them, and the markdown table and bar plot of decoding configurations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peagle.io import atomic_write_bytes

__all__ = ["HARNESS", "format_goals", "format_report", "format_table", "plot_groups", "plot_rows", "served_acceptance"]

HARNESS = "P-EAGLE harness (cost-aware)"  # the harness's configuration row


def served_acceptance(result: dict[str, Any], depths: int) -> dict[str, Any] | None:
    """vLLM's counters as the published tables report them: the conditional acceptance at position i (accepted at i
    given 1..i-1 accepted) and the acceptance length 1 + accepted / drafts."""
    drafts = result.get("drafts", 0)
    if not drafts:
        return None
    per_pos = list(result["accepted_per_pos"])[:depths] + [0] * max(0, depths - len(result["accepted_per_pos"]))
    conditional, previous = [], drafts
    for v in per_pos:
        conditional.append(v / previous if previous else 0.0)
        previous = v
    return {
        "drafts": drafts,
        "conditional_acceptance": conditional,
        "acceptance_length": 1.0 + result["accepted_tokens"] / drafts,
    }


def _al_cell(r: dict[str, Any]) -> str:
    half = r.get("acceptance_interval")
    return f"{r['acceptance_length']:.2f}" + (f" +- {half:.2f}" if half is not None and half != float("inf") else "")


def _lossless_cell(r: dict[str, Any]) -> str:
    if "lossless" not in r:
        return "-"
    return f"{r['lossless']} ({r['identical_outputs']})"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the rows (with their category, temperature and batch size when they have one). AL: tokens
    emitted per target forward, +- its 95% interval; load: the 1-minute load average before / after, and the cores
    other processes kept busy meanwhile; noisy: more than a quarter of a core (peagle.demo.machine)."""
    grouped = any("category" in r for r in rows)
    head = "| Config | category | T | batch " if grouped else "| Config "
    lines = [
        head + "| tokens/s | AL (95%) | Pos 1..K | draft / verify / other | speedup | lossless | load before / after "
        "(others' cores) |",
        "|---" * (4 if grouped else 1) + "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        split = r.get("split")
        shares = " / ".join(f"{100 * split[k]:.0f}%" for k in ("draft", "verify", "other")) if split else "-"
        positions = " ".join(f"{v:.2f}" for v in r.get("conditional_acceptance", [])) or "-"
        others = r.get("others_busy_cores")
        load = (
            f"{r['load_before'][0]:.1f} / {r['load_after'][0]:.1f}"
            + (f" ({others:.2f})" if others is not None else "")
            + (" **noisy**" if r.get("noisy") else "")
            if "load_before" in r
            else "-"
        )
        group = f"| {r['category']} | {r['temperature']:g} | {r['batch_size']} " if grouped else ""
        lines.append(
            f"| {r['config']} {group}| {r['tokens_per_second']:.1f} | {_al_cell(r)} | {positions} | {shares} | "
            f"{r['speedup']:.2f}x | {_lossless_cell(r)} | {load} |"
        )
    return "\n".join(lines)


def format_goals(goals: list[dict[str, Any]]) -> str:
    """The goals table: value, goal, met (noisy groups are no headline: not judged), the oracle bound."""
    lines = ["| Goal | group | value | goal | met | bound |", "|---|---|---|---|---|---|"]
    for g in goals:
        value = g["value"]
        shown = f"{value:.2f}x" if isinstance(value, float) else str(value)
        met = "noisy: not judged" if g["noisy"] else {True: "yes", False: "**missed**", None: "-"}[g["met"]]
        bound = f"{g['bound']:.2f}x" if g.get("bound") is not None else "-"
        target = f">= {g['target']}x" if isinstance(g["target"], float) else str(g["target"])
        lines.append(f"| {g['goal']} | {g['group']} | {shown} | {target} | {met} | {bound} |")
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    """bench.md: a table per group (batch size and temperature), the goals and the lossless power check."""
    rows = report["rows"]
    parts = []
    for key in dict.fromkeys((r["batch_size"], r["temperature"]) for r in rows):
        members = [r for r in rows if (r["batch_size"], r["temperature"]) == key]
        parts += [f"### batch {key[0]}, temperature {key[1]:g}", "", format_table(members), ""]
    parts += ["### Goals", "", format_goals(report["goals"]), ""]
    for check in report.get("lossless_power", []):
        verdict = "rejected" if check["rejected"] else "**not rejected: the test has no power here**"
        parts.append(
            f"Power of the lossless test at T={check['temperature']:g}: {check['config']}: p = {check['p_value']:.3g} "
            f"({verdict})."
        )
    return "\n".join(parts)


def _color(name: str) -> str:
    if name.startswith("vLLM"):
        return "#7f7f7f"
    if name == HARNESS:
        return "#31a354"
    if name.startswith("P-EAGLE"):
        return "#08519c" if "chain" in name else "#6baed6"
    if name.startswith("EAGLE-3"):
        return "#a63603" if "chain" in name else "#fd8d3c"
    return "#333333"


def plot_rows(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bars of tokens/s (speedup over the target alone on top) and acceptance length per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    colors = [_color(n) for n in names]
    fig, (speed, accept) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.8), sharey=True)
    ys = range(len(rows))
    speed.barh(ys, [r["tokens_per_second"] for r in rows], color=colors)
    for y, r in zip(ys, rows, strict=True):
        speed.text(r["tokens_per_second"], y, f" {r['speedup']:.2f}x", va="center", fontsize=8)
    speed.set_yticks(list(ys), names, fontsize=8)
    speed.invert_yaxis()
    speed.set_xlabel("generated tokens / s")
    accept.barh(ys, [r["acceptance_length"] for r in rows], color=colors)
    accept.set_xlabel("acceptance length (tokens per target forward)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buffer = path.with_suffix(".tmp.png")
    fig.savefig(buffer, dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.read_bytes())
    buffer.unlink()


def plot_groups(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Tokens/s of each configuration per category, one panel per temperature (the first batch size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    batch = rows[0].get("batch_size")
    rows = [r for r in rows if r.get("batch_size") == batch]
    temperatures = list(dict.fromkeys(r.get("temperature", 0.0) for r in rows))
    categories = list(dict.fromkeys(r.get("category", "all") for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5 + 2.5 * len(categories), 4.2), squeeze=False)
    width = 0.8 / max(1, len(configs))
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        for i, name in enumerate(configs):
            speeds = {r.get("category", "all"): r["tokens_per_second"] for r in rows
                      if r["config"] == name and r.get("temperature", 0.0) == temperature}  # fmt: skip
            xs = [c + (i - (len(configs) - 1) / 2) * width for c in range(len(categories))]
            ax.bar(xs, [speeds.get(c, 0.0) for c in categories], width, label=name, color=_color(name))
        ax.set_xticks(range(len(categories)), categories)
        ax.set_title(f"temperature {temperature:g}" + (f", batch {batch}" if batch is not None else ""), fontsize=9)
        ax.set_ylabel("generated tokens / s")
    axes[0][0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buffer = path.with_suffix(".tmp.png")
    fig.savefig(buffer, dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.read_bytes())
    buffer.unlink()
