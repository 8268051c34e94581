"""The harness against the best fixed configurations, in the engine on this CPU: tokens/s and acceptance length of
``mode="harness"`` (a cost table profiled first, in the same run) against every P-EAGLE chain length (chain 0: the
target alone) and P-EAGLE trees at several node budgets (the Cartesian tree of per-depth top-k that fits the budget,
``tree N``; the best N nodes by path score of the top-2-per-depth candidate tree, ``tree N pruned``, the engine's
default tree), at batch sizes 1, 4 and 16, at each temperature (default 0 and 1) and per prompt category (a prompts
file's records name theirs in ``category``), as ratios to the best fixed chain and the best fixed tree: the fastest in
the run (hindsight), and, with two passes or more, the one picked on the other half of the passes
(:func:`held_out_ratio`: no winner's curse). Over the categories together (the mixed workload, one fixed
configuration for all of them, as a user would pick): the harness against the best single fixed configuration. Each
group prints the load average before and after it and torch's threads; a group measured above the core count is
marked noisy.

Goals (issue 40): >= 1.05x the best single fixed configuration over the mixed workload at batch 1, >= 0.97x at batch
4 and 16.

    PYTHONPATH=. python benchmarks/harness_speed.py --target DIR --drafter DIR [--prompts 8 --new-tokens 96]
        [--batch-sizes 1,4,16] [--budgets 8,16,32] [--pruned-budgets 8,16] [--costs costs.json]
        [--prompts-file heldout.jsonl] [--categories code,math] [--passes 3] [--temperature 0,1] [--top-p 1]
        [--costs-out harness-costs.json] [--trace]

With no --target / --drafter: the demo-sized random models of ``engine_speed.py`` (acceptance near zero).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from peagle.decode import SpeculativeDecoder
from peagle.decode.harness import CostTable
from peagle.decode.harness.profile import profile_costs
from peagle.demo.bench_decode import (
    Call,
    every_call_speed,
    fastest_calls,
    interleaved_calls,
    load_category_prompts,
    oracle_bound,
    tree_topk,
)
from peagle.demo.workload import check_categories, check_sampling
from peagle.model import from_pretrained


class PassResult(NamedTuple):
    tokens_per_s: float  # wall clock
    cpu_tokens_per_s: float  # this process's CPU time: one thread, so the other processes' load barely counts
    acceptance_length: float
    accepted: list[list[list[int]]]  # per batch, the requests' accepted drafts per round
    phase_ms: tuple[float, float, float]  # per batched round: drafting, verification, the rest (GenerateMetrics)


def unprofiled_warning(table: CostTable, batches: Sequence[int], source: str) -> str | None:
    """A warning naming the batch sizes a loaded cost table was not profiled at, or None. The harness then plans
    with the costs of the next profiled batch size up (:meth:`CostTable.bucket`), and its row compares rounds the
    table does not describe: a batch-4 table made the harness decode plainly at batch 1, where it drafts with one of
    batch 1."""
    unprofiled = [b for b in batches if b not in table.batch_sizes]
    if not unprofiled:
        return None
    used = [table.batch_sizes[table.bucket(b)] for b in unprofiled]
    return (
        f"warning: --costs {source} was profiled at batch sizes {table.batch_sizes}; batch sizes {unprofiled} "
        f"plan with the costs of batch sizes {used} (drop --costs to profile them)"
    )


def summarize(calls: dict[tuple[str, int, int], Call], passes: Sequence[int]) -> dict[str, PassResult]:
    """Every configuration's figures over the given ``passes``: each call's fastest of them counts
    (:func:`fastest_calls`; the phases of the fastest call)."""
    results = {}
    for name in dict.fromkeys(name for name, _, _ in calls):
        fastest = fastest_calls(calls, name, passes)
        tokens = sum(c.new_tokens for c in fastest)
        results[name] = PassResult(
            tokens / sum(c.seconds for c in fastest),
            tokens / sum(c.cpu_seconds for c in fastest),
            sum(c.emitted for c in fastest) / max(sum(c.request_rounds for c in fastest), 1),
            [c.accepted for c in fastest],
            tuple(
                1e3 * sum(c.phases[i] for c in fastest) / max(sum(c.metrics.rounds for c in fastest), 1)
                for i in range(3)
            ),
        )
    return results


def best_of(results: dict[str, PassResult], kind: str) -> str:
    """The fastest configuration (wall clock) whose name starts with ``kind``."""
    return max((n for n in results if n.startswith(kind)), key=lambda n: results[n].tokens_per_s)


def held_out_ratio(calls: dict[tuple[str, int, int], Call], passes: int, kind: str) -> tuple[float, list[str]]:
    """The harness over the best fixed ``kind`` configuration chosen without hindsight. Picking the fastest of several
    nearly equal configurations on the same noisy passes that score it favours whichever was lucky (the winner's
    curse), so here the passes split in two halves (even and odd turns): the configuration fastest on one half is
    scored against the harness on the other, both ways. Returns the geometric mean of the two ratios and the two
    picks."""
    if passes < 2:
        raise ValueError(f"held-out selection needs passes >= 2, got {passes}")
    halves = (range(0, passes, 2), range(1, passes, 2))
    ratios, picks = [], []
    for pick_on, score_on in (halves, halves[::-1]):
        name = best_of(summarize(calls, pick_on), kind)
        scored = summarize(calls, score_on)
        ratios.append(scored["harness"].tokens_per_s / scored[name].tokens_per_s)
        picks.append(name)
    return math.sqrt(ratios[0] * ratios[1]), picks


def every_call_ratio(calls: dict[tuple[str, int, int], Call], kind: str) -> tuple[float, str]:
    """The harness over the best fixed ``kind`` configuration with every call of every pass counted
    (:func:`every_call_speed`): the harness keeps state across calls (calibration, whether speculating pays, with
    probe calls that draft again), and a probe call that runs slower than its other passes would not count in
    :func:`summarize`, where each call's fastest pass does. Returns the ratio and the fixed configuration."""
    speed = every_call_speed(calls)
    best = max((n for n in speed if n.startswith(kind)), key=speed.__getitem__)
    return speed["harness"] / speed[best], best


def call_trace(calls: dict[tuple[str, int, int], Call], fixed: str) -> list[str]:
    """One line per harness call in the order they ran: its pass and first prompt, how it started (draft, probe,
    plain, control), its acceptance length and tokens/s, and the ``fixed`` configuration's tokens/s on the same
    prompts in the same pass (their ratio: where the harness gained or lost, call by call)."""
    lines = []
    for (name, start, turn), ours in calls.items():
        if name != "harness":
            continue
        theirs = calls[fixed, start, turn]
        speed, their_speed = ours.new_tokens / ours.seconds, theirs.new_tokens / theirs.seconds
        acceptance = ours.emitted / max(ours.request_rounds, 1)
        lines.append(
            f"pass {turn} prompt {start:>3} {ours.metrics.harness_call:<8} AL {acceptance:4.2f} {speed:8.1f} tokens/s, "
            f"{fixed} {their_speed:8.1f} ({speed / their_speed:.2f}x)"
        )
    return lines


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def mixed_ratio(per_category: dict[str, dict[tuple[str, int, int], Call]]) -> tuple[float, str]:
    """The harness over the best single fixed configuration over every category together (each call's fastest
    pass; tokens and seconds summed over the categories): one configuration for the whole workload."""
    totals: dict[str, list[float]] = {}
    for calls in per_category.values():
        passes = range(1 + max(turn for _, _, turn in calls))
        for name in dict.fromkeys(name for name, _, _ in calls):
            fastest = fastest_calls(calls, name, passes)
            total = totals.setdefault(name, [0.0, 0.0])
            total[0] += sum(c.new_tokens for c in fastest)
            total[1] += sum(c.seconds for c in fastest)
    speed = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
    best = max((n for n in speed if n != "harness"), key=speed.__getitem__)
    return speed["harness"] / speed[best], best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--costs", default=None, help="a cost table to use instead of profiling one")
    parser.add_argument(
        "--costs-out",
        default=str(Path(__file__).parent / "results" / "harness-costs.json"),
        help="where the profiled cost table goes",
    )
    parser.add_argument("--prompts", type=int, default=16, help="prompts per category")
    parser.add_argument(
        "--prompts-file", default=None, help="token-id prompts (.jsonl, records may name their 'category')"
    )
    parser.add_argument("--categories", default=None, help="categories of the prompts file to measure (default all)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument(
        "--passes",
        type=int,
        default=3,
        help="passes per configuration (each call's fastest counts; >= 2: also the held-out pick)",
    )
    parser.add_argument("--budgets", default="8,16,32", help="node budgets of the Cartesian trees")
    parser.add_argument("--pruned-budgets", default="8,16", help="node budgets of the pruned top-2 trees ('' none)")
    parser.add_argument("--temperature", default="0,1", help="temperatures, comma-separated (0: greedy rounds)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the target's top-p in sampled rounds (1: off)")
    parser.add_argument(
        "--trace", action="store_true", help="also print every harness call against the best fixed chain's"
    )
    args = parser.parse_args()
    try:
        temperatures = check_sampling(args.temperature, args.top_p)
    except ValueError as err:
        parser.error(str(err))
    torch.set_num_threads(1)
    if args.target:
        target, drafter = args.target, from_pretrained(args.drafter)
    else:
        from engine_speed import random_models

        target, drafter = random_models()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.costs:
        table = CostTable.load(args.costs)
        warning = unprofiled_warning(table, batches, args.costs)
        if warning:
            print(warning, file=sys.stderr)
    else:
        nodes = [1, 2, 4, 8, 16, 32]
        table = profile_costs(target, drafter, batch_sizes=batches, contexts=[args.prompt_len], verify_nodes=nodes)
        Path(args.costs_out).parent.mkdir(parents=True, exist_ok=True)
        print(f"cost table written: {table.save(args.costs_out)}")
    depth, vocab = drafter.config.num_depths, drafter.config.draft_vocab_size
    configs = {"chain 0": dict(drafter=None)}  # width 0: the target alone
    configs.update({f"chain {k}": dict(mode="chain", depth=k) for k in range(1, depth + 1)})
    for budget in (int(b) for b in args.budgets.split(",")):
        configs[f"tree {budget}"] = dict(mode="tree", topk=tree_topk(depth, vocab, budget), num_nodes=budget)
    for budget in (int(b) for b in args.pruned_budgets.split(",") if b):
        configs[f"tree {budget} pruned"] = dict(mode="tree", topk=[min(2, vocab)] * depth, num_nodes=budget)
    configs["harness"] = dict(mode="harness", cost_table=table)
    decoders = {
        name: SpeculativeDecoder(target, o.pop("drafter", drafter), num_threads=1, **o) for name, o in configs.items()
    }
    runner = decoders["harness"].runner
    if args.prompts_file:
        grouped = load_category_prompts(args.prompts_file, args.prompts, runner.vocab_size)
    else:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, runner.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(16)]
        grouped = {"random": prompts[: args.prompts]}
    if args.categories:
        try:
            chosen = check_categories(args.categories, tuple(grouped))
        except ValueError as err:
            parser.error(str(err))
        grouped = {c: grouped[c] for c in chosen}
    context = max(len(p) for ps in grouped.values() for p in ps)
    print(f"torch threads {torch.get_num_threads()}, {_cores()} cores; categories {', '.join(grouped)}")
    header = f"{'batch':>5} {'T':>4} {'category':<8} {'config':<14} {'tok/s':>8} {'cpu tok/s':>10} {'AL':>6}"
    print(header + "  ms a round: draft / verify / other")
    for batch in batches:
        for temperature in temperatures:
            per_category = {}
            for category, prompts in grouped.items():
                group = f"{batch:>5} {temperature:>4g} {category:<8}"
                before = _load()
                calls = interleaved_calls(
                    decoders, prompts, batch, args.new_tokens, args.passes, temperature, top_p=args.top_p
                )
                after = _load()
                per_category[category] = calls
                noisy = max(before[0], after[0]) > _cores()
                results = summarize(calls, range(args.passes))
                for name, r in results.items():
                    phases = " / ".join(f"{ms:.3f}" for ms in r.phase_ms)
                    speed = f"{r.tokens_per_s:8.1f} {r.cpu_tokens_per_s:10.1f} {r.acceptance_length:6.2f}"
                    print(f"{group} {name:<14} {speed}  {phases}")
                print(
                    f"{group} load average {before[0]:.2f} before, {after[0]:.2f} after, {torch.get_num_threads()} "
                    f"thread(s)" + (" NOISY (load above the core count: no headline figure)" if noisy else "")
                )
                ours = results["harness"]
                for kind in ("chain", "tree"):
                    name = best_of(results, kind)
                    cpu_name = max(
                        (n for n in results if n.startswith(kind)), key=lambda n: results[n].cpu_tokens_per_s
                    )
                    theirs, cpu_theirs = results[name], results[cpu_name]
                    print(
                        f"{group} harness / best {kind}: tokens/s {ours.tokens_per_s / theirs.tokens_per_s:.2f}x "
                        f"({name}), CPU-time tokens/s {ours.cpu_tokens_per_s / cpu_theirs.cpu_tokens_per_s:.2f}x "
                        f"({cpu_name}), acceptance length {ours.acceptance_length / theirs.acceptance_length:.2f}x"
                    )
                    if args.passes >= 2:
                        ratio, picks = held_out_ratio(calls, args.passes, kind)
                        print(
                            f"{group} harness / best {kind} picked on the other passes: {ratio:.2f}x "
                            f"({', '.join(picks)})"
                        )
                    ratio, name = every_call_ratio(calls, kind)
                    print(f"{group} harness / best {kind}, every call of every pass counted: {ratio:.2f}x ({name})")
                if args.trace:
                    for line in call_trace(calls, best_of(results, "chain")):
                        print(f"{group} {line}")
                bound = oracle_bound(table, results[f"chain {depth}"].accepted, depth, context)
                print(f"{group} oracle depth choice / chain {depth} (cost-table seconds, same rounds): {bound:.3f}x")
            ratio, best = mixed_ratio(per_category)
            goal = 1.05 if batch == 1 else 0.97
            print(
                f"{batch:>5} {temperature:>4g} {'mixed':<8} harness / best single fixed configuration over the "
                f"categories: {ratio:.2f}x ({best}; goal >= {goal}x)"
            )


if __name__ == "__main__":
    main()
