"""Runs one vLLM-CPU engine configuration in its own process and writes its results as JSON (used by the vLLM tests:
a fresh process per configuration keeps plugin state, environment and memory apart).

    python vllm_runner.py CONFIG_JSON   ->  writes {"runs": [{"outputs", "metrics", "seconds"}, ...]} to result_file

A run may give "concurrency" C (its prompts go to LLM.generate C at a time, so at most C requests share a step) and
"harness": true (the engine then loads the harness's worker extension, and the run records the draft lengths the
harness chose, ``llm.collective_rpc("peagle_harness")``); its "sampling" may be a list, one per prompt. "llm_args" are
further LLM arguments.

Tests call :func:`run_vllm` (this file's directory is on sys.path under pytest).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_vllm(config: dict) -> list[dict]:
    """Runs ``config`` (model, runs, optional speculative_config / env / dtype / ...) in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        proc = subprocess.run(
            [sys.executable, __file__, json.dumps({**config, "result_file": str(result)})],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert proc.returncode == 0 and result.exists(), (proc.stdout + proc.stderr)[-4000:]
        return json.loads(result.read_text())["runs"]


def acceptance_length(metrics: dict) -> float:
    """vLLM's mean acceptance length (1 + accepted drafts per verification) from its spec-decode counters."""
    return 1.0 + metrics["vllm:spec_decode_num_accepted_tokens"] / metrics["vllm:spec_decode_num_drafts"]


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.update(config.get("env", {}))
    from vllm import LLM, SamplingParams

    harness = any(run.get("harness") for run in config["runs"])
    extension = {"worker_extension_cls": "peagle.vllm.harness.HarnessControl"} if harness else {}
    llm = LLM(
        model=config["model"],
        dtype=config.get("dtype", "float32"),
        max_model_len=config.get("max_model_len", 512),
        enforce_eager=True,
        gpu_memory_utilization=0.05,
        disable_log_stats=False,
        skip_tokenizer_init=True,
        seed=config.get("seed", 0),
        enable_prefix_caching=config.get("enable_prefix_caching", None),
        **({"speculative_config": config["speculative_config"]} if config.get("speculative_config") else {}),
        **extension,
        **config.get("llm_args", {}),
    )
    runs = []
    for run in config["runs"]:
        sampling = run["sampling"]  # one dict for every prompt, or a list of one per prompt
        params = [SamplingParams(ignore_eos=True, **s) for s in sampling] if isinstance(sampling, list) else (
            [SamplingParams(ignore_eos=True, **sampling)] * len(run["prompts"]))  # fmt: skip
        prompts = [{"prompt_token_ids": ids} for ids in run["prompts"]]
        if run.get("harness"):
            llm.collective_rpc("peagle_harness")  # the lengths chosen so far belong to earlier runs
        step = run.get("concurrency") or len(prompts)
        start = time.perf_counter()
        outputs = []
        for first in range(0, len(prompts), step):
            outputs += llm.generate(prompts[first : first + step], params[first : first + step], use_tqdm=False)
        seconds = time.perf_counter() - start
        metrics = {}  # cumulative over the engine's life
        for metric in llm.get_metrics():
            if "spec_decode" in metric.name:
                metrics[metric.name] = metric.value if hasattr(metric, "value") else list(metric.values)
        lengths = llm.collective_rpc("peagle_harness")[0] if run.get("harness") else None
        runs.append({"outputs": [[list(c.token_ids) for c in o.outputs] for o in outputs], "metrics": metrics,
                     "seconds": seconds, "harness": lengths})  # fmt: skip
    with open(config["result_file"], "w") as f:
        json.dump({"runs": runs}, f)
