"""The cost table: measured once per hardware and model pair (``peagle profile``), read by the harness policy.

A versioned JSON file holding the machine and model identity and two tables of wall-clock seconds:

* ``verify_s[b][c][i]``: one batched target forward (tree verification) of ``batch_sizes[b]`` requests whose contexts
  lie in the interval starting at ``contexts[c]``, each verifying ``verify_nodes[i]`` tree nodes (root included);
* ``draft_s[b][d][j]``: one drafter forward at draft depth ``d + 1`` over ``draft_widths[j]`` nodes per request
  (autoregressive drafting), and ``pass_s[b][k]``: one P-EAGLE pass drafting ``k + 1`` depths;
* ``sampled_verify_s`` and ``sampled_pass_s`` (version 2; optional): the same as ``verify_s`` and ``pass_s`` for
  sampled rounds (target probabilities and rejection sampling over every node; drafts drawn, with their
  full-vocabulary draft rows), which cost more per node than greedy ones. Sampled rounds read the greedy grids where a
  table has none (version 1 files).

Between measured points the policy interpolates linearly (node counts) and takes the nearest bucket (batch sizes: the
smallest measured one >= the batch, else the largest; contexts: the interval the context falls in).
"""

from __future__ import annotations

import bisect
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from peagle.io import atomic_write_json

__all__ = ["COST_TABLE_VERSION", "CostTable", "machine_identity"]

COST_TABLE_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # version 1: no sampled grids


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
        _check_axis("batch_sizes", self.batch_sizes, 1)
        _check_axis("contexts", self.contexts, 0)
        _check_axis("verify_nodes", self.verify_nodes, 1)
        _check_axis("draft_widths", self.draft_widths, 1)
        if self.verify_nodes[0] != 1:
            raise ValueError(f"CostTable: verify_nodes must start at 1 (the root alone), got {self.verify_nodes}")
        shape = [len(self.batch_sizes), len(self.contexts), len(self.verify_nodes)]
        _check_grid("verify_s", self.verify_s, shape)
        depths = len(self.draft_s[0]) if self.draft_s else 0
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
        return len(self.draft_s[0])

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

    def draft_row(self, batch: int, depth: int) -> Tensor:
        """t_depth(w) for the table's widths, float64 [W]; depths beyond the measured ones use the deepest."""
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
