"""Ragged prefill and paged extend attention in the Triton language (Ampere and newer).

One kernel serves both ops, as ``mosaic_prefill.py`` does for Mosaic GPU:

* **prefill** (``jattn.ops.mha_prefill``): ragged q, k, v without a cache; request
  ``b``'s queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, its keys rows
  ``cu_seqlens_kv[b]:cu_seqlens_kv[b+1]`` of k / v (``PAGE = 0``);
* **extend** (``jattn.ops.mha_extend_with_kvcache``): ragged q over a paged cache that
  already holds the new tokens; request ``b``'s keys are its first ``cache_seqlens[b]``
  tokens, gathered through ``page_table[b]`` (``PAGE`` = the page size).

Causal masks are aligned bottom-right: query ``i`` of ``n`` sees keys ``j <= L - n + i``.

Work layout: a **tile** is ``BLOCK_M`` consecutive query rows of one request; the grid
is ``(tiles, query heads)``. The tile list (:func:`tile_plan`, computed on the device
next to the launch: a cumulative sum, a segment search and a sort, no host sync) holds
every request's ``ceil(n_b / BLOCK_M)`` tiles with no padding between requests, longest
work first; slots past the real tiles are ``-1`` and exit at once. The rows past
``cu_seqlens_q[-1]`` are one more request without keys, so the kernel itself writes
every output row (0, LSE ``-inf``).

Each program walks the keys its tile can see in blocks of ``BLOCK_N``: with a causal
mask the loop stops after the tile's last query (blocks above the diagonal are never
loaded), with a sliding window it starts at the block holding the first query's first
key. Scores and ``P @ V`` are ``tl.dot`` products (mma on sm80), the softmax is online
in base 2. ``head_dim_qk = 192`` is two dots (128 + 64 columns). FP8 e4m3 K/V are
upcast to the query's dtype after the load; ``k_scale`` is in the score scale and
``v_scale``, like the sinks, is applied to the final output in the kernel.

Only the edge blocks are masked. The key walk is three loops: the blocks at the
window's start, the blocks that lie whole inside the tile's keys and are seen by every
row of the tile (below the causal diagonal, past the window's start for the tile's last
row), then the causal diagonal and the last partial block. The middle loop has no mask,
select or branch (its V goes from the async copy straight to the dot), so Triton's
software pipeliner overlaps its loads with the dots; the two others are masked and
clean V. Masked keys contribute
nothing, whatever they hold: keys outside the request (the
next request's rows, padding rows, a page's unused tail, pages past the request) are
not loaded (masked loads give 0); where a key inside the request is visible to some
rows of the tile and not to others (causal diagonal, window start), a V row holding a
non-finite value is replaced by 0 and the rows that do see it are made NaN. Scores of
masked keys are selected to ``-inf`` (never multiplied).

:func:`mha_prefill` and :func:`mha_extend` launch it from JAX through jax-triton
(``triton_glue``); ``jattn.bridge.triton_native.prefill`` launches the same source on torch tensors
(a CUDA stream, or Triton's CPU interpreter under ``TRITON_INTERPRET=1``, as the CPU
tests do). :func:`unsupported_reason` says whether a call can be served.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jattn.pallas_kernels import prefill_plan, triton_glue
from jattn.pallas_kernels.mosaic_common import empty_outputs

try:  # the kernel source needs triton.language only when it is compiled or interpreted
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton not installed
    tl = None

__all__ = [
    "mha_prefill",
    "mha_extend",
    "unsupported_reason",
    "launch_params",
    "tile_plan",
]

SUPPORTED_HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))
_LOG2E = 1.4426950408889634
_LN2 = math.log(2.0)


def _prefill_kernel(
    tile_req_ptr,  # i32[NUM_TILES]: request of each tile (-1: no tile)
    tile_q0_ptr,  # i32[NUM_TILES]: the tile's first query row within its request
    cu_q_ptr,  # i32[NREQ + 1] query offsets (the padding request last)
    kv_start_ptr,  # i32[NREQ]: first key row (ragged; 0 for paged)
    kv_len_ptr,  # i32[NREQ]: keys L per request
    pt_ptr,  # i32[NREQ, MAX_PAGES] page table (read when PAGE > 0)
    params_ptr,  # f32[2 + HQ]: softmax scale * k_scale, v_scale, sinks
    q_ptr,  # [T, HQ, D]
    k_ptr,  # ragged [NUM_KV, HKV, D] or paged [NUM_PAGES, PAGE, HKV, D]
    v_ptr,  # ragged [NUM_KV, HKV, DV] or paged [NUM_PAGES, PAGE, HKV, DV]
    o_ptr,  # [T, HQ, DV], q's dtype
    lse_ptr,  # f32[T, HQ], natural log
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    DA: tl.constexpr,  # head_dim_qk = DA + DB, both powers of two (DB = 0: one dot)
    DB: tl.constexpr,
    DV: tl.constexpr,
    PAGE: tl.constexpr,  # 0: ragged K/V
    MAX_PAGES: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,  # -1: off
    LOGIT_CAP: tl.constexpr,  # 0: off
    HAS_SINKS: tl.constexpr,
    PARTIAL: tl.constexpr,  # a key inside the request may be seen by some rows and not others
    DOT_PREC: tl.constexpr = "tf32",  # tl.dot input precision: "ieee" for f32 operands
):
    tid = tl.program_id(0)
    h = tl.program_id(1)
    D: tl.constexpr = DA + DB
    kvh = h // (HQ // HKV)
    req = tl.load(tile_req_ptr + tid)
    valid = req >= 0
    req = tl.maximum(req, 0)
    q0 = tl.load(tile_q0_ptr + tid)
    row0 = tl.load(cu_q_ptr + req)
    n_q = tl.load(cu_q_ptr + req + 1) - row0
    kv_len = tl.load(kv_len_ptr + req)
    kv0 = tl.load(kv_start_ptr + req)
    n_rows = tl.where(valid, tl.minimum(n_q - q0, BLOCK_M), 0)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    qi = q0 + rows  # query index within the request
    qpos = kv_len - n_q + qi  # each row's own key position
    # Keys the tile can see: [lo, hi).
    hi = kv_len
    if CAUSAL:
        hi = tl.minimum(hi, kv_len - n_q + q0 + n_rows)
    lo = 0
    if WINDOW >= 0:
        lo = tl.maximum(kv_len - n_q + q0 - WINDOW, 0) // BLOCK_N * BLOCK_N
    hi = tl.where(n_rows > 0, tl.maximum(hi, 0), 0)
    lo = tl.minimum(lo, hi)

    tok_row = (row0 + qi).to(tl.int64) * HQ + h  # row of [T * HQ]
    cols_a = tl.arange(0, DA)
    q_a = tl.load(q_ptr + tok_row[:, None] * D + cols_a[None, :], mask=row_ok[:, None], other=0.0)
    if DB > 0:
        cols_b = DA + tl.arange(0, DB)
        q_b = tl.load(q_ptr + tok_row[:, None] * D + cols_b[None, :], mask=row_ok[:, None], other=0.0)
    cols_v = tl.arange(0, DV)
    scale = tl.load(params_ptr) * 1.4426950408889634  # to base 2
    # A negative scale runs as a positive one on negated queries (exact), so that the
    # unmasked loop may scale the row maximum instead of every score.
    neg = scale < 0
    q_a = tl.where(neg, -q_a, q_a)
    if DB > 0:
        q_b = tl.where(neg, -q_b, q_b)
    scale = tl.abs(scale)

    # Blocks in [full_lo, full_hi) are whole and visible to every row of the tile: they
    # skip the masks. The others (the causal diagonal, the window's start, the last
    # partial block) are masked.
    first = kv_len - n_q + q0  # the first row's position: keys <= first are seen by all rows
    full_lo = lo
    if WINDOW >= 0:
        last_lo = first + n_rows - 1 - WINDOW  # keys >= last_lo are seen by all rows
        full_lo = lo + tl.maximum(last_lo - lo + BLOCK_N - 1, 0) // BLOCK_N * BLOCK_N
    full_end = hi
    if CAUSAL:
        full_end = tl.minimum(hi, first + 1)
    full_hi = full_lo + tl.maximum(full_end - full_lo, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DV), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    # Ragged K/V: one scalar base per request and head, plus offsets within a block.
    k_off_a = offs_n[:, None] * (HKV * D) + cols_a[None, :]
    if DB > 0:
        k_off_b = offs_n[:, None] * (HKV * D) + cols_b[None, :]
    v_off = offs_n[:, None] * (HKV * DV) + cols_v[None, :]
    k_base = k_ptr + (kv0.to(tl.int64) * HKV + kvh) * D
    v_base = v_ptr + (kv0.to(tl.int64) * HKV + kvh) * DV
    # Three loops, each compiled on its own (PHASE is a compile-time constant): 0 the
    # window's first blocks [lo, full_lo) and 2 the causal diagonal and the last partial
    # block [full_hi, hi), both masked; 1 the blocks between, [full_lo, full_hi), with no
    # mask, select or branch in its body, which Triton's software pipeliner overlaps.
    for PHASE in tl.static_range(3):
        if PHASE == 0:
            p_lo = lo
            p_hi = tl.minimum(full_lo, hi)
        elif PHASE == 1:
            p_lo = full_lo
            p_hi = full_hi
        else:
            p_lo = full_hi
            p_hi = hi
        if PHASE != 0 or WINDOW >= 0:
            for t0 in range(p_lo, p_hi, BLOCK_N):
                tok = t0 + offs_n
                tok_ok = tok < hi
                if PAGE > 0:
                    if PHASE == 1:
                        page = tl.load(pt_ptr + req * MAX_PAGES + tok // PAGE)
                    else:
                        page = tl.load(pt_ptr + req * MAX_PAGES + tok // PAGE, mask=tok_ok, other=0)
                    page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1)
                    kv_row = (page.to(tl.int64) * PAGE + tok % PAGE) * HKV + kvh
                    k_a_ptrs = k_ptr + kv_row[:, None] * D + cols_a[None, :]
                    if DB > 0:
                        k_b_ptrs = k_ptr + kv_row[:, None] * D + cols_b[None, :]
                    v_ptrs = v_ptr + kv_row[:, None] * DV + cols_v[None, :]
                else:
                    blk = tl.cast(t0, tl.int64)
                    k_a_ptrs = k_base + blk * (HKV * D) + k_off_a
                    if DB > 0:
                        k_b_ptrs = k_base + blk * (HKV * D) + k_off_b
                    v_ptrs = v_base + blk * (HKV * DV) + v_off
                if PHASE == 1:
                    k_a = tl.load(k_a_ptrs)
                else:
                    k_a = tl.load(k_a_ptrs, mask=tok_ok[:, None], other=0.0)
                x = tl.dot(q_a, tl.trans(k_a.to(q_a.dtype)), input_precision=DOT_PREC)
                if DB > 0:
                    if PHASE == 1:
                        k_b = tl.load(k_b_ptrs)
                    else:
                        k_b = tl.load(k_b_ptrs, mask=tok_ok[:, None], other=0.0)
                    x += tl.dot(q_b, tl.trans(k_b.to(q_b.dtype)), input_precision=DOT_PREC)
                # The unmasked loop without a logit cap scales the row maximum rather than
                # every score (scale > 0), and folds the scale into the exponent (an FMA).
                sc = scale
                if PHASE != 1 or LOGIT_CAP > 0:
                    x = x * scale
                    sc = 1.0
                    if LOGIT_CAP > 0:
                        xc = x * (1.0 / (LOGIT_CAP * 1.4426950408889634))
                        e = tl.exp(-2.0 * tl.abs(xc))
                        th = (1.0 - e) / (1.0 + e)
                        x = tl.where(xc < 0, -th, th) * (LOGIT_CAP * 1.4426950408889634)
                if PHASE == 1:
                    # Every key is visible to every row: no mask, the row maximum is finite.
                    m_new = tl.maximum(m_i, tl.max(x, axis=1) * sc)
                    alpha = tl.exp2(m_i - m_new)
                    p = tl.exp2(x * sc - m_new[:, None])
                    l_i = l_i * alpha + tl.sum(p, axis=1)
                    v = tl.load(v_ptrs).to(q_a.dtype)
                else:
                    vis = tok_ok[None, :]
                    if CAUSAL:
                        vis = vis & (tok[None, :] <= qpos[:, None])
                    if WINDOW >= 0:
                        vis = vis & (tok[None, :] >= qpos[:, None] - WINDOW)
                    x = tl.where(vis, x, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(x, axis=1))
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp2(m_i - m_use)
                    p = tl.exp2(x - m_use[:, None])
                    l_i = l_i * alpha + tl.sum(p, axis=1)
                    v = tl.load(v_ptrs, mask=tok_ok[:, None], other=0.0).to(q_a.dtype)
                    if PARTIAL:
                        finite = (v - v) == 0
                        bad = tl.max(tl.where(finite, 0.0, 1.0), axis=1)  # [BLOCK_N]: V rows with a non-finite value
                        v = tl.where(finite, v, 0.0)
                        hit = tl.max(tl.where(vis & (bad[None, :] > 0), 1.0, 0.0), axis=1)
                        l_i = l_i + tl.where(hit > 0, float("nan"), 0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(q_a.dtype), v, input_precision=DOT_PREC)
                m_i = m_new

    empty = l_i == 0.0
    m_safe = tl.where(empty, 0.0, m_i)
    denom = l_i
    if HAS_SINKS:
        sink = tl.load(params_ptr + 2 + h) * 1.4426950408889634
        denom = denom + tl.exp2(sink - m_safe)
    v_scale = tl.load(params_ptr + 1)
    inv = tl.where(empty, 0.0, v_scale / tl.where(empty, 1.0, denom))
    out = acc * inv[:, None]
    lse = tl.where(empty, float("-inf"), (m_safe + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(o_ptr + tok_row[:, None] * DV + cols_v[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + tok_row, lse, mask=row_ok)


# ----------------------------------------------------------------------------- host side


def unsupported_reason(q, k, v, **_) -> str | None:
    """None when the kernel can serve this call, else a one-line reason: ``mha_prefill``
    (``k``/``v`` ragged ``[kv_tokens, Hkv, D]``) or ``mha_extend_with_kvcache`` (``k``/``v``
    the paged caches ``[num_pages, page_size, Hkv, D]``)."""
    if q.shape[0] == 0 or q.shape[1] == 0:
        return "no query rows or heads"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"q dtype {q.dtype} (bf16/fp16)"
    if k.dtype != v.dtype:
        return f"k dtype {k.dtype} differs from v's {v.dtype}"
    if k.dtype not in (q.dtype, jnp.float8_e4m3fn):
        return f"k/v dtype {k.dtype} (q's dtype {q.dtype}, or FP8 e4m3)"
    if (reason := triton_glue.fp8_reason(k.dtype)) is not None:
        return reason
    d, dv = q.shape[-1], v.shape[-1]
    if (d, dv) not in SUPPORTED_HEAD_DIMS:
        return f"head dims {d}/{dv} (supported: {SUPPORTED_HEAD_DIMS})"
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv:
        return f"num_q_heads={hq} is not a multiple of num_kv_heads={hkv}"
    return None


def launch_params(
    d: int,
    dv: int,
    *,
    sm: int = 80,
    paged: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` by head width, compute capability
    ``sm`` (90 for sm_90) and K/V layout (``paged``: an extend over the page table),
    each overridable. Hopper (sm >= 90), the fastest of the launches timed on the H200
    (docs/PERF.md, 2026-12-02): head_dim <= 128, 64 x 64 tiles of 4 warps and three K/V
    stages for ragged K/V, 128 x 128 of 8 warps and three stages for a paged cache (half
    the page-table gathers per key); head_dim 256, 128 x 64 of 8 warps, two stages
    (192 KB of shared memory); 192/128, 128 x 64 of 8 warps, three stages. Other GPUs:
    the score tile and the f32 accumulator fit the registers of ``num_warps`` warps and
    two K/V stages fit an sm80's shared memory (not timed here: no such GPU)."""
    if sm >= 90 and max(d, dv) <= 128:
        bm0, bn0, w0, st0 = (128, 128, 8, 3) if paged else (64, 64, 4, 3)
    elif sm >= 90 and d == 256:
        bm0, bn0, w0, st0 = 128, 64, 8, 2
    elif sm >= 90:
        bm0, bn0, w0, st0 = 128, 64, 8, 3
    elif max(d, dv) > 128:
        bm0, bn0, w0, st0 = 64, 32, 8, 2
    else:
        bm0, bn0, w0, st0 = 128, 64, 8, 2
    bm, bn = block_m or bm0, block_n or bn0
    return bm, bn, num_warps or w0, num_stages or st0


def _split_dim(d: int) -> tuple[int, int]:
    da = 1 << (d.bit_length() - 1)
    return da, d - da


def num_tiles_bound(num_tokens: int, num_reqs: int, block_m: int) -> int:
    """Tile slots for ``num_reqs`` requests (the padding request included) of
    ``num_tokens`` query rows in all: each request adds at most one partial tile."""
    return num_tokens // block_m + num_reqs


def tile_plan(cu_q, kv_len, num_tiles: int, *, block_m: int, is_causal: bool, window_left: int):
    """The tile list in launch order, longest work first: ``(tile_req, tile_q0)``
    i32[num_tiles] (``tile_req = -1``: no tile), as XLA ops on the device (a cumulative
    sum, a segment count and a sort: no host sync)."""
    from jattn.pallas_kernels.prefill_plan import segment_ids

    n_q = cu_q[1:] - cu_q[:-1]
    tiles = jnp.maximum(n_q + block_m - 1, 0) // block_m
    cum = jnp.cumsum(tiles)
    ids = jnp.arange(num_tiles, dtype=jnp.int32)
    req = jnp.minimum(segment_ids(cum[:-1], num_tiles), n_q.shape[0] - 1)
    valid = ids < cum[-1]
    q0 = (ids - (cum - tiles)[req]) * block_m
    n_b, l_b = n_q[req], kv_len[req]
    hi = jnp.minimum(l_b - n_b + jnp.minimum(q0 + block_m, n_b), l_b) if is_causal else l_b
    lo = jnp.maximum(l_b - n_b + q0 - window_left, 0) if window_left >= 0 else 0
    work = jnp.where(valid, jnp.maximum(hi - lo, 0) + 1, -1)  # +1: a tile without keys still writes
    order = jnp.argsort(-work, stable=True)
    return jnp.where(valid, req, -1)[order].astype(jnp.int32), q0[order].astype(jnp.int32)


def _constexprs(q, k, v, page_table, *, paged, is_causal, window_left, logit_cap, has_sinks, bm, bn):
    da, db = _split_dim(q.shape[-1])
    causal = bool(is_causal)
    return dict(
        HQ=q.shape[1],
        HKV=k.shape[-2],
        DA=da,
        DB=db,
        DV=v.shape[-1],
        PAGE=k.shape[1] if paged else 0,
        MAX_PAGES=page_table.shape[1],
        NUM_PAGES=k.shape[0] if paged else 1,
        BLOCK_M=bm,
        BLOCK_N=bn,
        CAUSAL=causal,
        WINDOW=int(window_left),
        LOGIT_CAP=float(logit_cap),
        HAS_SINKS=bool(has_sinks),
        PARTIAL=bool(causal or window_left >= 0),
        DOT_PREC=triton_glue.dot_precision(q.dtype),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "paged",
        "is_causal",
        "window_left",
        "logit_cap",
        "return_lse",
        "block_m",
        "block_n",
        "num_warps",
        "num_stages",
    ),
)
def _attention(
    q,
    k,
    v,
    cu_q,
    kv_start,
    kv_len,
    page_table,
    params,
    *,
    paged,
    is_causal,
    window_left,
    logit_cap,
    return_lse,
    block_m,
    block_n,
    num_warps,
    num_stages,
):

    t, hq, _ = q.shape
    dv = v.shape[-1]
    if t == 0 or hq == 0:  # nothing to compute (a grid of 0 blocks is no launch): no kernel
        return empty_outputs(q, dv, q.dtype, return_lse)
    has_sinks = params.shape[0] > 2
    if not has_sinks:
        params = jnp.concatenate([params, jnp.zeros((hq,), jnp.float32)])
    # The rows past cu_q[-1] (padding) are one more request without keys.
    cu_q, kv_start, kv_len, page_table = prefill_plan.with_padding_request(cu_q, kv_start, kv_len, page_table, t)
    bm, bn, warps, stages = launch_params(
        q.shape[-1],
        dv,
        sm=triton_glue.capability(),
        paged=paged,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    num_tiles = num_tiles_bound(t, cu_q.shape[0] - 1, bm)
    tile_req, tile_q0 = tile_plan(cu_q, kv_len, num_tiles, block_m=bm, is_causal=is_causal, window_left=window_left)
    kw = _constexprs(
        q,
        k,
        v,
        page_table,
        paged=paged,
        is_causal=is_causal,
        window_left=window_left,
        logit_cap=logit_cap,
        has_sinks=has_sinks,
        bm=bm,
        bn=bn,
    )
    o, lse = triton_glue.triton_call(
        _prefill_kernel,
        tile_req,
        tile_q0,
        cu_q,
        kv_start,
        kv_len,
        page_table,
        params,
        q,
        k,
        v,
        out_shape=(jax.ShapeDtypeStruct((t, hq, dv), q.dtype), jax.ShapeDtypeStruct((t, hq), jnp.float32)),
        grid=(num_tiles, hq),
        name="jattn_triton_prefill",
        num_warps=warps,
        num_stages=stages,
        **kw,
    )
    return (o, lse) if return_lse else o


def _params(softmax_scale, k_scale, v_scale, sinks, d):
    sm = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    parts = [
        jnp.reshape(jnp.asarray(k_scale, jnp.float32) * sm, (1,)),
        jnp.reshape(jnp.asarray(v_scale, jnp.float32), (1,)),
    ]
    if sinks is not None:
        parts.append(jnp.asarray(sinks, jnp.float32).reshape(-1))
    return jnp.concatenate(parts)


def mha_prefill(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_kv=None,
    *,
    is_causal=True,
    window_left=-1,
    logit_cap=0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse=False,
    max_seqlen_q=None,
    max_seqlen_kv=None,
    block_m=None,
    block_n=None,
    num_warps=None,
    num_stages=None,
):
    """Ragged attention without a cache through jax-triton; arguments as in
    ``jattn.ops.mha_prefill`` (``max_seqlen_q`` / ``max_seqlen_kv`` are accepted for the
    op's signature: the kernel reads the lengths from the offsets; ``block_m`` /
    ``block_n`` override the tile sizes, ``num_warps`` / ``num_stages`` the launch)."""
    cu_q = jnp.asarray(cu_seqlens_q, jnp.int32)
    cu_kv = cu_q if cu_seqlens_kv is None else jnp.asarray(cu_seqlens_kv, jnp.int32)
    return _attention(
        q,
        k,
        v,
        cu_q,
        cu_kv[:-1],
        cu_kv[1:] - cu_kv[:-1],
        jnp.zeros((cu_q.shape[0] - 1, 1), jnp.int32),
        _params(softmax_scale, k_scale, v_scale, sinks, q.shape[-1]),
        paged=False,
        is_causal=bool(is_causal),
        window_left=int(window_left),
        logit_cap=float(logit_cap),
        return_lse=bool(return_lse),
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def mha_extend(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    cu_seqlens_q,
    *,
    is_causal=True,
    window_left=-1,
    logit_cap=0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse=False,
    max_seqlen_q=None,
    block_m=None,
    block_n=None,
    num_warps=None,
    num_stages=None,
):
    """Ragged queries over a paged cache that already holds their K/V, through
    jax-triton; arguments as in ``jattn.ops.mha_extend_with_kvcache``."""
    page_table, lens = prefill_plan.no_pages_no_keys(
        jnp.asarray(page_table, jnp.int32), jnp.asarray(cache_seqlens, jnp.int32)
    )
    return _attention(
        q,
        k_cache,
        v_cache,
        jnp.asarray(cu_seqlens_q, jnp.int32),
        jnp.zeros_like(lens),
        lens,
        page_table,
        _params(softmax_scale, k_scale, v_scale, sinks, q.shape[-1]),
        paged=True,
        is_causal=bool(is_causal),
        window_left=int(window_left),
        logit_cap=float(logit_cap),
        return_lse=bool(return_lse),
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
