"""Fixtures shared by python_tests/, cuda_tests/ and benchmarks/.

pytest imports this file with the repository root on ``sys.path`` (its default "prepend" import mode), which is how
the tests import the ``testkit`` support package that lives beside ``peagle/`` but outside the wheel.
"""

import importlib
import importlib.util
import sys
import types

import pytest
import torch

from testkit import fresh_seed


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread while the module's tests run (restored after them): tiny matrices run faster on one thread
    than on two contending ones, and runs compared bit for bit (killed and resumed training, decoding against a
    reference) then sum floats in one order. A module takes it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")`` or as an argument of its module-scoped fixtures."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def generator() -> torch.Generator:
    """A CPU generator with a fresh seed per test; the seed is printed so that a failure can be replayed."""
    seed = fresh_seed()
    print(f"input seed {seed}")
    return torch.Generator().manual_seed(seed)


def import_speculators_peagle() -> types.SimpleNamespace:
    """speculators 0.9.0's P-EAGLE config and model classes, imported without its package ``__init__`` (which pulls
    in training-only dependencies such as openai). Returns a namespace with ``SpeculatorsConfig``,
    ``PEagleSpeculatorConfig``, ``PEagleDraftModel``, ``Eagle3SpeculatorConfig`` and ``Eagle3DraftModel``; raises
    ImportError when speculators is not installed."""
    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("speculators is not installed")
    root = spec.submodule_search_locations[0]
    if "speculators" not in sys.modules or not hasattr(sys.modules["speculators"], "_peagle_stub"):
        for name, path in [
            ("speculators", root),
            ("speculators.models", f"{root}/models"),
            ("speculators.models.eagle3", f"{root}/models/eagle3"),
            ("speculators.models.peagle", f"{root}/models/peagle"),
        ]:
            module = types.ModuleType(name)
            module.__path__ = [path]
            module._peagle_stub = True
            sys.modules[name] = module
        config = importlib.import_module("speculators.config")
        sys.modules["speculators"].SpeculatorModelConfig = config.SpeculatorModelConfig
        eagle3 = importlib.import_module("speculators.models.eagle3.config")
        sys.modules["speculators.models.eagle3"].Eagle3SpeculatorConfig = eagle3.Eagle3SpeculatorConfig
        peagle_config = importlib.import_module("speculators.models.peagle.config")
        for cls in (config.SpeculatorsConfig, eagle3.Eagle3SpeculatorConfig, peagle_config.PEagleSpeculatorConfig):
            cls.model_rebuild(_types_namespace={"torch": torch})
    config = importlib.import_module("speculators.config")
    peagle_config = importlib.import_module("speculators.models.peagle.config")
    core = importlib.import_module("speculators.models.peagle.core")
    eagle3_config = importlib.import_module("speculators.models.eagle3.config")
    eagle3_core = importlib.import_module("speculators.models.eagle3.core")
    return types.SimpleNamespace(
        SpeculatorsConfig=config.SpeculatorsConfig,
        PEagleSpeculatorConfig=peagle_config.PEagleSpeculatorConfig,
        PEagleDraftModel=core.PEagleDraftModel,
        Eagle3SpeculatorConfig=eagle3_config.Eagle3SpeculatorConfig,
        Eagle3DraftModel=eagle3_core.Eagle3DraftModel,
    )


@pytest.fixture(scope="session")
def speculators_peagle() -> types.SimpleNamespace:
    """speculators 0.9.0's P-EAGLE classes (:func:`import_speculators_peagle`); an ImportError when it is missing
    is an error of the test that asks for them, not a skip."""
    return import_speculators_peagle()
