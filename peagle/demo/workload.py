"""The embedded workload: prompt categories built from text every machine with Python has.

Users do not serve one kind of text: chat mixes code, prose and maths, and the papers report acceptance per category
(HumanEval, MT-Bench, SPEED-Bench), where a drafter's acceptance, and with it the best drafting configuration, differs
from one category to the next. The demo's default target trains on three categories and is measured on held-out
prompts of each:

- ``code``: the standard library's own ``.py`` files (tests, site-packages and a few tool packages left out);
- ``prose``: English about Python from the standard library: the reference documentation's topics that ``help()``
  shows (``pydoc_data.topics``) and the docstrings of the library's modules, classes and functions (one record per
  file, docstrings of 200 characters or more);
- ``math``: generated arithmetic worksheets (seeded): progressions (a, a + s, a + 2s, ...) and running sums (lines
  ``a + b = c``, the next adding b and c), every number following from the ones before it, so the target must compute
  its continuation and a drafter must guess digits the target computed (the tokenizer splits digits one by one).
  A greedy continuation of free text (code, prose) by a small target soon repeats itself, which any drafter predicts;
  one that must compute its next number does not.

Held-out split: a file (its code and its docstrings) by a hash of its relative path, a topic by a hash of its name, a
record of four worksheets by its index; everything is deterministic, so every machine builds the same records.
"""

from __future__ import annotations

import ast
import inspect
import math
import os
import random
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CATEGORIES", "category_documents", "check_categories", "check_sampling", "stdlib_files"]

CATEGORIES = ("code", "prose", "math")


def check_categories(categories, known=CATEGORIES, option: str = "--categories") -> tuple[str, ...]:
    """The categories as a tuple, refusing an empty selection, repeats or an unknown name (naming ``option``)."""
    if isinstance(categories, str):
        categories = [c.strip() for c in categories.split(",") if c.strip()]
    chosen = tuple(categories)
    unknown = [c for c in chosen if c not in known]
    if not chosen or unknown or len(set(chosen)) != len(chosen):
        got = ", ".join(map(str, chosen)) or "none"
        raise ValueError(
            f"{option} must name distinct categories among {', '.join(known)}, got {got}"
            + (f" (unknown: {', '.join(map(str, unknown))})" if unknown else "")
        )
    return chosen


def check_sampling(temperatures, top_p: float, flag: str = "--temperature") -> tuple[float, ...]:
    """The temperatures as a tuple of floats (repeats dropped), refusing one below 0 or not finite, an empty list, and
    a top-p outside (0, 1], naming the option."""
    if isinstance(temperatures, str):
        try:
            temperatures = [float(t) for t in temperatures.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"{flag} must be comma-separated numbers, got {temperatures!r}") from None
    values = tuple(dict.fromkeys(float(t) for t in temperatures))
    if not values or not all(math.isfinite(t) and t >= 0 for t in values):
        got = ", ".join(map(str, values)) or "none"
        raise ValueError(f"{flag} must be finite numbers >= 0 (0 = greedy), got {got}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1] (1 = off), got {top_p!r}")
    return values


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of the standard library's .py files, tests and site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "turtledemo"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(filenames):
            if name.endswith(".py") and name != "topics.py":  # pydoc's topics are prose, not code
                path = Path(dirpath) / name
                files.append((path.relative_to(root).as_posix(), path))
    return files


def _heldout(name: str, every: int) -> bool:
    return zlib.crc32(name.encode()) % every == 0


def _files(split: str, every: int) -> Iterator[tuple[str, str]]:
    """(relative path, text) of the split's files, in a hash order that mixes packages (the same on every run)."""
    files = stdlib_files()
    if not files:
        raise FileNotFoundError(f"no .py files under {sysconfig.get_paths()['stdlib']}")
    files.sort(key=lambda f: (zlib.crc32(f[0].encode()) // every, f[0]))
    for rel, path in files:
        if _heldout(rel, every) != (split == "heldout"):
            continue
        try:
            yield rel, path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def _docstrings(text: str) -> str:
    """The file's docstrings of 200 characters or more (module, classes, functions), cleaned, blank-line separated."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = [ast.get_docstring(node, clean=True) for node in ast.walk(tree) if isinstance(node, kinds)]
    return "\n\n".join(d for d in docs if d and len(d) >= 200)


def _topics(split: str, every: int) -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python built without its documentation topics: docstrings alone
        return
    for name in sorted(topics):
        if _heldout(f"topic:{name}", every) == (split == "heldout"):
            yield inspect.cleandoc(topics[name])


def worksheet(index: int) -> str:
    """Arithmetic worksheet ``index`` (seeded): even indices a progression (``# sequence: start a, step s`` then
    a, a + s, a + 2s, ... below 10000), odd ones running sums (``# sums``, then lines ``a + b = c`` whose next line adds
    b and c, until a sum passes 9999). Each line follows from the ones before it, so a continuation of a worksheet
    is determined by its prompt, and the target must compute it: a greedy continuation cannot collapse into a
    favourite line, and a drafter must compute the digits the target computes."""
    rng = random.Random(index)
    if index % 2 == 0:
        start, step = rng.randrange(1, 1000), rng.randrange(3, 400)
        terms = [str(t) for t in range(start, 10_000, step)][:60]
        return f"# sequence {index}: start {start}, step {step}\n" + ", ".join(terms) + "\n"
    a, b = rng.randrange(1, 100), rng.randrange(1, 100)
    lines = [f"# sums {index}"]
    while a + b < 10_000:
        lines.append(f"{a} + {b} = {a + b}")
        a, b = b, a + b
    return "\n".join(lines) + "\n"


def _worksheets(split: str, every: int, per_record: int = 4) -> Iterator[str]:
    """Records of ``per_record`` worksheets each (blank-line separated); record r is held out when r % every == 0."""
    record = 0
    while True:
        if (record % every == 0) == (split == "heldout"):
            first = record * per_record
            yield "\n".join(worksheet(i) for i in range(first, first + per_record))
        record += 1


def category_documents(category: str, split: str, every: int = 10) -> Iterator[str]:
    """The documents (texts) of ``category`` in ``split`` ("train" / "heldout"), in a fixed order; ``every``: one in
    ``every`` files, topics and worksheets is held out. The math worksheets never end: the caller caps them."""
    check_categories([category], option="category")
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if category == "code":
        for _, text in _files(split, every):
            yield text
    elif category == "prose":
        topics, docstrings = _topics(split, every), (_docstrings(text) for _, text in _files(split, every))
        # Topics and docstrings interleaved, so a capped split holds both.
        for pair in zip(topics, docstrings, strict=False):
            yield from (text for text in pair if text)
        yield from (text for text in docstrings if text)
    else:
        yield from _worksheets(split, every)
