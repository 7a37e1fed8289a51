"""Chained prefix keys: key ``j`` stands for the scope and every unit of blocks ``0..j``.

Policies that remember what was sent where (``prefix``'s pending prefills, ``approx_prefix``)
compare requests by these keys: two requests share their first ``m`` blocks exactly when
their first ``m`` keys are equal (up to 64-bit hash collisions, harmless for an estimate).
Token ids are grouped in blocks of ``tokens_per_block`` (what a replica can reuse); text, for
back ends the router cannot tokenize for, in chunks of characters.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache

import numpy as np


_MASK = (1 << 64) - 1
_P = 0x9E3779B97F4A7C15  # odd: invertible modulo 2**64
_P_INV = pow(_P, -1, 1 << 64)
_C1, _C2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_S33, _S29 = np.uint64(33), np.uint64(29)


class _Tables:
    """Powers of ``_P`` and ``_P_INV`` modulo 2**64, and per-position odd multipliers,
    grown on demand."""

    def __init__(self) -> None:
        self.pow = self.pow_inv = self.mult = np.ones(0, dtype=np.uint64)

    def powers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.pow) < n:
            size = max(n, 2 * len(self.pow), 256)
            pw, inv, a, b = [], [], 1, 1
            for _ in range(size):
                pw.append(a)
                inv.append(b)
                a, b = a * _P & _MASK, b * _P_INV & _MASK
            self.pow, self.pow_inv = np.array(pw, np.uint64), np.array(inv, np.uint64)
        return self.pow[:n], self.pow_inv[:n]

    def multipliers(self, n: int) -> np.ndarray:
        if len(self.mult) < n:
            out, x = [], 0x243F6A8885A308D3
            for _ in range(max(n, 64)):  # splitmix64, forced odd
                x = (x + 0x9E3779B97F4A7C15) & _MASK
                z = x
                z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
                z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
                out.append((z ^ (z >> 31)) | 1)
            self.mult = np.array(out, np.uint64)
        return self.mult[:n]


_TABLES = _Tables()


@lru_cache(maxsize=4096)
def _scope_seed(scope: str) -> int:
    """The chain's start for ``scope``: odd, so that a run of all-zero units (each hashes to
    0) still gives a different key at every depth (``P**(j+1) * seed`` differs for every
    ``j`` below 2**62 only when ``seed`` is odd), and the same in every process (``hash()``
    of a str is salted per process, which made keys, and the order of sets of them, vary
    between runs)."""
    digest = hashlib.blake2b(scope.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1


def chain_keys(data: bytes, step: int, scope: str = "") -> tuple[int, ...]:
    """One key per full ``step`` bytes of ``data`` (``block_keys`` of little-endian uint32
    token ids is ``chain_keys(ids, 4 * tokens_per_block, scope)``).

    Vectorised (a Python loop over 125 blocks of a 4k-token prompt cost ~35 us): each unit
    is hashed from its words (mixed, times a multiplier per position, summed), the chain is
    ``K_j = K_(j-1) * P + h_j`` modulo 2**64 from ``K_-1 = _scope_seed(scope)``, computed
    for all ``j`` at once as ``P**j * (P * K_-1 + cumsum(h_i * P**-i))``, and each ``K_j``
    goes through a bijective finaliser. Keys are 64-bit: equal prefixes give equal keys;
    different ones collide with negligible probability (and a collision only skews an
    estimate).
    """
    n = len(data) // step
    if n == 0:
        return ()
    size = 8 if step % 8 == 0 else 4 if step % 4 == 0 else 1
    words = np.frombuffer(data, dtype=f"<u{size}", count=n * step // size)
    words = words.reshape(n, step // size)
    if size != 8:
        words = words.astype(np.uint64)
    h = (words ^ (words >> _S29)) @ _TABLES.multipliers(step // size)  # wraps mod 2**64
    h ^= h >> _S33
    h *= _C1
    h ^= h >> _S29
    pw, inv = _TABLES.powers(n)
    acc = np.cumsum(h * inv, dtype=np.uint64)
    acc += np.uint64(_P * _scope_seed(scope) & _MASK)
    acc *= pw
    acc ^= acc >> _S33
    acc *= _C2
    acc ^= acc >> _S33
    return tuple(acc.tolist())


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


def remember(seen: OrderedDict[int, None], keys: tuple[int, ...], cap: int) -> None:
    """Record ``keys`` as the most recently sent in ``seen``, an LRU set of at most ``cap``
    keys. They are touched last key first, so that a prefix's first key is its freshest:
    eviction then shortens a prefix from its end, as a replica's cache does, instead of
    taking its first key and leaving the rest unmatchable (``shared_units`` matches from the
    first key on)."""
    for k in reversed(keys):
        seen[k] = None
        seen.move_to_end(k)
    while len(seen) > cap:
        seen.popitem(last=False)
