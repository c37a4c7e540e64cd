"""What a backend is built from and told per layer: :class:`MHAConfig`,
:class:`MLAConfig` and :class:`LayerSpec` (frozen, hashable: they are static under
``jax.jit``), each checked when it is made; and the checks of a call's arrays and plan
against them (:func:`as_heads`, :func:`check_rows`, :func:`check_plan_kind`)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jattn.checks import BACKENDS, _check_options, _check_scale, _concrete, _is_int
from jattn.kv_cache import _num_pages, cache_dtype
from jattn.metadata import DEFAULT_BATCH_BUCKETS, DecodeMetadata
from jattn.plan_inputs import _positive_int


def _check_fields(obj, ints=(), bools=()) -> None:
    """Each of ``ints`` a positive int (not a bool) and each of ``bools`` a bool."""
    for name in ints:
        _positive_int(getattr(obj, name), name)
    for name in bools:
        value = getattr(obj, name)
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name}={value!r} must be a bool")


def _check_heads(num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be divisible by num_kv_heads={num_kv_heads}")


def _check_serving(cfg) -> None:
    """The fields :class:`MHAConfig` and :class:`MLAConfig` share."""
    _check_fields(cfg, ints=("page_size", "context_len", "spec_num_tokens"))
    if cfg.num_pages is not None:
        _num_pages(cfg.num_pages)
    for name in ("dtype", "kv_cache_dtype"):
        value = getattr(cfg, name)
        try:
            canonical = cache_dtype(value).name
        except ValueError:
            raise ValueError(f"{name}={value!r} must be one of bfloat16, float16, float32, float8_e4m3fn") from None
        object.__setattr__(cfg, name, canonical)  # "bf16", jnp.bfloat16: one config, one jit key
    if cfg.kernel_backend is not None and cfg.kernel_backend not in BACKENDS:
        raise ValueError(f"kernel_backend={cfg.kernel_backend!r} must be one of {BACKENDS} or None")
    if cfg.batch_buckets is not None:
        buckets = tuple(cfg.batch_buckets) if isinstance(cfg.batch_buckets, (tuple, list)) else None
        if not buckets or not all(_is_int(b) and b >= 1 for b in buckets):
            raise ValueError(
                f"batch_buckets={cfg.batch_buckets!r} must be a non-empty tuple of positive ints, "
                "or None (powers of two)"
            )
        # sorted, no repeats, hashable: one set of buckets is one static jit key
        object.__setattr__(cfg, "batch_buckets", tuple(sorted({int(b) for b in buckets})))


def _plain_scales(obj, names) -> None:
    """``obj``'s concrete array scales as Python floats (the same f32 value), so that the
    frozen config stays hashable, a static ``jit`` argument; traced ones stay as they are."""
    for name in names:
        v = getattr(obj, name)
        c = None if v is None or not hasattr(v, "dtype") else _concrete(v)
        if c is not None:
            object.__setattr__(obj, name, float(c))


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What a backend needs to know of one attention layer (the ``layer`` object that
    tokenspeed and SGLang pass to their backends).

    ``sliding_window_size`` uses the kernels' ``window_left`` convention (the
    upstream backends' too): ``-1`` off, else the query sees ``window_left + 1`` keys including
    itself (Hugging Face ``sliding_window = w`` is ``w - 1`` here).
    """

    layer_id: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    scaling: float | None = None
    non_causal: bool = False

    def __post_init__(self):
        if not _is_int(self.layer_id) or self.layer_id < 0:
            raise ValueError(f"layer_id={self.layer_id!r} must be an int >= 0 (an index into the KV cache's layers)")
        _check_fields(self, ints=("num_q_heads", "num_kv_heads", "head_dim"), bools=("non_causal",))
        _check_heads(self.num_q_heads, self.num_kv_heads)
        if self.v_head_dim is not None:
            _positive_int(self.v_head_dim, "v_head_dim", "a positive int or None (head_dim)")
        try:
            _check_options(self.sliding_window_size, self.logit_cap, None, self.num_q_heads)
        except ValueError as e:
            raise ValueError(str(e).replace("window_left=", "sliding_window_size=", 1)) from None
        for name in ("k_scale", "v_scale", "scaling"):
            _check_scale(getattr(self, name), name, optional=name == "scaling")
        _plain_scales(self, ("k_scale", "v_scale", "scaling"))

    @property
    def head_dim_v(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


@dataclasses.dataclass(frozen=True)
class MHAConfig:
    """A paged MHA/GQA backend's settings. ``num_q_heads``, ``num_kv_heads`` and
    ``head_dim`` describe the model (per tensor-parallel rank) and are validated, but the
    calls follow each layer's own counts (an :class:`AttentionLayer`'s), as the upstream
    backends do: layers of one model may differ (per-layer GQA), and q and the caches are
    checked against the layer."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    context_len: int = 4096
    num_pages: int | None = None
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "bfloat16"
    spec_num_tokens: int = 1
    kernel_backend: str | None = None  # None = auto; "mosaic", "triton", "xla"
    batch_buckets: tuple = DEFAULT_BATCH_BUCKETS
    # Decode with batch-invariant bits (jattn.mha_decode_with_kvcache(batch_invariant=True));
    # cascade plans group requests by batch and are not covered.
    batch_invariant: bool = False

    def __post_init__(self):
        _check_fields(self, ints=("num_q_heads", "num_kv_heads", "head_dim"), bools=("batch_invariant",))
        _check_heads(self.num_q_heads, self.num_kv_heads)
        _check_serving(self)

    @property
    def max_num_pages(self) -> int:
        return -(-self.context_len // self.page_size)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """A DeepSeek MLA backend's settings. ``num_heads`` describes the model (per rank);
    the calls follow each layer's own head count, against which q is checked."""

    num_heads: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    page_size: int = 64
    context_len: int = 4096
    num_pages: int | None = None
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "bfloat16"
    scaling: float | None = None  # default 1/sqrt(qk_nope + qk_rope); times mscale^2 with YaRN
    spec_num_tokens: int = 1
    kernel_backend: str | None = None
    batch_buckets: tuple = DEFAULT_BATCH_BUCKETS

    def __post_init__(self):
        ints = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        _check_fields(self, ints=ints)
        _check_scale(self.scaling, "scaling", optional=True)
        _plain_scales(self, ("scaling",))
        _check_serving(self)

    @property
    def softmax_scale(self) -> float:
        if self.scaling is not None:
            return self.scaling
        return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def max_num_pages(self) -> int:
        return -(-self.context_len // self.page_size)


def check_plan_kind(metadata, kind: type, method: str) -> None:
    """``metadata`` is a plan of ``kind`` (:class:`DecodeMetadata` or :class:`ExtendMetadata`):
    a plan of the other kind has other rows (padded per request, or ragged) and would be
    read wrongly or fail on a missing field."""
    if not isinstance(metadata, kind):
        mode = getattr(metadata, "forward_mode", None)
        planner = "plan_decode" if kind is DecodeMetadata else "plan_extend"
        raise ValueError(
            f"{method} needs a plan of type {kind.__name__} (from {planner}), got metadata of type "
            f"{type(metadata).__name__}" + (f" (forward_mode={mode})" if mode is not None else "")
        )


def as_heads(x, name: str, heads: int, dim: int, rule: str):
    """``x`` [T, heads, dim] or [T, heads * dim] as [T, heads, dim]; any other shape is refused
    (a reshape by the layer's head counts would silently move rows between tokens).
    ``rule`` names where ``heads`` and ``dim`` come from."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) not in (2, 3) or shape[1:] not in ((heads, dim), (heads * dim,)):
        raise ValueError(f"{name} shape {shape} must be [T, {heads}, {dim}] or [T, {heads * dim}] ({rule})")
    return x.reshape(shape[0], heads, dim)


def check_rows(metadata, **arrays) -> None:
    """Each array has one row per token of the plan (``metadata.num_tokens``, its padding
    included); the ops cannot tell under ``jit``, where the plan's offsets are traced."""
    for name, x in arrays.items():
        if x is not None and x.shape[0] != metadata.num_tokens:
            raise ValueError(
                f"{name} has {x.shape[0]} rows; it must have one per token of the plan "
                f"(metadata.num_tokens={metadata.num_tokens}, padding included)"
            )
