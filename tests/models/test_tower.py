"""The model-family seam: `models.tower.FAMILIES` (one file per family in `models/families/`), the `Tower` that
`DenseCLIP` holds, and the block contract the engine reads (`attention.contract`)."""

from __future__ import annotations

import ast
import json
import shutil
import sys
import textwrap
from pathlib import Path

import open_clip
import pytest
import torch
import torch.nn as nn

from clipseg_sparse.attention import resolve_spec
from clipseg_sparse.attention.contract import grid_block, is_block
from clipseg_sparse.models.tower import FAMILIES, Tower, model_family
from conftest import DATA, TINY_CONFIG

PACKAGE = Path(__file__).parents[2] / "clipseg_sparse"
CAPTURED = json.loads((DATA / "ls_models.json").read_text(encoding="utf-8"))
# the smallest open_clip configuration of each family that runs (the protocol test builds each on the meta device)
EXAMPLES = {
    "CLIP ViT": "ViT-B-32", "MetaCLIP 2": "ViT-H-14-worldwide", "EVA-02": "EVA02-B-16", "EVA-01": "EVA01-g-14",
    "PE-Core": "PE-Core-T-16-384", "SigLIP": "ViT-B-16-SigLIP", "SigLIP 2": "ViT-B-16-SigLIP2", "timm ViT": "vit_medium_patch16_gap_256",
}  # fmt: skip


def test_ls_models_is_unchanged_for_every_open_clip_configuration():
    """`ls models` as captured before the families moved into files: every configuration keeps its family, tower
    kind, verdict and tags or reason (configurations other tests add are not in the capture)."""
    from clipseg_sparse.cli.ls import models_table

    assert open_clip.__version__ == CAPTURED["open_clip"], "recapture tests/data/ls_models.json for this open_clip"
    assert set(CAPTURED["models"]) <= set(open_clip.list_models())
    table = models_table()
    rows = {row[0]: row[1:] for row in zip(*(column._cells for column in table.columns))}
    for name, (family, tower, dense, last) in CAPTURED["models"].items():
        found = model_family(name, open_clip.get_model_config(name))
        assert (found.name, found.tower, found.reason is None) == (family, tower, dense == "yes"), name
        assert rows[name] == (family, dense, last), name
        assert found.name in FAMILIES, f"{name}: family {found.name!r} is not a registered name"


def _meta_model(name: str) -> nn.Module:
    """open_clip model `name`'s image tower on the meta device (no memory, no numbers), in a holder as `.visual`."""
    from open_clip.model import _build_vision_tower

    cfg = open_clip.get_model_config(name)
    with torch.device("meta"):
        visual = _build_vision_tower(cfg["embed_dim"], cfg["vision_cfg"])
    visual.preprocess_cfg = {"mean": (0.5,) * 3, "std": (0.5,) * 3}
    holder = nn.Module()
    holder.visual = visual
    return holder


def test_every_family_that_runs_wraps_a_tower_with_the_protocol_members():
    """Each running family's `wrap` gives a `Tower` (every member present) whose blocks meet the block contract;
    timm towers' blocks bring their own q/k/v and grid forward (`GridBlock`), open_clip's do not."""
    running = {f.name for f in (model_family(n, open_clip.get_model_config(n)) for n in CAPTURED["models"]) if f.wrap}
    assert running == set(EXAMPLES), "add the smallest configuration of a new family to EXAMPLES"
    for family, name in EXAMPLES.items():
        found = model_family(name, open_clip.get_model_config(name))
        assert found.name == family
        tower = found.wrap(_meta_model(name))
        assert isinstance(tower, Tower), family
        blocks = tower.visual.transformer.resblocks
        assert len(blocks) and all(is_block(b) for b in blocks), family
        assert all((grid_block(b) is None) == (family in ("CLIP ViT", "MetaCLIP 2")) for b in blocks), family
        assert tower.prefix_tokens == (0 if "SigLIP" in family or family == "timm ViT" else 1), family
        assert tower.embed_dim == open_clip.get_model_config(name)["embed_dim"], family
        assert tower.refuse(resolve_spec("sclip"), name) is None


PLUGIN = '''
    """A family of another package: the tiny test ViT under the name `tiny-seam`, with a tower counting its embeds."""
    from clipseg_sparse.models.families.openclip_vit import OpenClipViT
    from clipseg_sparse.models.tower import Family, register_family


    class CountingViT(OpenClipViT):
        embeds = 0

        def embed(self, pixels, rule):
            CountingViT.embeds += 1
            return super().embed(pixels, rule)


    def match(name, config):
        return Family("Tiny seam", "open_clip VisionTransformer, counted", wrap=CountingViT.of) if name == "tiny-seam" else None


    register_family("Tiny seam", match, help="a test's family")
'''


@pytest.fixture
def plugin_family(tmp_path, monkeypatch):
    """A family file of a test's own, registered after the built-ins as a plug-in's would be; the registry and
    open_clip's configurations are restored afterwards."""
    import importlib

    import open_clip.factory as factory

    FAMILIES.names()  # the built-ins first
    for attr in ("_items", "_help", "_where"):
        monkeypatch.setattr(FAMILIES, attr, dict(getattr(FAMILIES, attr)))
    monkeypatch.setattr(factory, "_MODEL_CONFIGS", dict(factory._MODEL_CONFIGS))
    monkeypatch.setattr(factory, "_MODEL_CONFIG_PATHS", list(factory._MODEL_CONFIG_PATHS))
    (tmp_path / "seam_family.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "seam_family", raising=False)
    module = importlib.import_module("seam_family")
    shutil.copy(TINY_CONFIG, tmp_path / "tiny-seam.json")
    return module, tmp_path / "tiny-seam.json"


def test_a_family_registered_from_another_module_is_found_by_model_family_and_load_clip(plugin_family, tiny_clip):
    """A plug-in family comes before the catch-alls (`CLIP ViT` would match its config too): `model_family`
    names it, `load_clip` wraps the model with its tower, and its numbers are the open_clip tower's own."""
    from clipseg_sparse import load_clip

    module, config = plugin_family
    assert FAMILIES.where("Tiny seam") == "seam_family"
    clip = load_clip(str(config), pretrained=None, device="cpu")
    assert model_family("tiny-seam", open_clip.get_model_config("tiny-seam")).name == "Tiny seam"
    assert type(clip.tower) is module.CountingViT and clip.visual is clip.model.visual
    pixels = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(0))
    before = module.CountingViT.embeds
    assert torch.equal(clip.encode_dense(pixels, "sclip"), tiny_clip.encode_dense(pixels, "sclip"))
    assert module.CountingViT.embeds == before + 1
    assert model_family("tiny-vit", open_clip.get_model_config("tiny-vit")).name == "CLIP ViT"


def test_dense_clip_built_directly_wraps_its_model_by_name(tiny_clip):
    """`DenseCLIP(model=..., model_name=...)` without a tower gets its family's, as `load_clip` gives it; a refused
    family is a one-line user error."""
    from clipseg_sparse.errors import UserValueError
    from clipseg_sparse.models.clip import DenseCLIP
    from clipseg_sparse.models.families.openclip_vit import OpenClipViT

    again = DenseCLIP(model=tiny_clip.model, tokenizer=tiny_clip.tokenizer, model_name=tiny_clip.model_name, pretrained="none")
    assert type(again.tower) is OpenClipViT and again.visual is tiny_clip.visual and again == tiny_clip
    with pytest.raises(UserValueError, match="'RN50' is not supported: its image tower is a ResNet"):
        DenseCLIP(model=tiny_clip.model, tokenizer=None, model_name="RN50", pretrained="none")


def _imports(path: Path, module: str) -> set[str]:
    """Modules of the package that `module` (its file `path`) imports, at module level or inside functions."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            prefix = ".".join(base + ([node.module] if node.module else []))
            found |= {prefix} | {f"{prefix}.{a.name}" for a in node.names}
    return found


def test_no_import_cycle_in_the_package_function_level_imports_included():
    """The import graph of the package's modules (every `import` statement, also those inside functions; a module's
    imports of its own parent packages left out) has no cycle: lazy imports may keep `--help` fast, not close a loop."""
    files = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in PACKAGE.rglob("*.py")}
    graph = {m: {t for t in _imports(p, m) if t in files and t != m and not m.startswith(t + ".")} for m, p in files.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
