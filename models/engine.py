"""A continuous-batching serving engine on jattn: host-side scheduler, one jitted step.

Requests arrive (``add_request``) and finish at different times. Each ``step()`` is either

* an **extend** (prefill) batch: prompt chunks of prefilling and newly admitted requests
  (ragged tokens, each over its own cached prefix), or
* a **decode** batch of every running request (one token each),

planned on the host (``plan_extend`` / ``plan_decode``: padded to batch / token buckets,
fixed page-table width) and run by ONE jitted function with the KV cache donated. The
programs are keyed by the metadata's static fields, so after one call per bucket the loop
never recompiles (``metrics.compilations`` counts traces). Pages come from a page pool
(``models/pages.py``; one per device when an MLA model is served data-parallel) and are
freed when a request ends.

Sampling is greedy (``temperature=0``) or temperature with top-k, top-p and min-p and a
per-request seed
(the key for the n-th token is ``fold_in(key(seed), n)``, so results do not depend on
what else is in the batch). Scheduling (chunked prefill, admission within the buckets,
preemption when the page pool runs out) is described on :class:`Engine`. A bad request
finishes with ``status="error"`` and a message; the others go on. With
``EngineConfig(overlap=True)`` each step is launched before the previous one's tokens are
read back, so the host's planning overlaps the device's work (same tokens); it is the
default (``overlap=False`` reads each step back first; so does a step short of pages).
On a GPU the engine fuses the model's q/k/v and gate/up projections in place
(``EngineConfig.fuse_projections``; same outputs up to rounding).

Example::

    from flax import nnx
    from jattn.models.config import LlamaConfig
    from jattn.models.engine import Engine, EngineConfig, SamplingParams
    from jattn.models.llama import Llama

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    engine = Engine(model, EngineConfig(page_size=16, num_pages=256, max_context=512))
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=8))
    engine.run()
    engine.requests[rid].output_tokens
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn.metadata import plan_decode, plan_extend
from jattn.models.pages import PagePool, cascade_grouping, check_invariants, page_table
from jattn.models.requests import (
    REQUEST_STATES,
    EngineConfig,
    EngineMetrics,
    Request,
    StepInfo,
    _validated_prompt,
)
from jattn.models.sampling import SamplingParams, sample_tokens, sampling_arrays, wrap_seed
from jattn.models.schedule import _Scheduling
from jattn.models.setup import check_context, new_kv_cache, serving_model
from jattn.models.step import (
    ENGINE_COMMAND_BUFFERS,
    InFlight,
    command_buffer_options,
    feed_tokens,
    make_step_fn,
    plan_devices,
    shared_step_fn,
    state_leaves,
)

# Re-exported: the sampler, the step and the engine's data types lived here first.
__all__ = [
    "Engine",
    "EngineConfig",
    "EngineMetrics",
    "REQUEST_STATES",
    "Request",
    "SamplingParams",
    "StepInfo",
    "ENGINE_COMMAND_BUFFERS",
    "command_buffer_options",
    "make_step_fn",
    "sample_tokens",
    "shared_step_fn",
    "state_leaves",
]


def _like(old, new, hint: str = ""):
    """``new`` (an ``nnx.State``) checked against ``old`` leaf by leaf (structure, shapes,
    dtypes) and placed as ``old``'s arrays are; a mismatch names the leaf (and ``hint``)."""
    paths, tree = jax.tree_util.tree_flatten_with_path(old)
    leaves, new_tree = jax.tree_util.tree_flatten(new)
    if new_tree != tree:
        raise ValueError("Engine.state: the new state's structure differs from the model's (other layers or names)")
    out = []
    for (path, a), b in zip(paths, leaves):
        if (np.shape(a), jnp.dtype(a.dtype)) != (np.shape(b), jnp.dtype(getattr(b, "dtype", np.asarray(b).dtype))):
            raise ValueError(
                f"Engine.state: {jax.tree_util.keystr(path)} is {getattr(b, 'dtype', '?')}{list(np.shape(b))}, the "
                f"model's {a.dtype}{list(np.shape(a))}{hint}"
            )
        out.append(jax.device_put(b, a.sharding) if isinstance(a, jax.Array) else b)
    return jax.tree_util.tree_unflatten(tree, out)


class Engine(_Scheduling):
    """Continuous-batching engine over a jattn model (``Llama`` or ``Deepseek``).

    Scheduling, every step:

    * **extend** when requests are prefilling or waiting: first the chunks of requests
      already prefilling, then newly admitted ones (FIFO), within the token budget
      (:attr:`EngineConfig.token_budget`) and the batch limit
      (:attr:`EngineConfig.max_batch`). A prompt longer than the budget is prefilled in
      chunks over several steps, each chunk an extend over its own cached prefix.
      A request is admitted when the pool has the pages for all its tokens; the token
      after the last chunk is sampled.
    * **decode** otherwise: one token for every running request. A request that needs a
      new page when the pool is empty takes it from the most recently admitted running
      request, which is *preempted*: its pages are freed, it goes back to the front of the
      queue and is recomputed (prompt + tokens so far, as one prefill) when pages free up.
      A request that cannot grow even alone fails with ``page pool exhausted``.

    * **parallel samples** (``SamplingParams.n > 1``): sample 0 is prefilled as usual;
      samples 1.. (and the queue behind them) wait until it has cached its prompt, then
      hold its prompt's whole pages
      too (counted holders: a page goes back to the pool when its last holder ends) and
      prefill only the prompt's tail (at least its last token) into pages of their own,
      so the prompt's K/V is computed and stored once. If sample 0 ends before they are
      admitted (on its first token), its prompt pages stay held for them until then. Sample ``i`` is seeded ``seed + i``
      and equals a lone request with that seed.

    * **data-parallel MLA** (``EngineConfig.mesh`` with a DeepSeek model): each device of the
      axis has its own pool, batch limit and token budget; a new request goes to the device
      with room and the most free pages (a parallel sample to its parent's), preemption
      stays within a device, and one step runs every device's batch (stacked plans).

    Requests are validated when submitted (:meth:`add_request`): a bad one finishes at
    once with ``status="error"``. An exception inside a step fails the requests of that
    step only (their pages return to the pool) and the engine goes on.
    """

    def __init__(self, model: nnx.Module, config: EngineConfig = EngineConfig(), backend=None):
        self.config = c = config
        check_context(model, c)
        self.page_size = c.page_size
        self.max_pages = -(-c.max_context // c.page_size)
        self.model, self.backend, self.fused_projections = serving_model(model, c, backend)
        model, backend = self.model, self.backend
        self.dp = getattr(backend, "data_parallel_size", 1)  # pools, one per device of a data-parallel axis
        self.kv_cache = new_kv_cache(model, backend, c)
        self.pools = [PagePool(c.num_pages) for _ in range(self.dp)]
        self.metrics = EngineMetrics()
        self._graphdef, self.state = nnx.split(model)
        self._step, self._traces = shared_step_fn(model, backend, command_buffers=c.command_buffers)
        self.requests: dict[int, Request] = {}
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self._next_rid = 0
        self.step_count = 0
        self._inflight: InFlight | None = None  # the launched step not yet read back
        # sample 0's rid -> (device, its whole prompt pages, its samples' rids): held after
        # it finished, for its parallel samples still waiting (see _hold_prefix)
        self._prefix_holds: dict[int, tuple[int, list[int], tuple]] = {}
        self._last_resolve = 0.0

    @property
    def state(self):
        """The model's ``nnx.State``; assigning a new one (other weights of the same
        structure: each array of the shape and dtype it replaces, else ``ValueError``
        naming it) also refreshes :attr:`params`, the flat tuple the jitted step takes.
        New arrays are placed as the ones they replace (split over a mesh alike)."""
        return self._state

    @state.setter
    def state(self, state):
        old = getattr(self, "_state", None)
        if old is not None:
            tp = self.config.mesh is not None and self.dp == 1
            hint = " (a tensor-parallel engine's model holds the physical KV heads)" if tp else ""
            state = _like(old, state, hint)
        self._state = state
        self.params = state_leaves(state)

    @property
    def allocator(self):
        """The free list of the first (with one device, the only) page pool."""
        return self.pools[0].allocator

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        """Queues a request; returns its id (with ``params.n > 1``, sample 0's; all samples'
        ids are its ``samples``, see :meth:`samples`). An invalid request (a field of the
        wrong type or out of range, an empty prompt, one that cannot fit the context or the
        page pool) finishes at once with ``status="error"`` and a message naming the field."""
        rid = self._next_rid
        self._next_rid += 1
        req = Request(rid=rid, prompt=[], params=params, arrival_step=self.step_count, arrival_time=time.perf_counter())
        self.requests[rid] = req
        try:
            if not isinstance(params, SamplingParams):
                raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
            req.params = params.validated()
            req.prompt = _validated_prompt(prompt, self.model.config.vocab_size)
            vocab = self.model.config.vocab_size
            never = [t for t in req.params.stop_token_ids if not 0 <= t < vocab]
            if never:  # a stop id no token can match would be ignored silently
                raise ValueError(f"stop_token_ids: {never[0]} is outside the vocabulary [0, {vocab})")
        except (TypeError, ValueError, OverflowError) as e:
            self._fail(req, str(e))
            return rid
        n = len(req.prompt)
        usable = self.allocator.num_pages - 1
        # Tokens the cache must hold before the request can make progress: the prompt, and
        # the first generated token unless it is the last (the last one is never fed back:
        # max_new_tokens of 1, or a prompt one short of max_context, which ends by length).
        first = n + (req.params.max_new_tokens > 1 and n + 1 < self.config.max_context)
        if n == 0:
            self._fail(req, "empty prompt: at least one token is needed")
        elif n >= self.config.max_context:
            self._fail(
                req,
                f"prompt of {n} tokens does not fit the context of "
                f"{self.config.max_context} tokens (prompt + at least one generated token)",
            )
        elif self._pages_for(first) > usable:
            what = "the prompt and its first generated token need" if first > n else "the prompt needs"
            self._fail(req, f"page pool exhausted: {what} {self._pages_for(first)} pages, the pool has {usable}")
        else:
            self.waiting.append(req)
            if req.params.n > 1:
                req.samples = (rid,) + tuple(self._add_sample(req, i) for i in range(1, req.params.n))
        return rid

    def _add_sample(self, first: Request, i: int) -> int:
        """Queues parallel sample ``i`` of ``first``'s prompt (seed + i) right behind it."""
        rid = self._next_rid
        self._next_rid += 1
        params = dataclasses.replace(first.params, n=1, seed=wrap_seed(first.params.seed + i))
        req = Request(
            rid=rid,
            prompt=first.prompt,
            params=params,
            arrival_step=first.arrival_step,
            arrival_time=first.arrival_time,
            parent=first.rid,
        )
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def _live(self) -> list[Request]:
        """The requests not done: the queues' and the step in flight's (not every request
        ever added: a server's step costs what its live requests cost)."""
        inflight = self._inflight.reqs if self._inflight is not None else []
        seen = {}
        for r in (*self.waiting, *self.prefilling, *self.running, *inflight):
            if not r.done:
                seen.setdefault(r.rid, r)
        return list(seen.values())

    def abort(self, rid: int) -> None:
        """Ends request ``rid`` now (and, for sample 0 of ``SamplingParams.n > 1``, all its
        samples), with ``finish_reason="abort"`` and the tokens it has: its pages return to
        the pool, and a token of it still in flight (overlap) is dropped. A request that is
        done already is left as it is; an unknown id raises ``KeyError``."""
        for r in self.samples(rid):
            if not r.done:
                self._finish(r, "abort")
                self.metrics.aborted += 1

    def release(self, rid: int) -> None:
        """Forgets finished request ``rid`` (for sample 0 of ``SamplingParams.n > 1``, its
        samples too; another sample alone): drops it from :attr:`requests` once its output
        is taken. A request not done yet raises ``ValueError`` (``abort`` it first); an
        unknown id ``KeyError``."""
        family = self.samples(rid)
        live = [r.rid for r in family if not r.done]
        if live:
            raise ValueError(f"release({rid}): request {live[0]} is {self.requests[live[0]].status}; abort it first")
        for r in family:
            self.requests.pop(r.rid, None)

    def samples(self, rid: int) -> list[Request]:
        """The requests of ``rid``'s parallel samples (``SamplingParams.n``), sample 0 first,
        less those released already (:meth:`release` of a finished sample)."""
        r = self.requests[rid]
        return [self.requests[i] for i in (r.samples or (rid,)) if i in self.requests]

    # ------------------------------------------------------------------ pages

    def _shared_prefix(self, r: Request):
        """For a parallel sample: ``(pages, tokens, device)`` of its parent's prompt prefix
        it can share now (whole pages, at least the last prompt token left to prefill, on
        the parent's device), ``None`` to wait (the parent will hold them soon), or
        ``([], 0, None)`` to prefill alone."""
        k = 0 if r.parent is None else (len(r.prompt) - 1) // self.page_size
        if k == 0:
            return [], 0, None
        p = self.requests.get(r.parent)  # (None: dropped by the caller, so done)
        if p is None or p.done:
            hold = self._prefix_holds.get(r.parent)
            return (hold[1], k * self.page_size, hold[0]) if hold else ([], 0, None)
        if p.status in ("running", "prefilling") and p.seq_len >= k * self.page_size:
            return p.pages[:k], k * self.page_size, p.device
        return None

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _fail(self, req: Request, msg: str):
        req.status, req.finish_reason, req.error = "error", "error", msg
        req.finish_time = time.perf_counter()
        self._release(req)

    def _finish(self, req: Request, reason: str):
        req.status, req.finish_reason = "finished", reason
        req.finish_time = time.perf_counter()
        if reason != "abort":
            self._hold_prefix(req)
        self._release(req)

    def _waiting_samples(self, samples) -> bool:
        """Whether any of ``samples`` (rids; sample 0 first) past the first still waits."""
        return any(self.requests[i].status == "waiting" for i in samples[1:] if i in self.requests)

    def _hold_prefix(self, p: Request):
        """Sample 0 ``p`` ends with samples still waiting (it stopped on its first token,
        before they were admitted): its whole prompt pages stay held for them, so they
        share them as they would a running parent's instead of prefilling the prompt again."""
        k = (len(p.prompt) - 1) // self.page_size
        if k and p.samples and p.seq_len >= k * self.page_size and self._waiting_samples(p.samples):
            self.pools[p.device].hold(p.pages[:k])
            self._prefix_holds[p.rid] = (p.device, list(p.pages[:k]), p.samples)

    def _drop_prefix_holds(self, device: int | None = None) -> bool:
        """Drops the prefix holds no waiting sample needs any more, and with ``device``
        every hold on that device (its pool is short); returns whether any was dropped."""
        dropped = False
        for rid, (d, pages, samples) in list(self._prefix_holds.items()):
            if d == device or not self._waiting_samples(samples):
                del self._prefix_holds[rid]
                self.pools[d].unref(pages)
                dropped = True
        return dropped

    def _release(self, req: Request):
        if req.pages:
            self.pools[req.device].unref(req.pages)
            req.pages = []
        for queue in (self.running, self.prefilling, self.waiting):
            if req in queue:
                queue.remove(req)
        if self._prefix_holds:
            self._drop_prefix_holds()

    def _preempt(self, req: Request):
        """Frees ``req``'s pages and requeues it at the front (recomputed when admitted again)."""
        self._release(req)
        req.status, req.seq_len = "waiting", 0
        req.preemptions += 1
        self.metrics.preemptions += 1
        self.waiting.insert(0, req)

    @property
    def _pending(self) -> dict[int, int]:
        """rid -> its row of the step in flight (overlap mode; empty when none)."""
        return self._inflight.rows if self._inflight is not None else {}

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self._inflight)

    def check_invariants(self) -> None:
        """Raises ``RuntimeError`` unless every page is either free or held by live
        requests as its holder count says (several only for a shared prompt prefix of
        parallel samples), and every request is in exactly one state (and queue)."""
        queues = {"waiting": self.waiting, "prefilling": self.prefilling, "running": self.running}
        check_invariants(self.pools, list(self.requests.values()), queues, self.page_size, self._prefix_holds)
        for rid, (_, _, samples) in self._prefix_holds.items():
            if not self._waiting_samples(samples):
                raise RuntimeError(f"request {rid}'s prompt pages are held with no sample waiting for them")

    def _by_device(self, items, req=lambda x: x):
        """``items`` split into one list per device (order kept)."""
        groups = [[] for _ in range(self.dp)]
        for x in items:
            groups[req(x).device].append(x)
        return groups

    def _dispatch(self, tokens, src, md, groups, bs_pad):
        """Launches the jitted step (JAX dispatches it asynchronously); returns (next
        tokens as a device array, launch time, compiled?). Rows with ``src[i] >= 0`` take
        their input token from row ``src[i]`` of the step in flight, on the device."""
        temp, top_p, seeds, counters, top_k, min_p, greedy_only = sampling_arrays(groups, bs_pad, self._pending)
        if (src >= 0).any():
            tokens = feed_tokens(self._inflight.nxt, src, tokens)
        before = self._traces[0]
        t0 = time.perf_counter()
        nxt, self.kv_cache = self._step(
            self.params, self.kv_cache, tokens, md, temp, top_p, seeds, counters, top_k, min_p, greedy_only=greedy_only
        )
        compiled = self._traces[0] > before
        if compiled:  # tracing and compiling ran in the call
            self.metrics.compilations += self._traces[0] - before
        return nxt, t0, compiled

    def _extend_step(self, batch: list[tuple[Request, int]]) -> InFlight:
        groups = self._by_device(batch, lambda x: x[0])

        def make(items, batch_buckets, token_buckets):
            ext = np.array([n for _, n in items], np.int64)
            return plan_extend(
                np.array([r.seq_len + n for r, n in items], np.int64),
                ext,
                page_size=self.page_size,
                page_table=page_table([r for r, _ in items], self.max_pages),
                batch_buckets=batch_buckets,
                token_buckets=token_buckets,
                max_pages=self.max_pages,
                num_pages=self.config.num_pages,
            )

        md, plans = plan_devices(groups, make, self.config.batch_buckets, self.config.token_buckets)
        tokens = np.zeros(sum(p.num_tokens for p in plans), np.int32)
        at = 0
        for items, p in zip(groups, plans):
            if items:
                new = np.concatenate([r.token_slice(r.seq_len, r.seq_len + n) for r, n in items])
                tokens[at : at + len(new)] = new
            at += p.num_tokens
        bs_pad = plans[0].batch_size
        src = np.full(len(tokens), -1, np.int32)  # an extend's tokens are all on the host
        nxt, t0, compiled = self._dispatch(tokens, src, md, [[r for r, _ in items] for items in groups], bs_pad)
        self.metrics.prefill_steps += 1
        prefilled = sum(n for _, n in batch)
        self.metrics.prompt_tokens += prefilled
        entries = []
        for d, items in enumerate(groups):
            for i, (r, n) in enumerate(items, start=d * bs_pad):
                r.seq_len += n
                if r.seq_len < r.num_tokens:
                    continue  # more chunks to go: the sampled token is not used
                self.prefilling.remove(r)
                r.status = "running"
                self.running.append(r)
                entries.append((r, i))
        reqs = [r for r, _ in batch]
        return InFlight("extend", nxt, entries, reqs, t0, compiled, prompt_tokens=prefilled)

    def _decode_step(self, reqs: list[Request]) -> InFlight:
        grouping = None
        if self.dp == 1 and self.config.cascade is not False:
            grouping = cascade_grouping(reqs, self.page_size, self.config.batch_buckets, always=self.config.cascade)
        cascade = {}
        if grouping is not None:
            reqs, g, pp = grouping
            cascade = dict(group_size=g, prefix_pages=np.asarray(pp, np.int32))
            self.metrics.cascade_steps += 1
        groups = self._by_device(reqs)

        def make(rows, batch_buckets, _token_buckets):
            return plan_decode(
                np.array([r.seq_len + 1 for r in rows], np.int64),
                page_size=self.page_size,
                page_table=page_table(rows, self.max_pages),
                batch_buckets=batch_buckets,
                max_pages=self.max_pages,
                num_pages=self.config.num_pages,
                **cascade,
            )

        md, plans = plan_devices(groups, make, self.config.batch_buckets, self.config.token_buckets)
        bs_pad = plans[0].batch_size
        tokens = np.zeros(self.dp * plans[0].num_tokens, np.int32)
        src = np.full(len(tokens), -1, np.int32)
        for d, rows in enumerate(groups):
            for i, r in enumerate(rows, start=d * plans[0].num_tokens):
                row = self._pending.get(r.rid)
                if row is None:
                    tokens[i] = r.output_tokens[-1]
                else:  # sampled by the step in flight: taken on the device
                    src[i] = row
        nxt, t0, compiled = self._dispatch(tokens, src, md, groups, bs_pad)
        self.metrics.decode_steps += 1
        entries = []
        for d, rows in enumerate(groups):
            for i, r in enumerate(rows, start=d * bs_pad):
                r.seq_len += 1
                entries.append((r, i))
        return InFlight("decode", nxt, entries, list(reqs), t0, compiled)

    def _resolve(self, f: InFlight) -> StepInfo:
        """Waits for step ``f``'s sampled tokens and accepts them (stop and length checks).
        A request that finished after ``f`` was launched (overlap: it stopped in the step
        before) drops its token."""
        self._inflight = None
        try:
            nxt = np.asarray(f.nxt)  # waits for the step
        except Exception as e:  # noqa: BLE001 - an execution error: fail the step's requests
            # (a request preempted since it was launched is waiting: it is recomputed anyway)
            return self._step_failed(f.mode, [r for r in f.reqs if r.status in ("running", "prefilling")], e)
        now = time.perf_counter()
        dt = now - max(f.t0, self._last_resolve)  # overlapped: the time since the last step's tokens
        self._last_resolve = now
        # the tokens this step adds: a request that finished after the launch drops its own
        kept = sum(1 for r, _ in f.entries if not r.done)
        self.metrics.record_step(f.mode, dt, compiled=f.compiled, tokens=kept, prompt_tokens=f.prompt_tokens)
        for r, i in f.entries:
            if r.done:
                continue
            if f.mode == "extend" and r.first_token_time is None:
                r.first_token_time = now
            self._accept(r, int(nxt[i]))
        return StepInfo(f.mode, tuple(r.rid for r in f.reqs), compiled=f.compiled, seconds=dt)

    def _accept(self, r: Request, tok: int):
        r.output_tokens.append(tok)
        self.metrics.generated_tokens += 1
        p = r.params
        if tok in p.stop_token_ids:
            self._finish(r, "stop")
        elif len(r.output_tokens) >= p.max_new_tokens:
            self._finish(r, "length")
        elif r.num_tokens >= self.config.max_context:
            self._finish(r, "length")  # no room to feed the token just generated

    def _sits_out(self, r: Request) -> bool:
        """Whether running request ``r`` gets no decode row now (overlap mode): its token in
        flight ends it by length."""
        if r.rid not in self._pending:
            return False
        return len(r.output_tokens) + 1 >= r.params.max_new_tokens or r.num_tokens + 1 >= self.config.max_context

    def _step_failed(self, mode: str, reqs: list[Request], err: Exception) -> StepInfo:
        """Fails the step's requests (their pages return to the pool). If the failure
        consumed the donated KV cache, a fresh cache replaces it and every other request
        holding pages is preempted (its cached tokens are gone; it is recomputed)."""
        msg = f"{mode} step failed: {type(err).__name__}: {err}"
        self.metrics.failed_steps += 1
        for r in reqs:
            if not r.done:
                self._fail(r, msg)
        preempted = []
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(self.kv_cache)):
            self.kv_cache = new_kv_cache(self.model, self.backend, self.config)
            for d in range(self.dp):  # the held prefixes' K/V are gone too
                self._drop_prefix_holds(device=d)
            for r in reversed(self.running + self.prefilling):
                self._preempt(r)
                preempted.append(r.rid)
        return StepInfo(mode, tuple(r.rid for r in reqs), preempted=tuple(preempted), error=msg)

    def step(self) -> StepInfo:
        """One engine step: an extend batch when requests are prefilling or admissible,
        else a decode of every running request. With ``EngineConfig.overlap`` the step is
        launched before the previous step's tokens are read back (its inputs that depend
        on them are taken on the device), so the host's scheduling and planning of this
        step run while the device computes the previous one; the returned info is then
        the launched step's, with ``finished`` the requests that ended in the step read
        back. A final call with nothing to launch reads back the last step."""
        self.step_count += 1
        self.metrics.steps += 1
        live = self._live()
        prev, prev_info = self._inflight, None
        if prev is not None and self._short_of_pages():
            # Overlap with a pool too small for every decode row: read the step in flight
            # back first (this step runs as the plain loop's would), so that requests it
            # ends free their pages before any request is preempted or admission waits.
            prev_info, prev = self._resolve(prev), None
        batch = self._schedule_extend() if (self.waiting or self.prefilling) else []
        preempted, reqs = [], []
        if batch:
            mode, reqs = "extend", [r for r, _ in batch]
        elif self.running:
            preempted = self._grow_for_decode()
            mode, reqs = "decode", [r for r in self.running if not self._sits_out(r)]
        if not reqs:
            mode = "idle"
        launched = failed = None
        if reqs:
            try:
                launched = self._extend_step(batch) if mode == "extend" else self._decode_step(reqs)
            except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving
                failed = self._step_failed(mode, reqs, e)
        # Read back the previous step (overlap: launched by the last call).
        if prev is not None:
            prev_info = self._resolve(prev)
        if launched is not None:
            self._inflight = launched
            if self.config.overlap:
                info = StepInfo(mode, tuple(r.rid for r in reqs), compiled=launched.compiled, seconds=None)
            else:
                info = self._resolve(launched)
        else:
            info = failed or prev_info or StepInfo("idle")
        finished = tuple(r.rid for r in live if r.done)
        return dataclasses.replace(info, finished=finished, preempted=tuple(preempted) + info.preempted)

    def run(self, max_steps: int | None = None) -> None:
        """Steps until no request is waiting, prefilling or running (and, with overlap,
        the last step is read back)."""
        n = 0
        while self.has_work() and (max_steps is None or n < max_steps):
            self.step()
            n += 1

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] = SamplingParams()
    ) -> list[Request]:
        """Runs ``prompts`` to completion together; returns their requests (in order)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"generate: {len(params)} SamplingParams for {len(prompts)} prompts (give one, or one each)"
            )
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        self.run()
        return [self.requests[i] for i in rids]

    def warmup(self, batch_sizes: Sequence[int] = (1,), prompt_len: int = 16) -> None:
        """Compiles the extend and decode programs of the given batch sizes, greedy and
        sampled (placeholder requests of ``prompt_len`` tokens), so that a run of those
        shapes compiles nothing more. Cascade plans (parallel samples) are not among them.
        The placeholders are dropped from :attr:`requests` and the metrics keep only the
        compilations. A placeholder the engine cannot serve (its prompt past
        ``max_context`` or the pool) raises ``ValueError``, as does a warmup while requests
        are queued or running (it would run them and then drop their metrics)."""
        if self.has_work():
            raise ValueError("warmup: the engine has queued or running requests; warm up before adding any")
        greedy, sampled = SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=2, temperature=0.8, seed=0)
        for params in (greedy, sampled):
            for bs in batch_sizes:
                rids = [self.add_request([0] * prompt_len, params) for _ in range(bs)]
                self.run()
                bad = [self.requests[i].error for i in rids if self.requests[i].status == "error"]
                for i in rids:
                    self.requests.pop(i, None)
                if bad:
                    raise ValueError(f"warmup(batch_sizes={tuple(batch_sizes)}, prompt_len={prompt_len}): {bad[0]}")
        self.metrics = EngineMetrics(compilations=self.metrics.compilations)
