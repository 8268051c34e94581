"""SpeculativeDecoder: the round loop over a batch of requests; stopping and metrics.

Per generate call: prefill commits every prompt in the target's paged cache and yields the first token (the target's
own: greedy argmax or a sample); the drafter then commits one element per prompt token. Each round, for the requests
still running:

1. draft (:mod:`peagle.decode.drafting`): the drafter runs the elements committed last round and drafts a tree whose
   root is the last emitted token;
2. one target forward over every tree node (:class:`peagle.decode.target.TargetRunner`): node i at KV slot
   ``seq_len + i``, position ``seq_len + depth[i]``, tree attention mask;
3. verify: ``tree_verify_greedy`` (temperature 0) or ``tree_rejection_sample`` on the target rows after temperature /
   top-k / top-p (:mod:`peagle.decode.sampling`), with the draft probabilities of sampled drafts and per-request
   uniforms;
4. commit: ``kv_compact`` moves the accepted path's KV entries behind the committed prefix (``seq_len +=
   num_accepted + 1``), hybrid targets commit their GDN/conv states at the last accepted node, and the accepted
   nodes' target states paired with the next tokens become the drafter's next elements;
5. observe: the call's :class:`~peagle.decode.rounds.RoundPolicy` is told what was verified and accepted;
6. emit: the host reads the emitted tokens once per round; a request stops at EOS or ``max_new_tokens`` (also inside an
   accepted run: the rest is dropped); the policy is told the round's wall time.

Before each round the policy says whether it drafts (a round that does not verifies the root alone) and whether the
drafter takes in its tokens, and gives drafting its planner: fixed configurations draft every round alike, the harness
(:mod:`peagle.decode.harness.rounds`) decides per round. Everything a round needs stays on the tensors' device; only
the emitted tokens and counts are read back.
"""

from __future__ import annotations

import math
import operator
import os
import time
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from peagle.decode.drafting import DraftTree, Eagle3Drafting, PEagleDrafting, Sampling, root_tree
from peagle.decode.harness.cost import CostTable
from peagle.decode.harness.policy import HarnessPolicy
from peagle.decode.harness.rounds import HarnessCalls
from peagle.decode.metrics import GenerateMetrics, GenerateOutput, RequestStats, conditional_acceptance
from peagle.decode.rounds import CallReport, FixedCalls, RoundPolicies, RoundPolicy
from peagle.decode.sampling import DRAFT_STREAM, STREAMS, VERIFY_STREAM, target_probs, uniforms
from peagle.decode.target import TargetRunner
from peagle.model import PEagleDrafter, check_context, context_limit, from_pretrained
from peagle.ops import TreeVerifyOutput, check_errors, tree_rejection_sample, tree_verify_greedy

__all__ = ["SpeculativeDecoder"]

Mode = Literal["chain", "tree", "harness"]
Method = Literal["peagle", "eagle3"]
DraftSampling = Literal["gumbel", "topk"]


class SpeculativeDecoder:
    """Speculative decoding of a Hugging Face target with a P-EAGLE / EAGLE-3 drafter (or the target alone).

    Args:
        target: a model directory or a transformers causal LM of model_type llama, mistral, qwen2, qwen3 or
            qwen3_next.
        drafter: a drafter checkpoint directory, a :class:`~peagle.model.PEagleDrafter`, or None (target-only
            decoding: one token per target forward).
        mode: "chain", "tree" or "harness" (cost-aware: per round, what maximises expected tokens per second under
            ``cost_table``: P-EAGLE's pass depth and verified nodes, EAGLE-3's width at each depth and verified nodes;
            see :mod:`peagle.decode.harness`). Its decisions learn from earlier rounds and generate calls, so a
            sampled request's tokens depend on its seed and on what ran before (their distribution does not).
        method: "peagle" (parallel drafting: depth <= the drafter's K) or "eagle3" (autoregressive); default "peagle"
            for drafters with K > 1, "eagle3" for K = 1.
        depth: drafts per chain / tree depth (P-EAGLE: default K; EAGLE-3: default 4).
        topk: tree branching. P-EAGLE: children per node at each depth (an int for every depth, or one per depth;
            default 2); EAGLE-3: the EAGLE-2 top-k (default 4).
        num_nodes: tree node budget, root included (default 16, at most the full tree).
        draft_sampling: at temperature > 0, "gumbel" draws drafts without replacement from the drafter's
            distribution; "topk" drafts deterministically (as at temperature 0). Both are lossless.
        block_size: paged KV cache block size; prefill_chunk: prompt tokens per prefill forward.
        dtype, device: of the target (a directory loads in float32 on the CPU by default; a module given with them
            is moved). The drafter follows the target's device and keeps its own dtype.
        cost_table: mode "harness" only: a :class:`~peagle.decode.harness.CostTable` or the JSON file ``peagle
            profile`` wrote for this target and drafter. ``num_nodes`` then caps the verified nodes (default 32).
        harness_timing: mode "harness" only: also weigh drafting against plain decoding, and trees against chains, by
            the rounds' measured wall time (now and then a generate call drafts for part of its tokens and
            decodes the rest plainly, a paired call, to compare the two on the same prompt at the same moment), which
            counts what the cost table leaves out (bookkeeping, commits); False: the table and the observed
            acceptance alone decide, so the decisions, and a sampled request's tokens for a seed, repeat from run to
            run.
        num_threads: torch's intra-op CPU threads while ``generate`` runs (restored afterwards); None leaves torch's
            setting. A small target on the CPU is bound by per-op overhead, where 1 thread is usually fastest.

    Attributes:
        round_policies: where each generate call gets its :class:`~peagle.decode.rounds.RoundPolicy` (from ``mode``;
            assign another :class:`~peagle.decode.rounds.RoundPolicies` to try a policy of your own).
    """

    def __init__(
        self,
        target: str | os.PathLike | nn.Module,
        drafter: str | os.PathLike | PEagleDrafter | None = None,
        mode: Mode = "chain",
        *,
        method: Method | None = None,
        depth: int | None = None,
        topk: int | Sequence[int] | None = None,
        num_nodes: int | None = None,
        draft_sampling: DraftSampling = "gumbel",
        block_size: int = 16,
        prefill_chunk: int = 256,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        num_threads: int | None = None,
        cost_table: CostTable | str | os.PathLike | None = None,
        harness_timing: bool = True,
    ) -> None:
        if mode not in ("chain", "tree", "harness"):
            raise ValueError(f"mode must be 'chain', 'tree' or 'harness', got {mode!r}")
        # How each call's rounds draft: the engine's only door to a policy (peagle.decode.rounds).
        self.round_policies: RoundPolicies
        if mode == "harness":
            if drafter is None:
                raise ValueError("mode 'harness' needs a drafter")
            self.round_policies = HarnessCalls.from_options(cost_table, num_nodes, harness_timing)
        elif cost_table is not None:
            raise ValueError(f"cost_table is for mode 'harness', got mode {mode!r}")
        else:
            self.round_policies = FixedCalls()
        if draft_sampling not in ("gumbel", "topk"):
            raise ValueError(f"draft_sampling must be 'gumbel' or 'topk', got {draft_sampling!r}")
        if num_threads is not None and (
            isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
        ):
            raise ValueError(f"num_threads must be None or an int >= 1, got {num_threads!r}")
        self.num_threads = num_threads
        drafter = _load_drafter(drafter)
        aux = drafter.config.aux_layer_ids if drafter is not None else ()
        self.runner = TargetRunner(
            target, aux, block_size=block_size, prefill_chunk=prefill_chunk, dtype=dtype, device=device
        )
        self.mode, self.draft_sampling, self.block_size = mode, draft_sampling, block_size
        self.drafting: PEagleDrafting | Eagle3Drafting | None = None
        if drafter is not None:
            if mode == "harness":
                topk, num_nodes = min(4, drafter.config.draft_vocab_size), self.policy.max_nodes
            draft_mode = "tree" if mode == "harness" else mode
            self.drafting = self._drafting(drafter.to(self.runner.device), draft_mode, method, depth, topk, num_nodes)
            limit = self.runner.max_nodes
            if limit is not None and self.drafting.max_nodes > limit:
                raise ValueError(
                    f"a hybrid target verifies at most {limit} nodes per tree; this configuration "
                    f"drafts up to {self.drafting.max_nodes} (lower num_nodes or depth)"
                )
        elif any(v is not None for v in (method, depth, topk, num_nodes)):
            raise ValueError("method, depth, topk and num_nodes need a drafter (drafter=None decodes with the target)")

    @property
    def max_positions(self) -> int | None:
        """The target's ``max_position_embeddings``: a prompt and its new tokens fit within it (None: no limit)."""
        return context_limit(self.runner.config)

    @property
    def max_depth(self) -> int:
        return self.drafting.depth if self.drafting is not None else 0

    @property
    def policy(self) -> HarnessPolicy | None:
        """Mode "harness": the policy that carries what its generate calls learnt; None in the other modes."""
        return self.round_policies.policy if isinstance(self.round_policies, HarnessCalls) else None

    @property
    def depth_chain_mode(self) -> str:
        """Debug: the DepthStepper mode of EAGLE-3 harness rounds ("auto"; "host" forces the host loop on a GPU)."""
        return self.round_policies.chain_mode if isinstance(self.round_policies, HarnessCalls) else "auto"

    @depth_chain_mode.setter
    def depth_chain_mode(self, mode: str) -> None:
        if isinstance(self.round_policies, HarnessCalls):
            self.round_policies.chain_mode = mode

    def _drafting(self, drafter: PEagleDrafter, mode, method, depth, topk, num_nodes):
        cfg = self.runner.config
        dcfg = drafter.config
        if dcfg.hidden_size != cfg.hidden_size or dcfg.vocab_size != self.runner.vocab_size:
            raise ValueError(
                f"drafter (hidden_size {dcfg.hidden_size}, vocab_size {dcfg.vocab_size}) does not fit the target "
                f"(hidden_size {cfg.hidden_size}, vocab_size {self.runner.vocab_size})"
            )
        method = method or ("peagle" if dcfg.num_depths > 1 else "eagle3")
        if method not in ("peagle", "eagle3"):
            raise ValueError(f"method must be 'peagle' or 'eagle3', got {method!r}")
        vocab = self.runner.vocab_size
        if method == "peagle":
            depth = dcfg.num_depths if depth is None else depth
            if not isinstance(depth, int) or not 1 <= depth <= dcfg.num_depths:
                raise ValueError(f"depth must be an int in [1, {dcfg.num_depths}] (the drafter's K), got {depth!r}")
            topk = [2] * depth if topk is None else [topk] * depth if isinstance(topk, int) else list(topk)
            if len(topk) != depth or not all(isinstance(k, int) and 1 <= k <= dcfg.draft_vocab_size for k in topk):
                raise ValueError(
                    f"topk must be an int or {depth} ints in [1, {dcfg.draft_vocab_size}] (one per depth), got {topk!r}"
                )
            full = 1 + sum(math.prod(topk[: d + 1]) for d in range(depth))
            num_nodes = _budget(num_nodes, full)
            return PEagleDrafting(drafter, vocab, mode, depth, topk, num_nodes)
        depth = 4 if depth is None else depth
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        topk = 4 if topk is None else topk
        if not isinstance(topk, int) or not 1 <= topk <= dcfg.draft_vocab_size:
            raise ValueError(f"topk must be an int in [1, {dcfg.draft_vocab_size}] for EAGLE-3, got {topk!r}")
        num_nodes = _budget(num_nodes, 1 + topk + (depth - 1) * topk * topk)
        return Eagle3Drafting(drafter, vocab, mode, depth, topk, num_nodes)

    # -----------------------------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | Sequence[int] = 0,
    ) -> GenerateOutput:
        """Generates up to ``max_new_tokens`` tokens for every prompt (token-id lists, ragged).

        ``temperature`` 0 decodes greedily; above 0 the output is distributed as the target's samples after
        temperature / top-k (0 = off) / top-p (1 = off). ``seed``: one int (request i uses seed + i) or one per
        request, each in [0, 2^32); a request's output depends only on its prompt and its seed.

        A prompt whose length plus ``max_new_tokens`` passes the target's ``max_position_embeddings`` is refused
        before anything runs (ValueError naming the prompt, its length, the requested tokens and the limit): decoding
        past the positions the target was built for would run without a word and yield text it was never trained
        to write.
        """
        vocab = self.runner.vocab_size
        prompt_list = _check_prompts(prompts, vocab)
        eos = _check_eos(eos_token_id, vocab)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
        seeds = _check_seeds(seed, len(prompt_list))
        check_context([len(p) for p in prompt_list], max_new_tokens, self.max_positions)
        threads = torch.get_num_threads()
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        try:
            return _Generation(self, prompt_list, max_new_tokens, eos, float(temperature), top_p, top_k, seeds).run()
        finally:
            torch.set_num_threads(threads)


def _budget(num_nodes: int | None, full: int) -> int:
    if num_nodes is None:
        return min(16, full)
    if not isinstance(num_nodes, int) or num_nodes < 2:
        raise ValueError(f"num_nodes must be an int >= 2 (the root and at least one draft), got {num_nodes!r}")
    return min(num_nodes, full)


def _load_drafter(drafter) -> PEagleDrafter | None:
    if drafter is None or isinstance(drafter, PEagleDrafter):
        return drafter
    if isinstance(drafter, (str, os.PathLike)):
        return from_pretrained(drafter)
    raise TypeError(f"drafter must be a checkpoint directory, a PEagleDrafter or None, got {type(drafter).__name__}")


def _ints(values) -> list[int] | None:
    """The values as Python ints (numpy / torch integers accepted), or None if one is not an integer."""
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        return None


def _check_prompts(prompts, vocab: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, Tensor)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    result = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence) or isinstance(prompt, (str, bytes)) or len(prompt) == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids")
        ids = _ints(prompt)
        if ids is None or not all(0 <= t < vocab for t in ids):
            raise ValueError(f"prompts[{i}] must hold token ids in [0, {vocab}), got {list(prompt)!r}")
        result.append(ids)
    return result


def _check_eos(eos, vocab: int) -> set[int]:
    values = _ints([] if eos is None else [eos] if not isinstance(eos, Sequence) else eos)
    if values is None or not all(0 <= t < vocab for t in values):
        raise ValueError(f"eos_token_id must be None, a token id or token ids in [0, {vocab}), got {eos!r}")
    return set(values)


def _check_seeds(seed, batch: int) -> list[int]:
    if isinstance(seed, Sequence):
        seeds = _ints(seed)
    else:
        single = _ints([seed])
        seeds = None if single is None else [single[0] + i for i in range(batch)]
    if seeds is None or len(seeds) != batch or not all(0 <= s < 2**32 for s in seeds):
        raise ValueError(f"seed must be an int or {batch} ints (one per request), each in [0, 2^32), got {seed!r}")
    return seeds


class _Clock:
    """Wall-clock spans of the phases of a round: perf_counter on the CPU, CUDA events on the GPU (read once at the
    end, so timing adds no synchronisation inside a round)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {}

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, name: str, start, end) -> None:
        self.spans.setdefault(name, []).append((start, end))

    def total(self, name: str) -> float:
        spans = self.spans.get(name, [])
        if self.cuda:
            torch.cuda.synchronize()
            return sum(start.elapsed_time(end) for start, end in spans) / 1000.0
        return sum(end - start for start, end in spans)


class _Generation:
    """The state of one generate call: prefill, then rounds until every request stopped (:meth:`_round`)."""

    def __init__(self, decoder: SpeculativeDecoder, prompts, max_new_tokens, eos, temperature, top_p, top_k, seeds):
        self.decoder, self.runner, self.drafting = decoder, decoder.runner, decoder.drafting
        self.prompts, self.max_new, self.eos = prompts, max_new_tokens, eos
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.device = self.runner.device
        self.seeds = seeds
        self.gumbel = temperature > 0 and decoder.draft_sampling == "gumbel"
        batch = len(prompts)
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.finish = [""] * batch
        self.accepted: list[list[int]] = [[] for _ in range(batch)]
        self.clock = _Clock(self.device)
        self.batched_rounds = self.drafted_rounds = 0
        longest = max(len(p) for p in prompts)
        self.rounds: RoundPolicy = decoder.round_policies.start_call(
            self.drafting, batch, longest, self.device, self.gumbel
        )
        self.report = CallReport()

    def run(self) -> GenerateOutput:
        start = time.perf_counter()
        mark = self.clock.mark()
        roots = self._prefill()
        self.clock.add("prefill", mark, self.clock.mark())
        active = [r for r in range(len(self.prompts)) if not self.finish[r]]
        step = 1
        while active:
            active = self._round(active, roots, step)
            step += 1
        self.report = self.rounds.finish()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._output(time.perf_counter() - start)

    @torch.no_grad()
    def _prefill(self) -> Tensor:
        runner, batch = self.runner, len(self.prompts)
        feeds = self.rounds.feeds_drafter
        max_nodes = self.drafting.max_nodes if feeds else 1
        longest = max(len(p) for p in self.prompts)
        capacity = longest + self.max_new + max_nodes + 1
        runner.allocate(batch, capacity)
        last, aux = runner.prefill(self.prompts)
        roots = torch.zeros(batch, dtype=torch.long, device=self.device)
        rows = torch.arange(batch, device=self.device)
        first = self._verify(root_tree(roots), runner.logits(last)[:, None], list(range(batch)), 0).emitted_tokens[:, 0]
        host_first = first.tolist()
        check_errors()  # deferred checks (peagle.ops.errors) surface here, where the host reads the tokens anyway
        for r, token in enumerate(host_first):
            self._emit(r, [token])
        if feeds:
            self.drafting.allocate(batch, capacity, max(longest, max_nodes + 1), self.decoder.block_size)
            # Element i pairs token x_{i+1} with g_i: the prompt's tokens after the first, then the first new token.
            padded = [
                [*p[1:], first, *[0] * (longest - len(p))] for p, first in zip(self.prompts, host_first, strict=True)
            ]
            tokens = torch.tensor(padded, dtype=torch.long, device=self.device)
            lengths = [len(p) for p in self.prompts]
            self.drafting.set_pending(rows, list(range(batch)), tokens, aux, lengths)
        return first

    @torch.no_grad()
    def _round(self, active: list[int], roots: Tensor, step: int) -> list[int]:
        """One round of the ``active`` requests: draft, verify, commit, observe, emit. Returns those still running."""
        runner, rounds, clock = self.runner, self.rounds, self.clock
        begin = time.perf_counter()
        rows = torch.tensor(active, device=self.device)
        drafts, feeds_drafter = rounds.drafts, rounds.feeds_drafter
        t0 = clock.mark()
        tree = self._draft(rows, active, roots[rows], step) if drafts else root_tree(roots[rows])
        t1 = clock.mark()
        final, aux = runner.forward(rows, active, tree.tokens, tree.depth, tree.mask, tree.parent, tree.num_nodes)
        result = self._verify(tree, runner.logits(final), active, step)
        t2 = clock.mark()
        emitted, accepted, nodes = self._read_back(result, tree)
        if drafts:
            rounds.observe(rows, tree, result, accepted, nodes)
        runner.commit(rows, active, result.accepted_path, result.num_accepted, result.last_node, accepted)
        roots[rows] = result.emitted_tokens[torch.arange(len(active), device=self.device), result.num_accepted]
        if feeds_drafter:  # a round that did not draft: the next drafting pass catches up on its tokens
            self._feed_drafter(rows, active, result, aux, accepted, append=not drafts)
        for i, r in enumerate(active):
            self.accepted[r].append(accepted[i])
            self._emit(r, emitted[i][: accepted[i] + 1])
        self.batched_rounds += 1
        self.drafted_rounds += drafts
        # The host has waited for the round's tokens: its wall time is complete.
        rounds.end_round(time.perf_counter() - begin, sum(accepted) + len(active), len(active), self._emitted_share())
        clock.add("draft", t0, t1)
        clock.add("verify", t1, t2)
        clock.add("other", t2, clock.mark())
        return [r for r in active if not self.finish[r]]

    def _draft(self, rows: Tensor, active: list[int], roots: Tensor, step: int) -> DraftTree:
        offset = step * STREAMS + DRAFT_STREAM
        sampling = Sampling(self.temperature, self.gumbel, [self.seeds[r] for r in active], offset)
        return self.drafting.draft(rows, active, roots, sampling, self.rounds.planner)

    def _verify(self, tree: DraftTree, logits: Tensor, host_rows: list[int], step: int) -> TreeVerifyOutput:
        if self.temperature == 0:
            return tree_verify_greedy(tree.parent, tree.tokens, tree.num_nodes, logits.float())
        probs = target_probs(logits, self.temperature, self.top_k, self.top_p)
        u = uniforms(
            [self.seeds[r] for r in host_rows], step * STREAMS + VERIFY_STREAM, tree.tokens.shape[1], self.device
        )
        return tree_rejection_sample(tree.parent, tree.tokens, tree.num_nodes, probs, tree.draft_probs, u)

    def _read_back(self, result: TreeVerifyOutput, tree: DraftTree) -> tuple[list[list[int]], list[int], list[int]]:
        """The round's one host read: per request the emitted tokens, the accepted drafts and the verified nodes."""
        emitted, accepted, nodes = (
            torch.cat([result.emitted_tokens, result.num_accepted[:, None], tree.num_nodes[:, None]], 1)
            .cpu()
            .split([result.emitted_tokens.shape[1], 1, 1], 1)
        )
        check_errors()  # deferred checks (peagle.ops.errors) surface where the host reads the tokens anyway
        return emitted.tolist(), accepted[:, 0].tolist(), nodes[:, 0].tolist()

    def _feed_drafter(
        self, rows: Tensor, active: list[int], result: TreeVerifyOutput, aux: Tensor, accepted: list[int], append: bool
    ) -> None:
        """The drafter's next elements: the accepted nodes' target states paired with the tokens that follow them."""
        width = max(accepted) + 1
        path = result.accepted_path[:, :width].clamp(min=0)
        new_aux = aux.gather(1, path[..., None].expand(-1, -1, aux.shape[2]))
        tokens = result.emitted_tokens[:, :width].clamp(min=0)
        self.drafting.set_pending(rows, active, tokens, new_aux, [m + 1 for m in accepted], append=append)

    def _emit(self, request: int, tokens: list[int]) -> None:
        """Appends a request's new tokens up to EOS / max_new_tokens and marks it finished there."""
        out = self.tokens[request]
        room = self.max_new - len(out)
        for i, token in enumerate(tokens[:room]):
            if token in self.eos:
                out.extend(tokens[: i + 1])
                self.finish[request] = "eos"
                return
        out.extend(tokens[:room])
        if len(out) >= self.max_new:
            self.finish[request] = "length"

    def _emitted_share(self) -> float:
        """The share of the call's most tokens emitted so far."""
        return sum(map(len, self.tokens)) / (len(self.tokens) * self.max_new)

    def _output(self, total: float) -> GenerateOutput:
        depth = self.decoder.max_depth
        requests = [
            RequestStats(len(p), len(self.tokens[r]), self.finish[r], self.accepted[r], depth)
            for r, p in enumerate(self.prompts)
        ]
        every = [a for accepted in self.accepted for a in accepted]
        new_tokens = sum(len(t) for t in self.tokens)
        metrics = GenerateMetrics(
            new_tokens=new_tokens,
            rounds=self.batched_rounds,
            request_rounds=len(every),
            acceptance_length=(sum(every) + len(every)) / len(every) if every else 0.0,
            conditional_acceptance=conditional_acceptance(every, depth),
            prefill_s=self.clock.total("prefill"),
            draft_s=self.clock.total("draft"),
            verify_s=self.clock.total("verify"),
            other_s=self.clock.total("other"),
            total_s=total,
            tokens_per_s=new_tokens / total if total > 0 else 0.0,
            depth_chain=self.report.depth_chain,
            drafted_rounds=self.drafted_rounds,
            harness_call=self.report.harness_call,
        )
        return GenerateOutput(self.tokens, requests, metrics)
