"""Paged MHA/GQA decode in the Triton language (Ampere and newer): split-KV.

One program per (request, KV head, split). It holds the ``q_len * group`` query
rows of that KV head (row ``i * group + j`` is query ``i``, head ``kvh * group + j``)
and walks its split's tokens in blocks of ``BLOCK_N``, gathering each token's K/V
row through the page table with masked loads (tokens past the length read as 0,
so a page's unused tail never enters the sums). Scores and ``P @ V`` are
``tl.dot`` products (mma on sm80+), the softmax is online in base 2. Masks:
the length, causal (query ``i`` sees tokens ``<= L - q_len + i``), the sliding
window; logit cap on the scaled scores. Where some rows of a block see a token
and others do not (several causal queries, a window), a V row holding a
non-finite value is replaced by 0 for the rows that do not see it and the rows
that do come out NaN: masked keys contribute nothing, whatever they hold.
FP8 e4m3 K/V are upcast to the query's dtype after the load; ``k_scale`` is in
the score scale.

Each split writes its normalised partial output (f32) and base-2 LSE;
``combine.combine_splits`` merges them and applies sinks and ``v_scale``.

:func:`mha_decode` launches it from JAX through jax-triton (``triton_glue``);
``jattn.bridge.triton_native`` launches the same source on torch tensors (a torch
CUDA stream, capturable in a torch CUDA graph; or, in a ``TRITON_INTERPRET=1``
process, Triton's CPU interpreter, as the CPU tests do). :func:`unsupported_reason`
says whether a call can be served.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jattn.dispatch import device_kind
from jattn.pallas_kernels import triton_glue
from jattn.pallas_kernels.combine import wave_splits
from jattn.pallas_kernels.mosaic_common import empty_outputs

try:  # the kernel source needs triton.language only when it is compiled or interpreted
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton not installed
    tl = None

__all__ = ["mha_decode", "unsupported_reason", "launch_params"]

_LOG2E = math.log2(math.e)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_Q_LEN = 8


def _decode_kernel(
    q_ptr,  # [bs * q_len, HQ, D]
    k_ptr,  # [num_pages, PAGE, HKV, D]
    v_ptr,  # [num_pages, PAGE, HKV, D]
    pt_ptr,  # i32[bs, MAX_PAGES]
    lens_ptr,  # i32[bs]
    scale_ptr,  # f32[1]: softmax scale * k_scale
    o_ptr,  # f32[SPLITS, bs, Q_LEN * HQ, D] (normalised per split)
    lse_ptr,  # f32[SPLITS, bs, Q_LEN * HQ] (base 2; -inf for a split without keys)
    BS: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    MAX_PAGES: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    Q_LEN: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,  # -1: off
    LOGIT_CAP: tl.constexpr,  # 0: off
    PARTIAL: tl.constexpr,  # some key is seen by some rows of a request and not others
    DOT_PREC: tl.constexpr = "tf32",  # tl.dot input precision: "ieee" for f32 operands
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    GROUP: tl.constexpr = HQ // HKV
    M: tl.constexpr = Q_LEN * GROUP
    seq_len = tl.load(lens_ptr + b)
    per = (tl.cdiv(seq_len, BLOCK_N) + SPLITS - 1) // SPLITS * BLOCK_N  # tokens per split
    t_lo = s * per
    t_hi = tl.minimum(t_lo + per, seq_len)

    rows = tl.arange(0, BLOCK_M)
    qi = rows // GROUP  # query index of each row
    head = kvh * GROUP + rows % GROUP
    row_ok = rows < M
    cols = tl.arange(0, D)
    q_off = ((b * Q_LEN + qi) * HQ + head).to(tl.int64) * D
    q = tl.load(q_ptr + q_off[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)
    scale = tl.load(scale_ptr) * 1.4426950408889634  # to base 2
    qpos = seq_len - Q_LEN + qi  # each row's own position
    last = tl.where(row_ok, qpos, -1) if CAUSAL else tl.where(row_ok, seq_len - 1, -1)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for t0 in range(t_lo, t_hi, BLOCK_N):
        tok = t0 + offs_n
        tok_ok = tok < t_hi
        page = tl.load(pt_ptr + b * MAX_PAGES + tok // PAGE, mask=tok_ok, other=0)
        page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1)
        kv_off = ((page.to(tl.int64) * PAGE + tok % PAGE) * HKV + kvh) * D
        k = tl.load(k_ptr + kv_off[:, None] + cols[None, :], mask=tok_ok[:, None], other=0.0)
        x = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * scale
        if LOGIT_CAP > 0:
            xc = x * (1.0 / (LOGIT_CAP * 1.4426950408889634))
            e = tl.exp(-2.0 * tl.abs(xc))
            th = (1.0 - e) / (1.0 + e)
            x = tl.where(xc < 0, -th, th) * (LOGIT_CAP * 1.4426950408889634)
        vis = tok_ok[None, :] & (tok[None, :] <= last[:, None])
        if WINDOW >= 0:
            vis = vis & (tok[None, :] >= qpos[:, None] - WINDOW)
        x = tl.where(vis, x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(x - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off[:, None] + cols[None, :], mask=tok_ok[:, None], other=0.0).to(q.dtype)
        if PARTIAL:
            finite = (v - v) == 0
            bad = tl.max(tl.where(finite, 0.0, 1.0), axis=1)  # [BLOCK_N] V rows with a non-finite value
            v = tl.where(finite, v, 0.0)
            hit = tl.max(tl.where(vis & (bad[None, :] > 0), 1.0, 0.0), axis=1)
            l_i = l_i + tl.where(hit > 0, float("nan"), 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    empty = l_i == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    out = acc * inv[:, None]
    lse = tl.where(empty, float("-inf"), tl.where(empty, 0.0, m_i) + tl.log2(tl.where(empty, 1.0, l_i)))
    orow = ((s * BS + b) * (Q_LEN * HQ) + qi * HQ + head).to(tl.int64)
    # a split without keys leaves its output unwritten where a merge follows (one reads
    # only its LSE, -inf); one split's output is final
    o_ok = tl.where(t_hi > t_lo, row_ok, False) if SPLITS > 1 else row_ok
    tl.store(o_ptr + orow[:, None] * D + cols[None, :], out, mask=o_ok[:, None])
    tl.store(lse_ptr + orow, lse, mask=row_ok)


def unsupported_reason(q, k_cache, v_cache, *, max_seqlen_q=1, **_) -> str | None:
    """None when the kernel can serve this ``mha_decode_with_kvcache`` call, else a one-line reason."""
    if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"q dtype {q.dtype}"
    if k_cache.dtype != v_cache.dtype or k_cache.shape != v_cache.shape:
        return "k_cache and v_cache differ in dtype or shape"
    if k_cache.dtype not in (q.dtype, jnp.float8_e4m3fn):
        return f"cache dtype {k_cache.dtype} (q's dtype or FP8 e4m3)"
    if (reason := triton_glue.fp8_reason(k_cache.dtype)) is not None:
        return reason
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={d} (supported: {SUPPORTED_HEAD_DIMS})"
    if not 1 <= max_seqlen_q <= MAX_Q_LEN:
        return f"max_seqlen_q={max_seqlen_q} (1..{MAX_Q_LEN})"
    if q.shape[1] % k_cache.shape[2]:
        return f"num_q_heads={q.shape[1]} is not a multiple of num_kv_heads={k_cache.shape[2]}"
    group = q.shape[1] // k_cache.shape[2]
    # the q tile and the K/V blocks in q's dtype (Triton 3.6 for sm_90, two stages: 16.5 KB
    # beside a bf16 q tile); a program may take 227 KB on Hopper, 163 KB on an A100 (sm80),
    # 99 KB on sm86 / sm89
    bm = _block_m(max_seqlen_q * group)
    need = jnp.dtype(q.dtype).itemsize * (bm * d + 8448)
    if q.dtype == jnp.float32:  # full-precision dots keep f32 layouts and scratch: fitted to sm80-sm90 builds
        need = 6 * bm * d + 98432
    limit = 232448 if device_kind() == "hopper" else 166912 if triton_glue.capability() == 80 else 101376
    if need > limit:
        return (
            f"{max_seqlen_q * group} query rows per KV head (q_len {max_seqlen_q} x group {group}) "
            f"at head_dim {d}: about {need} bytes of shared memory, over this GPU's {limit}"
        )
    return None


def _block_m(rows: int) -> int:
    """BLOCK_M for ``rows`` query rows of a KV head: a power of two, at least 16 (the mma's rows)."""
    return max(16, 1 << max(0, (rows - 1).bit_length()))


def launch_params(bs: int, hq: int, hkv: int, d: int, q_len: int, max_tokens: int, num_splits: int | None = None):
    """``(grid, constexprs)`` apart from the array shapes: BLOCK_M covers a KV head's
    ``q_len * group`` rows (at least 16, the mma's rows); splits so that about two
    waves of programs cover the SMs, each split at least 256 tokens."""
    block_m = _block_m(q_len * (hq // hkv))
    block_n = 64 if d <= 128 else 32
    if num_splits is None:
        num_splits = wave_splits(bs * hkv, max_tokens // 256)
    return (bs, hkv, num_splits), dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLITS=num_splits)


def _constexprs(q, k_cache, page_table, *, q_len, is_causal, window_left, logit_cap, params):
    num_pages, page, hkv, d = k_cache.shape
    bs = page_table.shape[0]
    return dict(
        BS=bs,
        HQ=q.shape[1],
        HKV=hkv,
        D=d,
        PAGE=page,
        MAX_PAGES=page_table.shape[1],
        NUM_PAGES=num_pages,
        Q_LEN=q_len,
        CAUSAL=bool(is_causal and q_len > 1),
        WINDOW=int(window_left),
        LOGIT_CAP=float(logit_cap),
        PARTIAL=bool((is_causal and q_len > 1) or window_left >= 0),
        DOT_PREC=triton_glue.dot_precision(q.dtype),
        **params,
    )


@functools.partial(
    jax.jit,
    static_argnames=("max_seqlen_q", "is_causal", "window_left", "logit_cap", "return_lse", "num_splits"),
)
def _mha_decode(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    sinks,
    scale,
    v_scale,
    *,
    max_seqlen_q,
    is_causal,
    window_left,
    logit_cap,
    return_lse,
    num_splits,
):
    from jattn.pallas_kernels.combine import combine_splits

    bs = page_table.shape[0]
    _, page, hkv, d = k_cache.shape
    hq = q.shape[1]
    if bs == 0 or hq == 0:  # nothing to compute (a grid of 0 blocks is no launch): no kernel
        return empty_outputs(q, v_cache.shape[-1], q.dtype, return_lse)
    grid, params = launch_params(bs, hq, hkv, d, max_seqlen_q, page_table.shape[1] * page, num_splits)
    splits = params["SPLITS"]
    rows = max_seqlen_q * hq
    kw = _constexprs(
        q,
        k_cache,
        page_table,
        q_len=max_seqlen_q,
        is_causal=is_causal,
        window_left=window_left,
        logit_cap=logit_cap,
        params=params,
    )
    o_part, lse_part = triton_glue.triton_call(
        _decode_kernel,
        q,
        k_cache,
        v_cache,
        page_table.astype(jnp.int32),
        cache_seqlens.astype(jnp.int32),
        scale,
        out_shape=(
            jax.ShapeDtypeStruct((splits, bs, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((splits, bs, rows), jnp.float32),
        ),
        grid=grid,
        name="jattn_triton_decode",
        num_warps=4,
        num_stages=2,
        **kw,
    )
    out, lse = combine_splits(
        o_part,
        lse_part,
        q_len=max_seqlen_q,
        num_q_heads=hq,
        sinks=sinks,
        v_scale=v_scale,
        out_dtype=q.dtype,
        use_kernel=True,
    )
    return (out, lse) if return_lse else out


def _scale(softmax_scale, k_scale, d):
    sm = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    return jnp.reshape(jnp.asarray(k_scale, jnp.float32) * sm, (1,))


def mha_decode(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    *,
    max_seqlen_q=1,
    is_causal=True,
    window_left=-1,
    logit_cap=0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse=False,
    num_splits=None,
):
    """Paged decode through jax-triton; arguments as in ``jattn.ops.mha_decode_with_kvcache``
    (``num_splits`` overrides the split count)."""
    vs = None if isinstance(v_scale, (int, float)) and float(v_scale) == 1.0 else v_scale
    return _mha_decode(
        q,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        None if sinks is None else jnp.asarray(sinks, jnp.float32),
        _scale(softmax_scale, k_scale, q.shape[-1]),
        vs,
        max_seqlen_q=int(max_seqlen_q),
        is_causal=bool(is_causal),
        window_left=int(window_left),
        logit_cap=float(logit_cap),
        return_lse=return_lse,
        num_splits=num_splits,
    )
