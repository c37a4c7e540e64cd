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


def _check_float(x, name):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}.dtype={x.dtype} must be a float dtype")


def _check_array(x, name, layout):
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array {layout}, got {type(x).__name__}")


def _check_ndim(x, name, ndim, layout):
    _check_array(x, name, layout)
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")


def _check_int(x, name):
    if not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an int32 array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{name}.dtype={x.dtype} must be int32")


def _is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _concrete(x):
    """``x`` as a numpy array, or None while it is traced (checked by its builder instead)
    or spans devices of other processes (each process sees only its own shards)."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.is_fully_addressable:
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_options(window_left, logit_cap, sinks, num_q_heads, is_causal=True):
    if not _is_int(window_left) or window_left < -1:
        raise ValueError(f"window_left={window_left!r} must be an int >= -1 (-1 disables it)")
    if not isinstance(logit_cap, numbers.Real) or isinstance(logit_cap, bool) or not 0 <= logit_cap < float("inf"):
        raise ValueError(f"logit_cap={logit_cap!r} must be a finite Python number >= 0 (0 disables it)")
    if sinks is not None:
        if tuple(jnp.shape(sinks)) != (num_q_heads,):
            raise ValueError(f"sinks must have shape ({num_q_heads},) (one per query head), got {jnp.shape(sinks)}")
        dt = np.dtype(sinks.dtype) if hasattr(sinks, "dtype") else np.asarray(sinks).dtype
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"sinks must hold float logits (any float dtype, read as f32), got dtype {dt}")
    s = None if sinks is None else _concrete(sinks)
    s32 = None if s is None else s.astype(np.float32)
    bad = None if s is None else np.isnan(s32) | (s32 == np.inf)
    if bad is not None and bad.any():
        h = int(np.flatnonzero(bad)[0])
        raise ValueError(f"sinks[{h}]={s[h].item()!r} must be a finite logit or -inf (no sink)")
    _check_causal(is_causal)


def _window_within(window_left: int, max_keys: int) -> int:
    """``window_left``, or -1 where the window holds every key a query can have (``window_left
    >= max_keys``: ``pos_i - window_left < 0`` for every query position ``pos_i < max_keys``),
    so that no kernel computes ``pos_i - window_left`` past int32."""
    return -1 if window_left >= max_keys else window_left


def _check_causal(is_causal) -> None:
    _check_bool(is_causal, "is_causal")


def _check_bool(value, name: str) -> None:
    """A flag is a Python or numpy bool: a string or a number would pass a truth test."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be a bool")


def _check_scale(value, name: str, *, optional: bool = False) -> None:
    """A scale is a Python number or a scalar array; where concrete, finite and > 0."""
    if value is None and optional:
        return
    number = isinstance(value, numbers.Real) or hasattr(value, "dtype")
    if value is None or isinstance(value, bool) or not number or jnp.ndim(value) != 0:
        raise ValueError(f"{name} must be a Python number or a scalar array, got {value!r:.80}")
    dtype = getattr(value, "dtype", None)
    if dtype is not None and jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(np.float64)):
        # A bf16 / f16 scale would round the softmax scale it multiplies; an integer one is a slip.
        raise TypeError(f"{name}.dtype={dtype} must be float32 (or a Python number)")
    v = _concrete(value)
    if v is not None and not (np.isfinite(v) and 0 < v <= np.finfo(np.float32).max and np.float32(v) > 0):
        raise ValueError(f"{name}={v.item()!r} must be finite and > 0 (in float32)")


def _check_scales(**scales) -> None:
    """:func:`_check_scale` for each keyword; ``softmax_scale`` may be None (the default).
    Where both are concrete, ``softmax_scale`` times the key scale (``k_scale`` /
    ``kv_scale``), the factor the scores are multiplied by, must be finite and > 0 in
    float32 too (each alone may be, and their product not)."""
    for name, value in scales.items():
        _check_scale(value, name, optional=name == "softmax_scale")
    concrete = lambda name: None if scales.get(name) is None else _concrete(scales[name])  # noqa: E731
    soft = concrete("softmax_scale")
    for name in ("k_scale", "kv_scale"):
        key = concrete(name)
        if soft is not None and key is not None:
            with np.errstate(over="ignore", under="ignore"):
                folded = np.float32(soft) * np.float32(key)
            if not (np.isfinite(folded) and folded > 0):
                raise ValueError(
                    f"softmax_scale * {name} = {float(soft) * float(key)!r} must be finite and > 0 in float32 "
                    "(the factor the scores are multiplied by)"
                )


def _check_cu_seqlens(cu, name: str, rows: int, rows_name: str, max_seqlen: int, max_name: str, lens=None) -> None:
    """Concrete ``cu`` (traced values pass): starts at 0, non-decreasing, ends within
    ``rows`` (the rows of ``rows_name``), each request at most ``max_seqlen`` long (the
    static bound ``max_name``) and, with ``lens``, at most ``lens[b]`` (the cached length
    that includes the request's new tokens)."""
    c = _concrete(cu)
    if c is None or c.size == 0:
        return
    if c[0] != 0:
        raise ValueError(f"{name}[0]={int(c[0])} must be 0")
    n = np.diff(c)
    if (n < 0).any():
        b = int(np.flatnonzero(n < 0)[0])
        raise ValueError(f"{name} must be non-decreasing: {name}[{b + 1}]={int(c[b + 1])} < {name}[{b}]={int(c[b])}")
    if c[-1] > rows:
        raise ValueError(f"{name}[-1]={int(c[-1])} exceeds the {rows} rows of {rows_name}")
    if n.size and n.max() > max_seqlen:
        b = int(np.argmax(n))
        raise ValueError(f"{name}: request {b} has {int(n[b])} tokens > {max_name}={max_seqlen}")
    if lens is not None:
        ln = _concrete(lens)
        if ln is not None and (n > ln).any():
            b = int(np.flatnonzero(n > ln)[0])
            raise ValueError(
                f"{name}: request {b} has {int(n[b])} new tokens > cache_seqlens[{b}]={int(ln[b])} "
                "(the cached length includes them)"
            )


def _check_kv_caches(k_cache, v_cache) -> None:
    """Paged K and V caches: 4-D, one KV dtype, the same pages, page size and heads."""
    _check_ndim(k_cache, "k_cache", 4, "[num_pages, page_size, num_kv_heads, head_dim]")
    _check_ndim(v_cache, "v_cache", 4, "[num_pages, page_size, num_kv_heads, head_dim_v]")
    _check_dtype(k_cache, "k_cache", KV_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache.dtype={v_cache.dtype} must equal k_cache.dtype={k_cache.dtype}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ in pages/heads")
    if k_cache.shape[3] == 0 or v_cache.shape[3] == 0:
        raise ValueError(f"head dims must be > 0: k_cache {k_cache.shape}, v_cache {v_cache.shape}")


def _check_paged(q, k_cache, v_cache, page_table, cache_seqlens):
    _check_ndim(q, "q", 3, "[tokens, num_q_heads, head_dim]")
    _check_kv_caches(k_cache, v_cache)
    _check_ndim(page_table, "page_table", 2, "[batch, max_pages]")
    _check_ndim(cache_seqlens, "cache_seqlens", 1, "[batch]")
    _check_dtype(q, "q", Q_DTYPES)
    _check_int(page_table, "page_table")
    _check_int(cache_seqlens, "cache_seqlens")
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
    lens, pt = _concrete(cache_seqlens), _concrete(page_table)
    if lens is None or pt is None or lens.size == 0:
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
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")


def _check_prefill(
    q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, window_left, logit_cap, sinks, is_causal
) -> None:
    """The shapes, dtypes, static bounds and (concrete) offsets of a ragged prefill."""
    _check_ndim(q, "q", 3, "[tokens, num_q_heads, head_dim_qk]")
    _check_ndim(k, "k", 3, "[kv_tokens, num_kv_heads, head_dim_qk]")
    _check_ndim(v, "v", 3, "[kv_tokens, num_kv_heads, head_dim_v]")
    _check_dtype(q, "q", Q_DTYPES)
    _check_dtype(k, "k", KV_DTYPES)
    if v.dtype != k.dtype:
        raise TypeError(f"v.dtype={v.dtype} must equal k.dtype={k.dtype}")
    _check_int(cu_seqlens_q, "cu_seqlens_q")
    _check_ndim(cu_seqlens_q, "cu_seqlens_q", 1, "[batch + 1]")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError(
            "cu_seqlens_q must be [batch + 1] with at least one entry (0 for an empty batch), got shape (0,)"
        )
    if cu_seqlens_kv is not None:
        _check_int(cu_seqlens_kv, "cu_seqlens_kv")
        if max_seqlen_kv is None:
            # Defaulting to max_seqlen_q would silently drop keys past it.
            raise ValueError("max_seqlen_kv is required when cu_seqlens_kv is given")
        if cu_seqlens_kv.shape != cu_seqlens_q.shape:
            raise ValueError(f"cu_seqlens_kv {cu_seqlens_kv.shape} must match cu_seqlens_q {cu_seqlens_q.shape}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {k.shape} and v {v.shape} differ in tokens/heads")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim_qk={q.shape[2]} must equal k head_dim_qk={k.shape[2]}")
    if q.shape[2] == 0 or v.shape[2] == 0:
        raise ValueError(f"head dims must be > 0: q {q.shape}, v {v.shape}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"num_q_heads={q.shape[1]} must be divisible by num_kv_heads={k.shape[1]}")
    _check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    if max_seqlen_kv is not None:
        _check_max_seqlen(max_seqlen_kv, "max_seqlen_kv")
    _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "q", max_seqlen_q, "max_seqlen_q")
    if cu_seqlens_kv is None:  # the keys' offsets are the queries'
        _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", k.shape[0], "k", max_seqlen_q, "max_seqlen_q")
        if max_seqlen_kv is not None:  # the keys are the queries' rows: each request within both bounds
            _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", k.shape[0], "k", max_seqlen_kv, "max_seqlen_kv")
    else:
        _check_cu_seqlens(cu_seqlens_kv, "cu_seqlens_kv", k.shape[0], "k", max_seqlen_kv, "max_seqlen_kv")
    _check_options(window_left, logit_cap, sinks, q.shape[1], is_causal)
