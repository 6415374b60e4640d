"""Score terms of the attention spec, parsed from their text once: `Term` (a tap, a metric, transforms),
`Group` (terms summed before one normalizer), `BlockInput` (an extra input of the edited block), and the
number and bracket helpers of the compact text form (grammar in the package docstring)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property

from ..errors import UserValueError
from ..stages import Needs

SOURCES = ("qk", "qq", "kk", "vv", "id")  # the v1 sources; `id` is the value path alone (MaskCLIP)
SUPPORTS = ("all", "pos", "thresh", "topk", "topp", "region")
INPUT_KINDS = ("sum", "mean")


def fmt_num(x: float) -> str:
    """Shortest text that parses back to exactly `x`, never in exponent form (`+` and `e` stay free)."""
    s = f"{x:g}"
    if "e" in s or float(s) != x:
        s = repr(float(x))
    if "e" in s:
        s = format(x, ".20f").rstrip("0").rstrip(".")
    return s


def parse_number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserValueError(f"{what}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise UserValueError(f"{what}: {text!r} is not finite")
    return value


def split_top(text: str, sep: str) -> list[str]:
    """Split on `sep` outside brackets and parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += 1 if ch in "[(" else -1 if ch in "])" else 0
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def _split_weight(text: str) -> tuple[float, str]:
    """`0.5*kk` -> (0.5, "kk"); `kk` -> (1.0, "kk")."""
    head, star, rest = text.partition("*")
    if star and "[" not in head and "(" not in head:
        return parse_number(head, f"weight in {text!r}"), rest
    return 1.0, text


# -- terms ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Term:
    """One score term: a tap (which features are compared), a metric and transforms.

    Applied in this order: features (a, b) of the tap; `cos` L2-normalises them; `iter` clustering
    steps (GEM: a <- normalize(norm(t a a^T) a)); S = t a b^T with t = `temp` (a number, `auto` = GEM's
    mean token norm x d^-1/2, default d^-1/2 for dot and 1 for cos); S <- scale * (S - shift * mean(S));
    entries outside the support get -inf; `weight` multiplies S inside its group (pre-normalisation mix).
    """

    tap: str
    metric: str = "dot"
    temp: float | str | None = None
    iterate: int = 0
    shift: float = 0.0
    scale: float = 1.0
    support: str = "all"
    support_arg: float | None = None
    weight: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "Term":
        weight, body = _split_weight(text.strip())
        tap, bracket, mods = body.partition("[")
        kwargs: dict = {"tap": tap.strip(), "weight": weight}
        if bracket:
            if not mods.endswith("]"):
                raise UserValueError(f"term {text!r}: modifiers must be closed with ']'")
            for mod in filter(None, (m.strip() for m in mods[:-1].split(","))):
                kwargs.update(_parse_modifier(mod, text))
        return cls(**kwargs)

    def __post_init__(self) -> None:
        from .taps import check_tap

        check_tap(self.tap)
        if self.metric not in ("dot", "cos"):
            raise UserValueError(f"term {self.tap!r}: metric {self.metric!r}; choose dot or cos")
        if isinstance(self.temp, str) and self.temp != "auto":
            raise UserValueError(f"term {self.tap!r}: temp must be a number or auto (got {self.temp!r})")
        if isinstance(self.temp, (int, float)) and not self.temp > 0:
            raise UserValueError(f"term {self.tap!r}: temp must be > 0 (got {self.temp})")
        if not (isinstance(self.iterate, int) and self.iterate >= 0):
            raise UserValueError(f"term {self.tap!r}: iter must be an integer >= 0 (got {self.iterate})")
        if self.iterate and not self.is_self_pair:
            raise UserValueError(f"term {self.tap!r}: iter needs a self-similarity tap (qq, kk, vv or x@L)")
        if self.support not in SUPPORTS:
            raise UserValueError(f"term {self.tap!r}: support {self.support!r}; choose {', '.join(SUPPORTS)}")
        if self.support != "region" and (self.support_arg is None) != (self.support in ("all", "pos")):
            raise UserValueError(f"term {self.tap!r}: support {self.support} {'takes no' if self.support in ('all', 'pos') else 'needs an'} argument")
        if self.support == "topk" and not (self.support_arg >= 1 and float(self.support_arg).is_integer()):
            raise UserValueError(f"term {self.tap!r}: topk needs an integer >= 1 (got {self.support_arg})")
        if self.support == "topp" and not 0 < self.support_arg <= 1:
            raise UserValueError(f"term {self.tap!r}: topp needs 0 < p <= 1 (got {self.support_arg})")
        if self.support == "region" and self.support_arg is not None and not self.support_arg >= 0:
            raise UserValueError(f"term {self.tap!r}: region needs a merge distance EPS >= 0, or no argument for no merging (got {self.support_arg})")

    @cached_property
    def ref(self):
        """The tap parsed once (`taps.TapRef`: registry kind and argument)."""
        from .taps import tap_kind

        return tap_kind(self.tap)

    @property
    def kind(self) -> str:
        """The tap's registry name: `qq`, `x` (for `x@9`), `attn`, `ext`, ..."""
        return self.ref.kind

    @property
    def needs(self) -> Needs:
        """What the term takes besides CLIP: its tap's needs, and region maps for the `region` support."""
        needs = self.ref.tap.needs(self.ref.arg)
        return needs | Needs(regions=f"term {self}") if self.support == "region" else needs

    @property
    def is_self_pair(self) -> bool:
        return self.tap in ("qq", "kk", "vv") or self.kind == "x"

    @property
    def is_plain(self) -> bool:
        """A v1 term: a q/k/v pair with the dot metric and nothing else (fused kernels apply)."""
        return self.tap in SOURCES and self == Term(self.tap)

    def __str__(self) -> str:
        mods = []
        if self.metric != "dot":
            mods.append(self.metric)
        if self.temp is not None:
            mods.append(f"temp:{self.temp if isinstance(self.temp, str) else fmt_num(self.temp)}")
        if self.iterate:
            mods.append(f"iter:{self.iterate}")
        if self.shift:
            mods.append(f"shift:{fmt_num(self.shift)}")
        if self.scale != 1.0:
            mods.append(f"scale:{fmt_num(self.scale)}")
        if self.support != "all":
            arg = self.support_arg
            mods.append(self.support if arg is None else f"{self.support}:{fmt_num(arg)}")
        body = self.tap + (f"[{','.join(mods)}]" if mods else "")
        return body if self.weight == 1.0 else f"{fmt_num(self.weight)}*{body}"


def _parse_modifier(mod: str, term: str) -> dict:
    name, _, arg = mod.partition(":")
    what = f"modifier {mod!r} of term {term!r}"
    if name in ("dot", "cos") and not arg:
        return {"metric": name}
    if name == "temp" and arg:
        return {"temp": "auto" if arg == "auto" else parse_number(arg, what)}
    if name == "iter" and arg.isdigit():
        return {"iterate": int(arg)}
    if name == "shift" and arg:
        return {"shift": parse_number(arg, what)}
    if name == "scale" and arg:
        return {"scale": parse_number(arg, what)}
    if name in ("all", "pos", "region") and not arg:  # bare region: the region maps as given, no merging
        return {"support": name}
    if name in ("thresh", "topk", "topp", "region") and arg:
        return {"support": name, "support_arg": parse_number(arg, what)}
    raise UserValueError(
        f"bad {what}; modifiers: cos, dot, temp:T|auto, iter:N, shift:BETA, scale:GAMMA, "
        f"pos, thresh:T, topk:K, topp:P, region[:EPS]"
    )


@dataclass(frozen=True)
class Group:
    """Terms whose scores are summed (weighted) before one normalizer; `weight` scales the normalised
    map in the post-normalisation sum over groups."""

    terms: tuple[Term, ...]
    weight: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "Group":
        text = text.strip()
        if not text:
            raise UserValueError("empty score term")
        weight, body = 1.0, text
        w, rest = _split_weight(text)
        if rest.startswith("(") and rest.endswith(")"):  # W*(A&B): a weighted group of pre-mixed terms
            weight, body = w, rest[1:-1]
        parts = split_top(body, "&")
        if len(parts) == 1:  # a single term: its weight is the group's (post-normalisation) weight
            term = Term.parse(parts[0])
            return cls((dataclasses.replace(term, weight=1.0),), weight * term.weight)
        return cls(tuple(Term.parse(p) for p in parts), weight)

    @property
    def is_map(self) -> bool:
        """The group reads an already normalised map (e.g. `attn@6-9`): no normalizer is applied."""
        return any(t.ref.tap.maps is not None for t in self.terms)

    def __str__(self) -> str:
        if len(self.terms) == 1:
            term = dataclasses.replace(self.terms[0], weight=self.weight)
            return str(term)
        body = "&".join(str(t) for t in self.terms)
        return body if self.weight == 1.0 else f"{fmt_num(self.weight)}*({body})"


@dataclass(frozen=True)
class BlockInput:
    """An extra input the edited block also runs on: `sum`/`mean` of the hidden states after blocks
    first..last (1-based, CLS included), its output added to the main output with `weight`. `source`: score
    groups of its own (canonical text, as the spec's; empty: the spec's), written `sum@A-B(GROUP+GROUP...)`
    (SFP's multi-level branch attends with the mid map alone)."""

    kind: str
    first: int
    last: int
    weight: float = 1.0
    source: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "BlockInput":
        weight, body = _split_weight(text.strip())
        body, paren, own = body.partition("(")
        if paren and not (own.endswith(")") and own[:-1].strip()):
            raise UserValueError(f"bad block input {text!r}: its own score terms go in parentheses, e.g. sum@4-10(kk)")
        source = tuple(str(Group.parse(g)) for g in split_top(own[:-1], "+")) if paren else ()
        kind, at, span = body.partition("@")
        first, dash, last = span.partition("-")
        if kind not in INPUT_KINDS or not at or not dash or not (first.isdigit() and last.isdigit()):
            raise UserValueError(f"bad block input {text!r}; write sum@A-B or mean@A-B (blocks A..B, 1-based), optionally W*sum@A-B")
        return cls(kind, int(first), int(last), weight, source)

    def __post_init__(self) -> None:
        if not 1 <= self.first <= self.last:
            raise UserValueError(f"block input {self.kind}@{self.first}-{self.last}: need 1 <= A <= B")

    @cached_property
    def terms(self) -> tuple[Term, ...]:
        """The score terms of its own groups (none: it attends with the spec's)."""
        return tuple(t for g in self.source for t in Group.parse(g).terms)

    def __str__(self) -> str:
        body = f"{self.kind}@{self.first}-{self.last}" + (f"({'+'.join(self.source)})" if self.source else "")
        return body if self.weight == 1.0 else f"{fmt_num(self.weight)}*{body}"
