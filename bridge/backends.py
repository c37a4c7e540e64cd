"""Torch-facing attention backends with the seeds' methods, running jattn's jitted JAX.

``TorchMHABackend`` mirrors tokenspeed's MHA backend and ``TorchMLABackend``
SGLang's TRTLLM MLA backend: torch tensors in, torch tensors out, metadata kept on
``self`` between ``init_forward_metadata`` and the per-layer ``forward_*`` calls.

How a call avoids per-call DLPack conversions (DESIGN.md host-overhead table):

* **KV pool views** are imported once per (pool buffer, layer) and reused.
* **Inputs** (q, k, v, ...) are copied by one ``torch.cat(..., out=)`` into a
  persistent staging buffer per (call signature, bucket), imported once.
* **Outputs**: on the GPU the jitted call writes into a persistent torch output
  buffer per (layer, call signature, bucket), donated and aliased (the returned
  tensor is a view of it and stays valid until the same layer's next call with the
  same bucket, like a CUDA-graph output). On the CPU the result is exported.
* **Metadata** is planned on the host once per step and put on the device in one
  transfer; every layer reuses it. Same bucket, new values: no retrace.
* **KV writes** (``save_kv_cache=True``): ``kv_writer="jax"`` (GPU default) writes
  inside the jitted call with the layer's K/V views donated and aliased back, so
  the torch pool is updated in place; the first call per layer checks the output
  pointer equals the torch pointer and raises otherwise (never a silent pool copy).
  ``kv_writer="torch"`` (CPU default) calls the pool's own ``set_kv_buffer`` /
  ``set_mla_kv_buffer`` (in place, on torch's stream) and JAX only reads. XLA's
  CPU client does not alias donated DLPack-imported buffers (it copies them,
  measured with jax 0.10.2), so ``kv_writer="jax"`` is refused on the CPU.
* **Streams**: one fence each way per call, see :mod:`jattn.bridge.streams`.

The seeds' CUDA-graph trio: ``init_cuda_graph_state`` chooses the batch buckets;
``init_forward_metadata_capture_cuda_graph`` installs an all-padding plan of a
bucket, so the layer calls that follow compile (the "capture");
``init_forward_metadata_replay_cuda_graph`` plans new values into the same bucket
(the "replay": the compiled calls run again, nothing retraces).
:meth:`precompile` compiles buckets ahead of time.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jattn import ops
from jattn.backends import ForwardMode, LayerSpec, MHABackend, MHAConfig, MLABackend, MLAConfig
from jattn.backends import _front_pad, _front_unpad
from jattn.kv_cache import cache_dtype, is_fp8
from jattn.metadata import DecodeMetadata, ExtendMetadata, bucket, plan_extend

from .convert import BridgeError, SUPPORTED_DTYPES, check_shareable, to_jax, torch_dtype
from .pool import layer_spec
from .streams import StreamSync

__all__ = ["TorchMHABackend", "TorchMLABackend", "DRAFT_EXTEND"]

#: MLA draft-extend mode (per-request query lengths vary); jattn's ForwardMode
#: has no member for it.
DRAFT_EXTEND = "draft_extend"


def _host(x):
    """numpy view of a host value (torch CPU/GPU tensor, list, numpy)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _mode(m):
    if isinstance(m, ForwardMode) or m == DRAFT_EXTEND:
        return m
    if isinstance(m, str):
        return ForwardMode(m)
    name = getattr(m, "name", None)  # another engine's enum: map by name
    if name:
        n = name.lower()
        if n in ("draft_extend", "draft_extend_v2"):
            return DRAFT_EXTEND
        if n in ("extend", "mixed", "prefill"):
            return ForwardMode.EXTEND
        return ForwardMode(n)
    raise ValueError(f"unknown forward_mode {m!r}")


def _slim(md):
    """``md`` without the fields the bridge's jitted bodies never read (positions,
    request count, prefix lengths): each array argument of a jitted call is host
    time on every call (~3 us on the H200 host)."""
    drop = {f: None for f in ("positions", "num_reqs", "prefix_lens") if hasattr(md, f)}
    return dataclasses.replace(md, **drop)


@dataclasses.dataclass
class _View:
    """A torch buffer and the JAX array viewing it (replaced by the aliased output
    after each donating call)."""

    torch: torch.Tensor
    jax: jax.Array
    verified: bool = False
    src_shape: tuple = ()


class _BridgeBase:
    """Staging, views, jit cache, metadata and fences shared by both backends."""

    _jbackend: MHABackend | MLABackend

    def __init__(self, config, *, device=None, kv_writer: str = "auto", sync: str = "auto"):
        self.config = config
        self.platform = jax.default_backend()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.platform == "gpu" else torch.device("cpu")
        self.device = torch.device(device)
        if kv_writer == "auto":
            kv_writer = "jax" if self.platform == "gpu" else "torch"
        if kv_writer not in ("jax", "torch"):
            raise ValueError(f"kv_writer={kv_writer!r} must be 'auto', 'jax' or 'torch'")
        if kv_writer == "jax" and self.platform != "gpu":
            raise BridgeError(
                "kv_writer='jax' needs the GPU: XLA's CPU client copies donated DLPack-imported "
                "buffers instead of aliasing them, so writes would not reach the torch pool; use "
                "kv_writer='torch' (the pool's own set_kv_buffer, in place)"
            )
        self.kv_writer = kv_writer
        self.alias_out = self.platform == "gpu"
        self.sync = StreamSync(sync, self.device if self.platform == "gpu" else None)
        self.page_size = config.page_size
        self.kv_cache_dtype = torch_dtype(cache_dtype(config.kv_cache_dtype))
        self.q_dtype = torch_dtype(cache_dtype(config.dtype))
        self._views: dict = {}
        self._stage: dict = {}
        self._outs: dict = {}
        self._fns: dict = {}
        self._specs: dict = {}
        self._params: dict = {}
        self._plans: dict = {}  # hot-path closures, see _make_plan
        #: use the per-(layer, pool, call signature, plan structure) closures (False:
        #: re-derive everything per call, as before; for benchmarks and debugging)
        self.fast_path = True
        self._md_sigs: dict = {}
        self._md_sig = None  # small int naming the installed plan's structure (mode, treedef, shapes)
        self.forward_metadata = None  # device pytree of the current step
        self._md_call = None  # the same without the fields no jitted body reads (fewer call arguments)
        self.forward_mode = None
        self._loc_t = None  # torch out_cache_loc of the real tokens (torch-writer path)
        self._num_real_tokens = 0
        self.cuda_graph_metadata: dict = {}

    # ---------------------------------------------------------------- metadata

    def _install(self, md, mode, num_real_tokens: int):
        md_dev = jax.device_put(md)
        self.forward_metadata, self.forward_mode = md_dev, mode
        self._md_call = _slim(md_dev)
        leaves, treedef = jax.tree_util.tree_flatten(md_dev)
        sig = (str(mode), treedef, tuple((x.shape, x.dtype) for x in leaves))
        self._md_sig = self._md_sigs.setdefault(sig, len(self._md_sigs))
        loc = np.asarray(md.out_cache_loc)  # padding rows' slots are the dummy page's
        self._loc_t = torch.from_numpy(loc.astype(np.int64)).to(self.device, non_blocking=True)
        self._num_real_tokens = num_real_tokens
        return md_dev

    @property
    def stream(self):
        """XLA's compute stream as a ``torch.cuda.Stream`` (GPU with ``sync="stream"``,
        the default where it is safe; else None). Running the engine's torch work on
        it (``with torch.cuda.stream(backend.stream):``) orders torch and jattn by one
        stream, so the per-call fences are skipped: the lowest host time per call."""
        return self.sync.stream

    def init_cuda_graph_state(self, max_bs: int, *args, **kwargs):
        """Chooses the batch buckets (the seeds' captured batch sizes) up to ``max_bs``."""
        return self._jbackend.init_cuda_graph_state(max_bs)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int | None = None,
                                                 req_pool_indices=None, seq_lens=None,
                                                 forward_mode=ForwardMode.DECODE, **kwargs):
        """Installs an all-padding plan of bucket ``bs``: the layer calls that follow
        compile the bucket (CUDA-graph capture). Their outputs are meaningless."""
        mode = _mode(forward_mode)
        md = self._jbackend.init_forward_metadata_capture_cuda_graph(bs, mode)
        md_dev = self._install(md, mode, 0)
        self.cuda_graph_metadata[bs] = md_dev
        return md_dev

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens, req_to_page=None,
                                                forward_mode=ForwardMode.DECODE, **kwargs):
        """Plans new values into the bucket of ``bs`` (CUDA-graph replay: no retrace)."""
        return self.init_forward_metadata(bs, 0, req_pool_indices, seq_lens, req_to_page, forward_mode, **kwargs)

    def init_forward_metadata(self, bs: int, num_extends: int = 0, req_pool_indices=None, seq_lens=None,
                              req_to_page=None, forward_mode=ForwardMode.DECODE, extend_seq_lens=None,
                              extend_seq_lens_cpu=None, extend_prefix_lens=None, extend_prefix_lens_cpu=None,
                              **kwargs):
        """Plans one step (host side) and puts the plan on the device once.

        Args follow the MHA seed: ``req_pool_indices`` int[>= bs], ``seq_lens`` int[>= bs]
        (new tokens included), ``req_to_page`` int[pool, max_pages] page ids,
        ``forward_mode`` (:class:`jattn.ForwardMode`, its value, or
        :data:`DRAFT_EXTEND`), and for extends ``extend_seq_lens`` (or ``_cpu``) and
        optionally ``extend_prefix_lens``. Host (CPU) tensors avoid a device sync.
        """
        mode = _mode(forward_mode)
        if req_to_page is None:
            req_to_page = kwargs.pop("req_to_token_pages", None)
        if req_pool_indices is None or seq_lens is None or req_to_page is None:
            raise ValueError("init_forward_metadata needs req_pool_indices, seq_lens and req_to_page")
        rpi, sl, r2p = _host(req_pool_indices)[:bs], _host(seq_lens)[:bs], _host(req_to_page)
        ext = _host(extend_seq_lens_cpu if extend_seq_lens_cpu is not None else extend_seq_lens)
        pre = _host(extend_prefix_lens_cpu if extend_prefix_lens_cpu is not None else extend_prefix_lens)
        if mode is ForwardMode.EXTEND or mode == DRAFT_EXTEND:
            if ext is None:
                raise ValueError(f"extend_seq_lens is required for {mode}")
            cfg = self.config
            md = plan_extend(
                sl, ext[:bs], page_size=cfg.page_size, req_to_page=r2p, req_pool_indices=rpi,
                extend_prefix_lens=None if pre is None else pre[:bs],
                batch_buckets=self._jbackend.batch_buckets, max_pages=cfg.max_num_pages,
                num_pages=cfg.num_pages,
            )
            n = int(np.asarray(ext[:bs]).sum())
        else:
            md = self._jbackend.init_forward_metadata(bs, rpi, sl, r2p, mode)
            n = bs * md.max_seqlen_q
        return self._install(md, mode, n)

    def support_kv_cache_prewrite(self, forward_mode=None) -> bool:
        """Decode writes the new K/V before attention reads them (they count in ``L``)."""
        return forward_mode is not None and _mode(forward_mode) in (
            ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK)

    # ---------------------------------------------------------------- buffers

    def _view(self, key, buf: torch.Tensor, shape) -> _View:
        """The cached JAX view of a pool buffer (imported when first seen or replaced)."""
        v = self._views.get(key)
        if v is not None and v.torch.data_ptr() == buf.data_ptr() and v.src_shape == buf.shape:
            return v
        check_shareable(buf, f"KV pool buffer {key}")
        t = buf.view(shape)
        v = _View(t, jax.dlpack.from_dlpack(t, copy=False), src_shape=buf.shape)
        self._views[key] = v
        return v

    def _staged(self, key, parts: Sequence[torch.Tensor], rows: int) -> jax.Array:
        """Copies ``parts`` (each [n, ...]) side by side into the persistent staging
        buffer ``[rows, sum of widths]`` of ``key``; returns its (cached) JAX view."""
        n = parts[0].shape[0]
        flat = [p.reshape(n, -1) for p in parts]
        dtype = flat[0].dtype
        width = sum(p.shape[1] for p in flat)
        skey = (key, rows, width, dtype)
        ent = self._stage.get(skey)
        if ent is None:
            if dtype not in SUPPORTED_DTYPES:
                raise BridgeError(f"input dtype {dtype} is not supported")
            t = torch.zeros(rows, width, dtype=dtype, device=self.device)
            ent = self._stage[skey] = (t, jax.dlpack.from_dlpack(t, copy=False))
        if n > rows:
            raise ValueError(f"{n} input rows exceed the plan's {rows} (call init_forward_metadata first)")
        if any(p.dtype != dtype for p in flat):
            raise TypeError(f"inputs must share one dtype, got {[p.dtype for p in flat]}")
        if len(flat) == 1:
            ent[0][:n].copy_(flat[0])
        else:
            torch.cat(flat, dim=1, out=ent[0][:n])
        return ent[1]

    def _out(self, key, rows: int, width: int, dtype) -> _View:
        okey = (key, rows, width, dtype)
        v = self._outs.get(okey)
        if v is None:
            t = torch.zeros(rows, width, dtype=dtype, device=self.device)
            v = self._outs[okey] = _View(t, jax.dlpack.from_dlpack(t, copy=False))
        return v

    def _param(self, x: torch.Tensor | None):
        """A per-layer constant (sinks) imported once, keyed by its pointer."""
        if x is None:
            return None
        key = (x.data_ptr(), tuple(x.shape), x.dtype)
        a = self._params.get(key)
        if a is None:
            a = self._params[key] = jax.dlpack.from_dlpack(x.detach().contiguous().float(), copy=True)
        return a

    def _spec(self, layer) -> LayerSpec:
        s = self._specs.get(id(layer))
        if s is None or s[0] is not layer:
            spec = layer_spec(layer)
            s = self._specs[id(layer)] = (layer, spec, dataclasses.replace(spec, layer_id=0))
        return s[1]

    def _shape_spec(self, layer) -> LayerSpec:
        """The layer's spec without its id (layers of one shape share compiled calls)."""
        self._spec(layer)
        return self._specs[id(layer)][2]

    # ---------------------------------------------------------------- the call

    def _call(self, fkey, build, layer_key, stage, kv_views: list[_View], out_rows: int, out_width: int,
              out_dtype, md, extra=()):
        """Runs the jitted function of ``fkey`` (built by ``build`` once) and returns
        the torch output ``[out_rows, out_width]``. Donates (and then re-points) the KV
        views when they are written; aliases the output on the GPU."""
        writes = bool(kv_views)
        fenced = self.sync.jax_fence
        fn = self._fns.get(fkey + (fenced,))
        if fn is None:
            body = build()
            # Event fences: the call takes the torch->JAX fence and returns a token for
            # the JAX->torch one. Other modes pass and return nothing extra.
            if self.alias_out:
                def wrapped(stage, kvs, out_buf, md, extra, *fence):
                    del out_buf
                    o, kv = body(stage, kvs, md, *extra)
                    return (o, kv, fence[0][0] + 1) if fence else (o, kv)  # a never-donated token
                donate = (1, 2) if writes else (2,)
            else:
                def wrapped(stage, kvs, md, extra, *fence):
                    o, kv = body(stage, kvs, md, *extra)
                    return (o, kv, fence[0][0] + 1) if fence else (o, kv)
                donate = (1,) if writes else ()
            fn = self._fns[fkey + (fenced,)] = jax.jit(wrapped, donate_argnums=donate, keep_unused=True)
        kvs = [v.jax for v in kv_views]
        if self.alias_out:
            ov = self._out(layer_key, out_rows, out_width, out_dtype)
            out, new_kvs, done = self._invoke(fn, fenced, stage, kvs, ov, md, tuple(extra))
            if not ov.verified:
                if out.unsafe_buffer_pointer() != ov.torch.data_ptr():
                    # Not a pool: fall back to exporting outputs (one DLPack export per call).
                    warnings.warn("jattn.bridge: the output buffer was not aliased; exporting outputs instead")
                    self.alias_out = False
                    self._fns.clear()
                    self._outs.clear()
                    self._plans.clear()
                    for v, a in zip(kv_views, new_kvs):
                        v.jax = a
                    self.sync.after_jax(done)
                    return torch.from_dlpack(out)
                ov.verified = True
        else:
            out, new_kvs, done = self._invoke(fn, fenced, stage, kvs, None, md, tuple(extra))
        for v, a in zip(kv_views, new_kvs):
            v.jax = a
            if not v.verified:
                self._check_alias(a, v.torch, "KV pool buffer")
                v.verified = True
        # Fence on the token, not on ``out``: an exported-then-donated buffer makes
        # XLA block the host at the next donation (measured on the H200: +250 us/call).
        self.sync.after_jax(done)
        if self.alias_out:
            return ov.torch
        return torch.from_dlpack(out)

    def _invoke(self, fn, fenced: bool, stage, kvs, ov: _View | None, md, extra):
        """One jitted call with the torch->JAX fence before it: the fence goes in as the
        last argument when ``fenced`` (event mode) and a token comes back to fence on;
        otherwise the output is what the JAX->torch fence waits for. With ``ov`` (the
        aliased output view) its buffer is passed (donated) and re-pointed. Returns
        ``(out, new_kvs, done)``."""
        f = self.sync.before_jax()
        args = (stage, kvs, md, extra) if ov is None else (stage, kvs, ov.jax, md, extra)
        out, new_kvs, *tok = fn(*args, *((f,) if fenced else ()))
        if ov is not None:
            ov.jax = out
        return out, new_kvs, (tok[0] if tok else out)

    def _make_plan(self, fkey, layer_key, stage_t: torch.Tensor, stage_j, n: int, out_rows: int, out_width: int,
                   out_dtype, kv_views: list[_View], extra_head: tuple, ro_views: list[_View], prep, checks):
        """The hot path of one (layer, pool, call signature, plan structure): a closure
        that re-derives nothing (no specs, keys, views or closures per call).

        ``prep(*inputs)`` does the torch-side work (torch KV write, staging copy into
        ``stage_t[:n]``); ``checks`` are ``(getter, data_ptr)`` pairs of pool buffers:
        a moved buffer returns None and the caller takes the slow path (re-import).
        Built only after a slow-path call of the same key verified every alias."""
        sync = self.sync
        fenced = sync.jax_fence
        fn = self._fns.get(fkey + (fenced,))
        if fn is None or any(not v.verified for v in kv_views):
            return None
        after, invoke = sync.after_jax, self._invoke
        on_gpu = self.platform == "gpu"
        ov = None
        if self.alias_out:
            ov = self._outs.get((layer_key, out_rows, out_width, out_dtype))
            if ov is None or not ov.verified:
                return None
            out_t = ov.torch[:n]
        nkv = len(kv_views)

        def plan(*inputs):
            if sync.jax_fence != fenced:
                return None  # the sync mode changed: rebuild on the slow path
            for get, ptr in checks:
                if get().data_ptr() != ptr:
                    return None
            prep(*inputs)
            extra = extra_head + tuple(v.jax for v in ro_views)
            kvs = [v.jax for v in kv_views]
            out, new_kvs, done = invoke(fn, fenced, stage_j, kvs, ov, self._md_call, extra)
            if nkv:
                for v, a in zip(kv_views, new_kvs):
                    v.jax = a
            if self.alias_out:
                after(done)
                return out_t
            if on_gpu:
                after(done)
            # CPU: the export below waits for the result (DLPack on the CPU blocks until
            # the buffer is ready; outputs become ready together), so it is the fence.
            return torch.from_dlpack(out)[:n]
        return plan

    @staticmethod
    def _check_alias(a: jax.Array, t: torch.Tensor, what: str):
        if a.unsafe_buffer_pointer() != t.data_ptr():
            raise BridgeError(
                f"the jitted call did not write the {what} in place (JAX output at "
                f"{a.unsafe_buffer_pointer():#x}, torch buffer at {t.data_ptr():#x}); refusing to go on "
                "with a copy. Use kv_writer='torch'."
            )

    def precompile(self, layers, buckets: Sequence[int] | None = None, forward_mode=ForwardMode.DECODE,
                   token_to_kv_pool=None):
        """Compiles the decode calls of ``layers`` for each batch bucket (capture ahead
        of time) by running them on all-padding plans. Needs the KV pool."""
        raise NotImplementedError  # overridden


# ============================================================================= MHA


class TorchMHABackend(_BridgeBase):
    """jattn paged MHA/GQA for a torch engine (the tokenspeed MHA seed's interface).

    Args:
      config: :class:`jattn.MHAConfig` (heads, head_dim, page_size, context_len,
        dtypes, ``spec_num_tokens``, ``kernel_backend``, batch buckets).
      device: torch device of the pool (default: the current CUDA device, else CPU).
      kv_writer: ``"jax"``, ``"torch"`` or ``"auto"`` (see the module docstring).
      sync: stream fences, ``"auto"`` (default: ``"stream"`` on a GPU where it
        checks out, else ``"event"``), ``"event"``, ``"stream"`` (on XLA's compute
        stream, no JAX call; see :mod:`jattn.bridge.streams`), ``"host"`` or ``"none"``.

    Example (CPU)::

        backend = TorchMHABackend(MHAConfig(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4))
        backend.init_forward_metadata(bs, 0, req_pool_indices, seq_lens, req_to_page, ForwardMode.DECODE)
        out = backend.forward_decode(q, k, v, layer, out_cache_loc, pool, bs, save_kv_cache=True)
    """

    def __init__(self, config: MHAConfig, *, device=None, kv_writer: str = "auto", sync: str = "auto"):
        self._jbackend = MHABackend(config)
        super().__init__(config, device=device, kv_writer=kv_writer, sync=sync)

    def _pool_views(self, pool, spec: LayerSpec) -> list[_View]:
        i, ps = spec.layer_id, self.page_size
        kb, vb = pool.get_key_buffer(i), pool.get_value_buffer(i)
        if kb.dtype != self.kv_cache_dtype:
            raise TypeError(f"pool dtype {kb.dtype} differs from config.kv_cache_dtype {self.kv_cache_dtype}")
        return [
            self._view((id(pool), i, "k"), kb, (-1, ps, spec.num_kv_heads, spec.head_dim)),
            self._view((id(pool), i, "v"), vb, (-1, ps, spec.num_kv_heads, spec.head_dim_v)),
        ]

    def _run(self, kind, q, k, v, layer, out_cache_loc, pool, save_kv_cache, sinks):
        pkey = (kind, id(layer), id(pool), self._md_sig, bool(save_kv_cache), q.shape, q.dtype,
                None if k is None else (k.shape, k.dtype), None if v is None else (v.shape, v.dtype),
                None if sinks is None else (sinks.data_ptr(), sinks.shape))
        plan = self._plans.get(pkey) if self.fast_path else None
        if plan is not None:
            out = plan(q, k, v, out_cache_loc)
            if out is not None:
                return out
            del self._plans[pkey]  # a pool buffer moved: re-import on the slow path
        out = self._run_slow(kind, q, k, v, layer, out_cache_loc, pool, save_kv_cache, sinks, pkey)
        return out

    def _run_slow(self, kind, q, k, v, layer, out_cache_loc, pool, save_kv_cache, sinks, pkey):
        spec = self._spec(layer)
        md = self._md_call
        if md is None:
            raise RuntimeError("call init_forward_metadata (or a cuda-graph init) first")
        hq, hkv, d, dv = spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v
        if spec.head_dim != spec.head_dim_v:
            raise NotImplementedError("the MHA seed requires qk_head_dim == v_head_dim")
        n = q.shape[0] if q.dim() == 2 else q.reshape(-1, hq * d).shape[0]
        rows = md.num_tokens
        has_kv = k is not None
        if (k is None) != (v is None):
            raise ValueError("k and v must both be given or both be None")
        views = self._pool_views(pool, spec)
        fp8 = self.kv_cache_dtype == torch.float8_e4m3fn
        jax_writes = save_kv_cache and has_kv and self.kv_writer == "jax"
        if save_kv_cache and has_kv and self.kv_writer == "torch":
            loc = (self._loc_t if out_cache_loc is None else out_cache_loc)[:n]
            pool.set_kv_buffer(layer, loc, k.reshape(n, hkv, d), v.reshape(n, hkv, dv), spec.k_scale, spec.v_scale)
        parts = [q.reshape(n, hq * d)] + ([k.reshape(n, hkv * d), v.reshape(n, hkv * dv)] if jax_writes else [])
        if kind == "extend" and not jax_writes and not md.has_prefix and not fp8:
            # ragged prefill reads the new K/V directly: stage them too
            if not has_kv:
                raise ValueError("forward_extend needs k and v")
            parts = [q.reshape(n, hq * d), k.reshape(n, hkv * d), v.reshape(n, hkv * dv)]
        stage = self._staged(("mha", kind, hq, hkv, d), parts, rows)
        nparts = len(parts)
        sinks_j = self._param(sinks)
        opts = self._jbackend.attention_options(spec, fp8)
        causal_off = spec.non_causal

        def build():
            def body(stage, kvs, md, *extra):
                sinks_a = extra[0] if extra else None
                t = stage.shape[0]
                qa = stage[:, : hq * d].reshape(t, hq, d)
                kc, vc = kvs if kvs else (None, None)
                if nparts == 3:
                    ka = stage[:, hq * d: (hq + hkv) * d].reshape(t, hkv, d)
                    va = stage[:, (hq + hkv) * d:].reshape(t, hkv, dv)
                causal = md.is_causal and not causal_off
                if jax_writes:
                    kc, vc = ops.set_kv_buffer(kc, vc, md.out_cache_loc, ka, va,
                                               k_scale=spec.k_scale, v_scale=spec.v_scale)
                else:
                    kc, vc = extra[1], extra[2]
                if kind == "decode":
                    o = ops.mha_decode_with_kvcache(
                        qa, kc, vc, md.page_table, md.cache_seqlens, max_seqlen_q=md.max_seqlen_q,
                        is_causal=causal, sinks=sinks_a, **opts)
                elif not md.has_prefix and not fp8:
                    o = ops.mha_prefill(qa, ka, va, md.cu_seqlens_q, max_seqlen_q=md.max_seqlen_q,
                                        is_causal=causal, sinks=sinks_a,
                                        **dict(opts, k_scale=1.0, v_scale=1.0))
                else:
                    o = ops.mha_extend_with_kvcache(
                        qa, kc, vc, md.page_table, md.cache_seqlens, md.cu_seqlens_q,
                        max_seqlen_q=md.max_seqlen_q, is_causal=causal, sinks=sinks_a, **opts)
                o = o.reshape(t, hq * dv).astype(stage.dtype)
                return o, ((kc, vc) if jax_writes else ())
            return body

        # Read-only calls pass the pool views as extra (non-donated) arguments.
        extra = (sinks_j,) if sinks_j is not None else (None,)
        if not jax_writes:
            extra = extra + (views[0].jax, views[1].jax)
        fkey = ("mha", kind, self._shape_spec(layer), jax_writes, nparts,
                sinks_j is not None, self.kv_cache_dtype)
        layer_key = ("mha", kind, spec.layer_id)
        out = self._call(fkey, build, layer_key, stage, views if jax_writes else [], rows, hq * dv, q.dtype, md,
                         extra)
        if self.fast_path and self._md_sig is not None and q.dim() == 2 and (not has_kv or (k.dim() == 2 and v.dim() == 2)):
            self._plans[pkey] = self._mha_plan(kind, fkey, layer_key, layer, pool, spec, n, rows, nparts,
                                               jax_writes, save_kv_cache and has_kv and self.kv_writer == "torch",
                                               views, extra[:1], q.dtype)
        return out[:n]

    def _mha_plan(self, kind, fkey, layer_key, layer, pool, spec, n, rows, nparts, jax_writes, torch_writes,
                  views, extra_head, dtype):
        hkv, d, dv, hq = spec.num_kv_heads, spec.head_dim, spec.head_dim_v, spec.num_q_heads
        width = hq * d + (hkv * (d + dv) if nparts == 3 else 0)
        ent = self._stage.get((("mha", kind, hq, hkv, d), rows, width, dtype))
        if ent is None:
            return None
        stage_n, stage_j = ent[0][:n], ent[1]
        i, ks, vs = spec.layer_id, spec.k_scale, spec.v_scale
        get_k, get_v = functools.partial(pool.get_key_buffer, i), functools.partial(pool.get_value_buffer, i)
        checks = ((get_k, views[0].torch.data_ptr()), (get_v, views[1].torch.data_ptr()))
        cat = torch.cat

        def prep(q, k, v, loc):
            if torch_writes:
                loc = (self._loc_t if loc is None else loc)[:n]
                pool.set_kv_buffer(layer, loc, k.view(n, hkv, d), v.view(n, hkv, dv), ks, vs)
            if nparts == 1:
                stage_n.copy_(q)  # only q is staged: one copy, no torch.cat
            else:
                cat((q, k, v), dim=1, out=stage_n)

        return self._make_plan(fkey, layer_key, ent[0], stage_j, n, rows, hq * dv, dtype,
                               views if jax_writes else [], extra_head, [] if jax_writes else views, prep, checks)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer,
                       out_cache_loc: torch.Tensor | None = None, token_to_kv_pool=None, bs: int | None = None,
                       save_kv_cache: bool = False, **kwargs) -> torch.Tensor:
        """Paged decode (also multi-token: target verify, DFLASH draft block).

        Args:
          q: [bs * q_len, tp_q_head_num * head_dim] (or [.., heads, head_dim]).
          k, v: the new tokens' K/V [bs * q_len, tp_k_head_num * head_dim], or None.
          layer: see :class:`jattn.bridge.TorchAttentionLayer`.
          out_cache_loc: slots of the new tokens (used by ``kv_writer="torch"``; the
            JAX writer uses the plan's slots, which are the same for a consistent
            ``req_to_page``). token_to_kv_pool: the torch pool. bs: requests.
          save_kv_cache: write k/v into the pool first (in place).
          kwargs: ``sinks`` f32[tp_q_head_num] (gpt-oss).

        Returns:
          [bs * q_len, tp_q_head_num * v_head_dim] torch tensor in q's dtype.
        """
        if token_to_kv_pool is None:
            raise ValueError("token_to_kv_pool is required")
        return self._run("decode", q, k, v, layer, out_cache_loc, token_to_kv_pool, save_kv_cache,
                         kwargs.get("sinks"))

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer,
                       out_cache_loc: torch.Tensor | None = None, token_to_kv_pool=None, bs: int | None = None,
                       save_kv_cache: bool = False, **kwargs) -> torch.Tensor:
        """Extend (ragged new tokens over a paged prefix; prefill when no prefix).

        q/k/v are token-major [num_tokens, heads * head_dim]; returns
        [num_tokens, tp_q_head_num * v_head_dim]. With a cached prefix the new K/V
        must be in the pool: ``save_kv_cache=True`` (or written by the engine before).
        """
        if token_to_kv_pool is None:
            raise ValueError("token_to_kv_pool is required")
        if k is None or v is None:
            raise ValueError("forward_extend needs k and v")
        return self._run("extend", q, k, v, layer, out_cache_loc, token_to_kv_pool, save_kv_cache,
                         kwargs.get("sinks"))

    def precompile(self, layers, buckets: Sequence[int] | None = None, forward_mode=ForwardMode.DECODE,
                   token_to_kv_pool=None, save_kv_cache: bool = True):
        """Compiles the decode call of each distinct layer shape for each bucket by
        running it once on an all-padding plan (writes go to the dummy page only)."""
        if token_to_kv_pool is None:
            raise ValueError("token_to_kv_pool is required")
        mode = _mode(forward_mode)
        q_len = 1 if mode is ForwardMode.DECODE else self.config.spec_num_tokens
        for b in buckets or self._jbackend.batch_buckets:
            self.init_forward_metadata_capture_cuda_graph(b, forward_mode=mode)
            seen = set()
            for layer in layers:
                s = dataclasses.replace(self._spec(layer), layer_id=0)
                first = s not in seen
                seen.add(s)
                if not first:
                    continue
                n = b * q_len
                q = torch.zeros(n, s.num_q_heads * s.head_dim, dtype=self.q_dtype, device=self.device)
                kv = torch.zeros(n, s.num_kv_heads * s.head_dim, dtype=self.q_dtype, device=self.device)
                self.forward_decode(q, kv, kv, layer, None, token_to_kv_pool, b, save_kv_cache=save_kv_cache)


# ============================================================================= MLA


class TorchMLABackend(_BridgeBase):
    """jattn DeepSeek MLA for a torch engine (the SGLang TRTLLM MLA seed's interface).

    Modes (set by ``init_forward_metadata``): ``DECODE`` absorbed decode;
    ``TARGET_VERIFY`` (``forward_extend`` with ``spec_num_tokens`` per request,
    causal); :data:`DRAFT_EXTEND` (``forward_extend``, per-request query lengths
    ``extend_seq_lens``, padded and unpadded inside the jitted call); ``EXTEND``
    (``forward_extend``: ragged non-absorbed prefill, q/k 192 wide, v 128, causal).

    The pool is ``token_to_kv_pool`` (given here, as SGLang binds it at
    construction, or per call). Outputs: absorbed modes ``[T, H * kv_lora_rank]``
    latent (the caller applies ``W_UV``); prefill ``[T, H * v_head_dim]``.
    """

    def __init__(self, config: MLAConfig, token_to_kv_pool=None, *, device=None, kv_writer: str = "auto",
                 sync: str = "auto"):
        self._jbackend = MLABackend(config)
        super().__init__(config, device=device, kv_writer=kv_writer, sync=sync)
        self.token_to_kv_pool = token_to_kv_pool
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_cache_dim = config.kv_lora_rank + config.qk_rope_head_dim

    def _pool(self, kwargs):
        pool = kwargs.get("token_to_kv_pool") or self.token_to_kv_pool
        if pool is None:
            raise ValueError("no token_to_kv_pool: pass it to the constructor or the call")
        return pool

    def _absorbed(self, q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, kwargs):
        spec = self._spec(layer)
        md = self._md_call
        if md is None:
            raise RuntimeError("call init_forward_metadata (or a cuda-graph init) first")
        pool = self._pool(kwargs)
        R, r, H = self.kv_lora_rank, self.qk_rope_head_dim, spec.num_q_heads
        n = q.reshape(-1, H * (R if q_rope is not None else R + r)).shape[0]
        buf = pool.get_key_buffer(spec.layer_id)
        if buf.dtype != self.kv_cache_dtype:
            raise TypeError(f"pool dtype {buf.dtype} differs from config.kv_cache_dtype {self.kv_cache_dtype}")
        view = self._view((id(pool), spec.layer_id, "kv"), buf, (-1, self.page_size, self.kv_cache_dim))
        jax_writes = save_kv_cache and self.kv_writer == "jax"
        if save_kv_cache and (k is None or k_rope is None):
            raise ValueError("save_kv_cache needs k (c_kv) and k_rope")
        if save_kv_cache and not jax_writes:
            loc = kwargs.get("out_cache_loc")
            loc = (self._loc_t if loc is None else loc)[:n]
            pool.set_mla_kv_buffer(layer, loc, k.reshape(n, R), k_rope.reshape(n, r))
        parts = [q.reshape(n, -1)]
        if q_rope is not None:
            parts.append(q_rope.reshape(n, H * r).to(q.dtype))
        if jax_writes:
            parts += [k.reshape(n, R).to(q.dtype), k_rope.reshape(n, r).to(q.dtype)]
        nparts = len(parts)
        has_rope = q_rope is not None
        mode = self.forward_mode
        rows = md.num_tokens
        stage = self._staged(("mla", mode, H), parts, rows)
        fp8 = self.kv_cache_dtype == torch.float8_e4m3fn
        scale = self.config.softmax_scale if spec.scaling is None else spec.scaling
        kv_scale = spec.k_scale if fp8 else 1.0
        cfg = self.config

        def build():
            def body(stage, kvs, md, *extra):
                t = stage.shape[0]
                w = H * R + (H * r if has_rope else 0)
                qa = stage[:, :w]
                if has_rope:
                    qa = jnp.concatenate([qa[:, : H * R].reshape(t, H, R), qa[:, H * R:].reshape(t, H, r)], -1)
                else:
                    qa = qa.reshape(t, H, R + r)
                if jax_writes:
                    (kv,) = kvs
                    kv = ops.set_mla_kv_buffer(kv, md.out_cache_loc, stage[:, w: w + R], stage[:, w + R:],
                                               kv_scale=spec.k_scale)
                else:
                    kv = extra[0]
                if mode == DRAFT_EXTEND:
                    qa = _front_pad(qa, md.cu_seqlens_q, md.max_seqlen_q)
                o = ops.mla_decode_with_kvcache(
                    qa, kv, md.page_table, md.cache_seqlens, kv_lora_rank=R, softmax_scale=scale,
                    max_seqlen_q=md.max_seqlen_q, is_causal=md.is_causal, kv_scale=kv_scale,
                    backend=cfg.kernel_backend)
                if mode == DRAFT_EXTEND:
                    o = _front_unpad(o, md.cu_seqlens_q, md.max_seqlen_q, t)
                return o.reshape(t, H * R).astype(stage.dtype), ((kv,) if jax_writes else ())
            return body

        extra = () if jax_writes else (view.jax,)
        fkey = ("mla", mode, self._shape_spec(layer), jax_writes, nparts, has_rope)
        out = self._call(fkey, build, ("mla", str(mode), spec.layer_id), stage,
                         [view] if jax_writes else [], rows, H * R, q.dtype, md, extra)
        return out[:n]

    def forward_decode(self, q, k, v, layer, forward_batch=None, save_kv_cache: bool = True, q_rope=None,
                       k_rope=None, cos_sin_cache=None, is_neox: bool = False, llama_4_scaling=None, **kwargs):
        """Absorbed decode.

        Args:
          q: absorbed q_nope [T, H * kv_lora_rank] with ``q_rope`` [T, H * rope], or the
            full [T, H * (kv_lora_rank + rope)] with ``q_rope=None``.
          k: c_kv [T, kv_lora_rank]; k_rope: [T, rope] (written when ``save_kv_cache``).
          v: unused (the value is the latent). forward_batch: unused (the plan of
            ``init_forward_metadata`` is used).
        Returns: [T, H * kv_lora_rank] in q's dtype.
        """
        if cos_sin_cache is not None or llama_4_scaling is not None:
            raise NotImplementedError("fused rope (cos_sin_cache) and llama_4_scaling are not supported")
        return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch=None, save_kv_cache: bool = True, q_rope=None,
                       k_rope=None, cos_sin_cache=None, is_neox: bool = False, llama_4_scaling=None,
                       return_lse: bool = False, **kwargs):
        """Target verify / draft extend (absorbed, as :meth:`forward_decode`) or ragged
        prefill (``EXTEND``): q [T, H * 192] (or q_nope [T, H * 128] with q_rope
        [T, H * 64]), k [T, H * 192] (or k_nope [T, H * 128] with k_rope [T, 64]),
        v [T, H * 128]; returns [T, H * 128] (and f32 LSE [T, H] with ``return_lse``).
        Prefill writes no cache (the latent is not among its inputs): pass
        ``save_kv_cache=False`` and write it with the pool's ``set_mla_kv_buffer``.
        """
        if cos_sin_cache is not None or llama_4_scaling is not None:
            raise NotImplementedError("fused rope (cos_sin_cache) and llama_4_scaling are not supported")
        if self.forward_mode is not ForwardMode.EXTEND:
            return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope, kwargs)
        if save_kv_cache:
            raise ValueError("ragged MLA prefill cannot write the latent cache from per-head k/v: pass "
                             "save_kv_cache=False and write c_kv/k_pe with set_mla_kv_buffer")
        if forward_batch is not None and getattr(forward_batch, "attn_attend_prefix_cache", False):
            return self._prefix_chunk(q, k, v, layer, q_rope, k_rope, forward_batch)
        return self._prefill(q, k, v, layer, q_rope, k_rope, return_lse)

    def _prefix_chunk(self, q, k, v, layer, q_rope, k_rope, forward_batch):
        """The chunked-prefix-cache path of the MLA seed: the new tokens attend,
        non-causally, to one chunk of their cached prefixes (K/V already gathered and
        up-projected by the model, ``[chunk_tokens, H, 192]`` / ``[.., H, 128]``).
        Returns ``(o [T, H * 128], lse f32[T, H])``; a request with no keys in the chunk
        gets ``o = 0, lse = -inf`` (the seed's zero-KV fixup is built in). Merge the
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
        bs_pad = md.cu_seqlens_q.shape[0] - 1
        if cu_kv.shape[0] - 1 > bs_pad:
            raise ValueError(f"prefix_chunk_cu_seq_lens has {cu_kv.shape[0] - 1} requests, the plan {bs_pad}")
        cu_kv = np.concatenate([cu_kv, np.full(bs_pad + 1 - cu_kv.shape[0], cu_kv[-1], np.int32)])
        max_kv = bucket(max(int(forward_batch.prefix_chunk_max_seq_lens[idx]), 1))
        n = q.shape[0]  # the new tokens (the chunk's K/V rows are another count)
        qj = to_jax(q.reshape(n, H, -1).contiguous())
        kt = k.reshape(-1, H, k.shape[-1] if k.dim() == 3 else k.shape[-1] // H)
        kj, vj = to_jax(kt.contiguous()), to_jax(v.reshape(-1, H, V).contiguous())
        qr = None if q_rope is None else to_jax(q_rope.reshape(n, H, r).contiguous())
        kr = None if k_rope is None else to_jax(k_rope.reshape(-1, r).contiguous())
        # (the DLPack imports above order torch's pending work before JAX's)
        o, lse = self._jbackend.forward_prefix_chunk(
            qj, kj, vj, dataclasses.replace(spec, layer_id=0), md.cu_seqlens_q, jnp.asarray(cu_kv),
            max_seqlen_q=md.max_seqlen_q, max_seqlen_kv=max_kv, q_rope=qr, k_rope=kr,
        )
        self.sync.after_jax(o)
        return torch.from_dlpack(o.reshape(n, H * V)), torch.from_dlpack(lse)

    def merge_state(self, o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
        """``attn_merge_state`` on torch tensors: o [T, H, D] (or [T, H * D] with lse [T, H]),
        natural-log LSE. Returns ``(o, lse)`` as torch tensors."""
        t, h = lse_a.shape
        o, lse = ops.attn_merge_state(
            to_jax(o_a.reshape(t, h, -1).contiguous()), to_jax(lse_a.float().contiguous()),
            to_jax(o_b.reshape(t, h, -1).contiguous()), to_jax(lse_b.float().contiguous()),
        )
        self.sync.after_jax(o)
        return torch.from_dlpack(o).reshape(o_a.shape), torch.from_dlpack(lse)

    def _prefill(self, q, k, v, layer, q_rope, k_rope, return_lse):
        spec = self._spec(layer)
        md = self.forward_metadata
        cfg = self.config
        H, P, r, V = spec.num_q_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        n = v.reshape(-1, H * V).shape[0]
        parts = [q.reshape(n, -1)]
        if q_rope is not None:
            parts.append(q_rope.reshape(n, H * r))
        parts.append(k.reshape(n, -1))
        if k_rope is not None:
            parts.append(k_rope.reshape(n, r))
        parts.append(v.reshape(n, H * V))
        widths = [p.shape[1] for p in parts]
        has_qr, has_kr = q_rope is not None, k_rope is not None
        stage = self._staged(("mla_prefill", H, tuple(widths)), [p.to(q.dtype) for p in parts], md.num_tokens)
        scale = self.config.softmax_scale if spec.scaling is None else spec.scaling

        def build():
            def body(stage, kvs, md, *extra):
                t = stage.shape[0]
                offs = np.cumsum([0] + widths)
                cols = [stage[:, offs[i]: offs[i + 1]] for i in range(len(widths))]
                i = 0
                qa = cols[i].reshape(t, H, -1); i += 1
                if has_qr:
                    qa = jnp.concatenate([qa, cols[i].reshape(t, H, r)], -1); i += 1
                ka = cols[i].reshape(t, H, -1); i += 1
                if has_kr:
                    ka = jnp.concatenate([ka, jnp.broadcast_to(cols[i].reshape(t, 1, r), (t, H, r))], -1); i += 1
                va = cols[i].reshape(t, H, V)
                o, lse = ops.mha_prefill(qa, ka, va, md.cu_seqlens_q, max_seqlen_q=md.max_seqlen_q,
                                         is_causal=md.is_causal, softmax_scale=scale, return_lse=True,
                                         backend=cfg.kernel_backend)
                return o.reshape(t, H * V).astype(stage.dtype), (lse,)
            return body

        # The LSE rides in the (non-donated) second output slot.
        fn_key = ("mla_prefill", dataclasses.replace(spec, layer_id=0), tuple(widths))
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

    def precompile(self, layers, buckets=None, forward_mode=ForwardMode.DECODE, token_to_kv_pool=None,
                   save_kv_cache: bool = True):
        """Compiles the absorbed decode of each distinct layer shape for each bucket."""
        mode = _mode(forward_mode)
        q_len = 1 if mode is ForwardMode.DECODE else self.config.spec_num_tokens
        R, r = self.kv_lora_rank, self.qk_rope_head_dim
        for b in buckets or self._jbackend.batch_buckets:
            self.init_forward_metadata_capture_cuda_graph(b, forward_mode=mode)
            seen = set()
            for layer in layers:
                s = dataclasses.replace(self._spec(layer), layer_id=0)
                if s in seen:
                    continue
                seen.add(s)
                n = b * q_len
                z = functools.partial(torch.zeros, dtype=self.q_dtype, device=self.device)
                self.forward_decode(z(n, s.num_q_heads * R), z(n, R), None, layer, save_kv_cache=save_kv_cache,
                                    q_rope=z(n, s.num_q_heads * r), k_rope=z(n, r),
                                    token_to_kv_pool=token_to_kv_pool)
