"""``peagle profile --backend vllm``: the harness's cost table measured through vLLM itself, for the harness that
chooses draft lengths inside vLLM (:mod:`peagle.vllm.harness`).

vLLM runs the target and the drafter as it serves them (its model runner, attention backend, scheduler, sampler and
P-EAGLE proposer, on whatever device it runs on), with the harness in profile mode: every request of a step verifies
a forced number of the pass's drafts, and every step's wall time (from the start of one step to the next: the
forward, verification, the drafter's pass, vLLM's bookkeeping and scheduling) and its pass's seconds are recorded in
the worker. The table's entries:

* ``verify_s[b][c][i]``: a step of ``b`` requests (all decoding, contexts from ``contexts[c]``) that each verify
  ``i - 1`` drafts, minus the pass's seconds: everything a step costs besides the drafter, for i = 1 .. K + 1 (i = 1
  is also what a step costs after the harness skipped its pass);
* ``pass_s[b][k - 1]``: the P-EAGLE pass of ``b`` requests drafting k depths, for k = 1 .. K (vLLM's proposer drafts
  the K it was started with, so each k is an engine of its own); ``sampled_*``: the same with sampled requests
  (temperature 1, verified by rejection sampling).

Each point is the median of a call's full-batch steps (all ``b`` requests verifying the forced count), and the fastest
of ``repeats`` calls (other processes only ever add time); the points of a batch size take turns call by call, and
each row is made non-decreasing along its node / depth axis (:func:`peagle.decode.harness.cost.monotone`). The table
records the target, the drafter with the served K, vLLM's version and the device, which the harness checks when it
loads the table.

Each engine runs in a process of its own (vLLM spawns workers and keeps global state):
``python -m peagle.vllm.profile REQUEST.json RESULT.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["profile_vllm"]

CPU_KV_CACHE_GIB = "2"  # the engines' VLLM_CPU_KVCACHE_SPACE unless the environment sets it


def profile_vllm(
    target: str | os.PathLike,
    drafter: str | os.PathLike,
    *,
    num_speculative_tokens: int | None = None,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
    contexts: Sequence[int] = (64,),
    repeats: int = 3,
    steps: int = 12,
    llm_args: dict[str, Any] | None = None,
    progress: bool = True,
):
    """Profiles ``target`` with ``drafter`` served at K = ``num_speculative_tokens`` (default: the drafter's depths)
    through vLLM; returns the :class:`~peagle.decode.harness.cost.CostTable` (see the module doc). ``llm_args``:
    further ``vllm.LLM`` arguments, as the server will run (dtype, tensor_parallel_size, ...)."""
    from peagle.decode.harness.cost import CostTable, monotone
    from peagle.vllm.serve import speculative_config

    if repeats < 1 or steps < 1:
        raise ValueError(f"repeats and steps must be >= 1, got {repeats} and {steps}")
    if not batch_sizes or min(batch_sizes) < 1 or not contexts or min(contexts) < 1:
        raise ValueError(f"batch sizes and contexts must be >= 1, got {list(batch_sizes)} and {list(contexts)}")
    depth = speculative_config(drafter, num_speculative_tokens)["num_speculative_tokens"]
    batches, spans = sorted(set(batch_sizes)), sorted(set(contexts))
    results = {}
    for k in range(1, depth + 1):
        request = {
            "target": str(target),
            "drafter": str(drafter),
            "depth": k,
            "served_depth": depth,
            "verify": k == depth,
            "batch_sizes": batches,
            "contexts": spans,
            "repeats": repeats,
            "steps": steps,
            "llm_args": llm_args or {},
        }
        if progress:
            what = "verify steps and pass" if k == depth else "pass"
            print(f"profile (vLLM): K = {k} engine, {what} at batch sizes {batches}", flush=True)
        results[k] = _run_engine(request)
    served = results[depth]
    grids: dict[str, list] = {"verify_s": [], "sampled_verify_s": [], "pass_s": [], "sampled_pass_s": []}
    for b in batches:
        for name, sampled in (("verify_s", False), ("sampled_verify_s", True)):
            grids[name].append([monotone(served["verify"][f"{b}/{c}/{int(sampled)}"]) for c in spans])
        for name, sampled in (("pass_s", False), ("sampled_pass_s", True)):
            grids[name].append(monotone([results[k]["pass"][f"{b}/{int(sampled)}"] for k in range(1, depth + 1)]))
    return CostTable(
        batch_sizes=batches,
        contexts=spans,
        verify_nodes=list(range(1, depth + 2)),
        draft_widths=[1],
        draft_s=[],
        **grids,
        machine=served["machine"],
        target=served["target"],
        drafter=served["drafter"],
    )


def _run_engine(request: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="peagle-profile-") as tmp:
        req_path, out = Path(tmp) / "request.json", Path(tmp) / "result.json"
        log = Path(tmp) / "engine.log"
        req_path.write_text(json.dumps(request))
        env = dict(os.environ)
        # vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE, and without it from the machine's memory (an engine
        # reached 22.7 GB on a 24 GiB machine); 2 GiB holds the batches and contexts profiled by default. A user who
        # profiles more sets it (the variable only concerns vLLM's CPU platform).
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        with log.open("w") as f:
            proc = subprocess.run(
                [sys.executable, "-m", "peagle.vllm.profile", str(req_path), str(out)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
            )
        if proc.returncode != 0 or not out.exists():
            lines = log.read_text(errors="replace").splitlines()
            causes = [x for x in lines if "Error: " in x][:3]  # vLLM's workers report the root cause before the rest
            tail = "\n".join([*causes, "...", *lines[-20:]])
            raise RuntimeError(f"profile (vLLM) K = {request['depth']} failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())


def _measure(request: dict[str, Any]) -> dict[str, Any]:
    """One engine's measurements (in its own process): pass seconds per batch size and kind of request, and (the
    served K's engine) every point's verify seconds."""
    import torch
    from vllm import LLM, SamplingParams

    from peagle.vllm.harness import HARNESS_KEY, served_identity
    from peagle.vllm.serve import speculative_config

    depth, batches, spans, steps = request["depth"], request["batch_sizes"], request["contexts"], request["steps"]
    spec = {**speculative_config(request["drafter"], depth), HARNESS_KEY: {"profile": True}}
    counts = range(depth + 1) if request["verify"] else [depth]
    llm_args = {
        "max_num_seqs": max(batches),
        "max_model_len": max(spans) + steps * (depth + 1) + depth + 16,
        "seed": 0,
        **request["llm_args"],
    }
    llm = LLM(
        model=request["target"],
        speculative_config=spec,
        worker_extension_cls="peagle.vllm.harness.HarnessControl",
        skip_tokenizer_init=True,
        **llm_args,
    )
    vocab = llm.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(0)
    prompts = {c: torch.randint(0, vocab, (c,), generator=gen).tolist() for c in spans}
    llm.generate([{"prompt_token_ids": prompts[spans[0]]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    verify: dict[str, list[list[float]]] = {}
    passes: dict[str, list[float]] = {}
    for _ in range(request["repeats"]):
        for b in batches:
            for c in spans:
                for sampled in (False, True):
                    for drafts in counts:  # the points of a row take turns
                        params = SamplingParams(
                            temperature=1.0 if sampled else 0.0, max_tokens=steps * (drafts + 1), ignore_eos=True
                        )
                        llm.collective_rpc("peagle_harness", kwargs={"forced": drafts, "take_steps": True})
                        llm.generate([{"prompt_token_ids": prompts[c]}] * b, params, use_tqdm=False)
                        records = llm.collective_rpc("peagle_harness", kwargs={"take_steps": True})[0]["steps"]
                        full = [
                            r
                            for r in records
                            if r["batch"] == b and r["decode"] and r["drafts"] == [drafts] and r["pass_s"] is not None
                        ]
                        if not full:
                            raise RuntimeError(f"no step of {b} requests verifying {drafts} drafts was recorded")
                        step = statistics.median(r["step_s"] - r["pass_s"] for r in full)
                        drafter = statistics.median(r["pass_s"] for r in full)
                        verify.setdefault(f"{b}/{c}/{int(sampled)}", [[] for _ in range(depth + 1)])
                        if request["verify"]:
                            verify[f"{b}/{c}/{int(sampled)}"][drafts].append(step)
                        passes.setdefault(f"{b}/{int(sampled)}", []).append(drafter)
    target, drafter, machine = served_identity(request["target"], request["drafter"], request["served_depth"])
    return {
        "verify": {key: [min(times) for times in row] for key, row in verify.items()} if request["verify"] else {},
        "pass": {key: min(times) for key, times in passes.items()},
        "target": target,
        "drafter": drafter,
        "machine": machine,
    }


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[0]).read_text())
    result = _measure(request)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
