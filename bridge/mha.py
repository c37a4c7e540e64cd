"""``TorchMHABackend``: tokenspeed's ``MHAAttnBackend`` interface over jattn's
:class:`~jattn.backends.MHABackend`, on a torch engine's own KV pool.

An adapter only: its jitted bodies unpack the staged inputs, view the pool's layer
as a one-layer :class:`~jattn.kv_cache.PagedKVCache` and call the core backend's
``forward_decode`` / ``forward_extend``. The call machinery (staging, views, jit
cache, fences, per-layer plans) is :mod:`jattn.bridge.call`.
"""

from __future__ import annotations

import jax
import numpy as np
import torch

from jattn.backends import LayerSpec, MHABackend, MHAConfig
from jattn.kv_cache import PagedKVCache

from .call import _BridgeBase
from .checks import INPUT_DTYPES, _check_shape, _rows, check_input_dtype, check_layer_id
from .convert import BridgeError
from .native import run_layer
from .pool import scale_key
from .state import _host_i32, _Plan, _ref, _View

__all__ = ["TorchMHABackend"]


class TorchMHABackend(_BridgeBase):
    """jattn paged MHA/GQA for a torch engine (tokenspeed's ``MHAAttnBackend`` methods).

    Args:
      config: :class:`jattn.MHAConfig` (heads, head_dim, page_size, context_len,
        dtypes, ``spec_num_tokens``, ``kernel_backend``, batch buckets).
      device: torch device of the pool (default: the current CUDA device, else CPU).
      kv_writer: ``"jax"``, ``"torch"`` or ``"auto"`` (see :mod:`jattn.bridge.call`).
      sync: stream fences, ``"auto"`` (default: ``"stream"`` on a GPU where it
        checks out, else ``"event"``), ``"event"``, ``"stream"`` (on XLA's compute
        stream, no JAX call; see :mod:`jattn.bridge.streams`), ``"host"`` or ``"none"``.
      kernels: ``"jax"`` (default: the core backend through JAX, any kernel backend)
        or ``"triton_native"``: the KV write and the attention as jattn's Triton
        kernels launched on torch's current stream, no JAX per layer call, capturable
        in a torch CUDA graph (:mod:`jattn.bridge.native`; ``kv_writer`` and ``sync``
        do not apply).

    Example (CPU)::

        backend = TorchMHABackend(MHAConfig(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4))
        backend.init_forward_metadata(bs, 0, req_pool_indices, seq_lens, req_to_page, ForwardMode.DECODE)
        out = backend.forward_decode(q, k, v, layer, out_cache_loc, pool, bs, save_kv_cache=True)
    """

    def __init__(
        self, config: MHAConfig, *, device=None, kv_writer: str = "auto", sync: str = "auto", kernels: str = "jax"
    ):
        self._jbackend = MHABackend(config)
        if kernels == "triton_native":  # no JAX call per layer: no JAX writer, no fences
            kv_writer, sync = "torch", "none"
        super().__init__(config, device=device, kv_writer=kv_writer, sync=sync, kernels=kernels)

    def fill_block_decode_seq_lens(self, bs: int, block_seq_lens) -> None:
        if self._native is None:
            return super().fill_block_decode_seq_lens(bs, block_seq_lens)
        lens = _host_i32(block_seq_lens, "block_seq_lens")
        md = self._jbackend.fill_block_decode_seq_lens(self.forward_metadata, np.int32(bs), lens)
        self._install(jax.device_get(md), self._num_real_tokens)

    fill_block_decode_seq_lens.__doc__ = _BridgeBase.fill_block_decode_seq_lens.__doc__

    def _pool_views(self, pool, st, spec: LayerSpec, jax_view: bool = True) -> list[_View]:
        """The K and V views of the layer's pool buffers (checked when first seen;
        ``jax_view`` as in :meth:`_view`)."""
        i, hkv = spec.layer_id, spec.num_kv_heads
        check_layer_id(pool, i, "layer.layer_id")
        kb, vb = pool.get_key_buffer(i), pool.get_value_buffer(i)

        def mismatch(dim):
            def msg(shape):
                pool_has = f"{shape[1]} x {shape[2]}" if len(shape) == 3 else f"{shape[1:]} per slot"
                return f"layer {i} has {hkv} KV heads x {dim}, the pool has {pool_has}"

            return msg

        kw = dict(jax_view=jax_view)
        return [
            self._view(
                pool, st, (i, "k"), f"k_buffer[layer {i}]", kb, (hkv, spec.head_dim), mismatch(spec.head_dim), **kw
            ),
            self._view(
                pool, st, (i, "v"), f"v_buffer[layer {i}]", vb, (hkv, spec.head_dim_v), mismatch(spec.head_dim_v), **kw
            ),
        ]

    @staticmethod
    def _check_inputs(q, k, v, spec: LayerSpec, sinks=None) -> None:
        """q/k/v shapes against the layer, their dtypes (floating; the paths that stage k/v
        beside q also need q's), and the sinks' shape (slow path: the hot-path plans are
        keyed on them)."""
        if (k is None) != (v is None):
            raise ValueError("k and v must both be given or both be None")
        hq, hkv, d, dv = spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v
        n = _rows(q, "q")
        _check_shape(q, "q", n, ((hq * d,), (hq, d)), "[tokens, tp_q_head_num * head_dim]")
        if q.dtype not in INPUT_DTYPES:
            raise BridgeError(f"q.dtype={q.dtype} is not supported (the step's inputs are staged in q's dtype)")
        if k is not None:
            _check_shape(k, "k", n, ((hkv * d,), (hkv, d)), "[tokens, tp_k_head_num * head_dim] (q's tokens)")
            _check_shape(v, "v", n, ((hkv * dv,), (hkv, dv)), "[tokens, tp_v_head_num * v_head_dim] (q's tokens)")
            check_input_dtype(k, "k")
            check_input_dtype(v, "v")
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (hq,)):
            got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise BridgeError(f"sinks must have shape ({hq},) (one per query head), got {got}")

    def _run(self, kind, q, k, v, layer, out_cache_loc, pool, save_kv_cache, sinks):
        decode = kind == "decode"
        if self._plan_decode is not decode:
            serves = "DECODE, TARGET_VERIFY and DRAFT_BLOCK plans" if decode else "EXTEND and DRAFT_EXTEND plans"
            self._check_mode(f"forward_{kind}", False, serves, "forward_extend" if decode else "forward_decode")
        self._check_tokens("q", q.shape[0])
        if self._native is not None:
            spec = self._spec(layer)
            self._check_inputs(q, k, v, spec, sinks)
            kv, vv = self._pool_views(pool, self._pool_state(pool), spec, jax_view=False)
            loc = None
            if save_kv_cache and k is not None and self._native_plan is not None:
                slots = kv.torch.shape[0] * self.page_size
                loc = self._out_loc(out_cache_loc, q.shape[0], slots, self._native_plan.tensors["out_cache_loc"])
            return run_layer(
                self._native,
                self._native_plan,
                spec=spec,
                q=q,
                k=k,
                v=v,
                k_buf=kv.torch,
                v_buf=vv.torch,
                out_cache_loc=loc,
                page_size=self.page_size,
                save_kv_cache=save_kv_cache,
                sinks=sinks,
                decode=decode,
                batch_invariant=self.config.batch_invariant,
            )
        st = self._pool_state(pool)
        # The plan does not depend on which sinks tensor is passed (it reads them per call);
        # it does on the layer's scales (``scale_key``: attribute reads, no tensor value),
        # which a caller may set after a warm-up call.
        pkey = (
            kind,
            id(layer),
            scale_key(layer),
            self._md_sig,
            bool(save_kv_cache),
            q.shape,
            q.dtype,
            None if k is None else (k.shape, k.dtype),
            None if v is None else (v.shape, v.dtype),
            sinks is None,
        )
        if self.fast_path:
            ent = st.plans.get(pkey)
            if ent is not None and ent.ref() is layer:
                out = ent.fn(pool, layer, (self._param(sinks),), q, k, v, out_cache_loc)
                if out is not None:
                    return out
                del st.plans[pkey]  # a pool buffer moved: re-import on the slow path
        return self._run_slow(kind, q, k, v, layer, out_cache_loc, pool, save_kv_cache, sinks, st, pkey)

    def _run_slow(self, kind, q, k, v, layer, out_cache_loc, pool, save_kv_cache, sinks, st, pkey):
        spec = self._spec(layer)
        md = self._md_call
        if md is None:
            raise RuntimeError("call init_forward_metadata (or a cuda-graph init) first")
        self._check_inputs(q, k, v, spec, sinks)
        hq, hkv, d, dv = spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v
        n = q.shape[0]
        rows = md.num_tokens
        has_kv = k is not None
        views = self._pool_views(pool, st, spec)
        jax_writes = save_kv_cache and has_kv and self.kv_writer == "jax"
        torch_writes = save_kv_cache and has_kv and self.kv_writer == "torch"
        if torch_writes:
            loc = self._out_loc(out_cache_loc, n, views[0].torch.shape[0] * self.page_size, self._loc_t)
            pool.set_kv_buffer(layer, loc, k.reshape(n, hkv, d), v.reshape(n, hkv, dv), spec.k_scale, spec.v_scale)
        # Staged: q, and the new K/V where the core may read them (a JAX-side write; an
        # extend, which runs as a ragged prefill on them when no request has a prefix).
        with_kv = has_kv and (jax_writes or kind == "extend")
        parts = [q.reshape(n, hq * d)] + ([k.reshape(n, hkv * d), v.reshape(n, hkv * dv)] if with_kv else [])
        stage = self._staged(("mha", kind, hq, hkv, d), parts, rows, names=("q", "k", "v"))
        sinks_j = self._param(sinks)
        core, spec0 = self._jbackend, self._shape_spec(layer)

        def build():
            def body(stage, kvs, md, *extra):
                t = stage.shape[0]
                qa = stage[:, : hq * d].reshape(t, hq, d)
                ka = va = None
                if with_kv:
                    ka = stage[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
                    va = stage[:, (hq + hkv) * d :].reshape(t, hkv, dv)
                kc, vc = kvs if jax_writes else extra[1:3]
                cache = PagedKVCache(k=(kc,), v=(vc,))
                if kind == "decode":
                    o, cache = core.forward_decode(
                        qa, ka, va, spec0, cache, md, save_kv_cache=jax_writes, sinks=extra[0]
                    )
                else:
                    o, cache = core.forward_extend(
                        qa,
                        ka,
                        va,
                        spec0,
                        cache,
                        md,
                        save_kv_cache=jax_writes,
                        sinks=extra[0],
                        kv_in_cache=not jax_writes,
                    )
                return o.astype(stage.dtype), ((cache.k[0], cache.v[0]) if jax_writes else ())

            return body

        # Read-only calls pass the pool views as extra (non-donated) arguments.
        extra = (sinks_j,)
        if not jax_writes:
            extra = extra + (views[0].jax, views[1].jax)
        fkey = ("mha", kind, spec0, jax_writes, with_kv, sinks_j is not None, self.kv_cache_dtype)
        layer_key = ("mha", kind, spec.layer_id)
        out = self._call(fkey, build, layer_key, stage, views if jax_writes else [], rows, hq * dv, q.dtype, md, extra)
        if (
            self.fast_path
            and self._md_sig is not None
            and q.dim() == 2
            and (not has_kv or (k.dim() == 2 and v.dim() == 2))
        ):
            plan = self._mha_plan(
                kind, fkey, layer_key, spec, n, rows, with_kv, jax_writes, torch_writes, views, q.dtype
            )
            if plan is not None:
                st.plans[pkey] = _Plan(_ref(layer, st.plans, pkey), plan)
        return out[:n]

    def _mha_plan(self, kind, fkey, layer_key, spec, n, rows, with_kv, jax_writes, torch_writes, views, dtype):
        hkv, d, dv, hq = spec.num_kv_heads, spec.head_dim, spec.head_dim_v, spec.num_q_heads
        width = hq * d + (hkv * (d + dv) if with_kv else 0)
        ent = self._stage.get((("mha", kind, hq, hkv, d), rows, width, dtype))
        if ent is None:
            return None
        stage_n, stage_j = ent[0][:n], ent[1]
        i, ks, vs = spec.layer_id, spec.k_scale, spec.v_scale
        slots, out_loc = views[0].torch.shape[0] * self.page_size, self._out_loc
        checks = (
            (lambda pool: pool.get_key_buffer(i), views[0].torch.data_ptr(), views[0].src_shape),
            (lambda pool: pool.get_value_buffer(i), views[1].torch.data_ptr(), views[1].src_shape),
        )
        cat = torch.cat

        def prep(pool, layer, q, k, v, loc):
            if torch_writes:
                loc = out_loc(loc, n, slots, self._loc_t)
                pool.set_kv_buffer(layer, loc, k.view(n, hkv, d), v.view(n, hkv, dv), ks, vs)
            if with_kv:
                cat((q, k, v), dim=1, out=stage_n)
            else:
                stage_n.copy_(q)  # only q is staged: one copy, no torch.cat

        return self._make_plan(
            fkey,
            layer_key,
            ent[0],
            stage_j,
            n,
            rows,
            hq * dv,
            dtype,
            views if jax_writes else [],
            [] if jax_writes else views,
            prep,
            checks,
        )

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer,
        out_cache_loc: torch.Tensor | None = None,
        token_to_kv_pool=None,
        bs: int | None = None,
        save_kv_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """Paged decode (also multi-token: target verify, DFLASH draft block).

        Args:
          q: [bs * q_len, tp_q_head_num * head_dim] (or [.., heads, head_dim]): one row per
            new token of the installed plan (``bs`` of ``init_forward_metadata``), or the
            rows of its bucket, padding included; other counts are refused.
          k, v: the new tokens' K/V [bs * q_len, tp_k_head_num * head_dim], or None
            (then they must be in the pool already).
          layer: see :class:`jattn.bridge.TorchAttentionLayer`.
          out_cache_loc: slots of the new tokens, 1-D integer (used by
            ``kv_writer="torch"``; the JAX writer uses the plan's slots). They must be the
            plan's slots (the attention reads those): where :attr:`check_slot_values` says,
            they are range-checked and compared with the plan's (the real tokens' rows).
            token_to_kv_pool: the torch pool. bs: requests.
          save_kv_cache: write k/v into the pool first (in place). Default False, as in
            tokenspeed's backend: k/v given without it are not written, and the attention
            reads what the pool holds at their slots (the engine must have written them).
          kwargs: ``sinks`` f32[tp_q_head_num] (gpt-oss).

        Returns:
          [bs * q_len, tp_q_head_num * v_head_dim] torch tensor in q's dtype; on the GPU a
          buffer the next call of this layer id and shape writes again (clone to keep it).
        """
        if token_to_kv_pool is None:
            raise ValueError("token_to_kv_pool is required")
        return self._run("decode", q, k, v, layer, out_cache_loc, token_to_kv_pool, save_kv_cache, kwargs.get("sinks"))

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer,
        out_cache_loc: torch.Tensor | None = None,
        token_to_kv_pool=None,
        bs: int | None = None,
        save_kv_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """Extend (ragged new tokens over a paged prefix; prefill when no prefix).

        q/k/v are token-major [num_tokens, heads * head_dim], num_tokens the plan's
        ``sum(extend_seq_lens)`` (or its bucket's rows); returns
        [num_tokens, tp_q_head_num * v_head_dim]. Over a cached prefix the new K/V are
        read from the pool: ``save_kv_cache=True`` writes them first; with
        ``save_kv_cache=False`` the engine must have written them.
        """
        if token_to_kv_pool is None:
            raise ValueError("token_to_kv_pool is required")
        if k is None or v is None:
            raise ValueError("forward_extend needs k and v")
        return self._run("extend", q, k, v, layer, out_cache_loc, token_to_kv_pool, save_kv_cache, kwargs.get("sinks"))

    def _precompile_call(self, layer, spec: LayerSpec, n: int, pool, save_kv_cache: bool):
        if pool is None:
            raise ValueError("token_to_kv_pool is required")
        q, k = self._zeros(n, spec.num_q_heads * spec.head_dim), self._zeros(n, spec.num_kv_heads * spec.head_dim)
        v = self._zeros(n, spec.num_kv_heads * spec.head_dim_v)
        self.forward_decode(q, k, v, layer, None, pool, n, save_kv_cache=save_kv_cache)
