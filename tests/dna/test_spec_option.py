"""The attention-spec option `dna:PATH`: text form with the adapter's hash, the same features as a converted
model, the negative branch added to another positive attention (by hand), and the CLI's one-line errors."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from clipseg_sparse.attention import AttentionSpec
from clipseg_sparse.cli.app import app
from clipseg_sparse.dna import apply_adapter, convert_to_dna, load_adapter, save_adapter
from conftest import TINY_CONFIG
from fake_benchmarks import make_benchmark


def _adapter(tiny_clip, path: Path, blocks=2, alpha: float | None = None) -> Path:
    clip = copy.deepcopy(tiny_clip)
    modules = convert_to_dna(clip, blocks)
    torch.manual_seed(2)
    with torch.no_grad():
        for m in modules.values():
            m.q_neg.weight.normal_(0, 0.3)
            m.v_neg.weight.normal_(0, 0.3)
            m.alpha.uniform_(0.3, 0.9) if alpha is None else m.alpha.fill_(alpha)
    return save_adapter(clip, path)


def test_text_form_records_the_adapter_hash(tiny_clip, tmp_path):
    path = _adapter(tiny_clip, tmp_path / "runs" / "a.safetensors")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    spec = AttentionSpec.parse(f"qk/softmax/dna:{path}")
    assert str(spec) == f"qk/softmax/dna:{path}@{digest}"
    assert AttentionSpec.parse(str(spec)) == spec
    recorded = str(spec)
    _adapter(tiny_clip, path, alpha=0.1)  # the file changes: a recorded spec no longer matches it
    with pytest.raises(ValueError, match="changed since it was recorded"):
        AttentionSpec.parse(recorded)
    path.unlink()  # read back on a machine without the file: still parses (report), fails only when run
    assert str(AttentionSpec.parse(recorded)) == recorded
    with pytest.raises(ValueError, match="not found"):
        AttentionSpec.parse(f"qk/softmax/dna:{path}")


def test_spec_equals_the_converted_model_and_changes_nothing(tiny_clip, tmp_path):
    path = _adapter(tiny_clip, tmp_path / "a.safetensors")
    x = torch.randn(2, 3, 64, 96)
    converted = copy.deepcopy(tiny_clip)
    apply_adapter(converted, path)  # open_clip's own block forward calling DenoisingAttention
    want = converted.encode_dense(x)
    got = tiny_clip.encode_dense(x, f"qk/softmax/dna:{path}")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert (tiny_clip.encode_dense(x) - want).abs().max() > 1e-3  # the adapter matters
    assert all(type(b.attn) is torch.nn.MultiheadAttention for b in tiny_clip.visual.transformer.resblocks)


def test_negative_branch_adds_to_another_positive_attention(tiny_clip, tmp_path):
    zero = _adapter(tiny_clip, tmp_path / "zero.safetensors", alpha=0.0)
    x = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(tiny_clip.encode_dense(x, f"qq+kk/softmax/dna:{zero}"), tiny_clip.encode_dense(x, "sclip"), atol=1e-6, rtol=0)
    # ClearCLIP's last block with the adapter's branch, written out: q-q softmax + alpha softmin(Q- K) V-,
    # out_proj, no residual, no FFN; the adapter's other block (1) runs DnA inside CLIP's own block
    path = _adapter(tiny_clip, tmp_path / "a.safetensors")
    got = tiny_clip.encode_dense(x, f"qq/softmax/nores/noffn/dna:{path}")
    t = load_file(str(path))
    v = tiny_clip.visual
    blocks = v.transformer.resblocks
    with torch.no_grad():
        tokens = v.conv1(x).flatten(2).transpose(1, 2)
        tokens = v.ln_pre(torch.cat([v.class_embedding.view(1, 1, -1), tokens], 1) + v.positional_embedding)
        tokens = blocks[0](tokens)
        converted = copy.deepcopy(tiny_clip)
        apply_adapter(converted, path)
        tokens = converted.visual.transformer.resblocks[1](tokens)
        blk = blocks[2]
        u = blk.ln_1(tokens)[0]
        W, b = blk.attn.in_proj_weight, blk.attn.in_proj_bias
        q, k, val = u @ W[:96].T + b[:96], u @ W[96:192].T + b[96:192], u @ W[192:].T + b[192:]
        qn = u @ t["blocks.2.q_neg.weight"].T + t["blocks.2.q_neg.bias"]
        vn = u @ t["blocks.2.v_neg.weight"].T + t["blocks.2.v_neg.bias"]
        heads = []
        for h in range(3):
            s = slice(32 * h, 32 * (h + 1))
            pos = torch.softmax(q[:, s] @ q[:, s].T / math.sqrt(32), -1) @ val[:, s]
            neg = torch.softmax(-(qn[:, s] @ k[:, s].T) / math.sqrt(32), -1) @ vn[:, s]
            heads.append(pos + t["blocks.2.alpha"][h] * neg)
        out = blk.attn.out_proj(torch.cat(heads, 1))
        want = F.normalize(v.ln_post(out[1:]) @ v.proj, dim=-1).reshape(4, 4, -1)
    torch.testing.assert_close(got[0], want, atol=2e-5, rtol=1e-4)


def _rewrite_meta(path: Path, out: Path, **changes) -> Path:
    meta = {**load_adapter(path).meta, **changes}
    save_file(load_file(str(path)), str(out), metadata=meta)
    return out


def test_eval_with_an_adapter_and_the_mismatch_error(tiny_clip, tmp_path):
    make_benchmark("ade20k", tmp_path / "data", n=2, size=(48, 64))
    path = _adapter(tiny_clip, tmp_path / "a.safetensors")
    args = ["eval", "--dataset", "ade20k", "--root", str(tmp_path / "data"), "--model", TINY_CONFIG, "--pretrained", "none",
            "--device", "cpu", "--templates", "single", "--resolution", "64", "--window", "0"]
    runner = CliRunner()
    r = runner.invoke(app, [*args, "--attn", f"qk/softmax/dna:{path}", "--out", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    assert json.loads((tmp_path / "r.json").read_text())["config"]["attention"].endswith(f"dna:{path}@{digest}")
    bad = _rewrite_meta(path, tmp_path / "b.safetensors", heads="12")
    r = runner.invoke(app, [*args, "--attn", f"qq+kk/softmax/dna:{bad}"])
    assert r.exit_code == 2 and "trained for heads '12'" in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    r = runner.invoke(app, [*args, "--attn", f"qk/softmax/dna:{tmp_path / 'missing.safetensors'}"])
    assert r.exit_code == 2 and "not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1
