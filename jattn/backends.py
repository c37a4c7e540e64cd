"""Attention backends with the flow of tokenspeed's ``MHAAttnBackend`` and SGLang's
``TRTLLMMLABackend``, made functional.

``init_forward_metadata`` returns a metadata pytree (it stores nothing on
``self``); ``forward_decode`` / ``forward_extend`` take the KV cache and return
``(out, kv_cache)``, so a whole serving step is one ``jax.jit`` with the cache
donated. The upstream CUDA-graph trio maps to buckets: ``init_cuda_graph_state``
chooses them, ``init_forward_metadata_capture_cuda_graph`` gives a placeholder
plan of a bucket (for the first, compiling, call), and
``init_forward_metadata_replay_cuda_graph`` fills a new plan of the same bucket
(a call with it never retraces).

Every decision about what a step computes (which op serves a mode, when the new
K/V are written, FP8 scales, the padding of draft-extend queries) lives in the
backends: :class:`MHABackend` here, :class:`MLABackend` in ``jattn.mla_backend``
(re-exported), their shared planning in ``jattn.planning``. The torch bridge
(``jattn.bridge``) calls these methods on a cache that views the torch pool.
"""

from __future__ import annotations

from typing import Callable

from jattn import cascade, ops
from jattn.config import LayerSpec as LayerSpec  # re-exported: the backends' public API
from jattn.config import MHAConfig as MHAConfig
from jattn.config import MLAConfig as MLAConfig
from jattn.config import as_heads, check_plan_kind, check_rows
from jattn.kv_cache import PagedKVCache, is_fp8
from jattn.metadata import DecodeMetadata, ExtendMetadata
from jattn.metadata import ForwardMode as ForwardMode
from jattn.mla_backend import MLABackend as MLABackend  # re-exported: the backends' public API
from jattn.mla_backend import apply_llama_4_scaling as apply_llama_4_scaling
from jattn.planning import _check_plan, _PlanningMixin


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

    @staticmethod
    def _heads(layer, q=None, k=None, v=None):
        """``q``, ``k``, ``v`` as ``[T, heads, dim]`` by the layer's head counts and dims
        (each may also come flat, ``[T, heads * dim]``; None stays None)."""
        kv_rule = "layer.num_kv_heads x layer.head_dim"
        shapes = (
            ("q", q, layer.num_q_heads, layer.head_dim, "layer.num_q_heads x layer.head_dim"),
            ("k", k, layer.num_kv_heads, layer.head_dim, kv_rule),
            ("v", v, layer.num_kv_heads, layer.head_dim_v, kv_rule + "_v"),
        )
        return tuple(None if x is None else as_heads(x, name, h, d, rule) for name, x, h, d, rule in shapes)

    @staticmethod
    def _layer_cache(layer, kv_cache: PagedKVCache):
        """The layer's K and V caches, which must have the layer's KV heads and head dims
        (a prewritten cache is read by these, so a mismatch would go unseen otherwise)."""
        kc, vc = kv_cache.layer(layer.layer_id)
        for name, c, d, dname in (("k", kc, layer.head_dim, "head_dim"), ("v", vc, layer.head_dim_v, "head_dim_v")):
            if tuple(c.shape[2:]) != (layer.num_kv_heads, d):
                raise ValueError(
                    f"layer {layer.layer_id}'s {name} cache has {c.shape[2]} KV heads x {c.shape[3]}, the layer "
                    f"layer.num_kv_heads={layer.num_kv_heads} x layer.{dname}={d}"
                )
        return kc, vc

    def _save(self, layer, kv_cache: PagedKVCache, loc, k, v) -> PagedKVCache:
        _, k, v = self._heads(layer, k=k, v=v)
        kc, vc = self._layer_cache(layer, kv_cache)
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
        sinks=None,  # f32[Hq] or None
    ):
        """Paged decode (also target verify and the non-causal DFLASH draft block).

        Writes ``k``/``v`` at the plan's slots first when ``save_kv_cache`` and they are
        given; otherwise the new tokens' K/V must already be in the cache (the engine
        wrote them: see :meth:`support_kv_cache_prewrite`).
        Returns ``(out [bs * q_len, Hq * Dv], kv_cache)``.
        """
        if (k is None) != (v is None):
            raise ValueError("k and v must both be given or both be None")
        check_plan_kind(metadata, DecodeMetadata, "forward_decode")
        _check_plan(metadata, kv_cache)
        q, _, _ = self._heads(layer, q)
        if save_kv_cache and k is not None:
            kv_cache = self._save(layer, kv_cache, metadata.out_cache_loc, k, v)
        kc, vc = self._layer_cache(layer, kv_cache)
        opts = self.attention_options(layer, is_fp8(kv_cache.dtype))
        cascaded = metadata.group_size > 1 and not self.config.batch_invariant
        if cascaded and layer.sliding_window_size < 0 and not layer.non_causal:
            # A cascade plan: each group's shared prefix is read once (windowed layers, and
            # a batch-invariant config, whose bits may not follow the grouping, take the
            # plain decode over the same full rows).
            g = metadata.group_size
            tables = cascade.cascade_tables(
                metadata.page_table,
                metadata.cache_seqlens,
                metadata.prefix_pages,
                group_size=g,
                page_size=metadata.page_size,
            )
            del opts["window_left"]
            out = cascade.cascade_decode(
                q, kc, vc, *tables, group_size=g, max_seqlen_q=metadata.max_seqlen_q, sinks=sinks, **opts
            )
            return out.reshape(out.shape[0], -1), kv_cache
        out = ops.mha_decode_with_kvcache(
            q,
            kc,
            vc,
            metadata.page_table,
            metadata.cache_seqlens,
            max_seqlen_q=metadata.max_seqlen_q,
            is_causal=metadata.is_causal and not layer.non_causal,
            sinks=sinks,
            batch_invariant=self.config.batch_invariant,
            **opts,
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
        sinks=None,  # f32[Hq] or None
        kv_in_cache: bool = False,
    ):
        """Extend over a paged prefix; a ragged prefill on ``k``/``v`` when no request
        has a prefix and the cache is not FP8 (the new K/V are then read as given,
        unscaled, not from the cache).

        ``save_kv_cache`` writes ``k``/``v`` at the plan's slots. An extend over a prefix
        reads the new tokens' K/V from the cache, so without ``save_kv_cache`` the caller
        must say they are there already with ``kv_in_cache=True`` (e.g. the torch
        engine wrote them into its pool); otherwise it raises.
        Returns ``(out [num_tokens, Hq * Dv], kv_cache)``; padding tokens give 0.
        """
        if (k is None) != (v is None):
            raise ValueError("k and v must both be given or both be None")
        check_plan_kind(metadata, ExtendMetadata, "forward_extend")
        _check_plan(metadata, kv_cache)
        causal = metadata.is_causal and not layer.non_causal
        fp8 = is_fp8(kv_cache.dtype)
        ragged = not metadata.has_prefix and not fp8
        if (k is None or v is None) and (save_kv_cache or ragged):
            raise ValueError(
                "forward_extend needs k and v (the new tokens' K/V): save_kv_cache writes them, and a plan with "
                "no prefix on a non-FP8 cache reads them as given"
            )
        q, k, v = self._heads(layer, q, k, v)
        check_rows(metadata, q=q, k=k, v=v)
        opts = dict(self.attention_options(layer, fp8), sinks=sinks)
        if save_kv_cache:
            kv_cache = self._save(layer, kv_cache, metadata.out_cache_loc, k, v)
        if ragged:
            # No cached prefix: ragged prefill on the new K/V, no cache read.
            opts.update(k_scale=1.0, v_scale=1.0)
            out = ops.mha_prefill(
                q,
                k,
                v,
                metadata.cu_seqlens_q,
                max_seqlen_q=metadata.max_seqlen_q,
                is_causal=causal,
                **opts,
            )
        else:
            if not (save_kv_cache or kv_in_cache):
                raise ValueError(
                    "extend over a paged prefix reads the new K/V from the cache: pass "
                    "save_kv_cache=True, or kv_in_cache=True if they are written already"
                )
            kc, vc = self._layer_cache(layer, kv_cache)
            out = ops.mha_extend_with_kvcache(
                q,
                kc,
                vc,
                metadata.page_table,
                metadata.cache_seqlens,
                metadata.cu_seqlens_q,
                max_seqlen_q=metadata.max_seqlen_q,
                is_causal=causal,
                **opts,
            )
        return out.reshape(out.shape[0], -1), kv_cache


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
