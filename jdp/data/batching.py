"""Cut global batches from in-memory splits and hand each process its own rows.

The global batch at a step is a function of (seed, step) only: a permutation of the train split drawn from
(seed, epoch) is cut into consecutive global batches, and process p of P takes the p-th contiguous block of
each. So the global batch does not depend on the process or device count (1x4 == 2x2), and any step can be
read directly, which makes resuming a matter of knowing the step.
"""

import dataclasses
import math
import operator
from collections.abc import Iterator

import numpy as np


@dataclasses.dataclass(frozen=True)
class Split:
    """One in-memory split: x float32 (N, *input_shape), y int32 (N,)."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32 or self.y.dtype != np.int32:
            raise TypeError(f"Split wants x float32 and y int32, got {self.x.dtype} and {self.y.dtype}")
        if self.y.ndim != 1 or self.x.shape[:1] != self.y.shape:
            raise ValueError(f"Split x {self.x.shape} and y {self.y.shape} disagree on the number of rows")


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


class Batcher(OrderedSource):
    """Global permutation -> this process's rows, for train and eval. Shared by every offline source."""

    def __init__(
        self,
        train: Split,
        eval: Split,
        *,
        seed: int,
        global_batch_size: int,
        eval_batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
        num_classes: int = 0,
    ) -> None:
        """`num_classes` 0 means max label + 1 over both splits."""
        if train.x.shape[1:] != eval.x.shape[1:]:
            raise ValueError(f"train inputs {train.x.shape[1:]} and eval inputs {eval.x.shape[1:]} differ")
        self._train, self._eval = train, eval
        super().__init__(RowOrder(seed=seed, num_train=len(train.y), num_eval=len(eval.y),
                                  global_batch_size=global_batch_size, eval_batch_size=eval_batch_size,
                                  process_index=process_index, process_count=process_count))
        self.input_shape: tuple[int, ...] = tuple(train.x.shape[1:])
        self.device_input = operator.itemgetter("x")  # batches hold the model's input as it is

        labels = np.concatenate([train.y, eval.y])
        if labels.min() < 0:
            raise ValueError(f"labels must be >= 0, got {labels.min()}")
        seen = int(labels.max()) + 1
        if num_classes and num_classes < seen:
            raise ValueError(f"num_classes is {num_classes} but the data has label {seen - 1}")
        self.num_classes: int = num_classes or seen

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the global train batch at `step`: {'x': (B/P, *shape), 'y': (B/P,)}."""
        rows = self._order.train_rows(step)
        return {"x": self._train.x[rows], "y": self._train.y[rows]}

    def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """The eval split once, in order; the last batch is padded with row 0 and `mask` 0 so none is dropped.

        Every process yields num_eval_batches() items, so collectives over eval batches stay in lockstep.
        """
        for i in range(self.num_eval_batches()):
            ids, real = self._order.eval_rows(i)
            rows = np.where(real, ids, 0)
            yield {"x": self._eval.x[rows], "y": self._eval.y[rows], "mask": real.astype(np.float32)}

    def close(self) -> None:
        """Nothing to release (the tfds source stops its threads and closes its files here)."""
