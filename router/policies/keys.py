"""Chained prefix keys: key ``j`` stands for the scope and every unit of blocks ``0..j``.

Policies that remember what was sent where (``prefix``'s pending prefills, ``approx_prefix``)
compare requests by these keys: two requests share their first ``m`` blocks exactly when
their first ``m`` keys are equal (up to 64-bit hash collisions, harmless for an estimate).
Token ids are grouped in blocks of ``tokens_per_block`` (what a replica can reuse); text, for
back ends the router cannot tokenize for, in chunks of characters.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence


def _chain(scope: str, data: bytes, step: int) -> tuple[int, ...]:
    keys = []
    h = hash(scope)
    for start in range(0, len(data) - step + 1, step):
        h = hash((h, data[start:start + step]))
        keys.append(h)
    return tuple(keys)


def block_keys(tokens: Sequence[int], tokens_per_block: int, scope: str = "") -> tuple[int, ...]:
    """One key per full block of ``tokens``."""
    return _chain(scope, array("I", tokens).tobytes(), tokens_per_block * 4)


def text_keys(text: str, chunk_chars: int = 64, scope: str = "") -> tuple[int, ...]:
    """One key per full chunk of ``chunk_chars`` characters of ``text``."""
    return _chain(scope, text.encode("utf-32-le"), chunk_chars * 4)


def shared_units(keys: tuple[int, ...], seen) -> int:
    """How many leading keys are in ``seen`` (a set or mapping)."""
    n = 0
    for k in keys:
        if k not in seen:
            break
        n += 1
    return n
