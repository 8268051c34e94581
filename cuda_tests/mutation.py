"""The deliberately wrong kernel of issue 15: a one-line off-by-one in the CUDA greedy verification walk (each accepted
node is recorded one slot early in accepted_path, over the root). cuda_tests/mutation_check.sh applies it to a scratch
copy of the sources, builds the copy and expects cuda_tests/test_tree_verify_cuda.py to fail there;
python_tests/test_gpu_script.py checks on every machine that it still applies to the current source.

    python cuda_tests/mutation.py ROOT    mutates the source tree at ROOT in place (never run it on your checkout)
"""

from __future__ import annotations

import sys
from pathlib import Path

FILE = "csrc/cuda/tree_verify_kernels.cu"
KERNEL = "greedy_walk_kernel"  # the function the mutated line must lie in
BEFORE = "    path[++count] = child;\n"
AFTER = "    path[count++] = child;  // MUTATION (issue 15): off by one, must fail cuda_tests\n"


def mutate(source: str) -> str:
    """source with the mutation applied; ValueError when the line to mutate is not there exactly once."""
    hits = source.count(BEFORE)
    if hits != 1:
        raise ValueError(f"{FILE}: expected the line {BEFORE.strip()!r} exactly once, found it {hits} times")
    return source.replace(BEFORE, AFTER)


def apply(root: Path) -> Path:
    """Mutates FILE under root in place; returns its path."""
    path = root / FILE
    path.write_text(mutate(path.read_text()))
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python cuda_tests/mutation.py ROOT")
    try:
        print(f"mutated {apply(Path(sys.argv[1]))}")
    except (OSError, ValueError) as error:
        sys.exit(f"mutation does not apply: {error}")
