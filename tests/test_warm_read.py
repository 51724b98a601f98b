"""A warm start's weights read while the worker imports (weights/warm_read.py): the load takes exactly
what it would have read itself, reports a failed read as its own, and never takes another file's."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import exported
from llorch.errors import ModelFileError
from llorch.weights import native_loader, warm_read
from llorch.weights.native_loader import load_native
from llorch.weights.warm_read import drop_warm_read, start_warm_read, take_warm_read
from model_zoo import Q

pytestmark = pytest.mark.cpu


@pytest.fixture(autouse=True)
def nothing_pending() -> Any:
    drop_warm_read()
    yield
    drop_warm_read()


def counted_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files the load reads itself (not through a warm read)."""
    reads: list[Path] = []
    original = native_loader.read_gguf_weights

    def reading(gguf: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(gguf.path)
        return original(gguf, *args, **kwargs)

    monkeypatch.setattr(native_loader, "read_gguf_weights", reading)
    return reads


def assert_same_weights(ours: Any, theirs: Any) -> None:
    assert ours.types == theirs.types
    assert sorted(ours.weights) == sorted(theirs.weights)
    for name, array in theirs.weights.items():
        assert ours.weights[name].dtype == array.dtype and np.array_equal(ours.weights[name], array), name


# llama: q and k rows un-permuted before they are rearranged; phi3: fused projections cut into parts.
@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_a_warm_read_gives_the_load_what_it_would_read_itself(zoo: dict[str, Path], arch: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = exported(zoo, arch, Q.Q8_0)
    load_native(path)  # converts the file: its config and tensor table are cached from here on
    reads = counted_reads(monkeypatch)
    itself = load_native(path).native
    assert reads == [path]
    assert start_warm_read(path)
    warm = load_native(path).native
    assert reads == [path], "the load read the file again instead of taking the warm read"
    assert_same_weights(warm, itself)


def test_a_file_the_cache_does_not_know_is_read_by_the_load(zoo: dict[str, Path], tmp_path: Path) -> None:
    fresh = shutil.copy(exported(zoo, "llama", Q.Q8_0), tmp_path / "fresh.gguf")
    assert not start_warm_read(Path(fresh))
    assert take_warm_read(Path(fresh)) is None


def test_a_failed_warm_read_fails_the_load_with_its_reason(zoo: dict[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = exported(zoo, "llama", Q.Q8_0)
    load_native(path)

    def failing(gguf: Any, *args: Any, **kwargs: Any) -> Any:
        def finish() -> Any:
            raise ModelFileError(gguf.path, "reading tensor blk.0.attn_q.weight failed: Input/output error")
        return finish

    monkeypatch.setattr(warm_read, "read_gguf_weights", failing)
    assert start_warm_read(path)
    with pytest.raises(ModelFileError, match=re.escape("blk.0.attn_q.weight failed: Input/output error")):
        load_native(path)


def test_another_file_s_warm_read_is_not_taken(zoo: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    one, other = exported(zoo, "llama", Q.Q8_0), exported(zoo, "qwen2", Q.Q8_0)
    load_native(one)
    itself = load_native(other).native
    assert start_warm_read(one)
    reads = counted_reads(monkeypatch)
    assert_same_weights(load_native(other).native, itself)
    assert reads == [other]
    assert take_warm_read(one) is None  # dropped when the other file's load looked for its own
