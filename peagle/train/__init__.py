"""Training: data preparation, hidden-state extraction, COD batching, sequence partitioning, the trainer and eval.

Heavy modules (transformers for prepare-data / extract) are imported by the CLI steps that need them.
"""

from peagle.train.partition import Segment, partition_elements, segment_boundaries, segment_masks

__all__ = ["Segment", "partition_elements", "segment_boundaries", "segment_masks"]
