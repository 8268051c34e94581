"""The harness: cost-aware drafting decisions made on the device, and the per-depth CUDA graphs that act on them
(:mod:`peagle.decode.harness.graphs`)."""
