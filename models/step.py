"""The engine's one jitted serving step (:func:`make_step_fn`): the model's forward over a
plan's tokens, the logits of each row's last new token and the sampler, the KV cache
donated; shared across engines of one model structure (:func:`shared_step_fn`), and the
XLA command-buffer (CUDA graph) options it compiles with."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from flax import nnx

from jattn.models.sampling import sample_tokens

__all__ = [
    "ENGINE_COMMAND_BUFFERS",
    "InFlight",
    "feed_tokens",
    "command_buffer_options",
    "make_step_fn",
    "plan_devices",
    "shared_step_fn",
    "state_leaves",
]


@dataclasses.dataclass
class InFlight:
    """A launched step: its sampled tokens (a device array, not yet read back) and the
    requests that take theirs from it, ``entries`` of (request, row); ``rows`` maps each
    one's rid to its row."""

    mode: str
    nxt: object
    entries: list
    reqs: list
    t0: float
    compiled: bool
    prompt_tokens: int = 0  # tokens an extend step prefills
    rows: dict = dataclasses.field(init=False)

    def __post_init__(self):
        self.rows = {r.rid: i for r, i in self.entries}


@jax.jit
def feed_tokens(prev, src, tokens):
    """``tokens`` with row i replaced by ``prev[src[i]]`` where ``src[i] >= 0``: a step's
    inputs that are the step in flight's outputs, taken on the device."""
    taken = prev[jnp.clip(src, 0, prev.shape[0] - 1)].astype(tokens.dtype)
    return jnp.where(src >= 0, taken, tokens)


def _is_gpu() -> bool:
    return jax.default_backend() == "gpu"


# The command buffers the engine asks for: XLA's own default types ("xla"). Their list
# holds cuBLAS GEMMs and Mosaic calls fed by a slice, which "FUSION,CUSTOM_CALL" leaves
# outside the graphs; the step-time comparison is in docs/PERF.md (serving loop).
ENGINE_COMMAND_BUFFERS = "xla"


# One item of XLA's command-buffer type list: a type name (FUSION, CUBLAS, CUSTOM_CALL, ...),
# optionally prefixed + or - to add it to or remove it from XLA's defaults. The names
# themselves change between XLA versions and are left to XLA.
_COMMAND_TYPE = re.compile(r"[+-]?[A-Za-z][A-Za-z0-9_]*")


def command_buffer_options(setting: bool | str) -> dict:
    """The jit ``compiler_options`` for an ``EngineConfig.command_buffers`` setting."""
    if setting is True:
        setting = ENGINE_COMMAND_BUFFERS
    if setting is False or setting == "off":
        return {"xla_gpu_enable_command_buffer": ""}
    if setting == "xla":
        return {}
    if not isinstance(setting, str):
        raise TypeError(f"command_buffers: expected a bool or a string, got {setting!r}")
    bad = [item for item in setting.split(",") if not _COMMAND_TYPE.fullmatch(item)]
    if bad:
        raise ValueError(
            f"command_buffers: expected True, False, 'off', 'xla' or a comma-separated list of XLA "
            f"command-buffer types without spaces (e.g. 'FUSION,CUBLAS', '+CUSTOM_CALL'), got {setting!r} "
            f"(bad item {bad[0]!r})"
        )
    return {"xla_gpu_enable_command_buffer": setting}


# A stacked model's scan slices each layer's weights out of the stacked arrays. Fed to a
# Triton GEMM fusion, each slice is a copy of the layer's weights per step (docs/PERF.md);
# with dynamic-slice fusion XLA runs cuBLAS on the slice in place, which needs cuBLAS GEMMs.
SCAN_COMPILER_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False}


def step_compiler_options(model: nnx.Module, command_buffers: bool | str = True) -> dict:
    """The jit ``compiler_options`` of a serving step on a GPU (none elsewhere): the
    command buffers, and :data:`SCAN_COMPILER_OPTIONS` for a model with stacked layers."""
    opts = dict(command_buffer_options(command_buffers))  # checks the setting on every platform
    if not _is_gpu():
        return {}
    if getattr(model, "layers_stacked", False):
        opts.update(SCAN_COMPILER_OPTIONS)
    return opts


def make_step_fn(model: nnx.Module, backend, *, command_buffers: bool | str = True, on_trace=None):
    """``step(params, kv_cache, tokens, metadata, temperature, top_p, seeds, counters,
    top_k, min_p, *, greedy_only) -> (next_tokens i32[bs_bucket], kv_cache)``, jitted, the
    cache donated.

    ``params`` is the model state's leaves as a flat tuple (:func:`state_leaves`): the
    jit flattens a tuple of arrays in C++, while flattening the ``nnx.State`` itself is
    Python work on every call (host time compared in docs/PERF.md, serving loop).
    ``tokens`` i32[num_tokens] (decode: one per row; extend: the token bucket); ``metadata``
    a ``DecodeMetadata`` or ``ExtendMetadata``; ``temperature`` / ``top_p`` / ``min_p``
    f32[bs_bucket], ``seeds`` / ``counters`` / ``top_k`` i32[bs_bucket] (see
    :func:`sample_tokens`). The token sampled
    for row b is read at the row's last new token (a row with no new tokens, as a padding
    row, gets a meaningless token: the engine never reads it). A data-parallel plan
    (``jattn.sharding.stack_plans``) has ``n`` devices' rows and tokens one after the other."""
    graphdef, state = nnx.split(model)
    state_def = jax.tree_util.tree_structure(state)

    dp = getattr(backend, "data_parallel_size", 1) > 1
    if dp:  # tokens split over the data-parallel axis as the pools are; sampled tokens replicated
        from jax.sharding import NamedSharding, PartitionSpec

        split = NamedSharding(backend.mesh, PartitionSpec(backend.axis))
        whole = NamedSharding(backend.mesh, PartitionSpec())

    def step(params, kv_cache, tokens, metadata, temperature, top_p, seeds, counters, top_k, min_p, greedy_only):
        if on_trace is not None:
            on_trace(metadata)
        if dp:
            tokens = jax.lax.with_sharding_constraint(tokens, split)
        m = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_def, params))
        hidden, kv_cache = m(tokens, metadata.positions, kv_cache, metadata, backend=backend)
        if hasattr(metadata, "cu_seqlens_q") and jnp.ndim(metadata.num_reqs) == 1:
            # a data-parallel plan: each device's cu_seqlens_q is local to its tokens
            n = metadata.num_reqs.shape[0]
            cu = metadata.cu_seqlens_q.reshape(n, -1)
            offsets = jnp.arange(n, dtype=jnp.int32)[:, None] * (tokens.shape[0] // n)
            last = (jnp.maximum(cu[:, 1:] - 1, 0) + offsets).reshape(-1)
        elif hasattr(metadata, "cu_seqlens_q"):
            last = jnp.maximum(metadata.cu_seqlens_q[1:] - 1, 0)
        else:
            q = metadata.max_seqlen_q
            last = jnp.arange(metadata.batch_size, dtype=jnp.int32) * q + (q - 1)
        logits = m.logits(hidden[last])
        nxt = sample_tokens(
            logits, temperature, top_p, seeds, counters, greedy_only=greedy_only, top_k=top_k, min_p=min_p
        )
        if dp:
            nxt = jax.lax.with_sharding_constraint(nxt, whole)
        return nxt, kv_cache

    opts = step_compiler_options(model, command_buffers)
    kw = {"compiler_options": opts} if opts else {}
    return jax.jit(step, donate_argnums=(1,), static_argnames=("greedy_only",), **kw)


_STEP_FNS: dict = {}


def state_leaves(state) -> tuple:
    """The arrays of an ``nnx.State`` as the flat tuple the jitted step takes."""
    return tuple(jax.tree_util.tree_leaves(state))


def shared_step_fn(model: nnx.Module, backend, *, command_buffers: bool | str = True):
    """``(jitted step, trace counter)`` shared by every engine of the same model structure
    and backend config, so a new engine reuses the programs already compiled."""
    graphdef, _ = nnx.split(model)
    cb = str(step_compiler_options(model, command_buffers)) if _is_gpu() else None
    key = (graphdef, type(backend), backend.config, getattr(backend, "sharding_key", None), cb)
    if key not in _STEP_FNS:
        counter = [0]

        def on_trace(_):
            counter[0] += 1

        _STEP_FNS[key] = (make_step_fn(model, backend, command_buffers=command_buffers, on_trace=on_trace), counter)
    return _STEP_FNS[key]


def plan_devices(groups, make, batch_buckets, token_buckets):
    """``(plan, per-device plans)`` of a step: ``make(items, batch_buckets,
    token_buckets)`` for each device's items (one list per device). With one device its
    plan; with several, each is replanned where needed so that all have the largest batch
    and token bucket among them, then they are stacked (``jattn.sharding.stack_plans``)."""
    plans = [make(items, batch_buckets, token_buckets) for items in groups]
    if len(plans) == 1:
        return plans[0], plans
    from jattn.sharding import stack_plans

    bs, toks = max(p.batch_size for p in plans), max(p.num_tokens for p in plans)
    plans = [
        p if (p.batch_size, p.num_tokens) == (bs, toks) else make(items, (bs,), (toks,))
        for p, items in zip(plans, groups)
    ]
    return stack_plans(plans), plans
