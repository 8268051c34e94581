"""`peagle regenerate --backend vllm`: the target answers through vLLM, every prompt of a chunk in one batched call.

Importing this module registers the ``vllm`` backend of :func:`peagle.train.regenerate.regenerate` (and of the
producers of ``peagle train --stream --producer-backend vllm``). vLLM gets token ids (no tokenizer of its own: the
records' ids go in and come out as they are); each answer's sampling seed is its own (``SamplingParams.seed``), so
sampled answers do not depend on the batch. The answer ends with the target's end-of-sequence token unless
``ignore_eos``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from peagle.train.regenerate import Sampling, register_generation_backend

__all__ = ["VllmAnswerer"]


class VllmAnswerer:
    """The target in vLLM (float32 and eager on a CPU-only machine, as the other vLLM-CPU paths run it)."""

    def __init__(
        self,
        target: str | os.PathLike,
        device: str = "cpu",
        max_len: int = 4096,
        llm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from transformers import AutoConfig
        from vllm import LLM

        config = AutoConfig.from_pretrained(str(target))
        eos = getattr(getattr(config, "text_config", None) or config, "eos_token_id", None)
        self.eos = set(eos if isinstance(eos, list) else [eos]) - {None}
        kwargs: dict[str, Any] = {"max_model_len": max_len, "skip_tokenizer_init": True, "seed": 0}
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            kwargs |= {"dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.05}
        self.llm = LLM(model=str(Path(target)), **(kwargs | (llm_kwargs or {})))

    def generate(self, prompts: list[list[int]], seeds: list[int], sampling: Sampling) -> list[list[int]]:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                seed=seed if sampling.temperature > 0 else None,
                max_tokens=sampling.max_new_tokens,
                ignore_eos=sampling.ignore_eos,
                stop_token_ids=None if sampling.ignore_eos else sorted(self.eos),
                detokenize=False,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        answers = [list(o.outputs[0].token_ids) for o in outputs]
        if not sampling.ignore_eos:  # an answer ends with its end-of-sequence token, as the transformers backend's
            for answer, output in zip(answers, outputs, strict=True):
                stop = output.outputs[0].stop_reason
                if isinstance(stop, int) and (not answer or answer[-1] != stop):
                    answer.append(stop)
        return answers

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


register_generation_backend("vllm", VllmAnswerer)
