"""Data-parallel training through torch's own wrappers: DistributedDataParallel (the drafter replicated on every
process) or, with ``--fsdp``, FSDP2 ``fully_shard`` (parameters, gradients and optimizer state sharded, each decoder
layer and the rest of the drafter gathered only while it runs).

A step's micro-batches run forward and backward with gradient sync off, so each process accumulates the gradients of
its own rows. One zero-valued pass through the wrapper (two elements of an all-zero row, loss times 0, so every
parameter is reached and no gradient changes) then hands the accumulated gradients to DDP's all-reduce or FSDP2's
reduce-scatter: every process takes part in exactly one reduction per step, also when none of its rows carried loss
(a row without trained labels runs no backward at all). Both wrappers average over processes.

Checkpoints hold full (unsharded) tensors gathered on rank 0, so a sharded run's checkpoint loads anywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from peagle.model import DraftOutput, PEagleDrafter

__all__ = ["ParallelDrafter", "TrainForward"]

Mode = Literal["single", "ddp", "fsdp"]
# Full tensors on rank 0 (on the CPU); the other ranks get empty dicts.
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
PREFIX = "drafter."


class TrainForward(nn.Module):
    """The drafter's ``forward_train`` as a module's forward: DDP and FSDP2 act in hooks around ``forward``."""

    def __init__(self, drafter: PEagleDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, *args: Any, sync_only: bool = False, **kwargs: Any) -> DraftOutput | Tensor:
        if not sync_only:
            return self.drafter.forward_train(*args, **kwargs)
        # Two elements (depth 0 and 1) reach every parameter, mask_hidden included; the result is an exact zero.
        width = self.drafter.config.num_aux * self.drafter.config.hidden_size
        device = self.drafter.embed_tokens.weight.device
        zeros = torch.zeros(2, dtype=torch.long, device=device)
        out = self.drafter.forward_train(
            zeros, torch.zeros(2, width, device=device), zeros, torch.tensor([0, 1], device=device), zeros
        )
        return out.logits.sum() * 0.0


class ParallelDrafter:
    """A drafter wrapped for ``world`` processes (``mode`` single, ddp or fsdp); see the module docstring."""

    def __init__(self, drafter: PEagleDrafter, mode: Mode, world: int, device: torch.device) -> None:
        if mode != "single" and not dist.is_initialized():
            raise ValueError(f"{mode} needs an initialised process group (run under torchrun)")
        self.drafter = drafter
        self.mode = mode
        self.root = TrainForward(drafter)
        self.module: nn.Module = self.root
        if mode == "ddp":
            ids = [device.index] if device.type == "cuda" else None
            # MoE experts no element of the sync pass routes to, and the low-rank head that only its KL loss
            # reaches, take no part in that pass: DDP then reduces their accumulated gradients as unused ones.
            cfg = drafter.config
            unreached = cfg.moe_num_experts > 0 or cfg.efficient_lm_head
            self.module = nn.parallel.DistributedDataParallel(
                self.root, device_ids=ids, broadcast_buffers=False, find_unused_parameters=unreached
            )
        elif mode == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (world,))
            for layer in drafter.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.root, mesh=mesh)

    def forward(self, *args: Any, **kwargs: Any) -> DraftOutput:
        """``forward_train`` through the wrapper (what :func:`peagle.train.trainer.train_row` calls)."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside only accumulate local gradients; :meth:`sync` reduces them afterwards."""
        if self.mode == "ddp":
            with self.module.no_sync():
                yield
        elif self.mode == "fsdp":
            self.root.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.root.set_requires_gradient_sync(True)
        else:
            yield

    def sync(self) -> None:
        """The one gradient reduction of a step (every process calls it once); nothing on a single process."""
        if self.mode != "single":
            self.module(sync_only=True).backward()

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def full_gradients(self) -> dict[str, Tensor]:
        """Every parameter's whole gradient (a collective under FSDP: all processes call it)."""
        return {
            name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for name, p in self.drafter.named_parameters()
        }

    def full_state_dict(self) -> dict[str, Tensor]:
        """The drafter's weights, whole, on rank 0 (empty elsewhere); a collective under FSDP."""
        state = get_model_state_dict(self.root, options=FULL)
        return {name.removeprefix(PREFIX): tensor for name, tensor in state.items()}

    def full_drafter(self) -> PEagleDrafter | None:
        """A drafter with whole weights on rank 0 (the drafter itself unless sharded), None elsewhere."""
        if self.mode != "fsdp":
            return self.drafter if not dist.is_initialized() or dist.get_rank() == 0 else None
        state = self.full_state_dict()
        if not state:
            return None
        copy = PEagleDrafter(self.drafter.config)
        copy.load_state_dict(state)
        return copy.to(self.drafter.embed_tokens.weight.device)

    def load_full_state_dict(self, state: dict[str, Tensor]) -> None:
        """Whole weights (every process passes them) into the drafter, sharding them under FSDP."""
        try:
            set_model_state_dict(self.root, {PREFIX + k: v for k, v in state.items()}, options=FULL_LOAD)
        except (RuntimeError, KeyError) as err:
            raise ValueError(f"the checkpoint's weights do not match this drafter: {err}") from err

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, whole, on rank 0 (a collective under FSDP)."""
        return get_optimizer_state_dict(self.root, optimizer, options=FULL)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if all(isinstance(p, int) for group in state["param_groups"] for p in group["params"]):
            if self.mode == "fsdp":
                raise ValueError("a checkpoint from before name-keyed optimizer states cannot resume with --fsdp")
            optimizer.load_state_dict(state)  # written by an earlier peagle: parameters by position
            return
        set_optimizer_state_dict(self.root, optimizer, state, options=FULL_LOAD)


FULL_LOAD = StateDictOptions(full_state_dict=True)
