"""e4m3 queries for the FP8 decode kernels, each in one kernel: the per-KV-head decode
kernel's tiles (``fp8_qk``) and the MLA kernel's rows (a bf16/f16 query on an FP8 latent
cache, :func:`query_rows_e4m3`).

``mosaic_decode_heads`` gives each item (one KV head's query rows, or one row tile of
them) to the kernel as ``N`` rows in e4m3 with one power-of-two scale. Per item:

* its rows gathered from ``q [bs * q_len, Hq, D]``: row ``k < q_len * G`` is query
  ``k // G``, head ``h * G + k % G`` (``G = Hq / Hkv``); rows past them are zeros;
* a row with a non-finite entry goes in as zeros (so it sets no scale for the other rows)
  and is flagged, for the split combine to make its output NaN where it saw a key;
* ``s = 2^e``, the largest power of two with ``amax * s <= 448`` (``amax`` the item's
  largest magnitude; ``s = 1`` where it is 0), :func:`pow2_scale`;
* ``q8 = e4m3(q * s)``, rounded to nearest, ties to even, and ``factor = 1 / s``.

The MLA rows (:func:`query_rows_e4m3`): each row its own power-of-two scale by the same rule;
a row with a non-finite entry becomes e4m3 NaN (scale 1), so it comes out NaN where it sees a
key, as the exact query would.

Two implementations of each, same bits:

* :func:`_tiles_kernel`: one Triton-language program per item, launched through
  jax-triton (one kernel where the XLA ops take several: the gather, two reductions
  and the rounding);
* :func:`_tiles_xla`: the same arithmetic as XLA ops (CPU, the Mosaic GPU interpreter).

(Subnormal f32 query entries: XLA on the CPU flushes them to zero, the kernel keeps them.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn.pallas_kernels.triton_glue import device_fn

try:  # the kernel source needs triton.language only when it is compiled or interpreted
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton not installed: XLA only
    tl = None

_INT32_MAX = 2**31 - 1

__all__ = ["pow2_scale", "query_tiles", "query_rows", "tiles_launch", "query_rows_e4m3", "rows_launch", "E4M3_MAX"]

E4M3_MAX = 448.0
_MAX_EXP = 126  # the largest scale exponent: 2^126 and its inverse are normal f32


def pow2_scale(amax):
    """``2^e`` (f32), the largest power of two with ``amax * 2^e <= 448``, for finite
    ``amax >= 0``; ``e`` at most 126; 1 where ``amax`` is 0. Exact: from ``amax``'s
    exponent and mantissa bits (``448 = 1.75 * 2^8``), with no rounded division or log."""
    bits = jax.lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.int32)
    e = jnp.where(bits & 0x7FFFFF <= 0x600000, 135, 134) - (bits >> 23)
    e = jnp.where(bits > 0, jnp.minimum(e, _MAX_EXP), 0)
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def query_rows(q, hkv: int, q_len: int, padded: int):
    """q ``[bs * q_len, hq, d]`` -> ``[bs, hkv, padded, d]``: row ``i * g + j`` of KV head
    ``h`` is query ``i``, head ``h * g + j`` (``g = hq / hkv``), zero rows after them."""
    rows, hq, d = q.shape
    bs, g = rows // q_len, hq // hkv
    q5 = q.reshape(bs, q_len, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(bs, hkv, q_len * g, d)
    return jnp.pad(q5, ((0, 0), (0, 0), (0, padded - q_len * g), (0, 0)))


def _groups_e4m3(x):
    """``x [..., rows, W]``, each leading index a group of rows with one scale: ``(q8, s,
    finite)``, the rows with a non-finite entry zeroed (so they set no scale), ``s`` the
    group's :func:`pow2_scale`, ``q8 = e4m3(x * s)`` and ``finite [..., rows]``."""
    from jattn.mla_rope import quantize_query_fp8

    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x).all(axis=-1)
    x = jnp.where(finite[..., None], x, 0.0)
    s = pow2_scale(jnp.max(jnp.abs(x), axis=(-2, -1)))
    return quantize_query_fp8(x, s[..., None, None]), s, finite


def _tiles_xla(q, hkv: int, q_len: int, tiles: int, width: int):
    q_arr = query_rows(q, hkv, q_len, tiles * width)
    bs, _, rows, d = q_arr.shape
    q8, s, finite = _groups_e4m3(q_arr.reshape(bs, hkv, tiles, width, d))
    return q8.reshape(q_arr.shape), 1.0 / s, ~finite.reshape(bs, hkv, rows)


@device_fn
def _scale_exp(amax):
    """:func:`pow2_scale`'s exponent ``e`` (int32, the scale is ``2^e``) on the bits of
    ``amax``: ``448 = 1.75 * 2^8``, so 135 or 134 less ``amax``'s biased exponent; at most 126;
    0 for 0."""
    bits = amax.to(tl.int32, bitcast=True)
    e = tl.where((bits & 0x7FFFFF) <= 0x600000, 135, 134) - (bits >> 23)
    return tl.where(bits > 0, tl.minimum(e, 126), 0)


@device_fn
def _round_e4m3(x):
    """``x`` clamped to +-448 and rounded to the nearest e4m3 value, ties to even, in f32 (so
    the cast that stores it is exact): 3 mantissa bits from 2^-6 up, the subnormal step 2^-9
    below it, -0 kept. Triton 3.6's interpreter rounds the cast itself wrongly where the
    mantissa carries into the exponent (126.5 -> 64)."""
    y = tl.minimum(tl.maximum(x, -448.0), 448.0)
    u = y.to(tl.uint32, bitcast=True)
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = ((y * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)
    sub = (sub.to(tl.uint32, bitcast=True) | (u & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


def _tiles_kernel(
    q_ptr,  # [BS * Q_LEN, HQ, D] bf16/f16/f32
    q8_ptr,  # out: e4m3 [BS, HKV, TILES * NT, D]
    factor_ptr,  # out: f32 [BS, HKV, TILES]
    bad_ptr,  # out: i8 [BS, HKV, TILES * NT], 1 for a row with a non-finite entry
    HQ: tl.constexpr,
    G: tl.constexpr,
    Q_LEN: tl.constexpr,
    TILES: tl.constexpr,
    NT: tl.constexpr,
    D: tl.constexpr,
    I64: tl.constexpr,  # offsets past int32 (huge batches)
):
    """One item (request b, KV head h, tile t) per program: ``program_id = (b * HKV + h) *
    TILES + t``."""
    item = tl.program_id(0)
    if I64:
        item = item.to(tl.int64)
    t = item % TILES
    bh = item // TILES  # b * HKV + h
    hkv = HQ // G
    b, h = bh // hkv, bh % hkv
    k = t * NT + tl.arange(0, NT)
    real = k < Q_LEN * G
    src = ((b * Q_LEN + k // G) * HQ + h * G + k % G) * D
    cols = tl.arange(0, D)
    x = tl.load(q_ptr + src[:, None] + cols[None, :], mask=real[:, None], other=0.0).to(tl.float32)
    finite = tl.sum((tl.abs(x) <= 3.4028234663852886e38).to(tl.int32), axis=1) == D  # NaN and Inf fail
    x = tl.where(finite[:, None], x, 0.0)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    e = _scale_exp(amax)
    y = _round_e4m3(x * ((e + 127) << 23).to(tl.float32, bitcast=True))
    dst = item * NT + tl.arange(0, NT)
    tl.store(q8_ptr + dst[:, None] * D + cols[None, :], y.to(q8_ptr.dtype.element_ty))
    tl.store(bad_ptr + dst, (~finite).to(tl.int8))
    tl.store(factor_ptr + item, ((127 - e) << 23).to(tl.float32, bitcast=True))


def tiles_launch(q_shape, hkv: int, q_len: int, tiles: int, width: int):
    """``(grid, constexprs)`` of :func:`_tiles_kernel` for a query of ``q_shape``."""
    rows, hq, d = q_shape
    items = rows // q_len * hkv * tiles
    i64 = max(rows * hq * d, items * width * d) > _INT32_MAX
    return (items,), dict(HQ=hq, G=hq // hkv, Q_LEN=q_len, TILES=tiles, NT=width, D=d, I64=i64)


def _tiles_triton(q, hkv: int, q_len: int, tiles: int, width: int):
    from jattn.pallas_kernels import triton_glue

    rows, _, d = q.shape
    bs = rows // q_len
    grid, params = tiles_launch(q.shape, hkv, q_len, tiles, width)
    return triton_glue.triton_call(
        _tiles_kernel,
        q,
        out_shape=(
            jax.ShapeDtypeStruct((bs, hkv, tiles * width, d), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((bs, hkv, tiles), jnp.float32),
            jax.ShapeDtypeStruct((bs, hkv, tiles * width), jnp.int8),
        ),
        grid=grid,
        name="jattn_e4m3_query",
        num_warps=4,
        num_stages=1,
        **params,
    )


def query_tiles(q, hkv: int, q_len: int, tiles: int, width: int, *, use_kernel: bool = True):
    """``(q8, factor, bad)`` of the module docstring for ``q [bs * q_len, Hq, D]``:
    ``q8`` e4m3 ``[bs, hkv, tiles * width, D]``, ``factor`` f32 ``[bs, hkv, tiles]``
    (``q ~ q8 * factor``), ``bad`` ``[bs, hkv, tiles * width]`` (nonzero: the row had a
    non-finite entry; bool from XLA, int8 from the kernel). The Triton kernel where
    ``use_kernel`` and jax-triton runs (a GPU, not the Mosaic GPU interpreter); XLA ops
    otherwise."""
    rows, _, d = q.shape
    if use_kernel and rows and _kernel_runs_here(d, width):
        return _tiles_triton(q, hkv, q_len, tiles, width)
    return _tiles_xla(q, hkv, q_len, tiles, width)


def _kernel_runs_here(d: int, width: int) -> bool:
    from jattn.pallas_kernels import triton_glue
    from jattn.pallas_kernels.interpret import interpreting

    pow2 = not (d & (d - 1)) and not (width & (width - 1))
    return pow2 and not interpreting() and triton_glue.available()


# ---------------------------------------------------------------------------
# MLA: one scale per query row.
def _rows_xla(q3, m_rows8: int, tile_rows: int):
    bs, m_rows, w = q3.shape
    q8, s, finite = _groups_e4m3(q3[:, :, None])  # each row a group of one
    q8 = jnp.where(finite, q8[:, :, 0], jnp.asarray(jnp.nan, q8.dtype))
    q8 = jnp.pad(q8, ((0, 0), (0, m_rows8 - m_rows), (0, 0)))
    return q8, jnp.pad(1.0 / s, ((0, 0), (0, tile_rows - m_rows)), constant_values=1.0)


def _rows_kernel(
    q_ptr,  # [BS, M_ROWS, W] bf16/f16/f32
    q8_ptr,  # out: e4m3 [BS, M_ROWS8, W]
    factor_ptr,  # out: f32 [BS, TILE_ROWS]
    M_ROWS: tl.constexpr,
    M_ROWS8: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,  # W rounded up to a power of two
    R: tl.constexpr,  # rows per program
    I64: tl.constexpr,  # offsets past int32 (huge batches)
):
    """``R`` rows of one request per program: ``program_id = b * cdiv(TILE_ROWS, R) + block``."""
    per = (TILE_ROWS + R - 1) // R
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    b = pid // per
    rows = (pid % per) * R + tl.arange(0, R)
    cols = tl.arange(0, WP)
    real = rows < M_ROWS
    inside = cols < W
    x = tl.load(
        q_ptr + (b * M_ROWS + rows)[:, None] * W + cols[None, :], mask=real[:, None] & inside[None, :], other=0.0
    ).to(tl.float32)
    finite = tl.sum((tl.abs(x) <= 3.4028234663852886e38).to(tl.int32), axis=1) == WP  # NaN and Inf fail
    amax = tl.max(tl.abs(tl.where(finite[:, None], x, 0.0)), axis=1)
    e = _scale_exp(amax)  # per row
    y = _round_e4m3(x * ((e + 127) << 23).to(tl.float32, bitcast=True)[:, None])
    dst = q8_ptr + (b * M_ROWS8 + rows)[:, None] * W + cols[None, :]
    keep = (rows < M_ROWS8)[:, None] & inside[None, :]
    tl.store(dst, y.to(q8_ptr.dtype.element_ty), mask=keep & finite[:, None])
    # a non-finite row: the e4m3 NaN byte itself (no conversion of a NaN to rely on)
    nan_byte = tl.full((R, WP), 0x7F, tl.uint8)
    tl.store(dst.to(tl.pointer_type(tl.uint8)), nan_byte, mask=keep & ~finite[:, None])
    factor = tl.where(real, ((127 - e) << 23).to(tl.float32, bitcast=True), 1.0)
    tl.store(factor_ptr + b * TILE_ROWS + rows, factor, mask=rows < TILE_ROWS)


def rows_launch(q_shape, m_rows8: int, tile_rows: int):
    """``(grid, constexprs, num_warps)`` of :func:`_rows_kernel` for ``q3`` of ``q_shape``:
    8192 elements a program (rows of the width rounded up to a power of two), 4 warps."""
    bs, m_rows, w = q_shape
    wp = 1 << max(0, (w - 1).bit_length())
    r = max(1, min(64, 8192 // wp))
    per = -(-tile_rows // r)
    i64 = bs * max(m_rows8, tile_rows) * wp > _INT32_MAX
    params = dict(M_ROWS=m_rows, M_ROWS8=m_rows8, TILE_ROWS=tile_rows, W=w, WP=wp, R=r, I64=i64)
    return (bs * per,), params, 4


def query_rows_e4m3(q3, m_rows8: int, tile_rows: int, *, use_kernel: bool = True):
    """``(q8, factor)`` for the MLA kernel's FP8 path: ``q3 [bs, m_rows, W]`` in e4m3, each
    row scaled by :func:`pow2_scale` of its largest magnitude (a row with a non-finite
    entry: e4m3 NaN, scale 1), rows zero-padded to ``m_rows8``, and ``factor`` f32 ``[bs,
    tile_rows]`` (1 / each row's scale, 1 past the rows). The Triton kernel where
    ``use_kernel`` and jax-triton runs; XLA ops otherwise."""
    bs, m_rows, w = q3.shape
    if not m_rows <= m_rows8 <= tile_rows:
        raise ValueError(f"query_rows_e4m3: rows {m_rows} <= m_rows8 {m_rows8} <= tile_rows {tile_rows} must hold")
    if use_kernel and bs and _kernel_runs_here(64, 16):
        from jattn.pallas_kernels import triton_glue

        grid, params, warps = rows_launch(q3.shape, m_rows8, tile_rows)
        return triton_glue.triton_call(
            _rows_kernel,
            q3,
            out_shape=(
                jax.ShapeDtypeStruct((bs, m_rows8, w), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((bs, tile_rows), jnp.float32),
            ),
            grid=grid,
            name="jattn_e4m3_query_rows",
            num_warps=warps,
            num_stages=1,
            **params,
        )
    return _rows_xla(q3, m_rows8, tile_rows)
