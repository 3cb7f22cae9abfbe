"""Cut global batches from in-memory splits and hand each process its own rows.

The global batch at a step is a function of (seed, step) only: a permutation of the train split drawn from
(seed, epoch) is cut into consecutive global batches, and process p of P takes the p-th contiguous block of
each. So the global batch does not depend on the process or device count (1x4 == 2x2), and any step can be
read directly, which makes resuming a matter of knowing the step.
"""

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from jdp.errors import UsageError


def _local_block(global_size: int, process_index: int, process_count: int, what: str) -> slice:
    """Process p's contiguous block [p*B/P, (p+1)*B/P) of a global batch of size B."""
    if global_size <= 0 or global_size % process_count:
        raise ValueError(
            f"{what} {global_size} must be a positive multiple of the process count {process_count}"
        )
    local = global_size // process_count
    return slice(process_index * local, (process_index + 1) * local)


class RowOrder:
    """Which rows of the train and eval splits this process reads, by step: the contract every source shares.

    Train: a permutation of the split from (seed, epoch), cut into consecutive global batches (the last
    partial batch of an epoch is dropped); process p takes its contiguous block of each. Eval: the split in
    order, in global batches of `eval_batch_size`, the last one padded (`real` False on padding rows)."""

    def __init__(self, *, seed: int, num_train: int, num_eval: int, global_batch_size: int, eval_batch_size: int,
                 process_index: int, process_count: int, train_split: str = "the train split") -> None:
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.train_block = _local_block(global_batch_size, process_index, process_count, "global batch size")
        self._eval_block = _local_block(eval_batch_size, process_index, process_count, "eval batch size")
        self._seed, self.num_train, self.num_eval = seed, num_train, num_eval
        self.global_batch_size, self.eval_batch_size = global_batch_size, eval_batch_size
        self.steps_per_epoch = num_train // global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"{train_split} has {num_train} examples, fewer than one global batch of "
                             f"{global_batch_size}; lower the global batch size")

        self._perm_memo: tuple[int, np.ndarray] | None = None  # (epoch, perm): a cache, not iterator state

    def _permutation(self, epoch: int) -> np.ndarray:
        memo = self._perm_memo
        if memo is None or memo[0] != epoch:
            memo = (epoch, np.random.default_rng([self._seed, epoch]).permutation(self.num_train))
            self._perm_memo = memo  # one tuple assignment: epoch and permutation always match
        return memo[1]

    def train_rows(self, step: int) -> np.ndarray:
        """This process's rows of the global train batch at `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, index = divmod(step, self.steps_per_epoch)
        start = index * self.global_batch_size
        return self._permutation(epoch)[start : start + self.global_batch_size][self.train_block]

    def num_eval_batches(self) -> int:
        return math.ceil(self.num_eval / self.eval_batch_size)

    def eval_rows(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(row ids, real) of this process's block of eval batch `i`; ids past the split are padding."""
        ids = np.arange(i * self.eval_batch_size, (i + 1) * self.eval_batch_size)[self._eval_block]
        return ids, ids < self.num_eval


class OrderedSource:
    """What every source (`Batcher`, `TfdsSource`) exposes of its `RowOrder`."""

    def __init__(self, order: RowOrder) -> None:
        self._order = order
        self.num_train, self.num_eval = order.num_train, order.num_eval
        self.steps_per_epoch: int = order.steps_per_epoch

    def num_eval_batches(self) -> int:
        return self._order.num_eval_batches()


class DataError(UsageError):
    """Data that cannot be trained on: the message is one line naming what is wrong and the fix."""


class RowDataset:
    """Rows read by index: `keys`, `len()` and `rows(ids)` -> {key: array with one entry per id}."""

    keys: tuple[str, ...]

    def __len__(self) -> int:
        raise NotImplementedError

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError


class ArrayDataset(RowDataset):
    """A dict of arrays that share a leading length: row i is {key: array[i]}."""

    def __init__(self, arrays: Mapping[str, Any], what: str = "the data") -> None:
        if not arrays:
            raise DataError(f"{what} is an empty dict; give a dict of arrays that share a leading length")
        self.arrays = {k: np.asarray(v) for k, v in arrays.items()}
        lengths = {k: (v.shape[0] if v.ndim else None) for k, v in self.arrays.items()}
        if None in lengths.values() or len(set(lengths.values())) > 1:
            listed = ", ".join(f"{k}: {n}" for k, n in lengths.items())
            raise DataError(f"{what}: the arrays' leading lengths differ ({listed}); every array needs one row "
                            "per example")
        self.keys = tuple(self.arrays)
        self._length = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._length

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[ids] for k, v in self.arrays.items()}


class RandomAccessDataset(RowDataset):
    """Any object with `__len__` and `__getitem__(i)` returning a dict of arrays (e.g. `grain.MapDataset`,
    `tfds.data_source`); `__getitems__(ids)`, where it exists, reads a batch of rows at once."""

    def __init__(self, data: Any, what: str = "the data") -> None:
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise DataError(f"{what} is a {type(data).__name__}; give a dict of numpy arrays, a random-access "
                            "dataset (__len__ and __getitem__ returning a dict) or a jdp Source")
        self._data = data
        first = data[0] if len(data) else {}
        if not isinstance(first, Mapping):
            raise DataError(f"{what}[0] is a {type(first).__name__}, not a dict of arrays")
        self.keys = tuple(first)

    def __len__(self) -> int:
        return len(self._data)

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        ids = [int(i) for i in ids]
        items = self._data.__getitems__(ids) if hasattr(self._data, "__getitems__") else [self._data[i] for i in ids]
        return {k: np.stack([np.asarray(item[k]) for item in items]) for k in self.keys}


def as_dataset(data: Any, what: str = "the data") -> RowDataset:
    """A dict of arrays or a random-access dataset, as a `RowDataset` that reads rows by index."""
    if isinstance(data, RowDataset):
        return data
    return ArrayDataset(data, what) if isinstance(data, Mapping) else RandomAccessDataset(data, what)


class Batcher(OrderedSource):
    """Global permutation -> this process's rows, for train and eval, of any `Dataset`s (jdp's `Source`
    for dicts of arrays, random-access datasets and jdp's in-memory datasets)."""

    def __init__(
        self,
        train: Any,
        eval: Any = None,
        *,
        seed: int,
        global_batch_size: int,
        eval_batch_size: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        """`train` and `eval`: dicts of arrays or random-access datasets (see `as_dataset`); no `eval`, no
        eval batches. `eval_batch_size` 0 = `global_batch_size`."""
        self._train = as_dataset(train, "the train data")
        self._eval = None if eval is None else as_dataset(eval, "the eval data")
        if self._eval is not None and len(self._eval) == 0:
            raise DataError("the eval data has no rows; give at least one example, or no eval data")
        if "mask" in self._train.keys:
            raise DataError("the data has a key 'mask', which jdp uses to mark the padding rows of eval batches; "
                            "rename it (e.g. 'token_mask')")
        if self._eval is not None and set(self._eval.keys) != set(self._train.keys):
            raise DataError(f"the eval data's keys {sorted(self._eval.keys)} differ from the train data's "
                            f"{sorted(self._train.keys)}; give both the same keys")
        super().__init__(RowOrder(seed=seed, num_train=len(self._train),
                                  num_eval=len(self._eval) if self._eval is not None else 0,
                                  global_batch_size=global_batch_size,
                                  eval_batch_size=eval_batch_size or global_batch_size,
                                  process_index=process_index, process_count=process_count))

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the global train batch at `step`."""
        return self._train.rows(self._order.train_rows(step))

    def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """The eval split once, in order; the last batch is padded with row 0 and `mask` 0 so none is dropped.

        Every process yields num_eval_batches() items, so collectives over eval batches stay in lockstep.
        """
        if self._eval is None:
            return
        for i in range(self.num_eval_batches()):
            ids, real = self._order.eval_rows(i)
            yield {**self._eval.rows(np.where(real, ids, 0)), "mask": real.astype(np.float32)}

    def close(self) -> None:
        """Nothing to release (the tfds source stops its threads and closes its files here)."""

