"""The spec's axes (terms, taps, options, groups, extension points): the text form and each axis against a
direct computation; the CLIP-only presets' listing, grids and entmax variants (their published forwards:
tests/methods/test_scclip.py, test_gem.py, test_clipsurgery.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import structured_pixels
from clipseg_sparse.attention import (
    OPTIONS, PRESETS, TAPS, AttentionSpec, BlockContext, Tap, attention_maps, edited_block_forward, register_option,
)

V2_SPECS = [
    "x@9[cos,shift:1,scale:3,pos]+kk/softmax/cls:0.3/noffn/avg/aggin:x@9[cos,thresh:0.4]/aggout:x@4[cos,thresh:0.4]/in:sum@4-10/hook:lof",
    "vv[cos,temp:auto,iter:1]+kk[cos,temp:auto,iter:1]/entmax:1.5/noffn/layers:6/parallel/avg",
    "0.25*qq[topk:5]+0.75*kk[topp:0.9]/sparsemax",
    "0.5*(0.3*kk&x@2[cos,temp:2])+attn@1-2/softmax/gauss:5/nores/noffn",
    "qq[dot,temp:0.1]/softmax/in:0.5*mean@1-2",
]


@pytest.mark.parametrize("text", V2_SPECS)
def test_v2_round_trip(text):
    spec = AttentionSpec.parse(text)
    assert AttentionSpec.parse(str(spec)) == spec
    assert str(AttentionSpec.parse(str(spec))) == str(spec)


@pytest.mark.parametrize("name", PRESETS.names())
def test_every_preset_round_trips_and_cites(name):
    spec = PRESETS.get(name).spec
    assert AttentionSpec.parse(str(spec)) == spec and AttentionSpec.parse(name) == spec
    assert PRESETS.help(name)


def test_preset_with_more_options():
    assert AttentionSpec.parse("sclip/entmax:1.5") == PRESETS.get("sclip-entmax").spec
    assert AttentionSpec.parse("naclip/neg:0.2") == PRESETS.get("naclip").spec.replace(negative=0.2)
    assert AttentionSpec.parse("gem/sparsemax/temp:0.5") == PRESETS.get("gem").spec.replace(normalizer="sparsemax", temperature=0.5)


def test_canonical_forms():
    assert str(AttentionSpec.parse("kk[dot]/softmax/nores/cls:0.3")) == "kk/softmax/cls:0.3"
    assert str(AttentionSpec.parse("1*qq+(kk)/softmax")) == "qq+kk/softmax"
    assert AttentionSpec.parse("qq+kk/softmax") == AttentionSpec(source=("qq", "kk"))  # v1 values unchanged
    assert AttentionSpec.parse("(0.5*qq&0.5*kk)/softmax").groups[0].weight == 1.0


@pytest.mark.parametrize(
    "bad,fragment",
    [
        ("qq[bogus]/softmax", "modifiers: cos, dot"),
        ("qq[topk:0]/softmax", "topk needs an integer"),
        ("zz/softmax", "unknown attention source"),
        ("x@0[cos]/softmax", "block number"),
        ("attn@3-1/softmax", "1 <= A <= B"),
        ("qk[iter:1]/softmax", "self-similarity"),
        ("qq/softmax/hook:nope", "lof, surgery"),
        ("qq/softmax/hook:regionvote", "labels stage"),
        ("qq/softmax/in:max@1-2", "sum@A-B or mean@A-B"),
        ("qq/softmax/layers:2/in:sum@1-2", "one edited block"),
        ("qq/softmax/frobnicate", "options: gauss:SIGMA"),
        ("qq[temp:hot]/softmax", "not a number"),
    ],
)
def test_bad_options_name_the_choices(bad, fragment):
    with pytest.raises(ValueError) as err:
        AttentionSpec.parse(bad)
    assert fragment in str(err.value)


# -- the axes against direct computations (tiny model) ------------------------------------------------------
def _qkv(blk, x):
    B, N, C = x.shape
    H = blk.attn.num_heads
    q, k, v = F.linear(blk.ln_1(x), blk.attn.in_proj_weight, blk.attn.in_proj_bias).chunk(3, -1)
    return [t.reshape(B, N, H, C // H).transpose(1, 2) for t in (q, k, v)]


def _out(blk, attn, v):
    B, H, N, d = v.shape
    return blk.attn.out_proj((attn @ v).transpose(1, 2).reshape(B, N, H * d))


@pytest.fixture()
def block_input(tiny_clip):
    torch.manual_seed(3)
    blk = tiny_clip.visual.transformer.resblocks[-1]
    return blk, torch.randn(2, 1 + 16, tiny_clip.visual.transformer.width)


def _support_reference(s, kind, arg):
    """Row by row, written without the engine's helpers."""
    out = s.clone()
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in s.shape[:-1]]):
        row = s[tuple(idx)]
        if kind == "topk":
            keep = row >= sorted(row.tolist(), reverse=True)[int(arg) - 1]
        elif kind == "topp":
            p = torch.softmax(row, 0)
            order = torch.argsort(p, descending=True)
            keep = torch.zeros_like(row, dtype=torch.bool)
            mass = 0.0
            for j in order.tolist():
                keep[j] = True
                mass += p[j].item()
                if mass >= arg:
                    break
        else:
            keep = row >= (0.0 if kind == "pos" else arg)
        out[tuple(idx)] = row.masked_fill(~keep, float("-inf"))
    return out


@pytest.mark.parametrize("mod,kind,arg", [("pos", "pos", None), ("thresh:0.2", "thresh", 0.2), ("topk:3", "topk", 3), ("topp:0.6", "topp", 0.6)])
def test_support_masks(block_input, mod, kind, arg):
    blk, x = block_input
    with torch.no_grad():
        out = edited_block_forward(blk, x, AttentionSpec.parse(f"qq[shift:1,scale:2,{mod}]/softmax/nores/noffn"), (4, 4))
        q, _, v = _qkv(blk, x)
        s = q @ q.transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = 2 * (s - s.mean(dim=(-1, -2), keepdim=True))
        ref = _out(blk, torch.softmax(_support_reference(s, kind, arg), -1), v)
    assert torch.allclose(out, ref, atol=1e-5)


def test_pre_mix_weights_and_post_mix(block_input):
    blk, x = block_input
    spec = AttentionSpec.parse("(0.3*qq&0.7*kk[cos,temp:4])+2*vv/softmax/nores/noffn/avg")
    with torch.no_grad():
        out = edited_block_forward(blk, x, spec, (4, 4))
        q, k, v = _qkv(blk, x)
        d = q.shape[-1]
        kn = F.normalize(k, dim=-1)
        pre = torch.softmax(0.3 * (q @ q.transpose(-1, -2)) / math.sqrt(d) + 0.7 * 4 * kn @ kn.transpose(-1, -2), -1)
        vv = torch.softmax(v @ v.transpose(-1, -2) / math.sqrt(d), -1)
        ref = _out(blk, (pre + 2 * vv) / 2, v)
    assert torch.allclose(out, ref, atol=1e-5)


def test_hidden_state_and_attention_taps(tiny_clip):
    """x@1 (cosine of the residual stream after block 1) and attn@1-2 (mean CLIP attention of blocks 1, 2)
    read the right tensors: compared with a plain run of open_clip's blocks."""
    v = tiny_clip.visual
    torch.manual_seed(4)
    pixels = torch.randn(1, 3, 64, 64)
    spec = AttentionSpec.parse("x@1[cos,temp:5]+attn@1-2/softmax/nores/noffn")
    with torch.no_grad():
        x, grid = tiny_clip._embed(pixels)
        b1, b2, b3 = v.transformer.resblocks
        x1 = b1(x)
        maps = []
        for blk, inp in ((b1, x), (b2, x1)):
            q, k, _ = _qkv(blk, inp)
            maps.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1))
        x2 = b2(x1)
        h = F.normalize(x1, dim=-1)
        attn = torch.softmax(5 * h @ h.transpose(-1, -2), -1)[:, None] + (maps[0] + maps[1]) / 2
        _, _, val = _qkv(b3, x2)
        ref = F.normalize(v.ln_post(_out(b3, attn, val)[:, 1:]) @ v.proj, dim=-1)
        assert torch.allclose(tiny_clip.encode_dense(pixels, spec).reshape(1, -1, ref.shape[-1]), ref, atol=1e-5)
        assert torch.allclose(attention_maps(tiny_clip, pixels, spec), attn.expand(-1, b3.attn.num_heads, -1, -1), atol=1e-6)


def test_extension_points_round_trip_and_run(block_input):
    """A tap registered from outside (as `ext:NAME` will be) and an extra option (as `dna:PATH` will be)."""
    if "const" not in TAPS:
        TAPS.register("const", Tap(features=lambda ctx, arg: (torch.ones_like(ctx.q[:, :1]),) * 2), help="const (test)")
    if "testpath" not in OPTIONS:
        register_option("testpath", lambda arg: arg.rstrip("/"), help="a path (test)", rest_of_spec=True)
    spec = AttentionSpec.parse("const:x/softmax/nores/noffn/testpath:/tmp/a/b/")
    assert spec.extra("testpath") == "/tmp/a/b" and AttentionSpec.parse(str(spec)) == spec
    blk, x = block_input
    with torch.no_grad():
        _, _, v = _qkv(blk, x)
        ref = _out(blk, torch.full((1, 1, 17, 17), 1 / 17), v)
        assert torch.allclose(edited_block_forward(blk, x, spec, (4, 4)), ref, atol=1e-5)


def test_an_option_tower_gives_the_blocks_the_model_runs(tiny_clip):
    """`ExtraOption.tower(clip, arg)`: DenseCLIP runs the blocks an option gives (how `dna:PATH` runs its
    adapter's blocks) without knowing the option."""
    from types import SimpleNamespace

    import torch.nn as nn

    seen = []

    def tower(clip, arg):
        seen.append(arg)
        blocks = list(clip.visual.transformer.resblocks)
        return clip.visual if arg == "same" else SimpleNamespace(
            transformer=SimpleNamespace(resblocks=nn.ModuleList(blocks[:-1] + blocks[:1]), batch_first=clip.visual.transformer.batch_first)
        )

    if "testtower" not in OPTIONS:
        register_option("testtower", lambda arg: arg, help="blocks from elsewhere (test)", tower=tower)
    torch.manual_seed(6)
    pixels = torch.randn(1, 3, 64, 48)
    with torch.no_grad():
        plain = tiny_clip.encode_dense(pixels, "sclip")
        assert torch.equal(tiny_clip.encode_dense(pixels, "sclip/testtower:same"), plain)
        assert not torch.allclose(tiny_clip.encode_dense(pixels, "sclip/testtower:swapped"), plain, atol=1e-3)
    assert seen == ["same", "swapped"]


def test_attention_maps_reproduce_the_forward(tiny_clip):
    """maps @ v through out_proj gives the forward's block output for a fused-kernel spec."""
    torch.manual_seed(5)
    pixels = torch.randn(2, 3, 64, 80)
    with torch.no_grad():
        maps = attention_maps(tiny_clip, pixels, "naclip")
        x, grid = tiny_clip._embed(pixels)
        blocks = tiny_clip.visual.transformer.resblocks
        for blk in blocks[:-1]:
            x = blk(x)
        _, k, v = _qkv(blocks[-1], x)
        from clipseg_sparse.attention import gaussian_prior

        ref = torch.softmax(k @ k.transpose(-1, -2) / math.sqrt(k.shape[-1]) + gaussian_prior(grid, 5.0), -1)
    assert maps.shape == (2, blocks[-1].attn.num_heads, 1 + 4 * 5, 1 + 4 * 5)
    assert torch.allclose(maps, ref, atol=1e-6)


def test_ls_presets_shows_the_new_presets_with_their_papers():
    from typer.testing import CliRunner

    from clipseg_sparse.cli.app import app

    result = CliRunner().invoke(app, ["ls", "presets"], env={"COLUMNS": "1000"})  # wide enough that no spec folds
    assert result.exit_code == 0
    assert str(PRESETS.get("scclip").spec) in result.output  # [..] modifiers are printed, not read as markup
    for name, paper in [("scclip", "SC-CLIP (Bai et al."), ("scclip-l14", "ViT-L/14"), ("gem", "GEM (Bousselham"),
                        ("gem-entmax", "gem with alpha-entmax"), ("clipsurgery", "CLIP Surgery (Li")]:
        assert any(paper in line and f" {name} " in line for line in result.output.splitlines()), (name, result.output)


@pytest.mark.parametrize("grid,models,presets", [
    ("scclip", ["ViT-B-16"], ["scclip"]), ("scclip-l14", ["ViT-L-14"], ["scclip-l14"]), ("gem", ["ViT-B-16", "ViT-L-14"], ["gem"]),
    ("clipsurgery", ["ViT-B-16", "ViT-L-14"], ["clipsurgery"]),
])
def test_reproduce_grids_cross_the_new_presets_with_softmax_and_entmax(grid, models, presets):
    """Each grid: its preset x {softmax, entmax:1.5} x the 8 benchmarks, with the right layer indices per model."""
    from clipseg_sparse.datasets import DATASETS
    from clipseg_sparse.sweeps.grid import GRIDS, read_grid_file

    g = read_grid_file(GRIDS.get(grid)).grid
    assert list(g.models) == models and set(g.datasets) == set(DATASETS.names()) and g.protocol == grid.split("-")[0]
    specs = {str(PRESETS.get(p).spec.replace(normalizer=n)) for p in presets for n in ("softmax", "entmax:1.5")}
    assert set(g.attention_specs()) == specs and len(g.cells()) == len(models) * 8 * 2


@pytest.mark.parametrize("name", ["scclip", "gem", "clipsurgery"])
def test_entmax_variant_tends_to_its_softmax_preset(vit_b16, name):
    """entmax replaces every normalizer slot: at alpha = 1 + 1e-4 the features agree with the softmax
    preset to 2e-3 (the entmax-softmax gap is O(alpha - 1) and fp32 rounding of (1 + (a-1)s)^(1/(a-1))
    adds about 1e4 x 6e-8 relative per probability); at alpha 1.5 they differ."""
    torch.manual_seed(8)
    pixels = structured_pixels(1, (224, 224))
    spec = PRESETS.get(f"{name}-entmax").spec
    assert spec == PRESETS.get(name).spec.replace(normalizer="entmax:1.5")
    with torch.no_grad():
        soft = vit_b16.encode_dense(pixels, name)
        near = vit_b16.encode_dense(pixels, spec.replace(normalizer="entmax:1.0001"))
        sparse = vit_b16.encode_dense(pixels, spec)
    assert (near - soft).abs().max() < 2e-3
    assert (sparse - soft).abs().max() > 1e-2
