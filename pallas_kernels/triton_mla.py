"""DeepSeek MLA absorbed paged decode in the Triton language (Ampere and newer): split-KV.

The latent cache holds one shared KV row of ``R + r`` (512 + 64) columns per
token; scores are taken against the whole row and the value is its first ``R``
columns. One program per (request, tile of ``BLOCK_M`` query rows, split): the
request's ``q_len * H`` rows (row ``i * H + h``) are the MMA rows, so each latent
row a program loads serves all its heads. Per block of ``BLOCK_N`` tokens
(gathered through the page table with masked loads: tokens past the length read
as 0) the scores are two ``tl.dot`` products (the 512 latent columns and the 64
rope columns) and ``P @ V`` one more over the 512 latent columns. Masked keys
contribute nothing: with several causal queries a later draft token's non-finite
value entries are replaced by 0 for the rows that do not see it; a row that does
see one comes out NaN anyway (the value columns are score columns too). FP8 e4m3
latent rows are upcast after the load; ``kv_scale`` is in the score scale and the
output.

Each split writes its normalised partial output (f32) and base-2 LSE;
``combine.combine_splits`` merges them. :func:`mla_decode` launches it from JAX
through jax-triton; ``jattn.bridge.triton_native`` can launch the same source on
torch tensors. :func:`unsupported_reason` says whether a call can be served.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jattn.pallas_kernels.combine import wave_splits

try:  # the kernel source needs triton.language only when it is compiled or interpreted
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton not installed
    tl = None

__all__ = ["mla_decode", "unsupported_reason", "launch_params", "choose_tuning", "Tuning", "DEFAULT_TUNING"]

MAX_Q_LEN = 8


def _mla_kernel(
    q_ptr,  # [bs * q_len, H, R + RP]
    kv_ptr,  # [num_pages, PAGE, R + RP]
    pt_ptr,  # i32[bs, MAX_PAGES]
    lens_ptr,  # i32[bs]
    scale_ptr,  # f32[1]: softmax scale * kv_scale
    o_ptr,  # f32[SPLITS, bs, Q_LEN * H, R]
    lse_ptr,  # f32[SPLITS, bs, Q_LEN * H] (base 2)
    BS: tl.constexpr,
    H: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    PAGE: tl.constexpr,
    MAX_PAGES: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    Q_LEN: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    b = tl.program_id(0)
    mt = tl.program_id(1)
    s = tl.program_id(2)
    W: tl.constexpr = R + RP
    M: tl.constexpr = Q_LEN * H
    seq_len = tl.load(lens_ptr + b)
    per = (tl.cdiv(seq_len, BLOCK_N) + SPLITS - 1) // SPLITS * BLOCK_N
    t_lo = s * per
    t_hi = tl.minimum(t_lo + per, seq_len)

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    qi = rows // H
    cr = tl.arange(0, R)
    cp = tl.arange(0, RP)
    q_row = (b * M + rows).to(tl.int64) * W  # q is [bs, Q_LEN * H, W] row-major
    q_nope = tl.load(q_ptr + q_row[:, None] + cr[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_ptr + q_row[:, None] + R + cp[None, :], mask=row_ok[:, None], other=0.0)
    scale = tl.load(scale_ptr) * 1.4426950408889634
    last = tl.where(row_ok, seq_len - Q_LEN + qi, -1) if CAUSAL else tl.where(row_ok, seq_len - 1, -1)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, R), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for t0 in range(t_lo, t_hi, BLOCK_N):
        tok = t0 + offs_n
        tok_ok = tok < t_hi
        page = tl.load(pt_ptr + b * MAX_PAGES + tok // PAGE, mask=tok_ok, other=0)
        page = tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1)
        kv_row = (page.to(tl.int64) * PAGE + tok % PAGE) * W
        k_nope = tl.load(kv_ptr + kv_row[:, None] + cr[None, :], mask=tok_ok[:, None], other=0.0).to(q_nope.dtype)
        k_pe = tl.load(kv_ptr + kv_row[:, None] + R + cp[None, :], mask=tok_ok[:, None], other=0.0).to(q_nope.dtype)
        x = (tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_pe, tl.trans(k_pe))) * scale
        vis = tok_ok[None, :] & (tok[None, :] <= last[:, None])
        x = tl.where(vis, x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(x - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = k_nope
        if CAUSAL:  # a later draft token's entries reach the rows that do not see it as P = 0
            v = tl.where((v - v) == 0, v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q_nope.dtype), v)
        m_i = m_new

    empty = l_i == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), tl.where(empty, 0.0, m_i) + tl.log2(tl.where(empty, 1.0, l_i)))
    orow = ((s * BS + b) * M + rows).to(tl.int64)
    tl.store(o_ptr + orow[:, None] * R + cr[None, :], acc * inv[:, None], mask=row_ok[:, None])
    tl.store(lse_ptr + orow, lse, mask=row_ok)


def unsupported_reason(q, kv_cache, page_table=None, cache_seqlens=None, *, kv_lora_rank, max_seqlen_q=1, **_):
    """None when the kernel can serve this ``mla_decode_with_kvcache`` call, else a one-line reason."""
    if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"q dtype {q.dtype}"
    if kv_cache.dtype not in (q.dtype, jnp.float8_e4m3fn):
        return f"kv_cache dtype {kv_cache.dtype} (q's dtype or FP8 e4m3)"
    r, rp = kv_lora_rank, kv_cache.shape[-1] - kv_lora_rank
    if r & (r - 1) or rp & (rp - 1) or r < 16 or rp < 16:
        return f"latent rank {r} and rope width {rp} must be powers of two >= 16"
    if not 1 <= max_seqlen_q <= MAX_Q_LEN:
        return f"max_seqlen_q={max_seqlen_q} (1..{MAX_Q_LEN})"
    return None


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch choices of the kernel (hashable; part of the compiled program). Every
    setting computes the same attention; ``python -m jattn bench mla --sweep`` times them.

    block_m: most query rows per program (the ``[block_m, R]`` f32 accumulator lives in
      registers); at least 16 (the mma's rows).
    block_n: tokens per key block.
    num_warps, num_stages: Triton's warps per program and software-pipeline depth.
    waves: splits so that about this many waves of programs cover the SMs.
    """

    block_m: int = 32
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 2


DEFAULT_TUNING = Tuning()  # every GPU but Hopper, and FP8 latent rows on Hopper
MAX_SPLITS = 128


def choose_tuning(heads: int, q_len: int, kv_itemsize: int, sm: int = 80) -> Tuning:
    """The launch choice of a call on a GPU of compute capability ``sm`` (90 for sm_90).

    Hopper, 2-byte latent rows, from ``bench mla --sweep`` on the H200 (docs/PERF.md):
    64 query rows or more take 64-row tiles, 64-token blocks and 8 warps (1.4-1.5x the
    default at 128 heads); 17-63 rows 64-token blocks, 8 warps and three stages (1.1x at
    16 heads and q_len 2); 16 rows or fewer 64-token blocks, 4 warps and three stages
    (1.1-1.5x at 16 heads). FP8 latent rows and other GPUs keep :data:`DEFAULT_TUNING`:
    the Hopper choices need up to 221 KB of shared memory, and FP8 measured slower with
    each of them."""
    if sm < 90 or kv_itemsize != 2:
        return DEFAULT_TUNING
    m = q_len * heads
    if m >= 64:
        return Tuning(block_m=64, block_n=64, num_warps=8, num_stages=2)
    if m > 16:
        return Tuning(block_n=64, num_warps=8, num_stages=3)
    return Tuning(block_n=64, num_warps=4, num_stages=3)


def launch_params(
    bs: int, heads: int, q_len: int, max_tokens: int, num_splits: int | None = None, tuning: Tuning = DEFAULT_TUNING
):
    """``(grid, constexprs, launch)`` apart from the shapes: row tiles of at most
    ``tuning.block_m`` rows, at least 16; splits so that about ``tuning.waves`` waves of
    programs cover the SMs, each at least 256 tokens, at most :data:`MAX_SPLITS`
    (batch 1 at 32k: 128); ``launch`` holds ``num_warps`` and ``num_stages``."""
    m = q_len * heads
    block_m = min(tuning.block_m, max(16, 1 << max(0, (m - 1).bit_length())))
    tiles = -(-m // block_m)
    if num_splits is None:
        num_splits = wave_splits(bs * tiles, max_tokens // 256, waves=tuning.waves, cap=MAX_SPLITS)
    launch = dict(num_warps=tuning.num_warps, num_stages=tuning.num_stages)
    return (bs, tiles, num_splits), dict(BLOCK_M=block_m, BLOCK_N=tuning.block_n, SPLITS=num_splits), launch


def constexprs(q, kv_cache, page_table, *, kv_lora_rank, q_len, is_causal, params):
    num_pages, page, width = kv_cache.shape
    return dict(
        BS=page_table.shape[0],
        H=q.shape[1],
        R=kv_lora_rank,
        RP=width - kv_lora_rank,
        PAGE=page,
        MAX_PAGES=page_table.shape[1],
        NUM_PAGES=num_pages,
        Q_LEN=q_len,
        CAUSAL=bool(is_causal and q_len > 1),
        **params,
    )


@functools.partial(
    jax.jit,
    static_argnames=("kv_lora_rank", "max_seqlen_q", "is_causal", "return_lse", "num_splits", "v_scale_one", "tuning"),
)
def _mla_decode(
    q,
    kv_cache,
    page_table,
    cache_seqlens,
    scale,
    kv_scale,
    *,
    kv_lora_rank,
    max_seqlen_q,
    is_causal,
    return_lse,
    num_splits,
    v_scale_one,
    tuning,
):
    from jattn.pallas_kernels import triton_glue
    from jattn.pallas_kernels.combine import combine_splits

    bs, h = page_table.shape[0], q.shape[1]
    if tuning is None:
        itemsize = jnp.dtype(kv_cache.dtype).itemsize
        tuning = choose_tuning(h, max_seqlen_q, itemsize, triton_glue.capability())
    grid, params, launch = launch_params(
        bs, h, max_seqlen_q, page_table.shape[1] * kv_cache.shape[1], num_splits, tuning
    )
    rows = max_seqlen_q * h
    kw = constexprs(
        q, kv_cache, page_table, kv_lora_rank=kv_lora_rank, q_len=max_seqlen_q, is_causal=is_causal, params=params
    )
    o_part, lse_part = triton_glue.triton_call(
        _mla_kernel,
        q,
        kv_cache,
        page_table.astype(jnp.int32),
        cache_seqlens.astype(jnp.int32),
        scale,
        out_shape=(
            jax.ShapeDtypeStruct((params["SPLITS"], bs, rows, kv_lora_rank), jnp.float32),
            jax.ShapeDtypeStruct((params["SPLITS"], bs, rows), jnp.float32),
        ),
        grid=grid,
        name="jattn_triton_mla_decode",
        **launch,
        **kw,
    )
    out, lse = combine_splits(
        o_part,
        lse_part,
        q_len=max_seqlen_q,
        num_q_heads=h,
        sinks=None,
        v_scale=None if v_scale_one else kv_scale,
        out_dtype=q.dtype,
        use_kernel=True,
    )
    return (out, lse) if return_lse else out


def mla_decode(
    q,
    kv_cache,
    page_table,
    cache_seqlens,
    *,
    kv_lora_rank: int,
    softmax_scale,
    max_seqlen_q: int = 1,
    is_causal: bool = True,
    kv_scale=1.0,
    return_lse: bool = False,
    num_splits: int | None = None,
    tuning: Tuning | None = None,
):
    """MLA absorbed decode through jax-triton; arguments as in ``jattn.mla_decode_with_kvcache``
    (``tuning``: the launch choices, :class:`Tuning`; :func:`choose_tuning`'s when None)."""
    one = isinstance(kv_scale, (int, float)) and float(kv_scale) == 1.0
    ks = jnp.asarray(kv_scale, jnp.float32)
    scale = (jnp.asarray(softmax_scale, jnp.float32) * ks).reshape(1)
    return _mla_decode(
        q,
        kv_cache,
        page_table,
        cache_seqlens,
        scale,
        ks,
        kv_lora_rank=kv_lora_rank,
        max_seqlen_q=int(max_seqlen_q),
        is_causal=bool(is_causal),
        return_lse=return_lse,
        num_splits=num_splits,
        v_scale_one=one,
        tuning=tuning,
    )
