"""The cost table: measured once per hardware and model pair (``peagle profile``), read by the harness policy.

A versioned JSON file holding the machine and model identity and two tables of wall-clock seconds:

* ``verify_s[b][c][i]``: one batched target forward (tree verification) of ``batch_sizes[b]`` requests whose contexts
  lie in the interval starting at ``contexts[c]``, each verifying ``verify_nodes[i]`` tree nodes (root included);
* ``draft_s[b][d][j]``: one drafter forward at draft depth ``d + 1`` over ``draft_widths[j]`` nodes per request
  (autoregressive drafting; empty in a table of P-EAGLE passes only, as ``peagle profile --backend vllm`` writes),
  and ``pass_s[b][k]``: one P-EAGLE pass drafting ``k + 1`` depths;
* ``sampled_verify_s`` and ``sampled_pass_s`` (version 2; optional): the same as ``verify_s`` and ``pass_s`` for
  sampled rounds (target probabilities and rejection sampling over every node; drafts drawn, with their
  full-vocabulary draft rows), which cost more per node than greedy ones. Sampled rounds read the greedy grids where a
  table has none (version 1 files).

Between measured points the policy interpolates linearly (node counts) and takes the nearest bucket (batch sizes: the
smallest measured one >= the batch, else the largest; contexts: the interval the context falls in).

Identity: ``machine``, ``target`` and ``drafter`` record what the timings belong to (:func:`machine_identity`,
:func:`model_identity`; the machine's ``backend``: peagle's engine, or the server that was timed, e.g. ``vllm 0.32.0``,
whose seconds include its whole step). :meth:`CostTable.identity_mismatches` names what differs from what is served.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from peagle.io import atomic_write_json

__all__ = ["COST_TABLE_VERSION", "ENGINE_BACKEND", "CostTable", "machine_identity", "model_identity", "monotone"]

COST_TABLE_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1: no sampled grids
ENGINE_BACKEND = "peagle"  # the machine's backend in tables of peagle's engine (tables without one are the engine's)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def machine_identity(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What the timings depend on besides the models: host, CPU / GPU, torch build and threads."""
    device = torch.device(device)
    ident = {
        "host": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        ident["gpu"] = torch.cuda.get_device_name(device)
    return ident


def model_identity(source: str | os.PathLike) -> dict[str, Any]:
    """What a model directory is, whatever its path: its config.json's SHA-256 and its weight files' bytes (a model
    copied elsewhere keeps them; another model, or the same one trained further, does not). A name that is not a
    directory (a hub id) is identified by the name."""
    path = Path(source)
    if not path.is_dir():
        return {"path": str(source)}
    config = path / "config.json"
    weights = sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES))
    return {
        "path": str(path.resolve()),
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "weights_bytes": weights,
    }


def monotone(row: list[float]) -> list[float]:
    """The row made non-decreasing by lowering each point to the smallest point at or after it: costs cannot fall as
    the work grows, and a late spike of interference must not make less work look dearer."""
    out, low = [], float("inf")
    for value in reversed(row):
        low = min(low, value)
        out.append(low)
    return out[::-1]


def _same_model(recorded: dict[str, Any], served: dict[str, Any]) -> bool:
    """Same content where both record it (:func:`model_identity`), else the same path; keys that both record beyond
    those (a served K) must agree too."""
    content = ("config_sha256", "weights_bytes")
    if all(recorded.get(k) is not None and served.get(k) is not None for k in content):
        same = all(recorded[k] == served[k] for k in content)
    else:
        same = recorded.get("path") == served.get("path")
    extra = (set(recorded) & set(served)) - {"path", *content}
    return same and all(recorded[k] == served[k] for k in extra)


def _device(machine: dict[str, Any]) -> str:
    """A machine's device as a table compares it: its kind, and the GPU's name or the CPU's."""
    kind = str(machine.get("device", "cpu")).split(":")[0]
    return f"{kind} ({machine.get('gpu') or machine.get('processor')})"


def _describe(model: dict[str, Any]) -> str:
    extra = {k: v for k, v in model.items() if k not in ("path", "config_sha256", "weights_bytes")}
    text = str(model.get("path", "?"))
    if model.get("config_sha256"):
        text += f" (config {model['config_sha256'][:12]}, {model.get('weights_bytes')} weight bytes)"
    return text + "".join(f", {k} {v}" for k, v in sorted(extra.items()))


@dataclass
class CostTable:
    """Seconds per batched forward; see the module docstring for the axes."""

    batch_sizes: list[int]
    contexts: list[int]
    verify_nodes: list[int]
    verify_s: list[list[list[float]]]
    draft_widths: list[int]
    draft_s: list[list[list[float]]]
    pass_s: list[list[float]] = field(default_factory=list)
    sampled_verify_s: list[list[list[float]]] = field(default_factory=list)
    sampled_pass_s: list[list[float]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] = field(default_factory=dict)
    drafter: dict[str, Any] = field(default_factory=dict)
    version: int = COST_TABLE_VERSION

    def __post_init__(self) -> None:
        if not self.draft_s and not self.pass_s:
            raise ValueError("CostTable: draft_s or pass_s must hold timings (an autoregressive or P-EAGLE drafter)")
        _check_axis("batch_sizes", self.batch_sizes, 1)
        _check_axis("contexts", self.contexts, 0)
        _check_axis("verify_nodes", self.verify_nodes, 1)
        _check_axis("draft_widths", self.draft_widths, 1)
        if self.verify_nodes[0] != 1:
            raise ValueError(f"CostTable: verify_nodes must start at 1 (the root alone), got {self.verify_nodes}")
        shape = [len(self.batch_sizes), len(self.contexts), len(self.verify_nodes)]
        _check_grid("verify_s", self.verify_s, shape)
        if self.draft_s:
            depths = len(self.draft_s[0])
            _check_grid("draft_s", self.draft_s, [len(self.batch_sizes), depths, len(self.draft_widths)])
        if self.pass_s:
            _check_grid("pass_s", self.pass_s, [len(self.batch_sizes), len(self.pass_s[0])])
        if self.sampled_verify_s:
            _check_grid("sampled_verify_s", self.sampled_verify_s, shape)
        if self.sampled_pass_s:
            depths = len(self.pass_s[0]) if self.pass_s else 0  # the depths of pass_s, which it needs
            _check_grid("sampled_pass_s", self.sampled_pass_s, [len(self.batch_sizes), depths])

    @property
    def max_depth(self) -> int:
        return len(self.draft_s[0]) if self.draft_s else len(self.pass_s[0])

    @property
    def backend(self) -> str:
        """What was timed: peagle's engine, or a server (``vllm 0.32.0``)."""
        return str(self.machine.get("backend", ENGINE_BACKEND))

    def identity_mismatches(
        self, target: dict[str, Any], drafter: dict[str, Any], machine: dict[str, Any]
    ) -> list[str]:
        """What differs between what this table was profiled for and what is served: the backend (its name, not its
        version), the device (kind and GPU or CPU name), the target and the drafter (:func:`model_identity`, plus
        keys both record, such as the served K). One line each; empty when everything matches."""
        out = []
        served_backend = str(machine.get("backend", ENGINE_BACKEND))
        if self.backend.split()[0] != served_backend.split()[0]:
            out.append(f"backend: profiled with {self.backend}, served by {served_backend}")
        if _device(self.machine) != _device(machine):
            out.append(f"device: profiled on {_device(self.machine)}, served on {_device(machine)}")
        for name, recorded, served in (("target", self.target, target), ("drafter", self.drafter, drafter)):
            if not _same_model(recorded, served):
                out.append(f"{name}: profiled for {_describe(recorded)}, served {_describe(served)}")
        return out

    def bucket(self, batch: int) -> int:
        """Index of the batch-size bucket: the smallest measured batch size >= ``batch``, else the largest."""
        return min(bisect.bisect_left(self.batch_sizes, batch), len(self.batch_sizes) - 1)

    def context_index(self, context: int) -> int:
        return max(bisect.bisect_right(self.contexts, context) - 1, 0)

    def verify_row(self, batch: int, context: int, max_nodes: int, sampled: bool = False) -> Tensor:
        """V[n] for n = 0 .. max_nodes (float64; V[0] = V[1]): linear between measured node counts, linear
        extrapolation from the last two beyond them. ``sampled``: of sampled rounds (the greedy grid without one)."""
        grid = self.sampled_verify_s if sampled and self.sampled_verify_s else self.verify_s
        row = grid[self.bucket(batch)][self.context_index(context)]
        return _interpolate(self.verify_nodes, row, max_nodes)

    def ragged_verify_row(
        self, batch: int, context: int, max_drafts: int, sampled: bool = False, fixed: int = 0
    ) -> Tensor:
        """V[n] for n = 0 .. max_drafts + 1 (float64; V[0] = V[1]): one target forward of ``batch`` requests that
        verify ``fixed`` + n - 1 drafts in all, as a server that does not pad its batches runs them (vLLM: each
        request verifies its own drafts). The table's seconds of ``batch`` requests of i nodes each, read at the mean
        node count 1 + drafts / batch (linear between node counts)."""
        nodes = [1.0 + (fixed + max(n - 1, 0)) / batch for n in range(max_drafts + 2)]
        row = self.verify_row(batch, context, math.ceil(nodes[-1]) + 1, sampled).tolist()
        out = []
        for x in nodes:
            low = int(x)
            out.append(row[low] + (row[min(low + 1, len(row) - 1)] - row[low]) * (x - low))
        return torch.tensor(out, dtype=torch.float64)

    def draft_row(self, batch: int, depth: int) -> Tensor:
        """t_depth(w) for the table's widths, float64 [W]; depths beyond the measured ones use the deepest."""
        if not self.draft_s:
            raise ValueError(
                f"this cost table ({self.backend}) times P-EAGLE passes only: an autoregressive drafter needs a table "
                "of `peagle profile` (peagle's engine)"
            )
        rows = self.draft_s[self.bucket(batch)]
        return torch.tensor(rows[min(max(depth, 1), len(rows)) - 1], dtype=torch.float64)

    def pass_time(self, batch: int, depths: int, sampled: bool = False) -> float:
        """Seconds of one P-EAGLE pass drafting ``depths`` depths (0 when not profiled). ``sampled``: of sampled
        rounds (the greedy grid without one)."""
        grid = self.sampled_pass_s if sampled and self.sampled_pass_s else self.pass_s
        if not grid:
            return 0.0
        row = grid[self.bucket(batch)]
        return float(row[min(max(depths, 1), len(row)) - 1])

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        atomic_write_json(path, asdict(self))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostTable:
        data = json.loads(Path(path).read_text())
        version = data.get("version")
        if version not in _READABLE_VERSIONS:
            raise ValueError(
                f"cost table {path}: version {version!r} is not supported (expected one of {_READABLE_VERSIONS}); "
                "run `peagle profile` again"
            )
        return cls(**data)


def _interpolate(xs: list[int], ys: list[float], max_nodes: int) -> Tensor:
    out = []
    for n in range(max_nodes + 1):
        n = max(n, 1)
        i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1) if len(xs) > 1 else 0
        if len(xs) == 1:
            out.append(ys[0])
            continue
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        out.append(max(y0 + (y1 - y0) * (n - x0) / (x1 - x0), 0.0))
    return torch.tensor(out, dtype=torch.float64)


def _check_axis(name: str, values: list[int], low: int) -> None:
    if not values or any(not isinstance(v, int) or v < low for v in values) or sorted(set(values)) != list(values):
        raise ValueError(f"CostTable: {name} must be a non-empty ascending list of ints >= {low}, got {values!r}")


def _check_grid(name: str, grid, shape: list[int]) -> None:
    tensor = torch.tensor(grid, dtype=torch.float64) if grid else torch.zeros(0)
    if list(tensor.shape) != shape or not bool(torch.isfinite(tensor).all()) or bool((tensor < 0).any()):
        raise ValueError(
            f"CostTable: {name} must be a grid of finite seconds >= 0 of shape {shape}, got shape {list(tensor.shape)}"
        )
