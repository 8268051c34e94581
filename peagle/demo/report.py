"""The demo's report: per prompt category and temperature, the per-position acceptance (offline and measured by vLLM,
each acceptance length with its 95% interval), tokens/s and speedup in vLLM and in peagle's decoding engine, the
lossless checks (greedy equality; at temperature > 0 a two-sample test against the target alone, with its power
check), the serving goals, and the load the figures were measured under; as markdown, JSON and PNG plots."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from peagle.demo.bench_decode import group_label
from peagle.demo.tables import format_goals, format_table, plot_groups, served_acceptance
from peagle.io import atomic_write_bytes, atomic_write_json

__all__ = ["acceptance_rows", "engine_rows", "serving_rows", "write_report"]


def _cells(values: list[float], k: int) -> list[str]:
    return [f"{v:.3f}" for v in values] + ["-"] * (k - len(values))


def _plots(out: Path, table: list[dict[str, Any]], serving: list[dict[str, Any]], k: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    panels = list(dict.fromkeys((row["category"], row["temperature"]) for row in table))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.2 * max(1, len(panels)), 4.4), squeeze=False)
    # A colour family per drafter (blues: P-EAGLE, oranges: EAGLE-3), darker = offline, lighter = vLLM.
    shades = {"P-EAGLE": ["#08519c", "#4292c6", "#9ecae1"], "EAGLE-3": ["#a63603", "#f16913", "#fdae6b"]}
    for ax, (category, temperature) in zip(axes[0], panels, strict=False):
        rows = [r for r in table if (r["category"], r["temperature"]) == (category, temperature)]
        width = 0.8 / max(1, len(rows))
        used: dict[str, int] = {}
        for i, row in enumerate(rows):
            xs = [p + 1 + (i - (len(rows) - 1) / 2) * width for p in range(len(row["conditional_acceptance"]))]
            family = shades.get(row["drafter"].split(" (")[0], ["#555", "#888", "#bbb"])
            color = family[min(used.get(row["drafter"], 0), len(family) - 1)]
            used[row["drafter"]] = used.get(row["drafter"], 0) + 1
            label = f"{row['drafter']} ({row['measured']}, AL {row['acceptance_length']:.2f})"
            ax.bar(xs, row["conditional_acceptance"], width, label=label, color=color)
        ax.set_xticks(range(1, k + 1), [f"Pos {p}" for p in range(1, k + 1)], fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_title(f"{category}, temperature {temperature:g}", fontsize=9)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    axes[0][0].set_ylabel("conditional acceptance")
    fig.suptitle("Per-position acceptance on the held-out prompts", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)
    files.append("acceptance.png")
    if serving:
        plot_groups(serving, out / "throughput.png", "vLLM-CPU serving")
        files.append("throughput.png")
    return files


def acceptance_rows(
    offline: dict[str, dict[str, dict[str, Any]]], served: dict[str, dict[str, Any]], k: int
) -> list[dict[str, Any]]:
    """The acceptance table: per drafter, category and temperature, the offline rows (every position; at
    temperature 0 also the serving walk) and vLLM's counters."""
    table = []
    for name, by_category in offline.items():
        for category, by_temperature in by_category.items():
            for key, r in by_temperature.items():
                common = {"drafter": name, "category": category, "temperature": float(key)}
                drafting = r.get("drafting", "parallel")
                table.append(
                    {
                        **common,
                        "measured": "offline",
                        "drafting": drafting,
                        "conditional_acceptance": r["conditional_acceptance"],
                        "acceptance_length": r["acceptance_length"],
                        "acceptance_interval": r.get("acceptance_length_interval"),
                        "chains": r["chains"],
                    }
                )
                if "serving_walk" in r:
                    walk = r["serving_walk"]
                    table.append(
                        {
                            **common,
                            "measured": "offline (serving walk)",
                            "drafting": drafting,
                            "conditional_acceptance": walk["conditional_acceptance"],
                            "acceptance_length": walk["acceptance_length"],
                            "drafts": walk["drafts"],
                            "rows": walk.get("rows"),  # the held-out rows walked (the served prompts)
                        }
                    )
                group = served.get(name, {}).get("groups", {}).get(f"{category} T={key}")
                s = served_acceptance(group, k) if group else None
                if s is not None:
                    table.append({**common, "measured": "vLLM", **s})
    return table


def serving_rows(served: dict[str, dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """One row per served configuration and group (category, temperature): tokens/s, speedup over no speculation,
    lossless check (greedy groups: output == no speculation's), AL."""
    serving = []
    for name, result in served.items():
        # Against no speculation at the same concurrency (rows of further levels end " @ C at once").
        plain = "no speculation" + (name[name.index(" @ ") :] if " @ " in name else "")
        reference = served.get(plain, {}).get("groups", {})
        for group, r in result.get("groups", {}).items():
            category, temperature = group.rsplit(" T=", 1)
            base = reference.get(group)
            entry = {
                "config": name,
                "category": category,
                "temperature": float(temperature),
                "tokens_per_second": r["tokens_per_second"],
                "generated_tokens": r["generated_tokens"],
                "seconds": r["seconds"],
                "startup_seconds": result["startup_seconds"],
                "speedup": r["tokens_per_second"] / base["tokens_per_second"] if base else None,
            }
            if base is not None and name != plain and float(temperature) == 0:
                same = [a == b for a, b in zip(r["outputs"], base["outputs"], strict=True)]
                entry["lossless"] = all(same)
                entry["identical_outputs"] = f"{sum(same)}/{len(same)}"
            acc = served_acceptance(r, k)
            entry["acceptance_length"] = acc["acceptance_length"] if acc else None
            serving.append(entry)
    return serving


def _served_equals_offline(
    reference: dict[str, Any] | None, heldout_completions: dict[str, list[list[int]]] | None
) -> tuple[int, int] | None:
    """How many of vLLM's greedy outputs (no speculation) equal the self-distilled continuation of the same held-out
    prompt (over the served length), of how many: when all do, the served text is the offline text."""
    if reference is None or not heldout_completions:
        return None
    same, total = 0, 0
    for category, completions in heldout_completions.items():
        group = reference.get("groups", {}).get(f"{category} T=0")
        if group is None:
            continue
        outs = group["outputs"]
        same += sum(o == c[: len(o)] for o, c in zip(outs, completions, strict=False))
        total += len(outs)
    return (same, total) if total else None


def _al_agreement(table: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per drafter and category: vLLM's greedy AL divided by each offline greedy AL."""
    agreement = {}
    for row in table:
        if row["measured"] != "vLLM" or row["temperature"] != 0:
            continue
        key = (row["drafter"], row["category"], 0.0)
        offline = {r["measured"]: r for r in table if (r["drafter"], r["category"], r["temperature"]) == key}
        agreement[f"{row['drafter']}, {row['category']}"] = {
            measured: row["acceptance_length"] / offline[measured]["acceptance_length"]
            for measured in ("offline", "offline (serving walk)")
            if measured in offline
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
    heldout_completions: dict[str, list[list[int]]] | None = None,
    load: dict[str, Any] | None = None,
    when_run: dict[str, float] | None = None,
    engine: dict[str, Any] | None = None,
    categories: list[str] | None = None,
) -> dict[str, Any]:
    """Writes report.json, report.md and the plots into ``out``; returns the report. ``offline``: {drafter:
    {category: {temperature key: eval result}}}; ``served``: {configuration: vLLM's result per group};
    ``train_budgets``: per drafter, what its training spent (``peagle.demo.pipeline.train_budget``); ``engine``: the
    decoding engine's bench report (:func:`peagle.demo.bench_decode.bench_decode`)."""
    out.mkdir(parents=True, exist_ok=True)
    k = spec.depths
    table = acceptance_rows(offline, served, k)
    serving = serving_rows(served, k)
    same_text = _served_equals_offline(served.get("no speculation"), heldout_completions)
    report = {
        "depths": k,
        "categories": categories or sorted({row["category"] for row in table}),
        "temperatures": list(spec.temperatures),
        "distill": distill,
        "served_equals_offline_text": f"{same_text[0]}/{same_text[1]}" if same_text is not None else None,
        "al_vllm_over_offline": _al_agreement(table),
        "machine_load": load,
        "target": target_info,
        "settings": {key: v for key, v in asdict(spec).items() if key != "target"},
        "acceptance": table,
        "offline": offline,
        "serving": serving,
        "engine": engine_rows(engine),
        "goals": engine.get("goals", []) if engine else [],
        "lossless_power": engine.get("lossless_power", []) if engine else [],
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
    lines += _acceptance_lines(spec, report, same_text)
    lines += _serving_lines(spec, serving)
    lines += _engine_lines(engine, report["engine"])
    lines += _timing_lines(stages, cached, when_run, total_seconds, load)
    lines += [""] + [f"![{p}]({p})" for p in report["plots"]] + [""]
    atomic_write_bytes(out / "report.md", "\n".join(lines).encode())
    return report


def engine_rows(engine: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The engine rows of the report, per category and temperature (the first batch size): target alone, P-EAGLE
    chain, the fastest P-EAGLE tree of the group and the one that accepts the most, the cost-aware harness, EAGLE-3
    chain and tree."""
    if engine is None or not engine["rows"]:
        return []
    batch = engine["rows"][0]["batch_size"]
    rows = []
    for r in engine["rows"]:
        if r["batch_size"] != batch or r["config"].startswith("vLLM"):
            continue
        ratios = engine["ratios"][group_label(batch, r["temperature"], r["category"])]
        shown = (ratios["best_tree"], ratios["best_tree_by_al"])
        if r["config"].startswith("P-EAGLE tree") and r["config"] not in shown:
            continue
        rows.append(r)
    return rows


def _lossless(serving: list[dict[str, Any]], engine: dict[str, Any] | None) -> bool | None:
    """Every speculative output equals its reference (vLLM without speculation; the engine's target alone) when
    greedy, and passes the two-sample test when sampled (whose power check must reject the biased verifier)."""
    checks = [s["lossless"] for s in serving if "lossless" in s]
    if engine is not None:
        checks += [r["lossless"] for r in engine["rows"] if r.get("lossless") is not None]
        checks += [check["rejected"] for check in engine.get("lossless_power", [])]
    return all(checks) if checks else None


def _engine_plot(out: Path, engine: dict[str, Any] | None) -> list[str]:
    if engine is None or not engine["rows"]:
        return []
    settings = engine["settings"]
    title = (
        f"peagle decoding engine: tokens/s per configuration and category ({settings['prompts']} prompts x "
        f"{settings['max_new_tokens']} tokens per category)"
    )
    plot_groups(engine["rows"], out / "decode.png", title)
    return ["decode.png"]


def _engine_lines(engine: dict[str, Any] | None, rows: list[dict[str, Any]]) -> list[str]:
    """The decoding engine's per-category table (the fastest P-EAGLE tree of the budgets and the one that accepts
    the most; decode.png and the engine's bench.md show them all), its goals and lossless checks."""
    if engine is None:
        return []
    s = engine["settings"]
    lines = [
        "",
        "## peagle decoding engine, per category and temperature",
        "",
        f"`peagle.decode.SpeculativeDecoder` on the first {s['prompts']} served prompts of each category, "
        f"{s['max_new_tokens']} tokens each, {s['batch_size']} request(s) at a time, {s['threads']} torch thread(s), "
        f"the configurations taking turns call by call over {s['repeats']} pass(es) (each call's fastest pass "
        f"counts). P-EAGLE trees at node budgets {', '.join(map(str, s['budgets']))} (shown: the fastest and the one "
        "that accepts the most); the EAGLE-3 dynamic tree at the fastest tree's budget; the cost-aware harness "
        '(`mode="harness"`, a cost table profiled in the same run). Speedup over the engine\'s target alone in the '
        "same group. AL: tokens emitted per target forward +- its 95% interval (requests as clusters); at a "
        f"temperature above 0 it comes from {s.get('acceptance_requests', 0)} more requests per category (held-out "
        "prompts, several seeds, decoded in batches and not timed). Lossless: greedy, the output equals the target "
        f"alone's for every prompt; sampled, a two-sample test of the first tokens ({s.get('lossless_draws', 0)} "
        "draws per prompt) against the target alone's passes (p >= 0.001). Load: the 1-minute load average before "
        "and after the row's calls, and in brackets the cores other processes kept busy meanwhile (the machine's busy "
        "time less this process's, which the load average counts too); **noisy** above a quarter of a core (no "
        "headline figure).",
        "",
        format_table(rows),
    ]
    lines += _drafting_cost_lines(engine["rows"])
    for check in engine.get("lossless_power", []):
        verdict = "rejected, as it must be" if check["rejected"] else "**not rejected: the test lacks power here**"
        lines += [
            "",
            f"Power of the lossless test at T={check['temperature']:g}: {check['config']}: p = "
            f"{check['p_value']:.3g} ({verdict}).",
        ]
    if engine.get("goals"):
        lines += ["", "### Serving goals (this run)", "", format_goals(engine["goals"])]
    return lines


def drafting_costs(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each chain's drafting time per round in ms (greedy groups of the first batch size, categories pooled): what a
    round's drafts cost each drafter (P-EAGLE: one pass; EAGLE-3: K passes)."""
    if not rows:
        return {}
    batch = rows[0]["batch_size"]
    chains = [r for r in rows if r["batch_size"] == batch and r["temperature"] == 0 and r["config"].endswith("chain")]
    costs: dict[str, list[float]] = {}
    for r in chains:
        if r["config"].startswith("vLLM") or "draft_s" not in r or not r.get("rounds"):
            continue
        total = costs.setdefault(r["config"], [0.0, 0.0])
        total[0] += r["draft_s"]
        total[1] += r["rounds"]
    return {name: 1e3 * seconds / rounds for name, (seconds, rounds) in costs.items() if rounds}


def _drafting_cost_lines(rows: list[dict[str, Any]]) -> list[str]:
    costs = drafting_costs(rows)
    if len(costs) < 2:
        return []
    reference = costs.get("EAGLE-3 chain")
    parts = [
        f"{name} {ms:.2f} ms" + (f" ({ms / reference:.2f}x EAGLE-3's)" if reference and name != "EAGLE-3 chain" else "")
        for name, ms in costs.items()
    ]
    return ["", "Drafting time per round (greedy chains, categories pooled): " + "; ".join(parts) + "."]


def _setup_lines(
    spec, t: dict[str, Any], distill: dict[str, Any] | None, budgets: dict[str, dict[str, Any]]
) -> list[str]:
    """The target, the text and the drafters' budgets."""
    if t["kind"] == "embedded default":
        c = t["config"]
        losses = ", ".join(f"{cat} {loss:.2f}" for cat, loss in t.get("heldout_loss_per_category", {}).items())
        records = t["corpus"].get("records", {})
        lines = [
            f"Target: the embedded default, a Llama-style model ({t['parameters'] / 1e6:.2f} M parameters: "
            f"{c['num_layers']} layers, hidden {c['hidden_size']}, head_dim {c['hidden_size'] // c['num_heads']}, "
            f"vocabulary {c['vocab_size']} byte-level BPE, digits one by one) trained {t['steps']} seeded steps on "
            f"{t.get('threads', 1)} thread(s) ({t['seconds']:.0f} s) on three prompt categories built from the Python "
            "standard library: code (its .py files), prose (its documentation topics and docstrings) and math "
            f"(generated progressions and running sums); training records per category "
            f"{', '.join(f'{k} {v}' for k, v in records.get('train', {}).items())}. Held-out loss per category: "
            f"{losses}.",
        ]
    else:
        lines = [f"Target: {t['path']}; data: {t['data']} (every 10th record held out; one category, all)."]
    if distill is not None:
        heldout = distill["heldout"]
        per_category = ", ".join(f"{c} {h['records']}" for c, h in heldout.items())
        tokens = distill["train"]["completion_tokens"] + sum(h["completion_tokens"] for h in heldout.values())
        lines += [
            "",
            f"Text: self-distilled. Prompts of up to {distill['prompt_tokens']} tokens from the training split "
            f"({distill['train']['records']}, every category) and, separately, each category's held-out split "
            f"({per_category}), each continued by the target itself (greedy, {distill['completion_tokens']} tokens: "
            f"{tokens} tokens in {distill['seconds']:.0f} s). The drafters train on the training continuations (loss "
            "on the generated tokens only), since a served drafter drafts against the target's own output.",
        ]
    k = spec.depths
    lines += [
        "",
        f"Drafters: P-EAGLE (K = {k} parallel depths) and an EAGLE-3 baseline (K = 1, drafting {k} tokens "
        f"autoregressively) on rows of T = {spec.seq_len}, with the same optimizer steps, rows and COD elements per "
        "row. The baseline trains with training-time test (`peagle train --depths 1 --ttt-steps S`): each unrolled "
        "step feeds back its own drafted token and hidden state, as vLLM serves it, with a loss at every step, so "
        "its Pos 2+ drafts read inputs it was trained on. Elements: drafter positions run (P-EAGLE: its COD depths; "
        "EAGLE-3: its unrolled steps)."
        + (
            " A third drafter, P-EAGLE with more layers, compares the two at equal drafting cost: P-EAGLE drafts K "
            "tokens in one pass where EAGLE-3 runs K passes, so for the same time per round it can afford a deeper "
            "drafter (the engine section shows each drafter's measured drafting time per round)."
            if len(budgets) > 2
            else ""
        ),
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


def _acceptance_lines(spec, report: dict[str, Any], same_text: tuple[int, int] | None) -> list[str]:
    """The per-position acceptance table per category and temperature, with what each row measured."""
    k = spec.depths
    lines = [
        "",
        "## Acceptance per category, on the held-out prompts",
        "",
        "Conditional acceptance at position i (accepted given positions 1..i-1 accepted) and the average acceptance "
        "length (AL = 1 + accepted drafts per verification, +- its 95% interval where measured).",
        "",
        f"- Offline: chains of {k} drafts on each category's held-out continuations, teacher-forced on the target's "
        "own text. Greedy (T = 0): verified against the target's argmax, so an accepted draft is the token the "
        "target would generate; sampled (T > 0): each draft drawn from the drafter at that temperature and accepted "
        "with probability sum min(p, q), the expectation reported. P-EAGLE drafts a chain in one pass; EAGLE-3 "
        "drafts it one token after another as vLLM's eagle3 proposer does. *offline*: a chain from every position "
        "(the papers' offline measure), over every held-out prompt; *offline (serving walk)*: only the chains a greedy "
        "server drafts, on the prompts vLLM serves.",
        f"- vLLM: the speculative-decoding counters of serving the first {spec.prompts} held-out prompts of each "
        f"category, {spec.max_tokens} tokens each, at each temperature"
        + (
            f"; vLLM's greedy output without speculation equals the offline continuation for {same_text[0]}/"
            f"{same_text[1]} prompts, so both measure the same text."
            if same_text is not None
            else "."
        ),
        "",
        "| Drafter | category | T | Measured | " + " | ".join(f"Pos {p}" for p in range(1, k + 1)) + " | AL |",
        "|---|---|---|---|" + "---|" * k + "---|",
    ]
    for row in report["acceptance"]:
        cells = _cells(row["conditional_acceptance"], k)
        half = row.get("acceptance_interval")
        al = f"{row['acceptance_length']:.3f}" + (f" +- {half:.3f}" if half is not None else "")
        lines.append(
            f"| {row['drafter']} | {row['category']} | {row['temperature']:g} | {row['measured']} | "
            + " | ".join(cells)
            + f" | {al} |"
        )
    lines += _repeat_lines(report["offline"], k)
    agreement = report["al_vllm_over_offline"]
    if agreement:
        parts = [
            f"{name} {' / '.join(f'{ratio:.2f} ({measured})' for measured, ratio in ratios.items())}"
            for name, ratios in agreement.items()
        ]
        lines += [
            "",
            "Greedy AL measured by vLLM divided by the offline AL: " + "; ".join(parts) + ". A server drafts only "
            "where its last verification ended (often a hard spot), so the every-position average can run higher; "
            "the serving walk drafts where the server drafts.",
        ]
    return lines


def _repeat_lines(offline: dict[str, dict[str, dict[str, Any]]], k: int) -> list[str]:
    """How often each drafter's greedy draft repeats the draft one depth before, against how often the text repeats its
    token there: the Pos 2 dip's measure (a drafter too shallow to tell its mask depths apart repeats itself)."""
    lines = []
    for name, by_category in offline.items():
        for category, by_temperature in by_category.items():
            r = by_temperature.get("0")
            if r and r.get("repeated_draft"):
                drafts = " / ".join(f"{100 * v:.0f}%" for v in r["repeated_draft"])
                texts = " / ".join(f"{100 * v:.0f}%" for v in r["repeated_text"])
                lines.append(f"| {name} | {category} | {drafts} | {texts} |")
    if not lines:
        return []
    return [
        "",
        f"Drafts at Pos 2..{k} that repeat the draft one position before, against the text repeating its token there "
        "(greedy, offline). P-EAGLE's drafts at depths >= 1 all read the same mask token and mask hidden state, told "
        "apart only by their positions (rotary): a drafter too shallow to use them drafts the same token at every "
        "depth, which shows as a Pos 2-3 dip where the text does not repeat; more layers fix it.",
        "",
        "| Drafter | category | repeated drafts | repeated text |",
        "|---|---|---|---|",
        *lines,
    ]


def _serving_lines(spec, serving: list[dict[str, Any]]) -> list[str]:
    """The vLLM-CPU throughput table, per category and temperature."""
    if not serving:
        return []
    lines = [
        "",
        "## vLLM-CPU serving, per category and temperature",
        "",
        f"The first {spec.prompts} held-out prompts of each category, {spec.max_tokens} generated tokens each, "
        + (
            "one request at a time"
            if tuple(spec.concurrency) == (1,)
            else f"{' / '.join(map(str, spec.concurrency))} requests decoded at once (rows of the later levels: @ C)"
        )
        + " (vLLM's max_num_seqs), float32, enforce_eager, sampled requests seeded; tokens/s of "
        + (
            f"the fastest of {spec.repeats} timed passes over the prompts (on a shared machine other processes "
            "only ever slow a pass down)"
            if spec.repeats > 1
            else "one timed pass over the prompts"
        )
        + ", engine start-up not included. Lossless (greedy groups): the output equals vLLM's without speculation.",
        "",
        "| Config | category | T | tokens/s | speedup | AL | lossless |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in serving:
        speed = f"{s['speedup']:.2f}x" if s["speedup"] is not None else "-"
        al = f"{s['acceptance_length']:.3f}" if s["acceptance_length"] else "-"
        if "lossless" in s:
            lossless = f"{s['lossless']} ({s['identical_outputs']})"
        else:
            lossless = "reference" if s["config"] == "no speculation" else "-"
        lines.append(
            f"| {s['config']} | {s['category']} | {s['temperature']:g} | {s['tokens_per_second']:.1f} | {speed} | "
            f"{al} | {lossless} |"
        )
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
