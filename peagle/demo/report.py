"""The demo's report: the per-position acceptance table (offline and measured by vLLM), the greedy lossless check,
tokens/s and speedup in vLLM, as markdown, JSON and PNG plots."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from peagle.demo.tables import format_table, plot_rows, served_acceptance
from peagle.io import atomic_write_bytes, atomic_write_json

__all__ = ["acceptance_rows", "engine_rows", "serving_rows", "write_report"]


def _cells(values: list[float], k: int) -> list[str]:
    return [f"{v:.3f}" for v in values] + ["-"] * (k - len(values))


def _plots(out: Path, table: list[dict[str, Any]], serving: list[dict[str, Any]], k: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(8, 4.6))
    width = 0.8 / max(1, len(table))
    # A colour family per drafter (blues: P-EAGLE, oranges: EAGLE-3), darker = offline, lighter = vLLM.
    shades = {"P-EAGLE": ["#08519c", "#4292c6", "#9ecae1"], "EAGLE-3": ["#a63603", "#f16913", "#fdae6b"]}
    used: dict[str, int] = {}
    for i, row in enumerate(table):
        xs = [p + 1 + (i - (len(table) - 1) / 2) * width for p in range(len(row["conditional_acceptance"]))]
        family = shades.get(row["drafter"], ["#555", "#888", "#bbb"])
        color = family[min(used.get(row["drafter"], 0), len(family) - 1)]
        used[row["drafter"]] = used.get(row["drafter"], 0) + 1
        label = f"{row['drafter']} ({row['measured']}, AL {row['acceptance_length']:.2f})"
        ax.bar(xs, row["conditional_acceptance"], width, label=label, color=color)
    ax.set_xticks(range(1, k + 1), [f"Pos {p}" for p in range(1, k + 1)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("conditional acceptance")
    ax.set_title("Per-position acceptance on the held-out split")
    ax.legend(fontsize=7.5, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)
    files.append("acceptance.png")
    if serving:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = [s["config"] for s in serving]
        ax.bar(names, [s["tokens_per_second"] for s in serving], color=["#888", "#1f77b4", "#ff7f0e"][: len(names)])
        for i, s in enumerate(serving):
            ax.text(i, s["tokens_per_second"], f"{s['speedup']:.2f}x", ha="center", va="bottom")
        ax.set_ylabel("generated tokens / s")
        ax.set_title("vLLM-CPU greedy decoding")
        fig.tight_layout()
        fig.savefig(out / "throughput.png", dpi=110)
        plt.close(fig)
        files.append("throughput.png")
    return files


def acceptance_rows(offline: dict[str, dict[str, Any]], served: dict[str, dict[str, Any]], k: int) -> list[dict]:
    """The acceptance table: per drafter, the offline rows (every position, serving walk) and vLLM's counters."""
    table = []
    for name in ("P-EAGLE", "EAGLE-3"):
        if name in offline:
            r = offline[name]
            drafting = r.get("drafting", "parallel")
            table.append(
                {
                    "drafter": name,
                    "measured": "offline",
                    "drafting": drafting,
                    "conditional_acceptance": r["conditional_acceptance"],
                    "acceptance_length": r["acceptance_length"],
                    "chains": r["chains"],
                }
            )
            if "serving_walk" in r:
                walk = r["serving_walk"]
                table.append(
                    {
                        "drafter": name,
                        "measured": "offline (serving walk)",
                        "drafting": drafting,
                        "conditional_acceptance": walk["conditional_acceptance"],
                        "acceptance_length": walk["acceptance_length"],
                        "drafts": walk["drafts"],
                    }
                )
        if name in served:
            s = served_acceptance(served[name], k)
            if s is not None:
                table.append({"drafter": name, "measured": "vLLM", **s})
    return table


def serving_rows(served: dict[str, dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """One row per served configuration: tokens/s, speedup over no speculation, lossless check, AL."""
    serving = []
    for name, r in served.items():
        # Against no speculation at the same concurrency (rows of further levels end " @ C at once").
        reference = served.get("no speculation" + name[name.index(" @ ") :] if " @ " in name else "no speculation")
        entry = {
            "config": name,
            "tokens_per_second": r["tokens_per_second"],
            "generated_tokens": r["generated_tokens"],
            "seconds": r["seconds"],
            "startup_seconds": r["startup_seconds"],
            "speedup": r["tokens_per_second"] / reference["tokens_per_second"] if reference else None,
        }
        if reference is not None and reference is not r:
            same = [a == b for a, b in zip(r["outputs"], reference["outputs"], strict=True)]
            entry["lossless"] = all(same)
            entry["identical_outputs"] = f"{sum(same)}/{len(same)}"
        acc = served_acceptance(r, k)
        entry["acceptance_length"] = acc["acceptance_length"] if acc else None
        serving.append(entry)
    return serving


def _served_equals_offline(reference: dict[str, Any] | None, heldout_completions: list[list[int]] | None) -> int | None:
    """How many of vLLM's greedy outputs (no speculation) equal the self-distilled continuation of the same held-out
    prompt (over the served length): when all do, the served text is the offline text."""
    if reference is None or not heldout_completions:
        return None
    outs = reference["outputs"]
    return sum(o == c[: len(o)] for o, c in zip(outs, heldout_completions, strict=False))


def _al_agreement(table: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per drafter: vLLM's AL divided by each offline AL."""
    agreement = {}
    for name in ("P-EAGLE", "EAGLE-3"):
        rows = {row["measured"]: row for row in table if row["drafter"] == name}
        if "vLLM" in rows:
            agreement[name] = {
                measured: rows["vLLM"]["acceptance_length"] / rows[measured]["acceptance_length"]
                for measured in ("offline", "offline (serving walk)")
                if measured in rows
            }
    return agreement


def write_report(
    out: Path,
    spec,
    target_info: dict[str, Any],
    offline: dict[str, dict[str, Any]],
    served: dict[str, dict[str, Any]],
    stages: dict[str, float],
    cached: list[str],
    total_seconds: float,
    train_budgets: dict[str, dict[str, Any]],
    distill: dict[str, Any] | None = None,
    heldout_completions: list[list[int]] | None = None,
    load: dict[str, Any] | None = None,
    when_run: dict[str, float] | None = None,
    engine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Writes report.json, report.md and the plots into ``out``; returns the report. ``train_budgets``: per drafter,
    what its training spent (``peagle.demo.pipeline.train_budget``). ``engine``: the decoding engine's bench report
    (:func:`peagle.demo.bench_decode.bench_decode`)."""
    out.mkdir(parents=True, exist_ok=True)
    k = spec.depths
    table = acceptance_rows(offline, served, k)
    serving = serving_rows(served, k)
    reference = served.get("no speculation")
    same_text = _served_equals_offline(reference, heldout_completions)
    report = {
        "depths": k,
        "distill": distill,
        "served_equals_offline_text": f"{same_text}/{len(reference['outputs'])}" if same_text is not None else None,
        "al_vllm_over_offline": _al_agreement(table),
        "machine_load": load,
        "target": target_info,
        "settings": {key: v for key, v in asdict(spec).items() if key != "target"},
        "acceptance": table,
        "offline": offline,
        "serving": serving,
        "engine": engine_rows(engine),
        "lossless": _lossless(serving, engine),
        "train_budgets": train_budgets,
        "train_seconds": {name: budget["seconds"] for name, budget in train_budgets.items()},
        "stage_seconds": stages,
        "cached_stages": cached,
        "stage_seconds_when_run": when_run or {},
        "total_seconds": total_seconds,
    }
    report["plots"] = _plots(out, table, serving, k) + _engine_plot(out, engine)
    atomic_write_json(out / "report.json", report)
    lines = ["# peagle demo report", ""]
    lines += _setup_lines(spec, target_info, distill, train_budgets)
    lines += _acceptance_lines(spec, report, same_text, len(reference["outputs"]) if reference else None)
    lines += _serving_lines(spec, serving, len(reference["outputs"]) if reference else None)
    lines += _engine_lines(engine, report["engine"])
    lines += _timing_lines(stages, cached, when_run, total_seconds, load)
    lines += [""] + [f"![{p}]({p})" for p in report["plots"]] + [""]
    atomic_write_bytes(out / "report.md", "\n".join(lines).encode())
    return report


def engine_rows(engine: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The engine rows of the report: target alone, P-EAGLE chain, the fastest P-EAGLE tree, the cost-aware harness,
    EAGLE-3 chain and tree."""
    if engine is None:
        return []
    best_tree = engine["ratios"]["best_tree"]
    return [
        r
        for r in engine["rows"]
        if not r["config"].startswith("P-EAGLE tree") or r["config"] == best_tree
        if not r["config"].startswith("vLLM")
    ]


def _lossless(serving: list[dict[str, Any]], engine: dict[str, Any] | None) -> bool | None:
    """Every speculative output equals its reference (vLLM without speculation; the engine's target alone)."""
    checks = [s["lossless"] for s in serving if "lossless" in s]
    checks += [r["lossless"] for r in engine["rows"]] if engine is not None else []
    return all(checks) if checks else None


def _engine_plot(out: Path, engine: dict[str, Any] | None) -> list[str]:
    if engine is None:
        return []

    settings = engine["settings"]
    title = f"peagle decoding engine, greedy: {settings['prompts']} prompts x {settings['max_new_tokens']} tokens"
    plot_rows(engine["rows"], out / "decode.png", title)
    return ["decode.png"]


def _engine_lines(engine: dict[str, Any] | None, rows: list[dict[str, Any]]) -> list[str]:
    """The decoding engine's table (the fastest P-EAGLE tree of the budgets; decode.png shows them all)."""
    if engine is None:
        return []

    s, ratios = engine["settings"], engine["ratios"]
    return [
        "",
        "## peagle decoding engine (greedy)",
        "",
        f"`peagle.decode.SpeculativeDecoder` on the first {s['prompts']} served prompts, {s['max_new_tokens']} tokens "
        f"each, {s['batch_size']} request(s) at a time, {s['threads']} torch thread(s), the configurations taking "
        f"turns call by call over {s['repeats']} pass(es) (each call's fastest pass counts). P-EAGLE trees at node "
        f"budgets {', '.join(map(str, s['budgets']))} (the fastest shown: {ratios['best_tree']}); the EAGLE-3 "
        'dynamic tree at the fastest tree\'s budget; the cost-aware harness (`mode="harness"`: pass depth and '
        "verified nodes chosen per round from a cost table profiled in the same run). Speedup over the engine's "
        "target alone; lossless: the output equals the target alone's for every prompt. Draft / verify / other: "
        "shares of the wall time (other: prefill, KV compaction, bookkeeping).",
        "",
        format_table(rows),
        "",
        f"Best tree AL / chain AL {ratios['tree_al_over_chain_al']:.2f}x, tokens/s "
        f"{ratios['best_tree_tps_over_chain_tps']:.2f}x; best P-EAGLE tokens/s over the target alone "
        f"{ratios['best_peagle_tps_over_target_tps']:.2f}x." + _harness_ratio(ratios),
    ]


def _harness_ratio(ratios: dict[str, Any]) -> str:
    value = ratios.get("harness_tps_over_best_fixed_tps")  # absent from reports cached before the harness
    if value is None:
        return ""
    if "best_fixed" not in ratios:  # cached before the target alone counted as a fixed configuration
        return f" Harness tokens/s over the best fixed P-EAGLE configuration {value:.2f}x."
    every_call = ratios["harness_every_call_over_best_fixed"]
    return (
        f" Harness tokens/s over the best fixed configuration ({ratios['best_fixed']}) {value:.2f}x; with every call "
        f"of every pass counted (its learning and paired calls included) {every_call:.2f}x."
    )


def _setup_lines(
    spec, t: dict[str, Any], distill: dict[str, Any] | None, budgets: dict[str, dict[str, Any]]
) -> list[str]:
    """The target, the text and the drafters' budgets."""
    if t["kind"] == "embedded default":
        c = t["config"]
        lines = [
            f"Target: the embedded default, a Llama-style model ({t['parameters'] / 1e6:.2f} M parameters: "
            f"{c['num_layers']} layers, hidden {c['hidden_size']}, head_dim {c['hidden_size'] // c['num_heads']}, "
            f"vocabulary {c['vocab_size']} byte-level BPE) trained {t['steps']} steps ({t['seconds']:.0f} s) on "
            f"{t['corpus']['files']['train']} Python standard-library files; held-out loss {t['heldout_loss']:.3f} "
            f"on {t['corpus']['files']['heldout']} held-out files.",
        ]
    else:
        lines = [f"Target: {t['path']}; data: {t['data']} (every 10th record held out)."]
    if distill is not None:
        lines += [
            "",
            f"Text: self-distilled. Prompts of {distill['prompt_tokens']} tokens from the training split "
            f"({distill['train']['records']}) and, separately, the held-out split ({distill['heldout']['records']}), "
            f"each continued by the target itself (greedy, {distill['completion_tokens']} tokens: "
            f"{distill['train']['completion_tokens'] + distill['heldout']['completion_tokens']} tokens in "
            f"{distill['seconds']:.0f} s). The drafters train on the training continuations (loss on the generated "
            "tokens only), since a served drafter drafts against the target's own output.",
        ]
    k = spec.depths
    lines += [
        "",
        f"Drafters: P-EAGLE (K = {k} parallel depths) and an EAGLE-3 baseline (K = 1, drafting {k} tokens "
        f"autoregressively) on rows of T = {spec.seq_len}, with the same optimizer steps, rows, layers and COD "
        "elements per row. The baseline trains with training-time test (`peagle train --depths 1 --ttt-steps S`): "
        "each unrolled step feeds back its own drafted token and hidden state, as vLLM serves it, with a loss at "
        "every step, so its Pos 2+ drafts read inputs it was trained on. Elements: drafter positions run (P-EAGLE: "
        "its COD depths; EAGLE-3: its unrolled steps).",
        "",
        "| Drafter | layers | K | TTT steps | steps | rows | elements | train wall time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, b in budgets.items():
        lines.append(
            f"| {name} | {b['layers']} | {b['depths']} | {b['ttt_steps'] if b['ttt_steps'] > 1 else '-'} | "
            f"{b['steps']} | {b['rows']} | {b['elements']} | {b['seconds']:.0f} s |"
        )
    return lines


def _acceptance_lines(spec, report: dict[str, Any], same_text: int | None, prompts: int | None) -> list[str]:
    """The per-position acceptance table, with what each row measured."""
    k = spec.depths
    distill = report["distill"]
    lines = [
        "",
        "## Acceptance on the held-out split",
        "",
        "Conditional acceptance at position i (accepted given positions 1..i-1 accepted) and the average acceptance "
        "length (AL = 1 + accepted drafts per verification).",
        "",
        f"- Offline: chains of {k} drafts on the {distill['heldout']['records'] if distill else ''} held-out "
        "continuations, verified greedily against the target's argmax (teacher-forced on the target's own text, so "
        "an accepted draft is the token the target would generate). P-EAGLE drafts a chain in one pass; EAGLE-3 "
        "drafts it one token after another as vLLM's eagle3 proposer does (each step feeds back the drafted token "
        "and the drafter's own hidden state). *offline*: a chain from every position (the papers' offline measure); "
        "*offline (serving walk)*: only the chains a greedy server drafts on the same text (the next chain starts "
        "after the accepted drafts and the bonus token).",
        f"- vLLM: the speculative-decoding counters of greedy serving of "
        f"{prompts if prompts is not None else '?'} held-out prompts (the first of the offline records' "
        f"prompts), {spec.max_tokens} tokens each"
        + (
            f"; vLLM's output without speculation equals the offline continuation for {same_text}/"
            f"{prompts} prompts, so both measure the same text."
            if same_text is not None
            else "."
        ),
        "",
        "| Drafter | Measured | " + " | ".join(f"Pos {p}" for p in range(1, k + 1)) + " | AL |",
        "|---|---|" + "---|" * k + "---|",
    ]
    for row in report["acceptance"]:
        cells = _cells(row["conditional_acceptance"], k)
        lines.append(
            f"| {row['drafter']} | {row['measured']} | " + " | ".join(cells) + f" | {row['acceptance_length']:.3f} |"
        )
    agreement = report["al_vllm_over_offline"]
    if agreement:
        parts = [
            f"{name} {' / '.join(f'{ratio:.2f} ({measured})' for measured, ratio in ratios.items())}"
            for name, ratios in agreement.items()
        ]
        lines += [
            "",
            "AL measured by vLLM divided by the offline AL: " + "; ".join(parts) + ". A server drafts only where "
            "its last verification ended (often a hard spot), so the every-position average can run higher; the "
            "serving walk drafts where the server drafts.",
        ]
    return lines


def _serving_lines(spec, serving: list[dict[str, Any]], prompts: int | None) -> list[str]:
    """The vLLM-CPU throughput table."""
    if not serving:
        return []
    lines = [
        "",
        "## vLLM-CPU serving (greedy)",
        "",
        f"{prompts if prompts is not None else '?'} held-out prompts, {spec.max_tokens} generated tokens each, "
        + (
            "one request at a time"
            if tuple(spec.concurrency) == (1,)
            else f"{' / '.join(map(str, spec.concurrency))} requests decoded at once (rows of the later levels: @ C)"
        )
        + " (vLLM's max_num_seqs), float32, enforce_eager; tokens/s of "
        + (
            f"the fastest of {spec.repeats} timed passes over the prompts (on a shared machine other processes "
            "only ever slow a pass down)"
            if spec.repeats > 1
            else "one timed pass over the prompts"
        )
        + ", engine start-up not included.",
        "",
        "| Config | tokens/s | speedup | AL | lossless (output == no speculation) |",
        "|---|---|---|---|---|",
    ]
    for s in serving:
        speed = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        al = f"{s['acceptance_length']:.3f}" if s["acceptance_length"] else "-"
        lossless = "reference" if "lossless" not in s else f"{s['lossless']} ({s['identical_outputs']})"
        lines.append(f"| {s['config']} | {s['tokens_per_second']:.1f} | {speed} | {al} | {lossless} |")
    return lines


def _timing_lines(
    stages: dict[str, float],
    cached: list[str],
    when_run: dict[str, float] | None,
    total_seconds: float,
    load: dict[str, Any] | None,
) -> list[str]:
    """Stage times (cached stages with the time they took when they ran) and the machine's load."""
    lines = ["", "## Timings", ""]
    if load is not None:
        start, end = load["loadavg_start"], load["loadavg_end"]
        lines += [
            f"{load['cores']} CPU cores, {load['threads']} torch thread(s); the machine's load average (1 / 5 / 15 "
            f"min) was {start[0]:.2f} / {start[1]:.2f} / {start[2]:.2f} at the start and {end[0]:.2f} / {end[1]:.2f} / "
            f"{end[2]:.2f} at the end (other processes share the cores: timings and tokens/s vary with it).",
            "",
        ]
    lines += ["| Stage | seconds |", "|---|---|"]
    for name, sec in stages.items():
        if name not in cached:
            lines.append(f"| {name} | {sec:.1f} |")
        else:
            earlier = (when_run or {}).get(name)
            lines.append(f"| {name} | cached" + (f" ({earlier:.1f} when it ran)" if earlier is not None else "") + " |")
    lines.append(f"| total (this run) | {total_seconds:.1f} |")
    if cached and when_run and all(name in when_run for name in stages):
        lines.append(f"| stages when they ran | {sum(when_run[name] for name in stages):.1f} |")
    return lines
