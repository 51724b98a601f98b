"""The tokenizer we build from GGUF metadata encodes and decodes exactly like the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from conftest import Reference
from llorch.cache import cache_dir
from llorch.weights.converted import ConversionCache, file_sha256
from llorch.weights.gguf import GGUFFile
from llorch.weights.loader import LoadedModel
from llorch.weights.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from llorch.weights.tokenizer_file import save_tokenizer

pytestmark = pytest.mark.cpu

MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé àccents: déjà vu, naïve café, Straße, øre, ñandú.",
    "中文字符测试，日本語のテキスト、한국어 문장입니다.",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "  leading spaces,   runs of spaces,\ttabs\t\t and\n\n\nnewline runs\r\n",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<table><tr><td>cell</td></tr></table> <b>bold</b>",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, ไทย",
    "def f(x):\n    return x ** 2  # comment\n",
    " ",
    "",
]


@pytest.mark.reference
@pytest.mark.parametrize("text", MULTILINGUAL)
def test_encode_decode_match_reference(ours: LoadedModel, reference: Reference, text: str) -> None:
    ids = ours.tokenizer.encode(text)
    expected = reference.tokenizer(text).input_ids
    assert ids == expected
    assert ours.tokenizer.decode(ids) == reference.tokenizer.decode(expected, skip_special_tokens=True)
    assert ours.tokenizer.decode(ids, skip_special=False) == reference.tokenizer.decode(expected)


def test_special_tokens_are_single_ids(ours: LoadedModel) -> None:
    ids = ours.tokenizer.encode("<start_of_turn>user")
    assert ids[0] == ours.config.bos_token_id
    assert ids[1] == 105  # <start_of_turn>, one token, not spelled out
    assert 106 in ours.tokenizer.eos_token_ids  # <end_of_turn> ends generation
    assert 1 in ours.tokenizer.eos_token_ids  # <eos>


def test_converted_tokenizer_is_cached_on_disk(model_path: Path, ours: LoadedModel) -> None:
    cached = list((cache_dir() / "tokenizers").glob("*.json"))
    assert cached, "the first load should have written tokenizer.json to the cache"
    again = tokenizer_from_gguf(GGUFFile(model_path).metadata, model_path)
    text = MULTILINGUAL[2]
    assert again.encode(text) == ours.tokenizer.encode(text)


@pytest.fixture(scope="module")
def warm_tokenizer(model_path: Path, ours: LoadedModel) -> Tokenizer:
    """The tokenizer a warm start parses from the conversion cache, its merges saved as strings."""
    meta = ConversionCache(file_sha256(model_path)).read_meta()
    assert meta is not None, "loading the model should have filled the conversion cache"
    return meta.tokenizer()


@pytest.mark.reference
@pytest.mark.parametrize("text", MULTILINGUAL)
def test_the_cached_tokenizer_matches_reference(warm_tokenizer: Tokenizer, reference: Reference, text: str) -> None:
    ids = warm_tokenizer.encode(text)
    assert ids == reference.tokenizer(text).input_ids
    assert warm_tokenizer.decode(ids, skip_special=False) == reference.tokenizer.decode(ids)


def test_saved_merges_are_strings_unless_a_token_holds_a_space(tmp_path: Path) -> None:
    for vocab, merges, form in (
        ({"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4}, [("a", "b"), ("ab", "c")], str),
        ({"a": 0, " ": 1, "b": 2, "a ": 3, "a b": 4}, [("a", " "), ("a ", "b")], list),
    ):
        built = HFTokenizer(BPE(vocab=vocab, merges=merges))
        # As the library wrote them, and as a SentencePiece conversion saves them: given apart from a BPE without.
        for saving, given in ((built, None), (HFTokenizer(BPE(vocab=vocab, merges=[])), merges)):
            save_tokenizer(saving, tmp_path / "tokenizer.json", given)
            saved = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"]
            assert len(saved) == len(merges) and all(isinstance(merge, form) for merge in saved), saved
            again = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
            assert again.get_vocab() == built.get_vocab()
            for text in ("abc", "ab", "a b", "ba", "cab"):
                assert again.encode(text).ids == built.encode(text).ids, text


@pytest.fixture(scope="module")
def spm_from_tokenizer_json(reference: Reference, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The reference's SentencePiece-style tokenizer saved as a Hugging Face directory, read by us."""
    directory = tmp_path_factory.mktemp("spm-tokenizer")
    reference.tokenizer.save_pretrained(directory)
    return tokenizer_from_hf_dir(directory, None, set())


@pytest.mark.reference
@pytest.mark.parametrize("text", MULTILINGUAL)
def test_tokenizer_json_of_an_spm_vocab_matches_reference(
    spm_from_tokenizer_json: Tokenizer, reference: Reference, text: str
) -> None:
    ids = spm_from_tokenizer_json.encode(text)
    expected = reference.tokenizer(text).input_ids
    assert ids == expected
    assert spm_from_tokenizer_json.decode(ids) == reference.tokenizer.decode(expected, skip_special_tokens=True)
    assert spm_from_tokenizer_json.decode(ids, skip_special=False) == reference.tokenizer.decode(expected)


@pytest.mark.cpu
@pytest.mark.parametrize("text", [t for t in MULTILINGUAL if "<" not in t])
def test_gguf_sentencepiece_vocab_with_space_prefix_matches_sentencepiece(
    sentencepiece_vocab: tuple[object, Tokenizer], text: str
) -> None:
    """SentencePiece itself is the reference for plain text (it knows no special tokens)."""
    sp, ours = sentencepiece_vocab
    expected = [sp.bos_id(), *sp.encode(text)]  # type: ignore[attr-defined]
    assert ours.encode(text) == expected
    assert ours.decode(expected) == sp.decode(expected)  # type: ignore[attr-defined]
