"""The cache folder where generated data is kept between runs, and atomic writes into it."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where generated datasets are kept between runs: $JDP_CACHE_DIR, else ~/.cache/jdp."""
    return Path(os.environ.get("JDP_CACHE_DIR") or Path.home() / ".cache" / "jdp")


def write_atomically(path: Path, data: bytes) -> None:
    """Written to a temporary name, fsynced and renamed, so no process ever reads a half-written file; an
    unwritable folder only means the next process makes the data again."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
