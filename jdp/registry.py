"""Names -> objects, one registry per kind (models, datasets, optimizers, losses), or import paths
(`package.module:Name`)."""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from jdp.errors import UsageError, one_line

T = TypeVar("T")


def import_object(path: str, what: str) -> Any:
    """`package.module:Name` -> the object; one-line UsageError when it cannot be imported."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"{what}={path!r}: cannot import {module_name!r} ({e}); put the module beside the config "
                         "file or on PYTHONPATH") from None
    except Exception as e:  # noqa: BLE001 - a module that fails as it imports: its own error, a SyntaxError
        raise UsageError(f"{what}={path!r}: importing {module_name!r} fails ({one_line(e)}); fix the module") from None
    try:
        return functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise UsageError(f"{what}={path!r}: {module_name} has no {attribute!r}") from None


class Registry(Generic[T]):
    """The built-in objects of one kind by name; any other name containing ':' is an import path."""

    def __init__(self, key: str) -> None:
        self.key = key  # the config key that names one, for messages
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            self._entries[name] = obj
            return obj

        return add

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries or ":" in name

    def get(self, name: str) -> T:
        if name in self._entries:
            return self._entries[name]
        if ":" in name:
            return import_object(name, self.key)
        close = difflib.get_close_matches(name, self._entries, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"{self.key}={name!r} is unknown; {hint}choose one of {', '.join(self._entries)}, or an "
                         "import path package.module:Name")
