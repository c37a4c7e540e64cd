"""The DeepSeek MLA backend (SGLang's ``TRTLLMMLABackend`` made functional): absorbed
paged decode over the 576-wide latent cache, target verify, draft extend, ragged MLA
prefill and the chunked prefix cache; ``jattn.backends`` re-exports it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn import ops
from jattn.checks import _concrete
from jattn.config import LayerSpec, MLAConfig, as_heads, check_plan_kind, check_rows
from jattn.kv_cache import MLAKVCache, is_fp8
from jattn.metadata import (
    DecodeMetadata,
    ExtendMetadata,
    ForwardMode,
)
from jattn.mla_rope import MLARope
from jattn.planning import _check_plan, _PlanningMixin


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


def check_draft_extend_shapes(ragged_shape, padded_shape, seq_lens_q, cu_seqlens_q, padded_name: str, exact=False):
    """``(bs, max_q)`` of a draft-extend pad / unpad after checking the shapes (and, where
    they are concrete, that every request's length fits ``max_q`` and matches ``cu``;
    ``exact``: that the lengths add up to the ragged rows)."""
    if len(padded_shape) < 2 or tuple(padded_shape[2:]) != tuple(ragged_shape[1:]):
        raise ValueError(
            f"{padded_name} shape {tuple(padded_shape)} must be [bs, max_q, *{tuple(ragged_shape[1:])}] "
            f"(the ragged rows' trailing dims)"
        )
    bs, max_q = int(padded_shape[0]), int(padded_shape[1])
    if np.shape(seq_lens_q) != (bs,) or np.shape(cu_seqlens_q) != (bs + 1,):
        raise ValueError(
            f"seq_lens_q shape {np.shape(seq_lens_q)} / cu_seqlens_q shape {np.shape(cu_seqlens_q)} must be "
            f"({bs},) / ({bs + 1},) for {padded_name} of {bs} requests"
        )
    if not any(isinstance(x, jax.core.Tracer) for x in (seq_lens_q, cu_seqlens_q)):
        n, cu = np.asarray(seq_lens_q), np.asarray(cu_seqlens_q)
        if (n < 0).any() or (n > max_q).any():
            raise ValueError(f"seq_lens_q {n.tolist()} must be in [0, max_q={max_q}]")
        if not np.array_equal(np.diff(cu), n) or cu[0] != 0 or cu[-1] > ragged_shape[0]:
            raise ValueError(
                f"cu_seqlens_q {cu.tolist()} must be the running sum of seq_lens_q {n.tolist()} from 0, within "
                f"{ragged_shape[0]} ragged rows"
            )
        if exact and cu[-1] != ragged_shape[0]:
            raise ValueError(f"sum_seq_lens_q={ragged_shape[0]} must equal sum(seq_lens_q)={int(cu[-1])}")
    return bs, max_q


def check_llama_4_scaling_shape(shape, tokens: int) -> None:
    """Raise unless ``shape`` (a per-token ``llama_4_scaling``'s) is ``[T]``, ``[T, 1]`` or
    ``[T, 1, 1]`` with ``T = tokens``."""
    shape = tuple(int(d) for d in shape)
    if not 1 <= len(shape) <= 3 or shape[0] != tokens or any(d != 1 for d in shape[1:]):
        raise ValueError(f"llama_4_scaling shape {shape} must be [T], [T, 1] or [T, 1, 1] with T={tokens}")


def check_llama_4_scaling(llama_4_scaling, tokens: int):
    """``llama_4_scaling`` as f32, checked: a real dtype, shape ``[T]``, ``[T, 1]`` or
    ``[T, 1, 1]`` with ``T = tokens``, and (where concrete) every scale finite and > 0."""
    shape, dtype = jnp.shape(llama_4_scaling), getattr(llama_4_scaling, "dtype", None)
    dtype = np.asarray(llama_4_scaling).dtype if dtype is None else jnp.dtype(dtype)
    if dtype == np.bool_ or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"llama_4_scaling.dtype={dtype} must be a real number type (f32 scales)")
    check_llama_4_scaling_shape(shape, tokens)
    s = jnp.asarray(llama_4_scaling, jnp.float32)
    v = _concrete(s)
    if v is not None and not (np.isfinite(v) & (v > 0)).all():
        t = int(np.flatnonzero(~(np.isfinite(v) & (v > 0)))[0])
        raise ValueError(f"llama_4_scaling[{t}]={v.reshape(-1)[t].item()!r} must be finite and > 0 (a per-token scale)")
    return s


def apply_llama_4_scaling(query, llama_4_scaling):
    """``query`` [T, H, D] times a per-token scale (f32 ``[T]``, ``[T, 1]`` or
    ``[T, 1, 1]``), computed in f32 and returned in the query's dtype; ``None``: the
    query unchanged."""
    if llama_4_scaling is None:
        return query
    s = check_llama_4_scaling(llama_4_scaling, query.shape[0])
    return (query.astype(jnp.float32) * s.reshape(-1, 1, 1)).astype(query.dtype)


class MLABackend(_PlanningMixin):
    """DeepSeek MLA: absorbed decode over the 576-wide latent cache (also target verify
    and draft extend), ragged non-absorbed prefill (192/128) with LSE, and the chunked
    prefix-cache path with state merge."""

    def __init__(self, config: MLAConfig):
        self.config = config

    def check_cache(self, kv_cache: MLAKVCache) -> None:
        """The latent cache's rows are the config's: ``kv_lora_rank`` columns of ``c_kv`` then
        ``qk_rope_head_dim`` of ``k_pe`` (another split of the same width would read the
        wrong columns as the value, silently)."""
        cfg = self.config
        width = kv_cache.kv[0].shape[-1]  # a stacked cache's too, with no slice of it
        if (kv_cache.kv_lora_rank, width - kv_cache.kv_lora_rank) != (cfg.kv_lora_rank, cfg.qk_rope_head_dim):
            raise ValueError(
                f"the MLA cache's rows are kv_lora_rank={kv_cache.kv_lora_rank} + rope {width - kv_cache.kv_lora_rank}"
                f" wide; config.kv_lora_rank={cfg.kv_lora_rank} and config.qk_rope_head_dim={cfg.qk_rope_head_dim} "
                "must equal them"
            )

    def save_kv(
        self, layer: LayerSpec, kv_cache: MLAKVCache, out_cache_loc, c_kv, k_pe, *, cos_sin_cache=None,
        is_neox: bool = False, positions=None,
    ) -> MLAKVCache:  # fmt: skip
        """Writes ``[c_kv, k_pe]`` rows (``set_mla_kv_buffer``) into layer ``layer.layer_id``:
        ``c_kv`` ``[T, kv_lora_rank]`` and ``k_pe`` ``[T, qk_rope_head_dim]`` (or ``[T, 1, .]``),
        each checked against the config (another split of the same row width would store
        columns of ``c_kv`` as rope). With ``cos_sin_cache``, ``k_pe`` arrives unrotated and
        is rotated here at ``positions`` (i32[T], required), as the fused-rope paths do."""
        self.check_cache(kv_cache)
        self._check_kv_rows(c_kv, k_pe, ("c_kv", "k_pe"))
        rope = MLARope.for_plan(None, cos_sin_cache, is_neox, positions, False)
        if rope is not None:
            k_pe = rope.key(k_pe)
        kv = ops.set_mla_kv_buffer(kv_cache.layer(layer.layer_id), out_cache_loc, c_kv, k_pe, kv_scale=layer.k_scale)
        return kv_cache.replace_layer(layer.layer_id, kv)

    def _absorbed_query(self, q_nope, q_rope, layer, llama_4_scaling=None, rope=None):
        cfg = self.config
        h, big_r, r = layer.num_q_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        rule = "layer.num_q_heads x config.kv_lora_rank"
        if q_rope is None:  # already the full 576-wide absorbed query
            query = as_heads(q_nope, "q", h, big_r + r, rule + " + config.qk_rope_head_dim, as q_rope is None")
        else:
            q_nope = as_heads(q_nope, "q", h, big_r, rule)
            q_rope = as_heads(q_rope, "q_rope", h, r, "layer.num_q_heads x config.qk_rope_head_dim")
            if q_rope.shape[0] != q_nope.shape[0]:
                raise ValueError(f"q_rope has {q_rope.shape[0]} rows; it must have q's {q_nope.shape[0]}")
            query = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
        if rope is not None:  # fused rope (and the FP8 query of an FP8 cache)
            return rope.query(query, cfg.qk_rope_head_dim, llama_4_scaling)
        return apply_llama_4_scaling(query, llama_4_scaling)

    def softmax_scale(self, layer: LayerSpec) -> float:
        """The layer's softmax scale: its ``scaling``, else the config's ``softmax_scale``."""
        return self.config.softmax_scale if layer.scaling is None else layer.scaling

    def _scale(self, layer: LayerSpec) -> float:
        """:meth:`softmax_scale`, for an attention call: a layer with a logit cap, a sliding
        window or ``non_causal`` set is refused by name (MLA attention takes none of them,
        and would run without it)."""
        for name, off in (("logit_cap", 0.0), ("sliding_window_size", -1), ("non_causal", False)):
            if getattr(layer, name) != off:
                raise ValueError(
                    f"layer.{name}={getattr(layer, name)!r}: the MLA backend takes no {name} (DeepSeek's MLA layers "
                    "have none); it would run without it"
                )
        return self.softmax_scale(layer)

    def _decode(self, query, layer, kv_cache: MLAKVCache, metadata, rope=None):
        """The absorbed attention op over the latent cache (FP8: ``layer.k_scale``). A bf16
        query that ``rope`` quantised for an FP8 cache goes to the op in e4m3 (exact: its
        values are e4m3 values), so the kernel reads it with no quantisation step."""
        _check_plan(metadata, kv_cache)
        if rope is not None and rope.fp8 and query.dtype == jnp.bfloat16:
            query = query.astype(jnp.float8_e4m3fn)
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

    def _check_kv_rows(self, c_kv, k_pe, names) -> None:
        """``c_kv`` / ``k_pe`` (called ``names`` by the caller) against the config's widths."""
        cfg = self.config
        for name, x, width, field in (
            (names[0], c_kv, cfg.kv_lora_rank, "kv_lora_rank"),
            (names[1], k_pe, cfg.qk_rope_head_dim, "qk_rope_head_dim"),
        ):
            if x.ndim not in (2, 3) or (x.ndim == 3 and x.shape[1] != 1) or x.shape[-1] != width:
                raise ValueError(
                    f"{name} shape {tuple(x.shape)} must be [T, {width}] or [T, 1, {width}] (config.{field})"
                )
        if c_kv.shape[0] != k_pe.shape[0]:
            raise ValueError(f"{names[0]} has {c_kv.shape[0]} rows and {names[1]} {k_pe.shape[0]}; they must be equal")

    def _write(self, layer, kv_cache, metadata, save_kv_cache, k, k_rope, rope=None):
        if not save_kv_cache:
            return kv_cache
        if k is None or k_rope is None:
            raise ValueError("save_kv_cache needs both k (c_kv) and k_rope")
        self._check_kv_rows(k, k_rope, ("k (c_kv)", "k_rope"))  # before the rope names its cache
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
        check_plan_kind(metadata, DecodeMetadata, "forward_decode")
        self.check_cache(kv_cache)
        rope = MLARope.for_plan(metadata, cos_sin_cache, is_neox, positions, is_fp8(kv_cache.dtype))
        kv_cache = self._write(layer, kv_cache, metadata, save_kv_cache, k, k_rope, rope)
        query = self._absorbed_query(q, q_rope, layer, llama_4_scaling, rope)
        out = self._decode(query, layer, kv_cache, metadata, rope)
        return out.reshape(out.shape[0], -1), kv_cache

    @staticmethod
    def pad_draft_extend_query(q, padded_q, seq_lens_q, cu_seqlens_q):
        """SGLang's helper: ``padded_q`` [bs, max_q, ...] with ``padded_q[b, i] =
        q[cu_seqlens_q[b] + i]`` for ``i < seq_lens_q[b]`` (tokens first, the rest of each
        row as ``padded_q`` held it). ``q`` [T, ...] ragged. Jittable; returns the new
        array. :meth:`forward_draft_extend` takes ragged rows and pads inside, so a caller
        of jattn's backends never needs this."""
        q, padded_q = jnp.asarray(q), jnp.asarray(padded_q)
        bs, max_q = check_draft_extend_shapes(q.shape, padded_q.shape, seq_lens_q, cu_seqlens_q, "padded_q")
        n = jnp.asarray(seq_lens_q, jnp.int32)
        cu = jnp.asarray(cu_seqlens_q, jnp.int32)
        i = jnp.arange(max_q, dtype=jnp.int32)[None, :]
        valid = (i < n[:, None]).reshape(bs, max_q, *([1] * (q.ndim - 1)))
        g = q[jnp.clip(cu[:-1, None] + i, 0, max(q.shape[0] - 1, 0))] if q.shape[0] else jnp.zeros_like(padded_q)
        return jnp.where(valid, g.astype(padded_q.dtype), padded_q)

    @staticmethod
    def unpad_draft_extend_output(raw_out, cu_seqlens_q, seq_lens_q, sum_seq_lens_q: int):
        """SGLang's helper, the inverse of :meth:`pad_draft_extend_query`: ``[sum_seq_lens_q,
        ...]`` with row ``cu_seqlens_q[b] + i`` = ``raw_out[b, i]`` for ``i < seq_lens_q[b]``.
        Jittable (``sum_seq_lens_q`` static)."""
        raw_out = jnp.asarray(raw_out)
        bs, max_q = check_draft_extend_shapes(
            (int(sum_seq_lens_q), *raw_out.shape[2:]), raw_out.shape, seq_lens_q, cu_seqlens_q, "raw_out", exact=True
        )
        cu = jnp.asarray(cu_seqlens_q, jnp.int32)
        t = jnp.arange(int(sum_seq_lens_q), dtype=jnp.int32)
        b = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, bs - 1)
        return raw_out[b, jnp.clip(t - cu[b], 0, max_q - 1)]

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
        check_plan_kind(metadata, ExtendMetadata, "forward_draft_extend")
        self.check_cache(kv_cache)
        rope = MLARope.for_plan(metadata, cos_sin_cache, is_neox, positions, is_fp8(kv_cache.dtype))
        kv_cache = self._write(layer, kv_cache, metadata, save_kv_cache, k, k_rope, rope)
        query = self._absorbed_query(q, q_rope, layer, llama_4_scaling, rope)
        check_rows(metadata, q=query)  # _front_pad would read clipped rows for the missing ones
        padded = _front_pad(query, metadata.cu_seqlens_q, metadata.max_seqlen_q)
        out = self._decode(padded, layer, kv_cache, metadata, rope)
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
        positions unless ``positions`` is given (no FP8 here: the prefill reads no cache).
        The rotation serves this call only: pass the same ``cos_sin_cache`` and positions
        to :meth:`save_kv` (the latent write) and :meth:`forward_prefix_chunk`."""
        check_plan_kind(metadata, ExtendMetadata, "forward_extend")
        rope = MLARope.for_plan(metadata, cos_sin_cache, is_neox, positions, False)
        q, k = self._qk(q, k, q_rope, k_rope, v, layer)
        check_rows(metadata, q=q, k=k, v=v)
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
        cos_sin_cache=None,
        is_neox: bool = False,
        positions=None,
    ):
        """Non-causal attention of the new tokens to one cached prefix chunk, with LSE.
        A request with no keys in the chunk gets ``o = 0, lse = -inf`` (merges as a no-op).
        ``llama_4_scaling`` as in :meth:`forward_extend`. With ``cos_sin_cache`` the query's
        last ``qk_rope_head_dim`` columns arrive unrotated and are rotated here at
        ``positions`` (i32[T], required: the new tokens' positions, as passed to
        :meth:`forward_extend`); the keys are cache rows, already rotated when written."""
        q, k = self._qk(q, k, q_rope, k_rope, v, layer)
        rope = MLARope.for_plan(None, cos_sin_cache, is_neox, positions, False)
        if rope is not None:
            q = rope.rotate_tail(q, self.config.qk_rope_head_dim)
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

    def _qk(self, q, k, q_rope, k_rope, v, layer):
        """The non-absorbed ``q``, ``k`` ``[T, H, qk_nope + qk_rope]`` (``q_rope`` / ``k_rope``
        appended), checked against the layer's heads and the config's widths (which the
        softmax scale and the rotated columns are taken from)."""
        cfg = self.config
        r = cfg.qk_rope_head_dim
        if q_rope is not None:
            if q_rope.ndim != 3 or q_rope.shape != q.shape[:2] + (r,):
                raise ValueError(
                    f"q_rope shape {tuple(q_rope.shape)} must be [{', '.join(map(str, q.shape[:2]))}, {r}]"
                    " (q's tokens and heads x config.qk_rope_head_dim)"
                )
            q = jnp.concatenate([q, q_rope.astype(q.dtype)], axis=-1)
        if k_rope is not None:
            t = k.shape[0]
            if k_rope.shape not in ((t, r), (t, 1, r)):
                raise ValueError(
                    f"k_rope shape {tuple(k_rope.shape)} must be [{t}, {r}] or [{t}, 1, {r}]"
                    " (k's tokens x config.qk_rope_head_dim, shared by every head)"
                )
            k_rope = k_rope.reshape(t, 1, r)
            k = jnp.concatenate([k, jnp.broadcast_to(k_rope, k.shape[:2] + (r,)).astype(k.dtype)], -1)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        rule = "layer.num_q_heads x config.qk_nope_head_dim + qk_rope_head_dim, q_rope / k_rope included"
        heads = layer.num_q_heads  # MLA's decompressed K and V are per query head
        for name, x, dim in (("q", q, qk), ("k", k, qk), ("v", v, cfg.v_head_dim)):
            if x.ndim != 3 or x.shape[1:] != (heads, dim):
                want = rule if name != "v" else "layer.num_q_heads x config.v_head_dim"
                raise ValueError(f"{name} shape {tuple(x.shape)} must be [T, {heads}, {dim}] ({want})")
        return q, k


# ----------------------------------------------------------------------------- registry
