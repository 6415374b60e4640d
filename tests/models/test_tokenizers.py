"""Hugging Face tokenizers of open_clip text towers offline (models/tokenizers.py): a tower with random weights
runs with a byte-level stand-in where the Hub tokenizer cannot be had (issue 35, reliability 16), one with
weights fails in one line that says so."""

from __future__ import annotations

import os
import subprocess
import sys

import open_clip

from clipseg_sparse.models.tokenizers import write_byte_tokenizer

CODE = """
import open_clip
from clipseg_sparse.models.tokenizers import HubTokenizer
from clipseg_sparse.runtime.weights import WeightsUnavailableError
cfg = open_clip.get_model_config('ViT-B-16-SigLIP2')['text_cfg']
ids = HubTokenizer('ViT-B-16-SigLIP2', cfg, random_weights=True)(['a photo of a cat.', 'a photo of a dog.'])
print('IDS', *ids.shape, int(ids.max()), bool((ids[0] != ids[1]).any()))
try:
    HubTokenizer('ViT-B-16-SigLIP2', cfg).load()
except WeightsUnavailableError as e:
    print('ERR', e)
"""


def test_random_weights_run_offline_with_a_byte_level_stand_in_and_the_error_says_so(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    context = open_clip.get_model_config("ViT-B-16-SigLIP2")["text_cfg"]["context_length"]
    _, rows, columns, top, differ = lines[0].split()
    assert (rows, columns, differ) == ("2", str(context), "True") and int(top) < 258, out.stdout + out.stderr
    assert "has random weights and its tokenizer 'timm/ViT-B-16-SigLIP2' cannot be had here" in out.stderr, out.stderr
    assert len(lines) == 2 and lines[1].startswith("ERR") and "With random weights (--pretrained none) no real tokenizer is needed" in lines[1]


def test_the_byte_tokenizer_is_a_tokenizer_directory_open_clip_reads(tmp_path):
    from open_clip.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(str(write_byte_tokenizer(tmp_path / "bytes")), context_length=8)
    ids = tokenizer(["ab", "ba"])
    assert ids.shape == (2, 8) and ids[0, 0] == ids[1, 1] and ids[0, 1] == ids[1, 0] and (ids[:, 2:] == 0).all()  # bytes, then <pad>
