"""Random access to a tfds split's tfrecord files without TensorFlow (`tfds.load` streams): frame headers (a uint64
length and its CRC, the record, its CRC), read once, index the records, each then one `os.pread`. CRCs are not
verified: a damaged record fails when its proto is parsed."""

from __future__ import annotations

import errno
import functools
import os
import struct
from collections.abc import Callable, Iterator, Sequence

import numpy as np

_HEADER = 12  # uint64 length + uint32 CRC of the length
_FOOTER = 4  # uint32 CRC of the record


class UnreadableFileError(ValueError):
    """A tfrecord file that is missing, remote, truncated or disagrees with the dataset info."""


def frames(path: str, read: Callable[[int, int], bytes], size: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each record of the `size`-byte file `path`, read by `read(n, offset)`; a frame cut short
    raises UnreadableFileError."""
    pos = 0
    while pos < size:
        header = read(_HEADER, pos)
        if len(header) < _HEADER:
            raise UnreadableFileError(f"{path} is truncated: a frame header at byte {pos} is cut off; prepare the "
                                      "dataset again")
        (length,) = struct.unpack_from("<Q", header)
        end = pos + _HEADER + length + _FOOTER
        if end > size:
            raise UnreadableFileError(f"{path} is truncated or not a tfrecord file: a {length}-byte record at "
                                      f"byte {pos} runs past its end ({size} bytes); prepare the dataset again")
        yield pos + _HEADER, length
        pos = end


class TfrecordRecords:
    """The serialized records of one split by index: row i is the i-th record of its tfds `FileInstruction`s'
    slices [skip, skip + take) of their files, concatenated (how tfds expresses a split and `train[:90%]`)."""

    def __init__(self, instructions: Sequence) -> None:
        self._fds: list[int] = []
        index = [np.zeros((0, 3), np.int64)]  # per row: (file, offset, length)
        for instruction in instructions:
            path = os.fspath(instruction.filename)
            if "://" in path:
                self.close()
                raise UnreadableFileError(f"{path}: tfrecord copies are read from a local or mounted file system; "
                                          "copy the dataset to a local disk or mount the bucket (e.g. gcsfuse)")
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                self.close()
                fix = ("raise the open-file limit (ulimit -n)" if e.errno == errno.EMFILE else
                       "copy or prepare the dataset again")
                raise UnreadableFileError(f"cannot open {path} ({e.strerror}); {fix}") from None
            self._fds.append(fd)
            offsets, lengths = np.asarray(list(frames(path, functools.partial(os.pread, fd), os.fstat(fd).st_size)),
                                          np.int64).reshape(-1, 2).T
            if len(offsets) != instruction.examples_in_shard:
                raise UnreadableFileError(f"{path} holds {len(offsets)} records where the dataset info says "
                                          f"{instruction.examples_in_shard}; prepare the dataset again")
            rows = slice(instruction.skip, instruction.skip + instruction.take)
            index.append(np.column_stack([np.full(len(offsets[rows]), len(self._fds) - 1), offsets[rows],
                                          lengths[rows]]))
        self._index = np.concatenate(index)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, row: int) -> bytes:
        file, offset, length = self._index[row].tolist()
        return os.pread(self._fds[file], length, offset)

    def close(self, _close=os.close) -> None:  # bound early: __del__ may run after `os` is torn down
        while self._fds:
            _close(self._fds.pop())

    def __del__(self) -> None:
        self.close()
