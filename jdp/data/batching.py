"""Global batches of arrays or datasets, each process given its own rows (`RowOrder`). A global batch is a function
of (seed, step) alone (docs/api.md, `jdp.fit`'s "Data"), so any step is read directly and a resume needs only it."""

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from jdp.errors import UsageError, warn
from jdp.split import process_block


class Source(Protocol):
    """What `fit` reads data through (docs/api.md, "`jdp.Source`"): this process's rows of every global batch."""

    num_train: int  # train examples
    steps_per_epoch: int

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the global train batch at `step` (0-based), a function of (seed, step)."""

    def eval_batches(self) -> Any:
        """The eval split once: this process's rows of each eval batch, with a float `mask` (0 = padding).
        Every process yields the same number of batches."""

    def close(self) -> None:
        """Release threads and files."""


# What a Source may also have, and jdp's default without it (`device_input`: run on the device, docs/api.md).
SOURCE_OPTIONAL = {"num_eval": 0, "tokens_per_example": 0, "device_input": lambda batch: batch}


def optional(source: Source, name: str) -> Any:
    return getattr(source, name, SOURCE_OPTIONAL[name])


class RowOrder:
    """Which rows of each split this process reads, by step. Train: a (seed, epoch) permutation cut into global
    batches (an epoch's last partial one dropped), process p taking its contiguous block of each. Eval: the split in
    order, the last batch padded (`real` False); subclasses read the rows (`_eval_rows`)."""

    def __init__(self, *, seed: int, num_train: int, num_eval: int, global_batch_size: int, eval_batch_size: int,
                 process_index: int, process_count: int, train_split: str = "the train split") -> None:
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.train_block = process_block(global_batch_size, process_index, process_count, "global batch size")
        self._eval_block = process_block(eval_batch_size, process_index, process_count, "eval batch size")
        self.num_train, self.num_eval = num_train, num_eval
        self.global_batch_size, self.eval_batch_size = global_batch_size, eval_batch_size
        self.steps_per_epoch = num_train // global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"{train_split} has {num_train} examples, fewer than one global batch of "
                             f"{global_batch_size}; lower the global batch size")
        # epoch -> its permutation, the latest one kept: a cache (thread-safe), not iterator state
        self._permutation = functools.lru_cache(maxsize=1)(
            lambda epoch: np.random.default_rng([seed, epoch]).permutation(num_train))

    def train_rows(self, step: int) -> np.ndarray:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, index = divmod(step, self.steps_per_epoch)
        start = index * self.global_batch_size
        return self._permutation(epoch)[start : start + self.global_batch_size][self.train_block]

    def eval_rows(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(row ids, real) of this process's block of eval batch `i`; ids past the split are padding."""
        ids = np.arange(i * self.eval_batch_size, (i + 1) * self.eval_batch_size)[self._eval_block]
        return ids, ids < self.num_eval

    def num_eval_batches(self) -> int:
        return math.ceil(self.num_eval / self.eval_batch_size)

    def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """The eval split once, in order, padded (`mask` 0) at its end; as many batches on every process (lockstep)."""
        for i in range(self.num_eval_batches()):
            ids, real = self.eval_rows(i)
            yield {**self._eval_rows(ids, real), "mask": real.astype(np.float32)}


class DataError(UsageError):
    """Data that cannot be trained on: the message is one line naming what is wrong and the fix."""


class ArrayDataset:
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
        self.dtypes = {k: v.dtype for k, v in self.arrays.items()}
        self._length = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._length

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {k: self.arrays[k][ids] for k in self.keys}


class RandomAccessDataset:
    """Any object with `__len__` and `__getitem__(i)` returning a dict of arrays (e.g. `grain.MapDataset`); its
    `__getitems__(ids)`, if any, reads a batch: a list of row dicts, or a dict of arrays of leading length len(ids)."""

    def __init__(self, data: Any, what: str = "the data") -> None:
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise DataError(f"{what} is a {type(data).__name__}; give a dict of numpy arrays, a random-access "
                            "dataset (__len__ and __getitem__ returning a dict) or a jdp Source")
        self._data, self._what = data, what
        first = data[0] if len(data) else {}
        if not isinstance(first, Mapping):
            raise DataError(f"{what}[0] is a {type(first).__name__}, not a dict of arrays")
        self.keys = tuple(first)
        self.dtypes = {k: np.asarray(v).dtype for k, v in first.items()}

    def __len__(self) -> int:
        return len(self._data)

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        ids, n, keys = [int(i) for i in ids], len(ids), list(self.keys)
        batched = hasattr(self._data, "__getitems__")
        got = self._data.__getitems__(ids) if batched else [self._data[i] for i in ids]
        kind = type(got).__name__
        if isinstance(got, Mapping):  # a dict of arrays stacked along a leading axis of len(ids)
            arrays = {k: np.asarray(got[k]) for k in keys if k in got}
            if len(arrays) == len(keys) and all(a.ndim and len(a) == n for a in arrays.values()):
                return arrays
            returned = "a dict of " + ", ".join(f"{k!r}: {getattr(v, 'shape', type(v).__name__)}"
                                                for k, v in got.items())
        elif not isinstance(got, Sequence) or isinstance(got, str | bytes):
            returned = f"a {kind}"
        elif (bad := next((i for i, row in enumerate(got)
                           if not (isinstance(row, Mapping) and set(keys) <= row.keys())), None)) is not None:
            row = got[bad]
            item = f"a dict with keys {list(row)}" if isinstance(row, Mapping) else f"a {type(row).__name__}"
            returned = f"a {kind} of {len(got)} whose item {bad} is {item}"
        elif len(got) != n:
            returned = f"a {kind} of {len(got)} rows"
        else:  # a list of row dicts
            return {k: self._stacked(k, [np.asarray(row[k]) for row in got], ids) for k in keys}
        if not batched:
            raise DataError(f"{self._what}'s __getitem__ over {n} ids gave {returned}; every row must be a dict with "
                            f"keys {keys}")
        raise DataError(f"{self._what}'s __getitems__ returned {returned} for {n} ids; return a list of {n} row dicts "
                        f"with keys {keys}, or a dict of those keys to arrays of leading length {n}")

    def _stacked(self, key: str, values: list[np.ndarray], ids: list[int]) -> np.ndarray:
        if odd := next((i for i, v in enumerate(values) if v.shape != values[0].shape), None):
            raise DataError(f"{self._what}'s row {ids[odd]} has {key!r} of shape {values[odd].shape}, row {ids[0]} "
                            f"{values[0].shape}; a batch stacks rows of one shape: pad them to one length")
        return np.stack(values)


def as_dataset(data: Any, what: str = "the data") -> ArrayDataset | RandomAccessDataset:
    """A dict of arrays or a random-access dataset, as one that reads rows by index: `keys`, `len()`, `rows(ids)`."""
    if isinstance(data, ArrayDataset | RandomAccessDataset):
        return data
    return ArrayDataset(data, what) if isinstance(data, Mapping) else RandomAccessDataset(data, what)


class Batcher(RowOrder):
    """jdp's `Source` of dicts of arrays or random-access datasets: this process's rows of each train and eval batch."""

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
        """`train` and `eval` (None: no eval batches): dicts of arrays or random-access datasets; `eval_batch_size`
        0 = `global_batch_size`."""
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
        dtypes = self._train.dtypes
        if unusable := [f"{k!r} ({dtype})" for k, dtype in dtypes.items() if dtype.kind not in "biufc"]:
            # A tfds record's `id`, say: no compiled step takes strings (JAX refused them at the step's lowering).
            one = len(unusable) == 1
            warn(f"the data's {'key' if one else 'keys'} {', '.join(unusable)} {'holds' if one else 'hold'} strings or "
                 "objects, which a compiled step cannot take: left out of the batches")
            for dataset in filter(None, (self._train, self._eval)):
                dataset.keys = tuple(k for k in dataset.keys if dtypes[k].kind in "biufc")
        self._shapes: dict[str, dict[str, tuple]] = {}  # each split's rows' shapes, as its first batch had them
        super().__init__(seed=seed, num_train=len(self._train),
                         num_eval=len(self._eval) if self._eval is not None else 0, global_batch_size=global_batch_size,
                         eval_batch_size=eval_batch_size or global_batch_size, process_index=process_index,
                         process_count=process_count)

    def sample_rows(self, k: int = 8) -> dict[str, np.ndarray]:
        """`k` rows at fixed places of the train data (not of its order): what the run record hashes."""
        return self._train.rows(np.unique(np.linspace(0, len(self._train) - 1, k).round().astype(np.int64)))

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        return self._same_shapes("train", self._train.rows(self.train_rows(step)))

    def _eval_rows(self, ids: np.ndarray, real: np.ndarray) -> dict[str, np.ndarray]:
        # Padding rows repeat row 0; no eval data, no eval batches.
        return self._same_shapes("eval", self._eval.rows(np.where(real, ids, 0)))

    def _same_shapes(self, split: str, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        first = self._shapes.setdefault(split, {k: v.shape[1:] for k, v in batch.items()})
        if changed := next((k for k, v in batch.items() if v.shape[1:] != first[k]), None):
            raise DataError(f"the {split} data's rows of {changed!r} have shape {batch[changed].shape[1:]} in this "
                            f"batch, {first[changed]} in its first; the compiled step takes one shape: pad every "
                            "row to one length")
        return batch

    def close(self) -> None:
        """Nothing to release (the tfds source stops its threads and closes its files here)."""

