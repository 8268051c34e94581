"""The harness inside vLLM: per step, each request verifies only the first L of the K tokens the P-EAGLE pass drafted,
L chosen by :class:`peagle.decode.harness.steps.StepHarness` from the live batch size, the cost table and the drafter's
confidence (the engine's policy pieces; see that module for the decision).

Opt in with a cost table of this vLLM, target, drafter and device (``peagle profile --backend vllm``):

    LLM(model=TARGET, speculative_config={"method": "eagle3", "parallel_drafting": True, "model": DRAFTER,
        "num_speculative_tokens": K, "peagle_harness": "costs.json"})
    vllm serve TARGET --speculative-config '{..., "peagle_harness": "costs.json"}'    # or: peagle serve --harness

Without that key vLLM runs exactly as before (the plugin's hooks only look for it). In the process that builds the
engine's configuration the plugin takes the key out of the speculative config (vLLM's own refuses unknown keys),
loads the table, refuses one profiled for another target, drafter, K, backend or device (naming what differs), turns
async scheduling off where it was left to vLLM (see below), and hands the table to the workers in
``additional_config["peagle_harness"]`` (where a user may also give it, as a path, instead).

Where the decision runs, and why there: on the CPU of the worker, in ``take_draft_token_ids``, after vLLM's own wait
for the drafted tokens. vLLM's synchronous scheduler takes the next step's drafts as host lists
(``Scheduler.update_draft_token_ids``, which accepts a list of its own length per request, as the n-gram proposer's
are), so the drafts come to the host every step anyway; the drafter's per-depth confidence (its top-1 probability,
[B, K] floats, computed on the device from the pass's logits) rides in the same device-to-host copy, before the event
vLLM waits on. The decision needs what the host has: the live batch, the request ids (the per-request calibration
follows a request, not its row, as vLLM reorders its batch), the cost table; and it writes host lists. So no
synchronisation is added and the device's work (the drafter's and the target's forwards, CUDA graphs) is unchanged.
The step's verification is observed on the host too, from the sampled tokens vLLM returns to the scheduler.

vLLM's parallel-drafting proposer drafts the K it was configured with in every pass (its slots per request are laid
out at start), so the harness chooses how many drafts the target verifies, not the pass's depth; and, before the pass,
whether it runs at all (:meth:`StepHarness.plan_pass <peagle.decode.harness.steps.StepHarness.plan_pass>`, on the
host from the same facts, in ``propose_draft_token_ids``): where the table says no request's drafts will pay for it
(a large batch, whose forward is compute-bound), the pass is skipped and every request decodes plainly next step.
A skipped pass writes nothing in the drafter's KV cache for that step's positions (as vLLM's own skip of the drafter
near ``max_model_len``), so a request that drafts again later may accept less; what is emitted is still the
target's. So a step that processed prompt tokens always runs its pass: the drafter's KV then holds every prompt, and
only decoded positions of skipped steps are missing from it.

Fallback, one log line each, with vLLM's fixed K left in place: a vLLM whose scheduler or model runner lacks the
per-request draft lists (a version other than :data:`peagle.vllm.SUPPORTED_VLLM`, or other methods), async scheduling
(the drafts then stay on the device and every request is scheduled K slots: serve with ``--no-async-scheduling``), a
proposer other than EAGLE's (n-gram, draft models) or one that reduces its argmax on the device
(``use_local_argmax_reduction``: no probabilities).
"""

from __future__ import annotations

import logging
import platform
import time
import types
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from peagle.decode.harness.cost import CostTable, model_identity
from peagle.decode.harness.steps import StepHarness

__all__ = [
    "HARNESS_KEY",
    "HarnessControl",
    "attach_to_runner",
    "drop_option",
    "harness_config",
    "install",
    "lacks_per_request_lengths",
    "served_identity",
]

HARNESS_KEY = "peagle_harness"  # in the speculative config (a cost table path) and in vLLM's additional_config
_log = logging.getLogger("peagle.vllm")
# What the harness wraps, with the parameters it was written for (vLLM 0.32).
_RUNNER_METHODS = {
    "execute_model": ("scheduler_output", "intermediate_tensors"),
    "sample_tokens": ("grammar_output",),
    "propose_draft_token_ids": (
        "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states", "sample_hidden_states",
        "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata", "slot_mappings",
    ),
    "_copy_draft_token_ids_to_cpu": ("scheduler_output", "zeros_only"),
    "take_draft_token_ids": (),
}  # fmt: skip
_PROPOSER_METHODS = {"propose": None, "_sample_draft_tokens": ("hidden_states", "sampling_metadata")}


def served_identity(target: str, drafter: str, depth: int) -> tuple[dict, dict, dict]:
    """(target, drafter, machine) as a cost table records them for this vLLM and device (the profile and the check
    both use this, so they agree)."""
    import vllm
    from vllm.platforms import current_platform

    kind = current_platform.device_type
    machine: dict[str, Any] = {"backend": f"vllm {vllm.__version__}", "device": kind}
    if kind == "cpu":
        machine["processor"] = platform.processor() or platform.machine()
    else:
        machine["gpu"] = current_platform.get_device_name()
    return model_identity(target), {**model_identity(drafter), "num_speculative_tokens": depth}, machine


def harness_config(option: Any, target: str, speculative: Any) -> dict[str, Any]:
    """The workers' ``additional_config["peagle_harness"]`` for the option a user gave (a cost table's path, or a
    dict already made: ``{"cost_table": {...}}`` or the profile's ``{"profile": True}``), after checking the table
    against what is served. Raises ValueError naming what differs."""
    if speculative is None:
        raise ValueError(f"{HARNESS_KEY}: the harness chooses draft lengths, so it needs a speculative_config")
    if isinstance(option, dict) and option.get("profile"):
        return {"profile": True}
    if isinstance(option, dict):
        table, source = CostTable(**option["cost_table"]), option.get("source", "the cost table")
    else:
        source = str(option)
        if not Path(source).is_file():
            raise ValueError(f"{HARNESS_KEY}: cost table {source} not found (write one with `peagle profile --backend "
                             "vllm`)")  # fmt: skip
        table = CostTable.load(source)
    depth = int(speculative.num_speculative_tokens)
    differs = table.identity_mismatches(*served_identity(target, str(speculative.model), depth))
    if differs:
        raise ValueError(
            f"{HARNESS_KEY}: cost table {source} was not profiled for what this engine serves; "
            + "; ".join(differs)
            + ". Profile it with `peagle profile --backend vllm`."
        )
    return {"cost_table": asdict(table), "source": source}


def install() -> None:
    """Hooks for the option, installed by the plugin's ``register`` (every vLLM process): the configuration hook that
    moves it out of the speculative config, and the model runner's start, which attaches the harness when the
    workers' configuration asks for it (:func:`attach_to_runner`). Both pass everything through otherwise."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    create = EngineArgs.create_speculative_config
    if not getattr(create, "_peagle", False):

        def create_speculative_config(self, target_model_config, target_parallel_config):
            option = None
            if isinstance(self.speculative_config, dict) and HARNESS_KEY in self.speculative_config:
                spec = dict(self.speculative_config)
                option = spec.pop(HARNESS_KEY)
                self.speculative_config = spec
            elif isinstance(self.additional_config, dict) and HARNESS_KEY in self.additional_config:
                option = self.additional_config[HARNESS_KEY]
                self.additional_config = {k: v for k, v in self.additional_config.items() if k != HARNESS_KEY}
            speculative = create(self, target_model_config, target_parallel_config)
            if option is None:
                return speculative
            missing = lacks_per_request_lengths()
            if missing is not None:
                _log.warning("peagle: the harness cannot choose draft lengths in this vLLM (%s); serving with the "
                             "fixed K", missing)  # fmt: skip
                return speculative
            config = harness_config(option, str(target_model_config.model), speculative)
            if self.async_scheduling is None:  # left to vLLM, which would pick async scheduling on a GPU
                self.async_scheduling = False
            self.additional_config = {**(self.additional_config or {}), HARNESS_KEY: config}
            return speculative

        create_speculative_config._peagle = True
        EngineArgs.create_speculative_config = create_speculative_config

    start = GPUModelRunner.__init__
    if not getattr(start, "_peagle", False):

        def runner_init(self, vllm_config, device):
            start(self, vllm_config, device)
            config = (vllm_config.additional_config or {}).get(HARNESS_KEY) if vllm_config is not None else None
            if config:
                attach_to_runner(self, config)

        runner_init._peagle = True
        GPUModelRunner.__init__ = runner_init


def drop_option() -> None:
    """For a vLLM the harness does not support: the option is taken out of the speculative config with one log line
    (vLLM would refuse the unknown key), and vLLM's fixed K stays."""
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_speculative_config
    if getattr(create, "_peagle", False):
        return

    def create_speculative_config(self, *args, **kwargs):
        if isinstance(self.speculative_config, dict) and HARNESS_KEY in self.speculative_config:
            self.speculative_config = {k: v for k, v in self.speculative_config.items() if k != HARNESS_KEY}
            _log.warning("peagle: this vLLM is not one the harness supports; serving with the fixed K")
        return create(self, *args, **kwargs)

    create_speculative_config._peagle = True
    EngineArgs.create_speculative_config = create_speculative_config


def _parameters(function: Callable) -> tuple[str, ...] | None:
    import inspect

    try:
        return tuple(p for p in inspect.signature(function).parameters if p != "self")
    except (TypeError, ValueError):
        return None


def lacks_per_request_lengths() -> str | None:
    """What this vLLM lacks for per-request draft lengths (None: nothing): a scheduler that takes a draft list per
    request, and the model runner's and proposer's methods the harness wraps, with the parameters it knows."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    update = getattr(Scheduler, "update_draft_token_ids", None)
    if getattr(update, "__isabstractmethod__", False) or _parameters(update) != ("draft_token_ids",):
        return "its scheduler takes no per-request draft lists (Scheduler.update_draft_token_ids)"
    for name, params in _RUNNER_METHODS.items():
        if _parameters(getattr(GPUModelRunner, name, None)) != params:
            return f"its model runner has no {name}{params}"
    for name, params in _PROPOSER_METHODS.items():
        found = _parameters(getattr(SpecDecodeBaseProposer, name, None))
        if found is None or (params is not None and found != params):
            return f"its proposer has no {name} the harness knows"
    return None


def _why_not(runner) -> str | None:
    """Why the harness cannot run in this model runner (None: it can)."""
    spec = runner.speculative_config
    if spec is None:
        return "no speculative decoding is configured"
    missing = lacks_per_request_lengths()
    if missing is not None:
        return f"this vLLM: {missing}"
    if getattr(runner, "use_async_scheduling", False):
        return ("async scheduling keeps the drafts on the device and schedules K slots for every request; serve "
                "with --no-async-scheduling for per-request lengths")  # fmt: skip
    if not spec.use_eagle():
        return f"draft lengths come from EAGLE / P-EAGLE drafters' probabilities, not method {spec.method!r}"
    drafter = getattr(runner, "drafter", None)
    if not all(callable(getattr(drafter, name, None)) for name in _PROPOSER_METHODS):
        return f"its proposer ({type(drafter).__name__}) is not vLLM's EAGLE proposer"
    if getattr(drafter, "use_local_argmax_reduction", False):
        return "the proposer reduces its argmax on the device (use_local_argmax_reduction): no draft probabilities"
    return None


def attach_to_runner(runner, config: dict[str, Any]) -> None:
    """Attaches the harness to a model runner (its own methods and its drafter's, on the instance), or logs why not
    and leaves it as it is."""
    why = _why_not(runner)
    if why is not None:
        _log.warning("peagle: the harness cannot choose draft lengths here (%s); serving with the fixed K", why)
        return
    runner._peagle_harness = RunnerHarness(runner, config)


def _processes_prompt_tokens(scheduler_output) -> bool:
    """Whether a request of the step was scheduled more tokens than its drafts and one: a prompt (or a chunk of one,
    or a preempted request's recomputation), whose positions only the pass writes into the drafter's KV cache."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    return any(n > 1 + len(drafts.get(r, ())) for r, n in scheduler_output.num_scheduled_tokens.items())


def _top_probability(logits: torch.Tensor) -> torch.Tensor:
    """Each row's largest softmax probability, exp(max - logsumexp) (float32, on the logits' device)."""
    logits = logits.float()
    return torch.exp(logits.amax(-1) - torch.logsumexp(logits, -1))


class RunnerHarness:
    """The harness in one model runner: captures the pass's confidence, trims the drafts handed to the scheduler,
    observes each step's verification. In profile mode (``{"profile": True}``), the drafts are trimmed to a forced
    count (:class:`HarnessControl`) and each step's seconds are recorded instead."""

    def __init__(self, runner, config: dict[str, Any]) -> None:
        self.runner = runner
        self.depth = int(runner.speculative_config.num_speculative_tokens)
        self.profiling = bool(config.get("profile"))
        self.policy = None if self.profiling else StepHarness(CostTable(**config["cost_table"]), self.depth)
        self.forced: int | None = None
        self.confidence: torch.Tensor | None = None  # [B, K] of the last pass, on the device
        self.confidence_cpu: torch.Tensor | None = None
        self._captured: list[torch.Tensor] | None = None
        self.scheduled: dict[str, list[int]] = {}  # the step under way: request -> its verified drafts
        self.steps: list[dict[str, Any]] = []  # profile mode: one record per finished step
        self._step: dict[str, Any] | None = None
        self._pinned: torch.Tensor | None = None
        self.decision_s, self.decisions = 0.0, 0  # host seconds of the decisions and observations, and their steps
        self._step_started: float | None = None  # when the step under way started (the policy's step times)
        self.skipped = 0  # passes skipped (no request's drafts would have paid)
        self.prompt_passes = 0  # passes run because the step processed prompt tokens
        self._wrap(runner, "execute_model", self.execute_model)
        self._wrap(runner, "sample_tokens", self.sample_tokens)
        self._wrap(runner, "propose_draft_token_ids", self.propose_draft_token_ids)
        self._wrap(runner, "_copy_draft_token_ids_to_cpu", self.copy_to_host)
        self._wrap(runner, "take_draft_token_ids", self.take_draft_token_ids)
        self._wrap(runner.drafter, "propose", self.propose)
        self._wrap(runner.drafter, "_sample_draft_tokens", self.sample_draft_tokens)
        mode = "profile mode (forced draft counts)" if self.profiling else f"cost table of {self.policy.table.backend}"
        _log.info("peagle: the harness chooses each request's draft length per step (K = %d; %s)", self.depth, mode)

    def _wrap(self, owner, name: str, wrapper: Callable) -> None:
        original = getattr(owner, name)
        setattr(owner, name, types.MethodType(lambda _owner, *a, **k: wrapper(original, *a, **k), owner))

    # The drafter: its per-depth confidence, from the logits its pass computes.

    def propose(self, original, *args, **kwargs):
        self._captured = []
        try:
            drafts = original(*args, **kwargs)
        finally:
            captured, self._captured = self._captured, None
        self.confidence = None
        if torch.is_tensor(drafts) and drafts.dim() == 2 and drafts.shape[1] > 0 and captured:
            rows, width = drafts.shape
            # Parallel drafting computes the K depths' logits in one call ([B * K] rows, request-major); the
            # autoregressive proposer one call per depth ([B] rows each).
            confidence = captured[0].view(rows, width) if len(captured) == 1 else torch.stack(captured, 1)
            if confidence.shape == drafts.shape:
                self.confidence = confidence
        return drafts

    def sample_draft_tokens(self, original, hidden_states, sampling_metadata):
        if self._captured is None:
            return original(hidden_states, sampling_metadata)
        model = self.runner.drafter.model
        compute = model.compute_logits

        def compute_logits(*args, **kwargs):
            logits = compute(*args, **kwargs)
            self._captured.append(_top_probability(logits))
            return logits

        model.compute_logits = compute_logits
        try:
            return original(hidden_states, sampling_metadata)
        finally:
            del model.compute_logits

    # The model runner: one step is execute_model -> sample_tokens (verification; the pass drafts the next step's
    # tokens) -> take_draft_token_ids (their lengths).

    def execute_model(self, original, scheduler_output, intermediate_tensors=None):
        now = time.perf_counter()
        if self._step is not None:  # the previous step ends where this one starts: its whole cost, scheduling included
            self._step["step_s"] = now - self._step.pop("started")
            self.steps.append(self._step)
            self._step = None
        self.scheduled = scheduler_output.scheduled_spec_decode_tokens or {}
        if self.policy is not None:  # the previous step ends where this one starts: its whole cost, scheduling included
            self.policy.step_ended(None if self._step_started is None else now - self._step_started)
            self._step_started = now
            if scheduler_output.finished_req_ids:
                self.policy.finish(scheduler_output.finished_req_ids)
        if self.profiling and scheduler_output.total_num_scheduled_tokens:
            counts = scheduler_output.num_scheduled_tokens
            drafts = [len(self.scheduled.get(r, ())) for r in counts]
            self._step = {
                "started": now,
                "batch": len(counts),
                "drafts": sorted(set(drafts)),
                "decode": all(n == 1 + d for n, d in zip(counts.values(), drafts, strict=True)),
                "pass_s": None,
            }
        return original(scheduler_output, intermediate_tensors)

    def sample_tokens(self, original, grammar_output):
        from vllm.v1.outputs import ModelRunnerOutput

        output = original(grammar_output)
        if self._step is not None:
            self._step["sampled"] = bool(self.runner.input_batch.random_reqs)
        if self.policy is not None and self.scheduled and isinstance(output, ModelRunnerOutput):
            requests, verified, accepted = [], [], []
            for request, index in output.req_id_to_index.items():
                drafts = self.scheduled.get(request)
                if not drafts:
                    continue
                count = next((i for i, t in enumerate(drafts) if t < 0), len(drafts))  # up to a placeholder
                requests.append(request)
                verified.append(count)
                accepted.append(len(output.sampled_token_ids[index]) - 1)
            start = time.perf_counter()
            self.policy.observe(requests, verified, accepted)
            self.decision_s += time.perf_counter() - start
        self.scheduled = {}
        return output

    def propose_draft_token_ids(self, original, scheduler_output, *args, **kwargs):
        if not self.profiling:
            if _processes_prompt_tokens(scheduler_output):  # the pass writes them into the drafter's KV cache
                self.prompt_passes += 1
                return original(scheduler_output, *args, **kwargs)
            start = time.perf_counter()
            go = self.policy.plan_pass(*self._live_batch())
            self.decision_s += time.perf_counter() - start
            if go:
                return original(scheduler_output, *args, **kwargs)
            # No drafts for the next step (vLLM's own value for a step of K = 0): the pass does not run.
            self.confidence, self.skipped, self.decisions = None, self.skipped + 1, self.decisions + 1
            return torch.empty(self.runner.input_batch.num_reqs, 0, dtype=torch.int64, device=self.runner.device)
        device = self.runner.device
        if device.type == "cuda":  # profile mode only: the pass's own seconds
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        drafts = original(scheduler_output, *args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if self._step is not None:
            self._step["pass_s"] = time.perf_counter() - start
        return drafts

    def copy_to_host(self, original, scheduler_output, zeros_only: bool = False):
        confidence, self.confidence_cpu = self.confidence, None
        if confidence is not None and not zeros_only:
            if confidence.device.type == "cpu":
                self.confidence_cpu = confidence
            else:  # on the copy stream, before the event vLLM records after its own copy (and waits on)
                rows, width = confidence.shape
                if self._pinned is None or self._pinned.shape[0] < rows or self._pinned.shape[1] < width:
                    self._pinned = torch.empty(max(rows, 64), width, dtype=torch.float32, pin_memory=True)
                stream, default = self.runner.draft_token_ids_copy_stream, torch.cuda.current_stream()
                with torch.cuda.stream(stream):
                    stream.wait_stream(default)  # the pass that computed the confidence
                    self._pinned[:rows, :width].copy_(confidence, non_blocking=True)
                self.confidence_cpu = self._pinned[:rows, :width]
        return original(scheduler_output, zeros_only)

    def take_draft_token_ids(self, original):
        from vllm.v1.outputs import DraftTokenIds

        drafts = original()
        confidence, self.confidence_cpu = self.confidence_cpu, None
        if drafts is None or confidence is None or not drafts.req_ids:
            return drafts
        requests = list(drafts.req_ids)
        if self.profiling:
            keep = [self.depth if self.forced is None else self.forced] * len(requests)
        else:
            start = time.perf_counter()
            _, sampled, seeded, context = self._live_batch(requests)
            keep = self.policy.decide(requests, confidence[: len(requests)], sampled, seeded, context)
            self.decision_s += time.perf_counter() - start
            self.decisions += 1
        lists = [list(d[:k]) for d, k in zip(drafts.draft_token_ids, keep, strict=True)]
        return DraftTokenIds(requests, lists)

    def _live_batch(self, requests: list[str] | None = None) -> tuple[list[str], list[bool], list[bool], int]:
        """(request ids, sampled, seeded, the mean context length) of the model runner's batch, as the policy takes
        them."""
        batch = self.runner.input_batch
        requests = list(batch.req_ids) if requests is None else requests
        sampled = [r in batch.random_reqs for r in requests]
        seeded = [s and getattr(self.runner.requests.get(r), "generator", None) is not None
                  for r, s in zip(requests, sampled, strict=True)]  # fmt: skip
        context = int(batch.num_tokens_no_spec[: len(requests)].mean()) if requests else 0
        return requests, sampled, seeded, context


class HarnessControl:
    """vLLM worker extension (``LLM(..., worker_extension_cls="peagle.vllm.harness.HarnessControl")``) through which
    the profile and the benchmarks talk to the harness in the workers (``llm.collective_rpc("peagle_harness",
    ...)``)."""

    def peagle_harness(self, forced: int | None = None, take_steps: bool = False) -> dict[str, Any]:
        """Profile mode: sets the forced draft count (``forced``; None keeps all K). Returns the chosen lengths'
        histogram since the last call (``{"lengths": {batch: {length: count}}}``), the host seconds the decisions and
        observations took and their steps (``decision_s``, ``decisions``), the passes skipped (``skipped``), the
        passes run because a step processed prompt tokens (``prompt_passes``) and, with ``take_steps``, the profile's
        step records since the last call; all reset."""
        harness = getattr(self.model_runner, "_peagle_harness", None)
        if harness is None:
            return {"attached": False}
        harness.forced = forced
        out: dict[str, Any] = {"attached": True, "depth": harness.depth}
        out["lengths"] = harness.policy.take_lengths() if harness.policy is not None else {}
        out["decision_s"], out["decisions"], out["skipped"] = harness.decision_s, harness.decisions, harness.skipped
        out["prompt_passes"] = harness.prompt_passes
        harness.decision_s, harness.decisions, harness.skipped, harness.prompt_passes = 0.0, 0, 0, 0
        if take_steps:  # a step still open ended with the last call: its end is not known (and it is not the next's)
            out["steps"], harness.steps, harness._step = harness.steps, [], None
        return out
