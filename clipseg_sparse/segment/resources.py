"""What a run reads besides the model and the image, in one object: `Resources`.

Region maps (CorrCLIP), an image bank and the other CLIPs of its stores (CorrCLIPv2), a prompt file
(OV-Stitcher's descriptions) and the external backbones with their weights (ProxyCLIP, Trident, LPOSS):
each method's extra input is one field here, opened once by the library, instead of a keyword threaded
through every command and layer. The CLI opens them with `Resources.open` before any model loads (a bad
folder, bank or prompt file fails first); `bind` then checks them against the plan and a loaded model and
loads, before any image, what the run will use (backbones, what stages load themselves, the bank's other
CLIPs). `Segmenter`, `evaluate`, the sweeps, `analyze`, `explain` and the demo take the same object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ..errors import UserValueError
from ..models.backbones import BACKBONES
from ..models.clip import DenseCLIP, load_clip
from ..models.proxies import ProxyBackbones
from .bank import ImageBank, clip_id
from .plan import Plan
from .regions import open_regions
from .vocabulary import Prompts, resolve_prompts

RegionSource = Callable[[np.ndarray, str], np.ndarray]


@dataclass(frozen=True)
class Resources:
    """A run's inputs besides the model and the image (see the module docstring).

    regions: a region source, (rgb, name) -> H x W integer ids (-1 unsegmented) with a `source()` text for
    result files (`regions.RegionFolder`, `regions.Sam2Regions`; one with `for_vocabulary(names)` is given the
    vocabulary's prompt names). bank: an opened image bank (`bank.ImageBank`). prompts: a prompt file
    (`vocabulary.Prompts`). proxy_weights: the weights of the external backbones (`--proxy-weights`; None:
    the CLIP's own choice, `DenseCLIP.proxy_weights`). backbones: loaded backbones to use (None: made when
    bound). bank_clips: loaded CLIPs of the bank's other stores (CorrCLIPv2's DFN; the others are loaded when
    bound, by the manifest's model and weights names)."""

    regions: RegionSource | None = None
    bank: ImageBank | None = None
    prompts: Prompts | None = None
    proxy_weights: str | None = None
    backbones: ProxyBackbones | None = None
    bank_clips: tuple[DenseCLIP, ...] = ()

    @classmethod
    def open(
        cls,
        plans: Plan | Iterable[Plan],
        *,
        regions: str | RegionSource | None = None,
        bank: str | Path | ImageBank | None = None,
        prompts: str | Path | Prompts | None = None,
        proxy_weights: str | None = None,
        names: Sequence[str] = (),
        device: str = "cpu",
        note: Callable[[str], None] | None = None,
        attention: bool = False,
    ) -> "Resources":
        """Open the inputs `plans` read, before any model loads; UserValueError when one of them needs an
        input that is not given (region maps, an image bank), or an input cannot be read. regions: a region
        source, a folder (checked to hold a file for each image of `names`) or a registered generator (sam2,
        sam3); bank: a bank folder; a bank no plan reads is not opened and `note` says so. attention: only
        what the plans' attention reads (`analyze`: the stages after it do not run)."""
        plans = [plans] if isinstance(plans, Plan) else list(plans)
        needs = [_needs(p, attention) for p in plans]
        reader = next((n.regions for n in needs if n.regions), None)
        if regions is None and reader:
            raise UserValueError(missing_regions(reader))
        if isinstance(regions, str):
            regions = open_regions(regions, device, names)
        wants_bank = next((n.bank for n in needs if n.bank), None)
        if bank is not None and not wants_bank:
            if note:
                note(f"--bank {bank} is unused: no retrieval stage runs (preset corrclipv2 has one)")
            bank = None
        if bank is None and wants_bank:
            raise UserValueError(missing_bank(wants_bank))
        if bank is not None and not isinstance(bank, ImageBank):
            bank = ImageBank.open(bank)
        if bank is not None and note and bank.unpublished():
            note(bank.unpublished())
        if proxy_weights is not None and note:
            used = list(dict.fromkeys(b for n in needs for b in n.backbones))
            unused = unused_proxy_weights(proxy_weights, used)
            if unused:
                runs = f"it runs {', '.join(used)}" if used else "it runs no external backbone"
                note(f"--proxy-weights {unused} is not used by {', '.join(str(p.spec) for p in plans)} ({runs}); ignored")
        return cls(regions, bank, resolve_prompts(prompts), proxy_weights)

    def for_model(self, clip: DenseCLIP) -> "Resources":
        """These inputs with backbones made for `clip` (with `proxy_weights`), so runs of several plans
        (`analyze`, `explain`, a sweep) share one set of loaded backbones."""
        return self if self.backbones is not None else dataclasses.replace(self, backbones=self._backbones(clip))

    def _backbones(self, clip: DenseCLIP) -> ProxyBackbones:
        return self.backbones or (ProxyBackbones.following(clip, self.proxy_weights) if self.proxy_weights else clip.proxies)

    def bind(self, plan: Plan, clip: DenseCLIP, names: Sequence[str] = (), attention: bool = False) -> "Resources":
        """These inputs checked against `plan` on `clip` (UserValueError for one the plan needs and lacks; then
        the plan against the model, `Plan.check_model`), those it does not read dropped (they are not recorded), and loaded now what the run will use: the
        backbones (with `proxy_weights`), what its stages load themselves, the bank's other CLIPs (the bank
        checked to hold this CLIP's values). names: the vocabulary's prompt names (a text-prompted region
        source). attention: only what the plan's attention reads (`analyze`)."""
        needs = _needs(plan, attention)
        if needs.regions and self.regions is None:
            raise UserValueError(missing_regions(needs.regions))
        if needs.bank and self.bank is None:
            raise UserValueError(missing_bank(needs.bank))
        plan.check_model(clip)
        regions = self.regions if needs.regions else None
        prompted = getattr(regions, "for_vocabulary", None)  # a text-prompted source (sam3) takes our names
        backbones = self._backbones(clip)
        bank = self.bank if needs.bank else None
        loaded = set()
        for stage in () if attention else plan.stages:
            if stage.load is not None:
                stage.load(backbones, clip.device)
                loaded |= set(stage.backbones)
        for name in [*needs.backbones, *([bank.proxy] if bank is not None else [])]:
            if name not in loaded:
                backbones.get(name, clip.device)
        bank_clips = self.bank_clips
        if bank is not None:
            bank.check(clip, backbones.config([bank.proxy])[bank.proxy])
            given = {clip_id(c): c for c in self.bank_clips}
            for store in bank.manifest["values"]:
                if store["clip"] != clip_id(clip) and store["clip"] not in given:
                    given[store["clip"]] = load_clip(store["model"], store["pretrained"], device=clip.device)
            bank_clips = tuple(given.values())
        return dataclasses.replace(
            self, regions=prompted(names) if prompted else regions, bank=bank, backbones=backbones, bank_clips=bank_clips
        )

    def record(self, plan: Plan) -> dict:
        """What result files record of these inputs (bound): the backbones' tags and weights, the region
        source, the bank's content hash; absent where the run reads none."""
        names = [*plan.backbones, *([self.bank.proxy] if self.bank is not None else [])]
        return {
            **self.backbones.record(list(dict.fromkeys(names))),
            **({"regions": self.regions.source()} if self.regions is not None else {}),
            **({"bank": self.bank.record()} if self.bank is not None else {}),
        }


def unused_proxy_weights(weights: str, used: Sequence[str]) -> str:
    """The part of a --proxy-weights value no backbone in `used` reads ("" when all of it is used): the
    NAME=W items naming other backbones, or the whole value when nothing runs a backbone ("auto": never)."""
    if weights == "auto":
        return ""
    if "=" in weights:
        known = set(BACKBONES.names())  # an unknown name is an error of its own (`ProxyBackbones.resolved_weights`)
        return ",".join(item for item in weights.split(",") if item and item.split("=", 1)[0] in known - set(used))
    return "" if used else weights


def _needs(plan: Plan, attention: bool):
    return plan.spec.attention_needs if attention else plan.needs


def missing_regions(reader: str) -> str:
    return f"{reader} needs region masks for each image: give --regions FOLDER (png/npy/npz per image), --regions sam2 or --regions sam3 (regions= in Python)"


def missing_bank(reader: str) -> str:
    return f"{reader} needs an image bank: give --bank BANK (build one with `clipseg-sparse bank build`)"
