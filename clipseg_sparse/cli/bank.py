"""`clipseg-sparse bank build` / `bank info`: image banks for region retrieval (CorrCLIPv2, `segment/bank.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (
    Device,
    DeviceOpt,
    ModelOpt,
    Precision,
    PrecisionOpt,
    PretrainedOpt,
    ProxyWeightsOpt,
    check_out,
    fail,
    load_model,
    note,
    open_resources,
    out_console,
    user_errors,
)

bank_app = typer.Typer(help="Image banks for region retrieval (CorrCLIPv2's memory bank; --bank on segment, eval and sweep).", no_args_is_help=True)


@bank_app.command("build", no_args_is_help=True)
@user_errors()
def build(
    inputs: Annotated[list[Path], typer.Argument(help="Image files and/or folders (searched recursively): the unlabeled images of the bank.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="The bank folder (created; an unfinished build there is resumed).")],
    regions: Annotated[str, typer.Option("--regions", help="Region masks per image: a folder with one png/npy/npz per image, named like it, or sam2 (any region source --regions takes).")],
    model: ModelOpt = "ViT-B-16",
    pretrained: PretrainedOpt = "openai",
    aux_model: Annotated[Optional[str], typer.Option("--aux-model", help="A second CLIP whose values are stored by the same region ids (CorrCLIPv2's DFN: ViT-B-16 with --aux-pretrained dfn2b).")] = None,
    aux_pretrained: Annotated[str, typer.Option("--aux-pretrained", help="Weights of --aux-model (open_clip tag, checkpoint file or none).")] = "openai",
    keys: Annotated[str, typer.Option("--keys", help="The dense backbone whose whole-image features are the keys (`ls backbones`, kind dense).")] = "c_radio_v3_l",
    values_attn: Annotated[Optional[str], typer.Option("--values-attn", help="Attention spec of the values' pixel features (default: the corrclipv2-values preset for the model's depth).")] = None,
    resolution: Annotated[int, typer.Option("--resolution", help="Short side of the values' network input (published 448).")] = 448,
    window: Annotated[int, typer.Option("--window", help="Values' sliding-window side (published 336).")] = 336,
    stride: Annotated[int, typer.Option("--stride", help="Values' sliding-window stride (published 112).")] = 112,
    index: Annotated[str, typer.Option("--index", help="FAISS index: auto (flat below 20000 regions, else IVF-PQ), flat, or ivfpq (the published nlist 8 sqrt(N), m 32, 8 bits).")] = "auto",
    device: DeviceOpt = Device.auto,
    precision: PrecisionOpt = Precision.fp32,
    proxy_weights: ProxyWeightsOpt = "auto",
) -> None:
    """Build an image bank: per region of every image a key (region mean of --keys' whole-image features)
    and a value per CLIP (L2 region mean of its pixel features). Resumable: run the same command again
    after a stop (a kill loses at most the image in flight); an image that cannot be read is skipped with a
    note, listed in the manifest and tried again by a re-run. Several processes:
    `torchrun --nproc-per-node N -m clipseg_sparse bank build ...` shards the images."""
    from ..attention import resolve_spec
    from ..files.inputs import discover_images
    from ..models.backbones import BACKBONES
    from ..models.proxies import ProxyBackbones
    from ..runtime.distributed import init_from_env
    from ..segment import InferenceSettings
    from ..segment.bank import BUILDER_SETTINGS, INDEX_KINDS, ValueModel, build_bank
    from ..segment.resources import missing_regions

    check_out(out, folder=True)
    if index not in INDEX_KINDS:
        fail(f"--index {index}: choose {', '.join(INDEX_KINDS)}")
    if keys not in BACKBONES or BACKBONES.get(keys).kind != "dense":
        dense = [n for n in BACKBONES.names() if BACKBONES.get(n).kind == "dense"]
        fail(f"--keys {keys}: not a dense backbone; choose {', '.join(dense)}")
    found = discover_images(inputs, out)
    if not found.jobs:
        fail("no images found in the inputs")
    jobs = [(job.source, str(job.rel)) for job in found.jobs]
    settings = InferenceSettings(**{**BUILDER_SETTINGS, "resolution": resolution, "window": window, "stride": stride})
    if regions is None:
        fail(missing_regions("bank build"))
    source = open_resources([], device, [name for _, name in jobs], regions=regions).regions
    init_from_env()
    clips = [load_model(model, pretrained, device, precision)]
    if aux_model:
        clips.append(load_model(aux_model, aux_pretrained, device, precision))
    # each CLIP's values read the backbones through its own normalisation; all loaded before any image
    values = [ValueModel(c, resolve_spec(values_attn or _values_preset(c)), settings, ProxyBackbones.following(c, proxy_weights)) for c in clips]
    for v in values:
        v.clip.check_spec(v.spec)
        v.backbones.share(values[0].backbones)  # DINO loaded once for both CLIPs
        for name in v.spec.needs.backbones:
            v.backbones.get(name, v.clip.device)
    key_backbones = values[0].backbones
    key_backbone = key_backbones.get(keys, clips[0].device)
    manifest = build_bank(jobs, out, values, key_backbone, key_backbones.config([keys])[keys], source, _source_text(source, regions), index, progress=True, note=note)
    _print_manifest(out, manifest)


def _values_preset(clip) -> str:
    """The published builder's values spec for the model's depth (12 blocks: 6..10, 24: 11..22)."""
    return "corrclipv2-l14-values" if len(clip.visual.transformer.resblocks) == 24 else "corrclipv2-values"


def _source_text(source, given: str) -> str:
    return source.source() if hasattr(source, "source") else given


@bank_app.command("info", no_args_is_help=True)
@user_errors()
def info(bank: Annotated[Path, typer.Argument(help="A bank folder made by `bank build`.", show_default=False)]) -> None:
    """What a bank holds: images, regions, the key backbone and value CLIPs with their weights and settings,
    the index and the content hash that result files record."""
    from ..segment.bank import ImageBank

    opened = ImageBank.open(bank)
    _print_manifest(bank, opened.manifest)


def _print_manifest(path: Path, manifest: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    keys = manifest["keys"]
    table = Table("field", "value", title=f"bank {path}")
    table.add_row("content hash", manifest["hash"])
    table.add_row("images", str(len(manifest["images"])))
    if manifest.get("skipped"):
        skipped = manifest["skipped"]
        table.add_row("skipped (unreadable)", f"{len(skipped)}: {', '.join(skipped[:5])}{', ...' if len(skipped) > 5 else ''}")
    table.add_row("regions (rows)", str(manifest["rows"]))
    table.add_row("keys", f"{keys['backbone']} ({keys.get('timm')}, weights {keys.get('weights')}, {keys.get('precision')})")
    for store in manifest["values"]:
        s = store["settings"]
        table.add_row("values", escape(f"{store['clip']} ({store['dim']}-d, {store['precision']}): {store['spec']} at {s['resolution']} px, windows {s['window']}/{s['stride']}, resize {s.get('resize')}, positions {s.get('pos_interp')}"))  # the spec's [..] is not markup
    table.add_row("regions from", str(manifest["regions"]))
    table.add_row("index", f"{manifest['index']} ({manifest['index_kind']})")
    out_console().print(table)
