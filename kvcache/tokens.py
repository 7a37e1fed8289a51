"""Token sequences as bytes: the form block keys are made of.

A block's key is the exact bytes of its tokens as native uint32 (``array('I')``). Keys
are compared, never hashed into something shorter, so two different blocks can never be
taken for one another.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

TOKEN_BYTES = 4
_MAX_TOKEN = 2**32 - 1


def as_token_array(tokens: Sequence[int] | array) -> array:
    """Token ids as an ``array('I')``; raises ValueError for anything not in [0, 2**32)."""
    if isinstance(tokens, array) and tokens.typecode == "I":
        return tokens
    try:
        return array("I", tokens)
    except OverflowError:
        bad = next(t for t in tokens if not 0 <= int(t) <= _MAX_TOKEN)
        raise ValueError(f"token ids must be in [0, 2**32), got {bad}") from None
    except TypeError:
        bad = next((t for t in tokens if not isinstance(t, int)), tokens)
        raise ValueError(f"token ids must be ints, got {bad!r}") from None


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Number of leading tokens two keys share.

    The XOR of the two prefixes read as big-endian integers has its highest set bit in
    the first byte where they differ; one C-level pass instead of a loop in Python.
    """
    n = min(len(a), len(b))
    diff = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    same_bytes = n if diff == 0 else n - (diff.bit_length() + 7) // 8
    return same_bytes // TOKEN_BYTES
