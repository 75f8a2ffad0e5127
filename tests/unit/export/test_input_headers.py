"""What ``predict`` and ``serve`` read is checked from its header before it is decoded: an
array that declares more data than its file holds, an image that declares more pixels than
the limit, or bytes that are no image, are one ``ValueError`` naming the file, never an
allocation of what the header claims (``MemoryError`` would end the server)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest

from edgepfl.export.predict import check_input, load_images, load_npy, open_image

pytest.importorskip("PIL")


def _npy_bytes(shape: tuple[int, ...], data: bytes) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": "<f8", "fortran_order": False, "shape": shape})
    return out.getvalue() + data


def test_an_npy_declaring_46_tebibytes_in_128_bytes_is_one_error_naming_it(tmp_path):
    lying = tmp_path / "lying.npy"
    lying.write_bytes(_npy_bytes((10**11, 1, 8, 8), bytes(64)))
    for read in (load_npy, check_input):
        with pytest.raises(ValueError, match="lying.npy: not a readable .npy file"):
            read(lying)
    honest = tmp_path / "honest.npy"
    np.save(honest, np.arange(12.0).reshape(3, 4))
    check_input(honest)
    assert np.array_equal(load_npy(honest), np.arange(12.0).reshape(3, 4))
    assert isinstance(load_npy(honest), np.ndarray) and not isinstance(load_npy(honest), np.memmap)


def test_an_npz_whose_array_declares_more_than_its_member_holds_is_refused_before_it_is_read(tmp_path):
    lying = tmp_path / "lying.npz"
    with zipfile.ZipFile(lying, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", _npy_bytes((10**11, 6, 100), bytes(64)))
    with pytest.raises(ValueError, match=r"lying.npz: array 'x' declares 480,000,000,000,000 bytes"):
        check_input(lying)
    honest = tmp_path / "honest.npz"
    np.savez_compressed(honest, x=np.zeros((4, 6, 100), np.float32), channel_names=np.array(list("abcdef")))
    check_input(honest)


def test_an_image_is_refused_from_its_header_and_unreadable_bytes_are_one_error(tmp_path):
    from PIL import Image

    photo = tmp_path / "photo.png"
    Image.fromarray(np.full((30, 40), 7, np.uint8), mode="L").save(photo)
    with pytest.raises(ValueError, match=r"photo.png: declares 40x30 = 1,200 pixels, more than the 1,000 .*--max-pixels"):
        open_image(photo, max_pixels=1_000)
    assert load_images([photo], (1, 8, 8), max_pixels=1_200).shape == (1, 1, 8, 8)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(photo.read_bytes()[:60])
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"not an image at all")
    for bad in (truncated, junk):
        with pytest.raises(ValueError, match=f"{bad.name}: not a readable image"):
            load_images([bad], (1, 8, 8))
    with pytest.raises(ValueError, match="junk.jpg: not a readable image"):
        check_input(junk)
    check_input(Path(photo))
