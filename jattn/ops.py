"""Public attention ops with backend dispatch.

Every op takes ``backend=None`` (auto) or a name from
:data:`BACKENDS`. Auto tries the kernels :data:`AUTO_ORDER` lists for the op on this device
(Hopper: ``mosaic``, then ``triton``; other GPUs from Ampere on: ``triton``), then ``xla``
(the plain-JAX reference, which serves every call), skipping a kernel that cannot serve the
call or that was measured slower than ``xla`` for its shapes; the state merge and the KV
writes have no entry and run on ``xla`` under auto. A named backend that cannot serve
the call raises ``NotImplementedError`` naming what is missing; it never falls back
silently. (A call with nothing to compute, no rows, heads, pages or tokens to write, gives
its empty or all-zero result, or the caches as they are, whatever the backend: the kernels
have no empty launch.)
What each op computes (masks, window, cap, sinks, FP8, LSE) is in docs/SEMANTICS.md.

Shapes and dtypes are checked at trace time with errors that name the argument.
Values (page ids, lengths, ``cu_seqlens``) are checked where they are concrete: an eager
call checks them; under ``jax.jit`` they are traced and pass unchecked, and the host-side
planners, which see numpy arrays, are what check a jitted step's values. Empty calls (no
requests, ``max_seqlen_q=0``, no query rows) return outputs of the usual shapes and
dtypes on every backend.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp

from jattn import reference
from jattn.checks import BACKENDS as BACKENDS  # re-exported: the public backend names
from jattn.checks import KV_DTYPES as _KV_DTYPES
from jattn.checks import Q_DTYPES as _Q_DTYPES
from jattn.checks import (
    _check_array,
    _check_backend,
    _check_bool,
    _check_causal,
    _check_cu_seqlens,
    _check_dtype,
    _check_float,
    _check_int,
    _check_kv_caches,
    _check_lengths,
    _check_max_seqlen,
    _check_ndim,
    _check_options,
    _check_paged,
    _check_prefill,
    _check_scale,
    _check_scales,
    _is_int,
    _window_within,
)
from jattn.dispatch import AUTO_ORDER as AUTO_ORDER  # re-exported, as the names below
from jattn.dispatch import KERNELS as KERNELS
from jattn.dispatch import OPS as OPS
from jattn.dispatch import _kernel_module, _merge_impl, _pick
from jattn.dispatch import device_kind as device_kind
from jattn.dispatch import op_backend as op_backend

# ----------------------------------------------------------------------------- ops


def mha_decode_with_kvcache(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    *,
    max_seqlen_q: int = 1,
    is_causal: bool = True,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse: bool = False,
    backend: str | None = None,
    batch_invariant: bool = False,
):
    """Paged decode attention (``max_seqlen_q`` tokens per request: spec verify, draft blocks).

    Args:
      q: [bs * max_seqlen_q, num_q_heads, head_dim] bf16/fp16/f32, request-major
        (request ``b``'s tokens are rows ``b * max_seqlen_q ...``, oldest first).
      k_cache: [num_pages, page_size, num_kv_heads, head_dim] bf16/fp16/f32/fp8 e4m3.
      v_cache: [num_pages, page_size, num_kv_heads, head_dim_v], k_cache's dtype.
      page_table: i32[bs, max_pages]; token ``t`` of request ``b`` is in page
        ``page_table[b, t // page_size]``; entries past a request's last page are never read.
      cache_seqlens: i32[bs], KV length ``L`` per request including the new tokens
        (already written to the cache); 0 for an empty or padded row (output 0).
      max_seqlen_q: query tokens per request (static, >= 0; 0 gives an empty output).
      is_causal: query ``i`` sees keys ``j <= L - max_seqlen_q + i``; else all ``L``.
      window_left: sliding window (``-1`` off): also ``j >= L - max_seqlen_q + i - window_left``.
      logit_cap: ``c * tanh(x / c)`` on the scaled scores; 0 disables.
      sinks: [num_q_heads] per-head sink logits (any float dtype, read as f32; denominator
        only, not scaled), or None.
      softmax_scale: python float or f32 scalar; defaults to ``1/sqrt(head_dim)``.
      k_scale, v_scale: FP8 dequantisation scales (python float or f32 scalar), applied
        whatever the cache dtype: pass 1.0 for bf16/fp16/f32 caches.
      return_lse: also return the natural-log LSE f32[bs * max_seqlen_q, num_q_heads]
        (``-inf`` for rows that see no key; the sink is not included).
      backend: None (auto), "mosaic", "triton" or "xla".
      batch_invariant: a request's output bits do not depend on the batch (its size, the
        bucket, the other requests) for a given page-table width: the split-KV kernels
        take their split count from the width alone (one split per
        ``pallas_kernels.combine.INVARIANT_SPLIT_TOKENS`` tokens) instead of from the batch; XLA's
        decode runs each request by the same program. Costs speed where the batch-sized
        choice would differ (docs/PERF.md).

    Returns:
      out [bs * max_seqlen_q, num_q_heads, head_dim_v] in q's dtype, or ``(out, lse)``.

    Example:
      >>> import jax.numpy as jnp
      >>> q = jnp.ones((2, 4, 8)); kc = jnp.ones((3, 16, 2, 8)); pt = jnp.array([[1], [2]], jnp.int32)
      >>> mha_decode_with_kvcache(q, kc, kc, pt, jnp.array([5, 0], jnp.int32)).shape
      (2, 4, 8)
    """
    _decode_checks(
        q, k_cache, v_cache, page_table, cache_seqlens, max_seqlen_q, window_left, logit_cap, sinks, is_causal,
        softmax_scale, k_scale, v_scale,
    )  # fmt: skip
    _check_bool(return_lse, "return_lse")
    _check_bool(batch_invariant, "batch_invariant")
    kw = dict(
        max_seqlen_q=max_seqlen_q,
        is_causal=is_causal,
        window_left=_window_within(window_left, page_table.shape[1] * k_cache.shape[1]),
        logit_cap=logit_cap,
        sinks=sinks,
        softmax_scale=softmax_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=return_lse,
    )
    if 0 in (q.shape[0], q.shape[1], page_table.shape[1]):
        # Nothing to compute (no rows, no heads or no pages): empty or all-zero rows on
        # every backend; the kernels have no empty launch.
        _check_backend(backend)
        return reference.mha_decode(q, k_cache, v_cache, page_table, cache_seqlens, **kw)
    impl = _pick(
        "mha_decode",
        backend,
        KERNELS["mosaic"]["mha_decode"],
        lambda mod, *a, **k: (
            mod.unsupported_reason(*a, batch_invariant=batch_invariant, **k)
            or (mod.auto_skip_reason(*a, **k) if backend is None else None)
        ),
        q,
        k_cache,
        v_cache,
        **kw,
    )
    impl = impl or reference.mha_decode
    if batch_invariant:
        kw.update(_invariant_splits(impl, q, k_cache, page_table, max_seqlen_q))
    return impl(q, k_cache, v_cache, page_table, cache_seqlens, **kw)


def _decode_checks(
    q, k_cache, v_cache, page_table, cache_seqlens, max_seqlen_q, window_left, logit_cap, sinks, is_causal,
    softmax_scale, k_scale, v_scale,
) -> None:  # fmt: skip
    _check_paged(q, k_cache, v_cache, page_table, cache_seqlens)
    bs = page_table.shape[0]
    _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    if q.shape[0] != bs * max_seqlen_q:
        raise ValueError(f"q has {q.shape[0]} rows; it must be batch ({bs}) * max_seqlen_q ({max_seqlen_q})")
    _check_options(window_left, logit_cap, sinks, q.shape[1], is_causal)
    _check_scales(softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale)


def _extend_checks(
    q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, window_left, logit_cap, sinks,
    is_causal, softmax_scale, k_scale, v_scale,
) -> None:  # fmt: skip
    _check_paged(q, k_cache, v_cache, page_table, cache_seqlens)
    _check_ndim(cu_seqlens_q, "cu_seqlens_q", 1, "[batch + 1]")
    _check_int(cu_seqlens_q, "cu_seqlens_q")
    if cu_seqlens_q.shape[0] != page_table.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries; it must be batch + 1 = {page_table.shape[0] + 1}"
        )
    _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    # causal: the new tokens are the last of the cached length (non-causal calls, such as a
    # cascade's pass over a shared prefix, may attend to keys that do not include them)
    lens = cache_seqlens if is_causal else None
    _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "q", max_seqlen_q, "max_seqlen_q", lens)
    _check_options(window_left, logit_cap, sinks, q.shape[1], is_causal)
    _check_scales(softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale)


def _prefill_checks(
    q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, window_left, logit_cap, sinks, is_causal,
    softmax_scale, k_scale, v_scale,
) -> None:  # fmt: skip
    _check_prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, window_left, logit_cap, sinks, is_causal
    )
    _check_scales(softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale)


def check_arguments(op, *args, **kwargs) -> None:
    """Runs the argument checks of ``op`` (:func:`mha_decode_with_kvcache`,
    :func:`mha_extend_with_kvcache` or :func:`mha_prefill`) on ``op``'s arguments without
    computing anything: shapes and dtypes, and page ids, lengths, offsets, sinks and scales
    where they are concrete. For wrappers that call ``op`` on slices of its arguments inside
    a trace (``jattn.sharding``), where the slices' values are not concrete."""
    checks = {
        mha_decode_with_kvcache: _decode_checks,
        mha_extend_with_kvcache: _extend_checks,
        mha_prefill: _prefill_checks,
    }[op]
    bound = inspect.signature(op).bind(*args, **kwargs)
    bound.apply_defaults()
    names = inspect.signature(checks).parameters
    checks(**{name: bound.arguments[name] for name in names})


def _invariant_splits(impl, q, k_cache, page_table, max_seqlen_q) -> dict:
    """The split-count keyword of kernel ``impl`` for batch-invariant decode: the same for
    every batch of this page-table width (for XLA's decode, which has no splits, a fixed
    key chunk: its default chunk shrinks as the batch grows)."""
    from jattn.pallas_kernels.combine import invariant_num_splits

    module = getattr(impl, "__module__", "").rsplit(".", 1)[-1]
    width = page_table.shape[1] * k_cache.shape[1]
    splits = invariant_num_splits(width)
    if module == "triton_decode":
        return {"num_splits": splits}
    if module == "mosaic_decode":
        mod = _kernel_module("mosaic_decode")
        bsz = mod.choose_block_sizes(
            batch=1,  # only the split count depends on the batch; it is replaced here
            num_kv_heads=k_cache.shape[2],
            head_dim=k_cache.shape[3],
            page_size=k_cache.shape[1],
            max_pages=page_table.shape[1],
            m_rows=max_seqlen_q * q.shape[1],
            kv_itemsize=jnp.dtype(k_cache.dtype).itemsize,
            q_itemsize=jnp.dtype(q.dtype).itemsize,
        )
        blocks = -(-width // (bsz.block_tokens * bsz.pages_per_block))
        # balanced splits size a request's splits by the other requests' lengths: off here
        options = dataclasses.replace(mod.KernelOptions(), balanced_splits=False)
        return {"block_sizes": dataclasses.replace(bsz, num_splits=min(splits, blocks)), "options": options}
    if impl is reference.mha_decode:
        return {"key_chunk": reference.INVARIANT_KEY_CHUNK}
    return {}


def mha_extend_with_kvcache(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    cu_seqlens_q,
    *,
    max_seqlen_q: int,
    is_causal: bool = True,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Extend: ragged new tokens attend to their paged prefix and, causally, to themselves.

    Args:
      q: [num_tokens, num_q_heads, head_dim], token-major; rows past
        ``cu_seqlens_q[-1]`` are padding and come out as 0 (LSE ``-inf``).
      cu_seqlens_q: i32[bs + 1] query offsets; request ``b`` has
        ``n_b = cu[b+1] - cu[b] <= max_seqlen_q`` new tokens, already in the cache.
      cache_seqlens: i32[bs], prefix + new tokens.
      max_seqlen_q: static bound on any request's new tokens.
      Other arguments as in :func:`mha_decode_with_kvcache`; query ``i`` of request ``b``
      sits at position ``cache_seqlens[b] - n_b + i``.

    Returns:
      out [num_tokens, num_q_heads, head_dim_v] in q's dtype, or ``(out, lse)`` with the
      natural-log lse f32[num_tokens, num_q_heads].
    """
    _extend_checks(
        q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, window_left, logit_cap, sinks,
        is_causal, softmax_scale, k_scale, v_scale,
    )  # fmt: skip
    _check_bool(return_lse, "return_lse")
    kw = dict(
        max_seqlen_q=max_seqlen_q,
        is_causal=is_causal,
        window_left=_window_within(window_left, page_table.shape[1] * k_cache.shape[1]),
        logit_cap=logit_cap,
        sinks=sinks,
        softmax_scale=softmax_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=return_lse,
    )
    impl = None
    if 0 not in (q.shape[0], q.shape[1], *page_table.shape):
        # No rows, heads, requests or pages: empty or all-zero rows on xla (no empty launch).
        impl = _pick(
            "mha_extend",
            backend,
            KERNELS["mosaic"]["mha_extend"],
            lambda mod, *a, **k: mod.extend_unsupported_reason(*a, **k),
            q,
            k_cache,
            v_cache,
            **kw,
        )
    else:
        _check_backend(backend)
    impl = impl or reference.mha_extend
    return impl(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, **kw)


def mha_prefill(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_kv=None,
    *,
    max_seqlen_q: int,
    max_seqlen_kv: int | None = None,
    is_causal: bool = True,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Ragged attention without a cache (prefill; MLA prefill with 192/128 head dims).

    Args:
      q: [num_tokens, num_q_heads, head_dim_qk] bf16/fp16/f32;
        k: [num_kv_tokens, num_kv_heads, head_dim_qk] bf16/fp16/f32/fp8 e4m3;
        v: [num_kv_tokens, num_kv_heads, head_dim_v].
      cu_seqlens_q, cu_seqlens_kv: i32[bs + 1] (kv defaults to q's). Causal masks
        are bottom-right aligned: query ``i`` of ``n`` sees keys ``j <= L - n + i``.
        Query rows past ``cu_seqlens_q[-1]`` come out as 0 (LSE ``-inf``).
      max_seqlen_q, max_seqlen_kv: static bounds on the per-request lengths;
        ``max_seqlen_kv`` is required with ``cu_seqlens_kv`` (default: ``max_seqlen_q``).
      Other arguments as in :func:`mha_decode_with_kvcache`.

    Returns:
      out [num_tokens, num_q_heads, head_dim_v] in q's dtype, or ``(out, lse)`` with the
      natural-log lse f32[num_tokens, num_q_heads].
    """
    _prefill_checks(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, window_left, logit_cap, sinks, is_causal,
        softmax_scale, k_scale, v_scale,
    )  # fmt: skip
    _check_bool(return_lse, "return_lse")
    kw = dict(
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        is_causal=is_causal,
        window_left=_window_within(window_left, k.shape[0]),  # no request has more keys than k's rows
        logit_cap=logit_cap,
        sinks=sinks,
        softmax_scale=softmax_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=return_lse,
    )
    impl = None
    if q.shape[0] and q.shape[1] and k.shape[0] and cu_seqlens_q.shape[0] > 1:
        # (no rows, heads, keys or requests: xla gives the empty or all-zero rows; no empty launch)
        impl = _pick(
            "mha_prefill",
            backend,
            KERNELS["mosaic"]["mha_prefill"],
            lambda mod, *a, **k: mod.unsupported_reason(*a, **k),
            q,
            k,
            v,
            **kw,
        )
    else:
        _check_backend(backend)
    impl = impl or reference.mha_prefill
    return impl(q, k, v, cu_seqlens_q, cu_seqlens_kv, **kw)


def mla_decode_with_kvcache(
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
    backend: str | None = None,
):
    """DeepSeek MLA absorbed decode over the latent paged cache.

    Args:
      q: [bs * max_seqlen_q, H, R + r] bf16/fp16/f32, request-major:
        ``W_UK^T q_nope`` (R) then rope(q_pe) (r). With an e4m3 ``kv_cache`` also
        float8_e4m3fn: a query already quantised (as the MLA backend's FP8 path makes
        it), which the Mosaic kernel reads as it is, with no quantisation of its own;
        the output is then bf16.
      kv_cache: [num_pages, page_size, R + r] bf16/fp16/f32/fp8 e4m3, latent rows ``[c_kv, k_pe]``.
      page_table: i32[bs, max_pages]; cache_seqlens: i32[bs], new tokens included.
      kv_lora_rank: R (512 for DeepSeek-V2/V3); the value is the first R columns.
      softmax_scale: ``1/sqrt(qk_nope + qk_rope)`` (times YaRN mscale^2) - never 1/sqrt(576).
      max_seqlen_q, is_causal: as in :func:`mha_decode_with_kvcache`.
      kv_scale: FP8 dequantisation scale of the cache (1.0 for other dtypes).
      return_lse, backend: as in :func:`mha_decode_with_kvcache`.

    Returns:
      latent out [bs * max_seqlen_q, H, R] in q's dtype, bf16 for an e4m3 q (and
      natural-log lse f32[.., H]).
    """
    if softmax_scale is None:
        raise ValueError(
            "softmax_scale is required for MLA decode: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) "
            "(times the YaRN mscale^2), which the op cannot infer from the 576-wide rows"
        )
    _check_ndim(q, "q", 3, "[tokens, num_heads, kv_lora_rank + rope_dim]")
    _check_ndim(kv_cache, "kv_cache", 3, "[num_pages, page_size, kv_lora_rank + rope_dim]")
    _check_ndim(page_table, "page_table", 2, "[batch, max_pages]")
    _check_ndim(cache_seqlens, "cache_seqlens", 1, "[batch]")
    if page_table.shape[0] != cache_seqlens.shape[0]:
        raise ValueError(f"page_table has {page_table.shape[0]} rows but cache_seqlens has {cache_seqlens.shape[0]}")
    _check_dtype(q, "q", (*_Q_DTYPES, jnp.float8_e4m3fn))
    _check_dtype(kv_cache, "kv_cache", _KV_DTYPES)
    _check_int(page_table, "page_table")
    _check_int(cache_seqlens, "cache_seqlens")
    q_e4m3 = jnp.dtype(q.dtype) == jnp.dtype(jnp.float8_e4m3fn)
    if q_e4m3 and jnp.dtype(kv_cache.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise TypeError(f"q.dtype=float8_e4m3fn needs a float8_e4m3fn kv_cache, got kv_cache.dtype={kv_cache.dtype}")
    q_wide = q.astype(jnp.bfloat16) if q_e4m3 else q  # exact: e4m3 values are bf16 values
    if q.shape[2] != kv_cache.shape[2]:
        raise ValueError(f"q width={q.shape[2]} must equal kv_cache width={kv_cache.shape[2]}")
    if not _is_int(kv_lora_rank) or not 0 < kv_lora_rank < kv_cache.shape[2]:
        raise ValueError(f"kv_lora_rank={kv_lora_rank!r} must be an int in (0, {kv_cache.shape[2]})")
    _check_scales(softmax_scale=softmax_scale, kv_scale=kv_scale)
    _check_causal(is_causal)
    _check_bool(return_lse, "return_lse")
    _check_lengths(page_table, cache_seqlens, kv_cache.shape[1], kv_cache.shape[0])
    bs = page_table.shape[0]
    _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    if q.shape[0] != bs * max_seqlen_q:
        raise ValueError(f"q has {q.shape[0]} rows; it must be batch ({bs}) * max_seqlen_q ({max_seqlen_q})")
    kw = dict(
        kv_lora_rank=kv_lora_rank,
        softmax_scale=softmax_scale,
        max_seqlen_q=max_seqlen_q,
        is_causal=is_causal,
        kv_scale=kv_scale,
        return_lse=return_lse,
    )
    if 0 in (q.shape[0], q.shape[1], page_table.shape[1]):
        _check_backend(backend)  # nothing to compute: the kernel has no empty launch
        return reference.mla_decode(q_wide, kv_cache, page_table, cache_seqlens, **kw)
    impl = _pick(
        "mla_decode",
        backend,
        KERNELS["mosaic"]["mla_decode"],
        lambda mod, *a, **k: mod.unsupported_reason(*a, **k),
        q_wide,
        kv_cache,
        **kw,
    )
    impl = impl or reference.mla_decode
    # the Mosaic kernel reads an e4m3 query as it is; the others get it in bf16
    takes_e4m3 = getattr(impl, "__module__", "").endswith(".mosaic_mla")
    return impl(q if takes_e4m3 else q_wide, kv_cache, page_table, cache_seqlens, **kw)


def attn_merge_state(o_a, lse_a, o_b, lse_b, *, backend: str | None = None):
    """Merges partial attentions over disjoint keys: ``(o, lse)`` (natural-log LSE).

    o_*: [tokens, heads, head_dim] (result in o_a's dtype); lse_*: f32[tokens, heads].
    Both ``-inf`` gives ``o = 0, lse = -inf``; the formula is in docs/SEMANTICS.md.
    backend: None or ``"xla"`` (XLA's fusion; its speed is in docs/PERF.md), or
    ``"triton"`` (one fused Triton kernel through jax-triton, the same source the torch
    bridge can launch; raises where it cannot run).
    """
    for x, name, layout in ((o_a, "o_a", "[T, H, D]"), (o_b, "o_b", "[T, H, D]")):
        _check_ndim(x, name, 3, layout)
        _check_dtype(x, name, _Q_DTYPES)
    for x, name in ((lse_a, "lse_a"), (lse_b, "lse_b")):
        _check_ndim(x, name, 2, "[T, H]")
        _check_dtype(x, name, (jnp.float32,))
    for x, name, want in ((o_b, "o_b", o_a.shape), (lse_a, "lse_a", o_a.shape[:2]), (lse_b, "lse_b", o_a.shape[:2])):
        if x.shape != want:
            raise ValueError(
                f"{name} must have shape {want} (o [T, H, D] and lse [T, H], equal for both states, "
                f"from o_a {o_a.shape}): got {x.shape}"
            )
    impl = _merge_impl(backend)
    if impl is not None:
        return impl(o_a, lse_a, o_b, lse_b)
    return reference.attn_merge_state(o_a, lse_a, o_b, lse_b)


def set_kv_buffer(k_cache, v_cache, out_cache_loc, k, v, *, k_scale=None, v_scale=None, backend=None):
    """Writes new tokens' K/V into the paged caches; returns ``(k_cache, v_cache)``.

    k: [T, num_kv_heads, head_dim], v: [T, num_kv_heads, head_dim_v] (any float dtype);
    out_cache_loc: i32[T] slots (``page * page_size + offset``), no two real tokens on one
    slot. FP8 caches store ``clamp(x / scale, -448, 448)`` (scale None = 1.0); other caches
    store ``x`` cast to their dtype and ignore the scales. Slots outside
    ``[0, num_pages * page_size)`` are dropped. Under ``jit`` with the caches donated the
    update is in place. backend: None or ``"xla"`` (one XLA scatter), or ``"triton"`` (the
    Triton write through jax-triton, the source the torch bridge launches natively).
    """
    _check_kv_caches(k_cache, v_cache)
    for x, name in ((k, "k"), (v, "v")):
        _check_ndim(x, name, 3, "[tokens, num_kv_heads, head_dim]")
        _check_float(x, name)
    _check_int(out_cache_loc, "out_cache_loc")
    _check_ndim(out_cache_loc, "out_cache_loc", 1, "[tokens]")
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check_scale(value, name, optional=True)
    if k.shape[0] != out_cache_loc.shape[0] or v.shape[0] != out_cache_loc.shape[0]:
        raise ValueError(f"k {k.shape}, v {v.shape} and out_cache_loc {out_cache_loc.shape} disagree on tokens")
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k rows {k.shape[1:]} must match k_cache's [num_kv_heads, head_dim] {k_cache.shape[2:]}")
    if v.shape[1:] != v_cache.shape[2:]:
        raise ValueError(f"v rows {v.shape[1:]} must match v_cache's {v_cache.shape[2:]}")
    if 0 in (out_cache_loc.shape[0], *k_cache.shape[:3]):  # no tokens, slots or heads: the caches as they are
        # on every backend (no empty launch)
        _check_backend(backend)
        return k_cache, v_cache
    kw = dict(k_scale=k_scale, v_scale=v_scale)
    impl = _pick("set_kv_buffer", backend, None, None, k_cache, v_cache, out_cache_loc, k, v, **kw)
    if impl is not None:
        return impl(k_cache, v_cache, out_cache_loc, k, v, **kw)
    return reference.set_kv_buffer(k_cache, v_cache, out_cache_loc, k, v, k_scale, v_scale)


def set_mla_kv_buffer(kv_cache, out_cache_loc, c_kv, k_pe, *, kv_scale=None, backend=None):
    """Writes latent rows ``[c_kv, k_pe]`` at ``out_cache_loc``; returns the cache.

    kv_cache: [num_pages, page_size, R + r]; out_cache_loc: i32[T]; c_kv: [T, R] or
    [T, 1, R]; k_pe: [T, r] or [T, 1, r] (any float dtype). FP8 caches store
    ``clamp(row / kv_scale, -448, 448)``; other caches store the row cast to their dtype.
    Slots outside ``[0, num_pages * page_size)`` are dropped. Under ``jit`` with the cache
    donated the update is in place. backend: None or ``"xla"`` (one XLA scatter), or
    ``"triton"`` (the Triton write through jax-triton, the source the torch bridge
    launches natively).
    """
    _check_ndim(kv_cache, "kv_cache", 3, "[num_pages, page_size, R + r]")
    _check_dtype(kv_cache, "kv_cache", _KV_DTYPES)
    _check_int(out_cache_loc, "out_cache_loc")
    _check_ndim(out_cache_loc, "out_cache_loc", 1, "[tokens]")
    _check_scale(kv_scale, "kv_scale", optional=True)
    for x, name in ((c_kv, "c_kv"), (k_pe, "k_pe")):
        _check_array(x, name, "[tokens, width] or [tokens, 1, width]")
        _check_float(x, name)
    t = out_cache_loc.shape[0]
    rows_ok = all(x.ndim in (2, 3) and x.shape[0] == t and (x.ndim == 2 or x.shape[1] == 1) for x in (c_kv, k_pe))
    if not rows_ok or c_kv.shape[-1] + k_pe.shape[-1] != kv_cache.shape[-1]:
        raise ValueError(f"c_kv {c_kv.shape} + k_pe {k_pe.shape} must give {t} rows of width {kv_cache.shape[-1]}")
    if 0 in (t, *kv_cache.shape[:2]):  # no tokens or slots: the cache as it is on every backend (no empty launch)
        _check_backend(backend)
        return kv_cache
    impl = _pick("set_mla_kv_buffer", backend, None, None, kv_cache, out_cache_loc, c_kv, k_pe, kv_scale=kv_scale)
    if impl is not None:
        return impl(kv_cache, out_cache_loc, c_kv, k_pe, kv_scale=kv_scale)
    return reference.set_mla_kv_buffer(kv_cache, out_cache_loc, c_kv, k_pe, kv_scale)
