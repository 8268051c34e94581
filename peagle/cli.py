"""`peagle <command>`: the command-line entry point."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch


def _best_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def cmd_example(args: argparse.Namespace) -> int:
    """COD sampling + fused gather of one packed training row on the CPU, checked against the PyTorch reference."""
    from peagle.ops import cod_gather, cod_gather_reference, cod_sample, cod_sample_reference
    from peagle.testing import random_packed_row

    gen = torch.Generator().manual_seed(args.seed)
    row = random_packed_row(gen, args.length, mean_document_length=args.length / 8)
    input_ids = torch.randint(0, args.vocab, (args.length,), generator=gen)
    hidden = torch.randn(args.length, args.width, generator=gen).to(torch.bfloat16)
    mask_hidden = torch.randn(args.width, generator=gen).to(torch.bfloat16)
    sample_args = (row.loss_mask, row.document_ids, args.depths, args.ratio, args.ratio_min, args.max_anchors)

    anchors, depths = cod_sample(*sample_args, args.seed)
    inputs = cod_gather(input_ids, hidden, mask_hidden, anchors, depths, args.vocab)
    ref_anchors, ref_depths = cod_sample_reference(*sample_args, args.seed)
    ref = cod_gather_reference(input_ids, hidden, mask_hidden, ref_anchors, ref_depths, args.vocab)
    same = torch.equal(anchors, ref_anchors) and all(torch.equal(a, b) for a, b in zip(inputs, ref, strict=True))

    documents = int(row.document_ids.max()) + 1
    print(f"packed row: T = {args.length} positions, {documents} documents, {int(row.loss_mask.sum())} trained labels")
    print(f"COD: K = {args.depths}, ratio {args.ratio}, ratio_min {args.ratio_min}, max_anchors {args.max_anchors}")
    print(f"{'depth':>5}  {'elements':>8}")
    counts = torch.bincount(depths, minlength=args.depths)
    for d, n in enumerate(counts.tolist()):
        print(f"{d:>5}  {n:>8}")
    print(f"total N = {anchors.numel()} elements ({anchors.numel() / args.length:.2f} x T)")
    print(f"cod_gather: ids {tuple(inputs.ids.shape)}, feats {tuple(inputs.feats.shape)} {inputs.feats.dtype}")
    print(f"equal to the PyTorch reference: {same}")

    ours = _best_ms(lambda: cod_gather(input_ids, hidden, mask_hidden, *cod_sample(*sample_args, 1), args.vocab))
    theirs = _best_ms(
        lambda: cod_gather_reference(input_ids, hidden, mask_hidden, *cod_sample_reference(*sample_args, 1), args.vocab)
    )
    print(f"sample + gather: peagle {ours:.2f} ms, reference {theirs:.2f} ms ({theirs / ours:.1f}x)")
    return 0 if same else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peagle", description="P-EAGLE parallel-drafting speculative decoding toolkit"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    example = commands.add_parser("example", help=cmd_example.__doc__, description=cmd_example.__doc__)
    example.add_argument("--length", type=int, default=4096, help="positions T of the packed row (default 4096)")
    example.add_argument("--depths", type=int, default=8, help="parallel depths K (default 8)")
    example.add_argument("--ratio", type=float, default=0.7, help="COD keep ratio per depth (default 0.7)")
    example.add_argument("--ratio-min", type=float, default=0.2, help="floor of the keep ratio (default 0.2)")
    example.add_argument("--max-anchors", type=int, default=None, help="cap on seed chains (default: none)")
    example.add_argument("--width", type=int, default=3 * 512, help="hidden width D = 3 x H (default 1536)")
    example.add_argument("--vocab", type=int, default=32000, help="vocabulary size; mask token = vocab (default 32000)")
    example.add_argument("--seed", type=int, default=0)
    example.set_defaults(func=cmd_example)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
