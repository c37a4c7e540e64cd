"""Paged MHA/GQA decode, one KV head per CTA, keys as the MMA rows (Mosaic GPU, Hopper).

``mosaic_decode.mha_decode`` (so ``jattn.ops.mha_decode_with_kvcache`` on the mosaic
backend) sends it the multi-token calls that ``decode_tuning.prefer_heads_kernel`` picks
(spec verify and draft blocks whose query rows fill at least one 64-row tile of the
all-heads kernel) when it serves them, every FP8 call (``KernelOptions.fp8_heads``: its
``fp8_qk`` and ``v_regs`` paths), and calls with one KV head and one query per request,
which the all-heads kernel does not compile; ``KernelOptions(heads_kernel=False)`` turns
the first two off.

The kernel body and its launch are in ``mosaic_decode_heads_kernel`` (with the layout,
occupancy, launch and FP8 paths described there); its build configuration, what it serves
and its launch choices in ``mosaic_decode_heads_config``. Here: the jitted call
(:func:`decode`, which lays out the query, launches the kernel and merges the splits), the
e4m3 query of ``fp8_qk`` as the test oracle sees it (:func:`fp8_qk_query`; the call makes it
with ``e4m3_query.query_tiles``) and the checked
entry point :func:`mha_decode_heads`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jattn.pallas_kernels import e4m3_query
from jattn.pallas_kernels.combine import (
    BALANCED_OVERHEAD_BLOCKS,
    HeadsLayout,
    balanced_split_blocks,
    balanced_split_count,
    combine_splits,
)
from jattn.pallas_kernels.e4m3_query import query_rows
from jattn.pallas_kernels.mosaic_common import check_plan, empty_outputs
from jattn.pallas_kernels.mosaic_decode_heads_config import (  # noqa: F401 - re-exported
    BLOCK,
    HeadsConfig,
    choose_num_splits,
    item_width,
    launch_ctas,
    row_tiles,
    unsupported_reason,
)
from jattn.pallas_kernels.mosaic_decode_heads_kernel import _run
from jattn.plan_inputs import _positive_int

__all__ = ["mha_decode_heads", "decode", "unsupported_reason", "HeadsConfig"]


@functools.partial(
    jax.jit,
    static_argnames=(
        "softmax_scale", "k_scale", "v_scale", "max_seqlen_q", "is_causal", "return_lse", "num_splits", "num_ctas",
        "latent", "interpret", "row_tile", "block", "fp8_qk", "v_regs", "overlap", "glue", "combine_kernel",
        "balanced",
    ),
)  # fmt: skip
def decode(q, k_cache, v_cache, page_table, cache_seqlens, *, softmax_scale, k_scale, v_scale, max_seqlen_q,
            is_causal, return_lse, num_splits, num_ctas, latent, interpret, row_tile=0, block=BLOCK,
            fp8_qk=False, v_regs=False, overlap=False, glue=True, combine_kernel=True, balanced=False):  # fmt: skip
    """The jitted call behind :func:`mha_decode_heads` and ``mosaic_mla_heads.mla_decode``:
    arguments checked by their callers, scales as Python floats, pools
    ``[pages, page_size, Hkv, D]``. ``num_ctas``: as :func:`launch_ctas`. ``latent``: MLA's
    value width (``k_cache`` is the latent pool with one KV head and ``v_cache`` is not
    read); 0 for MHA. ``row_tile``: as :attr:`HeadsConfig.row_tile` (0 where it would
    not split the rows). ``block`` and ``fp8_qk``: as :class:`HeadsConfig`'s fields;
    ``v_regs`` too (with ``fp8_qk``), and ``overlap`` with 2-byte K/V or ``v_regs`` (MHA
    only). ``balanced``: as :func:`mha_decode_heads`; ``num_splits`` is then the even-length
    count the static split count grows from."""
    num_pages, ps, hkv, d = k_cache.shape
    bs = page_table.shape[0]
    hq = q.shape[1]
    if bs == 0 or hq == 0:  # nothing to compute: no launch (a kernel of no items would still load a Q tile)
        return empty_outputs(q, latent or v_cache.shape[-1], q.dtype, return_lse)
    fp8 = jnp.dtype(k_cache.dtype).itemsize == 1
    v_regs = bool(v_regs and fp8_qk)
    tiles = row_tiles(max_seqlen_q * (hq // hkv), row_tile)
    row_tile = row_tile if tiles > 1 else 0
    max_blocks = -(-page_table.shape[1] * ps // block)
    programs = hkv * tiles  # CTAs (items) per split of a request
    if balanced:
        num_splits = balanced_split_count(num_splits, programs, max_blocks)
    cfg = HeadsConfig(
        head_dim=d,
        group=hq // hkv,
        kv_heads=hkv,
        q_len=max_seqlen_q,
        is_causal=bool(is_causal and max_seqlen_q > 1),
        page_size=ps,
        num_pages=num_pages,
        max_pages=page_table.shape[1],
        num_splits=num_splits,
        batch=bs,
        ctas=0,
        scale=softmax_scale * k_scale,
        fp8=fp8,
        interpret=interpret,
        latent=latent,
        row_tile=row_tile,
        block=block,
        fp8_qk=fp8_qk,
        v_regs=v_regs,
        overlap=bool(overlap and not latent and (v_regs or not fp8)),
        balanced=bool(balanced),
    )
    cfg = dataclasses.replace(cfg, ctas=launch_ctas(cfg, num_ctas))
    n, g, tiles = cfg.n, cfg.group, cfg.tiles
    k2d = k_cache.reshape(num_pages * ps, hkv * d)
    v2d = k2d if latent else v_cache.reshape(num_pages * ps, hkv * d)
    # FP8 K/V compute in f16: e4m3 -> f16 is exact and the one upcast the hardware has
    cdtype = jnp.float16 if cfg.fp8 else q.dtype
    if fp8_qk:
        q_arr, qf, bad = e4m3_query.query_tiles(q, hkv, max_seqlen_q, tiles, n, use_kernel=glue)
    else:
        q_arr, qf, bad = query_rows(q, hkv, max_seqlen_q, tiles * n).astype(cdtype), None, None
    lens = cache_seqlens.astype(jnp.int32)
    if balanced:  # the call's split size rides after the lengths
        nblk = (jnp.maximum(lens, 0) + block - 1) // block
        per = balanced_split_blocks(nblk, num_splits, programs, max_blocks, BALANCED_OVERHEAD_BLOCKS)
        lens = jnp.concatenate([lens, per])
    o_t, lse = _run(cfg, cdtype, page_table.astype(jnp.int32), lens, q_arr, k2d, v2d, qf)
    # The combine reads the partials as the kernel writes them (o_t [S, bs, hkv, tiles, dv,
    # N], lse [S, bs, hkv, tiles, N]). An e4m3 query row with a non-finite entry went in as
    # zeros; the combine makes it NaN where it saw a key, as the exact query would be.
    heads = HeadsLayout(kv_heads=hkv, group=g, width=n, tiles=tiles)
    bad = None if bad is None else bad.reshape(bs, hkv, tiles, n)
    merge = functools.partial(
        combine_splits, q_len=max_seqlen_q, num_q_heads=hq, sinks=None, out_dtype=q.dtype, use_kernel=combine_kernel,
        v_scale=None if v_scale == 1.0 else jnp.float32(v_scale),
    )  # fmt: skip
    if glue:
        out, lse = merge(o_t, lse, heads=heads, nan_rows=bad)
    else:  # the layouts moved by XLA ops around the rows combine (the A/B of KernelOptions.heads_glue)
        rows = functools.partial(heads.to_rows, q_len=max_seqlen_q, values=False)
        o_rows = heads.to_rows(o_t, max_seqlen_q, values=True)
        out, lse = merge(o_rows, rows(lse), nan_rows=None if bad is None else rows(bad))
    return (out, lse) if return_lse else out


def fp8_qk_query(q, num_kv_heads: int, max_seqlen_q: int = 1, row_tile: int = 0):
    """The query that :func:`mha_decode_heads` with ``fp8_qk=True`` (and these rows and
    tiles) attends with: ``q`` rounded to e4m3 at its tiles' scales, f32, in ``q``'s
    layout (NaN rows where ``q`` has a non-finite entry). Attention over it in f32 is what
    the kernel computes, up to the f16 ``P V``."""
    rows, hq, d = q.shape
    g = hq // num_kv_heads
    tiles, n = row_tiles(max_seqlen_q * g, row_tile), item_width(max_seqlen_q * g, row_tile)
    q8, factor, _ = e4m3_query.query_tiles(q, num_kv_heads, max_seqlen_q, tiles, n, use_kernel=False)
    x = q8.astype(jnp.float32).reshape(*factor.shape, -1) * factor[..., None]
    x = x.reshape(q8.shape)[:, :, : max_seqlen_q * g]
    x = x.reshape(-1, num_kv_heads, max_seqlen_q, g, d).transpose(0, 2, 1, 3, 4)
    # a row with a non-finite entry stays NaN (the kernel's output for it, where it sees a key)
    return jnp.where(jnp.isfinite(q).all(axis=-1, keepdims=True), x.reshape(rows, hq, d), jnp.nan)


def mha_decode_heads(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    *,
    softmax_scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_seqlen_q: int = 1,
    is_causal: bool = True,
    return_lse: bool = False,
    num_splits: int | None = None,
    persistent: bool = False,
    num_ctas: int | None = None,
    row_tile: int = 0,
    block: int = BLOCK,
    fp8_qk: bool = False,
    v_regs: bool = False,
    overlap: bool = False,
    glue: bool = True,
    combine_kernel: bool = True,
    balanced: bool = False,
):
    """Paged decode as ``jattn.ops.mha_decode_with_kvcache`` (bf16/f16 q; K/V in q's dtype
    or FP8 e4m3 with the Python-number scales ``k_scale`` / ``v_scale``; no window, cap or
    sinks): ``q [bs * max_seqlen_q, Hq, D]``, pools ``[pages, page_size, Hkv, D]``.
    Returns ``[bs * max_seqlen_q, Hq, D]`` in q's dtype (and with ``return_lse`` the
    natural-log LSE ``f32[bs * max_seqlen_q, Hq]``).

    ``persistent``: launch one CTA per SM slot (two per SM where two fit), each walking
    several (split, request, KV head) items in a fixed round-robin order, so one item's
    epilogue and the next item's Q load overlap the K/V stream the producer has already
    started for it; off (the default), one CTA per item, placed by the hardware as SM
    slots free up. ``num_ctas`` sets the CTA count of the persistent launch (tests).

    ``row_tile`` (16 or 32; 0, the default, for none): a KV head's query rows go in tiles
    of that many, each tile an item of its own (a narrower MMA and softmax tile per
    chain) beside the other tiles of its split, which read the same K/V blocks at about
    the same time (the second read from L2). It applies where the rows are more than
    ``row_tile``.

    ``block``: tokens per ring block, 64 (the default) or 128. ``fp8_qk`` (FP8 K/V only):
    the query goes to e4m3, each KV head's rows (of a row tile) with one power-of-two
    scale, and ``S^T = K Q^T`` runs as an e4m3 ``wgmma`` on the landed K tile, so only V
    is upcast (while that MMA runs) and two CTAs share an SM where they fit. The query's
    rounding to e4m3 (3 mantissa bits) is the price: :func:`fp8_qk_query` gives the query
    the kernel then attends with.

    ``v_regs`` (with ``fp8_qk``): ``V^T`` goes from the landed e4m3 V tile into registers,
    upcast there, as the ``O^T`` MMA's register operand, so the f16 V tile and its
    shared-memory round trip go and the ring gets that room.

    ``overlap`` (2-byte K/V, or FP8 with ``v_regs``): block ``i + 1``'s ``S^T`` is
    issued before block ``i``'s softmax, so that MMA runs under the softmax and the ``O^T``
    MMA (the scores of one block wait in registers for the next step).

    ``glue`` (the default): the e4m3 query tiles (``fp8_qk``) come from one Triton kernel
    (``e4m3_query``) and the split combine reads the kernel's partials in its layout
    (``combine.HeadsLayout``), where jax-triton runs; off: XLA ops gather the query and
    move the partials to the rows layout (an A/B of the same results, up to the order in
    which the two combines sum the splits). ``combine_kernel``: the split combine as one
    Triton kernel where jax-triton runs (``KernelOptions.kernel_combine``), else XLA ops.

    ``balanced``: every request of the call is cut into splits of one size in key blocks,
    chosen on the device from all the lengths
    (:func:`~jattn.pallas_kernels.combine.balanced_split_blocks`), over a static split count
    grown so that the longest request the page table holds could fill about two waves of
    the SMs (:func:`~jattn.pallas_kernels.combine.balanced_split_count`): a long request
    takes more splits than a short one, whose unused splits are empty CTAs, so uneven
    lengths do not leave a tail of long requests' CTAs. ``num_splits`` is the even-length
    count it grows from."""
    from jattn.pallas_kernels.interpret import interpreting

    reason = unsupported_reason(q, k_cache, v_cache, max_seqlen_q=max_seqlen_q)
    if reason:
        raise ValueError(f"mha_decode_heads: {reason}")
    if row_tile not in (0, 16, 32):
        raise ValueError(f"mha_decode_heads: row_tile={row_tile!r} must be 0 (no tiles), 16 or 32")
    if block not in (64, 128):
        raise ValueError(f"mha_decode_heads: block={block!r} must be 64 or 128 tokens")
    if fp8_qk and jnp.dtype(k_cache.dtype).itemsize != 1:
        raise ValueError(f"mha_decode_heads: fp8_qk needs an FP8 e4m3 cache, got {k_cache.dtype}")
    if v_regs and not fp8_qk:
        raise ValueError("mha_decode_heads: v_regs needs fp8_qk=True (V^T in registers serves the e4m3 query path)")
    if overlap and jnp.dtype(k_cache.dtype).itemsize == 1 and not v_regs:
        raise ValueError("mha_decode_heads: overlap on an FP8 cache needs v_regs=True (V^T in registers)")
    check_plan(q, page_table, cache_seqlens, max_seqlen_q)
    _, ps, hkv, d = k_cache.shape
    bs, max_pages = page_table.shape
    if num_splits is not None:
        num_splits = _positive_int(num_splits, "mha_decode_heads: num_splits", "an int >= 1 (or None: chosen)")
    if num_splits is None:
        tiles = row_tiles(max_seqlen_q * (q.shape[1] // hkv), row_tile)
        num_splits = choose_num_splits(bs, hkv, max_pages * ps, tiles, block)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    return decode(
        q,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        softmax_scale=scale,
        k_scale=float(k_scale),
        v_scale=float(v_scale),
        max_seqlen_q=max_seqlen_q,
        is_causal=is_causal,
        return_lse=return_lse,
        num_splits=int(num_splits),
        num_ctas=(None if num_ctas is None else int(num_ctas)) if persistent else -1,
        latent=0,
        interpret=interpreting(),
        row_tile=int(row_tile),
        block=int(block),
        fp8_qk=bool(fp8_qk),
        v_regs=bool(v_regs),
        overlap=bool(overlap),
        glue=bool(glue),
        combine_kernel=bool(combine_kernel),
        balanced=bool(balanced),
    )
