"""The papers' numbers as data: their shape and citations, and which result files they are compared with."""

import json
import re

import pytest

from clipseg_sparse.datasets import DATASETS
from clipseg_sparse.evaluation.protocols import PROTOCOLS
from clipseg_sparse.evaluation.published import EIGHT, PUBLISHED, comparison, published_for_preset, register_published
from clipseg_sparse.evaluation.segmentation import evaluate
from fake_benchmarks import make_benchmark

# a repository file (owner/repo[@commit] path.ext) or a paper by arXiv id with its table
CITATION = re.compile(r"[\w.-]+/[\w.-]+(@[0-9a-f]{7,40})? \S+\.(png|md|jpg)|arXiv \d{4}\.\d{4,5}\)? Table \d")


@pytest.mark.parametrize("name", PUBLISHED.names())
def test_every_entry_has_known_benchmarks_a_citation_and_its_printed_average(name):
    entry = PUBLISHED.get(name)
    assert entry.protocol in PROTOCOLS and set(entry.miou) <= set(DATASETS.names())
    assert all(0 < v < 100 for v in entry.miou.values())
    assert CITATION.search(entry.source), entry.source
    if entry.printed_average is not None:  # the typed cells give the table's own average (each cell rounded to 0.05)
        assert entry.average == pytest.approx(entry.printed_average, abs=0.1)
    else:  # a partial row (GEM's five sets)
        assert entry.average is None


def test_the_big_tables_are_in():
    """The rows every 2025-26 comparison table prints (Trident's, OV-Stitcher's, ActiveSAM's Table 1)."""
    averages = {n: round(PUBLISHED.get(n).average, 1) for n in ("sclip", "clearclip", "proxyclip", "trident", "corrclip", "ovstitcher", "segearth-ov3")}
    assert averages == {"sclip": 38.2, "clearclip": 38.1, "proxyclip": 42.3, "trident": 45.8, "corrclip": 48.7, "ovstitcher": 50.7, "segearth-ov3": 63.9}
    assert PUBLISHED.get("corrclip-metaclip").clip == "ViT-B-16-quickgelu:metaclip_fullcc"


def test_a_bad_entry_is_refused():
    with pytest.raises(ValueError, match="unknown benchmark"):
        register_published(PROTOCOLS.get("sclip"), {"voc22": 50.0}, "x/y z.png")
    with pytest.raises(ValueError, match="outside"):
        register_published(PROTOCOLS.get("sclip"), {"voc21": 500.0}, "x/y z.png")


@pytest.fixture(scope="module")
def sclip_result(tiny_clip, tmp_path_factory):
    """The config of a real `eval --protocol sclip` result file (a tiny random CLIP, so its weights are then
    set to the paper's: everything else is what an eval run records)."""
    root = tmp_path_factory.mktemp("voc")
    make_benchmark("voc21", root, n=1, size=(60, 80))
    out = root / "result.json"
    evaluate(tiny_clip, "voc21", root, protocol="sclip", class_names=None, templates="single", progress=False, out=out)
    config = json.loads(out.read_text())["config"]
    return {**config, "model": "ViT-B-16", "pretrained": "openai"}


def test_a_real_eval_record_of_the_protocol_gets_the_papers_number(sclip_result):
    found = comparison(sclip_result, 60.0)
    assert found is not None and found.entry.protocol == "sclip"
    assert found.published == 59.1 and found.delta == pytest.approx(0.9) and found.beyond and not found.limited
    assert not comparison(sclip_result, 59.3).beyond  # within the default 0.5
    assert comparison(sclip_result, 60.0, tolerance=1.0).beyond is False


def test_the_entmax_run_of_the_preset_is_compared_with_the_papers_softmax_number(sclip_result):
    entmax = sclip_result["attention"].replace("/softmax", "/entmax:1.5")
    assert entmax != sclip_result["attention"]
    assert comparison({**sclip_result, "attention": entmax}, 61.0).delta == pytest.approx(1.9)


@pytest.mark.parametrize(
    "change",
    [
        {"resolution": 448},  # another setting
        {"logit_scale": 100.0},
        {"pretrained": "laion2b_s34b_b88k"},  # other weights
        {"class_names": "plain"},
        {"attention": "kk/softmax/noffn"},  # another spec
        {"protocol": "clearclip"},
        {"protocol": "not-a-protocol"},
    ],
)
def test_a_run_that_differs_from_the_published_one_gets_no_number(sclip_result, change):
    assert comparison({**sclip_result, **change}, 60.0) is None


def test_a_limited_run_is_compared_but_never_marked(sclip_result):
    found = comparison({**sclip_result, "limit": 5}, 20.0)
    assert found.limited and not found.beyond and found.delta == pytest.approx(20.0 - 59.1)


def test_a_weights_variant_of_the_protocol_finds_its_own_row(sclip_result):
    """`trident` with MetaCLIP weights is the `trident-metaclip` row (the protocols differ only in the CLIP)."""
    trident = PROTOCOLS.get("trident")
    config = {"protocol": "trident", "dataset": "voc21", "model": "ViT-B-16-quickgelu", "pretrained": "metaclip_fullcc",
              "attention": str(trident.spec_for("voc21")), "class_names": trident.class_names}  # fmt: skip
    assert comparison(config, 70.0).entry.protocol == "trident-metaclip"
    assert comparison({**config, "model": "ViT-B-16", "pretrained": "openai"}, 70.0).entry.protocol == "trident"


def test_presets_find_their_papers():
    assert [e.protocol for e in published_for_preset("trident")] == ["trident", "trident-metaclip", "trident-laion-h14"]
    assert [e.protocol for e in published_for_preset("sclip-entmax")] == ["sclip"]
    assert published_for_preset("clip") == []
    assert set(EIGHT) <= set(DATASETS.names())


def test_the_tolerance_options_help_states_the_default_reports_use():
    from clipseg_sparse.cli.sweep import TolOpt
    from clipseg_sparse.evaluation.published import TOLERANCE

    assert f"(default {TOLERANCE:g})" in TolOpt.__metadata__[0].help
