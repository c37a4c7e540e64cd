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
from typing import Protocol, runtime_checkable

import torch

from jattn.backends import LayerSpec

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
        (``k_scale_float`` / ``v_scale_float`` are preferred when present).
      scaling: softmax scale (None: ``1/sqrt(qk_head_dim)``).
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


def _scale(layer, name: str) -> float:
    f = getattr(layer, f"{name}_float", None)
    if f is not None:
        return float(f)
    s = getattr(layer, name, None)
    if s is None:
        return 1.0
    if isinstance(s, torch.Tensor):
        return float(s.reshape(-1)[0].item())  # read once per layer (layer_spec is cached)
    return float(s)


def layer_spec(layer) -> LayerSpec:
    """The jattn :class:`~jattn.backends.LayerSpec` of an upstream-style ``layer`` object."""
    missing = [a for a in ("layer_id", "tp_q_head_num", "tp_k_head_num", "qk_head_dim") if not hasattr(layer, a)]
    if missing:
        raise TypeError(f"layer object {type(layer).__name__} lacks {missing} (see TorchAttentionLayer)")
    if getattr(layer, "is_cross_attention", False):
        raise NotImplementedError("cross attention is not supported by the torch bridge")
    window = getattr(layer, "sliding_window_size", -1)
    window = -1 if window is None else int(window)
    v_dim = getattr(layer, "v_head_dim", None)
    return LayerSpec(
        layer_id=int(layer.layer_id),
        num_q_heads=int(layer.tp_q_head_num),
        num_kv_heads=int(layer.tp_k_head_num),
        head_dim=int(layer.qk_head_dim),
        v_head_dim=None if v_dim is None else int(v_dim),
        sliding_window_size=window,
        logit_cap=float(getattr(layer, "logit_cap", 0.0) or 0.0),
        k_scale=_scale(layer, "k_scale"),
        v_scale=_scale(layer, "v_scale"),
        scaling=None if getattr(layer, "scaling", None) is None else float(layer.scaling),
        non_causal=bool(getattr(layer, "non_causal", False)),
    )


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` cast to float8_e4m3fn (docs/SEMANTICS.md)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _store(buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, scale) -> None:
    x = x.reshape(x.shape[0], *buf.shape[1:])
    if buf.dtype == torch.float8_e4m3fn and x.dtype != buf.dtype:
        x = quantize_fp8(x, 1.0 if scale is None else float(scale))
    x = x.to(buf.dtype)
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
        self.k_buffer = [mk(head_dim) for _ in range(num_layers)]
        self.v_buffer = [mk(dv) for _ in range(num_layers)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale=None, v_scale=None
    ) -> None:
        """Writes new tokens' K/V at slots ``loc`` (FP8 pools quantise with the scales)."""
        i = layer.layer_id
        _store(self.k_buffer[i], loc, cache_k, k_scale)
        _store(self.v_buffer[i], loc, cache_v, v_scale)


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
        self.kv_buffer = [
            torch.zeros(self.size, 1, kv_lora_rank + qk_rope_head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id][..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_mla_kv_buffer(
        self, layer, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor
    ) -> None:
        """Writes latent rows ``[c_kv, k_pe]`` at slots ``loc`` (FP8: ``layer.k_scale``)."""
        t = cache_k_nope.shape[0]
        row = torch.cat([cache_k_nope.reshape(t, -1), cache_k_rope.reshape(t, -1)], dim=-1)
        scale = _scale(layer, "k_scale") if self.dtype == torch.float8_e4m3fn else None
        _store(self.kv_buffer[layer.layer_id], loc, row, scale)
