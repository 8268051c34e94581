"""The harness: cost-aware drafting decisions made on the device. ``cost`` holds the profiled cost table, ``policy``
the decision math (its per-depth step is the ``harness_decide`` op), ``profile`` measures a cost table (``peagle
profile``), and ``graphs`` chains the per-depth CUDA graphs that act on the decisions (device tail launch)."""

from peagle.decode.harness.cost import COST_TABLE_VERSION, CostTable, machine_identity
from peagle.decode.harness.policy import (
    DepthHarness,
    DepthStepper,
    HarnessPolicy,
    PassHarness,
    Plan,
    harness_budget,
    pass_budget,
    predicted_acceptance,
    select_budget,
)

__all__ = [
    "COST_TABLE_VERSION",
    "CostTable",
    "DepthHarness",
    "DepthStepper",
    "HarnessPolicy",
    "PassHarness",
    "Plan",
    "harness_budget",
    "machine_identity",
    "pass_budget",
    "predicted_acceptance",
    "select_budget",
]
