"""Counter-based random numbers: a draw depends only on ``(seed, counter, token id)``.

Why: a job's output must not depend on which other jobs share its batch, and per-row
``torch.Generator`` objects cannot be batched. So each row gets a 64-bit key from its
``(seed, counter)`` on the host (splitmix64, exact Python integers), split into two 32-bit words
``a``, ``b``; on the device every token id ``t`` is hashed as ``mix(mix(t + a) ^ b)`` where
``mix`` is a two-round xor-shift-multiply integer hash ("lowbias32"-style, constants from the
hash-prospector search, both below 2**31 so that every product of a 32-bit value stays below
2**63: int64 arithmetic never overflows, on any backend). The top 24 bits give a uniform
``u`` in (0, 1); the Gumbel-max trick ``argmax(logit + -log(-log u))`` then draws a token
exactly from ``softmax(logits)`` with no sort, cumsum or normalisation.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_M1 = 0x21F0AAAD
_M2 = 0x735A2D97
# `row_keys`' splitmix64 constants as numpy scalars.
_GOLDEN, _MIX1, _MIX2 = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9),
                         np.uint64(0x94D049BB133111EB))
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_LITTLE_ENDIAN = sys.byteorder == "little"


def splitmix64(x: int) -> int:
    """One splitmix64 output for state ``x`` (host, exact)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@lru_cache(maxsize=4096)
def seed_key(seed: int) -> int:
    """The part of `row_key` that depends on the seed alone (remembered: a job keeps its
    seed, so its key is computed once)."""
    return splitmix64(seed & _MASK64)


def row_key(seed: int, counter: int) -> tuple[int, int]:
    """The two 32-bit words keying the draw number ``counter`` of a job seeded ``seed``."""
    k = splitmix64(seed_key(seed) ^ (counter & _MASK64))
    return k & _MASK32, k >> 32


def row_keys(seed_keys: Sequence[int] | np.ndarray, counters: Sequence[int]) -> np.ndarray:
    """`row_key` of many rows at once, from each row's `seed_key` (ints, or a uint64 array) and
    counter: int64 ``[rows, 2]`` (the words ``a``, ``b``). Vectorized splitmix64 (uint64
    arithmetic wraps like the masked Python integers); counters must fit in int64."""
    # In place on the one new array, with the constants built once: this runs every step.
    x = np.array(counters, dtype=np.int64).view(np.uint64)
    x ^= np.asarray(seed_keys, dtype=np.uint64)
    x += _GOLDEN
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31
    if _LITTLE_ENDIAN:  # the low word is a, the high word b: split by a view, not two ops
        return x.view(np.uint32).reshape(-1, 2).astype(np.int64)
    return np.stack([x & np.uint64(_MASK32), x >> np.uint64(32)], axis=1).astype(np.int64)


def host_uniform(seed: int, counter: int, stream: int) -> float:
    """A uniform in (0, 1) for per-row decisions taken on the host (e.g. whether XTC fires);
    ``stream`` separates independent decisions of the same draw."""
    a, b = row_key(seed, counter)
    h = _mix32_int(_mix32_int((stream + a) & _MASK32) ^ b)
    return ((h >> 8) + 0.5) / float(1 << 24)


def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * _M1) & _MASK32
    x ^= x >> 15
    x = (x * _M2) & _MASK32
    return x ^ (x >> 15)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """In-place two-round hash of int64 values in [0, 2**32)."""
    x ^= x >> 16
    x.mul_(_M1).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_M2).bitwise_and_(_MASK32)
    x ^= x >> 15
    return x


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise, float32 ``[rows, n]``.

    keys: int64 ``[rows, 2]`` (the words from `row_key`), on the device.
    token_ids: int64 ``[n]`` or ``[rows, n]``: the token each column stands for.
    """
    return _log_neg_log_uniform(keys, token_ids).neg_()


def perturb(values: torch.Tensor, keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``values + gumbel_noise(keys, token_ids)``, bit for bit (IEEE ``v - w`` is
    ``v + (-w)``), one kernel fewer: the noise's last negation is folded into the sum.

    values: float32 ``[rows, n]``, the logits of the tokens ``token_ids`` stands for.
    """
    return values.sub(_log_neg_log_uniform(keys, token_ids))


def _log_neg_log_uniform(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``log(-log(u))`` of every row's hashed uniforms: minus the Gumbel noise."""
    a = keys[:, :1]
    b = keys[:, 1:]
    h = _mix32((token_ids + a).bitwise_and_(_MASK32))
    h = _mix32(h.bitwise_xor_(b))
    return open_uniform(h).log_().neg_().log_()


def open_uniform(h: torch.Tensor) -> torch.Tensor:
    """Hashes in [0, 2**32) to float32 uniforms strictly inside (0, 1): ``(k + 0.5) / 2**23``
    with ``k`` the top 23 bits.

    23 bits, not 24: (2**24 - 1) + 0.5 rounds to 2**24 in float32, which gave u == 1.0 and
    +inf noise, so a filtered-out (-inf) token could win the argmax as NaN. Computed as
    ``(2k + 1) * 2**-24`` (``2k + 1`` is ``(h >> 8) | 1``): every step is exact in float32
    (``2k + 1 < 2**24``; a power-of-two scale), so it is the same value, in one kernel fewer
    where the integer-to-float conversion happens inside the multiplication."""
    odd = (h >> 8).bitwise_or_(1)
    if torch.get_default_dtype() == torch.float32:  # int * float scalar gives float32
        return odd.mul(1.0 / (1 << 24))
    return odd.to(torch.float32).mul_(1.0 / (1 << 24))
