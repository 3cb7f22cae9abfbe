"""Host-side data: each process gets its own rows of every global batch, as numpy arrays."""

from jdp.data.batching import Batcher, Split
from jdp.data.sources import DATASET_NAMES, build_source

__all__ = ["DATASET_NAMES", "Batcher", "Split", "build_source"]
