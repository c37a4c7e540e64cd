"""DeepSeek-V2 / V3 style decoder with multi-head latent attention (MLA) in Flax NNX.

Attention per layer (``R = kv_lora_rank``, ``r = qk_rope_head_dim``, ``P = qk_nope_head_dim``,
``V = v_head_dim``)::

    q        = q_b(norm(q_a(x)))  or  q_proj(x)         [T, H, P + r]  (optional q LoRA)
    c_kv,k_pe = kv_a_proj_with_mqa(x)                    [T, R], [T, r] (c_kv RMS-normed)
    rope(q_pe), rope(k_pe)                               interleaved pairs (2i, 2i+1) by default
    kv_b = [W_UK | W_UV]                                 [R, H, P + V]

* prefill (no cached prefix): non-absorbed ragged MHA, q/k ``[T, H, P + r]``, v ``[T, H, V]``,
  and the latent rows ``[c_kv, k_pe]`` written to the paged cache.
* decode, and extend over a cached prefix: absorbed, ``q = [W_UK^T q_nope, rope(q_pe)]``
  ``[T, H, R + r]`` against the ``R + r``-wide latent rows (576 for DeepSeek-V2/V3); the
  latent output times ``W_UV``. An extend over a prefix runs as a draft extend (each
  request's queries padded to ``max_seqlen_q``, docs/SEMANTICS.md).

The softmax scale is ``1/sqrt(P + r)`` times ``mscale^2`` under YaRN (``DeepseekConfig.softmax_scale``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jattn.backends import LayerSpec, MLABackend, MLAConfig
from jattn.models.attention import is_decode, ragged_prefill
from jattn.models.config import DeepseekConfig
from jattn.models.layers import CausalLM, DecoderBlock, Linear, MoE, RMSNorm, SwiGLU, apply_rope

# The epsilon of the latent norms (q_a_layernorm, kv_a_layernorm): Hugging Face's DeepSeek
# V2 and V3 build them with RMSNorm's default, whatever the config's rms_norm_eps (which
# the released checkpoints set to the same 1e-6).
LATENT_NORM_EPS = 1e-6


def default_mla_backend(cfg: DeepseekConfig, page_size: int = 64, kernel_backend: str | None = None) -> MLABackend:
    return MLABackend(
        MLAConfig(
            num_heads=cfg.num_heads,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            page_size=page_size,
            scaling=cfg.softmax_scale(),
            kernel_backend=kernel_backend,
        )
    )


class MLAttention(nnx.Module):
    """MLA attention of one layer. ``__call__(x [T, D], cos, sin f32[T, r // 2], kv_cache,
    metadata, backend) -> (out [T, D], kv_cache)``: ``kv_cache`` an ``MLAKVCache`` with a
    Decode/Extend plan, or None with a :class:`~jattn.models.attention.RaggedMetadata` (cache-free prefill)."""

    def __init__(self, cfg: DeepseekConfig, layer_id: int, *, std: float, rngs: nnx.Rngs):
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        kw = dict(dtype=dt, param_dtype=pdt, std=std, rngs=rngs)
        h, nh = cfg.hidden_size, cfg.num_heads
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, nh * cfg.qk_head_dim, **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(h, cfg.q_lora_rank, use_bias=cfg.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS, param_dtype=pdt)
            self.q_b_proj = Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, **kw)
        self.kv_a_proj_with_mqa = Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, use_bias=cfg.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=LATENT_NORM_EPS, param_dtype=pdt)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), **kw)
        self.o_proj = Linear(nh * cfg.v_head_dim, h, use_bias=cfg.attention_bias, **kw)
        self.cfg = cfg
        self.spec = LayerSpec(
            layer_id=layer_id,
            num_q_heads=nh,
            num_kv_heads=1,
            head_dim=cfg.qk_head_dim,
            v_head_dim=cfg.v_head_dim,
            scaling=cfg.softmax_scale(),
        )

    def __call__(self, x, cos, sin, kv_cache, metadata, backend):
        cfg, s = self.cfg, self.spec
        t, nh = x.shape[0], cfg.num_heads
        P, r, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
        with jax.named_scope("mla_proj"):
            if self.q_proj is not None:
                q = self.q_proj(x)
            else:
                q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            q = q.reshape(t, nh, P + r)
            q_nope, q_pe = q[..., :P], q[..., P:]
            kv = self.kv_a_proj_with_mqa(x)
            c_kv = self.kv_a_layernorm(kv[:, :R])
            k_pe = kv[:, R:]
            q_pe = apply_rope(q_pe, cos, sin, interleaved=cfg.rope_interleave)
            k_pe = apply_rope(k_pe[:, None, :], cos, sin, interleaved=cfg.rope_interleave)[:, 0]
            w = self.kv_b_proj.kernel[...].astype(x.dtype).reshape(R, nh, P + V)
            w_uk, w_uv = w[..., :P], w[..., P:]
        absorbed = kv_cache is not None and (is_decode(metadata) or metadata.has_prefix)
        with jax.named_scope("mla_attention"):
            if absorbed:
                q_abs = jnp.einsum("thp,rhp->thr", q_nope, w_uk)
                latent, kv_cache = backend.forward_absorbed(
                    q_abs, c_kv, None, s, kv_cache, metadata, q_rope=q_pe, k_rope=k_pe
                )
                out = jnp.einsum("thr,rhv->thv", latent.reshape(t, nh, R).astype(x.dtype), w_uv)
            else:
                k_nope = jnp.einsum("tr,rhp->thp", c_kv, w_uk)
                v = jnp.einsum("tr,rhv->thv", c_kv, w_uv)
                if kv_cache is None:
                    qf = jnp.concatenate([q_nope, q_pe], -1)
                    kf = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, None], (t, nh, r))], -1)
                    out = ragged_prefill(qf, kf, v, metadata, softmax_scale=s.scaling)
                else:
                    kv_cache = backend.save_kv(s, kv_cache, metadata.out_cache_loc, c_kv, k_pe)
                    out = backend.forward_extend(q_nope, k_nope, v, s, metadata, q_rope=q_pe, k_rope=k_pe)
        return self.o_proj(out.reshape(t, nh * V).astype(x.dtype)), kv_cache


class DeepseekBlock(DecoderBlock):
    def __init__(self, cfg: DeepseekConfig, layer_id: int, *, std: float, rngs: nnx.Rngs):
        dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pdt)
        self.self_attn = MLAttention(cfg, layer_id, std=std, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pdt)
        if cfg.is_moe_layer(layer_id):
            self.mlp = MoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                num_experts=cfg.n_routed_experts,
                top_k=cfg.num_experts_per_tok,
                num_shared=cfg.n_shared_experts,
                n_group=cfg.n_group,
                topk_group=cfg.topk_group,
                norm_topk_prob=cfg.norm_topk_prob,
                routed_scaling_factor=cfg.routed_scaling_factor,
                scoring_func=cfg.scoring_func,
                topk_method=cfg.topk_method,
                dtype=dt,
                param_dtype=pdt,
                std=std,
                rngs=rngs,
            )
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype=dt, param_dtype=pdt, std=std, rngs=rngs)


class Deepseek(CausalLM):
    """DeepSeek-V2/V3-style causal LM with MLA. ``__call__`` returns ``(hidden [T, D], kv_cache)``."""

    block_cls = DeepseekBlock

    def default_backend(self, page_size: int):
        return default_mla_backend(self.config, page_size)

    def make_cache(self, *, num_pages: int, page_size: int, dtype=None, stacked: bool = False):
        from jattn.kv_cache import MLAKVCache

        cfg = self.config
        return MLAKVCache.create(
            num_layers=cfg.num_layers,
            num_pages=num_pages,
            page_size=page_size,
            kv_lora_rank=cfg.kv_lora_rank,
            rope_dim=cfg.qk_rope_head_dim,
            dtype=dtype or cfg.dtype,
            stacked=stacked,
        )
