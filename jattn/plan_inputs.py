"""Host-side checks and conversions of the planners' inputs (:mod:`jattn.metadata`):
integer arrays, page tables given directly or through a request-to-page pool and their
page ids, the pool's page count, positive sizes, the int32 range of the device arrays,
and KV slots that two new tokens would both write. Each error names the argument (the
caller's own array) and the rule it broke."""

from __future__ import annotations

import numpy as np

from jattn.checks import first_page_outside

_I32_MAX = int(np.iinfo(np.int32).max)


def _positive_int(value, name: str, rule: str = "a positive int") -> int:
    """``value`` as an int, which must be a Python or numpy integer (not a bool) >= 1
    (``rule`` says so in the message)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be {rule}")
    return int(value)


def _check_i32(a: np.ndarray, name: str, what: str) -> None:
    """Refuses values past int32 (the device arrays' type), which would wrap silently."""
    if a.size and int(a.max()) > _I32_MAX:
        i = int(np.argmax(a))
        raise ValueError(f"{name}[{i}]={int(a.flat[i])} ({what}) overflows int32")


def _check_nonnegative(a: np.ndarray, name: str) -> None:
    """Refuses a negative entry of ``a``, naming the first one."""
    if (a < 0).any():
        b = int(np.argmax(a < 0))
        raise ValueError(f"{name}[{b}]={a[b]} is negative")


def _as_int_array(x, name: str, ndim: int) -> np.ndarray:
    try:
        a = np.asarray(x)
    except ValueError as e:  # a ragged nested list
        raise ValueError(f"{name} must be a rectangular {ndim}-D int array: {e}") from None
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.size and a.dtype == np.uint64 and (a > np.iinfo(np.int64).max).any():  # the cast would wrap
        i = int(np.argmax(a > np.iinfo(np.int64).max))
        raise ValueError(f"{name}[{i}]={int(a.flat[i])} overflows int64")
    return a.astype(np.int64)


def _resolve_page_table(page_table, req_to_page, req_pool_indices, bs: int):
    """``(page_table [bs, width], table_name, rows)``: the per-request table, from
    ``page_table`` or as ``req_to_page[req_pool_indices]``, with the name of the caller's
    array it came from and, for ``req_to_page``, that array's row of each request (None:
    request ``b`` is row ``b``), so that errors name the caller's own entries."""
    if page_table is not None:
        if req_to_page is not None or req_pool_indices is not None:
            raise ValueError("pass either page_table or (req_to_page, req_pool_indices), not both")
        pt = _as_int_array(page_table, "page_table", 2)
        name, rows = "page_table", None
    else:
        if req_to_page is None or req_pool_indices is None:
            raise ValueError("page_table or both req_to_page and req_pool_indices are required")
        r2p = _as_int_array(req_to_page, "req_to_page", 2)
        idx = _as_int_array(req_pool_indices, "req_pool_indices", 1)
        if idx.shape[0] != bs:
            raise ValueError(f"req_pool_indices has {idx.shape[0]} entries but seq_lens has {bs}")
        bad = (idx < 0) | (idx >= r2p.shape[0])
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"req_pool_indices[{i}]={idx[i]} out of range [0, {r2p.shape[0]}) of req_to_page")
        pt = r2p[idx]
        name, rows = "req_to_page", idx
    if pt.shape[0] != bs:
        raise ValueError(f"page_table has {pt.shape[0]} rows but seq_lens has {bs} requests")
    return pt, name, rows


def _check_pages(
    pt: np.ndarray,
    seq_lens: np.ndarray,
    page_size: int,
    num_pages: int | None,
    lens_name="seq_lens",
    *,
    table_name="page_table",
    rows=None,
):
    """Refuses a table that cannot hold the lengths, or whose used entries are not page ids
    of the pool or are the dummy page. Errors name entry ``[b, i]`` as
    ``table_name[rows[b], i]`` (``rows`` None: ``[b, i]``), the caller's own array."""
    from jattn.metadata import DUMMY_PAGE

    def entry(b, i):
        return f"{table_name}[{b if rows is None else int(rows[b])}, {i}]"

    _check_i32(seq_lens, lens_name, "a length")
    need = -(-seq_lens // page_size)
    if need.size and need.max() > pt.shape[1]:
        b = int(np.argmax(need))
        raise ValueError(
            f"{lens_name}[{b}]={seq_lens[b]} needs {need[b]} pages of page_size={page_size} but "
            f"{table_name} has only {pt.shape[1]} columns"
        )
    used = np.arange(pt.shape[1])[None, :] < need[:, None]
    ids = np.where(used, pt, 1)
    hi = np.iinfo(np.int32).max if num_pages is None else num_pages
    bad = first_page_outside(pt, seq_lens, page_size, hi)
    if bad is not None:
        b, i = bad
        if num_pages is None:
            raise ValueError(f"{entry(b, i)}={pt[b, i]} is not a page id (negative or past int32)")
        raise ValueError(f"{entry(b, i)}={pt[b, i]} out of range [0, {num_pages}) (num_pages of the pool)")
    dummy = used & (ids == DUMMY_PAGE)
    if dummy.any():
        b, i = map(int, np.argwhere(dummy)[0])
        raise ValueError(
            f"{entry(b, i)} is the reserved dummy page {DUMMY_PAGE} (padded rows write there), but "
            f"{lens_name}[{b}]={seq_lens[b]} uses {need[b]} pages of page_size={page_size}"
        )


def _check_num_pages(num_pages) -> int | None:
    if num_pages is None:
        return None
    return _positive_int(num_pages, "num_pages", "a positive int (the pool's page count) or None")


def _check_unique_slots(loc: np.ndarray, page_size: int, tokens=lambda i, j: f"new tokens {i} and {j}") -> None:
    """Refuses a plan in which two real tokens write one KV slot (one would silently
    overwrite the other's K/V). Pages shared read-only (a radix cache's prefix) are fine.
    ``tokens(i, j)`` names the two entries of ``loc`` that clash (``i < j``)."""
    if loc.size < 2:
        return
    order = np.argsort(loc, kind="stable")
    dup = np.flatnonzero(loc[order][1:] == loc[order][:-1])
    if dup.size:
        i, j = sorted((int(order[dup[0]]), int(order[dup[0] + 1])))
        slot = int(loc[i])
        raise ValueError(
            f"out_cache_loc: {tokens(i, j)} would both write slot {slot} (page {slot // page_size}, "
            f"offset {slot % page_size}); requests may share pages only read-only (their prefix), never a "
            "page they write"
        )


def _ranges(counts: np.ndarray) -> np.ndarray:
    """``[0..counts[0]), [0..counts[1]), ...`` concatenated."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _new_tokens(lens: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(row, position)`` of each new token: the last ``new[b]`` of row ``b``'s ``lens[b]``."""
    rows = np.repeat(np.arange(lens.shape[0]), new)
    return rows, lens[rows] - new[rows] + _ranges(new)


def _check_writes(table: np.ndarray, lens: np.ndarray, new: np.ndarray, page_size: int, real: np.ndarray) -> None:
    """Refuses a plan in which a real request's new token writes a slot that another
    real request holds (its tokens ``[0, lens)`` through its row of ``table``, its own
    new tokens, the last ``new``, included), or that the same request holds as another
    of its tokens (a row that repeats a page). Pages shared read-only (a radix cache's
    prefix) are fine; a write into one would change the other request's K/V silently.
    Two new tokens of one request on one slot are :func:`_check_unique_slots`' to find.
    Cost: the real requests' pages plus their new tokens."""
    rows = np.flatnonzero(real)
    ps = page_size
    wr, wt = _new_tokens(lens, np.where(real, new, 0))  # one entry per new token
    wp, wo = table[wr, wt // ps], wt % ps
    if wp.size == 0:
        return
    # the (request, column) entries that hold a written page: a mask over page ids keeps
    # this to one gather over the held entries (a sort of them cost about 100 ms a step
    # at 256 requests of 32k tokens)
    held_cols = np.arange(table.shape[1])[None, :] < (-(-lens[rows] // ps))[:, None]
    sub = table[rows]
    mark = np.zeros(int(max(sub.max(), wp.max())) + 1, bool)
    mark[wp] = True
    ri, rc = np.nonzero(held_cols & mark[sub])
    rr = rows[ri]
    held = np.minimum(ps, lens[rr] - rc * ps)  # its tokens in that page
    rp = table[rr, rc]
    order = np.argsort(rp, kind="stable")
    lo, hi = np.searchsorted(rp[order], wp, "left"), np.searchsorted(rp[order], wp, "right")
    cnt = hi - lo
    w = np.repeat(np.arange(wp.size), cnt)
    r = order[np.repeat(lo, cnt) + _ranges(cnt)]
    other_slot = (rr[r] != wr[w]) | (rc[r] != wt[w] // ps)  # another request, or the same one's other column
    bad = np.flatnonzero(other_slot & (wo[w] < held[r]))
    if bad.size:
        w, r = int(w[bad[0]]), int(r[bad[0]])
        if rr[r] == wr[w]:
            raise ValueError(
                f"page_table: request {int(wr[w])}'s row holds page {int(wp[w])} at columns {int(rc[r])} and "
                f"{int(wt[w]) // ps}; its new token at position {int(wt[w])} would overwrite its own token "
                f"{int(rc[r]) * ps + int(wo[w])} (a request's pages must be distinct)"
            )
        raise ValueError(
            f"out_cache_loc: request {int(wr[w])}'s new token at position {int(wt[w])} writes page {int(wp[w])}, "
            f"offset {int(wo[w])}, which request {int(rr[r])} holds as its token {int(rc[r]) * ps + int(wo[w])}; "
            "requests may share pages only read-only (their prefix), never a page they write"
        )


def _check_host_lengths(table: np.ndarray, lens: np.ndarray, num_reqs: int, page_size: int, q_len: int) -> None:
    """Host lengths for a plan's first ``num_reqs`` rows of ``table`` (``with_seq_lens``):
    a length reaching a column the planner filled with the dummy page is refused (padded
    rows write there), and so are writes that :func:`_check_unique_slots` and
    :func:`_check_writes` refuse in a new plan."""
    from jattn.metadata import DUMMY_PAGE

    c = lens[:num_reqs].astype(np.int64)
    need = -(-c // page_size)
    bad = (np.arange(table.shape[1])[None, :] < need[:, None]) & (table[:num_reqs] == DUMMY_PAGE)
    if bad.any():
        b, i = (int(x[0]) for x in np.nonzero(bad))
        raise ValueError(
            f"seq_lens[{b}]={int(c[b])} reaches page_table[{b}, {i}], the reserved dummy page "
            f"{DUMMY_PAGE}: plan with the longest length the plan will take (its pages), then shorten it"
        )
    real = c > 0
    new = np.where(real, np.minimum(q_len, c), 0)
    rows, pos = _new_tokens(c, new)
    slots = table[rows, pos // page_size] * page_size + pos % page_size
    _check_unique_slots(slots, page_size, tokens=lambda i, j: f"new tokens of requests {rows[i]} and {rows[j]}")
    _check_writes(table[:num_reqs], c, new, page_size, real)


def extend_prefix(sl: np.ndarray, ext: np.ndarray, extend_prefix_lens=None) -> np.ndarray:
    """Each request's cached prefix ``seq_lens - extend_seq_lens`` (int64 arrays), checked:
    equal counts, no negative length, and ``extend_prefix_lens`` (if given) equal to it."""
    bs = sl.shape[0]
    if ext.shape[0] != bs:
        raise ValueError(f"extend_seq_lens has {ext.shape[0]} entries but seq_lens has {bs}")
    for name, a in (("extend_seq_lens", ext), ("seq_lens", sl)):
        _check_nonnegative(a, name)
    prefix = sl - ext
    if (prefix < 0).any():
        b = int(np.argmax(prefix < 0))
        raise ValueError(f"extend_seq_lens[{b}]={ext[b]} exceeds seq_lens[{b}]={sl[b]}")
    if extend_prefix_lens is not None:
        given = _as_int_array(extend_prefix_lens, "extend_prefix_lens", 1)
        if given.shape != prefix.shape:
            raise ValueError(f"extend_prefix_lens has {given.shape[0]} entries but seq_lens has {bs}")
        if (given != prefix).any():
            b = int(np.argmax(given != prefix))
            raise ValueError(
                f"lengths inconsistent: extend_prefix_lens[{b}]={given[b]} + extend_seq_lens[{b}]={ext[b]} "
                f"!= seq_lens[{b}]={sl[b]}"
            )
    return prefix
