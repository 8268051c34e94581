"""One round of depth-by-depth drafting as a chain of CUDA graphs, each depth deciding on the device whether the next
depth runs, with no host synchronisation inside the round; without CUDA, the same decisions in a host loop.

A round is ``D`` depth steps and a finalize step (plain callables that launch device work: drafting one depth, then
the harness decision; building the tree / verifying after the last depth). Each depth step ends by writing the go flag
(``go``: a 1-element int32 tensor, nonzero = draft another depth). The decision after depth ``d`` is::

    next = depth d + 1   if go != 0 and d + 1 < D
           finalize      otherwise

so depth 0 always runs, and finalize runs exactly once per round.

Modes (:class:`DepthGraphChain`):

* ``"device"``: one CUDA graph per depth plus one for finalize, captured once. Each depth graph ends with a one-thread
  kernel (``torch.ops.peagle.graph_chain_tail``) that reads ``go`` and tail-launches the next graph from the device
  (graphs instantiated for device launch and uploaded; their handles live in device memory). :meth:`run` launches
  depth 0 from the host and returns without synchronising; work queued on the same stream afterwards (e.g. the copy
  of the emitted tokens) waits for the whole chain.
* ``"host_graphs"``: the same per-depth graphs launched from the host, which reads ``go`` after each depth (a
  synchronisation per depth): the baseline of ``benchmarks/bench_graph_chain.py``.
* ``"host"``: the steps called eagerly in a host loop that reads ``go`` after each depth: the CPU path.

Graphs are captured once and replayed every round, so everything that changes between rounds (widths, offsets, live
rows, RNG offsets, the round's root tokens) must be device tensors the steps read, updated in place before
:meth:`run`; the steps must pass data to each other through tensors that outlive the chain (captured addresses), not
through tensors they allocate (a graph's temporaries may share memory with a later graph's). Building a chain on CUDA
first calls every step once eagerly on a side stream (warm-up: lazy initialisation must not happen inside a capture),
so the caller resets its round state after construction. One chain serves one padded batch size:
:class:`GraphChainCache` keeps one per size.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Generic, Literal, Protocol, TypeVar

import torch
from torch import Tensor

import peagle  # noqa: F401  (loads peagle._C: the graph chain ops of a CUDA build)

Step = Callable[[], None]
Mode = Literal["auto", "device", "host_graphs", "host"]
MODES: tuple[str, ...] = ("auto", "device", "host_graphs", "host")


class _Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)  # what a GraphChainCache holds per padded batch size

# status[1] value the tail kernel records when a graph handle is missing (csrc/cuda/graph_chain_kernels.h).
_NO_HANDLE = -1


def device_launch_available(device: torch.device | str) -> bool:
    """Whether graphs on ``device`` can be chained by device graph launch: a CUDA device, a CUDA build of peagle with
    relocatable device code (not ``PEAGLE_NO_DLINK=1``), a torch whose CUDAGraph keeps its captured graph, and torch's
    native caching allocator (under ``backend:cudaMallocAsync`` captures hold memory allocation nodes, which a graph
    instantiated for device launch may not)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if not hasattr(torch.ops.peagle, "graph_chain_available"):  # a CPU build of peagle
        return False
    if torch.cuda.get_allocator_backend() != "native":
        return False
    try:
        torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # torch before keep_graph: the raw cudaGraph_t is not reachable
        return False
    with torch.cuda.device(device):
        return bool(torch.ops.peagle.graph_chain_available())


def _resolve_mode(mode: str, go: Tensor) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "device" if device_launch_available(go.device) else "host"
    if mode == "device" and not device_launch_available(go.device):
        raise RuntimeError(
            f"mode='device' needs go on a CUDA device and a CUDA build of peagle with device graph launch "
            f"(not PEAGLE_NO_DLINK=1), got go on {go.device}"
        )
    if mode == "host_graphs" and go.device.type != "cuda":
        raise ValueError(f"mode='host_graphs' needs go on a CUDA device, got {go.device}")
    return mode


def _check_args(depth_steps: Sequence[Step], finalize: Step, go: Tensor) -> None:
    if len(depth_steps) == 0:
        raise ValueError("depth_steps must hold at least one depth step, got none")
    for i, step in enumerate(depth_steps):
        if not callable(step):
            raise TypeError(f"depth_steps[{i}] must be callable, got {type(step).__name__}")
    if not callable(finalize):
        raise TypeError(f"finalize must be callable, got {type(finalize).__name__}")
    if not isinstance(go, Tensor) or go.dtype != torch.int32 or go.numel() != 1 or not go.is_contiguous():
        got = f"a {go.dtype} tensor of shape {tuple(go.shape)}" if isinstance(go, Tensor) else type(go).__name__
        raise ValueError(f"go must be a contiguous 1-element int32 tensor, got {got}")


def _warm_up(steps: Sequence[Step], device: torch.device) -> None:
    """Calls every step once on a side stream: lazy initialisation (workspaces, module loading) must not happen inside
    a capture."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for step in steps:
            step()
    torch.cuda.current_stream(device).wait_stream(side)


def _capture(step: Step, pool: tuple, keep_graph: bool, device: torch.device) -> torch.cuda.CUDAGraph:
    # On the chain's device: torch.cuda.graph captures on the current device's stream.
    with torch.cuda.device(device):
        graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
        with torch.cuda.graph(graph, pool=pool):
            step()
    return graph


# Chains garbage-collected while a stream captured a graph: destroying one synchronises the device, which would break
# that capture, so they wait here for the next chain built or closed.
_pending_destroy: list[int] = []


def _destroy_pending() -> None:
    """Destroys the executable graphs of the deferred chains, unless a capture is under way."""
    if torch.cuda.is_current_stream_capturing():
        return
    while _pending_destroy:
        torch.ops.peagle.graph_chain_destroy(_pending_destroy.pop())


def _destroy_chain(chain: int) -> None:
    """Destroys the executable graphs of ``chain`` (and of chains deferred earlier), or defers it during a capture."""
    _pending_destroy.append(chain)
    _destroy_pending()


class DepthGraphChain:
    """Runs one round: depth steps in order while ``go`` says so, then ``finalize`` once (see the module docstring).

    Args:
        depth_steps: the round's depth steps, depth 0 first; each ends by writing ``go``.
        finalize: the step after the last depth that ran.
        go: the go flag, a 1-element int32 tensor (on the device the steps run on).
        mode: ``"auto"`` (``"device"`` where device graph launch is available, else ``"host"``), ``"device"``,
            ``"host_graphs"`` or ``"host"``.
    """

    def __init__(self, depth_steps: Sequence[Step], finalize: Step, go: Tensor, *, mode: Mode = "auto") -> None:
        _check_args(depth_steps, finalize, go)
        self.mode = _resolve_mode(mode, go)
        self.go = go
        self.num_depths = len(depth_steps)
        self._steps, self._finalize = list(depth_steps), finalize
        self._transitions = 0  # host modes: depths run so far (each is followed by one transition)
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._chain: int | None = None
        self._closer: weakref.finalize | None = None
        self._closed = False
        if self.mode == "device":
            self._build_device_chain()
        elif self.mode == "host_graphs":
            self._build_host_graphs()

    def _build_device_chain(self) -> None:
        go, device = self.go, self.go.device
        # Handles of the depth graphs, then finalize's: written by graph_chain_create, read by the tail kernels.
        self._execs = torch.zeros(self.num_depths + 1, dtype=torch.int64, device=device)
        self._status = torch.zeros(2, dtype=torch.int32, device=device)  # tail launches, first error
        scratch = torch.zeros_like(self._status)

        def warm_tail() -> None:
            # CUDA launches the tail kernel only from a graph (graph_chain_tail refuses an eager call): it warms up in
            # a throwaway graph, where no handle is written yet, so it only records that into a scratch status.
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                torch.ops.peagle.graph_chain_tail(go, self._execs, scratch, 0)
            graph.replay()

        _warm_up([*self._steps, self._finalize], device)
        with torch.cuda.device(device):
            warm_tail()
        _destroy_pending()
        pool = torch.cuda.graph_pool_handle()
        for depth, step in enumerate(self._steps):

            def step_then_tail(step: Step = step, depth: int = depth) -> None:
                step()
                torch.ops.peagle.graph_chain_tail(go, self._execs, self._status, depth)

            self._graphs.append(_capture(step_then_tail, pool, keep_graph=True, device=device))
        self._graphs.append(_capture(self._finalize, pool, keep_graph=True, device=device))
        with torch.cuda.device(device):
            self._chain = torch.ops.peagle.graph_chain_create([g.raw_cuda_graph() for g in self._graphs], self._execs)
        # Destroys the executable graphs before the torch graphs (and their memory pool) go; during a capture, at the
        # next chain built or closed (_destroy_chain).
        self._closer = weakref.finalize(self, _destroy_chain, self._chain)

    def _build_host_graphs(self) -> None:
        _warm_up([*self._steps, self._finalize], self.go.device)
        pool = torch.cuda.graph_pool_handle()
        device = self.go.device
        self._graphs = [
            _capture(step, pool, keep_graph=False, device=device) for step in [*self._steps, self._finalize]
        ]

    def run(self) -> None:
        """Runs one round. On ``"device"`` it only launches depth 0 and returns (no synchronisation); the host modes
        read ``go`` after each depth."""
        if self._closed:
            raise RuntimeError("this DepthGraphChain is closed")
        if self.mode == "device":
            torch.ops.peagle.graph_chain_launch(self._chain)
            return
        if self.mode == "host_graphs":
            depths: Sequence[Step] = [g.replay for g in self._graphs[:-1]]
            finalize: Step = self._graphs[-1].replay
        else:
            depths, finalize = self._steps, self._finalize
        for depth, step in enumerate(depths):
            step()
            self._transitions += 1
            if depth + 1 == self.num_depths or int(self.go.reshape(())) == 0:
                break
        finalize()

    def transitions(self) -> int:
        """Depths run over every round so far (each ends in one transition: to the next depth or to finalize). On
        ``"device"`` this is the tail kernels' device counter, read with a synchronisation."""
        if self.mode == "device":
            return int(self._status[0])
        return self._transitions

    def check(self) -> None:
        """Raises if a device tail launch failed in any round so far (synchronises; a no-op in the host modes)."""
        if self.mode != "device":
            return
        code = int(self._status[1])
        if code == _NO_HANDLE:
            raise RuntimeError("graph chain: a tail kernel found no graph handle (chain not instantiated or destroyed)")
        if code != 0:
            raise RuntimeError(f"graph chain: a device tail launch failed with cudaError_t {code}")

    def close(self) -> None:
        """Waits for the device and destroys the executable graphs (also done when the chain is garbage collected)."""
        if self._closer is not None:
            self._closer()
        self._graphs = []
        self._closed = True


class GraphChainCache(Generic[C]):
    """One chain per padded batch size (:func:`padded_batch_size`), built on first use by ``build(padded_batch)``:
    a :class:`DepthGraphChain`, or an object that owns one together with the buffers its steps read (anything with
    ``close()``)."""

    def __init__(self, build: Callable[[int], C]) -> None:
        self._build = build
        self._chains: dict[int, C] = {}

    def get(self, padded_batch: int) -> C:
        if isinstance(padded_batch, bool) or not isinstance(padded_batch, int) or padded_batch <= 0:
            raise ValueError(f"padded_batch must be a positive int, got {padded_batch!r}")
        chain = self._chains.get(padded_batch)
        if chain is None:
            chain = self._chains[padded_batch] = self._build(padded_batch)
        return chain

    def __len__(self) -> int:
        return len(self._chains)

    def close(self) -> None:
        for chain in self._chains.values():
            chain.close()
        self._chains.clear()


def padded_batch_size(rows: int, limit: int) -> int:
    """The batch size a round of ``rows`` requests runs at: the next power of two, at most ``limit`` (the generate
    call's batch), so that a shrinking batch reuses a few captured chains instead of capturing one per size."""
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= limit:
        raise ValueError(f"rows must be an int in [1, limit={limit}], got {rows!r}")
    return min(1 << (rows - 1).bit_length(), limit)
