"""The engine's scheduling decisions: which prompt chunks the next extend step takes (each
device's token budget and batch limit, admission by free pages), and the pages each decode
row needs now (preemption when a pool runs out). A mixin of
:class:`jattn.models.engine.Engine`, whose queues, pools and config it reads."""

from __future__ import annotations

from jattn.models.pages import place, short_of_pages
from jattn.models.requests import Request


class _Scheduling:
    """Scheduling methods of :class:`jattn.models.engine.Engine` (see its docstring)."""

    def _held(self) -> list[int]:
        """Requests holding pages, per device."""
        n = [0] * self.dp
        for r in self.running + self.prefilling:
            n[r.device] += 1
        return n

    def _schedule_extend(self) -> list[tuple[Request, int]]:
        """(request, new tokens) pairs of the next extend step, or [] for none. Each
        device has its own token budget and batch limit; a new request goes to the device
        with room and the most free pages (a parallel sample to its parent's)."""
        c = self.config
        budget, count, batch = [c.token_budget] * self.dp, [0] * self.dp, []
        for r in self.prefilling:
            d = r.device
            if count[d] >= c.max_batch or budget[d] <= 0:
                continue
            n = min(r.num_tokens - r.seq_len, budget[d])
            batch.append((r, n))
            budget[d] -= n
            count[d] += 1
        held = self._held()  # kept current below as requests are admitted
        while self.waiting:
            room = [count[d] < c.max_batch and budget[d] > 0 and held[d] < c.max_batch for d in range(self.dp)]
            r = self.waiting[0]
            share = self._shared_prefix(r)
            if share is None:  # a sample whose parent is still prefilling: it and those behind it wait
                break
            shared, cached, parent_device = share
            d = parent_device if shared else place(self.pools, held, room)
            if d is None or not room[d]:
                break
            pool = self.pools[d]
            need = self._pages_for(r.num_tokens) - len(shared)
            if need > pool.num_free:
                if not held[d] and self._drop_prefix_holds(device=d):
                    continue  # a finished parent's held prefix was all that blocked it
                if not held[d]:  # nothing will free pages there
                    self._fail(
                        r,
                        f"page pool exhausted: {r.num_tokens} tokens need {need} pages, "
                        f"the pool has {pool.num_pages - 1}",
                    )
                    continue
                break  # wait for running requests to free pages
            pool.hold(shared)
            r.pages, r.device = list(shared) + pool.alloc(need), d
            r.seq_len = cached
            self.metrics.shared_tokens += cached
            self.waiting.pop(0)
            r.status = "prefilling"
            self.prefilling.append(r)
            n = min(r.num_tokens - cached, budget[d])
            batch.append((r, n))
            budget[d] -= n
            count[d] += 1
            held[d] += 1
        if self._prefix_holds:
            self._drop_prefix_holds()  # those whose last waiting sample was just admitted
        return batch

    def _grow_for_decode(self) -> list[Request]:
        """Gives every running request the page for the token it feeds now, preempting
        the most recently admitted running requests when the pool is empty; returns the
        preempted requests."""
        preempted, i = [], 0
        while i < len(self.running):
            r = self.running[i]
            if self._sits_out(r):  # no decode row now (see _sits_out)
                i += 1
                continue
            pool = self.pools[r.device]
            need = self._pages_for(r.seq_len + 1) - len(r.pages)
            if need <= pool.num_free:
                r.pages += pool.alloc(max(need, 0))
                i += 1
                continue
            if self._prefix_holds and self._drop_prefix_holds(device=r.device):
                continue  # pages held for waiting samples give way to a running request
            same = [x for x in self.running if x.device == r.device]  # only when the pool ran out
            if len(same) == 1:
                # (With overlap, a pool this short made step() read the step in flight back
                # first: the request's last token is accepted, as in the plain loop.)
                self._fail_exhausted(r)  # leaves self.running: i is the next request
            else:
                victim = same[-1]  # the most recently admitted on that device
                self._preempt(victim)
                preempted.append(victim.rid)
        return preempted

    def _short_of_pages(self) -> bool:
        """Whether some device's pool lacks the pages its decode rows need now."""
        rows = [r for r in self.running if not self._sits_out(r)]
        return short_of_pages(self.pools, rows, self.page_size)

    def _fail_exhausted(self, r: Request):
        need = self._pages_for(r.seq_len + 1)
        self._fail(
            r,
            f"page pool exhausted: {r.seq_len + 1} tokens need {need} pages, the pool has "
            f"{self.pools[r.device].num_pages - 1} (while decoding token {len(r.output_tokens) + 1})",
        )
