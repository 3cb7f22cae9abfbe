"""Host-side data: each process gets its own rows of every global batch, as numpy arrays."""

from jdp.data.batching import ArrayDataset, Batcher, DataError, RandomAccessDataset, as_dataset
from jdp.data.sources import DATASETS, build_source
from jdp.data.text import TEXT_PREFIX, Vocabulary, is_text
from jdp.data.tfds_source import TFDS_PREFIX, TfdsSource  # imports tensorflow-datasets only when one is built

__all__ = ["DATASETS", "TEXT_PREFIX", "TFDS_PREFIX", "ArrayDataset", "Batcher", "DataError", "RandomAccessDataset",
           "TfdsSource", "Vocabulary", "as_dataset", "build_source", "is_text"]
