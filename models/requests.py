"""The serving engine's data: its configuration (:class:`EngineConfig`), a request and
its states (:class:`Request`, :data:`REQUEST_STATES`), what one step did
(:class:`StepInfo`), the counters and timings (:class:`EngineMetrics`), and the check
of a submitted prompt. ``jattn.models.engine`` re-exports them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet

import numpy as np

from jattn.metadata import DEFAULT_BATCH_BUCKETS
from jattn.models.sampling import SamplingParams, _is_int

__all__ = ["EngineConfig", "EngineMetrics", "REQUEST_STATES", "Request", "StepInfo"]


def _validated_prompt(prompt, vocab: int) -> list:
    if hasattr(prompt, "__array__") and not isinstance(prompt, (list, tuple)):  # numpy, JAX, torch
        prompt = np.asarray(prompt)
        if prompt.ndim != 1:
            raise TypeError(f"prompt must be one sequence of token ids, got an array of shape {prompt.shape}")
        prompt = prompt.tolist()
    if isinstance(prompt, (str, bytes, Mapping, AbstractSet)) or not isinstance(prompt, Sequence):
        raise TypeError(f"prompt must be a sequence of token ids, got {type(prompt).__name__}")
    toks = list(prompt)
    bad = [t for t in toks if not _is_int(t)]
    if bad:
        raise TypeError(f"prompt token ids must be integers, got {bad[0]!r}")
    toks = [int(t) for t in toks]
    if toks and (min(toks) < 0 or max(toks) >= vocab):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    return toks


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int = 1024  # page 0 is reserved (padded rows write there)
    max_context: int = 2048  # prompt + generated tokens per request
    max_running: int = 128  # requests holding pages at once (also capped by the largest batch bucket)
    max_prefill_tokens: int = 4096  # new tokens per extend step (capped by the largest token bucket)
    batch_buckets: tuple = DEFAULT_BATCH_BUCKETS
    token_buckets: tuple | None = None  # None: powers of two >= 16; else taken as given
    kv_cache_dtype: str | None = None  # None: the model's dtype
    # None: auto (each call on the fastest backend that serves it here). A name is strict:
    # every attention call runs on it or fails; a backend this device cannot run at all is
    # refused when the engine is built (``setup.check_kernel_backend``)
    kernel_backend: str | None = None
    # XLA command buffers (CUDA graphs) for the step, GPU only: True = the engine's choice
    # (ENGINE_COMMAND_BUFFERS), False or "off" = none, "xla" = XLA's defaults, any other
    # string = XLA's command-buffer type list as given (e.g. "FUSION,CUSTOM_CALL").
    command_buffers: bool | str = True
    # A jax.sharding.Mesh to serve on (None: one device), split over its axis mesh_axis
    # (jattn.models.parallel.for_engine): a Llama-family model tensor-parallel (heads),
    # an MLA model data-parallel (each device its own requests and latent pool of
    # num_pages pages; the engine places requests). The step stays one jit.
    mesh: object = None
    mesh_axis: str = "tp"
    # Cascade decode for parallel samples that share prompt pages: None = when the shared
    # pages are at least a quarter of the batch's KV reads, True = whenever they share,
    # False = never (a plain decode over the same pages gives the same tokens). A cascade
    # needs the padded batch (its bucket) to be a multiple of the group size, so with the
    # default power-of-two buckets groups of n = 3, 5, ... samples decode plainly.
    cascade: bool | None = None
    # Overlap scheduling: each step is launched before the previous step's sampled tokens
    # are read back (the tokens it feeds are taken on the device), so the host's work for
    # a step overlaps the device's work on the one before. The tokens are the same; a
    # request that stops on a stop token has computed one more row, which is dropped.
    # False: each step's tokens are read back before the next step is planned.
    overlap: bool = True
    # Fused projections (models.layers.fuse_projections, applied to the model in place):
    # q/k/v as one matmul and gate/up as one, per layer. None (auto): on a GPU, unless the
    # mesh is tensor-parallel (whose column sharding is per projection); True: always
    # (refused with a tensor-parallel mesh); False: never. Weights given later through
    # Engine.state must have the structure the engine ended up with.
    fuse_projections: bool | None = None
    # Layers as one scan (CausalLM.stack_layers, applied to the model in place after any
    # fusion): consecutive blocks of one structure run as one jax.lax.scan over stacked
    # parameters and a stacked KV cache, so a program traces and compiles one block per
    # run instead of one per layer: shorter compiles. On a GPU its step uses cuBLAS GEMMs on
    # the layer slices in place (models.step.SCAN_COMPILER_OPTIONS), slower at batch 1 than
    # XLA's default GEMMs (docs/PERF.md), hence off by default. Not with a mesh.
    scan_layers: bool = False

    def __post_init__(self):
        for name, lo in (("page_size", 1), ("num_pages", 2), ("max_context", 2), ("max_running", 1)):
            v = getattr(self, name)
            if not _is_int(v) or v < lo:
                raise ValueError(f"EngineConfig.{name}={v!r} must be an integer >= {lo}")
        if not _is_int(self.max_prefill_tokens) or self.max_prefill_tokens < 1:
            raise ValueError(f"EngineConfig.max_prefill_tokens={self.max_prefill_tokens!r} must be an integer >= 1")
        for name in ("batch_buckets", "token_buckets"):
            bk = getattr(self, name)
            if bk is not None and (
                not isinstance(bk, Sequence) or not bk or not all(_is_int(b) and b >= 1 for b in bk)
            ):
                raise ValueError(f"EngineConfig.{name}={bk!r} must be None or a sequence of positive integers")
            if bk is not None:
                object.__setattr__(self, name, tuple(sorted({int(b) for b in bk})))  # one sorted hashable form
        if not isinstance(self.overlap, bool):
            raise ValueError(f"EngineConfig.overlap={self.overlap!r} must be True or False")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"EngineConfig.scan_layers={self.scan_layers!r} must be True or False")
        if self.scan_layers and self.mesh is not None:
            raise ValueError("EngineConfig.scan_layers: not supported with a mesh (sharded models keep their layers)")
        for name in ("fuse_projections", "cascade"):  # None, True or False: not 0 or 1, which == False / True
            v = getattr(self, name)
            if not (v is None or isinstance(v, (bool, np.bool_))):
                raise ValueError(f"EngineConfig.{name}={v!r} must be None (auto), True or False")
            if v is not None:
                object.__setattr__(self, name, bool(v))  # read with `is False` (np.False_ is not False)

    @property
    def max_batch(self) -> int:
        """Requests holding pages at once: ``max_running`` within the largest batch bucket."""
        return min(self.max_running, max(self.batch_buckets)) if self.batch_buckets else self.max_running

    @property
    def token_budget(self) -> int:
        """New tokens per extend step: ``max_prefill_tokens`` within the largest token bucket."""
        if self.token_buckets:
            return min(self.max_prefill_tokens, max(self.token_buckets))
        return self.max_prefill_tokens


#: Request states. ``waiting``: queued, no pages. ``prefilling``: pages held, part of
#: its tokens cached (chunked prefill). ``running``: every token but the last cached, one
#: token per decode step. ``finished`` / ``error``: done, no pages.
REQUEST_STATES = ("waiting", "prefilling", "running", "finished", "error")


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list
    params: SamplingParams
    arrival_step: int = 0
    output_tokens: list = dataclasses.field(default_factory=list)
    status: str = "waiting"  # one of REQUEST_STATES
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    pages: list = dataclasses.field(default_factory=list)
    device: int = 0  # the pool its pages are in (data-parallel serving: its device on the mesh axis)
    seq_len: int = 0  # tokens in the KV cache
    preemptions: int = 0  # times its pages were taken back (then recomputed)
    parent: int | None = None  # parallel sample i > 0: the rid of sample 0, whose prompt pages it shares
    samples: tuple = ()  # sample 0 of SamplingParams.n > 1: the rids of all n samples
    arrival_time: float | None = None  # time.perf_counter() at add_request
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def done(self) -> bool:
        return self.status in ("finished", "error")

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens: what the cache holds once the request is caught up."""
        return len(self.prompt) + len(self.output_tokens)

    def token_slice(self, start: int, stop: int) -> list:
        """Tokens ``start:stop`` of prompt + output."""
        n = len(self.prompt)
        return (self.prompt[start:stop] if start < n else []) + self.output_tokens[max(start - n, 0) : max(stop - n, 0)]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What one ``Engine.step()`` did."""

    mode: str  # "extend", "decode" or "idle"
    rids: tuple = ()  # requests in the batch
    finished: tuple = ()  # requests that finished (or failed) during the step
    preempted: tuple = ()  # requests whose pages were taken back (requeued, recomputed later)
    compiled: bool = False
    seconds: float | None = 0.0  # the step's time; None for one launched and not yet read back (overlap)
    error: str | None = None  # the step raised: its requests failed with this message


@dataclasses.dataclass
class EngineMetrics:
    steps: int = 0  # step() calls, idle ones and (overlap) the last one that only reads back included
    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0  # tokens prefilled: prompts, and tokens recomputed after preemption
    generated_tokens: int = 0
    decode_tokens: int = 0
    compilations: int = 0
    compile_steps: int = 0  # steps that traced + compiled; their time is in compile_time only
    compile_time: float = 0.0
    prefill_time: float = 0.0  # steps that did not compile
    timed_prompt_tokens: int = 0  # tokens prefilled by those steps
    decode_time: float = 0.0
    timed_tokens: int = 0  # tokens generated by steps that did not compile
    decode_step_times: list = dataclasses.field(default_factory=list)
    preemptions: int = 0
    failed_steps: int = 0
    aborted: int = 0  # requests ended by Engine.abort
    shared_tokens: int = 0  # prompt tokens a parallel sample did not prefill (its parent's pages)
    cascade_steps: int = 0  # decode steps planned as a cascade (shared prefixes read once per group)

    def record_step(self, mode: str, seconds: float, *, compiled: bool, tokens: int, prompt_tokens: int = 0) -> None:
        """Counts one read-back step: a compiling step's time goes to ``compile_time``
        only; otherwise its time and generated ``tokens`` (and an extend's prefilled
        ``prompt_tokens``) to the prefill or decode totals."""
        if compiled:
            self.compile_steps += 1
            self.compile_time += seconds
            return
        self.timed_tokens += tokens
        if mode == "extend":
            self.prefill_time += seconds
            self.timed_prompt_tokens += prompt_tokens
        else:
            self.decode_time += seconds
            self.decode_step_times.append(seconds)
            self.decode_tokens += tokens

    @property
    def busy_time(self) -> float:
        return self.prefill_time + self.decode_time

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of step time (prefill and decode; compiling steps excluded)."""
        return self.timed_tokens / self.busy_time if self.busy_time else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else 0.0

    @property
    def median_decode_step_ms(self) -> float:
        return 1e3 * float(np.median(self.decode_step_times)) if self.decode_step_times else 0.0

    def summary(self) -> str:
        extra = self.steps - self.prefill_steps - self.decode_steps
        calls = f"; {extra} more step() call(s): idle, or reading back the last step" if extra > 0 else ""
        return (
            f"{self.generated_tokens} tokens in {self.prefill_steps} prefill and {self.decode_steps} decode "
            f"steps{calls}; {self.tokens_per_s:.1f} tok/s overall, {self.decode_tokens_per_s:.1f} tok/s decode "
            f"(both over the {self.prefill_steps + self.decode_steps - self.compile_steps} steps that did not "
            f"compile); median decode step {self.median_decode_step_ms:.2f} ms; {self.compilations} compilations "
            f"({self.compile_time:.1f} s in the {self.compile_steps} compiling steps)"
        )
