"""Validating user-supplied token ids against a vocabulary."""

from __future__ import annotations

from inkling_jax.config import TextConfig


class TokenIdError(ValueError):
    """Token ids that the model cannot read; the message names the offending entry."""


def validate_token_ids(ids: object, text: TextConfig) -> list[int]:
    """A non-empty list of ints in [0, unpadded_vocab_size), else TokenIdError."""
    if not isinstance(ids, list) or not ids:
        raise TokenIdError("token ids must be a non-empty JSON list of integers")
    for i, token in enumerate(ids):
        if not isinstance(token, int) or isinstance(token, bool):
            raise TokenIdError(f"token id #{i} is {token!r}, not an integer")
        if not 0 <= token < text.unpadded_vocab_size:
            raise TokenIdError(f"token id #{i} is {token}, outside the vocabulary [0, {text.unpadded_vocab_size})")
    return ids
