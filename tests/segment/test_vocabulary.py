"""Vocabularies: repeated names refused, BOM stripped, binary files named, non-ASCII legends drawn (issue 15, finding 9)."""

import numpy as np
import pytest

from clipseg_sparse.files.outputs import overlay_image
from clipseg_sparse.segment.vocabulary import Vocabulary, resolve_templates
from conftest import TINY_CONFIG
from test_common import assert_one_line_error, invoke


@pytest.mark.parametrize(
    "text, says",
    [
        ("cat,dog,cat", "'cat' is given 2 times (class 0 'cat', class 2 'cat')"),
        ("cat|kitten,dog|kitten", "'kitten' is given 2 times (class 0 'cat', class 1 'dog')"),
        ("sky,tree|sky", "'sky' is given 2 times (class 0 'sky', class 1 'tree')"),
        ("Cat,cat", "'cat' is given 2 times"),
    ],
)
def test_repeated_names_are_refused_naming_the_name(text, says):
    with pytest.raises(ValueError, match="duplicate class name") as e:
        Vocabulary.parse(text).check_unique()
    assert says in str(e.value)
    Vocabulary.parse("cat|kitten,dog|puppy").check_unique()  # distinct names pass


def test_segment_refuses_a_name_used_as_synonym_and_class(tmp_path):
    result = invoke("segment", tmp_path, "--classes", "tree,sky", "--background", "sky,wall", "--out", tmp_path / "o",
                    "--model", "no-such-model")  # fmt: skip
    assert_one_line_error(result, "'sky' is given 2 times", "class 0 'background'", "class 2 'sky'")


def test_eval_notes_the_repeat_in_the_published_coco_object_names(tmp_path):
    from fake_benchmarks import make_benchmark

    make_benchmark("coco-object", tmp_path / "data", n=1, size=(32, 32))
    result = invoke("eval", "--dataset", "coco-object", "--root", tmp_path / "data", "--model", "no-such-model")
    assert "note: prompt names of coco-object: 'bed' is given 2 times (class 0 'background', class 60 'bed')" in result.stderr


def test_byte_order_mark_is_not_part_of_the_first_name(tmp_path):
    path = tmp_path / "classes.txt"
    path.write_bytes("\ufeffsky, heaven\ntree\n".encode("utf-8"))
    vocab = Vocabulary.from_file(path)
    assert vocab.names == (("sky", "heaven"), ("tree",)) and vocab.labels == ("sky", "tree")
    templates = tmp_path / "templates.txt"
    templates.write_bytes("\ufeffa photo of a {}.\n".encode("utf-8"))
    assert resolve_templates(str(templates)) == ("a photo of a {}.",)


@pytest.mark.parametrize("data", [bytes(range(256)) * 4, b"sky\x00\x00tree\n"])
def test_binary_classes_file_error_names_the_file(tmp_path, data):
    path = tmp_path / "classes.bin"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="classes.bin"):
        Vocabulary.from_file(path)
    result = invoke("segment", tmp_path, "--classes-file", path, "--out", tmp_path / "o", "--model", TINY_CONFIG)
    assert_one_line_error(result, str(path), "class-names file")


def _legend(name: str) -> np.ndarray:
    rgb, labels = np.zeros((40, 40, 3), np.uint8), np.zeros((40, 40), np.int64)
    return np.asarray(overlay_image(rgb, labels, {name: 1.0}, (name,)))[:, 40:]


@pytest.mark.parametrize("name", ["á", "ж", "λ"])
def test_non_ascii_names_are_drawn_not_boxed(name):
    """PIL's default font draws every glyph it lacks as the same box (U+E000, private use, has no glyph
    anywhere): a legend drawn with a font that covers the name differs from the box."""
    drawn, box = _legend(name), _legend("\ue000")
    assert drawn.shape != box.shape or not np.array_equal(drawn, box)
    assert not np.array_equal(_legend("á"), _legend("a"))  # the accent is drawn too
