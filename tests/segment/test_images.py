import numpy as np
from PIL import Image

from clipseg_sparse.segment.images import load_image


def test_arrays_of_every_depth_become_rgb_uint8():
    gray16 = np.array([[0, 1000], [2000, 4000]], dtype=np.uint16)
    out = load_image(gray16)
    assert out.dtype == np.uint8 and out.shape == (2, 2, 3)
    # stretched min..max, as 16-bit files are: 0 -> 0, 4000 -> 255, 2000 -> 128 (rounded)
    assert out[..., 0].tolist() == [[0, 64], [128, 255]]
    floats = np.full((2, 2, 3), 0.5)
    assert (load_image(floats) == 128).all()
    small_ints = np.full((2, 2, 3), 200, dtype=np.int64)
    assert (load_image(small_ints) == 200).all()
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    assert load_image(rgba).shape == (2, 2, 3)


def test_16bit_file_and_array_agree(tmp_path):
    data = (np.arange(12, dtype=np.uint16).reshape(3, 4) * 3000)
    path = tmp_path / "deep.png"
    img = Image.fromarray(data)
    assert img.mode.startswith("I;16")
    img.save(path)
    assert np.array_equal(load_image(path), load_image(data))
