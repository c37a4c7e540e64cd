"""Argument checks of the ops: each names the argument and the rule it breaks."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

BACKENDS = ("mosaic", "triton", "xla")
Q_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
KV_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)


def _check_dtype(x, name, allowed):
    if jnp.dtype(x.dtype) not in [jnp.dtype(a) for a in allowed]:
        names = ", ".join(str(jnp.dtype(a)) for a in allowed)
        raise TypeError(f"{name}.dtype={x.dtype} must be one of {names}")


def _check_ndim(x, name, ndim, layout):
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")


def _check_int(x, name):
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{name}.dtype={x.dtype} must be int32")


def _check_options(window_left, logit_cap, sinks, num_q_heads):
    if not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left={window_left!r} must be an int >= -1 (-1 disables it)")
    if logit_cap < 0:
        raise ValueError(f"logit_cap={logit_cap} must be >= 0 (0 disables it)")
    if sinks is not None and tuple(jnp.shape(sinks)) != (num_q_heads,):
        raise ValueError(f"sinks must have shape ({num_q_heads},) (one per query head), got {jnp.shape(sinks)}")


def _check_paged(q, k_cache, v_cache, page_table, cache_seqlens):
    _check_ndim(q, "q", 3, "[tokens, num_q_heads, head_dim]")
    _check_ndim(k_cache, "k_cache", 4, "[num_pages, page_size, num_kv_heads, head_dim]")
    _check_ndim(v_cache, "v_cache", 4, "[num_pages, page_size, num_kv_heads, head_dim_v]")
    _check_ndim(page_table, "page_table", 2, "[batch, max_pages]")
    _check_ndim(cache_seqlens, "cache_seqlens", 1, "[batch]")
    _check_dtype(q, "q", Q_DTYPES)
    _check_dtype(k_cache, "k_cache", KV_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache.dtype={v_cache.dtype} must equal k_cache.dtype={k_cache.dtype}")
    _check_int(page_table, "page_table")
    _check_int(cache_seqlens, "cache_seqlens")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ in pages/heads")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head_dim={q.shape[2]} must equal k_cache head_dim={k_cache.shape[3]}")
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be divisible by num_kv_heads={num_kv_heads}")
    if page_table.shape[0] != cache_seqlens.shape[0]:
        raise ValueError(f"page_table has {page_table.shape[0]} rows but cache_seqlens has {cache_seqlens.shape[0]}")
    _check_lengths(page_table, cache_seqlens, k_cache.shape[1], k_cache.shape[0])


def _check_lengths(page_table, cache_seqlens, page_size: int, num_pages: int) -> None:
    """Values of concrete lengths and page tables (an eager call; traced values under
    ``jit`` pass, their metadata builders check on the host): every length in
    ``[0, max_pages * page_size]`` and every page a length uses in ``[0, num_pages)``."""
    try:
        lens, pt = np.asarray(cache_seqlens), np.asarray(page_table)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if lens.size == 0:
        return
    cap = pt.shape[1] * page_size
    bad = np.flatnonzero((lens < 0) | (lens > cap))
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"cache_seqlens[{b}]={int(lens[b])} must be in [0, {cap}] (page_table's {pt.shape[1]} columns "
            f"of page_size={page_size})"
        )
    bad = first_page_outside(pt, lens, page_size, num_pages)
    if bad is not None:
        b, i = bad
        raise ValueError(f"page_table[{b}, {i}]={int(pt[b, i])} out of range [0, {num_pages}) (the cache's pages)")


def first_page_outside(pt: np.ndarray, lens: np.ndarray, page_size: int, hi: int):
    """``(request, column)`` of the first page-table entry that a length uses (columns
    below ``ceil(len / page_size)``) and that is not a page id in ``[0, hi)``, or None.
    The one rule behind the eager op checks and the planners' checks."""
    used = np.arange(pt.shape[1])[None, :] < -(-np.asarray(lens)[:, None] // page_size)
    out = used & ((pt < 0) | (pt >= hi))
    if not out.any():
        return None
    b, i = np.argwhere(out)[0]
    return int(b), int(i)


def _check_backend(backend) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS} or None")


def _check_max_seqlen(value, name: str) -> None:
    if not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")
