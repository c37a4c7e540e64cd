"""Public attention ops with backend dispatch.

Every op but ``set_mla_kv_buffer`` takes ``backend=None`` (auto) or a name from
:data:`BACKENDS`. Auto tries ``mosaic`` (Hopper GPUs), then ``triton``, then ``xla`` (the
plain-JAX reference, which serves every call), skipping a kernel that cannot serve the call
or that was measured slower than ``xla`` for its shapes. A named backend that cannot serve
the call raises ``NotImplementedError`` naming what is missing; it never falls back
silently. (A call with nothing to compute, no rows, heads or pages, gives its empty or
all-zero result from the reference whatever the backend: the kernels have no empty launch.)
What each op computes (masks, window, cap, sinks, FP8, LSE) is in docs/SEMANTICS.md.

Shapes and dtypes are checked at trace time with errors that name the argument;
values (page ids, lengths) are checked by the host-side planners. Empty calls (no
requests, ``max_seqlen_q=0``, no query rows) return outputs of the usual shapes and
dtypes on every backend.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp

from jattn import reference
from jattn.checks import BACKENDS as BACKENDS  # re-exported: the public backend names
from jattn.checks import KV_DTYPES as _KV_DTYPES
from jattn.checks import Q_DTYPES as _Q_DTYPES
from jattn.checks import (
    _check_backend,
    _check_causal,
    _check_cu_seqlens,
    _check_dtype,
    _check_int,
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

# ----------------------------------------------------------------------------- devices


@functools.lru_cache(maxsize=None)
def device_kind() -> str:
    """'hopper' (sm90+), 'ampere' (sm80+), 'gpu' (older), or 'cpu'."""
    if jax.default_backend() != "gpu":
        return "cpu"
    cc = getattr(jax.devices()[0], "compute_capability", "0.0")
    major = int(str(cc).split(".")[0])
    return "hopper" if major >= 9 else "ampere" if major >= 8 else "gpu"


def _kernel_module(name: str):
    try:
        return importlib.import_module(f"jattn.pallas_kernels.{name}")
    except ImportError:
        return None


# Auto's kernel order per device kind and op: the first that runs here and serves the
# call wins, else XLA. Hopper's order is measured (``python -m jattn bench decode /
# prefill / mla`` on the H200, docs/PERF.md): the Mosaic kernels lead the Triton ones
# for MHA decode (by 0-40%, except within 6% at 64 x 4096), prefill/extend (2x) and MLA
# decode (1.1-2.2x; with an FP8 latent cache 1.1-4.6x). Other
# GPUs from Ampere on have the Triton kernels only. Ops missing here (the KV write, the
# state merge) stay on XLA under auto, which measured as fast or faster.
AUTO_ORDER = {
    "hopper": {
        "mha_decode": ("mosaic", "triton"),
        "mha_extend": ("mosaic", "triton"),
        "mha_prefill": ("mosaic", "triton"),
        "mla_decode": ("mosaic", "triton"),
    },
    "ampere": {op: ("triton",) for op in ("mha_decode", "mha_extend", "mha_prefill", "mla_decode")},
}


def _pick(op: str, backend, kernel_module: str | None, reason_fn, *args, **kwargs):
    """Returns the implementation of ``op`` for ``backend`` (None = auto, in the order of
    :data:`AUTO_ORDER`), or None for XLA's."""
    _check_backend(backend)
    if backend == "xla":
        return None
    order = (backend,) if backend is not None else AUTO_ORDER.get(device_kind(), {}).get(op, ())
    for name in order:
        if name == "mosaic":
            impl = _pick_mosaic(op, backend, kernel_module, reason_fn, *args, **kwargs)
        else:
            module = KERNELS["triton"].get(op)
            impl = None if module is None else _pick_triton(op, backend, module, *args, **kwargs)
        if impl is not None:
            return impl
    if backend is not None:
        raise NotImplementedError(f"{op}: no {backend} kernel is built for this op yet")
    return None


def _pick_mosaic(op: str, backend, kernel_module: str | None, reason_fn, *args, **kwargs):
    """The Mosaic GPU kernel of ``op`` where it runs (Hopper; the CPU's interpreter when
    asked for by name) and serves the call."""
    if kernel_module is None:
        return None
    mod = _kernel_module(kernel_module)
    if backend == "mosaic":
        if mod is None:
            raise NotImplementedError(f"{op}: the mosaic backend is not available in this build")
        if device_kind() not in ("hopper", "cpu"):
            raise NotImplementedError(f"{op}: the mosaic backend needs a Hopper (sm90+) GPU")
    if mod is None or (backend is None and device_kind() != "hopper"):
        return None
    reason = reason_fn(mod, *args, **kwargs)
    if reason is None:
        return getattr(mod, op)
    if backend == "mosaic":
        raise NotImplementedError(f"{op}: the mosaic backend cannot serve this call: {reason}")
    return None


def _pick_triton(op: str, backend, module: str, *args, **kwargs):
    """The Triton kernel of ``op`` where it runs (a CUDA GPU with jax-triton) and serves the call."""
    from jattn.pallas_kernels import triton_glue

    mod = _kernel_module(module)
    if mod is None or not triton_glue.available():
        if backend == "triton":
            raise NotImplementedError(f"{op}: the triton backend needs a CUDA GPU with jax-triton installed")
        return None
    reason = mod.unsupported_reason(*args, **kwargs) if args else None  # no call: op_backend
    if reason is None:
        return getattr(mod, op)
    if backend == "triton":
        raise NotImplementedError(f"{op}: the triton backend cannot serve this call: {reason}")
    return None


# kernel backend -> {op: kernel module}; an op missing here has no kernel in that backend yet
KERNELS = {
    "mosaic": {
        "mha_decode": "mosaic_decode",
        "mha_extend": "mosaic_prefill",
        "mha_prefill": "mosaic_prefill",
        "mla_decode": "mosaic_mla",
    },
    "triton": {
        "mha_decode": "triton_decode",
        "mha_prefill": "triton_prefill",
        "mha_extend": "triton_prefill",
        "mla_decode": "triton_mla",
        "attn_merge_state": "merge_state",  # dispatched by _merge_impl
        "set_kv_buffer": "triton_kv_write",
    },
}
OPS = (
    "mha_decode",
    "mha_extend",
    "mha_prefill",
    "mla_decode",
    "attn_merge_state",
    "set_kv_buffer",
    "set_mla_kv_buffer",
)


def op_backend(op: str, backend: str | None = None) -> tuple[str, str | None]:
    """The backend that runs ``op`` (one of :data:`OPS`) on this device: ``(name, reason)``.

    ``backend`` is the one asked for (None = auto). The answer holds for a call within the
    kernel's limits (shapes, dtypes, options); auto sends a call outside them to ``xla``.
    ``reason`` says why a backend asked for by name cannot serve ``op`` here (the op would
    raise ``NotImplementedError`` with it), else None.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} must be one of {OPS}")
    if op == "attn_merge_state":
        try:
            return ("triton" if _merge_impl(backend) is not None else "xla"), None
        except NotImplementedError as e:
            return "xla", str(e)
    try:
        impl = _pick(op, backend, KERNELS["mosaic"].get(op), lambda *a, **k: None)
    except NotImplementedError as e:
        return "xla", str(e)
    if impl is None:
        return "xla", None
    module = impl.__module__.rsplit(".", 1)[-1]
    return next(b for b in KERNELS if module in KERNELS[b].values()), None


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
      sinks: f32[num_q_heads] per-head sink logits (denominator only, not scaled), or None.
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
    _check_paged(q, k_cache, v_cache, page_table, cache_seqlens)
    bs = page_table.shape[0]
    _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    if q.shape[0] != bs * max_seqlen_q:
        raise ValueError(f"q has {q.shape[0]} rows; it must be batch ({bs}) * max_seqlen_q ({max_seqlen_q})")
    _check_options(window_left, logit_cap, sinks, q.shape[1], is_causal)
    _check_scales(softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale)
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
            mod.unsupported_reason(*a, **k) or (mod.auto_skip_reason(*a, **k) if backend is None else None)
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
        return {"block_sizes": dataclasses.replace(bsz, num_splits=min(splits, blocks))}
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
    _check_prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, window_left, logit_cap, sinks, is_causal
    )
    _check_scales(softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale)
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
    backend: None or ``"xla"`` (XLA's fusion: on the H200 it streams at the copy
    bandwidth, docs/PERF.md), or ``"triton"`` (one fused Triton kernel through
    jax-triton, the same source the torch bridge can launch; raises where it cannot run).
    """
    for x, name, layout in ((o_a, "o_a", "[T, H, D]"), (o_b, "o_b", "[T, H, D]")):
        _check_ndim(x, name, 3, layout)
        _check_dtype(x, name, _Q_DTYPES)
    for x, name in ((lse_a, "lse_a"), (lse_b, "lse_b")):
        _check_ndim(x, name, 2, "[T, H]")
        _check_dtype(x, name, (jnp.float32,))
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:2] != lse_a.shape:
        raise ValueError(
            f"shapes must be o [T, H, D] and lse [T, H], equal for both: got {o_a.shape}, "
            f"{lse_a.shape}, {o_b.shape}, {lse_b.shape}"
        )
    impl = _merge_impl(backend)
    if impl is not None:
        return impl(o_a, lse_a, o_b, lse_b)
    return reference.attn_merge_state(o_a, lse_a, o_b, lse_b)


def _merge_impl(backend):
    """The Triton merge (``pallas_kernels.merge_state``) for ``backend="triton"``, else None
    (auto picks XLA's fusion: measured faster)."""
    _check_backend(backend)
    if backend in (None, "xla"):
        return None
    if backend == "mosaic":
        raise NotImplementedError("attn_merge_state: no mosaic kernel (the fused merge is a Triton kernel)")
    mod = _kernel_module("merge_state")
    if mod is not None and mod.kernel_runs_here():
        return mod.merge_state
    raise NotImplementedError("attn_merge_state: the triton kernel needs a CUDA GPU with jax-triton installed")


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
    _check_ndim(k_cache, "k_cache", 4, "[num_pages, page_size, num_kv_heads, head_dim]")
    _check_ndim(v_cache, "v_cache", 4, "[num_pages, page_size, num_kv_heads, head_dim_v]")
    _check_dtype(k_cache, "k_cache", _KV_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache.dtype={v_cache.dtype} must equal k_cache.dtype={k_cache.dtype}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ in pages/heads")
    for x, name in ((k, "k"), (v, "v")):
        _check_ndim(x, name, 3, "[tokens, num_kv_heads, head_dim]")
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
    kw = dict(k_scale=k_scale, v_scale=v_scale)
    impl = _pick("set_kv_buffer", backend, None, None, k_cache, v_cache, out_cache_loc, k, v, **kw)
    if impl is not None:
        return impl(k_cache, v_cache, out_cache_loc, k, v, **kw)
    return reference.set_kv_buffer(k_cache, v_cache, out_cache_loc, k, v, k_scale, v_scale)


def set_mla_kv_buffer(kv_cache, out_cache_loc, c_kv, k_pe, *, kv_scale=None):
    """Writes latent rows ``[c_kv, k_pe]`` at ``out_cache_loc``; returns the cache.

    kv_cache: [num_pages, page_size, R + r]; out_cache_loc: i32[T]; c_kv: [T, R] or
    [T, 1, R]; k_pe: [T, r] or [T, 1, r]. FP8 caches store ``clamp(row / kv_scale, -448, 448)``.
    """
    _check_ndim(kv_cache, "kv_cache", 3, "[num_pages, page_size, R + r]")
    _check_dtype(kv_cache, "kv_cache", _KV_DTYPES)
    _check_int(out_cache_loc, "out_cache_loc")
    _check_ndim(out_cache_loc, "out_cache_loc", 1, "[tokens]")
    _check_scale(kv_scale, "kv_scale", optional=True)
    t = out_cache_loc.shape[0]
    rows_ok = all(x.ndim in (2, 3) and x.shape[0] == t and (x.ndim == 2 or x.shape[1] == 1) for x in (c_kv, k_pe))
    if not rows_ok or c_kv.shape[-1] + k_pe.shape[-1] != kv_cache.shape[-1]:
        raise ValueError(f"c_kv {c_kv.shape} + k_pe {k_pe.shape} must give {t} rows of width {kv_cache.shape[-1]}")
    return reference.set_mla_kv_buffer(kv_cache, out_cache_loc, c_kv, k_pe, kv_scale)
