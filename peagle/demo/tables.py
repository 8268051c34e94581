"""Tables and plots shared by the demo's report and the decoding benchmark: vLLM's acceptance counters as the
published tables report them, and the markdown table and bar plot of decoding configurations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peagle.io import atomic_write_bytes

__all__ = ["HARNESS", "format_table", "plot_rows", "served_acceptance"]

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


def format_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the rows."""
    lines = [
        "| Config | tokens/s | AL | draft / verify / other | speedup | lossless |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        split = r.get("split")
        shares = " / ".join(f"{100 * split[k]:.0f}%" for k in ("draft", "verify", "other")) if split else "-"
        lines.append(
            f"| {r['config']} | {r['tokens_per_second']:.1f} | {r['acceptance_length']:.2f} | {shares} | "
            f"{r['speedup']:.2f}x | {r['lossless']} ({r['identical_outputs']}) |"
        )
    return "\n".join(lines)


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
