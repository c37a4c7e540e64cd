"""A continuous-batching serving engine on jattn: host-side scheduler, one jitted step.

Requests arrive (``add_request``) and finish at different times. Each ``step()`` is either

* an **extend** (prefill) batch of newly admitted requests (ragged tokens, no prefix), or
* a **decode** batch of every running request (one token each),

planned on the host (``plan_extend`` / ``plan_decode``: padded to batch / token buckets,
fixed page-table width) and run by ONE jitted function with the KV cache donated. The
programs are keyed by the metadata's static fields, so after one call per bucket the loop
never recompiles (``metrics.compilations`` counts traces). Pages come from a
``PageAllocator`` and are freed when a request ends.

Sampling is greedy (``temperature=0``) or temperature + top-p with a per-request seed
(the key for the n-th token is ``fold_in(key(seed), n)``, so results do not depend on
what else is in the batch). A bad request (empty prompt, prompt longer than the context,
page pool exhausted) finishes with ``status="error"`` and a message; the others go on.

Example::

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

from jattn.kv_cache import PageAllocator, PagePoolExhausted
from jattn.metadata import DEFAULT_BATCH_BUCKETS, plan_decode, plan_extend


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple = ()


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int = 1024  # page 0 is reserved (padded rows write there)
    max_context: int = 2048  # prompt + generated tokens per request
    max_running: int = 128  # decode batch limit
    max_prefill_tokens: int = 4096  # new tokens per extend step (a longer prompt runs alone)
    batch_buckets: tuple = DEFAULT_BATCH_BUCKETS
    token_buckets: tuple | None = None  # None: powers of two >= 16
    kv_cache_dtype: str | None = None  # None: the model's dtype
    kernel_backend: str | None = None  # None: auto
    command_buffers: bool = True  # XLA command buffers (CUDA graphs) for the step, GPU only


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list
    params: SamplingParams
    arrival_step: int = 0
    output_tokens: list = dataclasses.field(default_factory=list)
    status: str = "waiting"  # waiting | running | finished | error
    finish_reason: str | None = None  # stop | length | error
    error: str | None = None
    pages: list = dataclasses.field(default_factory=list)
    seq_len: int = 0  # tokens in the KV cache
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def done(self) -> bool:
        return self.status in ("finished", "error")


@dataclasses.dataclass
class EngineMetrics:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0
    compilations: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    decode_step_times: list = dataclasses.field(default_factory=list)

    @property
    def busy_time(self) -> float:
        return self.prefill_time + self.decode_time

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of step time (prefill and decode)."""
        return self.generated_tokens / self.busy_time if self.busy_time else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else 0.0

    @property
    def median_decode_step_ms(self) -> float:
        return 1e3 * float(np.median(self.decode_step_times)) if self.decode_step_times else 0.0

    def summary(self) -> str:
        return (f"{self.generated_tokens} tokens in {self.steps} steps ({self.prefill_steps} prefill, "
                f"{self.decode_steps} decode); {self.tokens_per_s:.1f} tok/s overall, "
                f"{self.decode_tokens_per_s:.1f} tok/s decode; median decode step "
                f"{self.median_decode_step_ms:.2f} ms; {self.compilations} compilations")


def sample_tokens(logits, temperature, top_p, seeds, counters, *, greedy_only: bool):
    """Next tokens i32[B] from logits f32[B, V]; per-row temperature f32[B] (0 = greedy),
    top_p f32[B], seeds / counters i32[B] (key = fold_in(key(seed), counter))."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        return greedy
    t = jnp.maximum(temperature, 1e-6)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    keep = (cum - probs) < top_p[:, None]  # the top token is always kept
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    pick = jax.vmap(jax.random.categorical)(keys, sorted_logits)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def _is_gpu() -> bool:
    return jax.default_backend() == "gpu"


def make_step_fn(model: nnx.Module, backend, *, command_buffers: bool = True, on_trace=None):
    """``step(state, kv_cache, tokens, metadata, temperature, top_p, seeds, counters, *,
    greedy_only) -> (next_tokens i32[bs_bucket], kv_cache)``, jitted, the cache donated.

    ``tokens`` i32[num_tokens] (decode: one per row; extend: the token bucket). The token
    sampled for row b is read at the row's last new token."""
    graphdef, _ = nnx.split(model)

    def step(state, kv_cache, tokens, metadata, temperature, top_p, seeds, counters, greedy_only):
        if on_trace is not None:
            on_trace(metadata)
        m = nnx.merge(graphdef, state)
        hidden, kv_cache = m(tokens, metadata.positions, kv_cache, metadata, backend=backend)
        if hasattr(metadata, "cu_seqlens_q"):
            last = jnp.maximum(metadata.cu_seqlens_q[1:] - 1, 0)
        else:
            q = metadata.max_seqlen_q
            last = jnp.arange(metadata.batch_size, dtype=jnp.int32) * q + (q - 1)
        logits = m.logits(hidden[last])
        nxt = sample_tokens(logits, temperature, top_p, seeds, counters, greedy_only=greedy_only)
        return nxt, kv_cache

    kw = {}
    if command_buffers and _is_gpu():
        kw["compiler_options"] = {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL"}
    return jax.jit(step, donate_argnums=(1,), static_argnames=("greedy_only",), **kw)


class Engine:
    """Continuous-batching engine over a jattn model (``Llama`` or ``Deepseek``)."""

    def __init__(self, model: nnx.Module, config: EngineConfig = EngineConfig(), backend=None):
        self.model = model
        self.config = c = config
        self.page_size = c.page_size
        self.max_pages = -(-c.max_context // c.page_size)
        mcfg = model.config
        if backend is None:
            backend = self._default_backend(model, c)
        self.backend = backend
        self.kv_cache = model.make_cache(num_pages=c.num_pages, page_size=c.page_size,
                                         dtype=c.kv_cache_dtype or mcfg.dtype)
        self.allocator = PageAllocator(c.num_pages)
        self.metrics = EngineMetrics()
        self._graphdef, self.state = nnx.split(model)
        self._traced: set = set()
        self._step = make_step_fn(model, backend, command_buffers=c.command_buffers,
                                  on_trace=self._on_trace)
        self.requests: dict[int, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._next_rid = 0
        self.step_count = 0

    @staticmethod
    def _default_backend(model, c: EngineConfig):
        from jattn.models.deepseek import Deepseek, default_mla_backend
        from jattn.models.llama import default_mha_backend

        if isinstance(model, Deepseek):
            return default_mla_backend(model.config, c.page_size, c.kernel_backend)
        return default_mha_backend(model.config, c.page_size, c.kernel_backend)

    def _on_trace(self, metadata):
        self.metrics.compilations += 1

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        """Queues a request; returns its id. Invalid requests finish at once with an error."""
        rid = self._next_rid
        self._next_rid += 1
        req = Request(rid=rid, prompt=[int(t) for t in prompt], params=params, arrival_step=self.step_count)
        self.requests[rid] = req
        n = len(req.prompt)
        vocab = self.model.config.vocab_size
        if n == 0:
            self._fail(req, "empty prompt: at least one token is needed")
        elif n >= self.config.max_context:
            self._fail(req, f"prompt of {n} tokens does not fit the context of "
                            f"{self.config.max_context} tokens (prompt + at least one generated token)")
        elif min(req.prompt) < 0 or max(req.prompt) >= vocab:
            self._fail(req, f"prompt token ids must be in [0, {vocab})")
        elif params.max_new_tokens < 1:
            self._fail(req, f"max_new_tokens={params.max_new_tokens} must be >= 1")
        elif self._pages_for(n) > self.allocator.num_pages - 1:
            self._fail(req, f"page pool exhausted: the prompt needs {self._pages_for(n)} pages, "
                            f"the pool has {self.allocator.num_pages - 1}")
        else:
            self.waiting.append(req)
        return rid

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _fail(self, req: Request, msg: str):
        req.status, req.finish_reason, req.error = "error", "error", msg
        req.finish_time = time.perf_counter()
        self._release(req)

    def _finish(self, req: Request, reason: str):
        req.status, req.finish_reason = "finished", reason
        req.finish_time = time.perf_counter()
        self._release(req)

    def _release(self, req: Request):
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling

    def _admit(self) -> list[Request]:
        """Newly admitted requests for one extend step (FIFO, within the token budget)."""
        batch, tokens = [], 0
        max_bs = max(self.config.batch_buckets)
        while self.waiting and len(self.running) + len(batch) < self.config.max_running and len(batch) < max_bs:
            req = self.waiting[0]
            n = len(req.prompt)
            if batch and tokens + n > self.config.max_prefill_tokens:
                break
            try:
                req.pages = self.allocator.alloc(self._pages_for(n))
            except PagePoolExhausted as e:
                if not self.running and not batch:
                    self.waiting.pop(0)
                    self._fail(req, str(e))
                    continue
                break  # wait for running requests to free pages
            self.waiting.pop(0)
            batch.append(req)
            tokens += n
        return batch

    def _sampling_arrays(self, reqs: list[Request], bs_pad: int):
        temp = np.zeros(bs_pad, np.float32)
        top_p = np.ones(bs_pad, np.float32)
        seeds = np.zeros(bs_pad, np.int32)
        counters = np.zeros(bs_pad, np.int32)
        for i, r in enumerate(reqs):
            temp[i], top_p[i] = r.params.temperature, r.params.top_p
            seeds[i], counters[i] = r.params.seed, len(r.output_tokens)
        greedy_only = bool((temp <= 0).all())
        return temp, top_p, seeds, counters, greedy_only

    def _page_table(self, reqs: list[Request]) -> np.ndarray:
        pt = np.zeros((len(reqs), self.max_pages), np.int32)
        for i, r in enumerate(reqs):
            pt[i, : len(r.pages)] = r.pages
        return pt

    def _run(self, tokens, md, reqs):
        temp, top_p, seeds, counters, greedy_only = self._sampling_arrays(reqs, md.batch_size)
        nxt, self.kv_cache = self._step(self.state, self.kv_cache, tokens, md, temp, top_p, seeds,
                                        counters, greedy_only=greedy_only)
        return np.asarray(nxt)

    def _extend_step(self, batch: list[Request]):
        lens = np.array([len(r.prompt) for r in batch])
        md = plan_extend(lens, lens, page_size=self.page_size, page_table=self._page_table(batch),
                         batch_buckets=self.config.batch_buckets, token_buckets=self.config.token_buckets,
                         max_pages=self.max_pages, num_pages=self.config.num_pages)
        tokens = np.zeros(md.num_tokens, np.int32)
        tokens[: lens.sum()] = np.concatenate([r.prompt for r in batch])
        t0 = time.perf_counter()
        nxt = self._run(tokens, md, batch)
        dt = time.perf_counter() - t0
        self.metrics.prefill_time += dt
        self.metrics.prefill_steps += 1
        self.metrics.prompt_tokens += int(lens.sum())
        now = time.perf_counter()
        for i, r in enumerate(batch):
            r.seq_len = len(r.prompt)
            r.status = "running"
            r.first_token_time = now
            self.running.append(r)
            self._accept(r, int(nxt[i]))

    def _decode_step(self):
        # Each running request needs room for the token it feeds now.
        for r in list(self.running):
            need = self._pages_for(r.seq_len + 1) - len(r.pages)
            if need > 0:
                try:
                    r.pages += self.allocator.alloc(need)
                except PagePoolExhausted as e:
                    self._fail(r, f"{e} (while decoding token {len(r.output_tokens) + 1})")
        reqs = list(self.running)
        if not reqs:
            return
        lens = np.array([r.seq_len + 1 for r in reqs])
        md = plan_decode(lens, page_size=self.page_size, page_table=self._page_table(reqs),
                         batch_buckets=self.config.batch_buckets, max_pages=self.max_pages,
                         num_pages=self.config.num_pages)
        tokens = np.zeros(md.num_tokens, np.int32)
        tokens[: len(reqs)] = [r.output_tokens[-1] for r in reqs]
        t0 = time.perf_counter()
        nxt = self._run(tokens, md, reqs)
        dt = time.perf_counter() - t0
        self.metrics.decode_time += dt
        self.metrics.decode_step_times.append(dt)
        self.metrics.decode_steps += 1
        self.metrics.decode_tokens += len(reqs)
        for i, r in enumerate(reqs):
            r.seq_len += 1
            self._accept(r, int(nxt[i]))

    def _accept(self, r: Request, tok: int):
        r.output_tokens.append(tok)
        self.metrics.generated_tokens += 1
        p = r.params
        if tok in p.stop_token_ids:
            self._finish(r, "stop")
        elif len(r.output_tokens) >= p.max_new_tokens:
            self._finish(r, "length")
        elif r.seq_len + 1 >= self.config.max_context:
            self._finish(r, "length")  # no room to feed the token just generated

    def step(self) -> None:
        """One engine step: an extend batch if requests are waiting and admissible, else a decode."""
        self.step_count += 1
        self.metrics.steps += 1
        batch = self._admit() if self.waiting else []
        if batch:
            self._extend_step(batch)
        elif self.running:
            self._decode_step()

    def run(self, max_steps: int | None = None) -> None:
        """Steps until no request is waiting or running."""
        n = 0
        while self.has_work() and (max_steps is None or n < max_steps):
            self.step()
            n += 1

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 = SamplingParams()) -> list[Request]:
        """Runs ``prompts`` to completion together; returns their requests (in order)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        self.run()
        return [self.requests[i] for i in rids]

    def warmup(self, batch_sizes: Sequence[int] = (1,), prompt_len: int = 16) -> None:
        """Compiles the extend and decode programs of the given batch sizes (placeholder
        requests, outputs discarded), so a timed run never compiles."""
        for bs in batch_sizes:
            for _ in range(bs):
                self.add_request([0] * prompt_len, SamplingParams(max_new_tokens=2))
            self.run()
