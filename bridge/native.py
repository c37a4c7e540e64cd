"""``kernels="triton_native"`` of ``TorchMHABackend`` and ``TorchMLABackend``: the layer
calls as plain Triton launches (MLA: :func:`run_mla_absorbed`, :func:`run_mla_prefill`).

With this option the bridge runs no JAX per layer call: the KV write, the decode (and
its split combine) and the extend / ragged prefill are jattn's Triton kernels launched
on torch's current CUDA stream through :mod:`jattn.bridge.triton_native`, on the
engine's own pool. A torch CUDA graph captures them as they are.

The step's plan is the core planner's, as with the JAX path (same padding, same dummy
page, same slots): :class:`NativePlans` copies its arrays into torch tensors on the
device, one set per plan shape (bucket), updated in place by every later plan of that
shape, so a captured graph reads the new step's values on replay. Inputs are staged
into per-bucket buffers the same way. Outputs equal the JAX path's within the
kernels' rounding (the same kernels run there through jax-triton).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from jattn.backends import LayerSpec
from jattn.metadata import DecodeMetadata
from jattn.pallas_kernels.combine import invariant_num_splits

from .convert import BridgeError

__all__ = ["NativePlans", "run_layer", "run_mla_absorbed", "run_mla_prefill"]

_FIELDS = ("page_table", "cache_seqlens", "out_cache_loc")
_EXTEND_FIELDS = _FIELDS + ("cu_seqlens_q",)


@dataclasses.dataclass(frozen=True)
class NativePlan:
    """The installed plan on the device as torch tensors, and its static fields."""

    tensors: dict  # name -> int32 torch tensor (page_table, cache_seqlens, out_cache_loc[, cu_seqlens_q])
    decode: bool
    rows: int  # token rows of the plan's bucket
    max_seqlen_q: int
    is_causal: bool
    has_prefix: bool


class NativePlans:
    """Per plan shape, the device tensors that hold the current plan: those of captured
    buckets kept for good (a graph captured on them reads them at every replay), the
    others in a bounded dict."""

    def __init__(self, device: torch.device, maxsize: int = 64):
        self.device = device
        self.maxsize = maxsize
        self._bufs: dict = {}
        self._pinned: dict = {}
        self._stage: dict = {}

    def install(self, md, pin: bool = False) -> NativePlan:
        """Copies plan ``md`` (host arrays) into the tensors of its shape (new ones the
        first time) and returns the plan's view of them. ``pin``: a CUDA-graph capture's
        plan, whose tensors are never dropped (a bounded dict would free them once enough
        other shapes came, and the captured graph would read freed memory)."""
        decode = isinstance(md, DecodeMetadata)
        names = _FIELDS if decode else _EXTEND_FIELDS
        arrays = {n: np.ascontiguousarray(np.asarray(getattr(md, n)), dtype=np.int32) for n in names}
        key = (decode, tuple((n, a.shape) for n, a in arrays.items()))
        bufs = self._pinned.get(key)
        if bufs is None:
            bufs = self._bufs.pop(key, None)  # re-inserted last: the oldest shape is dropped first
            if bufs is None:
                bufs = {n: torch.empty(a.shape, dtype=torch.int32, device=self.device) for n, a in arrays.items()}
            if pin:
                self._pinned[key] = bufs
            else:
                while len(self._bufs) >= self.maxsize:
                    self._bufs.pop(next(iter(self._bufs)))
                self._bufs[key] = bufs
        for n, a in arrays.items():  # (a read-only array, e.g. from a JAX plan, is copied: torch warns on those)
            bufs[n].copy_(torch.from_numpy(a if a.flags.writeable else a.copy()))
        rows = int(arrays["out_cache_loc"].shape[0])
        return NativePlan(
            tensors=bufs,
            decode=decode,
            rows=rows,
            max_seqlen_q=int(md.max_seqlen_q),
            is_causal=bool(md.is_causal),
            has_prefix=bool(getattr(md, "has_prefix", True)),
        )

    def staged(self, name: str, x: torch.Tensor, rows: int) -> torch.Tensor:
        """``x`` [n, ...] in a persistent buffer of ``rows`` rows (rows past ``n`` keep
        what they held: the plan's padding rows read no keys and write nothing real)."""
        n = x.shape[0]
        if n == rows:
            return x.contiguous()
        if n > rows:
            raise BridgeError(f"{name} has {n} rows but the installed plan has {rows}")
        key = (name, rows, tuple(x.shape[1:]), x.dtype)
        buf = self._stage.get(key)
        if buf is None:
            buf = self._stage[key] = torch.zeros((rows, *x.shape[1:]), dtype=x.dtype, device=self.device)
        buf[:n].copy_(x)
        return buf


def _check_device(device: torch.device) -> None:
    if device.type == "cuda":
        return
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise BridgeError(
        f"kernels='triton_native' launches Triton kernels: it needs a CUDA device (got {device}; "
        "CPU tensors run only under Triton's interpreter, TRITON_INTERPRET=1)"
    )


def run_layer(
    plans: NativePlans,
    plan: NativePlan | None,
    *,
    spec: LayerSpec,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    page_size: int,
    save_kv_cache: bool,
    out_cache_loc: torch.Tensor | None = None,
    sinks: torch.Tensor | None,
    decode: bool,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """One layer's attention on the pool buffers ``k_buf`` / ``v_buf`` (the layer's
    ``[slots, Hkv, D]``), as the core backend's ``forward_decode`` / ``forward_extend``
    computes it. Returns ``[n, Hq * Dv]`` in q's dtype. ``out_cache_loc``: the new
    tokens' slots (None: the plan's)."""
    from . import triton_native as tn

    if plan is None:
        raise RuntimeError("call init_forward_metadata (or a cuda-graph init) first")
    if plan.decode != decode:
        want, what = ("decode", "a decode") if plan.decode else ("extend", "an extend")
        raise ValueError(f"the installed plan is {what} plan: call forward_{want}")
    if k_buf.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise BridgeError(
            f"q.dtype={q.dtype} must be the KV pool's {k_buf.dtype} (or the pool FP8 e4m3): "
            "kernels='triton_native' attends in the pool's dtype"
        )
    _check_device(q.device)
    hq, hkv, d, dv = spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    q = q.reshape(-1, hq, d)
    n = q.shape[0]
    fp8 = k_buf.dtype == torch.float8_e4m3fn
    kc = k_buf.view(-1, page_size, hkv, d)
    vc = v_buf.view(-1, page_size, hkv, dv)
    t = plan.tensors
    if k is not None:
        k, v = k.reshape(n, hkv, d), v.reshape(n, hkv, dv)
    if save_kv_cache and k is not None:
        ks, vs = (spec.k_scale, spec.v_scale) if fp8 else (None, None)
        loc = t["out_cache_loc"][:n] if out_cache_loc is None else out_cache_loc[:n].to(torch.int32)
        tn.set_kv_buffer(kc, vc, loc, k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous(), k_scale=ks, v_scale=vs)
    opts = dict(
        window_left=spec.sliding_window_size,
        logit_cap=spec.logit_cap,
        sinks=None if sinks is None else sinks.float().contiguous(),
        softmax_scale=spec.scaling,
        k_scale=spec.k_scale if fp8 else 1.0,
        v_scale=spec.v_scale if fp8 else 1.0,
    )
    causal = plan.is_causal and not spec.non_causal
    qs = plans.staged("q", q, plan.rows)
    if decode:
        out = tn.mha_decode(
            qs,
            kc,
            vc,
            t["page_table"],
            t["cache_seqlens"],
            max_seqlen_q=plan.max_seqlen_q,
            is_causal=causal,
            num_splits=invariant_num_splits(t["page_table"].shape[1] * page_size) if batch_invariant else None,
            **opts,
        )
    elif not plan.has_prefix and not fp8:
        if k is None:
            raise ValueError("forward_extend needs k and v")
        opts.update(k_scale=1.0, v_scale=1.0)  # no prefix: the new K/V as given
        ks_, vs_ = plans.staged("k", k, plan.rows), plans.staged("v", v, plan.rows)
        out, _ = tn.prefill(qs, ks_, vs_, t["cu_seqlens_q"], is_causal=causal, **opts)
    else:
        out, _ = tn.prefill(
            qs,
            kc,
            vc,
            t["cu_seqlens_q"],
            page_table=t["page_table"],
            cache_seqlens=t["cache_seqlens"],
            is_causal=causal,
            **opts,
        )
    return out[:n].reshape(n, hq * dv)


def _front_pad(x, cu, max_q: int):
    """Ragged ``[T, ...]`` -> ``[bs * max_q, ...]``, each request's tokens at the END of
    its block (the decode masks' positions ``L - max_q + i`` are the tokens' own), the
    rest 0 (torch ops on the device: capturable)."""
    cu = cu.long()
    bs = cu.shape[0] - 1
    n = cu[1:] - cu[:-1]
    i = torch.arange(max_q, device=x.device)[None, :]
    tok = cu[:-1, None] + i - (max_q - n[:, None])
    valid = (i >= (max_q - n[:, None])).reshape(bs, max_q, *([1] * (x.ndim - 1)))
    g = x[tok.clamp(0, x.shape[0] - 1).reshape(-1)].reshape(bs, max_q, *x.shape[1:])
    return torch.where(valid, g, torch.zeros_like(g)).reshape(bs * max_q, *x.shape[1:])


def _front_unpad(y, cu, max_q: int, num_tokens: int):
    """The inverse of :func:`_front_pad`; rows past ``cu[-1]`` (padding tokens) are 0."""
    cu = cu.long()
    bs = cu.shape[0] - 1
    t = torch.arange(num_tokens, device=y.device)
    b = (torch.searchsorted(cu, t, right=True) - 1).clamp(0, bs - 1)
    n = cu[b + 1] - cu[b]
    row = (b * max_q + (max_q - n) + (t - cu[b])).clamp(0, y.shape[0] - 1)
    out = y[row]
    real = (t < cu[-1]).reshape(-1, *([1] * (y.ndim - 1)))
    return torch.where(real, out, torch.zeros_like(out))


def run_mla_absorbed(
    plans: NativePlans,
    plan: NativePlan | None,
    *,
    query: torch.Tensor,
    kv_buf: torch.Tensor,
    page_size: int,
    kv_lora_rank: int,
    softmax_scale: float,
    kv_scale: float,
) -> torch.Tensor:
    """One layer's absorbed MLA attention (decode, target verify, or draft extend with
    per-request query lengths, padded and unpadded on the device as the core backend's
    ``forward_absorbed`` does) over the latent pool buffer ``kv_buf`` (``[slots, R + r]``
    or ``[slots, 1, R + r]``). ``query`` ``[n, H, R + r]``, rotated and scaled. Returns
    the latent output ``[n, H * R]`` in the query's dtype."""
    from . import triton_native as tn

    if plan is None:
        raise RuntimeError("call init_forward_metadata (or a cuda-graph init) first")
    _check_device(query.device)
    n, h, w = query.shape
    t = plan.tensors
    qs = plans.staged("mla_q", query, plan.rows)
    if not plan.decode:  # draft extend: ragged queries into per-request blocks of max_seqlen_q
        qs = _front_pad(qs, t["cu_seqlens_q"], plan.max_seqlen_q)
    out = tn.mla_decode(
        qs.contiguous(),
        kv_buf.view(-1, page_size, w),
        t["page_table"],
        t["cache_seqlens"],
        kv_lora_rank=kv_lora_rank,
        softmax_scale=softmax_scale,
        max_seqlen_q=plan.max_seqlen_q,
        is_causal=plan.is_causal,
        kv_scale=kv_scale,
    )
    if not plan.decode:
        out = _front_unpad(out, t["cu_seqlens_q"], plan.max_seqlen_q, plan.rows)
    return out[:n].reshape(n, h * kv_lora_rank)


def run_mla_prefill(plans: NativePlans, plan: NativePlan | None, *, q, k, v, softmax_scale: float):
    """The ragged MLA prefill over the new tokens (causal as the plan says): ``q``/``k``
    ``[n, H, qk]``, ``v`` ``[n, H, v_head_dim]``. Returns ``(out [n, H * v_head_dim] in
    q's dtype, natural-log lse f32 [n, H])``."""
    from . import triton_native as tn

    if plan is None:
        raise RuntimeError("call init_forward_metadata (or a cuda-graph init) first")
    if plan.decode:
        raise ValueError("the installed plan is a decode plan: call forward_decode")
    _check_device(q.device)
    n, h, _ = q.shape
    qs, ks, vs = (plans.staged(name, x, plan.rows) for name, x in (("mla_pq", q), ("mla_pk", k), ("mla_pv", v)))
    out, lse = tn.prefill(
        qs, ks, vs, plan.tensors["cu_seqlens_q"], is_causal=plan.is_causal, softmax_scale=softmax_scale
    )
    return out[:n].flatten(1), lse[:n]  # (not reshape(n, -1): ambiguous at n = 0)
