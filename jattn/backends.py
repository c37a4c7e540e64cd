"""Attention backends with the seeds' flow, made functional.

``init_forward_metadata`` returns a metadata pytree (it stores nothing on
``self``); ``forward_decode`` / ``forward_extend`` take the KV cache and return
``(out, kv_cache)``, so a whole serving step is one ``jax.jit`` with the cache
donated. The seeds' CUDA-graph trio maps to buckets: ``init_cuda_graph_state``
chooses them, ``init_forward_metadata_capture_cuda_graph`` gives a placeholder
plan of a bucket (for the first, compiling, call), and
``init_forward_metadata_replay_cuda_graph`` fills a new plan of the same bucket
(a call with it never retraces).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jattn import ops
from jattn.kv_cache import MLAKVCache, PagedKVCache, is_fp8
from jattn.metadata import (
    DEFAULT_BATCH_BUCKETS,
    DUMMY_PAGE,
    DecodeMetadata,
    ExtendMetadata,
    plan_decode,
    plan_extend,
)


class ForwardMode(enum.Enum):
    DECODE = "decode"  # one token per request
    TARGET_VERIFY = "target_verify"  # spec_num_tokens per request, causal
    DRAFT_BLOCK = "draft_block"  # DFLASH: spec_num_tokens per request, non-causal
    EXTEND = "extend"  # ragged new tokens over a paged prefix (prefill when no prefix)

    def is_decode(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK)

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What a backend needs to know of one attention layer (the seeds' ``layer``).

    ``sliding_window_size`` uses the kernels' ``window_left`` convention (the
    seeds' too): ``-1`` off, else the query sees ``window_left + 1`` keys including
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

    @property
    def head_dim_v(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


@dataclasses.dataclass(frozen=True)
class MHAConfig:
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

    @property
    def max_num_pages(self) -> int:
        return -(-self.context_len // self.page_size)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
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

    @property
    def softmax_scale(self) -> float:
        if self.scaling is not None:
            return self.scaling
        return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def max_num_pages(self) -> int:
        return -(-self.context_len // self.page_size)


class _PlanningMixin:
    """Planning shared by the MHA and MLA backends (host side, numpy in)."""

    config: MHAConfig | MLAConfig

    def _q_len(self, mode: ForwardMode) -> int:
        return 1 if mode is ForwardMode.DECODE else self.config.spec_num_tokens

    def init_forward_metadata(
        self,
        bs: int,
        req_pool_indices,
        seq_lens,
        req_to_page,
        forward_mode: ForwardMode = ForwardMode.DECODE,
        extend_seq_lens=None,
        extend_prefix_lens=None,
        **kwargs,
    ) -> DecodeMetadata | ExtendMetadata:
        """Plans one forward step; returns the metadata pytree every layer reuses."""
        cfg = self.config
        common = dict(
            page_size=cfg.page_size,
            req_to_page=np.asarray(req_to_page),
            req_pool_indices=np.asarray(req_pool_indices)[:bs],
            batch_buckets=self.batch_buckets,
            max_pages=cfg.max_num_pages,
            num_pages=cfg.num_pages,
        )
        seq_lens = np.asarray(seq_lens)[:bs]
        if forward_mode.is_extend():
            if extend_seq_lens is None:
                raise ValueError("extend_seq_lens is required for ForwardMode.EXTEND")
            return plan_extend(
                seq_lens,
                np.asarray(extend_seq_lens)[:bs],
                extend_prefix_lens=None if extend_prefix_lens is None else np.asarray(extend_prefix_lens)[:bs],
                **common,
                **kwargs,
            )
        return plan_decode(
            seq_lens,
            q_len=self._q_len(forward_mode),
            is_causal=forward_mode is not ForwardMode.DRAFT_BLOCK,
            **common,
        )

    # ---- CUDA-graph analogue: buckets chosen once, compiled on first call, refilled after.

    @property
    def batch_buckets(self) -> tuple:
        return getattr(self, "_batch_buckets", self.config.batch_buckets)

    def init_cuda_graph_state(self, max_bs: int, **kwargs) -> tuple:
        """Chooses the batch buckets (the seeds' captured batch sizes) up to ``max_bs``."""
        buckets = tuple(b for b in self.config.batch_buckets if b < max_bs) + (max_bs,)
        self._batch_buckets = buckets
        return buckets

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, forward_mode: ForwardMode = ForwardMode.DECODE, **kwargs
    ) -> DecodeMetadata:
        """A placeholder decode plan of bucket ``bs`` (all rows padding) to compile with."""
        if bs not in self.batch_buckets:
            raise ValueError(f"bs={bs} is not one of the buckets {self.batch_buckets}")
        q_len = self._q_len(forward_mode)
        md = plan_decode(
            np.full(1, q_len),
            page_size=self.config.page_size,
            page_table=np.full((1, self.config.max_num_pages), 1),
            q_len=q_len,
            is_causal=forward_mode is not ForwardMode.DRAFT_BLOCK,
            batch_buckets=(bs,),
            max_pages=self.config.max_num_pages,
        )
        # Everything padding: zero lengths, writes to the dummy page.
        return dataclasses.replace(
            md,
            page_table=np.full_like(md.page_table, DUMMY_PAGE),
            cache_seqlens=np.zeros_like(md.cache_seqlens),
            out_cache_loc=np.full_like(md.out_cache_loc, DUMMY_PAGE * self.config.page_size),
            num_reqs=np.int32(0),
        )

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices, seq_lens, req_to_page,
        forward_mode: ForwardMode = ForwardMode.DECODE, **kwargs
    ) -> DecodeMetadata:
        """A decode plan for the first ``bs`` requests, padded to the smallest bucket."""
        return self.init_forward_metadata(bs, req_pool_indices, seq_lens, req_to_page, forward_mode)

    def support_kv_cache_prewrite(self, forward_mode: ForwardMode | None = None) -> bool:
        """Decode writes the new K/V before attention reads (they are part of ``L``)."""
        return forward_mode is not None and forward_mode.is_decode()


class MHABackend(_PlanningMixin):
    """Paged MHA/GQA: decode (also multi-token), extend over a paged prefix, ragged prefill."""

    def __init__(self, config: MHAConfig):
        self.config = config

    @classmethod
    def supports_head_dim(cls, head_dim: int) -> str | None:
        return None if head_dim > 0 else f"head_dim={head_dim} must be positive"

    def attention_options(self, layer: LayerSpec, fp8: bool) -> dict:
        """The op keywords a layer implies (window, cap, scale, FP8 scales, kernel backend);
        sinks are passed separately (they are an array)."""
        return dict(
            window_left=layer.sliding_window_size,
            logit_cap=layer.logit_cap,
            softmax_scale=layer.scaling,
            k_scale=layer.k_scale if fp8 else 1.0,
            v_scale=layer.v_scale if fp8 else 1.0,
            backend=self.config.kernel_backend,
        )

    def _options(self, layer: LayerSpec, kv_cache: PagedKVCache, sinks):
        return dict(self.attention_options(layer, is_fp8(kv_cache.dtype)), sinks=sinks)

    def _save(self, layer, kv_cache: PagedKVCache, loc, k, v) -> PagedKVCache:
        kc, vc = kv_cache.layer(layer.layer_id)
        k = k.reshape(k.shape[0], layer.num_kv_heads, layer.head_dim)
        v = v.reshape(v.shape[0], layer.num_kv_heads, layer.head_dim_v)
        kc, vc = ops.set_kv_buffer(kc, vc, loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale)
        return kv_cache.replace_layer(layer.layer_id, kc, vc)

    def forward_decode(
        self,
        q,  # [bs * q_len, Hq, D] or [bs * q_len, Hq * D]
        k,  # [bs * q_len, Hkv, D] new keys, or None
        v,  # [bs * q_len, Hkv, Dv] new values, or None
        layer: LayerSpec,
        kv_cache: PagedKVCache,
        metadata: DecodeMetadata,
        save_kv_cache: bool = True,
        sinks=None,
    ):
        """Returns ``(out [bs * q_len, Hq * Dv], kv_cache)``."""
        if (k is None) != (v is None):
            raise ValueError("k and v must both be given or both be None")
        if save_kv_cache and k is not None:
            kv_cache = self._save(layer, kv_cache, metadata.out_cache_loc, k, v)
        q = q.reshape(-1, layer.num_q_heads, layer.head_dim)
        kc, vc = kv_cache.layer(layer.layer_id)
        out = ops.mha_decode_with_kvcache(
            q,
            kc,
            vc,
            metadata.page_table,
            metadata.cache_seqlens,
            max_seqlen_q=metadata.max_seqlen_q,
            is_causal=metadata.is_causal and not layer.non_causal,
            **self._options(layer, kv_cache, sinks),
        )
        return out.reshape(out.shape[0], -1), kv_cache

    def forward_extend(
        self,
        q,  # [num_tokens, Hq, D] (token bucket)
        k,  # [num_tokens, Hkv, D]
        v,  # [num_tokens, Hkv, Dv]
        layer: LayerSpec,
        kv_cache: PagedKVCache,
        metadata: ExtendMetadata,
        save_kv_cache: bool = True,
        sinks=None,
    ):
        """Returns ``(out [num_tokens, Hq * Dv], kv_cache)``; padding tokens give 0."""
        q = q.reshape(-1, layer.num_q_heads, layer.head_dim)
        k = k.reshape(-1, layer.num_kv_heads, layer.head_dim)
        v = v.reshape(-1, layer.num_kv_heads, layer.head_dim_v)
        causal = metadata.is_causal and not layer.non_causal
        opts = self._options(layer, kv_cache, sinks)
        if save_kv_cache:
            kv_cache = self._save(layer, kv_cache, metadata.out_cache_loc, k, v)
        if not metadata.has_prefix and not is_fp8(kv_cache.dtype):
            # No cached prefix: ragged prefill on the new K/V, no cache read.
            opts.update(k_scale=1.0, v_scale=1.0)
            out = ops.mha_prefill(
                q, k, v, metadata.cu_seqlens_q,
                max_seqlen_q=metadata.max_seqlen_q, is_causal=causal, **opts,
            )
        else:
            if not save_kv_cache:
                raise ValueError("extend over a paged prefix reads the new K/V from the cache: save_kv_cache must be True")
            kc, vc = kv_cache.layer(layer.layer_id)
            out = ops.mha_extend_with_kvcache(
                q, kc, vc, metadata.page_table, metadata.cache_seqlens, metadata.cu_seqlens_q,
                max_seqlen_q=metadata.max_seqlen_q, is_causal=causal, **opts,
            )
        return out.reshape(out.shape[0], -1), kv_cache


def _front_pad(x, cu_seqlens_q, max_seqlen_q: int):
    """Ragged [T, ...] -> [bs * max_q, ...] with each request's tokens at the END of its
    block, so the decode masks' positions ``L - max_q + i`` are the tokens' own."""
    bs = cu_seqlens_q.shape[0] - 1
    n = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    i = jnp.arange(max_seqlen_q, dtype=jnp.int32)[None, :]
    tok = cu_seqlens_q[:-1, None] + i - (max_seqlen_q - n[:, None])
    valid = i >= (max_seqlen_q - n[:, None])
    g = x[jnp.clip(tok, 0, x.shape[0] - 1)]
    g = jnp.where(valid.reshape(bs, max_seqlen_q, *([1] * (x.ndim - 1))), g, 0)
    return g.reshape(bs * max_seqlen_q, *x.shape[1:])


def _front_unpad(y, cu_seqlens_q, max_seqlen_q: int, num_tokens: int):
    """Inverse of :func:`_front_pad`; padding tokens (past cu[-1]) give 0."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    bs = cu_seqlens_q.shape[0] - 1
    b = jnp.clip(jnp.searchsorted(cu_seqlens_q, t, side="right") - 1, 0, bs - 1)
    n = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
    row = b * max_seqlen_q + (max_seqlen_q - n) + (t - cu_seqlens_q[b])
    out = y[jnp.clip(row, 0, y.shape[0] - 1)]
    real = (t < cu_seqlens_q[-1]).reshape(-1, *([1] * (y.ndim - 1)))
    return jnp.where(real, out, 0)


class MLABackend(_PlanningMixin):
    """DeepSeek MLA: absorbed decode over the 576-wide latent cache (also target verify
    and draft extend), ragged non-absorbed prefill (192/128) with LSE, and the chunked
    prefix-cache path with state merge."""

    def __init__(self, config: MLAConfig):
        self.config = config

    def save_kv(self, layer: LayerSpec, kv_cache: MLAKVCache, out_cache_loc, c_kv, k_pe) -> MLAKVCache:
        """Writes ``[c_kv, k_pe]`` rows (``set_mla_kv_buffer``) into layer ``layer.layer_id``."""
        kv = ops.set_mla_kv_buffer(
            kv_cache.layer(layer.layer_id), out_cache_loc, c_kv, k_pe, kv_scale=layer.k_scale
        )
        return kv_cache.replace_layer(layer.layer_id, kv)

    def _absorbed(self, q_nope, q_rope, layer):
        cfg = self.config
        if q_rope is None:  # already the full 576-wide absorbed query
            return q_nope.reshape(-1, layer.num_q_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        q_nope = q_nope.reshape(-1, layer.num_q_heads, cfg.kv_lora_rank)
        q_rope = q_rope.reshape(-1, layer.num_q_heads, cfg.qk_rope_head_dim)
        return jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)

    def _scale(self, layer: LayerSpec) -> float:
        return self.config.softmax_scale if layer.scaling is None else layer.scaling

    def forward_decode(
        self,
        q,  # [T, H, R] absorbed q_nope (or [T, H, R + r] with q_rope=None)
        k,  # c_kv [T, R] (or None)
        v,  # unused (the value is the latent itself); kept for the seeds' signature
        layer: LayerSpec,
        kv_cache: MLAKVCache,
        metadata: DecodeMetadata,
        save_kv_cache: bool = True,
        q_rope=None,  # [T, H, r]
        k_rope=None,  # [T, r]
    ):
        """Absorbed decode / target verify; returns ``(latent out [T, H * R], kv_cache)``."""
        if save_kv_cache:
            if k is None or k_rope is None:
                raise ValueError("save_kv_cache needs both k (c_kv) and k_rope")
            kv_cache = self.save_kv(layer, kv_cache, metadata.out_cache_loc, k, k_rope)
        query = self._absorbed(q, q_rope, layer)
        fp8 = is_fp8(kv_cache.dtype)
        out = ops.mla_decode_with_kvcache(
            query,
            kv_cache.layer(layer.layer_id),
            metadata.page_table,
            metadata.cache_seqlens,
            kv_lora_rank=self.config.kv_lora_rank,
            softmax_scale=self._scale(layer),
            max_seqlen_q=metadata.max_seqlen_q,
            is_causal=metadata.is_causal,
            kv_scale=layer.k_scale if fp8 else 1.0,
            backend=self.config.kernel_backend,
        )
        return out.reshape(out.shape[0], -1), kv_cache

    def forward_draft_extend(
        self, q, k, v, layer: LayerSpec, kv_cache: MLAKVCache, metadata: ExtendMetadata,
        save_kv_cache: bool = True, q_rope=None, k_rope=None,
    ):
        """Absorbed attention with a different number of new tokens per request
        (draft extend): the queries are padded per request and unpadded after.
        Padded rows never write the cache and never reach real rows."""
        if save_kv_cache:
            kv_cache = self.save_kv(layer, kv_cache, metadata.out_cache_loc, k, k_rope)
        query = self._absorbed(q, q_rope, layer)
        padded = _front_pad(query, metadata.cu_seqlens_q, metadata.max_seqlen_q)
        fp8 = is_fp8(kv_cache.dtype)
        out = ops.mla_decode_with_kvcache(
            padded,
            kv_cache.layer(layer.layer_id),
            metadata.page_table,
            metadata.cache_seqlens,
            kv_lora_rank=self.config.kv_lora_rank,
            softmax_scale=self._scale(layer),
            max_seqlen_q=metadata.max_seqlen_q,
            is_causal=metadata.is_causal,
            kv_scale=layer.k_scale if fp8 else 1.0,
            backend=self.config.kernel_backend,
        )
        out = _front_unpad(out, metadata.cu_seqlens_q, metadata.max_seqlen_q, query.shape[0])
        return out.reshape(out.shape[0], -1), kv_cache

    def forward_extend(
        self,
        q,  # [T, H, qk_nope + qk_rope] or q_nope [T, H, qk_nope] with q_rope
        k,  # [T, H, qk_nope + qk_rope] or k_nope [T, H, qk_nope] with k_rope [T, r]
        v,  # [T, H, v_head_dim]
        layer: LayerSpec,
        metadata: ExtendMetadata,
        q_rope=None,
        k_rope=None,
        return_lse: bool = False,
    ):
        """Ragged non-absorbed prefill over the new tokens (causal); ``(out, lse)`` if asked."""
        q, k = self._qk(q, k, q_rope, k_rope)
        return ops.mha_prefill(
            q, k, v, metadata.cu_seqlens_q,
            max_seqlen_q=metadata.max_seqlen_q, is_causal=metadata.is_causal,
            softmax_scale=self._scale(layer), return_lse=return_lse,
            backend=self.config.kernel_backend,
        )

    def forward_prefix_chunk(
        self, q, k, v, layer: LayerSpec, cu_seqlens_q, cu_seqlens_kv, *,
        max_seqlen_q: int, max_seqlen_kv: int, q_rope=None, k_rope=None,
    ):
        """Non-causal attention of the new tokens to one cached prefix chunk, with LSE.
        A request with no keys in the chunk gets ``o = 0, lse = -inf`` (merges as a no-op)."""
        q, k = self._qk(q, k, q_rope, k_rope)
        return ops.mha_prefill(
            q, k, v, cu_seqlens_q, cu_seqlens_kv,
            max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, is_causal=False,
            softmax_scale=self._scale(layer), return_lse=True,
            backend=self.config.kernel_backend,
        )

    merge_state = staticmethod(ops.attn_merge_state)

    def _qk(self, q, k, q_rope, k_rope):
        if q_rope is not None:
            q = jnp.concatenate([q, q_rope.astype(q.dtype)], axis=-1)
        if k_rope is not None:
            k_rope = k_rope.reshape(k_rope.shape[0], 1, -1)
            k = jnp.concatenate([k, jnp.broadcast_to(k_rope, k.shape[:2] + k_rope.shape[-1:]).astype(k.dtype)], -1)
        return q, k


# ----------------------------------------------------------------------------- registry

_REGISTRY: dict[str, tuple[frozenset, Callable]] = {}


def register_backend(name: str, archs, cls) -> None:
    """Registers ``cls`` under ``name`` for the attention architectures ``archs``
    (e.g. ``{"MHA"}``, ``{"MLA"}``)."""
    _REGISTRY[name] = (frozenset(archs), cls)


def get_backend(name: str, arch: str | None = None):
    """The backend class registered as ``name`` (checked against ``arch`` if given)."""
    if name not in _REGISTRY:
        raise KeyError(f"no attention backend named {name!r}; registered: {sorted(_REGISTRY)}")
    archs, cls = _REGISTRY[name]
    if arch is not None and arch not in archs:
        raise ValueError(f"backend {name!r} serves {sorted(archs)}, not {arch!r}")
    return cls


def registered_backends() -> dict[str, frozenset]:
    return {k: v[0] for k, v in _REGISTRY.items()}


register_backend("mha", {"MHA"}, MHABackend)
register_backend("mla", {"MLA"}, MLABackend)
