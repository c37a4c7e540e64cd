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

from jattn.dispatch import device_kind
from jattn.pallas_kernels import triton_glue
from jattn.pallas_kernels.combine import wave_splits
from jattn.pallas_kernels.mosaic_common import empty_outputs

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
    SWAP: tl.constexpr = 0,  # 0: S = Q K^T; 1: S^T = K Q^T; 2: S^T = K Q^T and O^T = V^T P^T
    FP8_MATH: tl.constexpr = 0,  # FP8 rows: 0 upcast to q's dtype; 1 to f16; 2 FP8 Q K^T, f16 P V
    PREFETCH: tl.constexpr = 0,  # 1: load the next block's rows into registers before this block's dots
    DOT_PREC: tl.constexpr = "tf32",  # tl.dot input precision: "ieee" for f32 operands
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
    row_scale = tl.full((BLOCK_M,), 1.0, tl.float32) * scale  # the score scale of each row (base 2)
    if FP8_MATH == 1:  # f16 dots on the upcast rows: q in f16, the score scale folded in
        q_nope = (q_nope.to(tl.float32) * scale).to(tl.float16)
        q_pe = (q_pe.to(tl.float32) * scale).to(tl.float16)
        row_scale = tl.full((BLOCK_M,), 1.0, tl.float32)
    if FP8_MATH == 2:  # q rows in e4m3, each scaled so that its largest entry is 448
        amax = tl.maximum(tl.max(tl.abs(q_nope.to(tl.float32)), axis=1), tl.max(tl.abs(q_pe.to(tl.float32)), axis=1))
        qs = tl.where(amax > 0, 448.0 / tl.where(amax > 0, amax, 1.0), 1.0)
        q_nope = (q_nope.to(tl.float32) * qs[:, None]).to(tl.float8e4nv)
        q_pe = (q_pe.to(tl.float32) * qs[:, None]).to(tl.float8e4nv)
        row_scale = scale / qs
    cdt = tl.float16 if FP8_MATH != 0 else q_ptr.dtype.element_ty  # the P V dot's operand type
    kdt = tl.float8e4nv if FP8_MATH == 2 else cdt  # the score dot's operand type
    last = tl.where(row_ok, seq_len - Q_LEN + qi, -1) if CAUSAL else tl.where(row_ok, seq_len - 1, -1)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    if SWAP == 2:
        acc = tl.zeros((R, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, R), tl.float32)
    if SWAP != 0:
        qt_nope = tl.trans(q_nope)
        qt_pe = tl.trans(q_pe)
    offs_n = tl.arange(0, BLOCK_N)
    pt_row = pt_ptr + b * MAX_PAGES
    ONE_PAGE: tl.constexpr = PAGE % BLOCK_N == 0  # a block's tokens lie in one page
    if ONE_PAGE:  # the page of the next block to load, one scalar load ahead
        pg = tl.load(pt_row + t_lo // PAGE, mask=t_lo < t_hi, other=0)
    else:
        pg = 0
    if PREFETCH:  # the first block's rows, loaded before the loop
        tok = t_lo + offs_n
        tok_ok = tok < t_hi
        if ONE_PAGE:
            kv_row = (tl.minimum(tl.maximum(pg, 0), NUM_PAGES - 1).to(tl.int64) * PAGE + tok % PAGE) * W
            pg = tl.load(pt_row + (t_lo + BLOCK_N) // PAGE, mask=t_lo + BLOCK_N < t_hi, other=0)
        else:
            page = tl.load(pt_row + tok // PAGE, mask=tok_ok, other=0)
            kv_row = (tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64) * PAGE + tok % PAGE) * W
        k_nope_n = tl.load(kv_ptr + kv_row[:, None] + cr[None, :], mask=tok_ok[:, None], other=0.0)
        k_pe_n = tl.load(kv_ptr + kv_row[:, None] + R + cp[None, :], mask=tok_ok[:, None], other=0.0)
    for t0 in range(t_lo, t_hi, BLOCK_N):
        tok = t0 + offs_n
        tok_ok = tok < t_hi
        # the rows of the block loaded now: this one, or with PREFETCH the next (this one's are in hand)
        t1 = t0 + BLOCK_N if PREFETCH else t0
        tok1 = t1 + offs_n
        ok1 = tok1 < t_hi
        if ONE_PAGE:
            kv_row = (tl.minimum(tl.maximum(pg, 0), NUM_PAGES - 1).to(tl.int64) * PAGE + tok1 % PAGE) * W
            pg = tl.load(pt_row + (t1 + BLOCK_N) // PAGE, mask=t1 + BLOCK_N < t_hi, other=0)
        else:
            page = tl.load(pt_row + tok1 // PAGE, mask=ok1, other=0)
            kv_row = (tl.minimum(tl.maximum(page, 0), NUM_PAGES - 1).to(tl.int64) * PAGE + tok1 % PAGE) * W
        k_nope_l = tl.load(kv_ptr + kv_row[:, None] + cr[None, :], mask=ok1[:, None], other=0.0)
        k_pe_l = tl.load(kv_ptr + kv_row[:, None] + R + cp[None, :], mask=ok1[:, None], other=0.0)
        if PREFETCH:
            k_nope = k_nope_n
            k_pe = k_pe_n
            k_nope_n = k_nope_l
            k_pe_n = k_pe_l
        else:
            k_nope = k_nope_l
            k_pe = k_pe_l
        v = k_nope.to(cdt)
        if SWAP == 0:
            x = tl.dot(q_nope, tl.trans(k_nope.to(kdt)), input_precision=DOT_PREC)
            x += tl.dot(q_pe, tl.trans(k_pe.to(kdt)), input_precision=DOT_PREC)
            x = x * row_scale[:, None]
            vis = tok_ok[None, :] & (tok[None, :] <= last[:, None])
            x = tl.where(vis, x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, axis=1))
        else:  # the tokens are the MMA rows of the score dot
            x = tl.dot(k_nope.to(kdt), qt_nope, input_precision=DOT_PREC)
            x += tl.dot(k_pe.to(kdt), qt_pe, input_precision=DOT_PREC)
            x = x * row_scale[None, :]
            vis = tok_ok[:, None] & (tok[:, None] <= last[None, :])
            x = tl.where(vis, x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        if CAUSAL:  # a later draft token's entries reach the rows that do not see it as P = 0
            v = tl.where((v - v) == 0, v, 0.0)
        if SWAP == 0:
            p = tl.exp2(x - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(cdt), v, input_precision=DOT_PREC)
        else:
            p = tl.exp2(x - m_use[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            if SWAP == 1:
                acc = acc * alpha[:, None] + tl.dot(tl.trans(p.to(cdt)), v, input_precision=DOT_PREC)
            else:
                acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(cdt), input_precision=DOT_PREC)
        m_i = m_new

    empty = l_i == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), tl.where(empty, 0.0, m_i) + tl.log2(tl.where(empty, 1.0, l_i)))
    orow = ((s * BS + b) * M + rows).to(tl.int64)
    # a split without keys leaves its output unwritten where a merge follows (one reads
    # only its LSE, -inf); one split's output is final
    o_ok = tl.where(t_hi > t_lo, row_ok, False) if SPLITS > 1 else row_ok
    if SWAP == 2:
        tl.store(o_ptr + orow[None, :] * R + cr[:, None], acc * inv[None, :], mask=o_ok[None, :])
    else:
        tl.store(o_ptr + orow[:, None] * R + cr[None, :], acc * inv[:, None], mask=o_ok[:, None])
    tl.store(lse_ptr + orow, lse, mask=row_ok)


def unsupported_reason(q, kv_cache, page_table=None, cache_seqlens=None, *, kv_lora_rank, max_seqlen_q=1, **_):
    """None when the kernel can serve this ``mla_decode_with_kvcache`` call, else a one-line reason."""
    if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"q dtype {q.dtype}"
    if kv_cache.dtype not in (q.dtype, jnp.float8_e4m3fn):
        return f"kv_cache dtype {kv_cache.dtype} (q's dtype or FP8 e4m3)"
    if (reason := triton_glue.fp8_reason(kv_cache.dtype)) is not None:
        return reason
    r, rp = kv_lora_rank, kv_cache.shape[-1] - kv_lora_rank
    if r & (r - 1) or rp & (rp - 1) or r < 16 or rp < 16:
        return f"latent rank {r} and rope width {rp} must be powers of two >= 16"
    if not 1 <= max_seqlen_q <= MAX_Q_LEN:
        return f"max_seqlen_q={max_seqlen_q} (1..{MAX_Q_LEN})"
    if q.dtype == jnp.float32 and r >= 512 and device_kind() not in ("hopper", "cpu"):
        return f"f32 latent tiles of rank {r} need more shared memory than a pre-Hopper GPU's 99 KB"
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
    swap: 0: scores ``Q K^T`` (query rows are the MMA rows); 1: ``(K Q^T)^T`` (the tokens
      are, so Hopper's wgmma takes 16 query rows); 2: also ``O^T = V^T P^T``.
    fp8_math: FP8 latent rows only: 0 upcast to q's dtype; 1 upcast to f16 (q in f16 with
      the score scale folded in); 2 an FP8 ``Q K^T`` (q rows quantised to e4m3, each with
      its own scale) and an f16 ``P V``.
    prefetch: 1 loads the next block's rows into registers before this block's dots.
    """

    block_m: int = 32
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 2
    swap: int = 0
    fp8_math: int = 0
    prefetch: int = 0


DEFAULT_TUNING = Tuning()  # every GPU but Hopper, and FP8 latent rows of more than 16 query rows on Hopper
MAX_SPLITS = 128


def choose_tuning(heads: int, q_len: int, kv_itemsize: int, sm: int = 80) -> Tuning:
    """The launch choice of a call on a GPU of compute capability ``sm`` (90 for sm_90).

    Hopper, the fastest launches of ``bench mla --sweep`` (docs/PERF.md has the figures):
    2-byte latent rows with 64 query rows or more take 64-row tiles, 64-token blocks and 8
    warps; 17-63 rows 64-token blocks, 8 warps and three stages; 16 rows or fewer 64-token
    blocks, 4 warps, three stages and the tokens as the score dot's MMA rows (``swap=1``).
    FP8 latent rows, 16 query rows or fewer: 64-token blocks, 8 warps, the next block
    prefetched into registers and f16 dots on the upcast rows. ``fp8_math=2`` (an FP8
    ``Q K^T`` on e4m3 query rows, faster still) is an option only: it moves the LSE by
    about 1e-2 where the upcast paths stay near 1e-6. Everything else keeps
    :data:`DEFAULT_TUNING`."""
    if sm < 90:
        return DEFAULT_TUNING
    m = q_len * heads
    if kv_itemsize != 2:  # FP8, or f32 rows (which keep the default)
        if kv_itemsize == 1 and m <= 16:
            return Tuning(block_n=64, num_warps=8, num_stages=1, fp8_math=1, prefetch=1)
        return DEFAULT_TUNING
    if m >= 64:
        return Tuning(block_m=64, block_n=64, num_warps=8, num_stages=2)
    if m > 16:
        return Tuning(block_n=64, num_warps=8, num_stages=3)
    return Tuning(block_n=64, num_warps=4, num_stages=3, swap=1)


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
    params = dict(BLOCK_M=block_m, BLOCK_N=tuning.block_n, SPLITS=num_splits)
    params.update(SWAP=tuning.swap, FP8_MATH=tuning.fp8_math, PREFETCH=tuning.prefetch)
    return (bs, tiles, num_splits), params, launch


def constexprs(q, kv_cache, page_table, *, kv_lora_rank, q_len, is_causal, params):
    num_pages, page, width = kv_cache.shape
    fp8 = "float8" in str(kv_cache.dtype)
    params = dict(params, FP8_MATH=params.get("FP8_MATH", 0) if fp8 else 0)
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
        DOT_PREC=triton_glue.dot_precision(q.dtype),
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
    from jattn.pallas_kernels.combine import combine_splits

    bs, h = page_table.shape[0], q.shape[1]
    if bs == 0 or h == 0:  # nothing to compute (a grid of 0 blocks is no launch): no kernel
        return empty_outputs(q, kv_lora_rank, q.dtype, return_lse)
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
