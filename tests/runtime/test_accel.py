"""The optional AdaSplash (CUDA) attention backend: switch logic everywhere, exactness where CUDA exists."""

import entmax as entmax_pkg
import pytest
import torch

from clipseg_sparse.runtime.accel import adasplash_installed, attention_backend, can_use_adasplash, get_attention_backend
from clipseg_sparse.attention import AttentionSpec, _attend
from clipseg_sparse.attention.normalizers import entmax

ALPHAS = [1.1, 1.25, 1.5, 1.75, 2.0]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
adasplash = pytest.mark.skipif(
    not (torch.cuda.is_available() and adasplash_installed()), reason="needs a CUDA GPU and `pip install .[cuda]`"
)


def _qkv(device="cpu", dtype=torch.float32, n=197, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, n, d, generator=g).to(device=device, dtype=dtype) for _ in range(3)]


def test_backend_switch_is_scoped_and_validated():
    assert get_attention_backend() == "torch"
    with attention_backend("adasplash"):
        assert get_attention_backend() == "adasplash"
    assert get_attention_backend() == "torch"
    with pytest.raises(ValueError, match="backend"):
        with attention_backend("cudnn"):
            pass


def test_adasplash_backend_falls_back_where_the_kernel_cannot_run():
    q, k, v = _qkv()
    spec = AttentionSpec.parse("qq/entmax:1.5")
    with attention_backend("adasplash"):
        assert not can_use_adasplash(q, has_prior=False)  # CPU tensors
        switched = _attend(q, k, v, spec, (14, 14))
    assert torch.equal(switched, _attend(q, k, v, spec, (14, 14)))


def test_selected_backend_is_part_of_the_result_config(tiny_clip):
    """AdaSplash is only as exact as its iterations: a result must say which backend made it."""
    from clipseg_sparse import Segmenter

    seg = Segmenter(tiny_clip, "a,b", templates="single")
    assert seg.config()["attention_backend"] == "torch"
    with attention_backend("adasplash"):
        assert seg.config()["attention_backend"] == "adasplash"


@cuda
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("peaked", [False, True])
def test_fast_entmax_exact_on_cuda(alpha, peaked):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 257, 257, generator=g) * (0.5 if peaked else 3.0)
    if peaked:
        x[..., :3] += 8.0
    ref = entmax_pkg.entmax_bisect(x.double(), alpha=alpha, n_iter=200).float()
    out = entmax(x.cuda(), alpha).cpu()
    assert (out - ref).abs().max() <= 1e-5


@adasplash
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 5e-2)])
def test_adasplash_attention_matches_exact_dense(alpha, dtype, tol):
    q, k, v = _qkv("cuda", dtype)
    spec = AttentionSpec.parse(f"qq/entmax:{alpha}/temp:0.2")
    with attention_backend("adasplash"):
        assert can_use_adasplash(q, has_prior=False)
        fused = _attend(q, k, v, spec, (14, 14)).float()
    # reference: our exact entmax (checked against the entmax package above) on fp32 scores
    scores = (q.float() @ q.float().transpose(-2, -1)) * 0.2
    ref = entmax(scores, alpha) @ v.float()
    assert (fused - ref).abs().max() <= tol
