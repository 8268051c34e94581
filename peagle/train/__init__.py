"""Training-side building blocks: sequence partitioning (and, later, batching, the trainer and evaluation)."""

from peagle.train.partition import Segment, partition_elements, segment_boundaries, segment_masks

__all__ = ["Segment", "partition_elements", "segment_boundaries", "segment_masks"]
