"""The synthetic checkpoints' tokenizer: byte-level BPE with an o200k-style split, trained locally on a
built-in corpus (`tokenizer_corpus.CORPUS`), with the model's special tokens, sized to the config's vocabulary.

The same config always gives the same tokenizer.json bytes. Ids cover exactly [0, unpadded_vocab_size): the
256 byte tokens at their byte values, the corpus's merges in merge order (about 1,700 at most, so a full-size
vocabulary is mostly filler), the special tokens, and `<|unused_ID|>` fillers on every other id. Special tokens
sit at their real ids when the vocabulary holds them (>= 200058 ids), else in a block at its top with
`<|content_model_end_sampling|>` exactly on the config's eos_token_id. An image model's placeholder token
(`<|unused_200054|>` in the release) is a special token too, on the config's image_token_id, so that no text
encodes to it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers

from inkling_jax.chat import DEFAULT_TEMPLATE, TEMPLATE_FILE
from inkling_jax.checkpoint.tokenizer_corpus import CORPUS
from inkling_jax.config import TextConfig
from inkling_jax.tokenizer import (
    BOS_TOKEN,
    BYTE_LEVEL_ALPHABET,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_ID_RANGE,
    SPECIAL_TOKEN_IDS,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    TokenizerError,
)

# o200k's pre-tokenizer: words with their leading space or punctuation (and English contractions), numbers of
# at most 3 digits, punctuation runs, newlines, other whitespace.
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
IMAGE_PLACEHOLDER_ID = 200054  # the released tokenizer's image placeholder, <|unused_200054|>


def special_token_ids(text: TextConfig, image_token_id: int | None = None) -> dict[str, int]:
    """Where the special tokens go in a vocabulary of `text.unpadded_vocab_size` ids: the whole reserved block
    at the real ids when it fits, else the named tokens at the top with the EOS token on the config's
    eos_token_id (the first one of several; the top id when there is none), and an image model's placeholder
    (`image_token_id`) below them. TokenizerError if impossible."""
    size = text.unpadded_vocab_size
    eos = text.eos_token_id
    eos = eos[0] if isinstance(eos, tuple) else (size - 1 if eos is None else eos)
    if size >= SPECIAL_ID_RANGE.stop:
        if eos != SPECIAL_TOKEN_IDS[EOS_TOKEN]:
            raise TokenizerError(
                f"the special tokens sit at their real ids in a vocabulary of {size}, so eos_token_id must be "
                f"{SPECIAL_TOKEN_IDS[EOS_TOKEN]} ({EOS_TOKEN}), not {eos}"
            )
        names = {i: name for name, i in SPECIAL_TOKEN_IDS.items()}
        if image_token_id not in (None, IMAGE_PLACEHOLDER_ID):
            raise TokenizerError(
                f"image_token_id must be {IMAGE_PLACEHOLDER_ID} in a full vocabulary, not {image_token_id}"
            )
        return {names.get(i, f"<|unused_{i}|>"): i for i in SPECIAL_ID_RANGE}
    block = _top_block(size, eos)
    if image_token_id is None:
        return block
    bytes_end, block_start = len(BYTE_LEVEL_ALPHABET), min(block.values())
    if not bytes_end <= image_token_id < block_start:
        raise TokenizerError(
            f"image_token_id {image_token_id} must be within [{bytes_end}, {block_start}): above the byte tokens, "
            "below the special tokens' block"
        )
    return {f"<|unused_{IMAGE_PLACEHOLDER_ID}|>": image_token_id, **block}


def _top_block(size: int, eos: int) -> dict[str, int]:
    """The named special tokens on the top ids of a small vocabulary, in their real order except for the EOS
    token, which takes the slot of `eos`."""
    names = [name for name in SPECIAL_TOKEN_IDS if name != EOS_TOKEN]
    start = size - len(SPECIAL_TOKEN_IDS)
    if start < len(BYTE_LEVEL_ALPHABET):
        raise TokenizerError(
            f"a vocabulary of {size} ids cannot hold a byte-level tokenizer: it needs {len(BYTE_LEVEL_ALPHABET)} "
            f"byte tokens and {len(SPECIAL_TOKEN_IDS)} special tokens"
        )
    if not start <= eos < size:
        raise TokenizerError(
            f"eos_token_id {eos} must be one of the top {len(SPECIAL_TOKEN_IDS)} ids [{start}, {size}) of the "
            f"vocabulary, where the special tokens go"
        )
    names.insert(eos - start, EOS_TOKEN)
    return {name: start + i for i, name in enumerate(names)}


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _train_merges(max_vocab: int) -> list[tuple[str, str]]:
    """BPE merges learned from the corpus, at most `max_vocab` - 256 of them (fewer when the corpus runs out)."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=max_vocab, initial_alphabet=list(BYTE_LEVEL_ALPHABET), show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    return [tuple(merge) for merge in json.loads(tokenizer.to_str())["model"]["merges"]]


def _vocabulary(size: int, merges: list[tuple[str, str]], specials: dict[str, int]) -> dict[str, int]:
    """Token -> id for every id below `size`: bytes, then merged tokens in merge order, the special tokens at
    their ids, fillers elsewhere. (A filler can never be a BPE token: the split keeps `<|` apart from words.)"""
    by_id = dict(enumerate(BYTE_LEVEL_ALPHABET))
    by_id.update({len(BYTE_LEVEL_ALPHABET) + i: left + right for i, (left, right) in enumerate(merges)})
    by_id.update({i: name for name, i in specials.items()})
    return {by_id.get(i, f"<|unused_{i}|>"): i for i in range(size)}


def build_tokenizer(text: TextConfig, image_token_id: int | None = None) -> tokenizers.Tokenizer:
    """The synthetic tokenizer for a model config (`image_token_id`: an image model's placeholder); TokenizerError
    when its vocabulary cannot hold one."""
    specials = special_token_ids(text, image_token_id)
    merges = _train_merges(min(specials.values()))
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab=_vocabulary(text.unpadded_vocab_size, merges, specials), merges=merges)
    )
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    return tokenizer


def write_tokenizer(out: Path, tokenizer: tokenizers.Tokenizer) -> None:
    """Write tokenizer.json, a tokenizer_config.json naming the BOS / EOS / pad tokens, and Inkling 2's chat
    template (`chat_template.jinja`, which the SMG gateway renders chats with) into `out`."""
    (out / TOKENIZER_FILE).write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    shutil.copy(DEFAULT_TEMPLATE, out / TEMPLATE_FILE)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
