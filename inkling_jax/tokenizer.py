"""The Inkling tokenizer: a checkpoint directory's byte-level BPE `tokenizer.json` with the model's special
tokens, and streaming detokenization that never emits part of a character.

    tokenizer = Tokenizer.from_checkpoint(DIR)
    ids = tokenizer.encode("hello")                        # user text: special-token strings stay text
    ids = tokenizer.encode("<|message_user|>hi", special_tokens=True)   # chat framing
    stream = IncrementalDecoder(tokenizer)
    text = "".join(stream.push([token]) for token in generated) + stream.flush()
"""

from __future__ import annotations

import codecs
import json
import operator
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path

import tokenizers
from tokenizers import decoders

from inkling_jax.config import TextConfig

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

EOS_TOKEN = "<|content_model_end_sampling|>"
PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|begin_of_text|>"

SPECIAL_TOKEN_IDS: dict[str, int] = {
    "<|unused|>": 199998,
    PAD_TOKEN: 199999,
    "<|message_user|>": 200000,
    "<|message_model|>": 200001,
    "<|message_system|>": 200002,
    "<|message_tool|>": 200003,
    "<|content_text|>": 200004,
    "<|content_image|>": 200005,
    EOS_TOKEN: 200006,
    "<|content_thinking|>": 200008,
    "<|end_message|>": 200010,
    "<|content_audio_input|>": 200020,
    "<|content_tool_error|>": 200022,
    "<|audio|>": 200023,
    "<|content_xml|>": 200024,
    BOS_TOKEN: 200028,
    "<|audio_end|>": 200043,
    "<|content_invoke_tool_json|>": 200049,
    "<|content_invoke_tool_text|>": 200057,
}  # the released model's named special tokens at their ids, in id order

# The block of ids the released model reserves for special tokens: those not named above are `<|unused_ID|>`
# (200053 and 200054 serve as the audio and image placeholders).
SPECIAL_ID_RANGE = range(199998, 200058)


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or does not fit its model, or ids it does not know; the message says which."""


def _byte_level_alphabet() -> tuple[str, ...]:
    """GPT-2's byte-to-character map (index = byte) in which byte-level BPE vocabularies are written: printable
    Latin-1 bytes stand for themselves, the other 68 bytes for the code points 256 and up, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(256, 512))
    return tuple(chr(byte) if byte in printable else chr(next(others)) for byte in range(256))


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
_BYTE_OF_CHAR = {char: byte for byte, char in enumerate(BYTE_LEVEL_ALPHABET)}


def _token_bytes(token: str) -> bytes:
    """A token's bytes as the ByteLevel decoder renders them: through the byte alphabet when every character is
    in it, else (an added token such as `<|中|>`) its UTF-8."""
    try:
        return bytes(_BYTE_OF_CHAR[char] for char in token)
    except KeyError:
        return token.encode()


class Tokenizer:
    """A byte-level BPE tokenizer (`tokenizers.Tokenizer` with a ByteLevel decoder) and its special tokens.

    Attributes: `special_tokens` (string -> id), `eos_token_id`, `vocab_size` (one more than the largest id),
    `source` (what error messages call it).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_token: str = EOS_TOKEN, source: str = "tokenizer"):
        """`source` names the tokenizer in error messages (from_checkpoint passes the file)."""
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            raise TokenizerError(f"{source}: the decoder is {type(tokenizer.decoder).__name__}, not ByteLevel")
        eos = tokenizer.token_to_id(eos_token)
        if eos is None:
            raise TokenizerError(f"{source}: no EOS token {eos_token!r}")
        self.source = source
        self.eos_token_id: int = eos
        self._tokenizer = tokenizer
        self._plain = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True  # special-token strings are split and encoded like any text
        added = sorted(tokenizer.get_added_tokens_decoder().items())
        self.special_tokens: dict[str, int] = {token.content: i for i, token in added if token.special}
        self._special_ids = frozenset(self.special_tokens.values())
        self._vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(self._vocab.values()) + 1
        contiguous = len(self._vocab) == self.vocab_size
        self._known = range(self.vocab_size) if contiguous else frozenset(self._vocab.values())

    def serialized(self) -> str:
        """The tokenizer as tokenizer.json's text (what other tokenizer libraries load)."""
        return self._tokenizer.to_str()

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path) -> Tokenizer:
        """The tokenizer of a checkpoint directory: its tokenizer.json, with the EOS token named by
        tokenizer_config.json's `eos_token` when that file exists (`<|content_model_end_sampling|>` otherwise)."""
        path = Path(checkpoint) / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"{path} not found: the checkpoint has no tokenizer")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # the library raises a bare Exception for unreadable or malformed files
            raise TokenizerError(f"{path} is not a valid tokenizer: {error}") from error
        return cls(tokenizer, eos_token=_eos_token(Path(checkpoint) / TOKENIZER_CONFIG_FILE), source=str(path))

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        """The ids of `text`. Special-token strings in it become their ids only with `special_tokens=True`
        (for rendering chat framing); otherwise they are encoded as plain text, so user input cannot forge
        framing tokens. The batch call releases the GIL while it works (a single `encode` holds it: seconds on a
        long prompt, during which no other thread of the server runs)."""
        tokenizer = self._tokenizer if special_tokens else self._plain
        return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) from its UTF-8 length alone (no token is longer than the longest
        vocabulary entry), so that text which cannot fit a context is refused before it is encoded; 0 when the
        tokenizer normalizes text (which may shorten it)."""
        if self._tokenizer.normalizer is not None:
            return 0
        return -(-len(text.encode("utf-8", errors="surrogatepass")) // self._longest_piece)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `ids`; invalid UTF-8 (such as a character cut short) becomes U+FFFD."""
        return self._tokenizer.decode_batch([self._checked(ids)], skip_special_tokens=skip_special_tokens)[0]

    def token_bytes(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> bytes:
        """The bytes that `decode` turns into text, so that streaming can decode them incrementally."""
        pieces = self._pieces
        skipped = self._special_ids if skip_special_tokens else frozenset()
        return b"".join(pieces[i] for i in self._checked(ids) if i not in skipped)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (a byte-level BPE string or a special token), None if there is none."""
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id`, None if there is none."""
        return self._tokenizer.id_to_token(token_id)

    def check_against(self, text: TextConfig) -> None:
        """Raise TokenizerError unless the model can read every token id and agrees on the EOS token."""
        if self.vocab_size > text.unpadded_vocab_size:
            raise TokenizerError(
                f"{self.source}: token ids go up to {self.vocab_size - 1}, beyond the model's vocabulary of "
                f"{text.unpadded_vocab_size} (unpadded_vocab_size)"
            )
        eos = text.eos_token_id
        if eos is not None and self.eos_token_id not in (eos if isinstance(eos, tuple) else (eos,)):
            raise TokenizerError(
                f"{self.source}: the EOS token is id {self.eos_token_id}, but the model config's eos_token_id is {eos}"
            )

    @cached_property
    def _longest_piece(self) -> int:
        """The most bytes one token stands for (special tokens' text included)."""
        return max(1, *map(len, self._pieces))

    def _checked(self, ids: Iterable[int]) -> list[int]:
        """`ids` as a list of ints, every one in the vocabulary, else TokenizerError."""
        ids = [operator.index(i) for i in ids]
        unknown = [i for i in ids if i not in self._known]
        if unknown:
            raise TokenizerError(f"token id {unknown[0]} is not in the vocabulary of {self.source}")
        return ids

    @cached_property
    def _pieces(self) -> list[bytes]:
        """Each id's bytes (holes in the ids, which `_checked` rejects, stay empty); built on first use."""
        pieces = [b""] * self.vocab_size
        for token, i in self._vocab.items():
            pieces[i] = _token_bytes(token)
        return pieces


def _eos_token(config_path: Path) -> str:
    """The EOS token that tokenizer_config.json names (a string or an AddedToken-style object), if it exists."""
    if not config_path.is_file():
        return EOS_TOKEN
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(f"{config_path} is not valid JSON: {error}") from error
    eos = config.get("eos_token", EOS_TOKEN) if isinstance(config, dict) else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        raise TokenizerError(f"{config_path}: eos_token must be a token string, got {eos!r}")
    return eos


class IncrementalDecoder:
    """Streaming detokenization of one generation. `push` returns only final text: byte-level BPE tokens can
    split a multi-byte character, and its first bytes are held back until the rest arrive. `flush` ends the
    stream, returning what is left (U+FFFD for an unfinished character). All the pieces add up to
    `Tokenizer.decode` of all the ids, at O(1) work per token: each token's bytes go through an incremental
    UTF-8 decoder, which holds back at most the three bytes of an unfinished character."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Iterable[int]) -> str:
        """The text that `token_ids` complete (possibly empty)."""
        data = self._tokenizer.token_bytes(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._utf8.decode(data)

    def flush(self) -> str:
        """The end of the stream: the held-back bytes of an unfinished character, as U+FFFD."""
        return self._utf8.decode(b"", final=True)
