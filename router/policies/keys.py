"""Chained prefix keys: key ``j`` stands for the scope and every unit of blocks ``0..j``.

Policies that remember what was sent where (``prefix``'s pending prefills, ``approx_prefix``)
compare requests by these keys: two requests share their first ``m`` blocks exactly when
their first ``m`` keys are equal (up to 64-bit hash collisions, harmless for an estimate).
Token ids are grouped in blocks of ``tokens_per_block`` (what a replica can reuse); text, for
back ends the router cannot tokenize for, in chunks of characters.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence


def chain_keys(data: bytes, step: int, scope: str = "") -> tuple[int, ...]:
    """One key per full ``step`` bytes of ``data`` (``block_keys`` of little-endian uint32
    token ids is ``chain_keys(ids, 4 * tokens_per_block, scope)``)."""
    keys = []
    h = hash(scope)
    for start in range(0, len(data) - step + 1, step):
        h = hash((h, data[start:start + step]))
        keys.append(h)
    return tuple(keys)


def block_keys(tokens: Sequence[int], tokens_per_block: int, scope: str = "") -> tuple[int, ...]:
    """One key per full block of ``tokens``."""
    data = array("I", tokens)
    if sys.byteorder != "little":
        data.byteswap()
    return chain_keys(data.tobytes(), tokens_per_block * 4, scope)


def text_keys(text: str, chunk_chars: int = 64, scope: str = "") -> tuple[int, ...]:
    """One key per full chunk of ``chunk_chars`` characters of ``text``."""
    return chain_keys(text.encode("utf-32-le"), chunk_chars * 4, scope)


def shared_units(keys: tuple[int, ...], seen) -> int:
    """How many leading keys are in ``seen`` (a set or mapping)."""
    n = 0
    for k in keys:
        if k not in seen:
            break
        n += 1
    return n
