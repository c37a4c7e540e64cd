"""``TorchMLABackend``: SGLang's ``TRTLLMMLABackend`` interface over jattn's
:class:`~jattn.backends.MLABackend`, on a torch engine's own latent pool.

An adapter only: its jitted bodies unpack the staged inputs, view the pool's layer
as a one-layer :class:`~jattn.kv_cache.MLAKVCache` and call the core backend
(``forward_absorbed`` for decode, target verify and draft extend;
``forward_extend`` for the ragged prefill; ``forward_prefix_chunk`` and
``merge_state`` for the chunked prefix cache). The call machinery is
:mod:`jattn.bridge.call`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jattn.backends import MLABackend, MLAConfig
from jattn.kv_cache import MLAKVCache
from jattn.metadata import ForwardMode, bucket
from jattn.mla_backend import check_draft_extend_shapes, check_llama_4_scaling_shape
from jattn.mla_rope import MLARope

from .call import _BridgeBase
from .checks import _check_shape, _rows, check_input_dtype, check_layer_id
from .convert import BridgeError, to_jax_input
from .native import run_mla_absorbed, run_mla_prefill
from .state import _host

__all__ = ["TorchMLABackend"]

_DECODE_SERVES = "decode-kind plans (DECODE, TARGET_VERIFY, DRAFT_BLOCK)"
_EXTEND_SERVES = "every mode but DECODE (TARGET_VERIFY, DRAFT_EXTEND, EXTEND)"


def _by_heads(x, n: int, h: int):
    """``x`` (``n`` rows of ``h * d`` elements: ``[n, h, d]``, ``[n, h * d]``) as ``[n, h,
    d]``, ``d`` taken from ``x``: ``reshape(n, h, -1)`` is ambiguous at ``n = 0``."""
    return x.reshape(n, h, x.flatten(1).shape[1] // h if h else x.shape[-1])


def _llama_4_scaled(x, llama_4_scaling):
    """``x`` (tokens first) times the per-token ``llama_4_scaling`` ([T], [T, 1] or
    [T, 1, 1]) in f32, back in ``x``'s dtype: the query scaling SGLang's MLA backend
    applies before the attention (the rule of jattn.backends.apply_llama_4_scaling)."""
    if x is None or llama_4_scaling is None:
        return x
    s = llama_4_scaling
    check_llama_4_scaling_shape(s.shape, x.shape[0])
    y = x.flatten(1).float() * s.reshape(-1, 1).to(device=x.device, dtype=torch.float32)
    return y.to(x.dtype).reshape(x.shape)


class TorchMLABackend(_BridgeBase):
    """jattn DeepSeek MLA for a torch engine (SGLang's ``TRTLLMMLABackend`` methods).

    Modes (set by ``init_forward_metadata``): ``DECODE`` absorbed decode;
    ``TARGET_VERIFY`` (``forward_extend`` with ``spec_num_tokens`` per request,
    causal); ``DRAFT_EXTEND`` (``forward_extend``, per-request query lengths
    ``extend_seq_lens``, padded and unpadded inside the jitted call); ``EXTEND``
    (``forward_extend``: ragged non-absorbed prefill, q/k 192 wide, v 128, causal).

    The pool is ``token_to_kv_pool`` (given here, as SGLang binds it at
    construction, or per call). Outputs: absorbed modes ``[T, H * kv_lora_rank]``
    latent (the caller applies ``W_UV``); prefill ``[T, H * v_head_dim]``.

    ``kernels="triton_native"``: decode, target verify, draft extend and the ragged
    prefill run as jattn's Triton kernels launched on torch's current stream (no JAX
    per layer call, capturable in a torch CUDA graph; :mod:`jattn.bridge.native`), the
    latent written by the pool's own writer. That path takes ``q_rope`` / ``k_rope``
    rotated (``cos_sin_cache`` is refused: the fused rope and FP8 query run on
    ``kernels="jax"``). The chunked prefix cache and ``merge_state`` stay on JAX.
    """

    def __init__(
        self,
        config: MLAConfig,
        token_to_kv_pool=None,
        *,
        device=None,
        kv_writer: str = "auto",
        sync: str = "auto",
        kernels: str = "jax",
    ):
        self._jbackend = MLABackend(config)
        if kernels == "triton_native":  # the pool's own writer; no JAX call in the layer calls
            kv_writer = "torch"
        super().__init__(config, device=device, kv_writer=kv_writer, sync=sync, kernels=kernels)
        self.token_to_kv_pool = token_to_kv_pool
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_cache_dim = config.kv_lora_rank + config.qk_rope_head_dim

    def _absorbed_native(self, q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, kwargs):
        """The absorbed modes on the native kernels (rotated q_rope / k_rope)."""
        spec = self._spec(layer)
        if self._native_plan is None:
            raise RuntimeError("call init_forward_metadata (or a cuda-graph init) first")
        pool = self._pool(kwargs)
        R, r, H = self.kv_lora_rank, self.qk_rope_head_dim, spec.num_q_heads
        n = q.shape[0]
        buf = self._pool_view(pool, spec.layer_id, jax_view=False).torch  # [pages, page_size, R + r]
        if save_kv_cache:
            if k is None or k_rope is None:
                raise ValueError("save_kv_cache needs k (c_kv) and k_rope")
            plan_loc = self._native_plan.tensors["out_cache_loc"]
            loc = self._out_loc(_caller_loc(forward_batch, kwargs), n, buf.numel() // (R + r), plan_loc).long()
            pool.set_mla_kv_buffer(layer, loc, k.reshape(n, R), k_rope.reshape(n, r))
        if q_rope is not None:
            query = torch.cat([q.reshape(n, H, R), q_rope.reshape(n, H, r).to(q.dtype)], dim=-1)
        else:
            query = q.reshape(n, H, R + r)
        fp8 = buf.dtype == torch.float8_e4m3fn
        return run_mla_absorbed(
            self._native,
            self._native_plan,
            query=query,
            kv_buf=buf,
            page_size=self.page_size,
            kv_lora_rank=R,
            softmax_scale=self._jbackend.softmax_scale(spec),
            kv_scale=spec.k_scale if fp8 else 1.0,
        )

    def _pool(self, kwargs):
        pool = kwargs.get("token_to_kv_pool") or self.token_to_kv_pool
        if pool is None:
            raise ValueError("no token_to_kv_pool: pass it to the constructor or the call")
        return pool

    def _pool_view(self, pool, i: int, jax_view: bool = True):
        """The view of layer ``i``'s latent buffer (checked when first seen: width
        ``kv_lora_rank + qk_rope_head_dim``, pages; ``jax_view`` as in :meth:`_view`)."""
        check_layer_id(pool, i, "layer.layer_id")
        buf = pool.get_key_buffer(i)
        R, r, w = self.kv_lora_rank, self.qk_rope_head_dim, self.kv_cache_dim

        def mismatch(shape):
            return (
                f"{shape[-1] if len(shape) > 1 else None} wide per slot, config needs kv_lora_rank + "
                f"qk_rope_head_dim = {R} + {r} = {w} (as [slots, 1, {w}] or [slots, {w}])"
            )

        st = self._pool_state(pool)
        return self._view(pool, st, (i, "kv"), f"kv_buffer[layer {i}]", buf, (w,), mismatch, jax_view=jax_view)

    def _rope_key(self, k_rope, n: int, cs, is_neox: bool):
        """The rotated ``k_rope`` [n, r] (f32 torch) for the pool's own writer: the core's
        rope (:class:`jattn.mla_rope.MLARope`) at the plan's positions, one small jitted call."""
        fn = self._fns.get(("mla_rope_key", is_neox))
        if fn is None:
            fn = self._fns[("mla_rope_key", is_neox)] = jax.jit(
                lambda kr, pos, cs: MLARope(pos[: kr.shape[0]], cs, is_neox).key(kr)
            )
        out = fn(to_jax_input(k_rope.reshape(n, self.qk_rope_head_dim), "k_rope"), self.forward_metadata.positions, cs)
        self.sync.after_jax(out)
        return torch.from_dlpack(out)

    def _absorbed(self, q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, kwargs, rope=None, l4=None):
        """``rope``: ``(cos_sin_cache, is_neox)`` for the fused rope (None: q_rope / k_rope
        arrive rotated); ``l4``: ``llama_4_scaling`` for the core (fused path only)."""
        spec = self._spec(layer)
        md = self._md_call
        if md is None:
            raise RuntimeError("call init_forward_metadata (or a cuda-graph init) first")
        pool = self._pool(kwargs)
        R, r, H = self.kv_lora_rank, self.qk_rope_head_dim, spec.num_q_heads
        n = q.shape[0]
        view = self._pool_view(pool, spec.layer_id)
        jax_writes = save_kv_cache and self.kv_writer == "jax"
        if save_kv_cache and (k is None or k_rope is None):
            raise ValueError("save_kv_cache needs k (c_kv) and k_rope")
        cs = None if rope is None else self._param(rope[0], "cos_sin_cache")
        is_neox = rope is not None and bool(rope[1])
        if save_kv_cache and not jax_writes:
            loc = self._out_loc(
                _caller_loc(forward_batch, kwargs), n, view.torch.shape[0] * self.page_size, self._loc_t
            )
            if cs is None:
                pool.set_mla_kv_buffer(layer, loc, k.reshape(n, R), k_rope.reshape(n, r))
            else:  # the rotated k_pe (f32), quantised by the pool's writer
                pool.set_mla_kv_buffer(layer, loc, k.reshape(n, R).float(), self._rope_key(k_rope, n, cs, is_neox))
        parts = [q.flatten(1)]  # (not reshape(n, -1): ambiguous at n = 0)
        if q_rope is not None:
            parts.append(q_rope.reshape(n, H * r).to(q.dtype))
        if jax_writes:
            parts += [k.reshape(n, R).to(q.dtype), k_rope.reshape(n, r).to(q.dtype)]
        has_rope = q_rope is not None
        rows = md.num_tokens
        stage = self._staged(("mla", self.forward_mode, H), parts, rows)
        core, spec0 = self._jbackend, self._shape_spec(layer)
        fused, has_l4 = cs is not None, l4 is not None
        fused_extra = ()
        if fused:
            fused_extra = (cs, self.forward_metadata.positions)
            if has_l4:
                check_llama_4_scaling_shape(l4.shape, n)
                fused_extra += (self._staged(("mla_l4", H), [l4.reshape(n, 1).float()], rows),)

        def build():
            def body(stage, kvs, md, *extra):
                extra = list(extra)
                pool_kv = None if jax_writes else extra.pop(0)
                ropekw = {}
                if fused:
                    ropekw = dict(cos_sin_cache=extra.pop(0), positions=extra.pop(0), is_neox=is_neox)
                    if has_l4:
                        ropekw["llama_4_scaling"] = extra.pop(0).reshape(-1)
                t = stage.shape[0]
                w = H * (R + r)  # q_nope then q_rope, or the full absorbed query
                if has_rope:
                    qa, qr = stage[:, : H * R].reshape(t, H, R), stage[:, H * R : w].reshape(t, H, r)
                else:
                    qa, qr = stage[:, :w].reshape(t, H, R + r), None
                c_kv = k_pe = None
                if jax_writes:
                    c_kv, k_pe = stage[:, w : w + R], stage[:, w + R :]
                cache = MLAKVCache(kv=(kvs[0] if jax_writes else pool_kv,), kv_lora_rank=R)
                o, cache = core.forward_absorbed(
                    qa, c_kv, None, spec0, cache, md, save_kv_cache=jax_writes, q_rope=qr, k_rope=k_pe, **ropekw
                )
                return o.astype(stage.dtype), ((cache.kv[0],) if jax_writes else ())

            return body

        extra = (() if jax_writes else (view.jax,)) + fused_extra
        fkey = ("mla", self.forward_mode, spec0, jax_writes, len(parts), has_rope, fused, is_neox, has_l4)
        out = self._call(
            fkey,
            build,
            ("mla", str(self.forward_mode), spec.layer_id),
            stage,
            [view] if jax_writes else [],
            rows,
            H * R,
            q.dtype,
            md,
            extra,
        )
        return out[:n]

    def forward_decode(
        self,
        q,
        k,
        v,
        layer,
        forward_batch=None,
        save_kv_cache: bool = True,
        q_rope=None,
        k_rope=None,
        cos_sin_cache=None,
        is_neox: bool = False,
        llama_4_scaling=None,
        **kwargs,
    ):
        """Absorbed decode.

        Args:
          q: absorbed q_nope [T, H * kv_lora_rank] with ``q_rope`` [T, H * rope], or the
            full [T, H * (kv_lora_rank + rope)] with ``q_rope=None``.
          k: c_kv [T, kv_lora_rank]; k_rope: [T, rope] (written when ``save_kv_cache``).
          v: unused (the value is the latent). forward_batch: the plan of
            ``init_forward_metadata`` is used, but its ``out_cache_loc`` (or an
            ``out_cache_loc`` keyword) is where the pool's own writer (``kv_writer="torch"``)
            writes; the JAX writer writes the plan's slots. The two must agree (the
            attention reads the plan's): where the slot values are checked
            (``check_slot_values``) other slots are refused by name.
          cos_sin_cache: [max_position, rope] (cos then sin; any float dtype, read as f32):
            q_rope / k_rope arrive unrotated and the core rotates them at the plan's
            positions (``is_neox`` picks the pairing); on an FP8 pool the query is also
            quantised to e4m3 (scale 1), as SGLang's fused ``mla_rope_quantize_fp8``.
        Returns: [T, H * kv_lora_rank] in q's dtype.

        ``T`` is the installed plan's new tokens (or its bucket's rows, padding
        included); a plan of another kind (``EXTEND``, ``DRAFT_EXTEND``) is refused.
        """
        self._check_mode("forward_decode", bool(self._plan_decode), _DECODE_SERVES, "forward_extend")
        return self._absorbed_call(
            q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, cos_sin_cache, is_neox, llama_4_scaling, kwargs
        )

    def _absorbed_inputs(self, q, q_rope, layer) -> bool:
        """Whether an ``EXTEND`` call brings absorbed inputs (q of ``kv_lora_rank`` columns a
        head, with ``q_rope``, or ``kv_lora_rank + rope`` without) rather than the ragged
        prefill's: SGLang's absorbed extend over the paged prefix (its fallback with the
        chunked prefix cache off). Widths that fit both read as the prefill's."""
        cfg, H = self.config, self._spec(layer).num_q_heads
        R, P, r = self.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        width = q.shape[-1] if q.dim() == 3 else q.shape[-1] // max(H, 1)
        absorbed, prefill = (R, P) if q_rope is not None else (R + r, P + r)
        return width == absorbed != prefill

    def _check_absorbed(self, q, k, q_rope, k_rope, layer) -> None:
        """The absorbed modes' input shapes, and q's rows against the plan."""
        R, r, H = self.kv_lora_rank, self.qk_rope_head_dim, self._spec(layer).num_q_heads
        n = _rows(q, "q")
        self._check_tokens("q", n)
        if q_rope is None:
            full = "[tokens, H * (kv_lora_rank + qk_rope_head_dim)] (q_rope=None)"
            _check_shape(q, "q", n, ((H * (R + r),), (H, R + r)), full)
        else:
            _check_shape(q, "q", n, ((H * R,), (H, R)), "[tokens, H * kv_lora_rank] (with q_rope)")
            _check_shape(q_rope, "q_rope", n, ((H * r,), (H, r)), "[tokens, H * qk_rope_head_dim] (q's tokens)")
        if k is not None:
            _check_shape(k, "k", n, ((R,), (1, R)), "c_kv [tokens, kv_lora_rank] (q's tokens)")
        if k_rope is not None:
            _check_shape(k_rope, "k_rope", n, ((r,), (1, r)), "[tokens, qk_rope_head_dim] (q's tokens)")
        for x, name in ((q_rope, "q_rope"), (k, "k"), (k_rope, "k_rope")):
            check_input_dtype(x, name)

    def _check_prefill(self, q, k, v, q_rope, k_rope, layer, chunk: bool) -> None:
        """The ragged prefill's input shapes (``chunk``: k/v are a prefix chunk's rows,
        not the new tokens'), and q's rows against the plan."""
        cfg = self.config
        P, r, V, H = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, self._spec(layer).num_q_heads
        n = _rows(q, "q")
        self._check_tokens("q", n)
        if q_rope is None:
            _check_shape(q, "q", n, ((H * (P + r),), (H, P + r)), "[tokens, H * (qk_nope_head_dim + qk_rope_head_dim)]")
        else:
            _check_shape(q, "q", n, ((H * P,), (H, P)), "[tokens, H * qk_nope_head_dim] (with q_rope)")
            _check_shape(q_rope, "q_rope", n, ((H * r,), (H, r)), "[tokens, H * qk_rope_head_dim] (q's tokens)")
        m, kv_rows = (_rows(v, "v"), "the chunk's tokens") if chunk else (n, "q's tokens")
        if k_rope is None:
            what = f"[tokens, H * (qk_nope_head_dim + qk_rope_head_dim)] ({kv_rows})"
            _check_shape(k, "k", m, ((H * (P + r),), (H, P + r)), what)
        else:
            _check_shape(k, "k", m, ((H * P,), (H, P)), f"[tokens, H * qk_nope_head_dim] (with k_rope; {kv_rows})")
            _check_shape(k_rope, "k_rope", m, ((r,), (1, r)), f"[tokens, qk_rope_head_dim] ({kv_rows})")
        _check_shape(v, "v", m, ((H * V,), (H, V)), f"[tokens, H * v_head_dim] ({kv_rows})")
        for x, name in ((q_rope, "q_rope"), (k, "k"), (k_rope, "k_rope"), (v, "v")):
            check_input_dtype(x, name)

    def _absorbed_call(
        self, q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, cos_sin_cache, is_neox, l4, kwargs
    ):
        self._check_absorbed(q, k, q_rope, k_rope, layer)
        if cos_sin_cache is None:  # rotated inputs: llama_4_scaling on the torch side, as before
            q, q_rope = _llama_4_scaled(q, l4), _llama_4_scaled(q_rope, l4)
            if self._native is not None:
                return self._absorbed_native(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, kwargs)
            return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, kwargs)
        if self._native is not None:
            raise NotImplementedError(
                "kernels='triton_native' takes q_rope/k_rope already rotated: cos_sin_cache (the fused rope "
                "and, on an FP8 pool, the FP8 query) runs on kernels='jax'"
            )
        if save_kv_cache and k_rope is None:
            raise ValueError("save_kv_cache needs k (c_kv) and k_rope")
        rope = (cos_sin_cache, is_neox)
        return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, kwargs, rope=rope, l4=l4)

    def forward_extend(
        self,
        q,
        k,
        v,
        layer,
        forward_batch=None,
        save_kv_cache: bool = True,
        q_rope=None,
        k_rope=None,
        cos_sin_cache=None,
        is_neox: bool = False,
        llama_4_scaling=None,
        return_lse: bool = False,
        **kwargs,
    ):
        """Target verify / draft extend (absorbed, as :meth:`forward_decode`) or ragged
        prefill (``EXTEND``). An ``EXTEND`` call with absorbed inputs (q of
        ``kv_lora_rank`` columns a head, as :meth:`forward_decode` takes) runs absorbed over
        the paged prefix, causal among the new tokens, as SGLang does with its chunked
        prefix cache off. Prefill: q [T, H * 192] (or q_nope [T, H * 128] with q_rope
        [T, H * 64]), k [T, H * 192] (or k_nope [T, H * 128] with k_rope [T, 64]),
        v [T, H * 128]; returns [T, H * 128] (and f32 LSE [T, H] with ``return_lse`` or
        ``forward_batch.mha_return_lse``).
        Prefill writes no cache (the latent is not among its inputs): pass
        ``save_kv_cache=False`` and write it with the pool's ``set_mla_kv_buffer``.
        ``T`` is the plan's new tokens (or its bucket's rows); a ``DECODE`` plan is
        refused (SGLang runs it through :meth:`forward_decode`).
        """
        self._check_mode(
            "forward_extend", self.forward_mode is not ForwardMode.DECODE, _EXTEND_SERVES, "forward_decode"
        )
        absorbed_extend = not self._jbackend.is_absorbed(self.forward_mode) and self._absorbed_inputs(q, q_rope, layer)
        if absorbed_extend and self._native is not None:
            raise NotImplementedError(
                "an EXTEND call with absorbed inputs runs on kernels='jax' (the native Triton path serves the "
                "ragged prefill only)"
            )
        if absorbed_extend or self._jbackend.is_absorbed(self.forward_mode):
            return self._absorbed_call(
                q,
                k,
                layer,
                forward_batch,
                save_kv_cache,
                q_rope,
                k_rope,
                cos_sin_cache,
                is_neox,
                llama_4_scaling,
                kwargs,
            )
        if cos_sin_cache is not None:
            raise NotImplementedError(
                "cos_sin_cache (fused rope) on the ragged MLA prefill (EXTEND) is not supported by the bridge: "
                "apply the rope to q_rope/k_rope (jattn.MLABackend.forward_extend takes it)"
            )
        chunk = forward_batch is not None and getattr(forward_batch, "attn_attend_prefix_cache", False)
        self._check_prefill(q, k, v, q_rope, k_rope, layer, chunk)
        q, q_rope = _llama_4_scaled(q, llama_4_scaling), _llama_4_scaled(q_rope, llama_4_scaling)
        if save_kv_cache:
            raise ValueError(
                "ragged MLA prefill cannot write the latent cache from per-head k/v: pass "
                "save_kv_cache=False and write c_kv/k_pe with set_mla_kv_buffer"
            )
        if chunk:
            return self._prefix_chunk(q, k, v, layer, q_rope, k_rope, forward_batch)
        # SGLang's caller asks for the LSE through the batch (``mha_return_lse``)
        return_lse = bool(return_lse or getattr(forward_batch, "mha_return_lse", False))
        if self._native is not None:
            return self._prefill_native(q, k, v, layer, q_rope, k_rope, return_lse)
        return self._prefill(q, k, v, layer, q_rope, k_rope, return_lse)

    def _prefill_native(self, q, k, v, layer, q_rope, k_rope, return_lse):
        spec = self._spec(layer)
        H, r, V = spec.num_q_heads, self.config.qk_rope_head_dim, self.config.v_head_dim
        n = v.reshape(-1, H * V).shape[0]
        qa, ka = _by_heads(q, n, H), _by_heads(k, n, H).to(q.dtype)
        if q_rope is not None:
            qa = torch.cat([qa, q_rope.reshape(n, H, r).to(q.dtype)], dim=-1)
        if k_rope is not None:
            ka = torch.cat([ka, k_rope.reshape(n, 1, r).to(q.dtype).expand(n, H, r)], dim=-1)
        out, lse = run_mla_prefill(
            self._native,
            self._native_plan,
            q=qa.contiguous(),
            k=ka.contiguous(),
            v=v.reshape(n, H, V).to(q.dtype).contiguous(),
            softmax_scale=self._jbackend.softmax_scale(spec),
        )
        return (out, lse) if return_lse else out

    def _prefix_chunk(self, q, k, v, layer, q_rope, k_rope, forward_batch):
        """The chunked-prefix-cache path of SGLang's MLA backend: the new tokens attend,
        non-causally, to one chunk of their cached prefixes (K/V already gathered and
        up-projected by the model, ``[chunk_tokens, H, 192]`` / ``[.., H, 128]``).
        Returns ``(o [T, H * 128], lse f32[T, H])``; a request with no keys in the chunk
        gets ``o = 0, lse = -inf`` (SGLang's zero-KV fixup is built in). Merge the
        chunks' results with :meth:`merge_state`. The chunk K/V are imported per call
        (they are fresh tensors each chunk; this is a prefill path, not the decode hot path).
        """
        idx = forward_batch.prefix_chunk_idx
        if idx is None:
            raise ValueError("forward_batch.attn_attend_prefix_cache needs prefix_chunk_idx")
        spec = self._spec(layer)
        md = self.forward_metadata
        H, r, V = spec.num_q_heads, self.config.qk_rope_head_dim, self.config.v_head_dim
        cu_kv = _host(forward_batch.prefix_chunk_cu_seq_lens[idx]).astype(np.int32)
        bs_pad, real = md.cu_seqlens_q.shape[0] - 1, int(np.asarray(md.num_reqs))
        name = f"forward_batch.prefix_chunk_cu_seq_lens[{idx}]"
        if cu_kv.ndim != 1 or cu_kv.shape[0] - 1 not in (real, bs_pad):
            # fewer would leave the last requests without their prefix chunk, silently
            raise BridgeError(
                f"{name} has {cu_kv.shape[0] - 1} requests: the plan has {real} ({bs_pad} with its bucket's padding)"
            )
        chunk_rows = k.shape[0]
        if cu_kv[0] != 0 or (np.diff(cu_kv) < 0).any() or cu_kv[-1] > chunk_rows:
            raise BridgeError(f"{name}={cu_kv.tolist()} must rise from 0 to at most the chunk's {chunk_rows} K/V rows")
        max_given = int(forward_batch.prefix_chunk_max_seq_lens[idx])
        if np.diff(cu_kv).max(initial=0) > max_given:
            raise BridgeError(
                f"{name} holds a request of {int(np.diff(cu_kv).max())} keys > "
                f"forward_batch.prefix_chunk_max_seq_lens[{idx}]={max_given}"
            )
        cu_kv = np.concatenate([cu_kv, np.full(bs_pad + 1 - cu_kv.shape[0], cu_kv[-1], np.int32)])
        max_kv = bucket(max(max_given, 1))
        n = q.shape[0]  # the new tokens (the chunk's K/V rows are another count)
        qj = to_jax_input(_by_heads(q, n, H), "q")
        kt = k.reshape(-1, H, k.shape[-1] if k.dim() == 3 else k.shape[-1] // H)
        kj, vj = to_jax_input(kt, "k"), to_jax_input(v.reshape(-1, H, V), "v")
        qr = None if q_rope is None else to_jax_input(q_rope.reshape(n, H, r), "q_rope")
        kr = None if k_rope is None else to_jax_input(k_rope.reshape(-1, r), "k_rope")
        # (the DLPack imports above order torch's pending work before JAX's)
        o, lse = self._jbackend.forward_prefix_chunk(
            qj,
            kj,
            vj,
            self._shape_spec(layer),
            md.cu_seqlens_q,
            jnp.asarray(cu_kv),
            max_seqlen_q=md.max_seqlen_q,
            max_seqlen_kv=max_kv,
            q_rope=qr,
            k_rope=kr,
        )
        self.sync.after_jax(o)
        return torch.from_dlpack(o.reshape(n, H * V)), torch.from_dlpack(lse)

    def pad_draft_extend_query(self, q, padded_q, seq_lens_q, cu_seqlens_q):
        """SGLang's helper on torch tensors: writes ``q[cu_seqlens_q[b] + i]`` into
        ``padded_q[b, i]`` for ``i < seq_lens_q[b]`` in place and returns ``padded_q``
        (the semantics of :meth:`jattn.MLABackend.pad_draft_extend_query`).
        ``forward_extend`` in ``DRAFT_EXTEND`` mode pads inside, so it never needs this."""
        bs, max_q = self._draft_extend_shapes(q.shape, padded_q, seq_lens_q, cu_seqlens_q, "padded_q")
        i = torch.arange(max_q, device=padded_q.device)[None, :]
        n = seq_lens_q.to(padded_q.device).long()
        valid = i < n[:, None]
        src = cu_seqlens_q.to(padded_q.device).long()[:-1, None] + i
        padded_q[valid] = q[src[valid]].to(padded_q.dtype)
        return padded_q

    def unpad_draft_extend_output(self, raw_out, cu_seqlens_q, seq_lens_q, sum_seq_lens_q: int):
        """SGLang's helper on torch tensors, the inverse of :meth:`pad_draft_extend_query`:
        a new ``[sum_seq_lens_q, ...]`` tensor with row ``cu_seqlens_q[b] + i`` =
        ``raw_out[b, i]`` for ``i < seq_lens_q[b]``."""
        ragged = (int(sum_seq_lens_q), *raw_out.shape[2:])
        bs, max_q = self._draft_extend_shapes(ragged, raw_out, seq_lens_q, cu_seqlens_q, "raw_out", exact=True)
        dev = raw_out.device
        n = seq_lens_q.to(dev).long()
        b = torch.repeat_interleave(torch.arange(bs, device=dev), n, output_size=int(sum_seq_lens_q))
        i = torch.arange(int(sum_seq_lens_q), device=dev) - cu_seqlens_q.to(dev).long()[b]
        return raw_out[b, i]

    @staticmethod
    def _draft_extend_shapes(ragged_shape, padded, seq_lens_q, cu_seqlens_q, name: str, exact=False):
        """The shape and length checks of the JAX helpers, on host copies of the lengths."""
        lens, cu = _host(seq_lens_q), _host(cu_seqlens_q)
        return check_draft_extend_shapes(ragged_shape, tuple(padded.shape), lens, cu, name, exact)

    def merge_state(self, o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
        """``attn_merge_state`` on torch tensors: o [T, H, D] (or [T, H * D] with lse [T, H]),
        natural-log LSE (float, read as f32); both o of one shape and float dtype, both lse
        of one shape. Returns ``(o, lse)`` as torch tensors."""
        for x, name in ((o_a, "o_a"), (lse_a, "lse_a"), (o_b, "o_b"), (lse_b, "lse_b")):
            if not isinstance(x, torch.Tensor):
                raise BridgeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        for x, name in ((lse_a, "lse_a"), (lse_b, "lse_b")):
            if x.dim() != 2:
                raise BridgeError(f"{name} must be [T, H] (natural-log LSE), got shape {tuple(x.shape)}")
            if not x.dtype.is_floating_point:
                raise BridgeError(f"{name} must be a float tensor (natural-log LSE), got dtype {x.dtype}")
        if lse_b.shape != lse_a.shape:
            raise BridgeError(f"lse_b has shape {tuple(lse_b.shape)}, lse_a {tuple(lse_a.shape)}: they must be equal")
        t, h = lse_a.shape
        for x, name in ((o_a, "o_a"), (o_b, "o_b")):
            per_head = x.shape[1] == h if x.dim() == 3 else x.dim() == 2 and h > 0 and x.shape[1] % h == 0
            if x.dim() not in (2, 3) or x.shape[0] != t or not per_head:
                raise BridgeError(
                    f"{name} must be [T, H, D] or [T, H * D] with T, H = {t}, {h} (lse_a's), got shape {tuple(x.shape)}"
                )
            if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise BridgeError(f"{name}.dtype must be bfloat16, float16 or float32, got {x.dtype}")
        if o_b.shape != o_a.shape or o_b.dtype != o_a.dtype:
            raise BridgeError(
                f"o_b ({tuple(o_b.shape)}, {o_b.dtype}) must match o_a ({tuple(o_a.shape)}, {o_a.dtype}) "
                "in shape and dtype"
            )
        o, lse = self._jbackend.merge_state(
            to_jax_input(_by_heads(o_a, t, h), "o_a"),
            to_jax_input(lse_a.float(), "lse_a"),
            to_jax_input(_by_heads(o_b, t, h), "o_b"),
            to_jax_input(lse_b.float(), "lse_b"),
        )
        self.sync.after_jax(o)
        return torch.from_dlpack(o).reshape(o_a.shape), torch.from_dlpack(lse)

    def _prefill(self, q, k, v, layer, q_rope, k_rope, return_lse):
        spec = self._spec(layer)
        md = self.forward_metadata
        H, r, V = spec.num_q_heads, self.config.qk_rope_head_dim, self.config.v_head_dim
        n = v.reshape(-1, H * V).shape[0]
        parts = [q.flatten(1)]  # (not reshape(n, -1): ambiguous at n = 0)
        if q_rope is not None:
            parts.append(q_rope.reshape(n, H * r))
        parts.append(k.flatten(1))
        if k_rope is not None:
            parts.append(k_rope.reshape(n, r))
        parts.append(v.reshape(n, H * V))
        widths = [p.shape[1] for p in parts]
        has_qr, has_kr = q_rope is not None, k_rope is not None
        stage = self._staged(("mla_prefill", H, tuple(widths)), [p.to(q.dtype) for p in parts], md.num_tokens)
        core, spec0 = self._jbackend, self._shape_spec(layer)

        def build():
            def body(stage, kvs, md, *extra):
                t = stage.shape[0]
                offs = np.cumsum([0] + widths)
                cols = iter(stage[:, offs[i] : offs[i + 1]] for i in range(len(widths)))
                qa = next(cols).reshape(t, H, -1)
                qr = next(cols).reshape(t, H, r) if has_qr else None
                ka = next(cols).reshape(t, H, -1)
                kr = next(cols) if has_kr else None
                va = next(cols).reshape(t, H, V)
                o, lse = core.forward_extend(qa, ka, va, spec0, md, q_rope=qr, k_rope=kr, return_lse=True)
                return o.reshape(t, H * V).astype(stage.dtype), (lse,)

            return body

        # The LSE rides in the (non-donated) second output slot.
        fn_key = ("mla_prefill", spec0, tuple(widths))
        fn = self._fns.get(fn_key)
        if fn is None:
            b = build()
            fn = self._fns[fn_key] = jax.jit(lambda s, md, fence: b(s, (), md), keep_unused=True)
        fence = self.sync.before_jax()
        out, (lse,) = fn(stage, md, fence)
        self.sync.after_jax(out)
        o_t = torch.from_dlpack(out)[:n]
        if return_lse:
            return o_t, torch.from_dlpack(lse)[:n]
        return o_t

    def _precompile_call(self, layer, spec, n: int, pool, save_kv_cache: bool):
        R, r, H = self.kv_lora_rank, self.qk_rope_head_dim, spec.num_q_heads
        z = self._zeros
        self.forward_decode(
            z(n, H * R),
            z(n, R),
            None,
            layer,
            save_kv_cache=save_kv_cache,
            q_rope=z(n, H * r),
            k_rope=z(n, r),
            token_to_kv_pool=pool,
        )


def _caller_loc(forward_batch, kwargs):
    """The write slots a caller gives: the ``out_cache_loc`` keyword, else SGLang's
    ``forward_batch.out_cache_loc`` (where its MLA backend writes the latent); None for
    the plan's slots."""
    loc = kwargs.get("out_cache_loc")
    return getattr(forward_batch, "out_cache_loc", None) if loc is None else loc
