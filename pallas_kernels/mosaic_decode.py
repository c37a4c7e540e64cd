"""Paged MHA/GQA decode on Pallas Mosaic GPU (Hopper): split-KV flash-decoding.

Layout of the work:

* Grid ``(num_splits, batch, m_groups)``. One CTA takes one request and one
  contiguous range of its KV blocks, and covers *all* KV heads at once, so
  every page is read from HBM exactly once per request (GQA packed). A request's
  blocks are cut into ``num_splits`` equal ranges, or, balanced (by default with several
  requests of one row tile and a 2-byte cache, ``decode_tuning.balanced_for``), into ranges of
  one size shared by the whole call and chosen on the device from all the lengths (it
  rides after them in the lengths operand), so that a long request takes more splits
  than a short one.
* A KV *block* is ``block_tokens`` consecutive tokens of one page across all KV
  heads: with ``k_cache.reshape(num_pages, page_size * num_kv_heads, head_dim)``
  it is one TMA box of ``block_n = block_tokens * num_kv_heads`` rows
  (row ``t * num_kv_heads + h``). A producer warpgroup streams K and V blocks
  into a ``num_stages`` ring in shared memory.
* Each compute warpgroup owns 64 query rows. The rows of request ``b`` are
  ``q[b*q_len:(b+1)*q_len].reshape(q_len * num_q_heads, head_dim)`` (row
  ``i * num_q_heads + h``). Scores are one ``wgmma`` ``Q[64, D] @ K^T[D, block_n]``
  covering every (query head, KV head) pair; pairs whose heads do not match are
  masked to ``-inf`` (block-diagonal GQA mask), so the ``P @ V`` ``wgmma`` only
  mixes each query head with its own KV head.
* num_kv_heads not a multiple of 8: a page's tail box is shifted back by whole
  8-row tiles only, so it can hold up to 7 rows of the page's unused tail, which
  the compute warpgroup zeroes in shared memory (last block of a request only).
* Masked keys contribute nothing, whatever they hold (docs/SEMANTICS.md). Scores
  are selected to ``-inf``; V is the danger (``P = 0`` times NaN is NaN). Only a
  *boundary* block holds masked columns whose V may be anything: the last blocks
  (past the length, draft tokens past a query's causal limit) and, with a window,
  its first blocks. Without a window and with one query per request (or
  non-causal queries) there is none: the tail past the length is never loaded,
  or zeroed as above. Otherwise, on a
  boundary block only, the compute warpgroup rewrites the V tile in shared
  memory: rows no query sees become 0; rows some queries see and others do not
  (at most ``q_len - 1`` draft tokens and as many at the window's edge) get
  their non-finite entries replaced by 0, and the queries that see such a row
  are flagged (a small shared-memory table) and come out NaN. Full blocks pay
  one scalar test.
* Each split writes a normalised partial output and its log-sum-exp;
  ``combine.combine_splits`` merges the splits and applies sinks and
  ``v_scale``. With one split there is nothing to merge.

Multi-token calls whose query rows fill at least one 64-row tile go to the per-KV-head
kernel (``mosaic_decode_heads``) where ``decode_tuning.prefer_heads_kernel`` picks it and
it serves the call (``KernelOptions.heads_kernel``; explicit ``block_sizes`` keep them
here), and so do FP8 calls (``KernelOptions.fp8_heads``: an e4m3 query there,
docs/SEMANTICS.md), calls with one KV head and one query per request
(:func:`one_kv_head_single_query`) and calls whose heads this kernel cannot tile
(:func:`no_all_heads_block`). The entry point
is :func:`mha_decode` (here); the kernel body and its launch are
``mosaic_decode_kernel``; ``decode_tuning`` holds its static configuration
(:class:`BlockSizes`, :class:`KernelOptions`, the choosers) and
:func:`unsupported_reason`, which says whether a call can be served here. The f32
oracle is ``jattn.reference.mha_decode``.

Limits (checked by :func:`unsupported_reason`; other calls go to the xla
backend): head_dim 64/128/256, page_size 16/32/64/128, GQA group 1..16, any
num_kv_heads that makes a KV block of 64..256 rows (larger groups and other KV head
counts on the per-KV-head kernel, where it serves the call), q_len 1..8, bf16/f16 q with
KV of the same dtype or FP8 e4m3 KV. FP8: the ring holds FP8 tiles (half the
bytes); here each K and V tile is upcast through registers into an f16 tile for the
wgmma (q is cast to f16 for these calls; the output is returned in q's dtype),
by a converter warpgroup into a ring of f16 tiles, which the compute warpgroup
reads as it reads 2-byte KV (the default), or with
``KernelOptions(fp8_converter=False)`` by the compute warpgroup itself in the
plain block loop.

Under the Mosaic GPU interpreter (CPU tests) the matmuls are plain dots on
the shared-memory tiles (the interpreter's wgmma takes neither a transposed B
nor A in registers) and TMA reads are clamped into bounds; everything else
(page addressing, the TMA ring and barriers, masks, softmax, combine) is the
kernel that runs on the GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jattn.pallas_kernels.combine import BALANCED_OVERHEAD_BLOCKS, balanced_split_blocks, combine_splits
from jattn.pallas_kernels.decode_tuning import (
    MAX_GROUP,
    SUPPORTED_HEAD_DIMS,
    SUPPORTED_PAGE_SIZES,
    BlockSizes,
    KernelOptions,
    auto_skip_reason,
    block_shape,
    choose_block_sizes,
    choose_num_splits,
    decode_config,
    prefer_heads_kernel,
)
from jattn.pallas_kernels.decode_tuning import unsupported_reason as all_heads_unsupported_reason
from jattn.pallas_kernels.mosaic_common import check_plan, empty_outputs, fold_softmax_scale
from jattn.pallas_kernels.mosaic_decode_kernel import _run_kernel, request_blocks

__all__ = [
    "mha_decode",
    "heads_kernel_for",
    "routed_heads_kernel",
    "no_all_heads_block",
    "unsupported_reason",
    "auto_skip_reason",
    "BlockSizes",
    "KernelOptions",
    "choose_block_sizes",
    "choose_num_splits",
    "SUPPORTED_PAGE_SIZES",
    "SUPPORTED_HEAD_DIMS",
]


def _interpreting() -> bool:
    from jattn.pallas_kernels.interpret import interpreting

    return interpreting()


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
    block_sizes: BlockSizes | None = None,
    options: KernelOptions = KernelOptions(),
):
    """Paged decode attention (Mosaic GPU, Hopper).

    Args:
      q: ``[bs * q_len, Hq, D]`` bf16/f16, request-major.
      k_cache, v_cache: ``[num_pages, page_size, Hkv, D]``, same dtype as q.
      page_table: i32 ``[bs, max_pages]``; ids are clamped into the pool.
      cache_seqlens: i32 ``[bs]``, visible tokens per request, new tokens included.
      max_seqlen_q: q_len (1..8); is_causal, window_left, logit_cap, sinks (f32
        ``[Hq]``), softmax_scale: as in ``jattn.ops.mha_decode_with_kvcache``
        (rules in docs/SEMANTICS.md). k_scale / v_scale: Python floats or traced
        f32 scalars.
      return_lse: also return the natural-log LSE f32 ``[bs * q_len, Hq]``.
      block_sizes: the tiling (:func:`choose_block_sizes` when None).
      options: code-path choices (:class:`KernelOptions`); every setting gives
        the same results, up to the FP8 query's rounding on FP8 caches.

    Returns:
      ``out`` ``[bs * q_len, Hq, D]`` in q.dtype, or ``(out, lse)``.

    Example::

      out = mha_decode(q, k_cache, v_cache, page_table, lens)  # GPU
    """
    check_plan(q, page_table, cache_seqlens, max_seqlen_q)
    if page_table.shape[0] == 0 or q.shape[1] == 0:  # nothing to compute: no launch
        return empty_outputs(q, v_cache.shape[-1], q.dtype, return_lse)
    softmax_scale, k_scale = fold_softmax_scale(softmax_scale, k_scale)
    if block_sizes is None:
        heads = routed_heads_kernel(
            q, k_cache, v_cache, max_seqlen_q, window_left, logit_cap, sinks, softmax_scale, k_scale, v_scale,
            is_causal=is_causal, options=options,
        )  # fmt: skip
        if heads is not None:
            return heads(
                q,
                k_cache,
                v_cache,
                page_table,
                cache_seqlens,
                softmax_scale=softmax_scale,
                k_scale=k_scale,
                v_scale=v_scale,
                max_seqlen_q=max_seqlen_q,
                is_causal=is_causal,
                return_lse=return_lse,
                persistent=options.heads_persistent,
                row_tile=options.heads_row_tile,
                combine_kernel=options.kernel_combine,
            )
    reason = one_kv_head_reason(k_cache, max_seqlen_q, window_left, logit_cap, sinks)
    if reason is not None:  # a clear error now, not a failed build later
        raise ValueError(f"mosaic decode: {reason}")
    # A Python 1.0 v_scale is known at trace time: the output then needs no multiply.
    # A Python k_scale is folded into a constant score scale (no kernel computes it).
    unit_v = isinstance(v_scale, (int, float)) and float(v_scale) == 1.0
    k_py = isinstance(k_scale, (int, float))
    return _mha_decode(
        q,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        None if unit_v else v_scale,
        None if k_py else k_scale,
        max_seqlen_q=max_seqlen_q,
        k_scale_py=float(k_scale) if k_py else None,
        is_causal=is_causal,
        window_left=window_left,
        logit_cap=logit_cap,
        sinks=sinks,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
        block_sizes=block_sizes,
        options=options,
    )


def unsupported_reason(
    q, k_cache, v_cache, *, max_seqlen_q=1, is_causal=True, window_left=-1, logit_cap=0.0, sinks=None,
    softmax_scale=None, k_scale=1.0, v_scale=1.0, batch_invariant=False, **kw,
) -> str | None:  # fmt: skip
    """None if :func:`mha_decode` (default options, no block sizes) serves the call, else why
    not: the all-heads kernel's limits, except for a call :func:`heads_kernel_for` sends to
    the per-KV-head kernel (e.g. KV heads or a group no all-heads block fits,
    :func:`no_all_heads_block`).
    ``batch_invariant`` (set by the ops): the all-heads kernel alone, whose block sizes
    carry the invariant split count (not for one KV head and one query per request, which
    that kernel does not compile: :func:`one_kv_head_single_query`)."""
    reason = all_heads_unsupported_reason(
        q, k_cache, v_cache, max_seqlen_q=max_seqlen_q, window_left=window_left, sinks=sinks, **kw
    )
    if reason is None:
        reason = one_kv_head_reason(k_cache, max_seqlen_q, window_left, logit_cap, sinks)
        if reason is not None and batch_invariant:
            return f"batch_invariant=True (the mode runs the all-heads kernel alone) with {reason}"
    if reason is None or batch_invariant:
        return reason
    from jattn.pallas_kernels.interpret import no_gpu_reason

    if no_gpu_reason() is not None:
        return reason
    softmax_scale, k_scale = fold_softmax_scale(softmax_scale, k_scale)
    heads = heads_kernel_for(
        q, k_cache, v_cache, max_seqlen_q, window_left, logit_cap, sinks, softmax_scale, k_scale, v_scale,
        is_causal=is_causal,
    )  # fmt: skip
    return None if heads is not None else reason


def one_kv_head_single_query(k_cache, max_seqlen_q) -> bool:
    """Whether a call is one the all-heads kernel does not compile on jax 0.11 (one KV head,
    one query per request: Mosaic GPU's layout inference finds no solution for that build;
    the cause is not found, docs/PERF.md), so :func:`mha_decode` sends it to the per-KV-head kernel whatever
    ``KernelOptions.heads_kernel`` says; with one KV head both kernels stream the same
    rows."""
    return k_cache.shape[2] == 1 and max_seqlen_q == 1


def no_all_heads_block(q, k_cache) -> bool:
    """Whether the all-heads kernel has no tiling for the call's heads: a GQA group past
    ``MAX_GROUP`` (MQA with 32 or 64 query heads), or KV heads whose KV block cannot be a
    multiple of 64 rows and at most 256 (5, 7 or 10 of them). The per-KV-head kernel,
    which tiles one KV head's query rows, takes such calls where it serves them, whatever
    ``KernelOptions.heads_kernel`` says."""
    if q.ndim != 3 or k_cache.ndim != 4 or q.shape[1] % k_cache.shape[2]:
        return False
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    return q.shape[1] // num_kv_heads > MAX_GROUP or block_shape(num_kv_heads, head_dim, page_size) is None


def heads_kernel_required(q, k_cache, max_seqlen_q) -> bool:
    """Whether a call goes to the per-KV-head kernel whatever ``KernelOptions.heads_kernel``
    says (where that kernel serves it): one KV head and one query per request
    (:func:`one_kv_head_single_query`), or heads the all-heads kernel cannot tile
    (:func:`no_all_heads_block`)."""
    return one_kv_head_single_query(k_cache, max_seqlen_q) or no_all_heads_block(q, k_cache)


def one_kv_head_reason(k_cache, max_seqlen_q, window_left=-1, logit_cap=0.0, sinks=None) -> str | None:
    """Why the all-heads kernel cannot take a call with one KV head and one query per
    request (:func:`one_kv_head_single_query`), or None: its builds of such calls fail
    Mosaic GPU's layout inference on jax 0.11 except with a window and neither a logit cap
    nor sinks, the builds that compiled on the GPU (docs/PERF.md). The per-KV-head kernel
    serves the calls with none of the three."""
    if not one_kv_head_single_query(k_cache, max_seqlen_q):
        return None
    if window_left >= 0 and not logit_cap and sinks is None:
        return None
    return (
        "one KV head and one query per request with a logit cap or sinks, or without a window: the all-heads "
        "kernel's build of such a call fails Mosaic GPU's layout inference on jax 0.11 (the per-KV-head "
        "kernel, which takes the others, has no window, cap or sinks and needs Python-number scales)"
    )


def routed_heads_kernel(
    q, k_cache, v_cache, max_seqlen_q, window_left, logit_cap, sinks, softmax_scale, k_scale, v_scale,
    *, is_causal, options,
):  # fmt: skip
    """The per-KV-head kernel call (:func:`heads_kernel_for`) that :func:`mha_decode` makes
    with ``options`` and no explicit block sizes, or None where the call stays on the
    all-heads kernel: only with ``options.heads_kernel``, or for a call that
    :func:`heads_kernel_required` sends there whatever the options say; FP8 calls go to
    its e4m3-query path with ``fp8_heads`` and ``heads_kernel`` both on. Its splits are
    balanced only where ``options.balanced_splits`` is True (None keeps them even: not
    yet timed on this kernel)."""
    if not (options.heads_kernel or heads_kernel_required(q, k_cache, max_seqlen_q)):
        return None
    return heads_kernel_for(
        q, k_cache, v_cache, max_seqlen_q, window_left, logit_cap, sinks, softmax_scale, k_scale, v_scale,
        fp8_heads=options.fp8_heads and options.heads_kernel, is_causal=is_causal, overlap=options.heads_overlap,
        glue=options.heads_glue, v_regs=options.heads_v_regs, balanced=bool(options.balanced_splits),
    )  # fmt: skip


def heads_kernel_for(
    q, k_cache, v_cache, max_seqlen_q, window_left, logit_cap, sinks, softmax_scale, k_scale, v_scale,
    fp8_heads=True, is_causal=True, overlap=False, glue=True, v_regs=False, balanced=False,
):  # fmt: skip
    """``mosaic_decode_heads.mha_decode_heads`` where :func:`prefer_heads_kernel` or
    :func:`heads_kernel_required` picks it and it serves the call (Python-number scales,
    no window, cap or sinks), else None. ``fp8_heads`` (``KernelOptions.fp8_heads``): every
    FP8 call goes to it too (decode, causal verify, draft blocks), with the e4m3 query over
    64-token blocks. ``overlap``, ``glue`` and ``v_regs``: ``KernelOptions.heads_overlap``,
    ``heads_glue`` and ``heads_v_regs``, passed on (FP8 takes ``overlap`` only with
    ``v_regs``, the one FP8 loop that pipelines); ``balanced`` too."""
    from jattn.pallas_kernels import mosaic_decode_heads

    py = (int, float)
    if not (
        isinstance(k_scale, py) and isinstance(v_scale, py) and (softmax_scale is None or isinstance(softmax_scale, py))
    ):
        return None
    reason = mosaic_decode_heads.unsupported_reason(
        q, k_cache, v_cache, max_seqlen_q=max_seqlen_q, window_left=window_left, logit_cap=logit_cap, sinks=sinks
    )
    if reason is not None:
        return None
    itemsize = jnp.dtype(k_cache.dtype).itemsize
    if fp8_heads and itemsize == 1:
        return functools.partial(
            mosaic_decode_heads.mha_decode_heads,
            fp8_qk=True, block=64, v_regs=v_regs, overlap=overlap and v_regs, glue=glue, balanced=balanced,
        )  # fmt: skip
    if not (prefer_heads_kernel(max_seqlen_q, q.shape[1], itemsize) or heads_kernel_required(q, k_cache, max_seqlen_q)):
        return None
    # an FP8 cache here (no fp8_heads) takes the upcast, which does not pipeline
    return functools.partial(
        mosaic_decode_heads.mha_decode_heads, overlap=overlap and itemsize == 2, glue=glue, balanced=balanced
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "max_seqlen_q",
        "is_causal",
        "window_left",
        "logit_cap",
        "softmax_scale",
        "return_lse",
        "block_sizes",
        "options",
        "k_scale_py",
    ),
)
def _mha_decode(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    v_scale,
    k_scale,
    *,
    max_seqlen_q,
    k_scale_py,
    is_causal,
    window_left,
    logit_cap,
    sinks,
    softmax_scale,
    return_lse,
    block_sizes,
    options,
):
    """:func:`mha_decode` under jit (``v_scale`` None: 1.0; ``k_scale`` None: the
    Python float ``k_scale_py``)."""
    reason = all_heads_unsupported_reason(
        q, k_cache, v_cache, max_seqlen_q=max_seqlen_q, window_left=window_left, sinks=sinks, options=options
    )
    if reason is not None:
        raise NotImplementedError(f"mosaic mha_decode: {reason}")
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    tokens, num_q_heads, _ = q.shape
    batch = tokens // max_seqlen_q
    cfg = decode_config(
        batch=batch,
        num_pages=num_pages,
        page_size=page_size,
        max_pages=page_table.shape[1],
        num_kv_heads=num_kv_heads,
        num_q_heads=num_q_heads,
        head_dim=head_dim,
        q_len=max_seqlen_q,
        is_causal=is_causal,
        window_left=window_left,
        logit_cap=logit_cap,
        block_sizes=block_sizes,
        kv_itemsize=jnp.dtype(k_cache.dtype).itemsize,
        q_itemsize=jnp.dtype(q.dtype).itemsize,
        interpret=_interpreting(),
        options=options,
    )
    m_rows, dtype = cfg.m_rows, q.dtype

    sm_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if k_scale is None:
        scale = np.asarray([k_scale_py * sm_scale], np.float32)
    else:
        scale = (jnp.asarray(k_scale, jnp.float32) * sm_scale).reshape(1)
    # FP8 KV computes in f16: e4m3 -> f16 is exact and the one upcast the hardware
    # has (e4m3 -> bf16 goes through f32); bf16 q -> f16 keeps 10 mantissa bits.
    cdtype = jnp.float16 if jnp.dtype(k_cache.dtype).itemsize == 1 else dtype
    q3 = q.reshape(batch, m_rows, head_dim).astype(cdtype)
    if cfg.o_rows != m_rows:
        q3 = jnp.pad(q3, ((0, 0), (0, cfg.o_rows - m_rows), (0, 0)))
    k2 = k_cache.reshape(num_pages, page_size * num_kv_heads, head_dim)
    v2 = v_cache.reshape(num_pages, page_size * num_kv_heads, head_dim)
    lens = cache_seqlens.astype(jnp.int32)
    if cfg.balanced:  # the call's split size rides after the lengths
        lens = jnp.concatenate([lens, _balanced_split_size(cfg, lens)])
    o_part, lse_part = _run_kernel(cfg, cdtype, page_table.astype(jnp.int32), lens, scale, q3, k2, v2)
    out, lse = combine_splits(
        o_part,
        lse_part,
        q_len=max_seqlen_q,
        num_q_heads=num_q_heads,
        sinks=sinks,
        v_scale=v_scale,
        out_dtype=dtype,
        use_kernel=options.kernel_combine,
    )
    return (out, lse) if return_lse else out


def _balanced_split_size(cfg, lens):
    """i32[1]: the split size in KV blocks of a balanced call, from the blocks each
    request's CTAs walk (the kernel's own count, :func:`request_blocks`)."""
    lo, hi = request_blocks(cfg, lens)
    max_blocks = -(-(cfg.max_pages * cfg.page_size) // (cfg.bs.block_tokens * cfg.bs.pages_per_block))
    programs = cfg.m_tiles // cfg.bs.compute_wgs
    return balanced_split_blocks(
        jnp.maximum(hi - lo, 0), cfg.bs.num_splits, programs, max_blocks, BALANCED_OVERHEAD_BLOCKS
    )
