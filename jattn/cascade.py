"""Shared-prefix (cascade) paged decode: a group's common prefix is read once.

Parallel sampling, few-shot prompts and shared system prompts give several
requests the same leading pages. :func:`cascade_decode` takes a two-level page
structure: ``G`` groups of ``group_size`` consecutive requests; group ``g``'s
prefix is ``prefix_lens[g]`` tokens in the pages ``prefix_page_table[g]``, and
request ``b`` (of group ``b // group_size``) continues with its own
``suffix_lens[b]`` tokens in ``suffix_page_table[b]``. Request ``b``'s keys are
the prefix followed by its suffix, and the result equals
``mha_decode_with_kvcache`` over that concatenation:

* **prefix pass**: the group's queries attend to the prefix together, so each
  prefix page is read once per group (or per chunk of the group) rather than once
  per request. Two ways, chosen by ``prefix_pass``:

  - ``"decode"``: ``mha_decode_with_kvcache`` with ``max_seqlen_q = chunk * q_len``,
    non-causal (every query of the group comes after the whole prefix). A chunk is
    the largest divisor of ``group_size`` whose rows fit the decode kernels'
    ``max_seqlen_q`` limit (8), unless ``prefix_chunk`` says otherwise. Best for
    small groups: the decode kernels pack all query heads of a request into one
    tile, so 8 query rows fill the matrix unit;
  - ``"extend"``: ``mha_extend_with_kvcache``, non-causal, the group's queries
    being one request's new tokens, with the query heads of each KV head packed as
    extra rows (``group_size * q_len * Hq / Hkv`` rows on one head), and the prefix
    cut into ``prefix_splits`` page ranges (separate requests of that call, so a
    long prefix of one group still spreads over the machine), merged by their LSE.
    The prefix is read once per group and 128 packed rows; the prefill kernels'
    128-row tiles make it the choice for large groups.

  By default (``prefix_pass=None``) the decode pass serves groups of at most 8
  query rows that pack into fewer than 32 rows per KV head; the others take the
  extend pass;
:func:`cascade_tables` derives the two-level structure from a normal decode plan
(rows whose first pages are shared) on the device; :func:`check_shared_prefix`
checks a grouping on the host.

The prefix pass gives every query the whole prefix, so a request of a group with
a prefix needs ``suffix_lens[b] >= max_seqlen_q - 1`` (its first query at the
prefix's last position or later; refused where the lengths are concrete, and under
``jax.jit`` such a request's output and LSE rows come out NaN): a
suffix of 0 tokens is allowed (the request is only its prefix) when
``max_seqlen_q == 1``; a prefix of 0 tokens gives a plain decode. Window
attention is not supported (the window's start may fall inside the prefix).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jattn import ops
from jattn.checks import (
    _check_bool,
    _check_int,
    _check_lengths,
    _check_max_seqlen,
    _check_ndim,
    _check_options,
    _concrete,
    _is_int,
)
from jattn.plan_inputs import _as_int_array, _positive_int

__all__ = [
    "cascade_decode",
    "cascade_tables",
    "check_shared_prefix",
    "merge_states",
    "prefix_chunk_size",
    "prefix_split_count",
]

_MAX_ROWS = 8  # the decode kernels' max_seqlen_q
# Programs the extend prefix pass aims for: about two waves of a 108-132 SM GPU
# (A100, H100, H200); measured against one wave and four in docs/PERF.md.
_TARGET_PROGRAMS = 256
_MIN_SPLIT_TOKENS = 1024  # a split shorter than this pays its pipeline fill for little work
# Query rows per (group, KV head) from which the extend pass is the default: a quarter
# of a prefill tile (docs/PERF.md has the measurement).
_EXTEND_ROWS = 32


def prefix_chunk_size(group_size: int, q_len: int, limit: int = _MAX_ROWS) -> int:
    """The largest divisor of ``group_size`` whose ``chunk * q_len`` query rows fit ``limit``."""
    best = 1
    for c in range(1, group_size + 1):
        if group_size % c == 0 and c * q_len <= limit:
            best = c
    return best


def prefix_split_count(groups: int, rows: int, num_kv_heads: int, prefix_tokens: int) -> int:
    """Page ranges per group prefix for the ``"extend"`` prefix pass, whose ``rows`` query
    rows per (group, KV head) go in 128-row tiles: enough (KV head, tile, range)
    programs for about two waves, with ranges of at least ``_MIN_SPLIT_TOKENS`` of the
    ``prefix_tokens`` capacity."""
    programs = groups * num_kv_heads * -(-rows // 128)
    want = -(-_TARGET_PROGRAMS // max(1, programs))
    return max(1, min(want, prefix_tokens // _MIN_SPLIT_TOKENS))


def merge_states(outs, lses, dtype):
    """Merges ``K`` partial attentions over disjoint keys: ``outs [K, T, H, Dv]``,
    natural-log ``lses f32[K, T, H]`` -> ``(o [T, H, Dv] in dtype, lse [T, H])``.
    A part with LSE ``-inf`` contributes nothing, whatever its output holds; all
    ``-inf`` gives ``o = 0, lse = -inf``. A NaN LSE (a part that saw a non-finite key)
    makes the row NaN, as one attention over all the keys would be: the tests below
    are for an exact zero, which NaN is not, so NaN flows through."""
    m = jnp.max(lses, axis=0)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    w = jnp.exp(lses - m[None])  # 0 where a part is empty
    den = jnp.sum(w, axis=0)
    num = jnp.sum(jnp.where(w[..., None] == 0, 0.0, w[..., None] * outs.astype(jnp.float32)), axis=0)
    empty = den == 0
    o = jnp.where(empty[..., None], 0.0, num / jnp.where(empty, 1.0, den)[..., None])
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, den)))
    return o.astype(dtype), lse


def _extend_prefix(q, k_cache, v_cache, prefix_page_table, prefix_lens, group_size, q_len, splits, common):
    """The ``"extend"`` prefix pass: ``[S, bs * q_len, Hq, Dv]`` outputs and
    ``[S, bs * q_len, Hq]`` LSEs, one per page range of each group's prefix.

    The query heads that share a KV head are packed as extra query rows of a call with
    one query head per KV head (non-causal, so row order is free): the group's
    ``group_size * q_len * (Hq // Hkv)`` rows fill the prefill kernel's tiles and each
    range of K/V is read by one tile per 128 rows, not by one per query head."""
    groups, width = prefix_page_table.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    hq, d = q.shape[1], q.shape[2]
    g = hq // hkv
    n = group_size * q_len
    rows = n * g  # query rows per (group, KV head)
    per = -(-width // splits)  # pages per range
    table = prefix_page_table.astype(jnp.int32)
    if per * splits != width:  # pad with the row's first page (a valid id; never read)
        table = jnp.concatenate([table, jnp.repeat(table[:, :1], per * splits - width, axis=1)], axis=1)
    table = table.reshape(groups * splits, per)
    starts = jnp.arange(splits, dtype=jnp.int32) * (per * page_size)
    lens = jnp.clip(prefix_lens.astype(jnp.int32)[:, None] - starts[None, :], 0, per * page_size)  # [G, S]
    # [G*n, Hq, D] -> [G, n * g, Hkv, D]: row i * g + j is query row i of head kv * g + j.
    qp = jnp.swapaxes(q.reshape(groups, n, hkv, g, d), 2, 3).reshape(groups, 1, rows, hkv, d)
    qp = jnp.broadcast_to(qp, (groups, splits, rows, hkv, d)).reshape(-1, hkv, d)
    cu = jnp.arange(groups * splits + 1, dtype=jnp.int32) * rows
    o, lse = ops.mha_extend_with_kvcache(
        qp,
        k_cache,
        v_cache,
        table,
        lens.reshape(-1),
        cu,
        max_seqlen_q=rows,
        is_causal=False,
        return_lse=True,
        **common,
    )
    dv = o.shape[-1]
    # [G*S*n*g, Hkv, Dv] -> [S, G*n, Hkv*g, Dv]
    o = jnp.transpose(o.reshape(groups, splits, n, g, hkv, dv), (1, 0, 2, 4, 3, 5)).reshape(splits, groups * n, hq, dv)
    lse = jnp.transpose(lse.reshape(groups, splits, n, g, hkv), (1, 0, 2, 4, 3)).reshape(splits, groups * n, hq)
    empty = jnp.repeat(jnp.swapaxes(lens, 0, 1) == 0, n, axis=1)  # [S, bs * q_len]
    return o, jnp.where(empty[..., None], -jnp.inf, lse)


def _check_group_size(group_size) -> None:
    if not _is_int(group_size) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1")


def _check_part(table, lens, table_name: str, lens_name: str, k_cache) -> None:
    """The eager ops' check of concrete lengths and the page ids they use
    (``checks._check_lengths``) on one part's table, its message naming this part's
    arguments (the ops would name ``page_table`` / ``cache_seqlens``, at the rows of a
    repeated table)."""
    try:
        _check_lengths(table, lens, k_cache.shape[1], k_cache.shape[0])
    except ValueError as e:
        raise ValueError(str(e).replace("cache_seqlens", lens_name).replace("page_table", table_name)) from None


def _check_inputs(
    q, k_cache, prefix_page_table, prefix_lens, suffix_page_table, suffix_lens, group_size, n, cap, sinks
):
    """Shapes, dtypes and (where concrete) values of :func:`cascade_decode`'s arguments."""
    _check_group_size(group_size)
    _check_max_seqlen(n, "max_seqlen_q")
    _check_ndim(q, "q", 3, "[batch * max_seqlen_q, num_q_heads, head_dim]")
    _check_ndim(k_cache, "k_cache", 4, "[num_pages, page_size, num_kv_heads, head_dim]")
    for x, name, ndim, layout in (
        (prefix_page_table, "prefix_page_table", 2, "[groups, max_prefix_pages]"),
        (prefix_lens, "prefix_lens", 1, "[groups]"),
        (suffix_page_table, "suffix_page_table", 2, "[batch, max_suffix_pages]"),
        (suffix_lens, "suffix_lens", 1, "[batch]"),
    ):
        _check_int(x, name)
        _check_ndim(x, name, ndim, layout)
    groups, bs = prefix_page_table.shape[0], suffix_page_table.shape[0]
    if prefix_lens.shape != (groups,):
        raise ValueError(f"prefix_lens must have shape ({groups},) (one per group), got {tuple(prefix_lens.shape)}")
    if bs != groups * group_size:
        raise ValueError(f"suffix_page_table has {bs} rows; it must be groups ({groups}) * group_size ({group_size})")
    if suffix_lens.shape != (bs,):
        raise ValueError(f"suffix_lens must have shape ({bs},) (one per request), got {tuple(suffix_lens.shape)}")
    if q.shape[0] != bs * n:
        raise ValueError(f"q has {q.shape[0]} rows; it must be batch ({bs}) * max_seqlen_q ({n})")
    _check_options(-1, cap, sinks, q.shape[1])
    _check_part(prefix_page_table, prefix_lens, "prefix_page_table", "prefix_lens", k_cache)
    _check_part(suffix_page_table, suffix_lens, "suffix_page_table", "suffix_lens", k_cache)
    pl, sl = _concrete(prefix_lens), _concrete(suffix_lens)
    if pl is None or sl is None:
        return
    short = np.flatnonzero((np.repeat(pl, group_size) > 0) & (sl < n - 1))
    if short.size:
        b = int(short[0])
        raise ValueError(
            f"suffix_lens[{b}]={int(sl[b])} must be >= max_seqlen_q - 1 = {n - 1}: group {b // group_size} has a "
            f"prefix (prefix_lens[{b // group_size}]={int(pl[b // group_size])}) that every query sees whole, so "
            f"request {b}'s first query cannot come before its end"
        )


def cascade_decode(
    q,
    k_cache,
    v_cache,
    prefix_page_table,
    prefix_lens,
    suffix_page_table,
    suffix_lens,
    *,
    group_size: int,
    max_seqlen_q: int = 1,
    logit_cap: float = 0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse: bool = False,
    prefix_chunk: int | None = None,
    prefix_pass: str | None = None,
    prefix_splits: int | None = None,
    backend: str | None = None,
):
    """Paged decode where groups of ``group_size`` consecutive requests share a prefix.

    Args:
      q: ``[bs * max_seqlen_q, Hq, D]`` request-major; ``bs = G * group_size``.
      k_cache, v_cache: ``[num_pages, page_size, Hkv, D]`` (one pool for prefixes and suffixes).
      prefix_page_table: i32 ``[G, max_prefix_pages]``; prefix_lens: i32 ``[G]``.
      suffix_page_table: i32 ``[bs, max_suffix_pages]``; suffix_lens: i32 ``[bs]``, the
        new tokens included (already written to the cache).
      group_size: requests per group (static).
      prefix_chunk: requests per decode prefix pass (a divisor of ``group_size``; None:
        the largest that keeps ``chunk * max_seqlen_q <= 8``). Giving it selects the
        ``"decode"`` pass.
      prefix_pass: ``"decode"``, ``"extend"`` or None (decode for groups of at most
        8 query rows that pack into fewer than 32 rows per KV head, else extend); see the
        module docstring.
      prefix_splits: page ranges per group prefix for the extend pass (None:
        :func:`prefix_split_count`). Giving it selects the ``"extend"`` pass.
      Other arguments as in ``jattn.mha_decode_with_kvcache`` (causal within the suffix).

    Returns ``out [bs * max_seqlen_q, Hq, D]`` in q's dtype, and with ``return_lse`` the
    natural-log LSE f32 ``[bs * max_seqlen_q, Hq]``.
    """
    _check_bool(return_lse, "return_lse")
    _check_inputs(
        q,
        k_cache,
        prefix_page_table,
        prefix_lens,
        suffix_page_table,
        suffix_lens,
        group_size,
        max_seqlen_q,
        logit_cap,
        sinks,
    )
    groups, hkv = prefix_page_table.shape[0], max(1, k_cache.shape[2])
    rows = group_size * max_seqlen_q * (q.shape[1] // hkv)  # query rows per (group, KV head)
    if prefix_pass not in (None, "decode", "extend"):
        raise ValueError(f"prefix_pass={prefix_pass!r} must be 'decode', 'extend' or None")
    if prefix_pass == "extend" and prefix_chunk is not None:
        raise ValueError("prefix_chunk applies to prefix_pass='decode' only")
    if prefix_splits is not None and (prefix_pass == "decode" or prefix_chunk is not None):
        raise ValueError("prefix_splits applies to prefix_pass='extend' only")
    if prefix_splits is not None:
        prefix_pass = "extend"  # giving it selects the extend pass, as prefix_chunk selects decode
    if prefix_pass is None:
        small = rows < _EXTEND_ROWS and group_size * max_seqlen_q <= _MAX_ROWS
        prefix_pass = "decode" if small or prefix_chunk is not None else "extend"
    common = dict(logit_cap=logit_cap, softmax_scale=softmax_scale, k_scale=k_scale, v_scale=v_scale, backend=backend)
    o_s, lse_s = ops.mha_decode_with_kvcache(
        q,
        k_cache,
        v_cache,
        suffix_page_table,
        suffix_lens,
        max_seqlen_q=max_seqlen_q,
        is_causal=True,
        return_lse=True,
        **common,
    )
    if prefix_pass == "extend":
        width = prefix_page_table.shape[1]
        if prefix_splits is None:
            prefix_splits = prefix_split_count(groups, rows, hkv, width * k_cache.shape[1])
        if not _is_int(prefix_splits) or not 1 <= prefix_splits <= max(1, width):
            raise ValueError(f"prefix_splits={prefix_splits!r} must be an int in [1, {max(1, width)}]")
        o_p, lse_p = _extend_prefix(
            q, k_cache, v_cache, prefix_page_table, prefix_lens, group_size, max_seqlen_q, prefix_splits, common
        )
        o, lse = merge_states(
            jnp.concatenate([o_p, o_s[None].astype(o_p.dtype)]), jnp.concatenate([lse_p, lse_s[None]]), q.dtype
        )
    else:
        chunk = prefix_chunk_size(group_size, max_seqlen_q) if prefix_chunk is None else prefix_chunk
        if not _is_int(chunk) or chunk < 1 or group_size % chunk:
            raise ValueError(f"prefix_chunk={prefix_chunk!r} must divide group_size={group_size}")
        per = group_size // chunk
        # Each chunk of a group's requests is one "request" of chunk * q_len query rows.
        o_p, lse_p = ops.mha_decode_with_kvcache(
            q,
            k_cache,
            v_cache,
            jnp.repeat(prefix_page_table, per, axis=0),
            jnp.repeat(prefix_lens.astype(jnp.int32), per),
            max_seqlen_q=chunk * max_seqlen_q,
            is_causal=False,
            return_lse=True,
            **common,
        )
        o, lse = ops.attn_merge_state(o_p, lse_p, o_s, lse_s)
    if sinks is not None:
        s = jnp.asarray(sinks, jnp.float32)[None, :]
        factor = jnp.where(jnp.isneginf(lse), 1.0, 1.0 / (1.0 + jnp.exp(s - lse)))
        o = (o.astype(jnp.float32) * factor[..., None]).astype(q.dtype)
    if _concrete(prefix_lens) is None or _concrete(suffix_lens) is None:
        # traced lengths escape _check_inputs: a request whose first query comes before
        # its group's prefix ends (the prefix pass gave it the whole prefix) is NaN
        bad = (jnp.repeat(prefix_lens, group_size) > 0) & (suffix_lens < max_seqlen_q - 1)
        bad = jnp.repeat(bad, max_seqlen_q)[:, None]
        o = jnp.where(bad[..., None], jnp.nan, o.astype(jnp.float32)).astype(q.dtype)
        lse = jnp.where(bad, jnp.nan, lse)
    return (o, lse) if return_lse else o


def cascade_tables(page_table, seq_lens, prefix_pages, *, group_size: int, page_size: int):
    """The cascade's page structure from a decode plan's, on the device (jittable: a new
    grouping of the same shapes does not retrace).

    ``page_table`` i32[bs, W] and ``seq_lens`` i32[bs] are a decode plan's
    (``DecodeMetadata.page_table`` / ``cache_seqlens``); groups of ``group_size``
    consecutive requests share their first ``prefix_pages[g]`` pages (whole pages: the
    rows must hold the same ids there; where the values are concrete,
    :func:`check_shared_prefix` checks it, each request of a group with shared pages
    keeping at least its one new token after them). Returns ``(prefix_page_table [G, W],
    prefix_lens [G], suffix_page_table [bs, W], suffix_lens [bs])`` for
    :func:`cascade_decode`: group ``g``'s prefix is its first member's first pages, each
    request's suffix the rest of its row, shifted left.
    """
    _check_group_size(group_size)
    page_size = _positive_int(page_size, "page_size")
    _check_ndim(page_table, "page_table", 2, "[batch, max_pages]")
    _check_ndim(seq_lens, "seq_lens", 1, "[batch]")
    _check_int(page_table, "page_table")  # its rows become prefix_page_table as they are
    _check_int(seq_lens, "seq_lens")
    bs, width = page_table.shape
    if bs % group_size:
        raise ValueError(f"page_table has {bs} rows, not a multiple of group_size={group_size}")
    if seq_lens.shape != (bs,) or jnp.shape(prefix_pages) != (bs // group_size,):
        raise ValueError(
            f"seq_lens must have shape ({bs},) and prefix_pages ({bs // group_size},) (one per group of "
            f"{group_size}), got {tuple(seq_lens.shape)} and {jnp.shape(prefix_pages)}"
        )
    values = [_concrete(x) for x in (page_table, seq_lens, prefix_pages)]
    if all(x is not None for x in values):
        check_shared_prefix(*values, group_size=group_size, page_size=page_size)
    prefix_pages = jnp.asarray(prefix_pages, jnp.int32)
    prefix_page_table = page_table[::group_size]
    prefix_lens = prefix_pages * page_size
    per_req = jnp.repeat(prefix_pages, group_size)  # [bs]
    cols = jnp.minimum(jnp.arange(width, dtype=jnp.int32)[None, :] + per_req[:, None], width - 1)
    suffix_page_table = jnp.take_along_axis(page_table, cols, axis=1)
    suffix_lens = seq_lens.astype(jnp.int32) - jnp.repeat(prefix_lens, group_size)
    return prefix_page_table, prefix_lens, suffix_page_table, suffix_lens


def check_shared_prefix(page_table, seq_lens, prefix_pages, *, group_size: int, page_size: int, q_len: int = 1):
    """Host-side check of a grouping (numpy): raises ``ValueError`` naming the request whose
    row differs from its group's first row within the shared pages, or whose own part
    (suffix) would not hold its ``q_len`` new tokens after them (a group that shares no
    page is a plain decode: its rows may be shorter, padding rows of length 0 included)."""
    _check_group_size(group_size)
    page_size = _positive_int(page_size, "page_size")
    if not _is_int(q_len) or q_len < 0:
        raise ValueError(f"q_len={q_len!r} must be an int >= 0")
    pt = _as_int_array(page_table, "page_table", 2)
    sl = _as_int_array(seq_lens, "seq_lens", 1)
    pp = _as_int_array(prefix_pages, "prefix_pages", 1)
    bs, width = pt.shape
    if bs % group_size:
        raise ValueError(f"batch {bs} is not a multiple of group_size={group_size}")
    if pp.shape != (bs // group_size,) or sl.shape != (bs,):
        raise ValueError(
            f"prefix_pages must have shape ({bs // group_size},) and seq_lens ({bs},), got {pp.shape} and {sl.shape}"
        )
    bad = np.flatnonzero((pp < 0) | (pp > width))
    if bad.size:
        g = int(bad[0])
        raise ValueError(f"prefix_pages[{g}]={int(pp[g])} is outside [0, {width}]")
    n = np.repeat(pp, group_size)  # shared pages per request
    shared = np.arange(width)[None, :] < n[:, None]
    differs = ((pt != pt[np.arange(bs) // group_size * group_size]) & shared).any(axis=1)
    short = (n > 0) & (sl - n * page_size < q_len)

    def hint(b):
        return " (padding rows cannot join a sharing group)" if sl[b] == 0 else ""

    if differs.any():  # the sharing rule first
        b = int(np.argmax(differs))
        raise ValueError(f"request {b} does not share group {b // group_size}'s first {int(n[b])} pages{hint(b)}")
    if short.any():
        b = int(np.argmax(short))
        raise ValueError(
            f"request {b}: seq_len {int(sl[b])} leaves fewer than q_len={q_len} new tokens after group "
            f"{b // group_size}'s {int(n[b])} shared pages of {page_size}{hint(b)}"
        )
