"""Merge of split-KV partial attention outputs (flash-decoding's second step).

A split-KV decode kernel leaves, per (split, request, query row), an output
normalised over its split's keys and that split's log-sum-exp in base 2 (``-inf``
for a split with no keys). The merge is a softmax over the splits' LSEs
weighting their outputs; attention sinks and ``v_scale`` are applied after it:

    m = max_s lse_s;  w_s = 2^(lse_s - m);  o = sum_s w_s o_s / sum_s w_s
    lse = (m + log2 sum_s w_s) * ln 2                (natural log, returned)
    o *= 1 / (1 + e^(sink_h - lse))                  (sinks; h = row % Hq)
    o *= v_scale

A row whose splits are all empty gives ``o = 0``, ``lse = -inf`` (sinks leave it 0).
An empty split's partial output is never read (the kernels skip its loads: its weight
is 0, and a short request leaves the splits past its keys empty), so it may hold
anything, NaN included.

Two implementations, same results:

* :func:`_combine_kernel`: one Triton-language kernel launched through jax-triton
  (``triton_glue``), one program per (request, query row, column block) that
  loads all splits at once (in chunks of at most 256, merged online) and stores
  once. Instructions sm80 has; head_dim a power of two. For partials in the layout of
  the per-KV-head decode kernel (:class:`HeadsLayout`), :func:`_combine_heads_kernel`:
  one program per (item, column block) with all of the item's rows, the rows scattered
  to their places in the output on the store.
* :func:`_combine_xla`: the same arithmetic as XLA ops (several kernels; a
  :class:`HeadsLayout` is moved to the rows layout first).

:func:`combine_splits` picks: nothing to merge with one split; the Triton kernel
when asked for and jax-triton is available on a GPU; the XLA ops otherwise (CPU,
Mosaic GPU interpreter, no jax-triton).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jattn.pallas_kernels.triton_glue import device_fn

try:  # the kernel source needs triton.language only when it is compiled or interpreted
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton not installed: XLA combine only
    tl = None

__all__ = [
    "combine_splits",
    "HeadsLayout",
    "heads_launch_params",
    "combine_launch_params",
    "choose_num_splits",
    "wave_splits",
    "invariant_num_splits",
    "INVARIANT_SPLIT_TOKENS",
    "NUM_SMS",
]

_LN2 = math.log(2.0)
_ELEMS = 8192  # partial-output elements one program loads per chunk (64 per thread)
_MIN_COLS = 32  # narrowest column block
_MAX_CHUNK = _ELEMS // _MIN_COLS


# ---------------------------------------------------------------------------
# Triton kernels.
@device_fn
def _merged(m_i, l_i):
    """``(lse_nat, factor, empty)`` of merged rows with running max ``m_i`` and sum ``l_i``
    (base 2): the natural-log LSE and ``1 / l``, ``-inf`` and 0 where no split had keys."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    m_safe = tl.where(empty, 0.0, m_i)
    lse_nat = tl.where(empty, float("-inf"), (m_safe + tl.log2(l_safe)) * 0.6931471805599453)
    return lse_nat, tl.where(empty, 0.0, 1.0 / l_safe), empty


def _combine_kernel(
    # inputs
    lse_ptr,  # f32[NUM_SPLITS, BS, ROWS_LSE] base-2 LSE of each split
    o_ptr,  # [NUM_SPLITS, BS, ROWS, D] partial outputs, normalised per split
    sink_ptr,  # f32[HQ] sinks (read when HAS_SINKS)
    vs_ptr,  # f32[1] v_scale (read when HAS_VSCALE)
    # outputs
    out_ptr,  # [BS, M_ROWS, D]
    lse_out_ptr,  # f32[BS, M_ROWS] natural-log LSE
    NUM_SPLITS: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    ROWS_LSE: tl.constexpr,
    M_ROWS: tl.constexpr,
    D: tl.constexpr,
    HQ: tl.constexpr,
    CHUNK: tl.constexpr,
    DC: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_VSCALE: tl.constexpr,
):
    """One (request b, query row r, column block c) per program."""
    b = tl.program_id(0)
    r = tl.program_id(1)
    c = tl.program_id(2)
    if NUM_SPLITS * BS * ROWS * D > 2147483647:  # partial offsets past int32 (huge batches)
        b = b.to(tl.int64)
    cols = c * DC + tl.arange(0, DC)
    lse_base = lse_ptr + b * ROWS_LSE + r
    o_base = o_ptr + b * (ROWS * D) + r * D + cols[None, :]

    # First chunk of splits.
    s = tl.arange(0, CHUNK)
    if NUM_SPLITS * BS * ROWS * D > 2147483647:
        s = s.to(tl.int64)
    ok = s < NUM_SPLITS
    lse = tl.load(lse_base + s * (BS * ROWS_LSE), mask=ok, other=float("-inf"))
    keys = ok & (lse > float("-inf"))  # an empty split's output is not read
    o = tl.load(o_base + s[:, None] * (BS * ROWS * D), mask=keys[:, None], other=0.0)
    m_i = tl.max(lse, axis=0)
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    w = tl.exp2(lse - m_use)  # 0 for an empty split
    l_i = tl.sum(w, axis=0)
    acc = tl.sum(w[:, None] * o.to(tl.float32), axis=0)
    # Further chunks (more than CHUNK splits), merged online.
    for c0 in tl.static_range(CHUNK, NUM_SPLITS, CHUNK):
        s = c0 + tl.arange(0, CHUNK)
        if NUM_SPLITS * BS * ROWS * D > 2147483647:
            s = s.to(tl.int64)
        ok = s < NUM_SPLITS
        lse = tl.load(lse_base + s * (BS * ROWS_LSE), mask=ok, other=float("-inf"))
        keys = ok & (lse > float("-inf"))  # an empty split's output is not read
        o = tl.load(o_base + s[:, None] * (BS * ROWS * D), mask=keys[:, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(lse, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        w = tl.exp2(lse - m_use)
        l_i = l_i * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o.to(tl.float32), axis=0)
        m_i = m_new

    lse_nat, factor, empty = _merged(m_i, l_i)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + r % HQ)
        factor = factor * tl.where(empty, 1.0, 1.0 / (1.0 + tl.exp(sink - lse_nat)))
    if HAS_VSCALE:
        factor = factor * tl.load(vs_ptr)
    out = acc * factor
    tl.store(out_ptr + b * (M_ROWS * D) + r * D + cols, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_out_ptr + b * M_ROWS + r, lse_nat)


def _combine_heads_kernel(
    # inputs
    lse_ptr,  # f32[NUM_SPLITS, BS, HKV, TILES, NT] base-2 LSE of each split
    o_ptr,  # [NUM_SPLITS, BS, HKV, TILES, D, NT] partial outputs, each item's transposed
    vs_ptr,  # f32[1] v_scale (read when HAS_VSCALE)
    nan_ptr,  # i8[BS, HKV, TILES, NT] rows made NaN where they saw a key (read when HAS_NAN_ROWS)
    # outputs
    out_ptr,  # [BS, M_ROWS, D]
    lse_out_ptr,  # f32[BS, M_ROWS] natural-log LSE
    NUM_SPLITS: tl.constexpr,
    BS: tl.constexpr,
    HKV: tl.constexpr,
    TILES: tl.constexpr,
    NT: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    Q_LEN: tl.constexpr,
    CHUNK: tl.constexpr,
    DC: tl.constexpr,
    HAS_VSCALE: tl.constexpr,
    HAS_NAN_ROWS: tl.constexpr,
):
    """The merge of :func:`_combine_kernel` on partials in :class:`HeadsLayout`: one (item,
    column block) per program, all ``NT`` rows of the item at once, so each load reads
    ``NT`` consecutive values. Item ``(b * HKV + h) * TILES + t``'s row ``n`` is row
    ``k = t * NT + n`` of KV head ``h`` (query ``k // G``, head ``h * G + k % G``); rows
    ``k >= Q_LEN * G`` are padding, never read or written. No sinks (the kernel that
    writes this layout takes none)."""
    item = tl.program_id(0)
    c = tl.program_id(1)
    if NUM_SPLITS * BS * HKV * TILES * NT * D > 2147483647:  # partial offsets past int32
        item = item.to(tl.int64)
    t = item % TILES
    h = (item // TILES) % HKV
    b = item // (TILES * HKV)
    n = tl.arange(0, NT)
    k = t * NT + n
    real = k < Q_LEN * G
    cols = c * DC + tl.arange(0, DC)
    lse_split = BS * HKV * TILES * NT
    lse_base = lse_ptr + item * NT + n[None, :]  # [1, NT]
    o_base = o_ptr + item * (D * NT) + cols[None, :, None] * NT + n[None, None, :]  # [1, DC, NT]

    # First chunk of splits.
    s = tl.arange(0, CHUNK)
    if NUM_SPLITS * BS * HKV * TILES * NT * D > 2147483647:
        s = s.to(tl.int64)
    ok = (s[:, None] < NUM_SPLITS) & real[None, :]  # [CHUNK, NT]
    lse = tl.load(lse_base + s[:, None] * lse_split, mask=ok, other=float("-inf"))
    keys = ok & (lse > float("-inf"))  # an empty split's output is not read
    o = tl.load(o_base + s[:, None, None] * (lse_split * D), mask=keys[:, None, :], other=0.0)
    m_i = tl.max(lse, axis=0)  # [NT]
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    w = tl.exp2(lse - m_use[None, :])  # 0 for an empty split
    l_i = tl.sum(w, axis=0)
    acc = tl.sum(w[:, None, :] * o.to(tl.float32), axis=0)  # [DC, NT]
    # Further chunks (more than CHUNK splits), merged online.
    for c0 in tl.static_range(CHUNK, NUM_SPLITS, CHUNK):
        s = c0 + tl.arange(0, CHUNK)
        if NUM_SPLITS * BS * HKV * TILES * NT * D > 2147483647:
            s = s.to(tl.int64)
        ok = (s[:, None] < NUM_SPLITS) & real[None, :]
        lse = tl.load(lse_base + s[:, None] * lse_split, mask=ok, other=float("-inf"))
        keys = ok & (lse > float("-inf"))  # an empty split's output is not read
        o = tl.load(o_base + s[:, None, None] * (lse_split * D), mask=keys[:, None, :], other=0.0)
        m_new = tl.maximum(m_i, tl.max(lse, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        w = tl.exp2(lse - m_use[None, :])
        l_i = l_i * alpha + tl.sum(w, axis=0)
        acc = acc * alpha[None, :] + tl.sum(w[:, None, :] * o.to(tl.float32), axis=0)
        m_i = m_new

    lse_nat, factor, empty = _merged(m_i, l_i)
    if HAS_VSCALE:
        factor = factor * tl.load(vs_ptr)
    out = acc * factor[None, :]
    if HAS_NAN_ROWS:  # a row marked NaN stays NaN where it saw a key
        bad = (tl.load(nan_ptr + item * NT + n, mask=real, other=0) != 0) & (l_i != 0.0)
        out = tl.where(bad[None, :], float("nan"), out)
        lse_nat = tl.where(bad, float("nan"), lse_nat)
    r = (k // G) * (HKV * G) + h * G + k % G  # [NT] the rows' places in the output
    m_rows = Q_LEN * HKV * G
    dst = out_ptr + b * (m_rows * D) + r[None, :] * D + cols[:, None]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=real[None, :])
    tl.store(lse_out_ptr + b * m_rows + r, lse_nat, mask=real & (n * 0 + c == 0))  # once per row


#: Tokens of the page-table width per split in batch-invariant decode
#: (``jattn.mha_decode_with_kvcache(batch_invariant=True)``).
INVARIANT_SPLIT_TOKENS = 256  # measured trade-off: docs/PERF.md


NUM_SMS = 132  # H200 / H100 SXM


def choose_num_splits(batch: int, m_groups: int, max_blocks: int, num_sms: int = NUM_SMS) -> int:
    """Splits per request so that batch * splits CTAs fill the SMs in whole waves.

    Only static facts are used (batch size and the page-table width): the actual
    lengths are traced values. Score = fraction of the last wave in use minus a
    small cost per extra wave; splits never exceed the number of KV blocks.
    """
    ctas = batch * m_groups
    best, best_score = 1, -1e9
    cap = max(1, min(max_blocks, 4 * num_sms))
    for s in range(1, cap + 1):
        n = ctas * s
        waves = -(-n // num_sms)
        score = n / (waves * num_sms) - 0.02 * waves
        if score > best_score + 1e-9:
            best, best_score = s, score
    return best


# A CTA's fixed cost (prologue, epilogue, its share of the combine) in KV blocks, in the
# predicted makespan a balanced split size is chosen by (both MHA decode kernels).
BALANCED_OVERHEAD_BLOCKS = 2


def balanced_split_blocks(nblk, num_splits: int, programs: int, max_blocks: int, overhead_blocks: int):
    """i32[1]: a split size in key blocks shared by every request of a call, chosen on
    the device from each request's traced block count ``nblk`` (i32[bs]): the size ``p``
    with the shortest predicted makespan ``ceil(ctas(p) / NUM_SMS) * (p +
    overhead_blocks)``, where request ``b`` takes ``programs * ceil(nblk_b / p)`` CTAs,
    among the sizes that cover the longest request in ``num_splits`` splits (the static
    split count of the launch; a request uses its first ``ceil(nblk_b / p)`` splits, the
    rest are empty CTAs); the largest ``p`` on a tie. Long requests so take more splits
    than short ones, and the CTAs' work evens out."""
    nblk = jnp.maximum(nblk, 0)
    sizes = jnp.arange(1, max(1, max_blocks) + 1, dtype=jnp.int32)  # candidate p
    ctas = programs * jnp.sum((nblk[None, :] + sizes[:, None] - 1) // sizes[:, None], axis=1)
    cost = ((ctas + NUM_SMS - 1) // NUM_SMS) * (sizes + overhead_blocks)
    smallest = jnp.maximum(1, (jnp.max(nblk, initial=0) + num_splits - 1) // num_splits)
    cost = jnp.where(sizes >= smallest, cost, jnp.iinfo(jnp.int32).max)
    best = sizes.shape[0] - 1 - jnp.argmin(cost[::-1])  # the last minimum: the largest size
    return sizes[best].reshape(1)


def balanced_split_count(static_splits: int, programs: int, max_blocks: int) -> int:
    """The static split count of a balanced launch: ``static_splits`` (the even-length
    choice), or enough splits that a request as long as the page table holds could take
    about two waves of the SMs alone, whichever is more."""
    room = -(-2 * NUM_SMS // max(1, programs))
    return max(static_splits, min(max(1, max_blocks), room))


def wave_splits(programs: int, most: int, *, waves: int = 2, cap: int = 64) -> int:
    """Splits per request so that about ``waves`` waves of ``programs * splits`` programs
    (or CTAs) cover the SMs, at most ``most`` (what the length allows: a split's shortest
    length) and ``cap``; at least 1."""
    want = -(-waves * NUM_SMS // max(1, programs))
    return max(1, min(want, most, cap))


def invariant_num_splits(width_tokens: int) -> int:
    """The split count of batch-invariant decode for a page table of ``width_tokens``
    tokens (columns * page size): one split per :data:`INVARIANT_SPLIT_TOKENS`, 1 to 64.
    It depends on the width alone, so a request's partials and their merge are the same
    in every batch."""
    return max(1, min(64, -(-int(width_tokens) // INVARIANT_SPLIT_TOKENS)))


def combine_launch_params(num_splits: int, batch: int, m_rows: int, head_dim: int):
    """``(grid, constexprs)`` of :func:`_combine_kernel` apart from the array
    shapes: one load round when the splits fit (a program takes all splits of a
    column block, at most 8192 elements); columns are split across programs
    instead (batch 1 on 132 splits: 4 programs per row, each [256, 32])."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two for the split combine kernel")
    s_pad = 1 << max(0, (num_splits - 1).bit_length())
    chunk = min(s_pad, _MAX_CHUNK)
    dc = min(head_dim, max(_MIN_COLS, _ELEMS // chunk))
    return (batch, m_rows, head_dim // dc), dict(CHUNK=chunk, DC=dc)


def heads_launch_params(num_splits: int, heads: HeadsLayout, batch: int, q_len: int, head_dim: int):
    """``(grid, constexprs, num_warps)`` of :func:`_combine_heads_kernel` apart from the
    array shapes: a program takes an item's ``width`` rows and a column block, all splits
    in one load round where ``splits * width`` is at most 4096 (chunks of that otherwise),
    ``[chunk, columns, width]`` at most 8192 elements, 64 a thread (1-4 warps)."""
    if head_dim & (head_dim - 1) or heads.width & (heads.width - 1):
        raise ValueError(f"head_dim={head_dim} and width={heads.width} must be powers of two for the split combine")
    s_pad = 1 << max(0, (num_splits - 1).bit_length())
    chunk = min(s_pad, max(1, 4096 // heads.width))
    dc = min(head_dim, _ELEMS // (chunk * heads.width))
    warps = max(1, min(4, chunk * dc * heads.width // 2048))  # at most 64 elements a thread
    items = batch * heads.kv_heads * heads.tiles
    constexprs = dict(
        NUM_SPLITS=num_splits, BS=batch, HKV=heads.kv_heads, TILES=heads.tiles, NT=heads.width, D=head_dim,
        G=heads.group, Q_LEN=q_len, CHUNK=chunk, DC=dc,
    )  # fmt: skip
    return (items, head_dim // dc), constexprs, warps


def _combine_triton(o_part, lse_part, sinks, v_scale, nan_rows, *, m_rows, num_q_heads, out_dtype, heads, q_len):
    from jattn.pallas_kernels import triton_glue

    num_splits, batch = o_part.shape[:2]
    d = o_part.shape[-2] if heads else o_part.shape[3]
    # An absent sinks / v_scale / nan_rows is never read: lse_part (f32) stands in for its
    # pointer. Any constant array would cost a kernel per call (XLA materialises a splat
    # constant by a broadcast fusion).
    has_vscale = v_scale is not None
    v_scale = lse_part if v_scale is None else jnp.reshape(jnp.asarray(v_scale, jnp.float32), (1,))
    out_shape = (
        jax.ShapeDtypeStruct((batch, m_rows, d), out_dtype),
        jax.ShapeDtypeStruct((batch, m_rows), jnp.float32),
    )
    if heads:
        grid, params, warps = heads_launch_params(num_splits, heads, batch, q_len, d)
        return triton_glue.triton_call(
            _combine_heads_kernel,
            lse_part,
            o_part,
            v_scale,
            lse_part if nan_rows is None else nan_rows.astype(jnp.int8),
            out_shape=out_shape,
            grid=grid,
            name="jattn_split_combine_heads",
            num_warps=warps,
            num_stages=1,
            HAS_VSCALE=has_vscale,
            HAS_NAN_ROWS=nan_rows is not None,
            **params,
        )
    rows = o_part.shape[2]
    grid, params = combine_launch_params(num_splits, batch, m_rows, d)
    return triton_glue.triton_call(
        _combine_kernel,
        lse_part,
        o_part,
        lse_part if sinks is None else sinks.astype(jnp.float32),
        v_scale,
        out_shape=out_shape,
        # One warp per program: its [CHUNK, DC] tile is at most 8192 elements, and the
        # split-axis reduction then stays inside the warp (no shared-memory round).
        grid=grid,
        name="jattn_split_combine",
        num_warps=1,
        num_stages=1,
        NUM_SPLITS=num_splits,
        BS=batch,
        ROWS=rows,
        ROWS_LSE=lse_part.shape[2],
        M_ROWS=m_rows,
        D=d,
        HQ=num_q_heads,
        HAS_SINKS=sinks is not None,
        HAS_VSCALE=has_vscale,
        **params,
    )


# ---------------------------------------------------------------------------
# XLA ops.
def _combine_xla(o_part, lse_part, *, m_rows):
    """Merged ``(o f32 [bs, m, D], lse f32 [bs, m] natural log, empty bool [bs, m])``."""
    o = o_part[:, :, :m_rows].astype(jnp.float32)  # [S, bs, m, D]
    lse2 = jnp.broadcast_to(lse_part[:, :, :m_rows, None], o.shape)
    o = jnp.where(jnp.isneginf(lse2), 0.0, o)  # an empty split's output is not read
    mx = jnp.max(lse2, axis=0)
    mx = jnp.where(jnp.isneginf(mx), 0.0, mx)
    w = jnp.exp2(lse2 - mx[None])  # 0 for empty splits
    wsum, o = jnp.sum(w, axis=0), jnp.sum(w * o, axis=0)
    mx, wsum = mx[..., 0], wsum[..., 0]
    empty = wsum == 0.0
    o = o / jnp.where(empty, 1.0, wsum)[..., None]
    lse = jnp.where(empty, -jnp.inf, (mx + jnp.log2(jnp.where(empty, 1.0, wsum))) * _LN2)
    return o, lse, empty


@dataclasses.dataclass(frozen=True)
class HeadsLayout:
    """The partials of a kernel with one KV head per item (``mosaic_decode_heads``), as it
    writes them: ``o [S, bs, kv_heads, tiles, D, width]`` (each item's output transposed)
    and ``lse [S, bs, kv_heads, tiles, width]``. Query ``i``, head ``h * group + j`` is row
    ``k = i * group + j`` of KV head ``h``: item ``k // width``, column ``k % width``;
    columns past the real rows are padding."""

    kv_heads: int
    group: int
    width: int
    tiles: int

    def to_rows(self, x, q_len: int, *, values: bool):
        """A heads-layout array in the rows layout: ``values`` ``[*lead, kv_heads, tiles, D,
        width] -> [*lead, q_len * Hq, D]``, else ``[*lead, kv_heads, tiles, width] ->
        [*lead, q_len * Hq]`` (the LSE, or a per-row array with no split axis)."""
        g = self.group
        if values:
            x = jnp.swapaxes(x, -3, -2)  # [*lead, hkv, D, tiles, N]
        # explicit sizes throughout: a -1 is ambiguous when a leading axis is 0 (no requests)
        x = x.reshape(*x.shape[:-2], self.tiles * self.width)[..., : q_len * g]  # [*lead, hkv, (D,) q_len * g]
        x = x.reshape(*x.shape[:-1], q_len, g)
        rows = self.kv_heads * g
        if values:  # [*lead, hkv, D, q_len, g] -> [*lead, q_len, hkv, g, D]
            x = jnp.moveaxis(jnp.moveaxis(x, -3, -1), -3, -4)
            return x.reshape(*x.shape[:-4], q_len * rows, x.shape[-1])
        x = jnp.moveaxis(x, -2, -3)  # [*lead, q_len, hkv, g]
        return x.reshape(*x.shape[:-3], q_len * rows)


def combine_splits(
    o_part,
    lse_part,
    *,
    q_len: int,
    num_q_heads: int,
    sinks,
    v_scale,
    out_dtype,
    use_kernel: bool,
    heads: HeadsLayout | None = None,
    nan_rows=None,
):
    """Merge the splits of a split-KV decode; apply sinks and ``v_scale``.

    Args:
      o_part: ``[S, bs, rows, D]`` partial outputs, each normalised over its split
        (rows >= ``q_len * num_q_heads``; row ``i * num_q_heads + h`` is query ``i``,
        head ``h``; extra rows are ignored), or in ``heads``'s layout.
      lse_part: f32 ``[S, bs, rows']`` (rows' >= q_len * num_q_heads), base-2 LSE
        of each split, ``-inf`` for a split with no keys, or in ``heads``'s layout.
      sinks: None or f32 ``[num_q_heads]``.
      v_scale: None (1.0) or an f32 scalar.
      use_kernel: merge with the Triton kernel where jax-triton runs (GPU);
        otherwise, and always under the Mosaic GPU interpreter, with XLA ops.
      heads: None, or the :class:`HeadsLayout` of ``o_part`` / ``lse_part`` (which the
        kernel reads as they are: no transpose before it; no sinks then).
      nan_rows: None, or in ``lse_part``'s layout without its split axis (``[bs, rows']``, or
        ``[bs, kv_heads, tiles, width]`` with ``heads``), nonzero for rows whose output and
        LSE become NaN where they saw a key (a split with keys); rows that saw none stay
        ``0`` / ``-inf``.

    Returns:
      ``(o [bs * q_len, num_q_heads, D] out_dtype, lse f32 [bs * q_len, num_q_heads])``.

    With one split the partial output is already final up to ``v_scale`` and sinks:
    no work at all when ``v_scale`` is None, there are no sinks and no rows need
    slicing (each op after the decode kernel is one more kernel).
    """
    if heads and sinks is not None:
        raise ValueError("combine_splits: sinks need partials in the rows layout (heads=None)")
    num_splits, batch = o_part.shape[:2]
    head_dim = o_part.shape[-2] if heads else o_part.shape[3]
    m = q_len * num_q_heads
    out_shape = (batch * q_len, num_q_heads, head_dim)
    # (no rows: XLA's ops give the empty outputs; the kernel has no empty launch)
    if num_splits > 1 and use_kernel and batch * m > 0 and _kernel_runs_here(head_dim):
        o, lse = _combine_triton(
            o_part, lse_part, sinks, v_scale, nan_rows,
            m_rows=m, num_q_heads=num_q_heads, out_dtype=jnp.dtype(out_dtype), heads=heads, q_len=q_len,
        )  # fmt: skip
        o, lse = o.reshape(out_shape), lse.reshape(out_shape[:2])
        if nan_rows is not None and not heads:  # (the heads-layout kernel applies them itself)
            o, lse = _nan_rows(o, lse, nan_rows, m)
        return o.astype(out_dtype), lse
    if heads:
        o_part = heads.to_rows(o_part, q_len, values=True)
        lse_part = heads.to_rows(lse_part, q_len, values=False)
        nan_rows = None if nan_rows is None else heads.to_rows(nan_rows, q_len, values=False)
    if num_splits == 1:
        o = o_part[0, :, :m]  # normalised; 0 for empty rows
        lse2 = lse_part[0, :, :m]
        empty = jnp.isneginf(lse2)
        lse = lse2 * _LN2  # -inf stays -inf
    else:
        o, lse, empty = _combine_xla(o_part, lse_part, m_rows=m)
    o = o.reshape(out_shape)
    lse = lse.reshape(out_shape[:2])
    if sinks is not None:
        sink = sinks.astype(jnp.float32)[None, :]
        factor = jnp.where(empty.reshape(lse.shape), 1.0, 1.0 / (1.0 + jnp.exp(sink - lse)))
        if v_scale is not None:
            factor = factor * jnp.asarray(v_scale, jnp.float32)
        o = o.astype(jnp.float32) * factor[..., None]
    elif v_scale is not None:
        o = o.astype(jnp.float32) * jnp.asarray(v_scale, jnp.float32)
    if nan_rows is not None:
        o, lse = _nan_rows(o, lse, nan_rows, m)
    return o.astype(out_dtype), lse


def _nan_rows(o, lse, nan_rows, m: int):
    """``(o f32, lse)`` with the rows flagged in ``nan_rows`` (rows layout ``[bs, rows']``)
    NaN where they saw a key (an LSE other than ``-inf``)."""
    bad = (nan_rows[:, :m] != 0).reshape(lse.shape) & ~jnp.isneginf(lse)
    return jnp.where(bad[..., None], jnp.nan, o.astype(jnp.float32)), jnp.where(bad, jnp.nan, lse)


def _kernel_runs_here(head_dim: int) -> bool:
    from jattn.pallas_kernels import triton_glue
    from jattn.pallas_kernels.interpret import interpreting

    return (not head_dim & (head_dim - 1)) and not interpreting() and triton_glue.available()
