"""The torch bridge's call machinery, shared by the MHA and MLA adapters.

A torch engine calls the bridge once per layer, so the bridge's own host time is
paid per layer; it avoids per-call DLPack conversions (each costs more host time
than a jitted call, docs/PERF.md):

* **KV pool views** are imported once per (pool buffer, layer) and reused.
* **Inputs** (q, k, v, ...) are copied by one ``torch.cat(..., out=)`` into a
  persistent staging buffer per (call signature, bucket), imported once.
* **Outputs**: on the GPU the jitted call writes into a persistent torch output
  buffer per (layer, call signature, bucket), donated and aliased (the returned
  tensor is a view of it and stays valid until the same layer's next call with the
  same bucket, like a CUDA-graph output). On the CPU the result is exported.
* **Metadata** is planned on the host once per step by the core backend and put on
  the device in one transfer; every layer reuses it. Same bucket, new values: no
  retrace.
* **KV writes** (``save_kv_cache=True``): ``kv_writer="jax"`` (GPU default) writes
  inside the jitted call with the layer's K/V views donated and aliased back, so
  the torch pool is updated in place; the first call per layer checks the output
  pointer equals the torch pointer and raises otherwise (never a silent pool copy).
  ``kv_writer="torch"`` (CPU default) calls the pool's own ``set_kv_buffer`` /
  ``set_mla_kv_buffer`` (in place, on torch's stream) and JAX only reads. XLA's
  CPU client does not alias donated DLPack-imported buffers (it copies them), so
  ``kv_writer="jax"`` is refused on the CPU.
* **Streams**: one fence each way per call, see :mod:`jattn.bridge.streams`.
* **Input checks** cost no device sync (:mod:`jattn.bridge.checks`).
* **Per-layer plans**: after a first (slow-path) call has verified every alias, a
  closure per (layer, pool, call signature, plan structure) re-derives nothing.
* **Parameters** (``sinks``): an f32 copy imported once per tensor and reused while
  the tensor passed is the same object (held by a weak reference) with the same
  version counter, data pointer, shape and dtype: an in-place change or a new tensor
  (even one at a freed tensor's address) is re-read, in O(1) per call.
* **Pools** are held weakly: the views and plans of a pool are per-pool state that
  is dropped when the engine drops the pool. Each pool buffer is checked against
  the config and the layer (pages, heads, head dims) when it is first seen.
* **Bounds**: every cache holds at most :attr:`_BridgeBase.cache_bounds` entries
  (the oldest is dropped); a dropped entry is rebuilt (re-imported, re-verified) if
  it is needed again.

What a call computes is decided by the core backends (:mod:`jattn.backends`): the
adapters' jitted bodies only unpack the staged inputs, build a one-layer cache over
the pool views and call a core ``forward_*`` method.

The upstream CUDA-graph trio: ``init_cuda_graph_state`` chooses the batch buckets;
``init_forward_metadata_capture_cuda_graph`` installs an all-padding plan of a
bucket, so the layer calls that follow compile (the "capture");
``init_forward_metadata_replay_cuda_graph`` plans new values into the same bucket
(the "replay": the compiled calls run again, nothing retraces).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Sequence

import jax
import numpy as np
import torch

from jattn.backends import ForwardMode, LayerSpec, MHABackend, MLABackend
from jattn.kv_cache import cache_dtype
from jattn.planning import check_capture_bucket

from .checks import _InputChecks
from .convert import SUPPORTED_DTYPES, BridgeError, check_shareable, torch_dtype
from .native import NativePlans
from .pool import layer_spec, scale_key
from .state import _Bounded, _host, _host_i32, _LayerEntry, _Param, _ref, _req_to_page, _slim, _View
from .streams import StreamSync
from .views import _PoolViews


class _BridgeBase(_InputChecks, _PoolViews):
    """Staging, views, jit cache, metadata and fences shared by both backends."""

    _jbackend: MHABackend | MLABackend

    #: Entry bounds of the caches (beyond them the oldest entry is dropped, and rebuilt
    #: when needed again): live pools; per pool, buffer views (2 per layer
    #: for MHA, 1 for MLA) and hot-path plans (per layer, call signature and token
    #: count); staging buffers and output buffers (per call signature / layer and
    #: bucket); jitted functions (per layer shape and mode); layer specs; parameter
    #: copies (sinks, per tensor); installed plan structures. An instance copies the
    #: dict at construction; the per-pool bounds are read when a pool is first seen.
    cache_bounds = {
        "pools": 8,
        "views": 1024,
        "plans": 1024,
        "stage": 64,
        "outs": 1024,
        "fns": 256,
        "specs": 1024,
        "params": 256,
        "md_sigs": 256,
    }

    def __init__(self, config, *, device=None, kv_writer: str = "auto", sync: str = "auto", kernels: str = "jax"):
        if kernels not in ("jax", "triton_native"):
            raise ValueError(f"kernels={kernels!r} must be 'jax' or 'triton_native'")
        self.kernels = kernels
        self.config = config
        self.platform = jax.default_backend()
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if self.platform == "gpu" else torch.device("cpu")
            )
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
        self.cache_bounds = dict(self.cache_bounds)
        b = self.cache_bounds
        self._pools = _Bounded(b["pools"])  # id(pool) -> _PoolState (views, hot-path plans)
        self._stage = _Bounded(b["stage"])
        self._outs = _Bounded(b["outs"])
        self._fns = _Bounded(b["fns"])
        self._specs = _Bounded(b["specs"])
        self._params = _Bounded(b["params"])  # id(tensor) -> _Param
        #: use the per-(layer, pool, call signature, plan structure) closures (False:
        #: re-derive everything per call, as before; for benchmarks and debugging)
        self.fast_path = True
        self._md_sigs = _Bounded(b["md_sigs"])
        self._md_count = 0  # names of plan structures are never reused, even once dropped
        self._md_sig = None  # small int naming the installed plan's structure (mode, treedef, shapes)
        self.forward_metadata = None  # device pytree of the current step
        self._md_call = None  # the same without the fields no jitted body reads (fewer call arguments)
        self.forward_mode = None
        self._loc_t = None  # torch out_cache_loc of the real tokens (torch-writer path)
        self._loc_stream, self._loc_streams = None, set()  # _loc_t's copy stream; streams ordered after it
        self._num_real_tokens = 0
        self.cuda_graph_metadata = _Bounded(64)  # bucket -> its all-padding device plan
        self._fill_fn = None  # jitted fill_block_decode_seq_lens
        # kernels="triton_native": the installed plan as device tensors (jattn.bridge.native)
        self._native = NativePlans(self.device) if kernels == "triton_native" else None
        self._native_plan = None

    # ---------------------------------------------------------------- metadata

    def _install(self, md, num_real_tokens: int, tokens_rule: str | None = None, capture: bool = False):
        """Installs plan ``md`` of ``num_real_tokens`` new tokens (``tokens_rule``: how
        they were counted, for messages; None keeps the last); ``capture``: a bucket's
        capture plan (the native path keeps its device tensors for good)."""
        self._note_plan(md, tokens_rule)
        if self._native is not None:
            # host arrays: the native layer calls read the plan from NativePlans' device
            # tensors, and what still runs on JAX (MLA's prefix chunks) takes numpy as it is
            self.forward_metadata = self._md_call = md
            self.forward_mode = md.forward_mode
            self._num_real_tokens = num_real_tokens
            self._native_plan = self._native.install(md, pin=capture)
            return md
        md_dev = jax.device_put(md, self.sync._jdev)  # the pool's GPU (torch.cuda.set_device), not JAX's first
        mode = md.forward_mode
        self.forward_metadata, self.forward_mode = md_dev, mode
        self._md_call = _slim(md_dev)
        leaves, treedef = jax.tree_util.tree_flatten(md_dev)
        sig = (str(mode), treedef, tuple((x.shape, x.dtype) for x in leaves))
        self._md_sig = self._md_sigs.get(sig)
        if self._md_sig is None:
            self._md_count += 1
            self._md_sig = self._md_sigs[sig] = self._md_count
        loc = self._loc_np
        self._loc_t = torch.from_numpy(loc.astype(np.int64)).to(self.device, non_blocking=True)
        self._loc_stream, self._loc_streams = None, set()
        if self._loc_t.is_cuda:
            self._loc_stream = torch.cuda.current_stream(self.device)
            self._loc_streams = {self._loc_stream.cuda_stream}
        self._num_real_tokens = num_real_tokens
        return md_dev

    def _planned_loc(self, loc):
        """The plan's slots ``loc`` (``_loc_t``) for a torch write on the current stream.
        On a stream other than the planning one (layers under ``backend.stream``, planned
        outside it), that stream first waits for the planning stream (the slots' copy) and
        the tensor's memory is kept from reuse until the stream's work is done."""
        if loc is self._loc_t and self._loc_stream is not None and not torch.cuda.is_current_stream_capturing():
            cur = torch.cuda.current_stream(loc.device)
            if cur.cuda_stream not in self._loc_streams:
                cur.wait_stream(self._loc_stream)
                loc.record_stream(cur)
                self._loc_streams.add(cur.cuda_stream)
        return loc

    @property
    def stream(self):
        """XLA's compute stream as a ``torch.cuda.Stream`` (GPU with ``sync="stream"``,
        the default where it is safe; else None). Running the engine's torch work on
        it (``with torch.cuda.stream(backend.stream):``) orders torch and jattn by one
        stream, so the per-call fences are skipped: the lowest host time per call."""
        return self.sync.stream

    def init_cuda_graph_state(self, max_bs: int, *args, **kwargs):
        """Chooses the batch buckets (the upstream captured batch sizes) up to ``max_bs``."""
        return self._jbackend.init_cuda_graph_state(max_bs)

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int | None = None,
        req_pool_indices=None,
        seq_lens=None,
        forward_mode=ForwardMode.DECODE,
        num_pages: int | None = None,
        **kwargs,
    ):
        """Installs an all-padding plan of bucket ``bs``: the layer calls that follow
        compile the bucket (CUDA-graph capture). Their outputs are zero. ``num_pages`` as
        in :meth:`init_forward_metadata` (the replays must pass the same). SGLang's order
        ``(bs, num_tokens, req_pool_indices, seq_lens, ..., forward_mode)`` and tokenspeed's
        ``(bs, req_pool_indices, seq_lens, forward_mode)`` are both taken (a tensor second
        is tokenspeed's); ``num_tokens``, when given, must be the bucket's token rows."""
        if num_tokens is not None and not isinstance(num_tokens, (int, np.integer)):
            # tokenspeed's positional order: (bs, req_pool_indices, seq_lens, forward_mode)
            num_tokens, req_pool_indices, seq_lens, forward_mode = None, num_tokens, req_pool_indices, seq_lens
        md = self._jbackend.init_forward_metadata_capture_cuda_graph(bs, forward_mode, num_pages=num_pages)
        rows = int(np.shape(md.out_cache_loc)[0])
        if num_tokens is not None and int(num_tokens) != rows:
            mode = ForwardMode.parse(forward_mode).name
            raise BridgeError(f"num_tokens={int(num_tokens)} must be the {rows} token rows of bucket {bs} in {mode}")
        md_dev = self._install(md, 0, f"an all-padding capture plan of bucket {bs}", capture=True)
        self.cuda_graph_metadata[bs] = md_dev
        return md_dev

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices, seq_lens, req_to_page=None, forward_mode=ForwardMode.DECODE, **kwargs
    ):
        """Plans new values into the bucket of ``bs`` (CUDA-graph replay: no retrace)."""
        return self.init_forward_metadata(bs, 0, req_pool_indices, seq_lens, req_to_page, forward_mode, **kwargs)

    def init_forward_metadata_out_graph(
        self,
        bs: int,
        req_pool_indices=None,
        seq_lens=None,
        req_to_page=None,
        forward_mode=ForwardMode.DECODE,
        in_capture: bool = False,
        **kwargs,
    ):
        """SGLang's planning outside the captured graph: installs the plan of the batch
        (every mode; arguments as in :meth:`init_forward_metadata`). With ``in_capture``
        ``bs`` must be a bucket, and the plan is kept as that bucket's capture plan."""
        if in_capture:
            check_capture_bucket(bs, self._jbackend.graph_buckets)
        md_dev = self.init_forward_metadata(bs, 0, req_pool_indices, seq_lens, req_to_page, forward_mode, **kwargs)
        if in_capture:
            if self._native is not None:  # its tensors are the captured graph's: kept for good
                self._native_plan = self._native.install(md_dev, pin=True)
            self.cuda_graph_metadata[int(bs)] = md_dev
        return md_dev

    def init_forward_metadata(
        self,
        bs: int,
        num_extends: int = 0,
        req_pool_indices=None,
        seq_lens=None,
        req_to_page=None,
        forward_mode=ForwardMode.DECODE,
        extend_seq_lens=None,
        extend_seq_lens_cpu=None,
        extend_prefix_lens=None,
        extend_prefix_lens_cpu=None,
        num_pages: int | None = None,
        **kwargs,
    ):
        """Plans one step with the core backend (host side) and puts the plan on the
        device once.

        Args follow tokenspeed's ``MHAAttnBackend.init_forward_metadata``:
        ``req_pool_indices`` int[>= bs], ``seq_lens`` int[>= bs] (new tokens included, in
        every mode: SGLang's target-verify ``seq_lens`` leave the draft tokens out, so an
        SGLang engine passes ``torch.where(seq_lens > 0, seq_lens + num_draft_tokens, 0)``:
        a padding row, length 0, must stay 0, or it writes into the pages of the stale
        ``req_pool_indices`` row it carries),
        ``req_to_page`` int[pool, max_pages] page ids (or ``req_to_token_pages``),
        ``forward_mode`` (:class:`jattn.ForwardMode`, its value, or another engine's
        enum member, as :meth:`jattn.ForwardMode.parse` reads it), and for ``EXTEND`` / ``DRAFT_EXTEND``
        ``extend_seq_lens`` (or ``_cpu``) and optionally ``extend_prefix_lens``. Host
        (CPU) tensors avoid a device sync. ``num_pages``: the KV pool's page count, the
        bound the page ids are checked against when ``config.num_pages`` is None.
        """
        req_to_page = _req_to_page(req_to_page, kwargs)
        if kwargs.get("flat_block_tables"):
            raise NotImplementedError(
                "flat_block_tables (tokenspeed's per-group flat cache tables) are not supported: pass the "
                "request-to-page table as req_to_page"
            )
        if req_pool_indices is None or seq_lens is None or req_to_page is None:
            raise ValueError("init_forward_metadata needs req_pool_indices, seq_lens and req_to_page")
        ext = _host(extend_seq_lens_cpu if extend_seq_lens_cpu is not None else extend_seq_lens)
        pre = _host(extend_prefix_lens_cpu if extend_prefix_lens_cpu is not None else extend_prefix_lens)
        md = self._jbackend.init_forward_metadata(
            bs,
            _host(req_pool_indices),
            _host(seq_lens),
            _host(req_to_page),
            forward_mode,
            extend_seq_lens=ext,
            extend_prefix_lens=pre,
            num_pages=num_pages,
        )
        if md.forward_mode.is_extend():
            return self._install(md, int(ext[:bs].sum()), "sum(extend_seq_lens[:bs])")
        return self._install(md, bs * md.max_seqlen_q, f"bs * q_len = {bs} * {md.max_seqlen_q}")

    def support_kv_cache_prewrite(self, forward_mode=None) -> bool:
        """Whether the engine may write the new K/V before attention (the core's rule)."""
        return self._jbackend.support_kv_cache_prewrite(forward_mode)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The length to give padding rows (the core's: 0, an empty row)."""
        return self._jbackend.get_cuda_graph_seq_len_fill_value()

    def fill_block_decode_seq_lens(self, bs: int, block_seq_lens) -> None:
        """DFLASH draft block: sets the installed plan's first ``bs`` lengths to the
        block-end lengths ``block_seq_lens`` int[>= bs] (the core's
        :meth:`~jattn.backends.MHABackend.fill_block_decode_seq_lens`, one small jitted
        call on the device plan, no replanning). The block's pages must be in the
        ``req_to_page`` rows the plan was made from."""
        if self._fill_fn is None:
            self._fill_fn = jax.jit(self._jbackend.fill_block_decode_seq_lens)
        lens = _host_i32(block_seq_lens, "block_seq_lens")
        self._install(self._fill_fn(self.forward_metadata, np.int32(bs), lens), self._num_real_tokens)

    def get_verify_buffers_to_fill_after_draft(self) -> list:
        """Buffers to fill after the draft step: none (``[None, None]``, the core's)."""
        return self._jbackend.get_verify_buffers_to_fill_after_draft()

    # ---------------------------------------------------------------- buffers

    def _cache_sizes(self) -> dict:
        """Entries per cache (pool views and plans summed over the live pools)."""
        sts = list(self._pools.values())
        return {
            "pools": len(sts),
            "views": sum(len(st.views) for st in sts),
            "plans": sum(len(st.plans) for st in sts),
            "stage": len(self._stage),
            "outs": len(self._outs),
            "fns": len(self._fns),
            "specs": len(self._specs),
            "params": len(self._params),
            "md_sigs": len(self._md_sigs),
        }

    def _staged(self, key, parts: Sequence[torch.Tensor], rows: int, names: Sequence[str] = ()) -> jax.Array:
        """Copies ``parts`` (each [n, ...]) side by side into the persistent staging
        buffer ``[rows, sum of widths]`` of ``key``; returns its (cached) JAX view.
        ``names``: the parts' argument names, for errors (the first is q)."""
        n = parts[0].shape[0]
        flat = [p.reshape(n, math.prod(p.shape[1:])) for p in parts]  # (-1 is ambiguous at n = 0)
        dtype = flat[0].dtype
        width = sum(p.shape[1] for p in flat)
        skey = (key, rows, width, dtype)
        ent = self._stage.get(skey)
        if ent is None:
            if dtype not in SUPPORTED_DTYPES or not dtype.is_floating_point:
                raise BridgeError(f"q.dtype={dtype} is not supported (the step's inputs are staged in q's dtype)")
            t = torch.zeros(rows, width, dtype=dtype, device=self.device)
            ent = self._stage[skey] = (t, jax.dlpack.from_dlpack(t, copy=False))
        if n > rows:
            raise ValueError(f"{n} input rows exceed the plan's {rows} (call init_forward_metadata first)")
        bad = [i for i, p in enumerate(flat) if p.dtype != dtype]
        if bad:
            i = bad[0]
            name = names[i] if i < len(names) else f"input {i}"
            raise TypeError(
                f"{name}.dtype={flat[i].dtype} must be q's {dtype} (the step's inputs are staged in q's dtype)"
            )
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

    def _param(self, x: torch.Tensor | None, name: str = "sinks"):
        """The f32 JAX copy of a per-layer constant (``sinks``, ``cos_sin_cache``) as it is now: reused
        while ``x`` is the very tensor it was read from with the same version counter
        (bumped by every in-place torch op), data pointer, shape and dtype; re-read
        otherwise. O(1) per call. Writes that bypass the version counter (through
        ``x.data``, a numpy or DLPack view) are not seen. A tensor made under
        ``torch.inference_mode()`` has no version counter, so it is re-read on every call
        (a copy of it): make such constants outside inference mode to have them kept."""
        if x is None:
            return None
        p = self._params.get(id(x))
        if (
            p is not None
            and p.ref() is x
            and p.version is not None
            and p.version == x._version
            and p.ptr == x.data_ptr()
            and p.shape == x.shape
            and p.dtype == x.dtype
        ):
            return p.array
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        # An explicit torch copy: JAX's DLPack import with copy=True still aliases an
        # f32 CPU tensor, and the copy must not change with (or outlive) the caller's.
        c = x.detach().to(dtype=torch.float32, copy=True).contiguous()
        check_shareable(c, name)
        p = _Param(_ref(x, self._params, id(x)), x, jax.dlpack.from_dlpack(c, copy=False))
        self._params[id(x)] = p
        return p.array

    def _layer(self, layer) -> _LayerEntry:
        """The spec of ``layer`` with and without its id, cached per layer object
        (held weakly), read again when the layer's scale attributes change (``scale_key``)."""
        s = self._specs.get(id(layer))
        key = scale_key(layer)
        if s is None or s.ref() is not layer or s.scales != key:
            spec = layer_spec(layer)
            s = _LayerEntry(_ref(layer, self._specs, id(layer)), spec, dataclasses.replace(spec, layer_id=0), key)
            self._specs[id(layer)] = s
        return s

    def _spec(self, layer) -> LayerSpec:
        return self._layer(layer).spec

    def _shape_spec(self, layer) -> LayerSpec:
        """The layer's spec without its id (layers of one shape share compiled calls)."""
        return self._layer(layer).spec0

    # ---------------------------------------------------------------- the call

    def _call(
        self,
        fkey,
        build,
        layer_key,
        stage,
        kv_views: list[_View],
        out_rows: int,
        out_width: int,
        out_dtype,
        md,
        extra=(),
    ):
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
                    for st in self._pools.values():
                        st.plans.clear()
                    self._repoint(kv_views, new_kvs)
                    self.sync.after_jax(done)
                    return torch.from_dlpack(out)
                ov.verified = True
        else:
            out, new_kvs, done = self._invoke(fn, fenced, stage, kvs, None, md, tuple(extra))
        self._repoint(kv_views, new_kvs)
        # Fence on the token, not on ``out``: an exported-then-donated buffer makes
        # XLA block the host at the next donation (docs/PERF.md).
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

    def _make_plan(
        self,
        fkey,
        layer_key,
        stage_t: torch.Tensor,
        stage_j,
        n: int,
        out_rows: int,
        out_width: int,
        out_dtype,
        kv_views: list[_View],
        ro_views: list[_View],
        prep,
        checks,
    ):
        """The hot path of one (layer, pool, call signature, plan structure): a closure
        ``plan(pool, layer, head, *inputs)`` that re-derives nothing (no specs, keys,
        views or closures per call). It holds neither the pool nor the layer (both are
        passed per call), so a plan never keeps a pool alive.

        ``head``: the jitted call's leading extra arguments (the parameters, read per
        call). ``prep(pool, layer, *inputs)`` does the torch-side work (torch KV write,
        staging copy into ``stage_t[:n]``); ``checks`` are ``(getter, data_ptr, shape)``
        triples, ``getter(pool)`` a pool buffer: a moved or reshaped buffer returns None and
        the caller takes the slow path (re-import and its checks). Built only after a
        slow-path call of the same key verified every alias."""
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

        def plan(pool, layer, head, *inputs):
            if sync.jax_fence != fenced:
                return None  # the sync mode changed: rebuild on the slow path
            for get, ptr, shape in checks:
                buf = get(pool)
                if buf.data_ptr() != ptr or buf.shape != shape:
                    return None
            prep(pool, layer, *inputs)
            extra = head + tuple(v.jax for v in ro_views)
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

    def _repoint(self, kv_views, new_kvs) -> None:
        """Points the KV views at the call's donated-and-returned buffers, refusing (the
        first time a view is written) a buffer that is not the torch pool's own."""
        for v, a in zip(kv_views, new_kvs):
            v.jax = a
            if not v.verified:
                self._check_alias(a, v.torch, "KV pool buffer")
                v.verified = True

    @staticmethod
    def _check_alias(a: jax.Array, t: torch.Tensor, what: str):
        if a.unsafe_buffer_pointer() != t.data_ptr():
            raise BridgeError(
                f"the jitted call did not write the {what} in place (JAX output at "
                f"{a.unsafe_buffer_pointer():#x}, torch buffer at {t.data_ptr():#x}); refusing to go on "
                "with a copy. Use kv_writer='torch'."
            )

    def precompile(
        self,
        layers,
        buckets: Sequence[int] | None = None,
        forward_mode=ForwardMode.DECODE,
        token_to_kv_pool=None,
        save_kv_cache: bool = True,
    ):
        """Compiles the decode-mode call of each distinct layer shape for each batch bucket
        (capture ahead of time) by running it once on an all-padding plan (writes go to
        the dummy page only)."""
        q_len = self._jbackend.q_len(forward_mode)
        for b in buckets or self._jbackend.graph_buckets:
            self.init_forward_metadata_capture_cuda_graph(b, forward_mode=forward_mode)
            seen = set()
            for layer in layers:
                s = dataclasses.replace(self._spec(layer), layer_id=0)
                if s not in seen:
                    seen.add(s)
                    self._precompile_call(layer, s, b * q_len, token_to_kv_pool, save_kv_cache)

    def _precompile_call(self, layer, spec: LayerSpec, n: int, pool, save_kv_cache: bool):
        """One decode-mode call of ``layer`` on zeros of ``n`` tokens (adapters define it)."""
        raise NotImplementedError

    def _zeros(self, n: int, width: int) -> torch.Tensor:
        return torch.zeros(n, width, dtype=self.q_dtype, device=self.device)
