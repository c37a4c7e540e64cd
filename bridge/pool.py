"""Reference torch KV pools (the layout of tokenspeed's and SGLang's pools) and the ``layer`` protocol.

The pools are what an SGLang / tokenspeed engine owns: per layer a K and a V
buffer ``[num_slots, num_kv_heads, head_dim]`` (MHA) or one latent buffer
``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]`` (MLA), slot ``= page *
page_size + offset``. The torch backends view them as
``[num_pages, page_size, ...]`` once (zero-copy) and reuse the views every step.
Slot range ``[0, page_size)`` is the reserved dummy page
(:data:`jattn.metadata.DUMMY_PAGE`): padded rows write there.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Protocol, runtime_checkable

import torch

from jattn.backends import LayerSpec

from .checks import check_layer_id, check_slots
from .convert import BridgeError

__all__ = ["AttentionLayer", "TorchAttentionLayer", "TorchKVPool", "TorchMLAKVPool", "layer_spec", "FP8_MAX"]

FP8_MAX = 448.0


@runtime_checkable
class TorchAttentionLayer(Protocol):
    """What the torch backends read from the ``layer`` object tokenspeed and SGLang pass
    (SGLang's ``RadixAttention``, tokenspeed's ``PagedAttention``).

    Attributes:
      layer_id: index into the KV pool.
      tp_q_head_num, tp_k_head_num: query / KV heads on this rank
        (``tp_v_head_num`` is read if present, else ``tp_k_head_num``).
      qk_head_dim, v_head_dim: head sizes (MLA absorbed: ``v_head_dim = kv_lora_rank``).
      sliding_window_size: ``-1`` off, else ``window_left`` (the query sees
        ``window_left + 1`` keys including itself).
      logit_cap: soft-cap ``c`` (``0`` off).
      k_scale, v_scale: FP8 scales: None, a float or a one-element tensor
        (``k_scale_float`` / ``v_scale_float`` are preferred when present); finite
        and positive.
      scaling: softmax scale (None: ``1/sqrt(qk_head_dim)``); finite and positive.
    Optional: ``non_causal`` (DFLASH draft), ``is_cross_attention`` (unsupported).
    """

    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    qk_head_dim: int
    v_head_dim: int
    sliding_window_size: int
    logit_cap: float
    k_scale: object
    v_scale: object
    scaling: float | None


@dataclasses.dataclass
class AttentionLayer:
    """A minimal ``layer`` object with the upstream attribute names (tests, examples)."""

    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    qk_head_dim: int
    v_head_dim: int | None = None
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    k_scale: object = None
    v_scale: object = None
    scaling: float | None = None
    non_causal: bool = False

    def __post_init__(self):
        if self.v_head_dim is None:
            self.v_head_dim = self.qk_head_dim

    @property
    def tp_v_head_num(self) -> int:
        return self.tp_k_head_num

    @property
    def head_dim(self) -> int:
        return self.qk_head_dim


def check_scale(s, name: str) -> float:
    """``s`` (a number or a one-element tensor) as a float, refused unless finite and
    positive: a scale of 0, a negative, NaN or inf would quantise or scale every value
    wrongly (an FP8 write with scale 0 saturates everything to +-448). Reads a tensor's
    value (a device sync for a CUDA tensor): call it once per layer, not per step."""
    if isinstance(s, torch.Tensor):
        if s.numel() != 1:
            raise BridgeError(
                f"{name} must be a number or a one-element tensor, got a tensor of shape {tuple(s.shape)}"
            )
        s = s.item()
    try:
        f = float(s)
    except (TypeError, ValueError):
        raise BridgeError(f"{name} must be a number or a one-element tensor, got {type(s).__name__}") from None
    if not (math.isfinite(f) and f > 0):
        raise BridgeError(f"{name}={f} must be finite and positive")
    return f


def _scale(layer, name: str) -> float:
    f = getattr(layer, f"{name}_float", None)
    if f is not None:
        return check_scale(f, f"layer.{name}_float")
    s = getattr(layer, name, None)
    if s is None:
        return 1.0
    return check_scale(s, f"layer.{name}")  # read again only when scale_key changes (layer_spec is cached)


class _Same:
    """A key part equal to another only for the same live object (held weakly): a freed
    tensor's id may be reused by the next one, whose in-place version starts at 0 too."""

    __slots__ = ("ref", "id")

    def __init__(self, obj):
        self.ref, self.id = weakref.ref(obj), id(obj)

    def __eq__(self, other):
        obj = self.ref()
        return isinstance(other, _Same) and obj is not None and obj is other.ref()

    def __hash__(self):
        return self.id


def scale_key(layer) -> tuple:
    """What identifies ``layer``'s scales without reading a tensor's value (no device sync):
    per scale, the ``*_float`` attribute, the tensor itself (held weakly) and its in-place
    version. A cached spec is read again when it changes (scales loaded after a warm-up
    call), so the attention reads with the scale the pool's writer uses."""
    key = []
    for name in ("k_scale", "v_scale"):
        s = getattr(layer, name, None)
        same = _Same(s) if isinstance(s, torch.Tensor) else s
        key += [getattr(layer, f"{name}_float", None), same, getattr(s, "_version", None)]
    return tuple(key)


def layer_spec(layer) -> LayerSpec:
    """The jattn :class:`~jattn.backends.LayerSpec` of an upstream-style ``layer`` object."""
    missing = [a for a in ("layer_id", "tp_q_head_num", "tp_k_head_num", "qk_head_dim") if not hasattr(layer, a)]
    if missing:
        raise TypeError(f"layer object {type(layer).__name__} lacks {missing} (see TorchAttentionLayer)")
    if getattr(layer, "is_cross_attention", False):
        raise NotImplementedError("cross attention is not supported by the torch bridge")
    layer_id = int(layer.layer_id)
    if layer_id < 0:
        raise BridgeError(f"layer.layer_id={layer_id} must be >= 0 (an index into the KV pool's layers)")
    window = getattr(layer, "sliding_window_size", -1)
    window = -1 if window is None else int(window)
    v_dim = getattr(layer, "v_head_dim", None)
    scaling = getattr(layer, "scaling", None)
    return LayerSpec(
        layer_id=layer_id,
        num_q_heads=int(layer.tp_q_head_num),
        num_kv_heads=int(layer.tp_k_head_num),
        head_dim=int(layer.qk_head_dim),
        v_head_dim=None if v_dim is None else int(v_dim),
        sliding_window_size=window,
        logit_cap=float(getattr(layer, "logit_cap", 0.0) or 0.0),
        k_scale=_scale(layer, "k_scale"),
        v_scale=_scale(layer, "v_scale"),
        scaling=None if scaling is None else check_scale(scaling, "layer.scaling"),
        non_causal=bool(getattr(layer, "non_causal", False)),
    )


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` cast to float8_e4m3fn (docs/SEMANTICS.md), with the
    IEEE f32 quotient: the scale goes in as a tensor on ``x``'s device (a fill, no host
    copy: capturable in a CUDA graph), since CUDA's division by a host scalar multiplies
    by its f32 reciprocal, one ulp off for many quotients, which moves those next to an
    e4m3 midpoint to the other neighbour."""
    s = torch.full((), float(scale), dtype=torch.float32, device=x.device)
    return (x.float() / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _check_loc(loc: torch.Tensor, n: int, slots: int, x_name: str) -> None:
    """``loc``: a 1-D integer tensor of ``n`` slots (one per row of ``x_name``), its values
    in ``[0, slots)`` checked on the CPU only (a CUDA tensor's would cost a device sync;
    the torch backends check them where they can)."""
    values = isinstance(loc, torch.Tensor) and loc.device.type == "cpu"
    check_slots(
        loc, "loc", n, f"[{n}] (one slot per row of {x_name})", slots, f"the pool's slots [0, {slots})", values=values
    )


def _prepare(buf: torch.Tensor, n: int, x: torch.Tensor, scale, names: tuple) -> torch.Tensor:
    """Rows ``x`` ([n, ...]) checked and cast (FP8: quantised with ``scale``) for ``buf``;
    ``names``: the argument names of ``x`` and ``scale`` in messages. Every check of a
    call runs before its first write (:func:`_commit`), so a refused call writes nothing."""
    x_name, scale_name = names
    row = buf.shape[1:]
    if x.dim() == 0 or x.shape[0] != n or tuple(x.shape[1:]) not in ((math.prod(row),), tuple(row)):
        raise BridgeError(
            f"{x_name} must be [{n}, {math.prod(row)}] (or [{n}, {', '.join(map(str, row))}]) to fill the "
            f"pool's rows, got {tuple(x.shape)}"
        )
    fp8 = buf.dtype == torch.float8_e4m3fn
    if scale is not None:
        if isinstance(scale, torch.Tensor) and scale.numel() != 1:
            raise BridgeError(f"{scale_name} must be a number or a one-element tensor, got shape {tuple(scale.shape)}")
        if fp8 or not isinstance(scale, torch.Tensor):  # a tensor's value only where it is read anyway
            scale = check_scale(scale, scale_name)
    x = x.reshape(n, *row)
    if fp8:  # an e4m3 input too is divided by its scale, as every writer does (docs/SEMANTICS.md)
        x = quantize_fp8(x, 1.0 if scale is None else scale)
    return x.to(buf.dtype)


def _commit(buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor) -> None:
    if buf.element_size() == 1:  # FP8: index kernels lack the dtype, move the bytes
        buf, x = buf.view(torch.uint8), x.view(torch.uint8)
    buf.index_copy_(0, loc.to(device=buf.device, dtype=torch.long), x)


class TorchKVPool:
    """MHA/GQA KV pool as tokenspeed keeps it: per layer K and V ``[num_slots, num_kv_heads, head_dim]``.

    Example:
      >>> pool = TorchKVPool(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=16)
      >>> pool.get_key_buffer(0).shape
      torch.Size([32, 2, 16])
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        head_dim_v: int | None = None,
        dtype=torch.bfloat16,
        device=None,
    ):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is the dummy page)")
        self.page_size, self.num_pages = page_size, num_pages
        self.size = num_pages * page_size
        self.dtype = dtype
        dv = head_dim if head_dim_v is None else head_dim_v
        mk = lambda d: torch.zeros(self.size, num_kv_heads, d, dtype=dtype, device=device)  # noqa: E731
        self.layer_num = num_layers  # SGLang's name for the pool's layer count
        self.k_buffer = [mk(head_dim) for _ in range(num_layers)]
        self.v_buffer = [mk(dv) for _ in range(num_layers)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[check_layer_id(self, layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[check_layer_id(self, layer_id)]

    def get_kv_buffer(self, layer_id: int):
        i = check_layer_id(self, layer_id)
        return self.k_buffer[i], self.v_buffer[i]

    def set_kv_buffer(
        self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale=None, v_scale=None
    ) -> None:
        """Writes new tokens' K/V at slots ``loc`` (FP8 pools quantise with the scales:
        None, or finite positive numbers or one-element tensors)."""
        i = check_layer_id(self, layer.layer_id)
        kb, vb, n = self.k_buffer[i], self.v_buffer[i], cache_k.shape[0]
        _check_loc(loc, n, kb.shape[0], "cache_k")
        k = _prepare(kb, n, cache_k, k_scale, ("cache_k", "k_scale"))
        v = _prepare(vb, n, cache_v, v_scale, ("cache_v", "v_scale"))
        _commit(kb, loc, k)
        _commit(vb, loc, v)


class TorchMLAKVPool:
    """DeepSeek MLA latent pool: per layer ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]``."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
        dtype=torch.bfloat16,
        device=None,
    ):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is the dummy page)")
        self.page_size, self.num_pages = page_size, num_pages
        self.size = num_pages * page_size
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.dtype = dtype
        self.layer_num = num_layers  # SGLang's name for the pool's layer count
        self.kv_buffer = [
            torch.zeros(self.size, 1, kv_lora_rank + qk_rope_head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[check_layer_id(self, layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[check_layer_id(self, layer_id)][..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_mla_kv_buffer(
        self, layer, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor
    ) -> None:
        """Writes latent rows ``[c_kv, k_pe]`` at slots ``loc`` (FP8: ``layer.k_scale``)."""
        i = check_layer_id(self, layer.layer_id)
        t = cache_k_nope.shape[0] if cache_k_nope.dim() else 0
        R, r = self.kv_lora_rank, self.qk_rope_head_dim
        for x, name, w in ((cache_k_nope, "cache_k_nope", R), (cache_k_rope, "cache_k_rope", r)):
            if x.dim() == 0 or x.shape[0] != t or x.numel() != t * w:
                raise BridgeError(f"{name} must be [{t}, {w}] (or [{t}, 1, {w}]), got {tuple(x.shape)}")
        row = torch.cat([cache_k_nope.reshape(t, R), cache_k_rope.reshape(t, r)], dim=-1)
        scale = _scale(layer, "k_scale") if self.dtype == torch.float8_e4m3fn else None
        buf = self.kv_buffer[i]
        _check_loc(loc, t, buf.shape[0], "cache_k_nope")
        _commit(buf, loc, _prepare(buf, t, row, scale, ("[cache_k_nope, cache_k_rope]", "layer.k_scale")))
