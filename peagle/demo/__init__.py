"""`peagle demo`: the whole P-EAGLE workflow on an embedded default target (or yours), with a report."""

from peagle.demo.pipeline import DemoSpec, run_demo

__all__ = ["DemoSpec", "run_demo"]
