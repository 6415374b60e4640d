import entmax as entmax_pkg
import pytest
import torch

from clipseg_sparse.attention.normalizers import Normalizer, entmax, entmax_shift, normalize, random_mask_softmax

ALPHAS = [1.1, 1.25, 1.5, 1.75, 2.0]


def _inputs():
    g = torch.Generator().manual_seed(0)
    random = torch.randn(64, 197, generator=g) * 3
    peaked = torch.randn(64, 197, generator=g) * 0.5
    peaked[:, :3] += 8.0
    flat = torch.randn(64, 197, generator=g) * 0.05
    return {"random": random, "peaked": peaked, "flat": flat}


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("kind", ["random", "peaked", "flat"])
def test_entmax_matches_package(alpha, kind):
    x = _inputs()[kind]
    ref = entmax_pkg.entmax_bisect(x.double(), alpha=alpha, n_iter=200).float()
    out = normalize(x, f"entmax:{alpha}")
    assert (out - ref).abs().max() <= 1e-5
    assert torch.allclose(out.sum(-1), torch.ones(64), atol=1e-5)


def test_entmax_k_independent_when_support_is_large():
    # flat rows have supports far larger than k, which forces the full-row fallback
    x = _inputs()["flat"]
    for k in (2, 8, 197):
        assert torch.allclose(entmax(x, 1.75, k=k), entmax(x, 1.75, k=300), atol=1e-6)


def test_closed_forms():
    x = _inputs()["random"]
    assert (normalize(x, "entmax:2") - entmax_pkg.sparsemax(x, dim=-1)).abs().max() <= 1e-6
    assert (normalize(x, "sparsemax") - entmax_pkg.sparsemax(x, dim=-1)).abs().max() <= 1e-6
    assert (normalize(x, "entmax:1.5") - entmax_pkg.entmax15(x, dim=-1)).abs().max() <= 1e-6


def test_alpha_to_one_is_softmax():
    x = _inputs()["random"]
    assert torch.equal(normalize(x, "entmax:1"), torch.softmax(x, -1))
    near = normalize(x, "entmax:1.001")
    assert (near - torch.softmax(x, -1)).abs().max() < 5e-3
    # sparsity grows with alpha
    nnz = [(normalize(x, f"entmax:{a}") > 0).sum().item() for a in ALPHAS]
    assert nnz == sorted(nnz, reverse=True) and nnz[0] > nnz[-1]


def test_neg_inf_and_equal_rows():
    x = torch.randn(4, 10)
    x[:, 3:7] = float("-inf")
    for name in ["softmax", "entmax:1.3", "entmax:1.5", "sparsemax"]:
        p = normalize(x, name)
        assert not torch.isnan(p).any()
        assert torch.all(p[:, 3:7] == 0)
        assert torch.allclose(p.sum(-1), torch.ones(4), atol=1e-6)
    eq = torch.full((3, 7), 2.5)
    for name in ["entmax:1.25", "entmax:1.5", "sparsemax"]:
        assert torch.allclose(normalize(eq, name), torch.full((3, 7), 1 / 7), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    x = _inputs()["random"]
    for name in ["softmax", "entmax:1.5", "entmax:1.25", "sparsemax"]:
        p = normalize(x.to(dtype), name)
        assert p.dtype == dtype
        assert not torch.isnan(p).any()
        # same rows as the fp32 solve of the rounded input, up to output rounding
        assert (p.float() - normalize(x.to(dtype).float(), name)).abs().max() < 1e-2


def test_dim_argument():
    x = torch.randn(5, 9, 4)
    assert torch.allclose(normalize(x, "entmax:1.5", dim=1), normalize(x.transpose(1, 2), "entmax:1.5").transpose(1, 2))


def test_gradients_fall_back_to_package():
    x = torch.randn(3, 6, requires_grad=True)
    normalize(x, "entmax:1.3").pow(2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_randmask_matches_entmax_sparsity():
    x = _inputs()["random"]
    g = torch.Generator().manual_seed(1)
    p = random_mask_softmax(x, 1.5, generator=g)
    assert torch.equal((p > 0).sum(-1), (entmax(x, 1.5) > 0).sum(-1))
    assert torch.all(p.gather(-1, x.argmax(-1, keepdim=True)) > 0)
    assert torch.allclose(p.sum(-1), torch.ones(64), atol=1e-5)


def test_randmask_is_reproducible_whatever_the_global_rng():
    """The mask must not depend on how many images ran before (resume) or on the process's RNG state."""
    x = _inputs()["random"]
    first = normalize(x, "randmask:1.5")
    torch.rand(7)  # any other use of the global RNG in between
    assert torch.equal(normalize(x, "randmask:1.5"), first)
    other = random_mask_softmax(x, 1.5, generator=torch.Generator().manual_seed(123))
    assert not torch.equal(other, first)  # still random: another seed gives another mask


@pytest.mark.parametrize(
    "text,canonical",
    [("softmax", "softmax"), ("entmax:1.5", "entmax:1.5"), ("entmax:2", "sparsemax"), ("entmax:1.0", "softmax"),
     ("SPARSEMAX", "sparsemax"), ("randmask:1.25", "randmask:1.25")],
)
def test_parse(text, canonical):
    assert str(Normalizer.parse(text)) == canonical


@pytest.mark.parametrize("bad", ["entmax", "entmax:0.5", "entmax:2.5", "entmax:x", "gumbel", "softmax:2", "randmask:1"])
def test_parse_errors(bad):
    with pytest.raises(ValueError):
        Normalizer.parse(bad)


def _attention_like(seed=0, n=785):
    """Rows as wide as ViT-B/16 at 448 px: a mix of spread rows and rows peaked on a few tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, n, generator=g) * 3
    x[12:] = torch.randn(12, n, generator=g) * 0.5
    x[12:, :4] += torch.tensor([9.0, 8.5, 8.0, 2.0])
    return x


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("k", [1, 4, 64, 1000])
def test_entmax_exact_whatever_k(alpha, k):
    # small k pushes rows whose candidate set exceeds k onto the whole-row path, in the same call as the
    # rows that fit; the answer must not change
    x = _attention_like()
    ref = entmax_pkg.entmax_bisect(x.double(), alpha=alpha, n_iter=200).float()
    out = entmax(x, alpha, k=k)
    assert (out - ref).abs().max() <= 1e-5
    support = (ref > 0).sum(-1)
    if k == 4 and alpha <= 1.5:
        assert (support > k).any()  # the case this test exists for really happens


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_package(alpha, dtype):
    x = _attention_like(1).to(dtype)
    ref = entmax_pkg.entmax_bisect(x.double(), alpha=alpha, n_iter=200)
    out = entmax(x, alpha)
    assert out.dtype == dtype
    # exact up to rounding the output to the half type (relative 2^-11 for fp16, 2^-8 for bf16)
    assert ((out.double() - ref).abs() <= 1e-5 + ref.abs() * torch.finfo(dtype).eps).all()


def test_shift_solves_the_normalisation_equation():
    x = _attention_like(2)
    for alpha in ALPHAS:
        c = entmax_shift(x, alpha)
        mass = torch.clamp(1 + (alpha - 1) * (x.double() - c.double()), min=0).pow(1 / (alpha - 1)).sum(-1)
        assert torch.allclose(mass, torch.ones(24, dtype=torch.float64), atol=1e-5)


def test_row_without_finite_scores_is_nan_like_softmax():
    x = torch.randn(3, 8)
    x[1] = float("-inf")
    for name in ["softmax", "entmax:1.5", "entmax:1.2", "sparsemax"]:
        p = normalize(x, name)
        assert torch.isnan(p[1]).all() and not torch.isnan(p[[0, 2]]).any()


def test_input_with_no_finite_row_at_all_is_nan_like_softmax():
    """Every row -inf (or NaN): the candidate block has no column; still NaN rows, not an IndexError."""
    for fill in (float("-inf"), float("nan")):
        x = torch.full((2, 5), fill)
        for name in ["softmax", "entmax:1.5", "entmax:1.2", "sparsemax"]:
            assert torch.isnan(normalize(x, name)).all(), (fill, name)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_entmax_solved_in_blocks_of_rows_is_exact(alpha, monkeypatch):
    # blocks of 8 rows: one all flat rows (solved whole), one all peaked (candidates gathered), one with
    # a single flat row among peaked ones (both solvers in one block), a -inf row inside a block
    import clipseg_sparse.attention.normalizers as normalizers

    x = _attention_like(3)[12:].repeat(3, 1)  # 36 peaked rows
    g = torch.Generator().manual_seed(4)
    x[:8] = torch.randn(8, x.shape[1], generator=g) * 0.05
    x[17] = torch.randn(x.shape[1], generator=g) * 0.05
    x[29] = float("-inf")
    whole = entmax(x, alpha, k=8)
    monkeypatch.setattr(normalizers, "BLOCK_ELEMENTS", 8 * x.shape[1])
    out = entmax(x, alpha, k=8)
    finite = torch.arange(36) != 29
    ref = entmax_pkg.entmax_bisect(x[finite].double(), alpha=alpha, n_iter=200).float()
    assert (out[finite] - ref).abs().max() <= 1e-5
    assert torch.isnan(out[29]).all()
    assert torch.allclose(out[finite], whole[finite], atol=1e-6)
    assert entmax_shift(x[finite], alpha).shape == (35, 1)
