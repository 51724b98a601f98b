"""The block kernels, in every instruction-set variant this machine runs, against references.

- Reading: every GGUF block type, dequantized by our kernels, equals the gguf package's
  reference dequantization of the same bytes.
- Products: the kernel quantizes activations to int8 blocks of 32 (one float scale each);
  its product must equal, up to float rounding, the exact product of those quantized
  activations with the reference weights: the integer arithmetic itself loses nothing.
- Batch invariance: a row's result does not depend on the rows it is computed with.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize

from llorch.kernels import blocks, build

pytestmark = pytest.mark.cpu

Q = GGMLQuantizationType
BLOCK_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of each block type's float16 scale fields: random bytes there could be NaN.
F16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q2_K: [80, 82],
              Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}
VARIANTS = [v.name for v in build.runnable_variants()]


@pytest.fixture(scope="module", params=VARIANTS)
def lib(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return build.load_variant(request.param)


def random_matrix(qtype: Q, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random blocks of `qtype` (every bit pattern is a valid block), with sane float16 scales."""
    rng = np.random.default_rng(seed)
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_values, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(0.001, 0.05, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def reference_weights(matrix: torch.Tensor, qtype: Q, cols: int) -> torch.Tensor:
    return torch.from_numpy(reference_dequantize(matrix.numpy(), qtype).reshape(matrix.shape[0], cols)).double()


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_every_block_type_reads_as_the_reference_dequantizes_it(lib, qtype: Q) -> None:  # type: ignore[no-untyped-def]
    matrix = random_matrix(qtype, 9, 512, seed=int(qtype))
    ours = blocks.dequantize_rows(matrix, int(qtype), 512, lib=lib).double()
    assert torch.allclose(ours, reference_weights(matrix, qtype, 512), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 5, 70])  # 70: more rows than one activation tile
def test_products_are_exact_up_to_float_rounding(lib, qtype: Q, rows: int) -> None:  # type: ignore[no-untyped-def]
    matrix = random_matrix(qtype, 37, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 2
    exact = blocks.quantize_activations(x, lib=lib).double() @ reference_weights(matrix, qtype, 512).T
    ours = blocks.matmul(x, matrix, int(qtype), lib=lib).double()
    assert (ours - exact).abs().max() <= 1e-5 * exact.abs().max()


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_float_matrices_multiply_the_float_activations(lib, qtype: Q) -> None:  # type: ignore[no-untyped-def]
    weight = torch.randn(21, 96, generator=torch.Generator().manual_seed(2))
    dtype = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
    stored = weight.to(dtype)
    raw = stored.contiguous().view(torch.uint8).reshape(21, -1)
    x = torch.randn(3, 96)
    exact = x.double() @ stored.double().T
    assert torch.allclose(blocks.matmul(x, raw, int(qtype), lib=lib).double(), exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(blocks.dequantize_rows(raw, int(qtype), 96, lib=lib), stored.float())


def test_activation_blocks_keep_the_largest_value_and_round_to_nearest(lib) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 1, 96)
    again = blocks.quantize_activations(x, lib=lib)
    maxima = x.reshape(4, 3, 32).abs().amax(-1, keepdim=True)
    assert torch.allclose(again.reshape(4, 3, 32).abs().amax(-1, keepdim=True), maxima, rtol=1e-6)
    assert bool(((again - x).abs().reshape(4, 3, 32) <= maxima / 127 / 2 * (1 + 1e-5)).all())


def test_every_variant_quantizes_activations_to_the_same_bytes(lib) -> None:  # type: ignore[no-untyped-def]
    """The vector quantizers round as the portable one does, ties included, so variants agree."""
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(11)) * torch.logspace(-3, 2, 256)
    x[0] = torch.arange(256).float().remainder(32) - 15.5  # block max 16.5 -> scale 127/16.5: ties
    x[1, :32] = torch.tensor([127.0, -0.5, 0.5, -1.5, 1.5, 2.5, -2.5, *range(-12, 13)])  # scale 1: exact ties
    x[2, 32:64] = 0.0  # an all-zero block

    def raw(library) -> torch.Tensor:  # type: ignore[no-untyped-def]
        out = torch.zeros(6 * 256 // blocks.ACT_BLOCK * blocks.ACT_BLOCK_BYTES, dtype=torch.uint8)
        library.llorch_quantize_rows(x.data_ptr(), 6, 256, out.data_ptr())
        return out

    assert torch.equal(raw(lib), raw(build.load_variant("portable")))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call(lib, qtype: Q) -> None:  # type: ignore[no-untyped-def]
    """Decoding jobs batched together, or a prompt chunk's rows, get the numbers each gets alone."""
    matrix = random_matrix(qtype, 50, 256, seed=9)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(9))
    together = blocks.matmul(x, matrix, int(qtype), lib=lib)
    for size in (1, 3, 16):
        for start in range(0, 70 - size + 1, 23):
            assert torch.equal(blocks.matmul(x[start : start + size], matrix, int(qtype), lib=lib),
                               together[start : start + size])


@pytest.mark.parametrize("cols", [512, 2304])  # 2304: segments of 1024, 1024 and 256 values (csrc/llorch.h)
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_an_interleaved_matrix_reads_and_multiplies_as_the_file_layout(lib, qtype: Q, cols: int) -> None:  # type: ignore[no-untyped-def]
    """Where a variant interleaves rows for speed, the values, the exact products and batch invariance stay,
    in one segment of a row or several."""
    matrix = random_matrix(qtype, 48, cols, seed=4)
    layout = matrix.clone()
    interleaved = blocks.repacked(layout, int(qtype), cols, lib=lib)
    if interleaved == int(qtype):
        assert torch.equal(layout, matrix)  # nothing to interleave for: the file's layout is kept
        return
    assert blocks.file_type(interleaved) == qtype and not torch.equal(layout, matrix)
    assert torch.equal(blocks.dequantize_rows(layout, interleaved, cols, lib=lib),
                       blocks.dequantize_rows(matrix, int(qtype), cols, lib=lib))
    some = torch.tensor([47, 3, 8])
    assert torch.equal(blocks.dequantize_rows(layout, interleaved, cols, some, lib=lib),
                       blocks.dequantize_rows(matrix, int(qtype), cols, some, lib=lib))
    weights = reference_weights(matrix, qtype, cols)
    for rows in (1, 3, 4, 16, 70):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 2
        exact = blocks.quantize_activations(x, lib=lib).double() @ weights.T
        ours = blocks.matmul(x, layout, interleaved, lib=lib)
        assert (ours.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
        for start in range(0, rows, 3):  # batch invariant
            alone = blocks.matmul(x[start : start + 1], layout, interleaved, lib=lib)
            assert torch.equal(alone, ours[start : start + 1])
    # Groups of eight rows are computed two at a time where they can be: rows 32-39 of these 48 are
    # the second half of a pair (with rows 8-15), and of the first 40 rows alone the group left over;
    # same bits, for a few activation rows and for as many as the AVX2 kernels unpack each group once for.
    first_40 = matrix[:40].clone()
    first_40_type = blocks.repacked(first_40, int(qtype), cols, lib=lib)
    for rows in (5, 16):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(40))
        assert torch.equal(blocks.matmul(x, first_40, first_40_type, lib=lib),
                           blocks.matmul(x, layout, interleaved, lib=lib)[:, :40])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_a_matrix_wider_than_a_segment_gives_each_row_the_bits_of_one_pass(lib, qtype: Q) -> None:  # type: ignore[no-untyped-def]
    """A row's dot goes on from segment to segment in the order of one pass over the row: its bits are
    those of the same weights in a matrix of one segment (the first 1024 values; then the whole row with
    every value past them zero, which the segments after add nothing to)."""
    matrix = random_matrix(qtype, 32, 2304, seed=6)
    x = torch.randn(3, 2304, generator=torch.Generator().manual_seed(6))
    x[:, 1024:] = 0.0
    narrow = blocks.file_type(int(qtype))
    bytes_1024 = blocks.row_bytes(int(narrow), 1024)
    head = matrix[:, :bytes_1024].clone()
    head_type = blocks.repacked(head, int(qtype), 1024, lib=lib)
    wide = matrix.clone()
    wide_type = blocks.repacked(wide, int(qtype), 2304, lib=lib)
    if wide_type == int(qtype):
        assert torch.equal(wide, matrix)  # nothing to interleave for: the file's layout is kept
        return
    assert torch.equal(blocks.matmul(x, wide, wide_type, lib=lib), blocks.matmul(x[:, :1024], head, head_type, lib=lib))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_a_wide_product_has_the_same_bits_on_any_number_of_threads(lib, qtype: Q) -> None:  # type: ignore[no-untyped-def]
    """Decoding's few rows go through a wide matrix a segment at a time, the threads sharing each segment's
    chunks of rows between them (csrc/matmul.c): every chunk takes its segments in order whichever thread
    takes it, so one thread, two, or more threads than cores give the same bits."""
    rows, cols = 1024, 4352  # 64 chunks of 16 rows, in five segments (the last of 256 values)
    matrix = random_matrix(qtype, rows, cols, seed=11)
    layout = matrix.clone()
    interleaved = blocks.repacked(layout, int(qtype), cols, lib=lib)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(11))
    alone = blocks.matmul(x, layout, interleaved, lib=lib, threads=1)
    for threads in (2, 3, 5):
        for _ in range(3):  # the threads meet in another order each time
            assert torch.equal(blocks.matmul(x, layout, interleaved, lib=lib, threads=threads), alone)
    exact = blocks.quantize_activations(x, lib=lib).double() @ reference_weights(matrix, qtype, cols).T
    assert (alone.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


@pytest.mark.skipif("amx" not in VARIANTS, reason="this CPU has no AMX")
@pytest.mark.parametrize(("qtype", "cols"), [(Q.Q8_0, 640), (Q.Q5_0, 640), (Q.Q4_K, 768), (Q.Q6_K, 768),
                                             (Q.Q5_0, 2304), (Q.Q4_K, 2304)],
                         ids=lambda v: v.name if isinstance(v, Q) else str(v))
def test_rows_computed_on_amx_get_the_bits_of_the_8_bit_dot_kernels(qtype: Q, cols: int) -> None:
    """AMX takes a product's rows 16 at a time and leaves the rest to the VNNI kernels: every row must
    come out the same either way, or a prompt chunk's rows would differ from the same rows decoded."""
    amx, vnni = build.load_variant("amx"), build.load_variant("avx512-vnni")
    assert amx.llorch_amx_ready() == 1  # the tiles were granted: otherwise VNNI would be compared with itself
    matrix = random_matrix(qtype, 56, cols, seed=12)  # seven groups of eight: three pairs and one alone
    interleaved = blocks.repacked(matrix, int(qtype), cols, lib=amx)
    assert interleaved > int(qtype)
    for rows in (16, 33, 80):  # AMX takes 16 (Q5_0 only), 32 and 80 of them; 640 columns: spans of 8, 8 and 4 blocks
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 3
        assert torch.equal(blocks.matmul(x, matrix, interleaved, lib=amx),
                           blocks.matmul(x, matrix, interleaved, lib=vnni))


@pytest.mark.skipif("amx" not in VARIANTS, reason="this CPU has no AMX")
@pytest.mark.parametrize(("qtype", "cols"), [(Q.Q8_0, 640), (Q.Q5_0, 640), (Q.Q4_K, 768), (Q.Q6_K, 2304)],
                         ids=lambda v: v.name if isinstance(v, Q) else str(v))
def test_a_prompts_rows_on_amx_bf16_are_the_files_product_to_bfloat16_rounding(qtype: Q, cols: int) -> None:
    """A prompt's rows (csrc/amx_bf16.c): each weight the file's value and each activation rounded once to
    bfloat16, the sums in float32, so every output is within those roundings of the exact product and on
    average closer to it than the 8-bit kernels' blocks get; and each row is computed on its own."""
    amx = build.load_variant("amx")
    matrix = random_matrix(qtype, 56, cols, seed=14)  # seven groups of eight: a unit of four and one of three
    interleaved = blocks.repacked(matrix, int(qtype), cols, lib=amx)
    exact_weights = blocks.dequantize_rows(matrix, interleaved, cols, lib=amx).double()
    x = torch.randn(37, cols, generator=torch.Generator().manual_seed(cols)) * 3  # three tiles of rows, the last short
    ours = blocks.prompt_matmul(x, matrix, interleaved, lib=amx)
    assert ours is not None, "the amx variant takes interleaved matrices for a prompt's rows"
    exact = x.double() @ exact_weights.T
    # Two roundings of 2^-9 per product, and float32 sums of `cols` terms.
    bound = (2**-8 + cols * 2**-24) * (x.double().abs() @ exact_weights.abs().T)
    assert bool(((ours.double() - exact).abs() <= bound).all())
    eight_bit = blocks.matmul(x, matrix, interleaved, lib=amx).double()
    assert (ours.double() - exact).abs().mean() < 0.6 * (eight_bit - exact).abs().mean()
    for row in (0, 16, 36):
        assert torch.equal(blocks.prompt_matmul(x[row : row + 1], matrix, interleaved, lib=amx), ours[row : row + 1])
    assert blocks.prompt_matmul(x, matrix, int(qtype), lib=amx) is None  # a file type: not taken


@pytest.mark.skipif("avx512-vnni" not in VARIANTS, reason="this CPU has no AVX-512 VNNI to compare with")
@pytest.mark.parametrize("variant", [v for v in ("avx512", "avx2") if v in VARIANTS])
@pytest.mark.parametrize(("qtype", "cols"), [(Q.Q8_0, 640), (Q.Q5_0, 640), (Q.Q4_K, 768), (Q.Q6_K, 768),
                                             (Q.Q8_0, 2304), (Q.Q4_K, 2304), (Q.Q6_K, 2304)],
                         ids=lambda v: v.name if isinstance(v, Q) else str(v))
def test_the_interleaved_kernels_without_vnni_get_the_bits_of_the_vnni_ones(variant: str, qtype: Q, cols: int) -> None:
    """AVX2's pair products sum to the same exact integers as VNNI's dots, and the float operations after
    them are the same: a CPU without VNNI computes every row as one with it does."""
    narrow, vnni = build.load_variant(variant), build.load_variant("avx512-vnni")
    matrix = random_matrix(qtype, 56, cols, seed=13)  # seven groups of eight: three pairs and one alone
    layout = matrix.clone()
    interleaved = blocks.repacked(layout, int(qtype), cols, lib=narrow)
    assert interleaved == blocks.repacked(matrix, int(qtype), cols, lib=vnni) > int(qtype)
    assert torch.equal(layout, matrix)  # one layout for both
    for rows in (1, 2, 3, 4, 9):  # four activation rows at a time; one or two take Q4_K's groups in pairs
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 3
        assert torch.equal(blocks.matmul(x, matrix, interleaved, lib=narrow),
                           blocks.matmul(x, matrix, interleaved, lib=vnni))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the built library with")
@pytest.mark.parametrize("variant", [v for v in ("avx512-vnni", "avx512", "avx2") if v in VARIANTS])
def test_the_interleaved_kernels_ask_for_their_weights_ahead_in_every_variant(variant: str) -> None:
    """Decode streams its weights from memory, and the kernels ask for them ahead of their reads: the
    compiler deletes a request it sees no effect of wherever the helper making it was not inlined, as
    it once did in every build of the AVX2 kernels (a batch of eight decoded 1.4x slower), silently."""
    library = build.build_library(next(v for v in build.runnable_variants() if v.name == variant))
    code = subprocess.run(["objdump", "-d", "--disassemble=llorch_interleaved_groups", str(library)],
                          capture_output=True, text=True, check=True).stdout
    assert "<llorch_interleaved_groups>:" in code
    assert "prefetch" in code


def test_the_cache_holds_keys_and_values_as_float16_rounded_to_nearest_even(lib) -> None:  # type: ignore[no-untyped-def]
    """The step's float16 conversion is numpy's (IEEE round to nearest even): ties, subnormals,
    the largest finite value and overflow, in the vector body and the scalar tail alike."""
    half_ulp = np.float32(2.0**-11)  # half a float16 step at 1.0: 1 + it ties to 1, 1 + 3 of it to 1 + 2^-9
    edges = np.array([0.0, -0.0, 1.0, 1 + half_ulp, 1 + 3 * half_ulp, -(1 + half_ulp), 65504.0, 65519.0, 65520.0,
                      -70000.0, 2.0**-14, 2.0**-24, 2.0**-25, 1.5 * 2.0**-24, 2.0**-26, 3e-6, np.inf, -np.inf],
                     dtype=np.float32)
    x = np.concatenate([edges, np.random.default_rng(7).standard_normal(61).astype(np.float32) * 300])
    out = np.zeros(x.size, dtype=np.float16)
    lib.llorch_to_fp16(x.ctypes.data, x.size, out.ctypes.data)
    with np.errstate(over="ignore"):
        assert np.array_equal(out.view(np.uint16), x.astype(np.float16).view(np.uint16))
    nan = np.array([np.nan] * 9, dtype=np.float32)
    lib.llorch_to_fp16(nan.ctypes.data, 9, out.ctypes.data)
    assert np.isnan(out[:9]).all()


@pytest.mark.parametrize(("group", "head_dim", "count"), [(8, 64, 128), (8, 64, 37), (4, 256, 77), (2, 64, 5),
                                                      (2, 128, 33), (7, 64, 128), (3, 80, 50), (3, 128, 41),
                                                      (1, 128, 1), (5, 32, 9), (16, 64, 40), (32, 16, 20),
                                                      (4, 128, 70), (1, 64, 19)])
def test_an_attention_work_item_is_the_softmax_attention_of_its_chunk(lib, group: int, head_dim: int,  # type: ignore[no-untyped-def]
                                                                     count: int) -> None:
    """Each head's max score, weight sum and weighted values over a chunk of cached positions
    (float16 keys and values, as the cache holds them).

    The shapes take every path: sixteen dot products reduced at once and the rest one by one,
    values summed eight slices at a time and the rest value by value (starting inside a head
    when its slices do not divide by eight), and head sizes that are not a multiple of 16; and
    the groups whose query and key slices are each loaded once (a group dividing sixteen or
    divided by it, eight or divided by it with AVX2 alone; a head of 1, 2, 4 or a multiple of 8
    slices), and a group of three, whose slices
    are loaded once too; values shared by four heads (a group of 4, 8, 16), by two (a group of two
    with heads of 8 slices or more) or, with AVX2 alone, by three (a group of three).
    """
    kv_heads, g, scale, first = 3, 1, 0.125, 4
    rng = np.random.default_rng(group * 1000 + head_dim + count)
    slots_total = first + count + 10
    keys = torch.from_numpy(rng.standard_normal((slots_total, kv_heads * head_dim), dtype=np.float32)).half()
    values = torch.from_numpy(rng.standard_normal((slots_total, kv_heads * head_dim), dtype=np.float32)).half()
    q = torch.from_numpy(rng.standard_normal(kv_heads * group * head_dim, dtype=np.float32))
    slots = torch.from_numpy(rng.permutation(slots_total).astype(np.int64))  # paged: any order of slots
    scores = torch.empty(group * 128, dtype=torch.float32)
    parts = []
    for from_memory in (1, 0):  # asking for the chunk ahead or not (a decoding row's or a prompt's): same bits
        part = torch.full((group, head_dim + 2), float("nan"), dtype=torch.float32)
        lib.llorch_attend_chunk(q.data_ptr(), keys.data_ptr(), values.data_ptr(), g, group, head_dim, kv_heads, scale,
                                slots.data_ptr(), first, first + count, scores.data_ptr(), part.data_ptr(), from_memory)
        parts.append(part)
    assert torch.equal(parts[0], parts[1])
    rows = slots[first:first + count]
    k = keys[rows].double().view(count, kv_heads, head_dim)[:, g]
    v = values[rows].double().view(count, kv_heads, head_dim)[:, g]
    s = q.double().view(kv_heads * group, head_dim)[g * group:(g + 1) * group] @ k.T * scale  # [group, count]
    best = s.max(dim=1).values
    weights = torch.exp(s - best[:, None])
    torch.testing.assert_close(part[:, 0].double(), best, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part[:, 1].double(), weights.sum(dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part[:, 2:].double(), weights @ v, rtol=1e-5, atol=1e-4)


class AttendNext(ctypes.Structure):  # llorch.h's attend_next: the item a thread takes after this one
    _fields_ = [("slots", ctypes.c_void_p), ("g", ctypes.c_int64), ("first", ctypes.c_int64), ("last", ctypes.c_int64)]


def test_a_work_item_over_the_steps_cache_layout_asking_for_the_next_gives_the_same_bits(lib) -> None:  # type: ignore[no-untyped-def]
    """The step keeps its cache by head ([kv_heads, slots, head_dim]) and each work item asks for the next
    one's keys and values as it goes: the same chunk read that way, with a next item or none, from memory
    or not, gives exactly the bits of the slot-major entry."""
    kv_heads, group, head_dim, count, g, first, scale = 3, 4, 64, 100, 2, 4, 0.125
    rng = np.random.default_rng(11)
    slots_total = first + count + 30
    keys = rng.standard_normal((slots_total, kv_heads, head_dim), dtype=np.float32).astype(np.float16)
    values = rng.standard_normal((slots_total, kv_heads, head_dim), dtype=np.float32).astype(np.float16)
    q = rng.standard_normal(kv_heads * group * head_dim, dtype=np.float32)
    slots = rng.permutation(slots_total).astype(np.int64)
    scores = np.empty(group * 128, dtype=np.float32)
    expected = np.full((group, head_dim + 2), np.nan, dtype=np.float32)
    lib.llorch_attend_chunk(q.ctypes.data, keys.ctypes.data, values.ctypes.data, g, group, head_dim, kv_heads, scale,
                            slots.ctypes.data, first, first + count, scores.ctypes.data, expected.ctypes.data, 1)
    by_head_keys = np.ascontiguousarray(keys.transpose(1, 0, 2))
    by_head_values = np.ascontiguousarray(values.transpose(1, 0, 2))
    after = AttendNext(slots.ctypes.data, 0, 20, 120)  # another head's chunk, over other slots
    for ahead in (None, ctypes.byref(after)):
        for from_memory in (1, 0):
            part = np.full((group, head_dim + 2), np.nan, dtype=np.float32)
            lib.llorch_attend_chunk_then(q.ctypes.data, by_head_keys.ctypes.data, by_head_values.ctypes.data, g, group,
                                         head_dim, head_dim, slots_total * head_dim, scale, slots.ctypes.data, first,
                                         first + count, scores.ctypes.data, part.ctypes.data, from_memory, ahead)
            assert np.array_equal(part, expected)
    assert np.isfinite(expected).all()


def test_every_variant_argmaxes_a_row_to_its_first_largest_value_or_first_nan(lib) -> None:  # type: ignore[no-untyped-def]
    """torch's argmax, row by row: the first of tied largest values, the first NaN of a row holding one,
    wherever they fall (in the first lanes, in the vector loop, in the tail past it)."""
    rng = np.random.default_rng(7)
    cols = 262_147  # not a multiple of the vector width: the tail is scanned too
    rows = rng.standard_normal((9, cols)).astype(np.float32)
    rows[1, [5, 40_000]] = 9.0  # a tie: the first wins
    rows[2, cols - 1] = 9.0  # the largest in the tail
    rows[3, [17, 100_003]] = [np.nan, 9.0]  # a NaN before the largest value
    rows[4, [3, 8]] = [9.0, np.nan]  # a NaN after it: still the NaN
    rows[5] = -np.inf
    rows[6, [70_000, 70_001]] = np.inf
    rows[7, 0] = 9.0
    rows[8, [16, 31]] = 9.0  # a tie inside one vector's lanes
    out = np.full(len(rows), -7, dtype=np.int64)
    lib.llorch_argmax_rows(rows.ctypes.data, len(rows), cols, out.ctypes.data)
    expected = torch.from_numpy(rows).argmax(dim=1).tolist()
    nan_rows = np.isnan(rows).any(axis=1)
    assert out.tolist() == [-1 if nan else e for e, nan in zip(expected, nan_rows, strict=True)]
    assert expected[1:3] == [5, cols - 1] and expected[8] == 16


def reference_draw(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The distribution these filters define, in float64: softmax(logits / T) over the top-k
    tokens, the smallest most-probable prefix reaching top_p, tokens under min_p times the most
    probable dropped; returned with its cumulative sum in vocabulary order."""
    z = (logits.astype(np.float64) - logits.max()) / temperature
    if 0 < top_k < z.size:
        z = np.where(z < np.sort(z)[-top_k], -np.inf, z)
    probs = np.exp(z) / np.exp(z).sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        drop = before >= top_p
        drop[0] = False
        probs[order[drop]] = 0.0
    probs = np.where(probs < min_p * probs.max(), 0.0, probs)
    probs /= probs.sum()
    return probs, np.cumsum(probs)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (0.8, 40, 0.9, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 0, 0.95, 0.05),
    (1.3, 50, 1.0, 0.0), (0.5, 3, 0.5, 0.1), (1.0, 0, 1.0, 0.1), (1e-6, 0, 1.0, 0.0), (2.0, 1000, 0.99, 0.0)])
def test_a_sampled_token_is_where_the_uniform_falls_in_the_filtered_distribution(  # type: ignore[no-untyped-def]
        lib, temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    """For a grid of uniforms, the token drawn is the first in vocabulary order whose cumulative
    probability passes the uniform, under the float64 reference (a token the filters drop is
    never drawn; a uniform within 1e-5 of a boundary may land on either side of it)."""
    rng = np.random.default_rng(7)
    # A flat row of the full vocabulary, plain and in steps of 1/4 (many equal weights where the filters
    # cut), leaves most tokens to the filters: they are selected there, not sorted.
    for vocab, scale, step in [(5, 1.0, 0), (1000, 4.0, 0), (262_144, 5.0, 0), (32_768, 0.5, 0), (262_144, 1.0, 0),
                               (262_144, 1.0, 4)]:
        logits = (rng.standard_normal(vocab) * scale).astype(np.float32)
        if step:
            logits = np.round(logits * step) / step
        logits[rng.integers(vocab)] = float(logits.max())  # a tie for the top
        probs, cumulative = reference_draw(logits, temperature, top_k, top_p, min_p)
        row = torch.from_numpy(logits)
        for uniform in np.linspace(0.0, 0.9999, 101):
            token = lib.llorch_sample_row(row.data_ptr(), vocab, temperature, top_k, top_p, min_p, float(uniform))
            assert probs[token] > 0.0, (vocab, uniform, token)
            expected = int(np.searchsorted(cumulative, uniform, side="right"))
            if token != expected:
                assert np.abs(cumulative - uniform).min() < 1e-5, (vocab, uniform, token, expected)


def test_a_row_with_a_nan_or_an_infinity_is_left_to_the_caller(lib) -> None:  # type: ignore[no-untyped-def]
    for bad in (float("nan"), float("inf")):
        row = torch.randn(1000)
        row[17] = bad
        assert lib.llorch_sample_row(row.data_ptr(), 1000, 1.0, 0, 1.0, 0.0, 0.5) == -1
    row = torch.full((1000,), float("-inf"))
    assert lib.llorch_sample_row(row.data_ptr(), 1000, 1.0, 0, 1.0, 0.0, 0.5) == -1


def test_only_whole_groups_of_eight_rows_are_interleaved(lib) -> None:  # type: ignore[no-untyped-def]
    for rows, qtype in ((12, Q.Q8_0), (20, Q.Q4_K), (16, Q.Q4_1)):
        matrix = random_matrix(qtype, rows, 256, seed=rows)
        layout = matrix.clone()
        assert blocks.repacked(layout, int(qtype), 256, lib=lib) == int(qtype)
        assert torch.equal(layout, matrix)


def test_every_runnable_variant_is_offered_best_first() -> None:
    names = [v.name for v in build.runnable_variants()]
    assert names[-1] == "portable"
    assert len(set(names)) == len(names)
    flags = build.cpu_flags()
    if {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f"} <= flags:
        assert names[:2] == ["amx", "avx512-vnni"]
    elif {"avx512_vnni", "avx512f"} <= flags:
        assert names[0] == "avx512-vnni"


def test_the_kernels_in_use_are_named_as_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the start-up log says computes the model: the forced variant, else the best, and with AMX
    whether the tiles were granted (they are on a Linux that supports AMX)."""
    monkeypatch.setenv("LLORCH_KERNELS", "portable")
    assert build.in_use() == "portable"
    monkeypatch.delenv("LLORCH_KERNELS")
    assert build.in_use() == VARIANTS[0]


def test_forcing_a_variant_this_cpu_cannot_run_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLORCH_KERNELS", "no-such-variant")
    with pytest.raises(build.KernelUnavailable, match="does not run on this CPU"):
        build.chosen_variant()
    monkeypatch.setenv("LLORCH_KERNELS", "portable")
    assert build.chosen_variant().name == "portable"


def test_a_missing_compiler_is_reported_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("LLORCH_CACHE_DIR", str(tmp_path))
    with pytest.raises(build.KernelUnavailable, match="no C compiler"):
        build.build_library(build.runnable_variants()[-1])


def test_set_up_builds_the_kernels_once_and_a_first_start_only_finds_them(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """`python -m llorch.kernels` is `make serve`'s set-up step: the library it leaves is the one a worker's
    first start asks for, found without a second build."""
    monkeypatch.setenv("LLORCH_CACHE_DIR", str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "llorch.kernels"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    (built,) = (tmp_path / "kernels").glob("*.so")
    assert str(built) in done.stdout
    stamp = built.stat().st_mtime_ns
    assert build.build_library(build.chosen_variant()) == built and built.stat().st_mtime_ns == stamp


def test_set_up_without_a_compiler_says_why_and_leaves_the_worker_to_run_without(monkeypatch: pytest.MonkeyPatch,
                                                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("LLORCH_CACHE_DIR", str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "llorch.kernels"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert done.stderr.strip() == ("llorch kernels not built: no C compiler ('no-such-compiler-here' is not on "
                                   "PATH; set CC)")
    assert not (tmp_path / "kernels").exists() or not list((tmp_path / "kernels").glob("*.so"))
