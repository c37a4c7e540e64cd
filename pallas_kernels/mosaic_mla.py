"""DeepSeek MLA absorbed paged decode on Pallas Mosaic GPU (Hopper): split-KV.

The latent cache holds one shared KV row of ``W = R + r`` (576 = 512 + 64) columns
per token; the score of query row ``q`` against token ``j`` is ``q . row_j`` over all
``W`` columns and the value is the row's first ``R`` columns. With one KV head the
query heads are the MMA rows: request ``b``'s ``q_len * H`` rows (row ``i * H + h``)
are cut into tiles of 64.

The kernel (its layout of the work, the warpgroups' roles, the barriers) is in
``mosaic_mla_kernel``; this module chooses the split count, prepares the operands and
merges the splits (``combine.combine_splits``, which also applies ``kv_scale`` to the
output). With an FP8 e4m3 latent cache a bf16/f16 query is quantised to e4m3 here, one
power-of-two scale per row (``e4m3_query.query_rows_e4m3``, one Triton kernel on a GPU with
jax-triton): exact for a query whose entries are e4m3 values already, and otherwise the one
rounding the kernel adds to the reference's math; a row with a NaN or an Inf becomes NaN. A
query that comes in e4m3 (the MLA backend's FP8 path hands it over so, as SGLang's does) is
read as it is, with no row scales and no quantisation step.

The entry point is :func:`mla_decode`; :func:`unsupported_reason` says whether a
call can be served. The f32 oracle is ``jattn.reference.mla_decode``. Under the
Mosaic GPU interpreter (CPU tests) the matmuls are plain dots on the
shared-memory tiles; the rest is the kernel that runs on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jattn.pallas_kernels.combine import NUM_SMS, balanced_split_blocks, balanced_split_count, combine_splits
from jattn.pallas_kernels.e4m3_query import query_rows_e4m3
from jattn.pallas_kernels.interpret import no_gpu_reason
from jattn.pallas_kernels.mosaic_common import check_plan, empty_outputs
from jattn.pallas_kernels.mosaic_mla_kernel import BLOCK_N, FP8_LAND_STAGES, MLADecodeConfig, run
from jattn.plan_inputs import _positive_int

# FP8 with at most 32 query rows: V^T read from the landed e4m3 tile into registers
# (MLADecodeConfig.v_regs, measured faster; docs/PERF.md) or (False) the producer's upcast
FP8_V_REGS = True

__all__ = [
    "mla_decode",
    "unsupported_reason",
    "MLADecodeConfig",
    "choose_num_splits",
    "balanced_num_splits",
    "balanced_split_size",
]

SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)


def _interpreting() -> bool:
    from jattn.pallas_kernels.interpret import interpreting

    return interpreting()


def unsupported_reason(q, kv_cache, page_table=None, cache_seqlens=None, *, kv_lora_rank, max_seqlen_q=1, **_):
    """None when the kernel can serve this ``mla_decode_with_kvcache`` call, else a one-line reason."""
    reason = _build_reason(q, kv_cache, kv_lora_rank, max_seqlen_q)
    if reason is not None:
        return reason
    if q.shape[0] == 0 or q.shape[1] == 0:
        return "no query rows or heads"
    return no_gpu_reason()


def _build_reason(q, kv_cache, kv_lora_rank, max_seqlen_q) -> str | None:
    """Why the kernel cannot be built for these shapes and dtypes, or None."""
    width = kv_cache.shape[-1]
    fp8 = kv_cache.dtype == jnp.float8_e4m3fn
    # an e4m3 query (quantised by the caller) goes with an e4m3 cache only
    if q.dtype not in (jnp.bfloat16, jnp.float16, *((jnp.float8_e4m3fn,) if fp8 else ())):
        return f"q dtype {q.dtype} (bf16/f16, or e4m3 with an e4m3 cache)"
    if kv_cache.dtype not in (q.dtype, jnp.float8_e4m3fn):
        return f"kv_cache dtype {kv_cache.dtype} (q's dtype {q.dtype}, or float8_e4m3fn)"
    if (width, kv_lora_rank) != (576, 512):
        return f"latent width {width} / rank {kv_lora_rank} (576 / 512 only)"
    if kv_cache.shape[1] not in SUPPORTED_PAGE_SIZES:
        return f"page_size={kv_cache.shape[1]} (supported: {SUPPORTED_PAGE_SIZES})"
    if not 1 <= max_seqlen_q <= 8:
        return f"max_seqlen_q={max_seqlen_q} (1..8)"
    return None


#: A CTA's fixed cost in block times: the ring's fill and the output and LSE writes.
SPLIT_OVERHEAD_BLOCKS = 2


def choose_num_splits(batch: int, m_tiles: int, max_blocks: int) -> int:
    """Splits per request with the shortest predicted makespan. One CTA fits an SM (its
    shared memory), so ``batch * m_tiles * splits`` CTAs run in waves of ``NUM_SMS``,
    each CTA taking ``ceil(max_blocks / splits)`` blocks plus
    :data:`SPLIT_OVERHEAD_BLOCKS`; the fewest splits win a tie (each split is a combine
    row). Only static facts are used: the page-table width, not the traced lengths."""
    programs = max(1, batch * m_tiles)
    best, best_cost = 1, None
    for s in range(1, max(1, min(max_blocks, 2 * NUM_SMS)) + 1):
        cost = -(-programs * s // NUM_SMS) * (-(-max_blocks // s) + SPLIT_OVERHEAD_BLOCKS)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


# Balanced splits (``mla_decode(balanced_splits=...)``) by default where
# :func:`balanced_by_default` says so; False: never by default (docs/PERF.md, MLA decode).
BALANCED_SPLITS = True


def balanced_by_default(batch: int) -> bool:
    """Whether a call of ``batch`` requests takes balanced splits when it names none:
    with several requests (one request has nothing to balance against, and the balanced
    count only adds splits), at any head count, query length and cache dtype, unless
    :data:`BALANCED_SPLITS` is off. Uneven lengths (serving batches, whose bucket padding
    rows are empty) gain far more than equal lengths lose at 128 heads and with FP8
    caches (docs/PERF.md, MLA decode)."""
    return BALANCED_SPLITS and batch > 1


def balanced_num_splits(batch: int, m_tiles: int, max_blocks: int) -> int:
    """The static split count of a balanced call (:func:`~jattn.pallas_kernels.combine.balanced_split_count`
    over this module's even-length choice)."""
    programs = max(1, batch * m_tiles)
    return balanced_split_count(choose_num_splits(batch, m_tiles, max_blocks), programs, max_blocks)


def balanced_split_size(lens, block: int, num_splits: int, m_tiles: int, max_blocks: int):
    """i32[1]: the split size in blocks that every request of this call shares
    (:func:`~jattn.pallas_kernels.combine.balanced_split_blocks` over the requests'
    blocks of ``block`` keys). With equal lengths this is the split of
    :func:`choose_num_splits`; with uneven ones the long requests take more splits than
    the short ones."""
    nblk = (jnp.maximum(lens, 0) + block - 1) // block  # [bs]
    return balanced_split_blocks(nblk, num_splits, m_tiles, max_blocks, SPLIT_OVERHEAD_BLOCKS)


@functools.partial(
    jax.jit,
    static_argnames=(
        "kv_lora_rank",
        "max_seqlen_q",
        "is_causal",
        "return_lse",
        "num_splits",
        "score_scale",
        "land_stages",
        "options",
        "interpret",
        "balanced",
    ),
)
def _mla_decode(
    q,
    kv_cache,
    page_table,
    cache_seqlens,
    softmax_scale,
    kv_scale,
    *,
    kv_lora_rank,
    max_seqlen_q,
    is_causal,
    return_lse,
    num_splits,
    score_scale,
    land_stages,
    interpret,
    options=(),
    balanced=False,
):
    num_pages, page_size, width = kv_cache.shape
    bs = page_table.shape[0]
    h = q.shape[1]
    fp8, q_e4m3 = kv_cache.dtype == jnp.float8_e4m3fn, q.dtype == jnp.float8_e4m3fn
    out_dtype = jnp.bfloat16 if q_e4m3 else q.dtype
    cfg = MLADecodeConfig(
        width=width,
        rank=kv_lora_rank,
        num_heads=h,
        q_len=max_seqlen_q,
        is_causal=bool(is_causal and max_seqlen_q > 1),
        page_size=page_size,
        num_pages=num_pages,
        max_pages=page_table.shape[1],
        num_splits=num_splits,
        score_scale=score_scale,
        interpret=interpret,
        fp8=fp8,
        row_scales=fp8 and not q_e4m3,
        land_stages=land_stages,
        balanced=balanced,
    )
    # options: (field, value) pairs over the defaults (experiments, tests)
    cfg = dataclasses.replace(cfg, **{"v_regs": cfg.v_regs_ok, **dict(options)})
    # q rows padded to a multiple of 8 (with 8k heads, as DeepSeek's, no pad op at all)
    q3 = q.reshape(bs, cfg.m_rows, width)
    qs = None
    if cfg.row_scales:  # one kernel: the rows in e4m3 (padded), their factors (padded to the tiles)
        q3, qs = query_rows_e4m3(q3, cfg.m_rows8, cfg.m_tiles * 64, use_kernel=not interpret)
    elif cfg.m_rows8 != cfg.m_rows:
        q3 = jnp.pad(q3, ((0, 0), (0, cfg.m_rows8 - cfg.m_rows), (0, 0)))
    # a scale known when traced is built into the kernel: no operand, no op on the device
    scale = None
    if score_scale is None:
        scale = (jnp.asarray(softmax_scale, jnp.float32) * jnp.asarray(kv_scale, jnp.float32)).reshape(1)
    lens = cache_seqlens.astype(jnp.int32)
    if balanced:  # the call's split size rides after the lengths
        max_blocks = -(-(page_table.shape[1] * page_size) // BLOCK_N)
        per = balanced_split_size(lens, BLOCK_N, num_splits, cfg.m_tiles, max_blocks)
        lens = jnp.concatenate([lens, per])
    # FP8: P, the upcast V and the partial outputs in f16 (the GPU converts e4m3 to f16 only)
    part_dtype = jnp.float16 if cfg.fp8 else out_dtype
    o_part, lse_part = run(cfg, part_dtype, page_table.astype(jnp.int32), lens, scale, qs, q3, kv_cache)
    v_scale = None if isinstance(kv_scale, (int, float)) and float(kv_scale) == 1.0 else kv_scale
    out, lse = combine_splits(
        o_part,
        lse_part,
        q_len=max_seqlen_q,
        num_q_heads=h,
        sinks=None,
        v_scale=v_scale,
        out_dtype=out_dtype,
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
    keys_as_rows: bool = False,
    balanced_splits: bool | None = None,
):
    """MLA absorbed decode over the latent paged cache (Mosaic GPU, Hopper).

    Arguments as in ``jattn.ops.mla_decode_with_kvcache``; ``num_splits`` overrides the
    split count (None: :func:`choose_num_splits`). Returns the latent output
    ``[bs * max_seqlen_q, H, R]`` in q's dtype (bf16 for an e4m3 q), and with
    ``return_lse`` the natural-log LSE ``f32[bs * max_seqlen_q, H]``. ``kv_cache`` is
    q's dtype or float8_e4m3fn (``kv_scale`` its dequantisation scale); with FP8 a
    bf16/f16 query is read as e4m3 rows (``e4m3_query.query_rows_e4m3``, one kernel
    before the decode kernel), and an e4m3 query (with an e4m3 cache only) as it is,
    with no quantisation step.

    ``keys_as_rows``: run ``mosaic_mla_heads.mla_decode`` (the latent rows as
    the MMA rows, the query rows as its N; at most 32 query rows per request,
    Python-number scales) instead of this module's kernel. Off by default: it measured
    slower on the H200 at every 16-head shape (docs/PERF.md).

    ``balanced_splits`` (None: :func:`balanced_by_default`; not with ``num_splits``): the
    split size is chosen on the device from the call's lengths
    (:func:`balanced_split_size`), shared by every request, so a long request takes
    more splits than a short one; otherwise each request's blocks are cut into the
    same number of splits, chosen from the page table's width.
    """
    if balanced_splits is not None and not isinstance(balanced_splits, bool):
        raise ValueError(f"mla_decode: balanced_splits={balanced_splits!r} must be True, False or None (the default)")
    if balanced_splits and num_splits is not None:
        raise ValueError("mla_decode: balanced_splits chooses the split size itself; it takes no num_splits")
    elif balanced_splits and keys_as_rows:
        raise ValueError("mla_decode: balanced_splits is a choice of this module's kernel, not of keys_as_rows")
    if num_splits is not None:
        num_splits = _positive_int(num_splits, "mla_decode: num_splits", "an int >= 1 (or None: chosen)")
    if keys_as_rows:
        from jattn.pallas_kernels import mosaic_mla_heads

        return mosaic_mla_heads.mla_decode(
            q,
            kv_cache,
            page_table,
            cache_seqlens,
            kv_lora_rank=kv_lora_rank,
            softmax_scale=softmax_scale,
            max_seqlen_q=max_seqlen_q,
            is_causal=is_causal,
            kv_scale=kv_scale,
            return_lse=return_lse,
            num_splits=num_splits,
        )
    check_plan(q, page_table, cache_seqlens, max_seqlen_q)
    reason = _build_reason(q, kv_cache, kv_lora_rank, max_seqlen_q)
    if reason is not None:  # named now (a page of 48 rows read past the page and hung)
        raise ValueError(f"mosaic_mla.mla_decode: {reason}")
    bs, max_pages = page_table.shape
    if bs == 0 or q.shape[1] == 0:  # nothing to compute: no launch
        out_dtype = jnp.bfloat16 if jnp.dtype(q.dtype).itemsize == 1 else q.dtype
        return empty_outputs(q, kv_lora_rank, out_dtype, return_lse)
    m_tiles = -(-(max_seqlen_q * q.shape[1]) // 64)
    if balanced_splits is None:  # a given split count is even splits
        balanced_splits = num_splits is None and balanced_by_default(bs)
    if num_splits is None:
        max_blocks = -(-(max_pages * kv_cache.shape[1]) // BLOCK_N)
        choose = balanced_num_splits if balanced_splits else choose_num_splits
        num_splits = choose(bs, m_tiles, max_blocks)
    return _mla_decode(
        q,
        kv_cache,
        page_table,
        cache_seqlens,
        softmax_scale,
        kv_scale,
        kv_lora_rank=kv_lora_rank,
        max_seqlen_q=max_seqlen_q,
        is_causal=is_causal,
        return_lse=return_lse,
        num_splits=int(num_splits),
        score_scale=_static_scale(softmax_scale, kv_scale),
        land_stages=FP8_LAND_STAGES,
        interpret=_interpreting(),
        options=() if FP8_V_REGS else (("v_regs", False),),
        balanced=bool(balanced_splits),
    )


def _static_scale(softmax_scale, kv_scale):
    """``softmax_scale * kv_scale`` as a Python float when both are plain numbers, else None."""
    numbers = (int, float)
    if isinstance(softmax_scale, numbers) and isinstance(kv_scale, numbers):
        return float(softmax_scale) * float(kv_scale)
    return None
