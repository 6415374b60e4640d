"""Named-object registries (timm / lm-evaluation-harness style).

Presets, datasets, protocols and shipped grids are all registered by name so the CLI can list them
(`clipseg-sparse ls ...`) and a typo gets a "did you mean" instead of a KeyError.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """A name that is not in a registry; the message lists close matches and all choices."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly.
        return str(self.args[0])


class Registry(Generic[T]):
    """A name -> object table that refuses collisions and explains misses."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._help: dict[str, str] = {}

    def register(self, name: str, obj: T, help: str = "") -> T:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj
        self._help[name] = help
        return obj

    def decorator(self, name: str, help: str = "") -> Callable[[T], T]:
        def wrap(obj: T) -> T:
            return self.register(name, obj, help)

        return wrap

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, list(self._items), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        return f"unknown {self.kind} {name!r}.{hint} Choices: {', '.join(self.names())}"

    def help(self, name: str) -> str:
        self.get(name)
        return self._help[name]

    def names(self) -> list[str]:
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)
