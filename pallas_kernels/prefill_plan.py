"""Host-side arrays of the ragged prefill / paged extend kernel (``mosaic_prefill.py``).

Plain XLA around the kernel, jitted with it:

* :func:`tile_plan`: the 128-row query tiles of every request in launch order,
  longest work first;
* :func:`section_items`: the same tiles request by request, and the launch order of
  the (tile, query head) items in sections of KV heads whose K/V fit in L2;
* :func:`merge_sides`: the output chunks that straddle a request's edge put in
  their rows of the ragged output;
* :func:`v_may_be_nonfinite`: the per-call check that turns the kernel's edge
  cleaning on;
* :func:`segment_ids`, :func:`pad_rows`: helpers.
"""

from __future__ import annotations

import jax.numpy as jnp

TILE_Q = 128  # query rows per tile (the kernel's two consumer warpgroups of 64)

__all__ = ["TILE_Q", "segment_ids", "tile_plan", "section_items", "merge_sides", "v_may_be_nonfinite", "pad_rows"]


def segment_ids(ends, n: int):
    """i32[n]: for each index i, how many of ``ends`` are <= i (the segment of i when
    ``ends`` are the segments' sorted end offsets). A scatter-add and a prefix sum: no
    search loop, which XLA runs step by step on the GPU."""
    marks = jnp.zeros((n,), jnp.int32).at[ends].add(1, mode="drop")
    return jnp.cumsum(marks).astype(jnp.int32)


def tile_plan(cu_q, kv_len, num_tiles: int, *, is_causal: bool, window_left: int, with_work: bool = False):
    """Tiles of every request in launch order, longest work first: ``tile_req`` (-1:
    no tile) and ``tile_loc`` (which tile of its request), i32[num_tiles]; with
    ``with_work`` also each tile's work, the keys it sees plus one (0: no tile).

    Tile ``j`` of a request covers the rows ``8 * (cu_q[b] // 8) + 128 * j + [0, 128)``
    (8-row aligned, see the kernel)."""
    n_q = cu_q[1:] - cu_q[:-1]
    dq = cu_q[:-1] % 8
    tiles = jnp.where(n_q > 0, (n_q + dq + TILE_Q - 1) // TILE_Q, 0)
    cum = jnp.cumsum(tiles)
    base = cum - tiles
    ids = jnp.arange(num_tiles, dtype=jnp.int32)
    req = segment_ids(cum[:-1], num_tiles)
    valid = ids < cum[-1]
    loc = ids - base[req]
    q0 = loc * TILE_Q - dq[req]
    off = kv_len[req] - n_q[req]
    hi = jnp.minimum(off + jnp.minimum(q0 + TILE_Q, n_q[req]), kv_len[req]) if is_causal else kv_len[req]
    lo = jnp.clip(off + q0 - window_left, 0, None) if window_left >= 0 else 0
    work = jnp.where(valid, jnp.maximum(hi - lo, 0) + 1, -1)  # +1: a tile of no keys still writes
    order = jnp.argsort(-work, stable=True).astype(jnp.int32)
    tile_req = jnp.where(valid, req, -1)[order]
    if with_work:
        return tile_req, loc[order].astype(jnp.int32), jnp.maximum(work, 0)[order]
    return tile_req, loc[order].astype(jnp.int32)


def section_items(
    tile_req,
    tile_loc,
    kv_len,
    *,
    num_q_heads: int,
    group: int,
    key_bytes: int,
    budget: int,
    ctas: int = 0,
    work=None,
):
    """An L2-aware launch order of the (tile, query head) items.

    The default order (tiles longest first across requests, heads fastest) puts the
    longest tiles of every request and head in flight at once; where each query head
    has its own KV head, no two of them read the same K/V. Here the tiles are regrouped
    request by request (requests in the order of their longest tile, each request's
    tiles still longest first), and each request's items are laid out in sections of
    ``hs`` KV heads: section by section, then tile by tile, the section's query heads
    fastest. ``hs`` is the most KV heads whose keys (``kv_len[b] * key_bytes`` bytes a
    head) fit in ``budget`` bytes, at least one. The CTAs in flight then share a few
    KV streams, read from L2 by the tiles that run together. With ``ctas`` (the
    persistent launch's CTA count) each section is folded for that walk
    (:func:`_fold_for_walk`), so that the CTAs' work stays even; given ``work`` (each
    tile's, as :func:`tile_plan` returns it), only where the walk's most loaded CTA
    then has no more work than without the fold (a tile counted as its keys plus one
    block of fixed cost). Where the call's K/V (every request's keys of every KV
    head) fit in ``budget``, the default order is returned as it is (``item`` the
    identity): L2 holds it all whatever the order.

    Returns ``(tile_req, tile_loc, item)``: the regrouped tile arrays, and
    ``item[p] = t * num_q_heads + h``, the item (tile ``t`` of the regrouped list,
    query head ``h``) run at launch position ``p``. Tiles without a request
    (``tile_req = -1``) stay last in the tile list, their items after every live one."""
    i32 = jnp.int32
    nt = tile_req.shape[0]
    bs = kv_len.shape[0]
    hq, hkv = num_q_heads, num_q_heads // group
    ids = jnp.arange(nt, dtype=i32)
    tile_req0, tile_loc0 = tile_req, tile_loc
    live = tile_req >= 0
    req = jnp.where(live, tile_req, bs)  # bs: no request
    first = jnp.full((bs + 1,), nt, i32).at[req].min(ids)  # each request's longest tile (no request: last)
    order = jnp.argsort(first[req], stable=True).astype(i32)
    req, tile_req, tile_loc, live = req[order], tile_req[order], tile_loc[order], live[order]
    start = jnp.full((bs + 1,), nt, i32).at[req].min(ids)[req]  # first tile of the request
    count = jnp.zeros((bs + 1,), i32).at[req].add(1)[req]  # its tiles
    j = ids - start  # which of them
    keys = jnp.concatenate([kv_len.astype(i32), jnp.zeros((1,), i32)])[req]
    per_head = jnp.clip(keys, 1, (1 << 30) // key_bytes) * key_bytes  # no int32 overflow
    hs = jnp.clip(min(budget, 1 << 30) // per_head, 1, hkv)  # KV heads a section: [nt]
    h = jnp.arange(hq, dtype=i32)
    sec = (h // group)[None, :] // hs[:, None]  # [nt, hq]
    s0 = sec * hs[:, None] * group  # the section's first query head
    size = (jnp.minimum((sec + 1) * hs[:, None], hkv) - sec * hs[:, None]) * group
    # the tiles of no request are one more request without keys, one section of all
    # heads: their items keep their positions
    pos = start[:, None] * hq + s0 * count[:, None] + j[:, None] * size + (h[None, :] - s0)
    if ctas:
        n_live = jnp.sum(live.astype(i32)) * hq  # the live items hold positions [0, n_live)
        folded = _fold_for_walk(pos, start[:, None] * hq + s0 * count[:, None], count[:, None] * size, n_live, ctas)
        folded = jnp.where(live[:, None], folded, pos)
        if work is not None:
            cost = jnp.where(live, work[order] + TILE_Q, 0)[:, None] + jnp.zeros((1, hq), i32)
            better = _walk_max(folded, cost, ctas) <= _walk_max(pos, cost, ctas)
            folded = jnp.where(better, folded, pos)
        pos = folded
    flat = ids[:, None] * hq + h[None, :]
    item = jnp.zeros((nt * hq,), i32).at[pos.reshape(-1)].set(flat.reshape(-1))
    # A call whose K/V all fit in one section's budget reads it from L2 in any order:
    # the default order then, which balances the CTAs best.
    total = jnp.sum(jnp.maximum(kv_len, 0).astype(jnp.float32)) * (hkv * key_bytes)
    fits = total <= budget
    tile_req = jnp.where(fits, tile_req0, tile_req)
    tile_loc = jnp.where(fits, tile_loc0, tile_loc)
    return tile_req, tile_loc, jnp.where(fits, jnp.arange(nt * hq, dtype=i32), item)


def _walk_max(pos, cost, ctas: int):
    """The most work any CTA gets in the persistent walk of ``ctas`` CTAs (round ``r``
    gives CTA ``c`` launch position ``r * ctas + c`` in even rounds and ``r * ctas +
    ctas - 1 - c`` in odd ones) when the item of cost ``cost`` runs at position ``pos``."""
    r, c = pos // ctas, pos % ctas
    cta = jnp.where(r % 2 == 0, c, ctas - 1 - c)
    return jnp.zeros((ctas,), cost.dtype).at[cta.reshape(-1)].add(cost.reshape(-1)).max()


def _fold_for_walk(pos, first, size, n_live, ctas: int):
    """The positions ``pos`` of a section order (live items, positions ``[0, n_live)``)
    laid out for the persistent walk of ``ctas`` CTAs, which gives CTA ``c`` positions
    ``2kC + c`` and ``2kC + 2C - 1 - c`` in rounds ``2k`` and ``2k + 1``. Each section
    (``first``: its first position, ``size``: its items; longest tile first) is folded
    so that its k-th longest and k-th shortest items are neighbours, and each pair of
    neighbours goes to the two positions of one CTA. The tiles of a request grow by the
    same step, so each CTA's two items of a round pair add up to about the same work, as
    the default order's longest-first walk gives; without the fold a section that ends
    mid-round puts its longest tiles on the CTAs that already took the last section's
    longest. In the last, partial round pair (``rem`` positions) the CTAs that take two
    positions take a pair and the others one item each. Items stay within the round
    pairs of their section order, so the CTAs in flight still share KV streams."""
    k = pos - first
    v = first + jnp.where(k < (size + 1) // 2, 2 * k, 2 * (size - 1 - k) + 1)
    block = v // (2 * ctas)
    u = v - block * 2 * ctas  # place in the round pair
    rem = jnp.clip(n_live - block * 2 * ctas, 0, 2 * ctas)  # its live positions
    pairs = jnp.maximum(rem - ctas, 0)  # CTAs with two of them: lanes 2C - rem ...
    lane = 2 * ctas - rem + u // 2
    paired = jnp.where(u % 2 == 0, lane, rem - 1 - u // 2)
    return block * 2 * ctas + jnp.where(u < 2 * pairs, paired, u - 2 * pairs)


def merge_sides(o, lse, o_side, lse_side, cu_q):
    """The ragged output with the straddling chunks of ``o_side`` / ``lse_side`` put
    in their rows: slot ``2b`` holds request ``b``'s first chunk (rows ``-dq .. 63 -
    dq`` of the request, when ``dq = cu_q[b] % 8 > 0``), slot ``2b + 1`` its last
    chunk when that one straddles the request's end. ``lse`` comes in ``[Hq, Tq]``
    and leaves ``[Tq, Hq]``."""
    tq = o.shape[0]
    n_q = cu_q[1:] - cu_q[:-1]
    dq = cu_q[:-1] % 8
    j = jnp.arange(64, dtype=jnp.int32)
    first_r = -dq  # request row of the first chunk's row 0
    last_r = first_r + 64 * ((n_q - 1 + dq) // 64)  # ... and of the last chunk's
    first_ok = dq > 0
    last_ok = (last_r >= 0) & (last_r + 64 > n_q)
    r = jnp.stack([first_r, last_r], 1)[:, :, None] + j  # [bs, 2, 64] request rows
    ok = jnp.stack([first_ok, last_ok], 1)[:, :, None] & (r >= 0) & (r < n_q[:, None, None]) & (n_q > 0)[:, None, None]
    target = jnp.where(ok, cu_q[:-1, None, None] + r, tq).reshape(-1)  # out of range: dropped
    o = o.at[target].set(o_side.reshape((-1,) + o_side.shape[2:]), mode="drop")
    lse = lse.at[:, target].set(jnp.moveaxis(lse_side, 1, 0).reshape(lse.shape[0], -1), mode="drop")
    return o, lse.T


def v_may_be_nonfinite(v, cu_q, kv_start, kv_len, page_table, page_size: int, window_left: int, num_q: int):
    """bool[]: whether a V row that some query could see masked holds a non-finite
    value, so the kernel must clean its edge blocks. Prefill: any of the requests' V
    rows (one pass over V). Extend: the new tokens' V rows in the cache (the causal
    diagonal holds only those); with a sliding window the window's first keys may
    lie in the prefix, so always. Arrays as passed to the kernel (with the padding
    request last)."""
    if page_size == 0:
        end = jnp.max(kv_start + kv_len)
        real = jnp.arange(v.shape[0], dtype=jnp.int32) < end
        return jnp.any(real[:, None, None] & ~jnp.isfinite(v))
    if window_left >= 0:
        return jnp.bool_(True)
    x = jnp.arange(num_q, dtype=jnp.int32)
    r = jnp.clip(segment_ids(cu_q[1:-1], num_q), 0, kv_len.shape[0] - 1)  # request of each row
    pos = kv_len[r] - (cu_q[r + 1] - cu_q[r]) + x - cu_q[r]  # its key position
    real = (x < cu_q[-1]) & (pos >= 0)
    pos = jnp.maximum(pos, 0)
    page = jnp.clip(page_table[r, jnp.minimum(pos // page_size, page_table.shape[1] - 1)], 0, v.shape[0] - 1)
    rows = v[page, pos % page_size]  # [num_q, Hkv, Dv]
    return jnp.any(real[:, None, None] & ~jnp.isfinite(rows))


def pad_rows(x, rows: int):
    return jnp.pad(x, [(0, rows)] + [(0, 0)] * (x.ndim - 1))


def no_pages_no_keys(page_table, lens):
    """``(page_table, lens)`` of an extend, where a page table with no columns becomes one
    column of page 0 with every length 0: such a table holds no keys (a length past what
    a table holds is out of range, which the ops check where the lengths are concrete),
    and the kernels' page lookups need a column to index."""
    if page_table.shape[1]:
        return page_table, lens
    return jnp.zeros((page_table.shape[0], 1), jnp.int32), jnp.zeros_like(lens)


def with_padding_request(cu_q, kv_start, kv_len, page_table, num_tokens: int):
    """The arrays with one more request appended: the rows past ``cu_q[-1]`` (padding, up
    to ``num_tokens``) as a request without keys, so a kernel writes every output row
    (0, LSE -inf). All four come back int32."""
    i32 = jnp.int32
    return (
        jnp.concatenate([cu_q.astype(i32), jnp.full((1,), num_tokens, i32)]),
        jnp.concatenate([kv_start.astype(i32), jnp.zeros((1,), i32)]),
        jnp.concatenate([kv_len.astype(i32), jnp.zeros((1,), i32)]),
        jnp.concatenate([page_table.astype(i32), jnp.zeros((1, page_table.shape[1]), i32)]),
    )
