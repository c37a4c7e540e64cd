"""Llama-family decoder in Flax NNX with every attention through jattn.

Covers Llama 2 / 3 (GQA, llama3 / linear / yarn RoPE scaling), SmolLM2, Qwen2 (qkv bias)
and Qwen3 (per-head q/k RMSNorm). Activations are token-major ``[T, D]``: one forward
serves cache-free ragged prefill, extend through the paged cache, and decode.

Example (two prompts of 5 and 3 tokens, cache-free)::

    import numpy as np
    from flax import nnx
    from jattn.models.attention import RaggedMetadata
    from jattn.models.config import LlamaConfig
    from jattn.models.llama import Llama

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    md = RaggedMetadata.from_lengths([5, 3])
    tokens = np.arange(8, dtype=np.int32)                 # i32[8], both prompts packed
    positions = RaggedMetadata.positions([5, 3])          # i32[8]: 0..4, 0..2
    hidden, _ = model(tokens, positions, None, md)        # [8, hidden_size]
    logits = model.logits(hidden)                         # f32[8, vocab]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jattn.backends import LayerSpec, MHABackend, MHAConfig
from jattn.models.attention import is_decode, ragged_prefill
from jattn.models.config import LlamaConfig
from jattn.models.layers import CausalLM, DecoderBlock, Linear, RMSNorm, SwiGLU, apply_rope, fused_linear


def default_mha_backend(cfg: LlamaConfig, page_size: int = 16, kernel_backend: str | None = None) -> MHABackend:
    return MHABackend(
        MHAConfig(
            num_q_heads=cfg.num_q_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            page_size=page_size,
            kernel_backend=kernel_backend,
        )
    )


class LlamaAttention(nnx.Module):
    """GQA attention of one layer. ``__call__(x [T, D], cos, sin f32[T, head_dim // 2],
    kv_cache, metadata, backend) -> (out [T, D], kv_cache)``: ``kv_cache`` a ``PagedKVCache``
    with a Decode/Extend plan, or None with a :class:`~jattn.models.attention.RaggedMetadata` (cache-free prefill)."""

    def __init__(self, cfg: LlamaConfig, layer_id: int, *, std: float, rngs: nnx.Rngs):
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        kw = dict(dtype=dt, param_dtype=pdt, std=std, rngs=rngs)
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_q_heads * d, use_bias=cfg.qkv_bias, **kw)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, use_bias=cfg.qkv_bias, **kw)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, use_bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(cfg.num_q_heads * d, h, use_bias=cfg.o_bias, **kw)
        self.qkv_proj = nnx.data(None)  # set by fuse_qkv: [q | k | v] as one matmul
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=pdt)
            self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=pdt)
        else:
            self.q_norm = self.k_norm = None
        self.spec = LayerSpec(
            layer_id=layer_id,
            num_q_heads=cfg.num_q_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=d,
            sliding_window_size=cfg.sliding_window - 1 if cfg.sliding_window else -1,
        )

    def fuse_qkv(self) -> None:
        """In place: ``q/k/v_proj`` become one ``qkv_proj`` (see ``layers.fuse_projections``)."""
        if self.qkv_proj is None:
            self.qkv_proj = fused_linear([self.q_proj, self.k_proj, self.v_proj])
            self.q_proj = self.k_proj = self.v_proj = None

    def __call__(self, x, cos, sin, kv_cache, metadata, backend):
        t = x.shape[0]
        s = self.spec
        with jax.named_scope("qkv"):
            if self.qkv_proj is not None:
                nq, nk = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
                y = self.qkv_proj(x)
                q, k, v = y[:, :nq], y[:, nq : nq + nk], y[:, nq + nk :]
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = q.reshape(t, s.num_q_heads, s.head_dim)
            k = k.reshape(t, s.num_kv_heads, s.head_dim)
            v = v.reshape(t, s.num_kv_heads, s.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        with jax.named_scope("attention"):
            if kv_cache is None:
                out = ragged_prefill(q, k, v, metadata, window_left=s.sliding_window_size).reshape(t, -1)
            elif is_decode(metadata):
                out, kv_cache = backend.forward_decode(q, k, v, s, kv_cache, metadata)
            else:
                out, kv_cache = backend.forward_extend(q, k, v, s, kv_cache, metadata)
        return self.o_proj(out.astype(x.dtype)), kv_cache


class LlamaBlock(DecoderBlock):
    def __init__(self, cfg: LlamaConfig, layer_id: int, *, std: float, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pdt)
        self.self_attn = LlamaAttention(cfg, layer_id, std=std, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pdt)
        self.mlp = SwiGLU(
            cfg.hidden_size,
            cfg.intermediate_size,
            use_bias=cfg.mlp_bias,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=pdt,
            std=std,
            rngs=rngs,
        )


class Llama(CausalLM):
    """Llama-family causal LM. ``__call__`` returns ``(hidden [T, D], kv_cache)``."""

    block_cls = LlamaBlock

    def default_backend(self, page_size: int):
        return default_mha_backend(self.config, page_size)

    def make_cache(self, *, num_pages: int, page_size: int, dtype=None, stacked: bool = False):
        from jattn.kv_cache import PagedKVCache

        cfg = self.config
        return PagedKVCache.create(
            num_layers=cfg.num_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype or cfg.dtype,
            stacked=stacked,
        )
