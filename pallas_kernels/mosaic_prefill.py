"""Ragged prefill and paged extend attention on Pallas Mosaic GPU (Hopper): the entry points.

* **prefill** (:func:`mha_prefill`, ``jattn.ops.mha_prefill``): ragged q, k, v without a
  cache; request ``b``'s queries are ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and its keys
  ``cu_seqlens_kv[b]:cu_seqlens_kv[b+1]``;
* **extend** (:func:`mha_extend`, ``jattn.ops.mha_extend_with_kvcache``, after the new
  K/V are written to the cache): ragged q over a paged cache; request ``b``'s keys are
  its first ``cache_seqlens[b]`` cached tokens, found through ``page_table[b]``.

Both run the one kernel of ``mosaic_prefill_kernel`` (its docstring describes the work
layout, the ping-pong, masking and the output writes). Here: the checks
(:func:`unsupported_reason`), the block sizes, the padding request, the tile plan and
the per-call V check (``prefill_plan``), FP8 computing in f16, the merge of the side
buffer, ``v_scale``. The f32 oracles are ``jattn.reference.mha_prefill`` and
``jattn.reference.mha_extend``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jattn.pallas_kernels import prefill_plan as plan
from jattn.pallas_kernels.combine import NUM_SMS
from jattn.pallas_kernels.interpret import no_gpu_reason
from jattn.pallas_kernels.mosaic_common import empty_outputs, fold_softmax_scale
from jattn.pallas_kernels.mosaic_prefill_config import (
    TILE_Q,
    PrefillConfig,
    PrefillOptions,
    persistent_by_default,
    resolve_l2_section_kib,
)
from jattn.pallas_kernels.mosaic_prefill_kernel import run

__all__ = [
    "mha_prefill",
    "mha_extend",
    "unsupported_reason",
    "extend_unsupported_reason",
    "PrefillConfig",
    "PrefillOptions",
    "TILE_Q",
]

SUPPORTED_HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)


def _interpreting() -> bool:
    from jattn.pallas_kernels.interpret import interpreting

    return interpreting()


def _num_sms() -> int:
    """The default device's SM count (the persistent launch's CTAs), or the H200's
    where JAX does not report it (CPU, the interpreter)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or NUM_SMS)


def _choose_blocks(d: int, dv: int, kv_fp8: bool = False, block_kv: int = 0) -> tuple[int, int]:
    """(block_kv, num_stages) by head width: the ring and the two query tiles fit
    in shared memory, and the score tile plus the accumulator fit in registers.
    FP8 at head_dim 256: the landing tiles leave room for one ring slot (the landing
    tiles are then the second buffer). 192/128 takes 128-key blocks where its output
    tiles borrow a ring slot (``PrefillConfig.out_in_ring``) and no FP8 landing tiles
    are needed. ``block_kv`` (> 0, ``PrefillOptions.block_kv``) overrides the block: 64
    keys with the stages the width allows, 128 where the width takes 128 by default (else
    ``ValueError``: its ring would not fit in shared memory)."""
    if d == 256 and kv_fp8:
        default = 64, 1
    elif (d, dv) == (192, 128) and not kv_fp8:
        default = 128, 2
    elif max(d, dv) > 128:
        default = 64, 2
    else:
        default = 128, 2
    if block_kv == 64:
        return 64, default[1]
    if block_kv == 128 and default[0] != 128:
        raise ValueError(
            f"PrefillOptions.block_kv=128 at head dims {d}/{dv}{' with FP8 K/V' if kv_fp8 else ''}: its ring "
            "does not fit in shared memory (64, or 0 for the width's default)"
        )
    return default


def unsupported_reason(q, k, v, *, page_size=0, **_) -> str | None:
    """None when the kernel can serve this prefill call (``k``/``v`` ragged) or, with
    ``page_size``, this extend call (``k``/``v`` the paged cache), else a one-line reason."""
    if q.shape[0] == 0 or q.shape[1] == 0:
        return "no query rows or heads"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"q dtype {q.dtype} (bf16/f16 only)"
    if k.dtype != v.dtype:
        return f"k dtype {k.dtype} differs from v's {v.dtype}"
    if k.dtype != q.dtype and k.dtype != jnp.float8_e4m3fn:
        return f"k/v dtype {k.dtype} (q's dtype {q.dtype}, or FP8 e4m3)"
    d, dv = q.shape[-1], v.shape[-1]
    if (d, dv) not in SUPPORTED_HEAD_DIMS:
        return f"head dims {d}/{dv} (supported: {SUPPORTED_HEAD_DIMS})"
    if k.shape[-1] != d or k.shape[:-1] != v.shape[:-1]:
        return f"k {tuple(k.shape)} must have q's head_dim {d} and v's {tuple(v.shape)} but for the last dimension"
    hq, hkv = q.shape[-2], k.shape[-2]
    if hq % hkv:
        return f"num_q_heads={hq} is not a multiple of num_kv_heads={hkv}"
    if page_size and page_size not in SUPPORTED_PAGE_SIZES:
        return f"page_size={page_size} (supported: {SUPPORTED_PAGE_SIZES})"
    return no_gpu_reason()


def extend_unsupported_reason(q, k_cache, v_cache, **kw) -> str | None:
    """:func:`unsupported_reason` of an extend over ``[num_pages, page_size, Hkv, D]`` caches."""
    return unsupported_reason(q, k_cache, v_cache, page_size=k_cache.shape[1], **kw)


@functools.partial(
    jax.jit,
    static_argnames=(
        "page_size",
        "is_causal",
        "window_left",
        "logit_cap",
        "softmax_scale",
        "return_lse",
        "interpret",
        "clean_edges",
        "options",
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
    sinks,
    k_scale,
    v_scale,
    *,
    page_size,
    is_causal,
    window_left,
    logit_cap,
    softmax_scale,
    return_lse,
    interpret,
    clean_edges,
    options,
):
    if options.ctas < 0:
        raise ValueError(f"PrefillOptions.ctas={options.ctas}: 0 (one CTA per SM) or a positive count")
    if options.ctas and options.persistent is False:
        raise ValueError(f"PrefillOptions.ctas={options.ctas} sizes the persistent launch; persistent=False has none")
    if options.block_kv not in (0, 64, 128):
        raise ValueError(f"PrefillOptions.block_kv={options.block_kv}: 0 (by head width), 64 or 128")
    if options.prefetch_k and options.overlap_pv:
        raise ValueError("PrefillOptions: prefetch_k and overlap_pv cannot be combined")
    t, hq, d = q.shape
    dv = v.shape[-1]
    hkv = k.shape[-2]
    if t == 0 or hq == 0:  # nothing to compute (and no TMA descriptor of an empty array): no launch
        return empty_outputs(q, dv, q.dtype, return_lse)
    options = dataclasses.replace(options, l2_section_kib=resolve_l2_section_kib(options, hq, hkv))
    # The rows past cu_q[-1] (padding) are one more request with no keys: the kernel
    # writes them as 0 / -inf, so every output row is written once, by the kernel.
    cu_q, kv_start, kv_len, page_table = plan.with_padding_request(cu_q, kv_start, kv_len, page_table, t)
    bs = cu_q.shape[0] - 1
    # Request b has ceil((n_b + dq_b) / 128) <= (n_b + 7 + 127) / 128 tiles (dq_b < 8).
    num_tiles = -(-(t + (TILE_Q + 6) * bs) // TILE_Q)
    # FP8 KV computes in f16: e4m3 -> f16 is exact; a bf16 q -> f16 keeps 10 mantissa bits.
    kv_fp8 = jnp.dtype(k.dtype).itemsize == 1
    bk, stages = _choose_blocks(d, dv, kv_fp8, options.block_kv)
    cdtype = jnp.dtype(jnp.float16) if kv_fp8 else q.dtype
    cfg = PrefillConfig(
        head_dim=d,
        head_dim_v=dv,
        num_q_heads=hq,
        num_kv_heads=hkv,
        block_kv=bk,
        num_stages=stages,
        is_causal=is_causal,
        window_left=window_left,
        logit_cap=float(logit_cap),
        has_sinks=sinks is not None,
        page_size=page_size,
        num_pages=k.shape[0] if page_size else 0,
        max_pages=page_table.shape[1],
        interpret=interpret,
        clean_edges=clean_edges,
        options=options,
        kv_fp8=kv_fp8,
        num_tiles=num_tiles,
    )
    persistent = options.persistent
    if persistent is None:  # a CTA count asks for the persistent launch
        persistent = bool(options.ctas) or persistent_by_default(d, dv, kv_fp8)
    if persistent:
        if cfg.out_in_ring:
            raise ValueError(
                f"PrefillOptions(persistent=True): head dims {d}/{dv} stage the output in the K/V ring, "
                "which the next tile's blocks would overwrite; it needs head_dim == head_dim_v"
            )
        cfg = dataclasses.replace(cfg, ctas=options.ctas or _num_sms())
    scale = (1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale) * k_scale
    # Only causal and windowed calls have keys inside a request that some rows do not
    # see (the kernel's edge_steps reads v_bad for those alone): no pass over V otherwise.
    needs_check = clean_edges and (is_causal or window_left >= 0)
    v_bad = (
        plan.v_may_be_nonfinite(v, cu_q, kv_start, kv_len, page_table, page_size, window_left, t) if needs_check else 0
    )
    scales = jnp.concatenate(
        [
            jnp.reshape(scale, (1,)).astype(jnp.float32),
            jnp.zeros((hq,), jnp.float32) if sinks is None else sinks,
            jnp.reshape(v_bad, (1,)).astype(jnp.float32),
        ]
    ).astype(jnp.float32)
    tile_req, tile_loc, work = plan.tile_plan(
        cu_q, kv_len, num_tiles, is_causal=is_causal, window_left=window_left, with_work=True
    )
    if options.l2_section_kib:
        tile_req, tile_loc, item = plan.section_items(
            tile_req,
            tile_loc,
            kv_len,
            num_q_heads=hq,
            group=hq // hkv,
            key_bytes=(d + dv) * jnp.dtype(k.dtype).itemsize,
            budget=options.l2_section_kib << 10,
            ctas=cfg.launch_ctas if cfg.ctas and options.fold_sections else 0,
            work=work,
        )
    else:
        item = jnp.zeros((1,), jnp.int32)
    # The tiled TMA view of a ragged array needs a multiple of 8 rows; under the
    # interpreter no box may read out of bounds either (the GPU zero-fills those rows).
    qp, kp, vp = q.astype(cdtype), k, v
    if interpret or t % 8:
        qp = plan.pad_rows(qp, TILE_Q if interpret else -t % 8)
    if not page_size and (interpret or k.shape[0] % 8 or not k.shape[0]):
        extra = bk if interpret else -k.shape[0] % 8 or 8
        kp, vp = plan.pad_rows(k, extra), plan.pad_rows(v, extra)
    arrays = (
        tile_req,
        tile_loc,
        item,
        cu_q,
        kv_start,
        kv_len,
        page_table.astype(jnp.int32),
        scales,
        qp,
        kp,
        vp,
    )
    o, lse, o_side, lse_side = run(cfg, cdtype, arrays)
    o, lse = plan.merge_sides(o, lse, o_side, lse_side, cu_q)
    if o.shape[0] != t:
        o, lse = o[:t], lse[:t]
    if v_scale is not None:
        o = (o.astype(jnp.float32) * v_scale).astype(q.dtype)
    elif o.dtype != q.dtype:
        o = o.astype(q.dtype)
    return (o, lse) if return_lse else o


def _clean_edges(clean_edges, is_causal: bool, window_left: int) -> bool:
    """The edge cleaning where a key inside the request can be masked for some rows
    (causal, sliding window); without either, zeroing the V rows outside the request
    is exact and cheaper. An explicit True/False wins."""
    if clean_edges is not None:
        return bool(clean_edges)
    return bool(is_causal or window_left >= 0)


def _v_scale_arg(v_scale):
    """None for a Python 1.0 (the output then needs no multiply), else the scale."""
    if isinstance(v_scale, (int, float)) and float(v_scale) == 1.0:
        return None
    return v_scale


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
    clean_edges=None,
    options: PrefillOptions | None = None,
):
    """Ragged attention without a cache (Mosaic GPU, Hopper).

    Args:
      q: ``[num_tokens, Hq, D]`` bf16/f16, ragged by ``cu_seqlens_q``.
      k, v: ``[num_kv_tokens, Hkv, D]`` / ``[.., Dv]``, same dtype, ragged by
        ``cu_seqlens_kv`` (default ``cu_seqlens_q``).
      is_causal, window_left, logit_cap, sinks (f32 ``[Hq]``), softmax_scale,
        k_scale, v_scale, return_lse: as in ``jattn.ops.mha_prefill``.
      max_seqlen_q, max_seqlen_kv: accepted for the op's signature; the kernel
        reads the lengths from the offsets.
      clean_edges: make masked keys contribute nothing whatever their V holds (edge
        blocks flag and clean non-finite V, see the module docstring); False only
        zeroes V rows outside the request. None: on where it is needed (causal or
        windowed calls).
      options: :class:`PrefillOptions` (scheduling; None: the defaults).

    Returns ``out [num_tokens, Hq, Dv]`` (rows past ``cu_seqlens_q[-1]`` are 0), and
    with ``return_lse`` the natural-log LSE f32 ``[num_tokens, Hq]``.
    """
    if cu_seqlens_kv is None:
        cu_seqlens_kv = cu_seqlens_q
    cu_kv = jnp.asarray(cu_seqlens_kv, jnp.int32)
    softmax_scale, k_scale = fold_softmax_scale(softmax_scale, k_scale)
    return _attention(
        q,
        k,
        v,
        jnp.asarray(cu_seqlens_q, jnp.int32),
        cu_kv[:-1],
        cu_kv[1:] - cu_kv[:-1],
        jnp.zeros((1, 1), jnp.int32),
        None if sinks is None else jnp.asarray(sinks, jnp.float32),
        k_scale,
        _v_scale_arg(v_scale),
        page_size=0,
        is_causal=is_causal,
        window_left=int(window_left),
        logit_cap=float(logit_cap),
        softmax_scale=softmax_scale,
        return_lse=return_lse,
        interpret=_interpreting(),
        clean_edges=_clean_edges(clean_edges, is_causal, int(window_left)),
        options=options or PrefillOptions(),
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
    clean_edges=None,
    options: PrefillOptions | None = None,
):
    """Ragged queries over a paged cache that already holds their K/V (Mosaic GPU).

    Args:
      q: ``[num_tokens, Hq, D]`` ragged by ``cu_seqlens_q``: the last ``n_b`` tokens
        of request ``b``'s ``cache_seqlens[b]``.
      k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` (same dtype as q).
      page_table: i32 ``[bs, max_pages]``; cache_seqlens: i32 ``[bs]`` (prefix + new).
      Other arguments as in :func:`mha_prefill`.
    """
    softmax_scale, k_scale = fold_softmax_scale(softmax_scale, k_scale)
    page_table, lens = plan.no_pages_no_keys(jnp.asarray(page_table, jnp.int32), jnp.asarray(cache_seqlens, jnp.int32))
    return _attention(
        q,
        k_cache,
        v_cache,
        jnp.asarray(cu_seqlens_q, jnp.int32),
        jnp.zeros_like(lens),
        lens,
        page_table,
        None if sinks is None else jnp.asarray(sinks, jnp.float32),
        k_scale,
        _v_scale_arg(v_scale),
        page_size=int(k_cache.shape[1]),
        is_causal=is_causal,
        window_left=int(window_left),
        logit_cap=float(logit_cap),
        softmax_scale=softmax_scale,
        return_lse=return_lse,
        interpret=_interpreting(),
        clean_edges=_clean_edges(clean_edges, is_causal, int(window_left)),
        options=options or PrefillOptions(),
    )
