"""The C tokenizer a warm start serves encodes, decodes and spells tokens exactly as the `tokenizers`
object it stands for, on the default model's Gemma vocabulary and on a Llama-2-style one (dummy prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from llorch.engine.vocabulary import token_bytes
from llorch.weights.converted import ConversionCache, file_sha256
from llorch.weights.gguf import GGUFFile
from llorch.weights.native_tokenizer import NativeSpm, tables_beside
from llorch.weights.tokenizer import Tokenizer, tokenizer_from_gguf

pytestmark = pytest.mark.cpu

# Pieces that meet every branch: added tokens whole, cut short and back to back; whitespace runs past the
# longest whitespace token; characters outside the vocabulary (byte fallback); text spelling a byte token.
FRAGMENTS = [
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<unused7>", "<start_of", "turn>", "<s>", "</s>",
    " ", "  ", " " * 33, " " * 40, "\t", "\n", "\n\n", "\r\n", "\u2581", "\u2581\u2581", "<0x41>", "<0xe2>",
    "hello", " world", "The", "ing", "ab", "aaaa", "=" * 20, "déjà", "Straße", "日本語", "한국어", "🤖", "👨‍👩‍👧",
    "\U0001fa7f", "\u0378", "\x00", "\x7f", "0123456789", "{\"a\": [1, 2]}", "def f(x):\n    return x\n",
]
texts = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=12).map("".join),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=10).map("".join),
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def gemma(model_path: Path) -> tuple[Tokenizer, HFTokenizer]:
    """The default model's tokenizer as a warm start builds it, beside the library's parse of the same JSON."""
    metadata = GGUFFile(model_path).metadata
    tokenizer_from_gguf(metadata, model_path)  # a first start writes the cache
    warm = tokenizer_from_gguf(metadata, model_path)
    assert isinstance(warm.backend, NativeSpm)
    assert warm.saved is not None
    return warm, HFTokenizer.from_file(str(warm.saved))


@pytest.fixture(scope="module")
def llama2(sentencepiece_vocab: tuple[object, Tokenizer]) -> tuple[Tokenizer, HFTokenizer]:
    _, built = sentencepiece_vocab
    assert built.saved is not None
    warm = NativeSpm.load(built.saved)
    assert warm is not None and warm.tables.prepend
    return Tokenizer(backend=warm, bos_token_id=built.bos_token_id, eos_token_ids=built.eos_token_ids,
                     special_ids=warm.tables.special_ids, byte_token_ids=built.byte_token_ids), built.library


VOCABS = ["gemma", "llama2"]


@pytest.fixture(params=VOCABS)
def pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, HFTokenizer]:
    return request.getfixturevalue(request.param)


@FUZZ
@given(text=texts)
def test_encoding_and_decoding_text_match_the_library(pair: tuple[Tokenizer, HFTokenizer], text: str) -> None:
    ours, library = pair
    for special in (True, False):
        expected = library.encode(text, add_special_tokens=special).ids
        assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
        for skip in (True, False):
            assert ours.decode(expected, skip_special=skip) == library.decode(expected, skip_special_tokens=skip)


@FUZZ
@given(data=st.data())
def test_decoding_any_ids_matches_the_library(pair: tuple[Tokenizer, HFTokenizer], data: st.DataObject) -> None:
    """Byte tokens that do and do not make characters, special tokens, ids past the vocabulary."""
    ours, library = pair
    size = len(ours.backend.tables.flags)  # type: ignore[union-attr]
    byte_ids = sorted(ours.byte_token_ids)
    one = st.one_of(st.sampled_from(byte_ids), st.sampled_from(sorted(ours.special_ids)),
                    st.integers(0, size - 1), st.integers(size, size + 10))
    ids = data.draw(st.lists(one, max_size=12))
    for skip in (True, False):
        assert ours.decode(ids, skip_special=skip) == library.decode(ids, skip_special_tokens=skip), ids


@FUZZ
@given(data=st.data())
def test_token_spellings_match_the_library(pair: tuple[Tokenizer, HFTokenizer], data: st.DataObject) -> None:
    ours, library = pair
    backend = ours.backend
    size = len(backend.tables.flags)  # type: ignore[union-attr]
    token_id = data.draw(st.integers(-1, size + 1))
    spelled = library.id_to_token(token_id) if token_id >= 0 else None
    assert (backend.id_to_token(token_id) if token_id >= 0 else None) == spelled
    text = data.draw(st.one_of(st.just(spelled or ""), st.sampled_from(FRAGMENTS), st.text(max_size=4)))
    assert backend.token_to_id(text) == library.token_to_id(text), text
    assert ours.token_text(token_id % size) == library.decode([token_id % size], skip_special_tokens=False)


@pytest.mark.parametrize("vocab", VOCABS)
def test_vocabulary_and_grammar_bytes_match_the_library(vocab: str, request: pytest.FixtureRequest) -> None:
    ours, library = request.getfixturevalue(vocab)
    backend: Any = ours.backend
    assert backend.get_vocab() == library.get_vocab(with_added_tokens=True)
    assert backend.get_vocab_size() == library.get_vocab_size(with_added_tokens=True)
    assert ({i: (t.content, t.special) for i, t in backend.get_added_tokens_decoder().items()}
            == {i: (t.content, t.special) for i, t in library.get_added_tokens_decoder().items()})
    assert backend.decoder.__getstate__() == library.decoder.__getstate__()
    size = len(backend.tables.flags)
    on_library = Tokenizer.around(library, ours.bos_token_id, set(ours.eos_token_ids))
    assert ours.special_ids == on_library.special_ids and ours.byte_token_ids == on_library.byte_token_ids
    assert token_bytes(ours, size) == token_bytes(on_library, size)


def test_a_warm_start_from_the_conversion_cache_serves_the_c_tokenizer(model_path: Path, ours: Any) -> None:
    meta = ConversionCache(file_sha256(model_path)).read_meta()
    assert meta is not None, "loading the model fills the conversion cache"
    assert isinstance(meta.tokenizer().backend, NativeSpm)


def test_pair_encodings_for_pooling_come_from_the_library(gemma: tuple[Tokenizer, HFTokenizer]) -> None:
    ours, library = gemma
    ids, types, length = ours.encode_for_pooling("a query", "a document that is long", limit=6)
    whole = library.post_process(library.encode("a query", add_special_tokens=False),
                                 library.encode("a document", add_special_tokens=False), add_special_tokens=True)
    assert (ids, types) == (whole.ids, whole.type_ids) and len(ids) == 6 and length > 6


def test_damaged_tables_or_tables_of_another_json_are_never_loaded(gemma: tuple[Tokenizer, HFTokenizer],
                                                                    tmp_path: Path) -> None:
    ours, _ = gemma
    assert ours.saved is not None
    saved, tables = tmp_path / "tokenizer.json", tables_beside(tmp_path / "tokenizer.json")
    saved.write_bytes(ours.saved.read_bytes())
    tables.write_bytes(tables_beside(ours.saved).read_bytes())
    assert NativeSpm.load(saved) is not None
    tables.write_bytes(b"PK\x03\x04 not an archive")
    assert NativeSpm.load(saved) is None
    tables.write_bytes(tables_beside(ours.saved).read_bytes()[:-100])
    assert NativeSpm.load(saved) is None
    tables.write_bytes(tables_beside(ours.saved).read_bytes())
    saved.write_bytes(ours.saved.read_bytes()[:-10])  # a damaged JSON: the library could not serve from it
    assert NativeSpm.load(saved) is None


def test_without_the_c_kernels_the_library_serves(gemma: tuple[Tokenizer, HFTokenizer],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ours, _ = gemma
    monkeypatch.setenv("LLORCH_KERNELS", "no-such-variant")
    assert ours.saved is not None and NativeSpm.load(ours.saved) is None


@pytest.mark.parametrize("kernels", ["built", "missing"])
def test_a_first_start_serves_what_a_warm_start_would(model_path: Path, gemma: tuple[Tokenizer, HFTokenizer],
                                                      kernels: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Converted into an empty cache, the vocabulary is served at once by the C tokenizer over the tables just
    built (or, without the C kernels, by the library reading the JSON just saved), and both encode as the
    warm start's tokenizer does."""
    monkeypatch.setenv("LLORCH_CACHE_DIR", str(tmp_path))
    if kernels == "missing":
        monkeypatch.setenv("LLORCH_KERNELS", "no-such-variant")
    first = tokenizer_from_gguf(GGUFFile(model_path).metadata, model_path)
    assert first.saved is not None and first.saved.is_relative_to(tmp_path)
    assert isinstance(first.backend, NativeSpm if kernels == "built" else HFTokenizer)
    warm, _ = gemma
    for text in [*FRAGMENTS, "".join(FRAGMENTS)]:
        assert first.encode(text) == warm.encode(text), text
