"""`peagle serve`: the `vllm serve` command line that serves a peagle drafter beside its target."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from peagle.model.config import OPTIONS_KEY


def serve_command(
    drafter: str | os.PathLike,
    target: str | None = None,
    num_speculative_tokens: int | None = None,
    extra_args: list[str] | None = None,
) -> list[str]:
    """argv of `vllm serve TARGET --speculative-config ...` for a speculators-format drafter directory.

    The target defaults to the verifier recorded in the drafter's config.json and K to its number of depths; a K = 1
    drafter (EAGLE-3) is served autoregressively, a P-EAGLE one with parallel drafting.
    """
    config_path = Path(drafter) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"drafter: {config_path} not found (expected a peagle/speculators checkpoint directory)"
        )
    config = json.loads(config_path.read_text())
    if config.get(OPTIONS_KEY):
        raise ValueError(
            f"drafter {drafter} uses options vLLM cannot serve ({', '.join(config[OPTIONS_KEY])}); serve it with "
            "peagle's engine (peagle.decode)"
        )
    spec = config.get("speculators_config", {})
    if target is None:
        target = spec.get("verifier", {}).get("name_or_path")
        if not target:
            raise ValueError(f"{config_path} names no verifier: pass --target")
    depths = max((m.get("speculative_tokens", 1) for m in spec.get("proposal_methods", [])), default=1)
    parallel = config.get("speculators_model_type") == "peagle" and depths > 1
    tokens = num_speculative_tokens or depths
    if parallel and tokens > depths:
        raise ValueError(f"num_speculative_tokens {tokens} exceeds the drafter's {depths} parallel depths")
    speculative = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": tokens}
    if parallel:
        speculative["parallel_drafting"] = True
    return ["vllm", "serve", str(target), "--speculative-config", json.dumps(speculative), *(extra_args or [])]


def format_command(argv: list[str], peagle_verify: bool) -> str:
    prefix = "PEAGLE_VLLM_VERIFY=1 " if peagle_verify else ""
    return prefix + shlex.join(argv)
