"""The attention spec value and its compact text form (grammar in the package docstring).

A spec is frozen and hashable; `AttentionSpec.parse(str(spec)) == spec` for every spec. Score terms are
stored as their canonical text (`source`: one string per post-normalisation group, e.g. `("qq", "kk")`
for SCLIP) and parsed once into `Group`/`Term` values (`terms.py`), so v1 code that joins or replaces
`source` keeps working; what the spec needs to run (`needs`), its normalizer and its stages are parsed once too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from ..errors import UserValueError
from ..registry import ENTRY_POINT_GROUP, Registry, caller_module
from ..stages import Needs, Stage, check_hook, resolve_stages
from .normalizers import NORMALIZER_KINDS, Normalizer, normalizer_forms
from .terms import SOURCES, BlockInput, Group, Term, parse_number, fmt_num, split_top

# -- extension point: options other modules register --------------------------------------------------
@dataclass(frozen=True)
class ExtraOption:
    """A spec option defined outside this package, e.g. `dna:PATH`.

    check(arg) validates the argument and returns its canonical text (raise `errors.UserValueError` when bad);
    `rest_of_spec`: the argument runs to the end of the spec text, so it may contain '/' (paths); such an
    option is written last. The parsed value is `spec.extra(name)` (the canonical text). tower(clip, arg):
    what the edited blocks run from instead of `clip.visual` (its `transformer.resblocks`; DnA's adapter
    blocks), so the model runs an option's blocks without knowing the option. needs(arg): what running it
    takes besides CLIP (`stages.Needs`: region maps for CorrCLIP's `mct:`, a forward of its own for `stitch:`).
    values(arg, weights, v): the B x H x N x d attention output from the B x H x N x N attention and the values,
    in place of weights @ v per head (DiH-CLIP's selected heads applied to every head's values)."""

    check: Callable[[str], str]
    rest_of_spec: bool = False
    tower: Callable[[Any, str], Any] | None = None
    needs: Callable[[str], Needs] | None = None
    values: Callable[[str, Any, Any], Any] | None = None


OPTIONS: Registry[ExtraOption] = Registry(
    "attention spec option", locations=("clipseg_sparse.attention.scope", "clipseg_sparse.dna.spec_option"), group=ENTRY_POINT_GROUP
)


def register_option(
    name: str,
    check: Callable[[str], str],
    help: str,
    rest_of_spec: bool = False,
    tower: Callable[[Any, str], Any] | None = None,
    needs: Callable[[str], Needs] | None = None,
    values: Callable[[str, Any, Any], Any] | None = None,
) -> None:
    """Add a spec option `NAME:ARG` (see ExtraOption); it round-trips through the text form."""
    OPTIONS.register(name, ExtraOption(check, rest_of_spec, tower, needs, values), help=help, module=caller_module())


BUILTIN_OPTIONS = (
    "gauss:SIGMA, temp:T, nores, cls:C, noffn, layers:N, parallel, avg, neg:W, aggin:TERM, aggout:TERM, "
    "in:sum@A-B|mean@A-B, hook:NAME"
)


def _options_help() -> str:
    extra = "".join(f", {n}:ARG" for n in OPTIONS.names())
    return f"options: {BUILTIN_OPTIONS}{extra}; normalizers: {normalizer_forms()}"


# -- the spec -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionSpec:
    """How the last `layers` blocks of a CLIP ViT compute attention. Defaults = unmodified CLIP.

    source: score terms, one canonical string per post-normalisation group (`("qq", "kk")`).
    cls_residual: replace the residual by this multiple of the block input's CLS token; attention then
        runs over patch tokens only (SC-CLIP). parallel: the edited blocks form a side path that reads
        the original path's ln_1 state (GEM, CLIP Surgery). average: divide the sum of groups by their
        number. aggregate_in/out: identity-value aggregation x <- R(support(S)) x before / after the block
        (R: row sums + 1e-6, SC-CLIP). inputs: extra inputs of the block (SC-CLIP's multi-level sum).
        hooks: token, match, global, windows and post stages the method needs (`clipseg_sparse.stages`: lof, surgery, sam, lp, tlp). extras:
        registered options.
    """

    source: tuple[str, ...] = ("qk",)
    normalizer: str = "softmax"
    gauss_sigma: float | None = None
    temperature: float | None = None
    residual: bool = True
    ffn: bool = True
    layers: int = 1
    negative: float = 0.0
    cls_residual: float | None = None
    parallel: bool = False
    average: bool = False
    aggregate_in: str | None = None
    aggregate_out: str | None = None
    inputs: tuple[str, ...] = ()
    hooks: tuple[str, ...] = ()
    extras: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        source = (self.source,) if isinstance(self.source, str) else tuple(self.source)
        if not source:
            raise UserValueError("attention source is empty")
        if "id" in source and len(source) > 1:
            raise UserValueError("source 'id' (value path only) cannot be summed with other sources")
        groups = []
        for text in source:
            try:
                groups.append(Group.parse(text) if text != "id" else None)
            except UserValueError as e:
                if text.isalpha() and "[" not in text:
                    raise UserValueError(f"unknown attention source {text!r}; choose from {', '.join(SOURCES)}, a tap "
                                         f"({_taps_help()}) or a sum such as qq+kk") from None
                raise e
        object.__setattr__(self, "source", tuple("id" if g is None else str(g) for g in groups))
        object.__setattr__(self, "normalizer", str(Normalizer.parse(self.normalizer)))
        if source == ("id",) and self.normalizer != "softmax":  # a run would be recorded as one it never was
            raise ValueError(f"normalizer {self.normalizer} on source 'id' (the value path alone: maskclip, lposs) "
                             "would change nothing: it has no attention scores to normalize; keep softmax")
        for name in ("gauss_sigma", "temperature", "negative", "cls_residual"):  # nan / inf give NaN scores
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be finite (got {value})")
        if self.gauss_sigma is not None and not self.gauss_sigma > 0:
            raise UserValueError(f"gauss sigma must be > 0 (got {self.gauss_sigma})")
        if self.temperature is not None and not self.temperature > 0:
            raise UserValueError(f"temperature must be > 0 (got {self.temperature})")
        if not (isinstance(self.layers, int) and self.layers >= 1):
            raise UserValueError(f"layers must be an integer >= 1 (got {self.layers})")
        if self.cls_residual is not None and self.residual:
            object.__setattr__(self, "residual", False)  # cls:C replaces the residual
        for name in ("aggregate_in", "aggregate_out"):
            value = getattr(self, name)
            if value is not None:
                term = Term.parse(value)
                if term.ref.tap.projections:  # computed outside the block's attention: it has no q/k/v
                    option = "aggin" if name == "aggregate_in" else "aggout"
                    raise UserValueError(f"{option}:{value}: {term.ref.kind} reads the edited block's own q/k/v, which the aggregation outside its attention has not; use a tap shared by all heads, e.g. x@L")
                object.__setattr__(self, name, str(term))
        object.__setattr__(self, "inputs", tuple(str(BlockInput.parse(i)) for i in self.inputs))
        if self.inputs and (self.parallel or self.layers != 1):
            raise UserValueError("extra block inputs (in:...) need one edited block in replace mode (layers:1, no parallel)")
        object.__setattr__(self, "hooks", tuple(check_hook(h) for h in self.hooks))
        extras = []
        for name, arg in self.extras:
            extras.append((name, OPTIONS.get(name).check(arg)))
        object.__setattr__(self, "extras", tuple(sorted(extras, key=lambda kv: (OPTIONS.get(kv[0]).rest_of_spec, kv[0]))))

    # -- structure ------------------------------------------------------------------------------
    @cached_property
    def groups(self) -> tuple[Group, ...]:
        """Parsed score groups (empty for source `id`)."""
        return () if self.source == ("id",) else tuple(Group.parse(s) for s in self.source)

    @cached_property
    def terms(self) -> tuple[Term, ...]:
        """Every score term of every group, in order."""
        return tuple(t for g in self.groups for t in g.terms)

    @cached_property
    def aggregation_in(self) -> Term | None:
        return Term.parse(self.aggregate_in) if self.aggregate_in else None

    @cached_property
    def aggregation_out(self) -> Term | None:
        return Term.parse(self.aggregate_out) if self.aggregate_out else None

    @cached_property
    def block_inputs(self) -> tuple[BlockInput, ...]:
        return tuple(BlockInput.parse(i) for i in self.inputs)

    @cached_property
    def norm(self) -> Normalizer:
        """The normalizer, parsed once."""
        return Normalizer.parse(self.normalizer)

    @cached_property
    def stages(self) -> tuple[Stage, ...]:
        """The stages the spec names (`hook:`), configured once."""
        return resolve_stages(self.hooks)

    @cached_property
    def attention_needs(self) -> Needs:
        """What the edited attention takes besides CLIP: one fold over its terms (their taps, the region
        support) and its registered options (`stages.Needs`)."""
        needs = Needs()
        inputs = (t for inp in self.block_inputs for t in inp.terms)
        for term in (*self.terms, *(t for t in (self.aggregation_in, self.aggregation_out) if t), *inputs):
            needs |= term.needs
        for name, arg in self.extras:
            option = OPTIONS.get(name).needs
            needs |= option(arg) if option else Needs()
        return dataclasses.replace(needs, regions=f"attention {self}") if needs.regions else needs

    @cached_property
    def needs(self) -> Needs:
        """What running the spec takes besides CLIP: its attention's needs, then its stages'."""
        needs = self.attention_needs
        for stage in self.stages:
            needs |= stage.needs
        return needs

    def extra(self, name: str) -> str | None:
        """The canonical argument of a registered option, or None when the spec does not set it."""
        return dict(self.extras).get(name)

    # -- text form -------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "AttentionSpec":
        """Parse a preset name (`sclip`), a preset with more options (`sclip/entmax:1.5/neg:0.2`) or the
        compact form (`qq+kk/entmax:1.5/nores`)."""
        text = text.strip()
        if text in PRESETS:
            return PRESETS.get(text).spec
        source_text, *options = text.split("/")
        if source_text in PRESETS:  # PRESET/[NORMALIZER/]OPTION...: the preset with more edits
            parts = str(PRESETS.get(source_text).spec).split("/")
            if options[0].split(":")[0] in NORMALIZER_KINDS:
                parts[1] = options.pop(0)
            return cls.parse("/".join(parts + options))
        if not options and "+" not in text and "[" not in text and "@" not in text and text not in SOURCES:
            raise UserValueError(
                f"unknown attention spec {text!r}: not a preset ({', '.join(PRESETS.names())}) and not of the "
                f"form SOURCE/NORMALIZER, e.g. qq/entmax:1.5; sources: {', '.join(SOURCES)}"
            )
        kwargs: dict = {"source": tuple(split_top(source_text, "+"))}
        if options and options[0].split(":")[0] in NORMALIZER_KINDS:
            kwargs["normalizer"] = options.pop(0)
        extras, inputs, hooks = [], [], []
        while options:
            opt = options.pop(0)
            name, _, arg = opt.partition(":")
            try:
                if name in OPTIONS:
                    if OPTIONS.get(name).rest_of_spec:
                        arg, options = "/".join([arg, *options]), []
                    extras.append((name, arg))
                else:
                    kwargs.update(_parse_option(name, arg, inputs, hooks))
            except ValueError as e:
                raise UserValueError(f"bad option {opt!r} in attention spec {text!r} ({e}); {_options_help()}") from None
        return cls(**kwargs, inputs=tuple(inputs), hooks=tuple(hooks), extras=tuple(extras))

    def __str__(self) -> str:
        parts = ["+".join(self.source), self.normalizer]
        if self.gauss_sigma is not None:
            parts.append(f"gauss:{self.gauss_sigma:g}")
        if self.temperature is not None:
            parts.append(f"temp:{self.temperature:g}")
        if self.cls_residual is not None:
            parts.append(f"cls:{fmt_num(self.cls_residual)}")
        elif not self.residual:
            parts.append("nores")
        if not self.ffn:
            parts.append("noffn")
        if self.layers != 1:
            parts.append(f"layers:{self.layers}")
        if self.parallel:
            parts.append("parallel")
        if self.average:
            parts.append("avg")
        if self.negative:
            parts.append(f"neg:{self.negative:g}")
        if self.aggregate_in:
            parts.append(f"aggin:{self.aggregate_in}")
        if self.aggregate_out:
            parts.append(f"aggout:{self.aggregate_out}")
        parts += [f"in:{i}" for i in self.inputs] + [f"hook:{h}" for h in self.hooks]
        parts += [f"{name}:{arg}" for name, arg in self.extras]
        return "/".join(parts)

    def replace(self, **changes) -> "AttentionSpec":
        return dataclasses.replace(self, **changes)

    def __getstate__(self) -> dict:
        """The fields only: what the spec parsed once (configured stages hold functions) is parsed again."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    @property
    def has_normalizer_slot(self) -> bool:
        """False for source `id` (MaskCLIP's value path): no attention scores, so no normalizer to swap."""
        return self.source != ("id",)

    @property
    def is_identity(self) -> bool:
        """True when the spec leaves CLIP unchanged, so no block needs to be re-run by hand."""
        return self == AttentionSpec()


def _parse_option(name: str, arg: str, inputs: list, hooks: list) -> dict:
    """One built-in option -> AttentionSpec keyword(s); `in:` and `hook:` append to their lists."""
    if name == "gauss" and arg:
        return {"gauss_sigma": parse_number(arg, "gauss")}
    if name == "temp" and arg:
        return {"temperature": parse_number(arg, "temp")}
    if name in ("nores", "noffn", "parallel", "avg") and not arg:
        return {"nores": {"residual": False}, "noffn": {"ffn": False}, "parallel": {"parallel": True}, "avg": {"average": True}}[name]
    if name == "cls" and arg:
        return {"cls_residual": parse_number(arg, "cls"), "residual": False}
    if name == "layers" and arg:
        return {"layers": int(arg)}
    if name == "neg" and arg:
        return {"negative": parse_number(arg, "neg")}
    if name in ("aggin", "aggout") and arg:
        return {"aggregate_" + name[3:]: arg}
    if name == "in" and arg:
        inputs.append(arg)
        return {}
    if name == "hook" and arg:
        hooks.append(arg)
        return {}
    raise UserValueError("unknown option or missing argument")


def _taps_help() -> str:
    from .taps import TAPS

    return ", ".join(TAPS.help(n) for n in TAPS.names())


# -- named specs: the published methods register theirs (clipseg_sparse.methods, `presets.register_preset`) --
@dataclass(frozen=True)
class Preset:
    spec: AttentionSpec
    reference: str
    notes: str = ""  # quirks of the published code copied or fixed

    def describe(self, help: str) -> dict[str, str]:
        return {"spec": str(self.spec), "normalizer slot": "yes" if self.spec.has_normalizer_slot else "no", "follows": help}


PRESETS: Registry[Preset] = Registry("attention preset", locations=("clipseg_sparse.methods",), group=ENTRY_POINT_GROUP)
