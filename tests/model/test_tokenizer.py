"""The tokenizer: round trips, special tokens, streaming detokenization, the synthetic tokenizer, clear errors."""

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from paths import TINY_CONFIG
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer, special_token_ids, write_tokenizer
from inkling_jax.config import TextConfig, load_config
from inkling_jax.tokenizer import (
    BYTE_LEVEL_ALPHABET,
    EOS_TOKEN,
    SPECIAL_ID_RANGE,
    SPECIAL_TOKEN_IDS,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    IncrementalDecoder,
    Tokenizer,
    TokenizerError,
)

TINY_TEXT = load_config(TINY_CONFIG).text
FULL_TEXT = TextConfig()  # the released vocabulary: 200058 ids, EOS 200006

POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
    " \t\n\r",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "éèêàçœßñõüöäÉÀ",
    "中文日本語한국어東京桜",
    "😀👍🎉🚀🤖🌍",
    "∑√∞≈≠€£¥©…—•",
]
FRAGMENTS = [
    "def f(x):\n    return x + 1\n",
    "    ",
    "\n\n\n",
    "<|message_user|>",
    "<|content_model_end_sampling|>",
    "<|",
    "|>",
    "❤️",
    "👩‍💻",
    "🇫🇷",
    "it's",
    "1234567",
]


def random_text(rng: np.random.Generator, max_len: int = 40) -> str:
    """Characters from every pool, code fragments, special-token look-alikes and random code points."""
    parts = []
    for _ in range(rng.integers(0, max_len)):
        kind = rng.integers(0, len(POOLS) + 2)
        if kind < len(POOLS):
            pool = POOLS[kind]
            parts.append(pool[rng.integers(0, len(pool))])
        elif kind == len(POOLS):
            parts.append(FRAGMENTS[rng.integers(0, len(FRAGMENTS))])
        else:
            code = int(rng.integers(0x20, 0x10FFFF))
            parts.append(chr(code) if not 0xD800 <= code < 0xE000 else "x")  # no lone surrogates: not UTF-8
    return "".join(parts)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(out, build_tokenizer(TINY_TEXT))
    return out


@pytest.fixture(scope="module")
def tokenizer(checkpoint) -> Tokenizer:
    return Tokenizer.from_checkpoint(checkpoint)


def test_random_text_round_trips(tokenizer):
    rng = np.random.default_rng(1)
    for _ in range(300):
        text = random_text(rng)
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(tokenizer.encode(text, special_tokens=True)) == text


def test_the_trained_merges_cover_words_and_multibyte_characters(tokenizer):
    for text in ["the", " model", "中文", "😀"]:
        assert len(tokenizer.encode(text)) < len(text.encode())


def test_special_token_strings_are_ids_only_when_asked(tokenizer):
    special_ids = set(tokenizer.special_tokens.values())
    assert set(tokenizer.special_tokens) == set(SPECIAL_TOKEN_IDS)
    for name, token_id in tokenizer.special_tokens.items():
        assert tokenizer.encode(name, special_tokens=True) == [token_id]
        assert tokenizer.token_to_id(name) == token_id and tokenizer.id_to_token(token_id) == name
        text = f"say {name}twice{name}"
        framed = tokenizer.encode(text, special_tokens=True)
        assert framed.count(token_id) == 2 and tokenizer.decode(framed) == text
        plain = tokenizer.encode(text)
        assert not special_ids & set(plain)
        assert tokenizer.decode(plain) == text


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("<|message_user|>hi there<|end_message|><|message_model|>", special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi there"
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=True)
    assert "".join(decoder.push([i]) for i in ids) + decoder.flush() == "hi there"


def _splits_a_character(tokenizer: Tokenizer, ids: list[int]) -> bool:
    """Whether some token boundary falls inside a multi-byte character."""
    data = tokenizer.token_bytes(ids)
    text = data.decode()
    char_ends = set(np.cumsum([len(char.encode()) for char in text]).tolist())
    token_ends = np.cumsum([len(tokenizer.token_bytes([i])) for i in ids]).tolist()
    return any(end not in char_ends for end in token_ends)


def _stream(tokenizer: Tokenizer, ids: list[int], chunks: list[int], skip: bool = False) -> list[str]:
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
    pieces, start = [], 0
    for size in chunks:
        pieces.append(decoder.push(ids[start : start + size]))
        start += size
    assert start == len(ids)
    return [*pieces, decoder.flush()]


def _random_chunks(rng: np.random.Generator, total: int) -> list[int]:
    chunks = []
    while total > 0:
        chunks.append(int(rng.integers(0, min(total, 6) + 1)))  # empty pushes too
        total -= chunks[-1]
    return chunks


def test_streaming_valid_text_equals_decode_and_never_shows_a_partial_character(tokenizer):
    rng = np.random.default_rng(2)
    splits = 0
    for _ in range(300):
        ids = tokenizer.encode(random_text(rng), special_tokens=bool(rng.integers(0, 2)))
        splits += _splits_a_character(tokenizer, ids)
        full = tokenizer.decode(ids)
        for chunks in ([1] * len(ids), _random_chunks(rng, len(ids))):
            pieces = _stream(tokenizer, ids, chunks)
            assert "".join(pieces) == full
            assert not any("\ufffd" in piece for piece in pieces)
    assert splits > 10


def test_streaming_holds_back_the_bytes_of_a_split_character(tokenizer):
    ids = [tokenizer.token_to_id(BYTE_LEVEL_ALPHABET[byte]) for byte in "é😀".encode()]
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.push([i]) for i in ids] == ["", "é", "", "", "", "😀"]
    assert decoder.push(ids[2:4]) == "" and decoder.flush() == "\ufffd" == tokenizer.decode(ids[2:4])


def test_streaming_any_ids_equals_decode(tokenizer):
    """Random ids (invalid UTF-8, special tokens) too: replacement characters land where decode puts them."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        ids = rng.integers(0, tokenizer.vocab_size, rng.integers(0, 30)).tolist()
        for skip in (False, True):
            full = tokenizer.decode(ids, skip_special_tokens=skip)
            assert "".join(_stream(tokenizer, ids, _random_chunks(rng, len(ids)), skip)) == full


def test_streaming_added_tokens_outside_the_byte_alphabet():
    """Added tokens are rendered as the library renders them: through the byte alphabet when they can be."""
    vocab = {char: byte for byte, char in enumerate(BYTE_LEVEL_ALPHABET)}
    base = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    base.decoder = decoders.ByteLevel()
    base.add_special_tokens([AddedToken(t, special=True) for t in [EOS_TOKEN, "<|中|>", "<|é|>", "<|Ġ|>"]])
    tokenizer = Tokenizer(base)
    rng = np.random.default_rng(4)
    for _ in range(200):
        ids = rng.integers(0, tokenizer.vocab_size, rng.integers(0, 20)).tolist()
        assert "".join(_stream(tokenizer, ids, [1] * len(ids))) == tokenizer.decode(ids)


def test_synthetic_tokenizer_is_deterministic(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_tokenizer(tmp_path / name, build_tokenizer(TINY_TEXT))
    for file in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()


def test_synthetic_tokenizer_fits_the_tiny_config(tokenizer):
    assert tokenizer.vocab_size == TINY_TEXT.unpadded_vocab_size == 500
    assert tokenizer.eos_token_id == TINY_TEXT.eos_token_id == 499 == tokenizer.special_tokens[EOS_TOKEN]
    assert all(tokenizer.id_to_token(i) is not None for i in range(500))
    tokenizer.check_against(TINY_TEXT)


def test_special_tokens_sit_at_their_real_ids_in_a_full_vocabulary():
    layout = special_token_ids(FULL_TEXT)
    assert sorted(layout.values()) == list(SPECIAL_ID_RANGE)
    assert all(layout[name] == token_id for name, token_id in SPECIAL_TOKEN_IDS.items())
    assert layout["<|unused_200054|>"] == 200054 and layout["<|unused_200007|>"] == 200007
    tokenizer = Tokenizer(build_tokenizer(FULL_TEXT))
    assert tokenizer.special_tokens == layout
    assert tokenizer.vocab_size == 200058 and tokenizer.eos_token_id == 200006
    tokenizer.check_against(FULL_TEXT)
    text = "<|message_user|>Hello, 世界 😀<|end_message|>"
    assert tokenizer.decode(tokenizer.encode(text, special_tokens=True)) == text
    assert tokenizer.encode("<|message_user|>", special_tokens=True) == [200000]


def test_special_tokens_in_a_small_vocabulary_put_eos_on_the_config_id():
    text = dataclasses.replace(TINY_TEXT, unpadded_vocab_size=400, eos_token_id=(390, 5))
    layout = special_token_ids(text)
    assert layout[EOS_TOKEN] == 390 and sorted(layout.values()) == list(range(381, 400))
    others = [name for name in SPECIAL_TOKEN_IDS if name != EOS_TOKEN]
    assert sorted(others, key=layout.get) == others
    assert special_token_ids(dataclasses.replace(text, eos_token_id=None))[EOS_TOKEN] == 399


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"eos_token_id": 3}, "eos_token_id 3 must be one of the top 19 ids"),
        ({"unpadded_vocab_size": 60, "eos_token_id": 59}, "cannot hold a byte-level tokenizer"),
        ({"unpadded_vocab_size": 200058, "eos_token_id": 200010}, "eos_token_id must be 200006"),
    ],
)
def test_impossible_placements_are_clear_errors(changes, message):
    with pytest.raises(TokenizerError, match=message):
        special_token_ids(dataclasses.replace(TINY_TEXT, **changes))


def test_synthetic_checkpoints_carry_a_tokenizer_when_the_vocabulary_holds_one(tmp_path, caplog):
    out = write_checkpoint(TINY_CONFIG, tmp_path / "tiny", experts="bf16")
    Tokenizer.from_checkpoint(out).check_against(load_config(out / "config.json").text)
    tiny = {key: value for key, value in json.loads(TINY_CONFIG.read_text()).items() if key != "dspark_config"}
    small = tiny | {"vocab_size": 64, "unpadded_vocab_size": 60, "eos_token_id": 3}
    (tmp_path / "small.json").write_text(json.dumps(small))
    with caplog.at_level(logging.WARNING):
        out = write_checkpoint(tmp_path / "small.json", tmp_path / "small", experts="bf16")
    assert not (out / TOKENIZER_FILE).exists() and "gets no tokenizer" in caplog.text


def test_missing_or_corrupt_tokenizer_files_are_clear_errors(tmp_path, checkpoint):
    with pytest.raises(TokenizerError, match=f"{tmp_path / TOKENIZER_FILE} not found"):
        Tokenizer.from_checkpoint(tmp_path)
    valid = (checkpoint / TOKENIZER_FILE).read_text(encoding="utf-8")
    for content in ["not json", valid[: len(valid) // 2], '{"version": "1.0"}']:
        (tmp_path / TOKENIZER_FILE).write_text(content)
        with pytest.raises(TokenizerError, match=f"{tmp_path / TOKENIZER_FILE} is not a valid tokenizer"):
            Tokenizer.from_checkpoint(tmp_path)
    (tmp_path / TOKENIZER_FILE).write_text(valid, encoding="utf-8")
    (tmp_path / TOKENIZER_CONFIG_FILE).write_text("{")
    with pytest.raises(TokenizerError, match=f"{tmp_path / TOKENIZER_CONFIG_FILE} is not valid JSON"):
        Tokenizer.from_checkpoint(tmp_path)
    (tmp_path / TOKENIZER_CONFIG_FILE).write_text('{"eos_token": "<|no_such_token|>"}')
    with pytest.raises(TokenizerError, match="no EOS token '<\\|no_such_token\\|>'"):
        Tokenizer.from_checkpoint(tmp_path)
    (tmp_path / TOKENIZER_CONFIG_FILE).write_text('{"eos_token": {"content": "<|end_message|>"}}')
    assert Tokenizer.from_checkpoint(tmp_path).eos_token_id == special_token_ids(TINY_TEXT)["<|end_message|>"]


def test_a_tokenizer_that_does_not_fit_the_model_is_a_clear_error(tokenizer):
    with pytest.raises(TokenizerError, match="token ids go up to 499, beyond the model's vocabulary of 400"):
        tokenizer.check_against(dataclasses.replace(TINY_TEXT, unpadded_vocab_size=400, eos_token_id=399))
    with pytest.raises(TokenizerError, match="the EOS token is id 499, but the model config's eos_token_id is 7"):
        tokenizer.check_against(dataclasses.replace(TINY_TEXT, eos_token_id=7))
    tokenizer.check_against(dataclasses.replace(TINY_TEXT, eos_token_id=(7, 499)))
    tokenizer.check_against(dataclasses.replace(TINY_TEXT, eos_token_id=None))


def test_unknown_ids_and_other_decoders_are_clear_errors(tokenizer):
    for bad in ([500], [-1], [3, 10**6]):
        with pytest.raises(TokenizerError, match=f"token id {bad[-1]} is not in the vocabulary"):
            tokenizer.decode(bad)
        with pytest.raises(TokenizerError, match="is not in the vocabulary"):
            IncrementalDecoder(tokenizer).push(bad)
    other = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, EOS_TOKEN: 1}, merges=[]))
    other.decoder = decoders.BPEDecoder()
    with pytest.raises(TokenizerError, match="the decoder is BPEDecoder, not ByteLevel"):
        Tokenizer(other)
