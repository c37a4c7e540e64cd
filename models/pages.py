"""The serving engine's page accounting: one :class:`PagePool` per KV pool (one per
device of a data-parallel mesh, else one), the choice of device for a request, and the
cascade grouping of parallel samples that share prompt pages.

A pool hands out page ids ``1 .. num_pages - 1`` (page 0 is the dummy that padded rows
write to) and counts each page's holders: more than one only for a parallel sample's
shared prompt pages, which go back to the free list when their last holder ends.
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from jattn.kv_cache import PageAllocator
from jattn.metadata import bucket
from jattn.models.requests import REQUEST_STATES

__all__ = ["PagePool", "cascade_grouping", "check_invariants", "page_table", "place", "short_of_pages"]


class PagePool:
    """A free list of one pool's pages and the holder count of every page in use."""

    def __init__(self, num_pages: int):
        self.allocator = PageAllocator(num_pages)
        self.refs: dict[int, int] = {}  # page -> requests holding it

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh pages, one holder each (raises ``PagePoolExhausted`` past the free list)."""
        pages = self.allocator.alloc(n)
        for p in pages:
            self.refs[p] = 1
        return pages

    def hold(self, pages: Sequence[int]) -> None:
        """One more holder of each page (all in use; checked before any count changes)."""
        idle = [p for p in pages if p not in self.refs]
        if idle:
            raise ValueError(f"hold: page {idle[0]} is not in use")
        for p in pages:
            self.refs[p] += 1

    def unref(self, pages: Sequence[int]) -> None:
        """Drops one holder of each page (a page listed k times drops k); pages nobody holds
        go back to the free list. A page with fewer holders than it is listed raises before
        any count changes, so the pool stays whole."""
        drops = collections.Counter(pages)
        over = [p for p, k in drops.items() if self.refs.get(p, 0) < k]
        if over:
            p = over[0]
            raise ValueError(f"unref: page {p} is dropped {drops[p]} times but has {self.refs.get(p, 0)} holders")
        free = []
        for p, k in drops.items():
            self.refs[p] -= k
            if self.refs[p] == 0:
                del self.refs[p]
                free.append(p)
        self.allocator.free(free)

    def check(self, held: dict[int, int], name: str = "the pool") -> None:
        """Raises ``RuntimeError`` unless ``held`` (page -> holders, counted from the
        requests) equals the counts here and every page is free or held."""
        if held != self.refs:
            raise RuntimeError(f"page holders of {name} differ from the engine's counts")
        if self.num_free + len(held) != self.num_pages - 1:
            raise RuntimeError(
                f"pages leaked in {name}: {self.num_free} free + {len(held)} held != {self.num_pages - 1}"
            )


def place(pools: Sequence[PagePool], held: Sequence[int], room: Sequence[bool]) -> int | None:
    """The device for a new request: among those with ``room`` (batch and token budget
    left), the one with the most free pages, then the fewest requests ``held``, then the
    lowest index; None when none has room."""
    best = None
    for d, (pool, ok) in enumerate(zip(pools, room)):
        if ok and (best is None or (pool.num_free, -held[d]) > (pools[best].num_free, -held[best])):
            best = d
    return best


def page_table(reqs, max_pages: int) -> np.ndarray:
    """i32[len(reqs), max_pages]: each request's pages, zero-padded."""
    pt = np.zeros((len(reqs), max_pages), np.int32)
    for i, r in enumerate(reqs):
        pt[i, : len(r.pages)] = r.pages
    return pt


def short_of_pages(pools: Sequence[PagePool], rows, page_size: int) -> bool:
    """Whether some pool lacks the pages that decode ``rows`` (requests on the devices of
    ``pools``) need to feed one more token each."""
    need = [0] * len(pools)
    for r in rows:
        need[r.device] += max(-(-(r.seq_len + 1) // page_size) - len(r.pages), 0)
    return any(n > pool.num_free for n, pool in zip(need, pools))


def cascade_grouping(reqs, page_size: int, batch_buckets, *, always: bool | None = None):
    """``(reqs reordered, group_size, prefix_pages)`` for a cascade decode of ``reqs``
    (engine requests: ``rid``, ``parent``, ``pages``, ``seq_len``), or None: the parallel
    samples of one prompt that run together (the largest such set sets ``group_size``)
    form a group sharing their common leading pages; the other requests follow,
    ``group_size`` to a group sharing nothing. With ``always=None`` a grouping is made only
    when the shared pages are at least a quarter of the batch's KV reads; ``always=True``
    whenever one exists; ``always=False`` never (None)."""
    if always is False:
        return None
    roots: dict[int, list] = {}
    for r in reqs:
        roots.setdefault(r.rid if r.parent is None else r.parent, []).append(r)
    g = max(len(m) for m in roots.values())
    if g < 2:
        return None
    groups, loose = [], []
    for members in roots.values():
        first = members[0].pages
        n = min(next((i for i, (a, b) in enumerate(zip(first, m.pages)) if a != b), len(m.pages)) for m in members)
        n = min(n, min(m.seq_len // page_size for m in members))  # the new token stays outside
        if len(members) == g and n > 0:
            groups.append((members, n))
        else:
            loose.extend(members)
    if not groups or bucket(len(reqs), batch_buckets) % g:
        return None
    saved = sum((g - 1) * n * page_size for _, n in groups)
    if always is None and 4 * saved < sum(r.seq_len + 1 for r in reqs):
        return None
    order = [m for members, _ in groups for m in members] + loose
    return order, g, [n for _, n in groups] + [0] * (-(-len(loose) // g))


def check_invariants(
    pools: list[PagePool], requests: list, queues: dict, page_size: int, prefix_holds: dict | None = None
) -> None:
    """Raises ``RuntimeError`` unless every page of each pool is either free or held by
    live requests (and ``prefix_holds``: finished sample 0's rid -> ``(device, pages, ...)``
    kept for its waiting samples) as its holder count says (several only for a shared
    prompt prefix of parallel samples), and every request is in exactly one state and in the queue of
    ``queues`` (name -> list) that its state names, holding pages only while prefilling
    or running, enough for the tokens it caches."""
    for d, pool in enumerate(pools):
        mine = [r for r in requests if r.device == d]
        holds = {rid: h[1] for rid, h in (prefix_holds or {}).items() if h[0] == d}
        held: dict[int, int] = {}
        for pages in [r.pages for r in mine] + list(holds.values()):
            for p in pages:
                held[p] = held.get(p, 0) + 1
        pool.check(held, f"device {d}'s pool" if len(pools) > 1 else "the pool")
        for p, n in held.items():
            if n > 1:
                roots = {r.rid if r.parent is None else r.parent for r in mine if p in r.pages}
                roots |= {rid for rid, pages in holds.items() if p in pages}
                if len(roots) != 1:
                    raise RuntimeError(f"page {p} is held by requests of different prompts")
    for r in requests:
        if r.status not in REQUEST_STATES:
            raise RuntimeError(f"request {r.rid} has unknown status {r.status!r}")
        where = [name for name, q in queues.items() if any(x is r for x in q)]
        want = [] if r.done else [r.status]
        if where != want:
            raise RuntimeError(f"request {r.rid} ({r.status}) is in queues {where}")
        if r.pages and r.status not in ("prefilling", "running"):
            raise RuntimeError(f"request {r.rid} ({r.status}) holds pages")
        if r.status in ("prefilling", "running") and len(r.pages) < -(-r.seq_len // page_size):
            raise RuntimeError(f"request {r.rid} caches {r.seq_len} tokens in {len(r.pages)} pages")
