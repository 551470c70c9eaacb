"""GGML quantized blocks written from their definition (ggml-common.h), for testing dequantizers.

`random_blocks(kind, rows, cols, rng)` draws every field of every block at random (scales as powers
of two, so each value is exact in float32), packs the fields into the bytes llama.cpp writes, and
returns those bytes with the values they stand for, computed from the fields by the formula of the
format. Nothing here dequantizes bytes, so a dequantizer under test is checked against the
format's definition, not against another dequantizer. `dequantize_q5_0` is the one decoder, from
the same definition, for checking real files of a type transformers' own dequantizer lacks.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

BLOCK_ELEMENTS = {Q.Q8_0: 32, Q.Q5_0: 32, Q.Q4_K: 256, Q.Q6_K: 256}


def _halves(values: np.ndarray) -> np.ndarray:
    """float16 scales as their little-endian bytes, [blocks, 2]."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _powers_of_two(rng: np.random.Generator, blocks: int, low: int, high: int) -> np.ndarray:
    return np.exp2(-rng.integers(low, high, blocks)).astype(np.float32)


def _q8_0(rng: np.random.Generator, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    # block_q8_0: fp16 d; int8 qs[32]. y = d * qs
    d = _powers_of_two(rng, blocks, 8, 11)
    q = rng.integers(-128, 128, (blocks, 32))
    packed = np.concatenate([_halves(d), q.astype(np.int8).view(np.uint8)], axis=1)
    return packed, d[:, None] * q


def _q5_0(rng: np.random.Generator, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    # block_q5_0: fp16 d; uint32 qh (bit j: 5th bit of element j); uint8 qs[16] (low nibble:
    # element j, high nibble: element j + 16). y = d * (q - 16)
    d = _powers_of_two(rng, blocks, 5, 8)
    q = rng.integers(0, 32, (blocks, 32)).astype(np.uint32)
    qh = ((q >> 4) << np.arange(32, dtype=np.uint32)).sum(axis=1).astype("<u4")
    qs = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    packed = np.concatenate([_halves(d), qh.view(np.uint8).reshape(-1, 4),
                             qs.astype(np.uint8)], axis=1)
    return packed, d[:, None] * (q.astype(np.float32) - 16)


def _q4_k(rng: np.random.Generator, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    # block_q4_K: fp16 d, dmin; 12 bytes of eight 6-bit scales and mins; uint8 qs[128].
    # Sub-block s (32 elements) = d * scale[s] * q - dmin * min[s]; sub-blocks 2k and 2k + 1
    # take the low and high nibbles of qs[32k : 32k + 32].
    d, dmin = _powers_of_two(rng, blocks, 12, 15), _powers_of_two(rng, blocks, 12, 15)
    scale, low = rng.integers(0, 64, (blocks, 8)), rng.integers(0, 64, (blocks, 8))
    q = rng.integers(0, 16, (blocks, 8, 32))
    packed_scales = np.concatenate([
        scale[:, :4] | ((scale[:, 4:] >> 4) << 6),
        low[:, :4] | ((low[:, 4:] >> 4) << 6),
        (scale[:, 4:] & 0xF) | ((low[:, 4:] & 0xF) << 4),
    ], axis=1).astype(np.uint8)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(blocks, 128).astype(np.uint8)
    packed = np.concatenate([_halves(d), _halves(dmin), packed_scales, qs], axis=1)
    values = (d[:, None, None] * scale[:, :, None] * q
              - (dmin[:, None] * low)[:, :, None]).reshape(blocks, 256)
    return packed, values


def _q6_k(rng: np.random.Generator, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    # block_q6_K: uint8 ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], fp16 d.
    # Element e = 128h + 32g + l (half h, group g of 4, lane l): its low 4 bits are the low
    # (g < 2) or high (g >= 2) nibble of ql[64h + 32(g % 2) + l], its top 2 bits are bits
    # 2g..2g+1 of qh[32h + l]; y = d * scales[e // 16] * (q - 32).
    d = _powers_of_two(rng, blocks, 13, 16)
    scales = rng.integers(-128, 128, (blocks, 16))
    q = rng.integers(0, 64, (blocks, 2, 4, 32))
    low, high = q & 0xF, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4),
                         low[:, :, 1] | (low[:, :, 3] << 4)], axis=2).reshape(blocks, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
          | (high[:, :, 3] << 6)).reshape(blocks, 64)
    packed = np.concatenate([ql.astype(np.uint8), qh.astype(np.uint8),
                             scales.astype(np.int8).view(np.uint8), _halves(d)], axis=1)
    values = (d[:, None] * np.repeat(scales, 16, axis=1)
              * (q.reshape(blocks, 256) - 32)).astype(np.float32)
    return packed, values


_PACKERS = {Q.Q8_0: _q8_0, Q.Q5_0: _q5_0, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}


def random_blocks(kind: Q, rows: int, cols: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(bytes [rows, bytes per row], float32 values [rows, cols]) of a random ``kind`` tensor."""
    per_block = BLOCK_ELEMENTS[kind]
    if cols % per_block:
        raise ValueError(f"{kind.name} rows hold whole blocks of {per_block}; got {cols}")
    packed, values = _PACKERS[kind](rng, rows * cols // per_block)
    return (np.ascontiguousarray(packed).reshape(rows, -1),
            values.astype(np.float32).reshape(rows, cols))


def dequantize_q5_0(raw: np.ndarray) -> np.ndarray:
    """Flat Q5_0 bytes to flat float32 values, from the block definition above."""
    blocks = raw.reshape(-1, 22)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    qh = blocks[:, 2:6].copy().view("<u4")
    bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    qs = blocks[:, 6:]
    q = np.concatenate([(qs & 0xF) | (bits[:, :16] << 4), (qs >> 4) | (bits[:, 16:] << 4)],
                       axis=1)
    return (d * (q.astype(np.float32) - 16)).reshape(-1)
