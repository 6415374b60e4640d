"""Named-object registries: the one plug-in pattern of the package (timm / mmengine / lm-eval style).

Presets, stages, protocols, taps, spec options, backbones, datasets and grids are registered by name, so
the CLI can list them (`clipseg-sparse ls ...`) and a typo gets a "did you mean" instead of a KeyError.

The rules:
- a registry is defined next to the type of its entries (`PRESETS` with `AttentionSpec`, `STAGES` with `Stage`);
- an entry registers itself in the module that implements it (`REG.register(...)` or `@REG.decorator(...)`);
- a registry whose entries live in modules above it names them in `locations`: they are imported once, on
  the first lookup, together with the modules of the entry-point group `group` (third-party methods:
  `[project.entry-points."clipseg_sparse.methods"] mymethod = "my_pkg.my_method"`). This is a dependency by
  name, declared once as data (mmengine's `Registry(..., locations=[...])`), so no module is imported only
  for the side effect of filling a registry.
"""

from __future__ import annotations

import difflib
import importlib
import sys
import threading
from importlib import metadata
from typing import Callable, Generic, Iterator, Sequence, TypeVar

from .errors import UserValueError

T = TypeVar("T")

ENTRY_POINT_GROUP = "clipseg_sparse.methods"


class UnknownNameError(UserValueError, KeyError):
    """A name that is not in a registry; the message lists close matches and all choices."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly.
        return str(self.args[0])


def caller_module(depth: int = 1) -> str:
    """The `__name__` of the module `depth` calls above the function calling this one: what `register`
    records as an entry's home (read once, at registration; a dataclass instance has no module of its own)."""
    return sys._getframe(depth + 1).f_globals.get("__name__", "")


class Registry(Generic[T]):
    """A name -> object table that refuses collisions, explains misses and records where each entry lives.

    locations: modules imported on the first lookup (their import registers the built-in entries);
    group: an entry-point group whose modules are imported with them (plug-ins of other packages).
    An entry's `ls` row is its type's `describe(help) -> dict[str, str]` where it has one; otherwise the
    registry's `describe(entry)` (default: nothing) followed by the help under `help_column`.
    """

    def __init__(
        self,
        kind: str,
        *,
        locations: Sequence[str] = (),
        group: str | None = None,
        help_column: str = "meaning",
        describe: Callable[[T], dict[str, str]] | None = None,
    ) -> None:
        self.kind = kind
        self.locations = tuple(locations)
        self.group = group
        self.help_column = help_column
        self._describe = describe
        self._items: dict[str, T] = {}
        self._help: dict[str, str] = {}
        self._where: dict[str, str] = {}
        self._loaded = not (self.locations or group)
        self._loading = False
        self._lock = threading.RLock()

    def _load(self) -> None:
        """Import `locations` and the entry-point group once. `_loading` is set first, under a re-entrant
        lock: a module that looks this registry up while it is being imported (a method reading another's
        protocol) does not recurse, and another thread waits until every entry is in."""
        if self._loaded:
            return
        with self._lock:
            if self._loaded or self._loading:
                return
            self._loading = True
            try:
                for module in self.locations:
                    importlib.import_module(module)
                if self.group:
                    for entry in metadata.entry_points(group=self.group):
                        importlib.import_module(entry.value.split(":")[0])
            finally:
                self._loaded = True

    def register(self, name: str, obj: T, help: str = "", module: str | None = None) -> T:
        """Add `obj` under `name`. `module`: where it is implemented, shown by `where` and `ls` (default: the
        module calling `register`; a helper that registers for its caller passes `caller_module()`)."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj
        self._help[name] = help
        self._where[name] = module or caller_module()
        return obj

    def decorator(self, name: str, help: str = "") -> Callable[[T], T]:
        def wrap(obj: T) -> T:
            return self.register(name, obj, help, module=obj.__module__)

        return wrap

    def get(self, name: str) -> T:
        self._load()
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, self.names(), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        return f"unknown {self.kind} {name!r}.{hint} Choices: {', '.join(self.names())}"

    def help(self, name: str) -> str:
        self.get(name)
        return self._help[name]

    def where(self, name: str) -> str:
        """The module that registered `name` (timm's `_model_to_module`), e.g. `clipseg_sparse.methods.sclip`."""
        self.get(name)
        return self._where[name]

    def describe(self, name: str) -> dict[str, str]:
        """The row `ls` prints for `name`, column -> text (see the class docstring)."""
        entry = self.get(name)
        own = getattr(entry, "describe", None)
        if self._describe is None and callable(own):
            return own(self._help[name])
        return {**(self._describe(entry) if self._describe else {}), self.help_column: self._help[name]}

    def names(self) -> list[str]:
        self._load()
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())
