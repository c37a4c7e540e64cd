"""Host-side checks and conversions of the planners' inputs (:mod:`jattn.metadata`):
integer arrays, page tables given directly or through a request-to-page pool, the pool's
page count, positive sizes, the int32 range of the device arrays, and KV slots that two
new tokens would both write. Each error names the argument and the rule it broke."""

from __future__ import annotations

import numpy as np

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


def _as_int_array(x, name: str, ndim: int) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64)


def _resolve_page_table(page_table, req_to_page, req_pool_indices, bs: int) -> np.ndarray:
    if page_table is not None:
        if req_to_page is not None or req_pool_indices is not None:
            raise ValueError("pass either page_table or (req_to_page, req_pool_indices), not both")
        pt = _as_int_array(page_table, "page_table", 2)
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
    if pt.shape[0] != bs:
        raise ValueError(f"page_table has {pt.shape[0]} rows but seq_lens has {bs} requests")
    return pt


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
