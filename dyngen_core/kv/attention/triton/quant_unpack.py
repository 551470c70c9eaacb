"""Codes of 4- and 8-bit pages for the q8/q4 decode kernel (`quant_decode`): keys as integers,
values as floats; loads, joins.

A page row of ``HEAD_DIM`` codes is ``WORDS`` int32 words of ``PER_WORD`` codes each (8 for 4
bits, 4 for 8 bits; `quant.format`): dim ``d`` is field ``d % PER_WORD`` of word
``d // PER_WORD``, i.e. byte ``d * BITS // 8`` of the row.

Keys (`integer_queries`, `integer_scores`): the query becomes int8 codes, one float32 scale a
row and group of 32 dims; each group of a key's codes is one int8 tensor-core dot with them
(int32 sums), times the key's group scale and the query's. 8-bit codes go to the dot as
stored. A byte of 4-bit codes holds ``u = code + 8`` of an even dim (low nibble) and the next
odd one (high); ``((u ^ 8) << 4)`` read as a signed byte is 16 times the code, so the low
codes are ``(word << 4) & 0xF0F0F0F0 ^ 0x80808080`` and the high ones
``word & 0xF0F0F0F0 ^ 0x80808080``: three instructions a word of 8 codes in inline PTX
(`signed_nibbles` with FAST; per byte in plain Triton otherwise), joined back in dim order, and
the 16 is divided out of the query's scale.

Values: field ``i`` of every word of a block of keys is one tile [keys, W_PAD] whose column
``w`` is dim ``w * PER_WORD + i`` (`field_values`); `join_columns` puts such tiles back in dim
order. Codes become floats with the exponent trick (a field OR-ed into the mantissa of a power
of two, minus that power and the code bias): no integer-to-float conversions.
`dequantized_fields` with FAST (float16 only, CUDA only: inline PTX) does the trick on two
fields of a word at once, as half2 (``lop3`` of the word, shifted, with 0x000F000F / 0x00FF00FF
and 0x6400 in each half, then one ``sub.f16x2`` and one ``mul.f16x2``): about 2 instructions a
code instead of about 5 (a shift, a mask, an or, packing, half a subtract and a multiply each).
Joined value rows (`dequantized_rows`) take the fields in the unpack's pair order
(`paired_fields`) and their middle column quarters swapped (`swapped_quarters`), which the
kernel undoes once after its key loop (`unpaired_columns`, `swapped_quarters` again).
"""

from __future__ import annotations

from dyngen_core.ops.triton_support import tl, triton

# Fields (0, 4), (1, 5), (2, 6), (3, 7) of a word of 4-bit codes as half2, each 1024 + u where
# u = code + 8; minus 1032, times the scale. $8: the word, $9: the scale (f16).
_NIBBLES_ASM = tl.constexpr("""{
.reg .b32 t<4>, s, s2, bias;
mov.b32 s2, {$9, $9};
mov.b32 bias, 0x64086408;
lop3.b32 t0, $8, 0x000F000F, 0x64006400, 0xEA;
shr.u32 s, $8, 4;
lop3.b32 t1, s, 0x000F000F, 0x64006400, 0xEA;
shr.u32 s, $8, 8;
lop3.b32 t2, s, 0x000F000F, 0x64006400, 0xEA;
shr.u32 s, $8, 12;
lop3.b32 t3, s, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t0, t0, bias;
sub.f16x2 t1, t1, bias;
sub.f16x2 t2, t2, bias;
sub.f16x2 t3, t3, bias;
mul.f16x2 t0, t0, s2;
mul.f16x2 t1, t1, s2;
mul.f16x2 t2, t2, s2;
mul.f16x2 t3, t3, s2;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}""")
# Fields (0, 2), (1, 3) of a word of signed bytes as half2: (byte ^ 0x80) | 0x6400 in one lop3
# ((a & b) ^ c), i.e. 1024 + 128 + code; minus 1152, times the scale. $4: word, $5: scale.
_BYTES_ASM = tl.constexpr("""{
.reg .b32 t<2>, s, s2, bias;
mov.b32 s2, {$5, $5};
mov.b32 bias, 0x64806480;
lop3.b32 t0, $4, 0x00FF00FF, 0x64806480, 0x6A;
shr.u32 s, $4, 8;
lop3.b32 t1, s, 0x00FF00FF, 0x64806480, 0x6A;
sub.f16x2 t0, t0, bias;
sub.f16x2 t1, t1, bias;
mul.f16x2 t0, t0, s2;
mul.f16x2 t1, t1, s2;
mov.b32 {$0, $2}, t0;
mov.b32 {$1, $3}, t1;
}""")


@triton.jit
def join_columns(t, BLOCK_M: tl.constexpr, W_PAD: tl.constexpr, PER_WORD: tl.constexpr):
    """PER_WORD tiles [BLOCK_M, W_PAD] as [BLOCK_M, W_PAD * PER_WORD], tile i giving the
    columns ``w * PER_WORD + i``."""
    if PER_WORD == 4:
        y = tl.join(tl.join(t[0], t[2]), tl.join(t[1], t[3]))
    else:
        y = tl.join(tl.join(tl.join(t[0], t[4]), tl.join(t[2], t[6])),
                    tl.join(tl.join(t[1], t[5]), tl.join(t[3], t[7])))
    return tl.reshape(y, (BLOCK_M, W_PAD * PER_WORD))


@triton.jit
def field_values(words, scales, i: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr):
    """Field ``i`` of int32 ``words`` dequantized (code times ``scales``, same shape) in ``DT``.
    A field ``u`` (the code plus its bias, 8 or 128) OR-ed into the mantissa of 1024 (fp16),
    128 (bf16, 4 bits) or 2**23 (fp32) reads as that power plus ``u``, exactly."""
    field = (words >> (BITS * i)) & ((1 << BITS) - 1)
    if BITS == 8:
        field = field ^ 0x80  # signed byte -> byte + 128
    BIAS: tl.constexpr = 8 if BITS == 4 else 128
    if DT == tl.float16:
        code = (field | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + BIAS)
        return code * scales
    elif DT == tl.bfloat16 and BITS == 4:
        code = (field | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (128.0 + BIAS)
        return code * scales
    else:
        code = (field | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)
        return (code * scales.to(tl.float32)).to(DT)


@triton.jit
def load_word_rows(base, slots, stride_s, key_valid, W_PAD: tl.constexpr, W_VALID: tl.constexpr):
    """Code words [BLOCK_N, W_PAD] of the rows at ``slots`` of one page (``base``: that page
    and KV head); invalid keys, and words from ``W_VALID`` on, read 0. Addressed as
    [BLOCK_N, 2, W_PAD / 2] (halves of rows): Triton gives a load as many contiguous elements
    a thread as the loads of the same shape around it, so a [BLOCK_N, W_PAD] tile beside the
    key groups' byte tiles would be copied to shared memory in runs of 32 (q4) or 64 (q8)
    bytes a thread, each 32-byte sector split between two copies; in their own shape the words
    go in 16 bytes a thread, whole sectors a warp. W_PAD: a power of two >= 2."""
    HALF: tl.constexpr = W_PAD // 2
    cols = tl.arange(0, 2)[:, None] * HALF + tl.arange(0, HALF)[None, :]
    mask = key_valid[:, None, None]
    if W_VALID < W_PAD:
        mask = mask & (cols < W_VALID)[None, :, :]
    tile = tl.load(base + slots[:, None, None] * stride_s + cols[None, :, :], mask=mask, other=0)
    return tl.reshape(tile, (slots.shape[0], W_PAD))


@triton.jit
def load_scales(scales_ptr, offset, slots, stride_s, key_valid, G_PAD: tl.constexpr,
                PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """float16 scales at ``scales_ptr + offset`` (the page and KV head's) for the keys at
    ``slots``, widened to the code-word columns: [BLOCK_N, G_PAD * PER_GROUP], column ``w``
    holding the scale of group ``w // PER_GROUP`` (PER_GROUP 1: one column a group). Each
    key's row of scales (contiguous, 8 bytes at head_dim 128) is one [keys, groups] tile that
    goes through cp.async in 4-byte pieces (sm_90 TTGIR), pipelined with the code words, and
    is widened in registers (`_widened`). When the columns hold no
    padding, ``offset`` and ``stride_s`` must be multiples of the group count
    (`quant_decode.check_scale_rows`): the kernel tells Triton so, which lets a row be a vector
    copy (Triton assumes nothing of a stride that is not a multiple of 16, such as 4 scales
    between KV heads). Invalid keys read 0."""
    group = tl.arange(0, G_PAD)
    mask = key_valid[:, None]
    if G_PAD * 32 > HEAD_DIM:  # a mask that varies along the row stops its vector load
        mask = mask & (group * 32 < HEAD_DIM)[None, :]
        rows_at = offset + slots * stride_s
    else:
        rows_at = tl.multiple_of(offset + slots * stride_s, G_PAD)
    rows = tl.load(scales_ptr + rows_at[:, None] + group[None, :], mask=mask, other=0)
    return _widened(rows, slots.shape[0], G_PAD, PER_GROUP)


@triton.jit
def _widened(rows, BLOCK_N: tl.constexpr, G_PAD: tl.constexpr, PER_GROUP: tl.constexpr):
    """rows [BLOCK_N, G_PAD] as [BLOCK_N, G_PAD * PER_GROUP] (PER_GROUP 1 to 8, a power of
    two), column ``c`` holding ``rows[:, c // PER_GROUP]``: each join pairs every column with
    itself, and the row-major reshape puts the pair side by side."""
    out = rows
    if PER_GROUP >= 2:
        out = tl.reshape(tl.join(out, out), (BLOCK_N, G_PAD * 2))
    if PER_GROUP >= 4:
        out = tl.reshape(tl.join(out, out), (BLOCK_N, G_PAD * 4))
    if PER_GROUP >= 8:
        out = tl.reshape(tl.join(out, out), (BLOCK_N, G_PAD * 8))
    return out


@triton.jit
def dequantized_fields(words, scales, BITS: tl.constexpr, DT: tl.constexpr,
                       FAST: tl.constexpr):
    """Every field of int32 ``words`` dequantized (times ``scales``, same shape, in ``DT``):
    a tuple of 32 / BITS tiles, field ``i`` at index ``i``. FAST (needs DT float16 and a GPU;
    `field_values` otherwise): two fields per instruction in inline PTX (module docstring)."""
    if FAST and DT == tl.float16:
        if BITS == 4:
            fields = tl.inline_asm_elementwise(
                _NIBBLES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, scales],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            fields = tl.inline_asm_elementwise(
                _BYTES_ASM, "=h,=h,=h,=h,r,h", [words, scales],
                dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:
        fields = ()
        for i in tl.static_range(32 // BITS):
            fields = fields + (field_values(words, scales, i, BITS, DT),)
    return fields


@triton.jit
def dequantized_rows(words, scales, BLOCK_N: tl.constexpr, W_PAD: tl.constexpr,
                     BITS: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr):
    """4- or 8-bit code words [BLOCK_N, W_PAD] (and their ``scales``, same shape) dequantized
    to whole rows [BLOCK_N, W_PAD * 32 / BITS] for one dot per block: with N = DIM_PAD Triton
    spreads its warps over the dims instead of repeating a [BLOCK_M, W_PAD] dot per field on
    every warp, and one layout conversion replaces one per field. The columns of each word
    come in `paired_fields` order (undo with `unpaired_columns` on whatever the rows are
    multiplied into)."""
    PER_WORD: tl.constexpr = 32 // BITS
    fields = paired_fields(dequantized_fields(words, scales, BITS, DT, FAST), PER_WORD)
    return join_columns(fields, BLOCK_N, W_PAD, PER_WORD)


@triton.jit
def paired_fields(fields, PER_WORD: tl.constexpr):
    """The fields of a word in the order the inline-PTX unpack makes them as half2 pairs:
    (0, 4), (1, 5), (2, 6), (3, 7) of 8 fields (4-bit codes), (0, 2), (1, 3) of 4 (bytes).
    Joined in this order, each pair of adjacent columns is one 32-bit register of the unpack,
    so the joined tile needs no byte permutes (PRMT) to pack its halves for the shared-memory
    store of the dot operand."""
    if PER_WORD == 8:
        return (fields[0], fields[4], fields[1], fields[5], fields[2], fields[6], fields[3],
                fields[7])
    else:
        return (fields[0], fields[2], fields[1], fields[3])


@triton.jit
def unpaired_columns(x, BLOCK_M: tl.constexpr, W_PAD: tl.constexpr, PER_WORD: tl.constexpr):
    """x [BLOCK_M, W_PAD * PER_WORD] whose columns are in `paired_fields` order per word
    (column ``w * PER_WORD + 2 h + s`` holds dim ``w * PER_WORD + s * PER_WORD / 2 + h``)
    back in dim order."""
    HALF: tl.constexpr = PER_WORD // 2
    y = tl.permute(tl.reshape(x, (BLOCK_M, W_PAD, HALF, 2)), (0, 1, 3, 2))
    return tl.reshape(y, (BLOCK_M, W_PAD * PER_WORD))


@triton.jit
def swapped_quarters(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """x [ROWS, COLS] with its second and third quarters of columns swapped (its own inverse).
    For a joined value tile of 128 columns in 4 warps (two threads a row, 64 columns each),
    the two threads of a row then store 16-byte pieces that Triton's swizzled shared layout
    (8 pieces a phase, XOR-ed with the row) puts in different banks: in dim order both
    threads' pieces of one row land in the same 8 banks, a 2-way conflict per store."""
    y = tl.permute(tl.reshape(x, (ROWS, 2, 2, COLS // 4)), (0, 2, 1, 3))
    return tl.reshape(y, (ROWS, COLS))


@triton.jit
def group_columns(x, ROWS: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
    """x [ROWS, G * W] as G tiles [ROWS, W], tile g holding columns [g * W, (g + 1) * W)."""
    if G == 1:
        return (x,)
    elif G == 2:
        a0, a1 = tl.split(tl.permute(tl.reshape(x, (ROWS, 2, W)), (0, 2, 1)))
        return (a0, a1)
    elif G == 4:
        b0, b1 = tl.split(tl.permute(tl.reshape(x, (ROWS, 2, 2, W)), (0, 3, 1, 2)))
        g0, g2 = tl.split(b0)
        g1, g3 = tl.split(b1)
        return (g0, g1, g2, g3)
    else:
        c0, c1 = tl.split(tl.permute(tl.reshape(x, (ROWS, 2, 2, 2, W)), (0, 4, 1, 2, 3)))
        b00, b01 = tl.split(c0)
        b10, b11 = tl.split(c1)
        g0, g4 = tl.split(b00)
        g2, g6 = tl.split(b01)
        g1, g5 = tl.split(b10)
        g3, g7 = tl.split(b11)
        return (g0, g1, g2, g3, g4, g5, g6, g7)


@triton.jit
def integer_queries(q, BLOCK_M: tl.constexpr, DIM_PAD: tl.constexpr, K_BITS: tl.constexpr):
    """Float32 query rows q [BLOCK_M, DIM_PAD] (rotated, scaled) as int8 codes with one float32
    scale a row and group of 32 dims (``q ~ scale * code``, the rotation keeps a group's
    values alike): a tuple of G_PAD (codes [32, BLOCK_M], scales [1, BLOCK_M]) pairs, one a
    group, transposed for `integer_scores`' dots. For 4-bit keys the scale is divided by the
    16 that those key codes come times (`signed_nibbles`)."""
    G_PAD: tl.constexpr = DIM_PAD // 32
    tiles = group_columns(q, BLOCK_M, G_PAD, 32)
    groups = ()  # one (codes, scales) pair a group
    for g in tl.static_range(G_PAD):
        rows = tiles[g]
        amax = tl.max(tl.abs(rows), 1)
        scale = tl.where(amax > 0, amax / 127.0, 1.0)
        codes = tl.floor(rows / scale[:, None] + 0.5).to(tl.int32).to(tl.int8)
        if K_BITS == 4:
            scale = scale * 0.0625
        groups = groups + ((tl.trans(codes), scale[None, :]),)  # type: ignore[assignment]
    return groups


@triton.jit
def integer_scores(qs, k_base, slots, stride_ks, ks_ptr, ks_offset, stride_kss, key_valid,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr,
                   K_BITS: tl.constexpr, FAST: tl.constexpr):
    """Scores [BLOCK_N, BLOCK_M] (float32, keys along the rows) of the integer queries ``qs``
    (`integer_queries`) against the keys at ``slots`` of one page (``k_base``: its int32 code
    words for the KV head; every row on 16 bytes, `quant_decode.check_key_rows`): one int8
    dot a group of 32 dims, times the key's scale of that group and the query's. Invalid keys
    read 0. 4-bit key rows are copied whole (with head-major pages a block's rows are one run
    of bytes) and split into groups in registers; 8-bit keys are copied one group at a time."""
    GROUP_BYTES: tl.constexpr = 4 * K_BITS
    row_bytes = tl.multiple_of(slots * (stride_ks * 4), 16)
    byte_ptr = k_base.to(tl.pointer_type(tl.int8))
    scales = load_scales(ks_ptr, ks_offset, slots, stride_kss, key_valid, G_PAD, 1,
                         HEAD_DIM).to(tl.float32)
    key_scales = group_columns(scales, BLOCK_N, G_PAD, 1)
    scores = tl.zeros([BLOCK_N, qs[0][0].shape[1]], tl.float32)
    if K_BITS == 4:
        cols = tl.arange(0, G_PAD * GROUP_BYTES)
        rows = tl.load(byte_ptr + row_bytes[:, None] + cols[None, :],
                       mask=key_valid[:, None] & (cols[None, :] < HEAD_DIM // 2), other=0)
        row_groups = group_columns(rows, BLOCK_N, G_PAD, GROUP_BYTES)
    for g in tl.static_range(G_PAD):
        if g * 32 < HEAD_DIM:
            if K_BITS == 4:
                codes = signed_nibbles(row_groups[g], BLOCK_N, FAST)
            else:
                cols = g * GROUP_BYTES + tl.arange(0, GROUP_BYTES)
                codes = tl.load(byte_ptr + row_bytes[:, None] + cols[None, :],
                                mask=key_valid[:, None], other=0)
            dots = tl.dot(codes, qs[g][0]).to(tl.float32)
            scores += (dots * tl.reshape(key_scales[g], (BLOCK_N, 1))) * qs[g][1]
    return scores


# A word of 4 bytes of two 4-bit codes each (u = code + 8): each byte's low code times 16, as
# a signed byte: ((u ^ 8) << 4) = 16 * code. $1: the word.
_LOW_NIBBLES_ASM = tl.constexpr("""{
.reg .b32 t;
shl.b32 t, $1, 4;
lop3.b32 $0, t, 0xF0F0F0F0, 0x80808080, 0x6A;
}""")
# Each byte's high code times 16: (u ^ 8) << 4 in place.
_HIGH_NIBBLES_ASM = tl.constexpr("""{
lop3.b32 $0, $1, 0xF0F0F0F0, 0x80808080, 0x6A;
}""")


@triton.jit
def signed_nibbles(codes, BLOCK_N: tl.constexpr, FAST: tl.constexpr):
    """Bytes [BLOCK_N, 16] of 4-bit codes (one group of 32 dims a row) as int8 [BLOCK_N, 32]
    of 16 times each code, in dim order (a byte's low code, then its high one). FAST: inline
    PTX on whole words (CUDA only)."""
    if FAST:
        low = tl.inline_asm_elementwise(_LOW_NIBBLES_ASM, "=r,r", [codes], dtype=tl.int8,
                                        is_pure=True, pack=4)
        high = tl.inline_asm_elementwise(_HIGH_NIBBLES_ASM, "=r,r", [codes], dtype=tl.int8,
                                         is_pure=True, pack=4)
    else:
        flipped = codes ^ -120  # 0x88
        low = flipped << 4
        high = flipped & -16
    return tl.reshape(tl.join(low, high), (BLOCK_N, 32))
