"""Vocabularies, prompt templates and cached text embeddings.

A vocabulary is a list of classes, each with one or more names (synonyms). Published class files put
one class per line with synonyms separated by ", "; on the command line `|` joins synonyms and `,`
separates classes. Each name is embedded with every template; the template embeddings are
L2-normalised, averaged and re-normalised (the CLIP zero-shot recipe). A prompt file (`Prompts`, OV-Stitcher's
`class_biased_template.json`) adds whole sentences per name to that average. Embeddings are cached on disk,
keyed by model, weights, names, templates and sentences, so a vocabulary is embedded once per model.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from ..errors import UserFileNotFoundError, UserValueError

if TYPE_CHECKING:
    import torch

    from ..models.clip import DenseCLIP

SINGLE_TEMPLATE = ("a photo of a {}.",)
NO_TEMPLATE = ("{}",)


def openai_imagenet_templates() -> tuple[str, ...]:
    """The 80 prompt templates of CLIP's ImageNet zero-shot evaluation (taken from open_clip)."""
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

    return tuple(t("{}") for t in OPENAI_IMAGENET_TEMPLATES)


def resolve_templates(templates: str | Sequence[str] = "openai") -> tuple[str, ...]:
    """`openai` (80 templates), `single` ("a photo of a {}."), `none` ("{}"), a file, or a list."""
    if not isinstance(templates, str):
        out = tuple(templates)
    elif templates == "openai":
        return openai_imagenet_templates()
    elif templates == "single":
        return SINGLE_TEMPLATE
    elif templates == "none":
        return NO_TEMPLATE
    else:
        path = Path(templates)
        if not path.is_file():
            raise UserValueError(f"templates {templates!r}: not 'openai', 'single', 'none' or an existing file")
        out = tuple(line.strip() for line in read_text_lines(path, "templates file"))
    bad = [t for t in out if not _one_placeholder(t)]
    if not out or bad:
        where = f"templates {templates!r}: " if isinstance(templates, str) else ""
        raise UserValueError(f"{where}every template needs exactly one '{{}}' placeholder for the class name and no other braces (bad: {bad[:3] or 'none given'})")
    return out


def read_text_lines(path: Path, what: str) -> list[str]:
    """The non-blank lines of a UTF-8 text file (a byte-order mark is dropped); UserValueError naming the
    file when it is not text."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UserValueError(f"{path}: not a UTF-8 text file; a {what} has one entry per line") from None
    if "\x00" in text:
        raise UserValueError(f"{path}: binary data (NUL bytes), not a text file; a {what} has one entry per line")
    return [line for line in text.splitlines() if line.strip()]


@dataclass(frozen=True)
class Prompts:
    """Description sentences per class name, embedded with the name's templates and averaged with them
    (atw617/OV-Stitcher@91a9489 `generate_category_embeddings`: each prompt L2-normalised, all of a name's
    prompts averaged, re-normalised). The file is a JSON object: name -> list of sentences (used as
    written, no placeholder), e.g. OV-Stitcher's `prompts/class_biased_template.json`; names matched exactly,
    names it lacks get the templates alone."""

    file: str
    sentences: Mapping[str, tuple[str, ...]]
    sha256: str

    @classmethod
    def read(cls, path: str | Path) -> "Prompts":
        """UserValueError naming the file when it is missing or not a JSON object of lists of sentences."""
        path = Path(path)
        try:
            raw = path.read_bytes()
            data = json.loads(raw.decode("utf-8-sig"))
        except OSError as e:
            raise UserValueError(f"{path}: cannot read the prompt file ({e.strerror or e})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserValueError(f"{path}: not a JSON prompt file ({e}); expected {{\"class name\": [\"sentence\", ...]}}") from None
        if not isinstance(data, dict):
            raise UserValueError(f"{path}: a prompt file is a JSON object of class name -> list of sentences (got {type(data).__name__})")
        for name, sentences in data.items():
            if not isinstance(sentences, list) or not all(isinstance(x, str) and x.strip() for x in sentences):
                raise UserValueError(f"{path}: class {name!r}: expected a list of non-empty sentences")
        sentences = {name: tuple(v) for name, v in data.items()}
        return cls(str(path), sentences, hashlib.sha256(raw).hexdigest()[:16])

    def id(self) -> dict:
        """What a result file records: the file's name and a hash of its bytes."""
        return {"file": Path(self.file).name, "sha256": self.sha256}

    def extra(self, names: Sequence[str]) -> list[tuple[str, ...]]:
        """The sentences of each name (empty for names the file lacks); UserValueError when it has none of
        them (a file for another vocabulary would change nothing and still be recorded as used)."""
        extra = [self.sentences.get(n, ()) for n in names]
        if not any(extra):
            mine, theirs = list(self.sentences), list(names)
            raise UserValueError(
                f"{self.file}: none of its names ({', '.join(mine[:3])}{', ...' if len(mine) > 3 else ''}) is a class name here "
                f"({', '.join(theirs[:3])}{', ...' if len(theirs) > 3 else ''}); names are matched exactly"
            )
        return extra


def resolve_prompts(prompts: "Prompts | str | Path | None") -> "Prompts | None":
    """A Prompts, the path of a prompt file, or None (templates only)."""
    return prompts if prompts is None or isinstance(prompts, Prompts) else Prompts.read(prompts)


def _one_placeholder(template: str) -> bool:
    """True for a template that `template.format(name)` fills: one `{}` and no other replacement field."""
    import string

    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError:  # an unmatched brace
        return False
    return fields == [("", "", None)]


def templates_id(templates: Sequence[str]) -> str | list[str]:
    """What a result file records for resolved templates: the name of a named set (`openai`, `single`,
    `none`), else the templates themselves, so two different template lists never share a configuration."""
    templates = tuple(templates)
    if templates == SINGLE_TEMPLATE:
        return "single"
    if templates == NO_TEMPLATE:
        return "none"
    if len(templates) == 80 and templates == openai_imagenet_templates():
        return "openai"
    return list(templates)


@dataclass(frozen=True)
class Vocabulary:
    """Classes to segment. `names[i]` are the synonyms of class i; `labels[i]` its display name."""

    names: tuple[tuple[str, ...], ...]
    labels: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.names:
            raise UserValueError("the vocabulary is empty: give at least one class")
        if len(self.names) != len(self.labels):
            raise UserValueError("one label per class is needed")
        for syn in self.names:
            if not syn or any(not n for n in syn):
                raise UserValueError("every class needs at least one non-empty name")

    @classmethod
    def from_names(cls, names: Sequence[Sequence[str]], labels: Sequence[str] | None = None) -> "Vocabulary":
        names = tuple(tuple(n.strip() for n in syn if n.strip()) for syn in names)
        labels = tuple(labels) if labels is not None else tuple(syn[0] if syn else "" for syn in names)
        return cls(names, labels)

    @classmethod
    def parse(cls, text: str) -> "Vocabulary":
        """`"cat,dog|puppy,sky"`: commas separate classes, `|` joins synonyms of one class."""
        classes = [c for c in text.split(",") if c.strip()]
        return cls.from_names([c.split("|") for c in classes])

    @classmethod
    def from_file(cls, path: str | Path) -> "Vocabulary":
        """One class per line, synonyms separated by ", " (the format of the published class files)."""
        path = Path(path)
        if not path.is_file():
            raise UserFileNotFoundError(f"{path}: class-names file not found")
        lines = read_text_lines(path, "class-names file")
        if not lines:
            raise UserValueError(f"{path}: class-names file is empty")
        return cls.from_names([line.split(",") for line in lines])

    def with_background(self, names: Sequence[str], label: str = "background") -> "Vocabulary":
        """Prepend a background class (index 0) named by `names`, e.g. stuff words such as sky, wall."""
        names = tuple(n.strip() for n in names if n.strip())
        if not names:
            raise UserValueError("background needs at least one name")
        return Vocabulary(((*names,), *self.names), (label, *self.labels))

    def repeated_names(self) -> list[str]:
        """One line per name given more than once (in two classes, or twice in one), saying where.

        A repeated name scores the same for every class holding it, so on its pixels the later class can
        never win; `check_unique` refuses such a vocabulary (the published SCLIP COCO-Object file has one).
        """
        where: dict[str, list[int]] = {}
        for i, syn in enumerate(self.names):
            for name in syn:
                where.setdefault(name.casefold(), []).append(i)
        out = []
        for name, classes in where.items():
            if len(classes) > 1:
                uses = ", ".join(f"class {i} {self.labels[i]!r}" for i in dict.fromkeys(classes))
                out.append(f"{name!r} is given {len(classes)} times ({uses})")
        return out

    def check_unique(self) -> None:
        """UserValueError naming the first repeated name (see `repeated_names`)."""
        repeated = self.repeated_names()
        if repeated:
            raise UserValueError(f"duplicate class name: {repeated[0]}; a name may appear once, as a class or as a synonym")

    @property
    def flat_names(self) -> tuple[str, ...]:
        return tuple(n for syn in self.names for n in syn)

    @property
    def name_to_class(self) -> list[int]:
        return [i for i, syn in enumerate(self.names) for _ in syn]

    def __len__(self) -> int:
        return len(self.names)


def default_cache_dir() -> Path:
    """`$CLIPSEG_SPARSE_CACHE`, else `$XDG_CACHE_HOME/clipseg-sparse`, else `~/.cache/clipseg-sparse`."""
    if os.environ.get("CLIPSEG_SPARSE_CACHE"):
        return Path(os.environ["CLIPSEG_SPARSE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "clipseg-sparse"


def _weights_key(clip: "DenseCLIP") -> str | None:
    """What identifies the weights; None for random weights, which must never be cached."""
    if clip.pretrained == "none":
        return None
    path = Path(clip.pretrained)
    if path.is_file():
        st = path.stat()
        return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return clip.pretrained


def text_cache_key(clip: "DenseCLIP", names: Sequence[str], templates: Sequence[str], extra: Sequence[Sequence[str]] = ()) -> str | None:
    weights = _weights_key(clip)
    if weights is None:
        return None
    key = [clip.model_name, weights, clip.precision, clip.quick_gelu, list(names), list(templates)]
    blob = json.dumps(key + [[list(e) for e in extra]] if any(extra) else key)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def embed_names(
    clip: "DenseCLIP",
    names: Sequence[str],
    templates: str | Sequence[str] = "openai",
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    progress: bool = False,
    prompts: "Prompts | str | Path | None" = None,
) -> "torch.Tensor":
    """Text embeddings for `names` (N x D, fp32, L2-normalised), averaged over templates (and over the
    name's sentences of a prompt file, `Prompts`).

    progress: a progress bar (prompts/s, ETA) on stderr while embedding, or a note that the cached
    embeddings are reused.
    """
    import torch
    import torch.nn.functional as F

    templates = resolve_templates(templates)
    prompts = resolve_prompts(prompts)
    extra = prompts.extra(names) if prompts is not None else []
    key = text_cache_key(clip, names, templates, extra) if use_cache else None
    cache_file = Path(cache_dir or default_cache_dir()) / "text" / f"{key}.pt" if key else None
    if cache_file is not None and cache_file.is_file():
        try:
            emb = torch.load(cache_file, map_location=clip.device, weights_only=True)
        except Exception:  # a torn write from an interrupted run: recompute
            cache_file.unlink(missing_ok=True)
        else:
            if progress:
                _note(f"text: reusing the cached embeddings of {len(names)} names x {len(templates)} templates ({cache_file})")
            return emb
    if any(extra):  # templates, then the name's sentences, all averaged
        per_name = [[t.format(n) for t in templates] + list(e) for n, e in zip(names, extra)]
        counts = torch.tensor([len(p) for p in per_name])
        texts = [p for ps in per_name for p in ps]
        emb = F.normalize(_encode_prompts(clip, texts, f"text: {len(names)} names x {len(templates)} templates + {len(texts) - len(names) * len(templates)} sentences", progress), dim=-1)
        total = emb.new_zeros(len(names), emb.shape[-1]).index_add_(0, torch.repeat_interleave(torch.arange(len(names)), counts).to(emb.device), emb)
        emb = F.normalize(total / counts.to(emb.device, emb.dtype)[:, None], dim=-1)
    else:
        texts = [t.format(n) for n in names for t in templates]
        emb = _encode_prompts(clip, texts, f"text: {len(names)} names x {len(templates)} templates", progress)
        emb = emb.reshape(len(names), len(templates), -1)
        emb = F.normalize(F.normalize(emb, dim=-1).mean(1), dim=-1)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        torch.save(emb.cpu(), tmp)
        tmp.replace(cache_file)
    return emb


def _note(message: str) -> None:
    from ..runtime.progress import err_console

    err_console.print(message, highlight=False, soft_wrap=True)


def _encode_prompts(clip: "DenseCLIP", prompts: list[str], description: str, progress: bool) -> "torch.Tensor":
    """clip.encode_text(prompts), with a progress bar (prompts/s, ETA) on stderr when `progress`."""
    if not progress:
        return clip.encode_text(prompts)
    from ..runtime.progress import progress_bar

    with progress_bar("prompts") as bar:
        task = bar.add_task(description, total=len(prompts))
        return clip.encode_text(prompts, advance=lambda n: bar.advance(task, n))
