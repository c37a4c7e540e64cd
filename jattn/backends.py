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
K/V are written, FP8 scales, the padding of draft-extend queries) lives here; the
torch bridge (``jattn.bridge``) calls these methods on a cache that views the
torch pool.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from jattn import cascade, ops
from jattn.config import LayerSpec as LayerSpec  # re-exported: the backends' public API
from jattn.config import MHAConfig as MHAConfig
from jattn.config import MLAConfig as MLAConfig
from jattn.kv_cache import MLAKVCache, PagedKVCache, is_fp8
from jattn.metadata import (
    DecodeMetadata,
    ExtendMetadata,
    ForwardMode,
    plan_decode,
    plan_extend,
)
from jattn.mla_rope import MLARope


def _check_plan(metadata, kv_cache) -> None:
    """The plan fits the cache (checked at trace time, on static fields only): the same
    page size, and page ids range-checked against at most the cache's page count."""
    if metadata.page_size != kv_cache.page_size:
        raise ValueError(
            f"metadata.page_size={metadata.page_size} differs from the KV cache's page_size="
            f"{kv_cache.page_size}: the plan's slots would address the wrong tokens"
        )
    bound, have = metadata.num_pages, kv_cache.num_pages
    if bound is None:
        raise ValueError(
            f"metadata.num_pages is None: the plan's page_table ids were never range-checked, and the "
            f"KV cache has {have} pages; plan with num_pages={have} (config.num_pages, the num_pages "
            "argument of init_forward_metadata, or plan_decode / plan_extend(num_pages=...))"
        )
    if bound > have:
        raise ValueError(
            f"metadata.num_pages={bound} exceeds the KV cache's {have} pages: the plan's page_table "
            f"ids were checked against {bound} and may read or write past the pool"
        )


class _PlanningMixin:
    """Planning shared by the MHA and MLA backends (host side, numpy in)."""

    config: MHAConfig | MLAConfig

    def q_len(self, mode: ForwardMode) -> int:
        """New tokens per request of a decode-mode step: 1 for ``DECODE``, else
        ``config.spec_num_tokens`` (target verify, DFLASH draft block)."""
        return 1 if ForwardMode.parse(mode) is ForwardMode.DECODE else self.config.spec_num_tokens

    def init_forward_metadata(
        self,
        bs: int,
        req_pool_indices,
        seq_lens,
        req_to_page,
        forward_mode: ForwardMode = ForwardMode.DECODE,
        extend_seq_lens=None,
        extend_prefix_lens=None,
        num_pages: int | None = None,
        **kwargs,
    ) -> DecodeMetadata | ExtendMetadata:
        """Plans one forward step; returns the metadata pytree every layer reuses.

        Args:
          bs: number of requests; the first ``bs`` entries of the per-request inputs count.
          req_pool_indices: int[>= bs] rows of ``req_to_page``.
          seq_lens: int[>= bs], tokens per request, the new ones included.
          req_to_page: int[pool, max_pages] page ids.
          forward_mode: a :class:`ForwardMode` (or its value, or another engine's enum
            member of the same name). Decode modes plan ``q_len(mode)`` tokens per
            request; ``EXTEND`` / ``DRAFT_EXTEND`` need ``extend_seq_lens`` int[>= bs].
          extend_prefix_lens: optional int[>= bs], checked against the lengths.
          num_pages: the KV cache's page count, the bound of the page ids when
            ``config.num_pages`` is None (see :meth:`page_bound`).
          kwargs: passed to :func:`jattn.plan_extend` (token buckets) for extends.
        """
        mode = ForwardMode.parse(forward_mode)
        cfg = self.config
        bs = int(bs)
        given = {"req_pool_indices": req_pool_indices, "seq_lens": seq_lens}
        if mode.is_extend():
            given["extend_seq_lens"] = extend_seq_lens
        for name, x in given.items():
            if x is not None and not 0 <= bs <= len(np.asarray(x)):
                raise ValueError(f"bs={bs} must be in [0, {len(np.asarray(x))}] (the entries of {name})")
        common = dict(
            page_size=cfg.page_size,
            req_to_page=np.asarray(req_to_page),
            req_pool_indices=np.asarray(req_pool_indices)[:bs],
            batch_buckets=self.batch_buckets,
            max_pages=cfg.max_num_pages,
            num_pages=self.page_bound(num_pages),
        )
        seq_lens = np.asarray(seq_lens)[:bs]
        if mode.is_extend():
            if extend_seq_lens is None:
                raise ValueError(f"extend_seq_lens is required for {mode}")
            return plan_extend(
                seq_lens,
                np.asarray(extend_seq_lens)[:bs],
                extend_prefix_lens=None if extend_prefix_lens is None else np.asarray(extend_prefix_lens)[:bs],
                forward_mode=mode,
                **common,
                **kwargs,
            )
        return plan_decode(
            seq_lens,
            q_len=self.q_len(mode),
            is_causal=mode is not ForwardMode.DRAFT_BLOCK,
            forward_mode=mode,
            **common,
        )

    def page_bound(self, num_pages: int | None = None) -> int | None:
        """The pool size a plan's page ids are checked against: ``config.num_pages``, or
        else ``num_pages`` (the cache's page count, given by the caller). The plan records
        it as a static field, so it must be the same for every step of a jitted loop; the
        ``forward_*`` methods refuse a plan without one, or with more pages than the cache."""
        return self.config.num_pages if self.config.num_pages is not None else num_pages

    # ---- CUDA-graph analogue: buckets chosen once, compiled on first call, refilled after.

    @property
    def batch_buckets(self) -> tuple:
        return getattr(self, "_batch_buckets", self.config.batch_buckets)

    def init_cuda_graph_state(self, max_bs: int, **kwargs) -> tuple:
        """Chooses the batch buckets (the upstream captured batch sizes) up to ``max_bs``."""
        buckets = tuple(b for b in self.config.batch_buckets if b < max_bs) + (max_bs,)
        self._batch_buckets = buckets
        return buckets

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, forward_mode: ForwardMode = ForwardMode.DECODE, num_pages: int | None = None, **kwargs
    ) -> DecodeMetadata:
        """A placeholder decode plan of bucket ``bs`` (all rows padding) to compile with;
        ``num_pages`` as in :meth:`init_forward_metadata` (the replays must agree)."""
        if bs not in self.batch_buckets:
            raise ValueError(f"bs={bs} is not one of the buckets {self.batch_buckets}")
        mode = ForwardMode.parse(forward_mode)
        if not mode.is_decode():
            raise ValueError(f"CUDA-graph plans are decode plans; got {mode}")
        q_len = self.q_len(mode)
        # No requests: every row of the bucket is padding (length 0, writes to the dummy page).
        return plan_decode(
            np.zeros(0, np.int32),
            page_size=self.config.page_size,
            page_table=np.zeros((0, self.config.max_num_pages), np.int32),
            q_len=q_len,
            is_causal=mode is not ForwardMode.DRAFT_BLOCK,
            forward_mode=mode,
            batch_buckets=(bs,),
            max_pages=self.config.max_num_pages,
            num_pages=self.page_bound(num_pages),
        )

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices,
        seq_lens,
        req_to_page,
        forward_mode: ForwardMode = ForwardMode.DECODE,
        num_pages: int | None = None,
        **kwargs,
    ) -> DecodeMetadata:
        """A decode plan for the first ``bs`` requests, padded to the smallest bucket."""
        return self.init_forward_metadata(
            bs, req_pool_indices, seq_lens, req_to_page, forward_mode, num_pages=num_pages
        )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The length to give padding rows of a bucket: 0 (an empty row: output 0,
        its new K/V written to the dummy page, no page of its own needed)."""
        return 0

    def get_verify_buffers_to_fill_after_draft(self) -> list:
        """Buffers a target-verify plan needs filled after the draft step: none (the
        verify mask is causal by position, there is no custom mask), so ``[None, None]``."""
        return [None, None]

    def fill_block_decode_seq_lens(self, metadata: DecodeMetadata, bs, block_seq_lens) -> DecodeMetadata:
        """DFLASH draft block: the plan with each of the first ``bs`` requests' length set
        to its block-end length ``block_seq_lens`` i32[>= bs] (prefix + block), clamped
        to ``[spec_num_tokens, context_len]``. Jittable (``bs`` may be traced): the
        drafter calls it inside its jitted step; write slots and positions are
        re-derived on the device from the plan's page table, which for a DRAFT_BLOCK
        plan keeps each request's whole ``req_to_page`` row (the block's pages must be
        there, as they must be in the upstream engine's table).
        """
        if metadata.forward_mode is not ForwardMode.DRAFT_BLOCK:
            raise ValueError(f"fill_block_decode_seq_lens needs a DRAFT_BLOCK plan, got {metadata.forward_mode}")
        lens = jnp.clip(jnp.asarray(block_seq_lens, jnp.int32), self.config.spec_num_tokens, self.config.context_len)
        return metadata.with_seq_lens(lens, bs)

    def support_kv_cache_prewrite(self, forward_mode: ForwardMode | None = None) -> bool:
        """Whether the engine may write the new K/V before attention (decode modes: the
        new tokens are part of ``L`` and attention reads them from the cache)."""
        return forward_mode is not None and ForwardMode.parse(forward_mode).is_decode()


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
        _check_plan(metadata, kv_cache)
        if save_kv_cache and k is not None:
            kv_cache = self._save(layer, kv_cache, metadata.out_cache_loc, k, v)
        q = q.reshape(-1, layer.num_q_heads, layer.head_dim)
        kc, vc = kv_cache.layer(layer.layer_id)
        opts = self.attention_options(layer, is_fp8(kv_cache.dtype))
        if metadata.group_size > 1 and layer.sliding_window_size < 0 and not layer.non_causal:
            # A cascade plan: each group's shared prefix is read once (windowed layers
            # take the plain decode over the same full rows).
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
        _check_plan(metadata, kv_cache)
        q = q.reshape(-1, layer.num_q_heads, layer.head_dim)
        k = k.reshape(-1, layer.num_kv_heads, layer.head_dim)
        v = v.reshape(-1, layer.num_kv_heads, layer.head_dim_v)
        causal = metadata.is_causal and not layer.non_causal
        fp8 = is_fp8(kv_cache.dtype)
        opts = dict(self.attention_options(layer, fp8), sinks=sinks)
        if save_kv_cache:
            kv_cache = self._save(layer, kv_cache, metadata.out_cache_loc, k, v)
        if not metadata.has_prefix and not fp8:
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
            kc, vc = kv_cache.layer(layer.layer_id)
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


def apply_llama_4_scaling(query, llama_4_scaling):
    """``query`` [T, H, D] times a per-token scale (f32 ``[T]``, ``[T, 1]`` or
    ``[T, 1, 1]``), computed in f32 and returned in the query's dtype; ``None``: the
    query unchanged."""
    if llama_4_scaling is None:
        return query
    s = jnp.asarray(llama_4_scaling, jnp.float32)
    if s.size != query.shape[0] or any(d != 1 for d in s.shape[1:]):
        raise ValueError(f"llama_4_scaling shape {s.shape} must be [T], [T, 1] or [T, 1, 1] with T={query.shape[0]}")
    return (query.astype(jnp.float32) * s.reshape(-1, 1, 1)).astype(query.dtype)


class MLABackend(_PlanningMixin):
    """DeepSeek MLA: absorbed decode over the 576-wide latent cache (also target verify
    and draft extend), ragged non-absorbed prefill (192/128) with LSE, and the chunked
    prefix-cache path with state merge."""

    def __init__(self, config: MLAConfig):
        self.config = config

    def save_kv(self, layer: LayerSpec, kv_cache: MLAKVCache, out_cache_loc, c_kv, k_pe) -> MLAKVCache:
        """Writes ``[c_kv, k_pe]`` rows (``set_mla_kv_buffer``) into layer ``layer.layer_id``."""
        kv = ops.set_mla_kv_buffer(kv_cache.layer(layer.layer_id), out_cache_loc, c_kv, k_pe, kv_scale=layer.k_scale)
        return kv_cache.replace_layer(layer.layer_id, kv)

    def _absorbed_query(self, q_nope, q_rope, layer, llama_4_scaling=None, rope=None):
        cfg = self.config
        if q_rope is None:  # already the full 576-wide absorbed query
            query = q_nope.reshape(-1, layer.num_q_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        else:
            q_nope = q_nope.reshape(-1, layer.num_q_heads, cfg.kv_lora_rank)
            q_rope = q_rope.reshape(-1, layer.num_q_heads, cfg.qk_rope_head_dim)
            query = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
        if rope is not None:  # fused rope (and the FP8 query of an FP8 cache)
            return rope.query(query, cfg.qk_rope_head_dim, llama_4_scaling)
        return apply_llama_4_scaling(query, llama_4_scaling)

    def _scale(self, layer: LayerSpec) -> float:
        return self.config.softmax_scale if layer.scaling is None else layer.scaling

    def _decode(self, query, layer, kv_cache: MLAKVCache, metadata):
        """The absorbed attention op over the latent cache (FP8: ``layer.k_scale``)."""
        _check_plan(metadata, kv_cache)
        return ops.mla_decode_with_kvcache(
            query,
            kv_cache.layer(layer.layer_id),
            metadata.page_table,
            metadata.cache_seqlens,
            kv_lora_rank=self.config.kv_lora_rank,
            softmax_scale=self._scale(layer),
            max_seqlen_q=metadata.max_seqlen_q,
            is_causal=metadata.is_causal,
            kv_scale=layer.k_scale if is_fp8(kv_cache.dtype) else 1.0,
            backend=self.config.kernel_backend,
        )

    def _write(self, layer, kv_cache, metadata, save_kv_cache, k, k_rope, rope=None):
        if not save_kv_cache:
            return kv_cache
        if k is None or k_rope is None:
            raise ValueError("save_kv_cache needs both k (c_kv) and k_rope")
        k_rope = k_rope if rope is None else rope.key(k_rope)
        return self.save_kv(layer, kv_cache, metadata.out_cache_loc, k, k_rope)

    def forward_decode(
        self,
        q,  # [T, H, R] absorbed q_nope (or [T, H, R + r] with q_rope=None)
        k,  # c_kv [T, R] (or None)
        v,  # unused (the value is the latent itself); kept for the upstream signature
        layer: LayerSpec,
        kv_cache: MLAKVCache,
        metadata: DecodeMetadata,
        save_kv_cache: bool = True,
        q_rope=None,  # [T, H, r]
        k_rope=None,  # [T, r]
        llama_4_scaling=None,  # f32[T] (or [T, 1] / [T, 1, 1]): per-token query scale
        cos_sin_cache=None,  # [max_position, r]: q_rope / k_rope arrive unrotated
        is_neox: bool = False,
        positions=None,  # i32[T]; default: the plan's
    ):
        """Absorbed decode / target verify; returns ``(latent out [T, H * R], kv_cache)``.
        ``llama_4_scaling`` multiplies each token's absorbed query in f32, as SGLang does.
        ``cos_sin_cache``: q_rope / k_rope are rotated here (at the plan's ``positions``
        unless given; ``is_neox`` the pairing) and an FP8 cache's query is quantised
        (scale 1, +-448): :mod:`jattn.mla_rope`, docs/SEMANTICS.md."""
        rope = MLARope.for_plan(metadata, cos_sin_cache, is_neox, positions, is_fp8(kv_cache.dtype))
        kv_cache = self._write(layer, kv_cache, metadata, save_kv_cache, k, k_rope, rope)
        out = self._decode(self._absorbed_query(q, q_rope, layer, llama_4_scaling, rope), layer, kv_cache, metadata)
        return out.reshape(out.shape[0], -1), kv_cache

    def forward_draft_extend(
        self,
        q,
        k,
        v,
        layer: LayerSpec,
        kv_cache: MLAKVCache,
        metadata: ExtendMetadata,
        save_kv_cache: bool = True,
        q_rope=None,
        k_rope=None,
        llama_4_scaling=None,
        cos_sin_cache=None,
        is_neox: bool = False,
        positions=None,
    ):
        """Absorbed attention with a different number of new tokens per request (draft
        extend, or an extend over a prefix run absorbed): the queries are padded per
        request to ``max_seqlen_q`` and unpadded after. Padded rows never write the
        cache and never reach real rows. Returns ``(latent out [T, H * R], kv_cache)``.
        ``cos_sin_cache``, ``is_neox``, ``positions`` (ragged, one per token) as in
        :meth:`forward_decode`."""
        rope = MLARope.for_plan(metadata, cos_sin_cache, is_neox, positions, is_fp8(kv_cache.dtype))
        kv_cache = self._write(layer, kv_cache, metadata, save_kv_cache, k, k_rope, rope)
        query = self._absorbed_query(q, q_rope, layer, llama_4_scaling, rope)
        padded = _front_pad(query, metadata.cu_seqlens_q, metadata.max_seqlen_q)
        out = self._decode(padded, layer, kv_cache, metadata)
        out = _front_unpad(out, metadata.cu_seqlens_q, metadata.max_seqlen_q, query.shape[0])
        return out.reshape(out.shape[0], -1), kv_cache

    def forward_absorbed(
        self,
        q,
        k,
        v,
        layer: LayerSpec,
        kv_cache: MLAKVCache,
        metadata,
        save_kv_cache: bool = True,
        q_rope=None,
        k_rope=None,
        llama_4_scaling=None,
        **rope,  # cos_sin_cache=, is_neox=, positions= (see forward_decode)
    ):
        """Absorbed attention for any plan: :meth:`forward_decode` for a decode-mode plan
        (decode, target verify), :meth:`forward_draft_extend` for an extend-mode plan."""
        fwd = self.forward_decode if metadata.forward_mode.is_decode() else self.forward_draft_extend
        return fwd(
            q,
            k,
            v,
            layer,
            kv_cache,
            metadata,
            save_kv_cache,
            q_rope=q_rope,
            k_rope=k_rope,
            llama_4_scaling=llama_4_scaling,
            **rope,
        )

    @staticmethod
    def is_absorbed(forward_mode) -> bool:
        """Whether ``forward_extend`` of SGLang's MLA backend runs a mode absorbed (target
        verify, draft extend) rather than as the ragged non-absorbed prefill (``EXTEND``)."""
        return ForwardMode.parse(forward_mode) is not ForwardMode.EXTEND

    def forward_extend(
        self,
        q,  # [T, H, qk_nope + qk_rope] or q_nope [T, H, qk_nope] with q_rope
        k,  # [T, H, qk_nope + qk_rope] or k_nope [T, H, qk_nope] with k_rope [T, r]
        v,  # [T, H, v_head_dim]
        layer: LayerSpec,
        metadata: ExtendMetadata,
        q_rope=None,  # [T, H, qk_rope]
        k_rope=None,  # [T, qk_rope], shared by every head
        return_lse: bool = False,
        llama_4_scaling=None,  # f32[T] (or [T, 1] / [T, 1, 1]): per-token query scale
        cos_sin_cache=None,
        is_neox: bool = False,
        positions=None,
    ):
        """Ragged non-absorbed prefill over the new tokens (causal); ``(out, lse)`` if asked
        (natural-log LSE f32[T, H]). With ``cos_sin_cache`` the last ``qk_rope_head_dim``
        columns of q and k (``q_rope`` / ``k_rope``) are rotated here, at the plan's
        positions unless ``positions`` is given (no FP8 here: the prefill reads no cache)."""
        rope = MLARope.for_plan(metadata, cos_sin_cache, is_neox, positions, False)
        q, k = self._qk(q, k, q_rope, k_rope)
        if rope is not None:
            r = self.config.qk_rope_head_dim
            q, k = rope.rotate_tail(q, r), rope.rotate_tail(k, r)
        q = apply_llama_4_scaling(q, llama_4_scaling)
        return ops.mha_prefill(
            q,
            k,
            v,
            metadata.cu_seqlens_q,
            max_seqlen_q=metadata.max_seqlen_q,
            is_causal=metadata.is_causal,
            softmax_scale=self._scale(layer),
            return_lse=return_lse,
            backend=self.config.kernel_backend,
        )

    def forward_prefix_chunk(
        self,
        q,
        k,
        v,
        layer: LayerSpec,
        cu_seqlens_q,
        cu_seqlens_kv,
        *,
        max_seqlen_q: int,
        max_seqlen_kv: int,
        q_rope=None,
        k_rope=None,
        llama_4_scaling=None,
    ):
        """Non-causal attention of the new tokens to one cached prefix chunk, with LSE.
        A request with no keys in the chunk gets ``o = 0, lse = -inf`` (merges as a no-op).
        ``llama_4_scaling`` as in :meth:`forward_extend`."""
        q, k = self._qk(q, k, q_rope, k_rope)
        q = apply_llama_4_scaling(q, llama_4_scaling)
        return ops.mha_prefill(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_kv,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv,
            is_causal=False,
            softmax_scale=self._scale(layer),
            return_lse=True,
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
