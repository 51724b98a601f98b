"""The C step's matrices kept as one file beside the converted model (weights/weight_image.py): a load
after the first maps them from it and computes exactly what a load from the GGUF file computes; an
image that does not fit the model, or one mapped on small pages, is never what the step reads; a
write that fails leaves nothing behind."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import exported
from llorch.engine.factory import probe_logits
from llorch.weights import warm_read, weight_image
from llorch.weights.converted import ConversionCache, file_sha256
from llorch.weights.native_loader import load_native
from llorch.weights.warm_read import drop_warm_read, start_warm_read
from llorch.weights.weight_image import WeightImage, wait_for_images
from model_zoo import Q

pytestmark = pytest.mark.cpu

IDS = [1, 5, 9, 2, 7, 3]


@pytest.fixture
def model(zoo: dict[str, Path]) -> Path:
    """A GGUF file whose conversion entry holds no image yet."""
    path = exported(zoo, "llama", Q.Q8_0)
    wait_for_images()  # another test's load of it may still be writing
    for stale in ConversionCache(file_sha256(path)).directory.glob("*weights-*"):
        stale.unlink()
    return path


def image_of(path: Path) -> WeightImage:
    image = WeightImage.beside(ConversionCache(file_sha256(path)).directory)
    assert image is not None
    return image


def matrices(loaded: Any) -> dict[str, np.ndarray]:
    return {name: array for name, array in loaded.native.weights.items() if name in loaded.native.types}


def assert_same_model(ours: Any, theirs: Any) -> None:
    assert ours.native.types == theirs.native.types
    for name, array in matrices(theirs).items():
        assert np.array_equal(matrices(ours)[name], array), name
    assert np.array_equal(probe_logits(ours, IDS, "cpu"), probe_logits(theirs, IDS, "cpu"))


def test_a_load_after_the_first_maps_the_image_the_first_wrote(model: Path) -> None:
    first = load_native(model)
    assert all(array.flags.writeable for array in matrices(first).values()), "the first load reads the file"
    wait_for_images()
    assert image_of(model).exists()
    mapped = load_native(model)
    assert not any(array.flags.writeable for array in matrices(mapped).values()), "mapped read-only from the image"
    assert_same_model(mapped, first)


def test_an_image_that_does_not_describe_the_model_is_ignored(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = load_native(model)
    wait_for_images()
    image = image_of(model)
    index = json.loads(image.index.read_text())
    index["entries"][0]["shape"][0] += 8  # a matrix of other rows than the model's
    image.index.write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING, logger="llorch.weights"):
        again = load_native(model)
    assert "ignoring a weight image that does not fit the model" in caplog.text
    assert all(array.flags.writeable for array in matrices(again).values()), "read from the GGUF file instead"
    assert_same_model(again, first)


def test_a_truncated_image_is_ignored(model: Path) -> None:
    first = load_native(model)
    wait_for_images()
    image = image_of(model)
    with image.data.open("r+b") as handle:
        handle.truncate(image.data.stat().st_size // 2)
    again = load_native(model)
    assert all(array.flags.writeable for array in matrices(again).values())
    assert_same_model(again, first)


def test_an_image_mapped_on_small_pages_is_copied_into_memory_of_its_own(model: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_native(model)
    wait_for_images()
    monkeypatch.setattr(weight_image, "HUGE_PAGE", 1)  # this small file counts as large enough to check
    monkeypatch.setattr(weight_image, "huge_share", lambda view: 0.0)
    copied = load_native(model)
    assert all(array.flags.writeable for array in matrices(copied).values()), "an arena's copy, not the mapping"
    assert_same_model(copied, first)


def test_an_image_partly_on_small_pages_is_read_back_in_huge_ones(model: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_native(model)
    wait_for_images()
    shares = iter([0.8, 1.0])  # as seen after part of the file left memory and came back through read()
    dropped: list[int] = []
    monkeypatch.setattr(weight_image, "HUGE_PAGE", 1)
    monkeypatch.setattr(weight_image, "huge_share", lambda view: next(shares))
    monkeypatch.setattr(weight_image.os, "posix_fadvise",
                        lambda fd, offset, length, advice: dropped.append(advice))
    again = load_native(model)
    assert dropped == [weight_image.os.POSIX_FADV_DONTNEED], "its pages dropped, to be faulted in again"
    assert not any(array.flags.writeable for array in matrices(again).values()), "mapped, not copied"
    assert_same_model(again, first)


def test_a_write_that_fails_midway_leaves_nothing(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(fd: int, data: Any) -> None:
        weight_image.os.write(fd, bytes(memoryview(data).cast("B")[:100]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weight_image, "_write_all", failing)
    load_native(model)
    wait_for_images()
    assert list(image_of(model).data.parent.glob("*weights-*")) == []


def test_an_image_of_other_kernels_is_removed_when_this_one_is_written(model: Path) -> None:
    directory = image_of(model).data.parent
    other = [directory / "weights-llorch-other-0.bin", directory / "weights-llorch-other-0.json"]
    for path in other:
        path.write_bytes(b"from another build of the kernels")
    load_native(model)
    wait_for_images()
    assert image_of(model).exists()
    assert not any(path.exists() for path in other)


def test_a_warm_start_with_an_image_faults_in_no_arena(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prepared: list[int] = []
    monkeypatch.setattr(warm_read, "prepare_arena", prepared.append)
    with monkeypatch.context() as unwritten:
        unwritten.setattr(WeightImage, "write_later", lambda *args: None)
        load_native(model)  # converts; no image yet
        try:
            assert start_warm_read(model)
            assert prepared == [model.stat().st_size], "without an image the warm read fills an arena"
        finally:
            drop_warm_read()
    load_native(model)  # reads the file again, and writes the image
    wait_for_images()
    prepared.clear()
    try:
        assert start_warm_read(model)
        assert prepared == [], "the image is mapped: no memory to fault in"
        warm = load_native(model)
    finally:
        drop_warm_read()
    assert not any(array.flags.writeable for array in matrices(warm).values())
