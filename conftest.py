"""Fixtures shared by python_tests/ and cuda_tests/."""

import pytest
import torch

from peagle.testing import fresh_seed


@pytest.fixture
def generator() -> torch.Generator:
    """A CPU generator with a fresh seed per test; the seed is printed so that a failure can be replayed."""
    seed = fresh_seed()
    print(f"input seed {seed}")
    return torch.Generator().manual_seed(seed)
