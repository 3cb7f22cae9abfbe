"""The cache folder where generated data is kept between runs, and atomic writes into it."""

import contextlib
import os
from pathlib import Path

from jdp.files import write_atomic


def cache_dir() -> Path:
    """Where generated datasets are kept between runs: $JDP_CACHE_DIR, else ~/.cache/jdp."""
    return Path(os.environ.get("JDP_CACHE_DIR") or Path.home() / ".cache" / "jdp")


def write_atomically(path: Path, data: bytes) -> None:
    """`jdp.files.write_atomic` into a folder made if needed; an unwritable folder only means the next process
    makes the data again."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
