"""Engine speed on the CPU: tokens/s and acceptance length of target-only decoding, the P-EAGLE chain and P-EAGLE
trees at several node budgets, one request at a time (batch 1), plus an optional profile of the rounds.

With ``--target DIR --drafter DIR`` (e.g. a ``peagle demo --quick --workdir W`` cache) it measures those models;
without, a demo-sized Llama target (``peagle.demo.target.QUICK_TARGET``'s shape) and a P-EAGLE drafter with random
weights (acceptance near zero, so only the per-round cost means something).

    PYTHONPATH=. python benchmarks/engine_speed.py [--target DIR --drafter DIR] [--prompts 32 --new-tokens 128]
        [--threads 1] [--temperature 0] [--profile tree16]
"""

from __future__ import annotations

import argparse
import time

import torch

from peagle.decode import SpeculativeDecoder
from peagle.demo.target import QUICK_TARGET
from peagle.model import DrafterConfig, PEagleDrafter
from peagle.model.target import llama_config


def random_models(seed: int = 0) -> tuple[torch.nn.Module, PEagleDrafter]:
    from transformers import LlamaForCausalLM

    spec = QUICK_TARGET
    torch.manual_seed(seed)
    config = llama_config(
        spec.vocab_size,
        spec.hidden_size,
        spec.num_layers,
        spec.num_heads,
        spec.num_kv_heads,
        spec.intermediate_size,
        max_position_embeddings=4096,
    )
    target = LlamaForCausalLM(config).eval()
    drafter = PEagleDrafter(
        DrafterConfig(
            hidden_size=spec.hidden_size,
            vocab_size=spec.vocab_size,
            num_layers=1,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.hidden_size // spec.num_heads,
            intermediate_size=spec.intermediate_size,
            aux_layer_ids=[1, 2, 4],
            mask_token_id=spec.vocab_size - 1,
            num_depths=4,
        )
    )
    drafter.reset_parameters(std=0.05)
    return target, drafter.eval()


CONFIGS = {
    "target": dict(drafter=False),
    "chain": dict(mode="chain"),
    "tree8": dict(mode="tree", num_nodes=8),
    "tree16": dict(mode="tree", num_nodes=16),
    "tree32": dict(mode="tree", num_nodes=32),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: sampled (Gumbel drafts)")
    parser.add_argument("--topk", type=int, default=2, help="tree children per node at every depth")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--profile", default=None, help="a configuration to profile with cProfile afterwards")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.target:
        target, drafter = args.target, args.drafter
    else:
        target, drafter = random_models()
    gen = torch.Generator().manual_seed(1)
    decoders = {}
    for name in args.configs.split(","):
        options = dict(CONFIGS[name])
        if options.pop("drafter", True):
            extra = {"topk": args.topk} if options.get("mode") == "tree" else {}
            decoders[name] = SpeculativeDecoder(target, drafter, **options, **extra)
        else:
            decoders[name] = SpeculativeDecoder(target, None)
    vocab = next(iter(decoders.values())).runner.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    # tok/cpu-s (this process's CPU time, one thread) is the steadier figure on a shared machine.
    print(f"{'config':<8} {'tok/s':>8} {'tok/cpu-s':>10} {'AL':>6} {'draft%':>7} {'verify%':>8} {'other%':>7}")
    for name, decoder in decoders.items():
        decoder.generate(prompts[:1], 8)  # warm-up
        tokens, seconds, cpu, parts, rounds, emitted = 0, 0.0, 0.0, [0.0, 0.0, 0.0], 0, 0
        for prompt in prompts:  # one request at a time
            start, start_cpu = time.perf_counter(), time.process_time()
            out = decoder.generate([prompt], args.new_tokens, temperature=args.temperature)
            seconds += time.perf_counter() - start
            cpu += time.process_time() - start_cpu
            m = out.metrics
            tokens += m.new_tokens
            parts = [parts[0] + m.draft_s, parts[1] + m.verify_s, parts[2] + m.other_s + m.prefill_s]
            rounds += m.request_rounds
            emitted += sum(r.emitted for r in out.requests)
        share = [100 * p / seconds for p in parts]
        figures = f"{tokens / seconds:8.1f} {tokens / cpu:10.1f} {emitted / max(rounds, 1):6.2f} "
        print(f"{name:<8} {figures}" + " ".join(f"{s:7.1f}" for s in share))
    if args.profile:
        import cProfile
        import pstats

        decoder = decoders[args.profile]
        profile = cProfile.Profile()
        profile.enable()
        for prompt in prompts[:8]:
            decoder.generate([prompt], args.new_tokens)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
