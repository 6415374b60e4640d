"""Running CLIP's transformer with the edited block(s): replace or parallel mode, hooks, extra inputs.

`encode_tokens` runs the untouched blocks (keeping the hidden states and attention maps the spec's taps
read), the token hooks, then the last `spec.layers` blocks from their own weights:
- replace mode: each edited block's output feeds the next (v1; SCLIP, ClearCLIP, NACLIP, SC-CLIP);
- parallel mode: the original blocks keep running; a side path starts at the first edited block's input
  and adds each edited attention, computed from the *original* path's ln_1 state (GEM, CLIP Surgery).
  Its output has the original path's CLS token (CLIP Surgery; patch tokens do not depend on it).
Extra inputs (`in:sum@A-B`) run the last block again on that input and add its output (SC-CLIP), attending
with the spec's score groups or with their own (`in:sum@A-B(GROUPS)`, SFP). Token stages may read CLIP's own
attention of the blocks before the edited ones (`Stage.maps`, SFP's outlier finder).
Region maps (CorrCLIP, `scope.py`): the `region:EPS` support and the `mct:BETA` semantic branch; with
`mct`, `encode_normed` applies ln_post to each branch before the weighted sum.
Nothing is patched in place; the model's weights are only read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import UserValueError
from . import feedback
from .combine import _attend, aggregate, attended_values, attention_weights
from .contract import Block, grid_block, negative_branch, positive_attention
from .grid import resize_regions
from .precision import like
from .scope import mask_class_tokens, mct_step, needs_regions, prepare_regions, semantic_tokens, semantic_weight
from .spec import OPTIONS, AttentionSpec
from .terms import BlockInput
from .taps import BlockContext, block_qkv, clip_attention, run_block


@dataclass
class EncoderState:
    """The residual stream entering the edited blocks and what the taps read (token hooks edit it).

    x: B x (1 + h*w) x C. hidden: block index (1-based) -> tokens after that block, untouched (output
    aggregation and extra inputs read these). main: the hidden states the main path's score terms and
    input aggregation read (a token stage with `taps` repairs them with x). maps: CLIP's own attention of kept blocks."""

    x: torch.Tensor
    grid: tuple[int, int]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    main: dict[int, torch.Tensor] = field(default_factory=dict)
    maps: dict[int, torch.Tensor] = field(default_factory=dict)
    pixels: torch.Tensor | None = None
    blocks: Sequence = ()  # the tower's blocks (BlockContext.blocks)
    extra: dict = field(default_factory=dict)  # BlockContext.extra of the edited blocks (feedback map, regions, cached taps)


def _tap_needs(spec: AttentionSpec) -> tuple[set[int], set[int], set[int]]:
    """(hidden states read by score terms and input aggregation, by output aggregation and extra
    inputs, CLIP attention maps read), as 1-based block indices."""
    main, raw, maps = set(), set(), set()
    inputs = (t for inp in spec.block_inputs for t in inp.terms)
    for term in (*spec.terms, *(t for t in (spec.aggregation_in,) if t), *inputs):
        main |= term.ref.tap.hidden(term.ref.arg)
        maps |= term.ref.tap.blocks(term.ref.arg)
    if spec.aggregation_out:
        raw |= spec.aggregation_out.ref.tap.hidden(spec.aggregation_out.ref.arg)
    for inp in spec.block_inputs:
        raw |= set(range(inp.first, inp.last + 1))
    return main, raw, maps


@functools.lru_cache(maxsize=256)
def input_spec(spec: AttentionSpec, inp: BlockInput) -> AttentionSpec:
    """The spec an extra input attends with: the spec's own, or with the input's score groups (`sum@A-B(...)`)."""
    return spec.replace(source=inp.source) if inp.source else spec


def _stage_maps(hooks: Sequence[Callable], n_plain: int) -> dict[int, int]:
    """Each block a token stage's `maps` names -> its 1-based index; UserValueError for one that is not a
    block before the edited ones."""
    blocks = {}
    for hook in hooks:
        for named in getattr(hook, "maps", ()):
            i = n_plain + 1 + named if named < 0 else named
            if not 1 <= i <= n_plain:
                raise UserValueError(f"token stage {getattr(hook, 'name', hook)} reads the attention of block {named}; blocks 1..{n_plain} run before the edited ones")
            blocks[named] = i
    return blocks


def _token_stage(hook: Callable, state: EncoderState, grid: tuple[int, int], blocks: dict[int, int]) -> torch.Tensor:
    """Run one token stage on `state.x` with what it declares it reads (`stages.TokenCall`)."""
    named = getattr(hook, "maps", ())
    if named:
        return hook(state.x, grid, state.main, {m: state.maps[blocks[m]] for m in named})
    return hook(state.x, grid, state.main) if getattr(hook, "taps", False) else hook(state.x, grid)


def min_depth(spec: AttentionSpec) -> int:
    """The fewest blocks a tower needs to run `spec`: its edited blocks after every block a tap or input reads
    (`ls presets` shows it where the default ViT-B/16 has fewer)."""
    return spec.layers + max(set().union(*_tap_needs(spec)), default=0)


def check_depth(spec: AttentionSpec, depth: int) -> None:
    """UserValueError when a spec needs more blocks than a tower of `depth` blocks has: it edits more than
    `depth`, or a tap or input reads a block that is edited or past the last (a ViT-L spec on a ViT-B).
    `DenseCLIP.check_spec` runs it before any image; the forward runs it again for library callers."""
    if spec.layers > depth:
        raise UserValueError(f"spec {spec} edits the last {spec.layers} blocks but the model has {depth}")
    n_plain = depth - spec.layers
    late = sorted(i for i in set().union(*_tap_needs(spec)) if i > n_plain)
    if late:
        raise UserValueError(f"spec {spec} reads block {late[0]}, which is edited or past the last block; taps and inputs must come from blocks 1..{n_plain} of this model's {depth}")


def _context(state: EncoderState, reads: torch.Tensor, block: Block, offset: int, hidden) -> BlockContext:
    """ln_1 and q/k/v (B x H x N x d) of `reads` (B x N x C) for `block` (`taps.block_qkv`)."""
    u = block.ln_1(reads)
    q, k, v = block_qkv(block, u, state.grid)
    return BlockContext(
        q=q, k=k, v=v, u=u, grid=state.grid, offset=offset, hidden=hidden, maps=state.maps, pixels=state.pixels, extra=state.extra,
        blocks=state.blocks,
    )


def edited_block_forward(
    block: Block,
    x: torch.Tensor,
    spec: AttentionSpec,
    grid: tuple[int, int],
    state: EncoderState | None = None,
    reads: torch.Tensor | None = None,
    main: bool = True,
    sink: list | None = None,
) -> torch.Tensor:
    """Run one block (`contract.Block`: open_clip's `ResidualAttentionBlock`, or a timm block adapted by its
    family, `models/families/timm_tower.py`) with the attention described by `spec`.

    x: B x N x C tokens (batch first, the prefix tokens (CLS; none in SigLIP) first, then the h x w patch
    grid row-major).
    reads: the tokens whose ln_1 gives q, k, v (parallel mode: the original path); default x.
    main: False for an extra input (no input aggregation). sink: if a list, the B x H x N x N attention
    that multiplies the values is appended to it (analysis). Uses the block's own weights (`attn.in_proj_*`,
    `attn.out_proj`, `ln_1`, `ln_2`, `mlp`, `ls_*`) and changes none of them.
    """
    attn = positive_attention(block.attn)  # a DnA block (dna:PATH) adds its negative branch below
    if not isinstance(attn, torch.nn.MultiheadAttention) and grid_block(block) is None:
        raise TypeError(
            f"attention edits need open_clip's default ResidualAttentionBlock (nn.MultiheadAttention) or an "
            f"adapted timm block, got {type(attn).__name__}"
        )
    state = state or EncoderState(x, grid)
    off = _cls_offset(spec, x, grid)  # cls:C attends over the patch tokens only
    tokens = x[:, off:] if off else x
    if main and spec.aggregate_in:
        tokens = aggregate(tokens, spec.aggregation_in, BlockContext(grid=grid, offset=off, hidden=state.main, blocks=state.blocks))
    source = tokens if reads is None else reads[:, off:]
    ctx = _context(state, source, block, off, state.main)
    B, _, C = tokens.shape
    apply = _values_rule(spec)
    if sink is not None or apply is not None:
        weights = attention_weights(spec, ctx)
        if sink is not None:
            sink.append(weights)
        values = attended_values(spec, ctx)
        out = like(weights, values) @ values if apply is None else apply(weights, values)
    elif spec.source == ("id",):
        out = ctx.v
    else:
        out = _attend(ctx.q, ctx.k, ctx.v, spec, grid, ctx)
    branch = negative_branch(block.attn)  # a WrappedAttention's (DnA, dna:PATH)
    if branch is not None:
        if out.shape[2] != ctx.u.shape[1]:
            raise UserValueError("dna:PATH adds its branch on CLIP's token grid; it cannot be combined with attention on an external grid")
        out = out + branch(ctx.u, ctx.k, ctx.v)
    out = attn.out_proj(out.transpose(1, 2).reshape(B, out.shape[2], C))  # N, or an external grid's size
    if spec.cls_residual is not None:
        base = spec.cls_residual * x[:, :1] if off else 0  # cls:0 on a tower without CLS (SigLIP): no residual
    else:
        base = tokens if spec.residual else 0
    y = base + block.ls_1(out)
    if spec.ffn:
        y = y + block.ls_2(block.mlp(block.ln_2(y)))
    if spec.aggregate_out:
        y = aggregate(y, spec.aggregation_out, BlockContext(grid=grid, offset=off, hidden=state.hidden, blocks=state.blocks))
    return torch.cat([x[:, :off], y], dim=1) if off else y


def _values_rule(spec: AttentionSpec) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """An option's rule for applying the attention to the values (`ExtraOption.values`), or None: weights @ v."""
    for name, arg in spec.extras:
        rule = OPTIONS.get(name).values
        if rule is not None:
            return functools.partial(rule, arg)
    return None


def _cls_offset(spec: AttentionSpec, x: torch.Tensor, grid: tuple[int, int]) -> int:
    """The prefix tokens `cls:C` sets aside (x: B x N x C on `grid`): the CLS token (0 without `cls:`). A tower
    without one (SigLIP) has nothing to set aside, so `cls:0` (no residual) runs and `cls:C`, C != 0, cannot."""
    if spec.cls_residual is None:
        return 0
    prefix = x.shape[1] - grid[0] * grid[1]
    if prefix == 0 and spec.cls_residual:
        raise UserValueError(f"spec {spec}: cls:C adds C x the CLS token, and this model's tokens have none (SigLIP; cls:0 runs)")
    return min(prefix, 1)


def encode_tokens(
    visual: torch.nn.Module,
    x: torch.Tensor,
    spec: AttentionSpec,
    grid: tuple[int, int],
    pixels: torch.Tensor | None = None,
    token_hooks: Sequence[Callable] = (),
    sink: list | None = None,
    context: Mapping[str, Any] | None = None,
    regions: torch.Tensor | None = None,
    branches: list | None = None,
) -> torch.Tensor:
    """Tokens B x (1 + h*w) x C after the last block, the last `spec.layers` blocks edited.

    x: B x (1 + h*w) x C after ln_pre. token_hooks: token stages (`stages.py`) to run after the spec's
    own (`hook:`), before the edited blocks. sink: see `edited_block_forward` (filled by the last
    edited block's main path). context: what a `feedback` term's first pass reads (`text`, `logit_scale`;
    see feedback.py): the edited blocks run once without it, their labels make the map the final run reads;
    and `image_features` (backbone name -> the windows' crops of whole-image features, `ext:NAME.image`:
    `models.proxies.WindowFeatures`, or a B x C x H x W tensor of them).
    regions: B x H x W region ids of the input's pixels (-1 unsegmented), for specs that read regions
    (`scope.py`). branches: with `mct:BETA`, a list that receives the (weight, B x M x C tokens) of the
    extra inputs and the semantic branch instead of adding them to the main output (`encode_normed`)."""
    blocks = visual.transformer.resblocks
    check_depth(spec, len(blocks))
    if spec.is_identity and sink is None:
        for blk in blocks:
            x = run_block(blk, x, grid)
        for hook in token_hooks:  # no block is edited: the hooks see the last block's output
            x = hook(x, grid)
        return x
    n_plain = len(blocks) - spec.layers
    need_main, need_raw, need_maps = _tap_needs(spec)
    hooks = [st for st in spec.stages if st.kind == "token"] + list(token_hooks)
    stage_maps = _stage_maps(hooks, n_plain)
    need_maps |= set(stage_maps.values())
    state = EncoderState(x, grid, pixels=pixels, blocks=tuple(blocks))
    for name, feats in (context or {}).get("image_features", {}).items():  # whole-image backbone features, per window
        state.extra[("image", name)] = feats
    if (context or {}).get("backbones") is not None:  # the run's external backbones (`ext:` taps)
        state.extra["backbones"] = context["backbones"]
    if needs_regions(spec):
        prepare_regions(spec, regions, pixels, grid, state.extra)
    beta = semantic_weight(spec)
    if beta is not None and branches is None:
        if sink is None:
            raise ValueError(f"spec {spec}: the mct branch is added after ln_post; encode it with encode_normed")
        beta = None  # attention maps only: the main path does not depend on the MCTs
    if beta is not None:
        if spec.layers != 1 or spec.parallel:
            raise UserValueError(f"spec {spec}: mct needs one edited block in replace mode (layers:1, no parallel)")
        ids = torch.stack([resize_regions(r.view(state.extra["regions_grid"]), grid) for r in state.extra["regions"]])
        mct, allowed, index = mask_class_tokens(x, ids.flatten(1))
    for i, blk in enumerate(blocks[:n_plain], start=1):
        if i in need_maps:
            state.maps[i] = clip_attention(blk, x, grid)
        if beta is not None:
            mct = mct_step(blk, mct, x, allowed, grid)
        x = run_block(blk, x, grid)
        if i in need_main | need_raw:
            state.hidden[i] = x
    state.x = x
    state.main = {i: state.hidden[i] for i in need_main}
    for hook in hooks:
        state.x = _token_stage(hook, state, grid, stage_maps)
    edited = blocks[n_plain:]
    if feedback.feedback_terms(spec):  # ResCLIP: a first pass, then the map the final pass reads
        first = _replace(edited, state, feedback.first_pass_spec(spec), None)
        state.extra["feedback"] = feedback.feedback_scores(visual, first, grid, pixels, spec, context)
    if spec.parallel:
        return _parallel(edited, state, spec, sink)
    if beta is None:
        return _replace(edited, state, spec, sink)
    x = _replace(edited, state, spec, sink, branches)
    mct = mct_step(edited[-1], mct, state.x, allowed, grid)
    branches.append((beta, semantic_tokens(mct, index, grid, state.extra["regions_grid"])))
    return x


def _replace(edited, state: EncoderState, spec: AttentionSpec, sink: list | None, branches: list | None = None) -> torch.Tensor:
    """Replace mode: each edited block's output feeds the next; extra inputs add their outputs (or, with
    `branches`, are appended to it as (weight, tokens))."""
    grid = state.grid
    x = state.x
    for j, blk in enumerate(edited):
        x = edited_block_forward(blk, x, spec, grid, state, sink=sink if j == len(edited) - 1 else None)
    off = _cls_offset(spec, state.x, grid)
    for inp in spec.block_inputs:
        layers = [state.hidden[i] for i in range(inp.first, inp.last + 1)]
        r = sum(layers[1:], layers[0].clone()) if inp.kind == "sum" else torch.stack(layers).mean(0)
        y = edited_block_forward(edited[-1], r, input_spec(spec, inp), grid, state, main=False)[:, off:]
        if branches is not None:
            branches.append((inp.weight, y))
            continue
        x = torch.cat([x[:, :off], x[:, off:] + (y if inp.weight == 1.0 else inp.weight * y)], dim=1)
    return x


def encode_normed(
    visual: torch.nn.Module,
    x: torch.Tensor,
    spec: AttentionSpec,
    grid: tuple[int, int],
    ln_post: Callable[[torch.Tensor], torch.Tensor],
    pixels: torch.Tensor | None = None,
    token_hooks: Sequence[Callable] = (),
    regions: torch.Tensor | None = None,
    context: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """`ln_post` (the tower's final LayerNorm) of `encode_tokens`' output, B x (1 + M) x C. With `mct:BETA`
    (CorrCLIP) the main output, each extra input's and the semantic branch's pass ln_post separately and
    are then summed with their weights (patch tokens; the CLS token is the main path's)."""
    branches: list = []
    x = ln_post(encode_tokens(visual, x, spec, grid, pixels, token_hooks, context=context, regions=regions, branches=branches))
    for weight, y in branches:
        y = ln_post(y)
        x = torch.cat([x[:, :1], x[:, 1:] + (y if weight == 1.0 else weight * y)], dim=1)
    return x


def _parallel(edited, state: EncoderState, spec: AttentionSpec, sink: list | None) -> torch.Tensor:
    """GEM / CLIP Surgery: x_par += edited attention of ln_1(x_orig) (FFN if kept), x_orig runs as is."""
    x_orig = x_par = state.x
    for j, blk in enumerate(edited):
        x_par = edited_block_forward(blk, x_par, spec, state.grid, state, reads=x_orig, sink=sink if j == len(edited) - 1 else None)
        x_orig = run_block(blk, x_orig, state.grid)
    prefix = x_orig.shape[1] - state.grid[0] * state.grid[1]  # the CLS token (none in SigLIP)
    return torch.cat([x_orig[:, :prefix], x_par[:, prefix:]], dim=1)


def attention_maps_from_tokens(
    visual: torch.nn.Module, x: torch.Tensor, spec: AttentionSpec, grid: tuple[int, int], pixels=None, regions=None,
    context: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """B x H x N x N attention of the last edited block's main path (see `attention.attention_maps`);
    context as `encode_tokens`' (the `image_features` crops `ext:NAME.image` taps read)."""
    sink: list = []
    encode_tokens(visual, x, spec, grid, pixels, sink=sink, context=context, regions=regions)
    return sink[-1]
