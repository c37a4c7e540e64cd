"""Shared building blocks: RMSNorm, RoPE (NeoX and interleaved), SwiGLU MLP, a small MoE.

Tokens are flattened: activations are ``[T, D]`` (T = all tokens of a ragged batch), so one
module serves prefill, extend and decode alike.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _init(std: float):
    return nnx.initializers.normal(std)


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)``; kernel ``[in, out]`` (the transpose of a torch weight),
    initialised from ``rngs``, or ``weights=(kernel, bias or None)`` as given."""

    def __init__(
        self,
        din: int,
        dout: int,
        *,
        use_bias: bool = False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        std: float = 0.02,
        rngs: nnx.Rngs | None = None,
        weights: tuple | None = None,
    ):
        if weights is not None:  # (kernel [din, dout], bias [dout] or None) as given
            kernel, bias = weights
            self.kernel = nnx.Param(kernel)
            self.bias = nnx.Param(bias) if bias is not None else None
        else:
            self.kernel = nnx.Param(_init(std)(rngs.params(), (din, dout), param_dtype))
            self.bias = nnx.Param(jnp.zeros((dout,), param_dtype)) if use_bias else None
        self.dtype = dtype

    def __call__(self, x):
        y = jnp.einsum("td,de->te", x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def fused_linear(parts: list[Linear]) -> Linear:
    """One :class:`Linear` computing ``parts`` side by side (their kernels, and biases
    if any, concatenated along the output axis): one matmul instead of several."""
    has_bias = [p.bias is not None for p in parts]
    if any(has_bias) and not all(has_bias):
        raise ValueError("fused projections must all have a bias or none")
    kernel = jnp.concatenate([p.kernel[...] for p in parts], axis=1)
    bias = jnp.concatenate([p.bias[...] for p in parts]) if all(has_bias) else None
    return Linear(kernel.shape[0], kernel.shape[1], dtype=parts[0].dtype, weights=(kernel, bias))


def fuse_projections(model) -> None:
    """In place: every attention's ``q/k/v_proj`` of a Llama-family model becomes one
    ``qkv_proj``, and every SwiGLU's ``gate/up_proj`` one ``gate_up_proj`` (also the
    dense and shared-expert MLPs of a DeepSeek model): fewer, wider matmuls per layer,
    the same outputs up to the matmul's rounding. The separate projections are dropped
    (their weights freed once nothing else holds them). Tensor-parallel models keep
    them separate (their column sharding is per projection)."""
    nodes = [n for _, n in nnx.iter_graph(model)]  # listed first: the loop edits the graph
    unfused = any(
        (isinstance(n, SwiGLU) and n.gate_up_proj is None) or getattr(n, "qkv_proj", 0) is None for n in nodes
    )
    if unfused and getattr(model, "layers_stacked", False):
        raise ValueError("fuse_projections: this model's layers are stacked; fuse before stack_layers")
    for node in nodes:
        if isinstance(node, SwiGLU) and node.gate_up_proj is None:
            node.gate_up_proj = fused_linear([node.gate_proj, node.up_proj])
            node.gate_proj = node.up_proj = None
        fuse_qkv = getattr(node, "fuse_qkv", None)
        if fuse_qkv is not None and callable(fuse_qkv):
            fuse_qkv()


class RMSNorm(nnx.Module):
    """``x / rms(x) * weight``, computed in f32 and cast back (as HF Llama / DeepSeek do)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x):
        dtype = x.dtype
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(dtype) * xf.astype(dtype)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, param_dtype=jnp.float32, std: float = 0.02, rngs: nnx.Rngs):
        self.embedding = nnx.Param(_init(std)(rngs.params(), (vocab, dim), param_dtype))

    def __call__(self, tokens):  # i32[T] -> [T, D]
        return jnp.take(self.embedding[...], tokens, axis=0)

    def attend(self, x):  # [T, D] -> f32[T, V]
        return jnp.einsum("td,vd->tv", x, self.embedding[...].astype(x.dtype), preferred_element_type=jnp.float32)


def rope_cos_sin(positions, inv_freq: np.ndarray, attn_factor: float):
    """cos, sin f32[T, rotary_dim // 2] at absolute ``positions`` i32[T]."""
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(ang) * attn_factor, jnp.sin(ang) * attn_factor


def apply_rope(x, cos, sin, *, interleaved: bool = False):
    """Rotate ``x`` [T, H, d] by per-token angles (cos/sin f32[T, d/2]).

    ``interleaved=False``: NeoX / HF Llama "rotate half" pairs ``(i, i + d/2)``.
    ``interleaved=True``: GPT-J / DeepSeek pairs ``(2i, 2i + 1)``; output keeps that layout.
    """
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        y = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(xf.shape)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        y = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return y.astype(dtype)


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        *,
        use_bias: bool = False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        std: float = 0.02,
        rngs: nnx.Rngs,
    ):
        kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, std=std, rngs=rngs)
        self.gate_proj = Linear(dim, hidden, **kw)
        self.up_proj = Linear(dim, hidden, **kw)
        self.down_proj = Linear(hidden, dim, **kw)
        self.gate_up_proj = nnx.data(None)  # set by fuse_projections: [gate | up] as one matmul
        self.hidden = hidden

    def __call__(self, x):
        with jax.named_scope("swiglu"):
            if self.gate_up_proj is not None:
                gu = self.gate_up_proj(x)
                gate, up = gu[:, : self.hidden], gu[:, self.hidden :]
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            return self.down_proj(jax.nn.silu(gate) * up)


class MoE(nnx.Module):
    """DeepSeek-V3 style MoE: sigmoid router with a correction bias, group-limited top-k,
    normalised and scaled weights, plus shared experts.

    Experts are evaluated densely (every expert on every token, then weighted): exact and
    simple, meant for small models and tests, not for serving a 256-expert model.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        *,
        num_experts: int,
        top_k: int,
        num_shared: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        scoring_func: str = "sigmoid",
        topk_method: str = "noaux_tc",
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        std: float = 0.02,
        rngs: nnx.Rngs,
    ):
        init = _init(std)
        self.gate_weight = nnx.Param(init(rngs.params(), (num_experts, dim), jnp.float32))
        sigmoid = scoring_func == "sigmoid"  # V3's router has a correction bias, V2's none
        self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32)) if sigmoid else None
        self.w_gate = nnx.Param(init(rngs.params(), (num_experts, dim, hidden), param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (num_experts, dim, hidden), param_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (num_experts, hidden, dim), param_dtype))
        self.shared = (
            SwiGLU(dim, hidden * num_shared, dtype=dtype, param_dtype=param_dtype, std=std, rngs=rngs)
            if num_shared > 0
            else None
        )
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.scoring_func, self.topk_method = scoring_func, topk_method
        self.dtype = dtype

    def route(self, x):
        """Dense combine weights f32[T, E] (zero for unselected experts). The experts are
        the ``top_k`` best choice scores within the ``topk_group`` best groups: V3
        (sigmoid) chooses by score plus correction bias, a group by its top two; V2
        (softmax) by score, a group by its best (``group_limited_greedy``) or with no
        groups (``greedy``). The weights are the scores of the chosen experts, divided by
        their sum with ``norm_topk_prob`` (V3 only: Hugging Face's V2 router ignores it),
        times ``routed_scaling_factor``."""
        t = x.shape[0]
        e, g = self.num_experts, self.n_group
        logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), self.gate_weight[...])
        if self.scoring_func == "softmax":
            scores = choice = jax.nn.softmax(logits, axis=-1)
            grouped = None if self.topk_method == "greedy" else choice.reshape(t, g, e // g).max(-1)
        else:
            scores = jax.nn.sigmoid(logits)
            choice = scores + self.e_score_correction_bias[...][None]
            grouped = jax.lax.top_k(choice.reshape(t, g, e // g), min(2, e // g))[0].sum(-1)  # [T, G]
        if grouped is not None:
            _, gidx = jax.lax.top_k(grouped, self.topk_group)
            gmask = jnp.zeros((t, g), bool).at[jnp.arange(t)[:, None], gidx].set(True)
            choice = jnp.where(jnp.repeat(gmask, e // g, axis=1), choice, -jnp.inf)
        _, idx = jax.lax.top_k(choice, self.top_k)  # [T, k]
        w = jnp.take_along_axis(scores, idx, axis=1)
        if self.norm_topk_prob and self.scoring_func == "sigmoid":  # V2's router never normalises
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        w = w * self.routed_scaling_factor
        return jnp.zeros((t, e), jnp.float32).at[jnp.arange(t)[:, None], idx].set(w)

    def __call__(self, x):
        with jax.named_scope("moe"):
            combine = self.route(x)
            xd = x.astype(self.dtype)
            h = jax.nn.silu(jnp.einsum("td,edh->teh", xd, self.w_gate[...].astype(self.dtype)))
            h = h * jnp.einsum("td,edh->teh", xd, self.w_up[...].astype(self.dtype))
            y = jnp.einsum("teh,ehd->ted", h, self.w_down[...].astype(self.dtype))
            out = jnp.einsum("ted,te->td", y.astype(jnp.float32), combine).astype(x.dtype)
            if self.shared is not None:
                out = out + self.shared(x)
            return out


class DecoderBlock(nnx.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.
    Subclasses set ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``."""

    def __call__(self, x, cos, sin, kv_cache, metadata, backend):
        h, kv_cache = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, metadata, backend)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv_cache


class LayerRun(nnx.Module):
    """``count`` consecutive decoder blocks of one structure as one ``block`` whose
    parameters carry a leading layer axis; ``start`` is the first one's layer index."""

    def __init__(self, block: nnx.Module, start: int, count: int):
        self.block = block
        self.start = start
        self.count = count


class CausalLM(nnx.Module):
    """The decoder-only body shared by the model families: embedding, ``block_cls`` blocks,
    final norm, (tied) LM head and RoPE tables. Subclasses give ``block_cls``,
    ``default_backend(page_size)`` and ``make_cache``. ``__call__`` returns
    ``(hidden [T, D], kv_cache)``."""

    block_cls: type = DecoderBlock

    def __init__(self, cfg, *, rngs: nnx.Rngs, std: float = 0.02):
        pdt = jnp.dtype(cfg.param_dtype)
        self.config = cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=pdt, std=std, rngs=rngs)
        self.layers = nnx.List([self.block_cls(cfg, i, std=std, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pdt)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(
                cfg.hidden_size, cfg.vocab_size, dtype=jnp.dtype(cfg.dtype), param_dtype=pdt, std=std, rngs=rngs
            )
        )
        self.layer_runs = nnx.data(None)  # set by stack_layers
        inv_freq, attn_factor = cfg.rope()
        self._inv_freq = tuple(float(f) for f in inv_freq)  # static, hashable
        self._attn_factor = attn_factor

    def __call__(self, tokens, positions, kv_cache=None, metadata=None, *, backend=None):
        """tokens, positions: i32[T]; ``kv_cache`` a paged cache (with Decode/Extend
        metadata) or None (with :class:`jattn.models.attention.RaggedMetadata`)."""
        from jattn.models.attention import RaggedMetadata

        cfg = self.config
        if kv_cache is not None and backend is None:
            backend = self.default_backend(metadata.page_size)
        if kv_cache is None and not isinstance(metadata, RaggedMetadata):
            raise TypeError("without a kv_cache, metadata must be a RaggedMetadata")
        x = self.embed_tokens(tokens).astype(jnp.dtype(cfg.dtype))
        cos, sin = rope_cos_sin(positions, jnp.asarray(self._inv_freq, jnp.float32), self._attn_factor)
        if self.layer_runs is not None:
            x, kv_cache = self._scan_layers(x, cos, sin, kv_cache, metadata, backend)
        else:
            for layer in self.layers:
                x, kv_cache = layer(x, cos, sin, kv_cache, metadata, backend)
        return self.norm(x), kv_cache

    @property
    def layers_stacked(self) -> bool:
        return self.layer_runs is not None

    def stack_layers(self) -> None:
        """In place: each run of consecutive blocks of the same structure (all of a Llama;
        a DeepSeek's dense blocks, then its MoE blocks) becomes one :class:`LayerRun` whose
        parameters are stacked on a leading layer axis, and the forward runs each as one
        ``jax.lax.scan``. A program then traces and compiles one block per run instead of
        one per layer; the outputs are the same.

        A stacked model reads a stacked KV cache (``make_cache(..., stacked=True)``, or
        ``cache.stack()``): each scanned layer sees the cache's one-layer ``flat()`` view
        and the plan shifted to its own pages (``with_page_offset``), so the attention
        kernels take the pool as it is, with no slice copied out per layer. Every
        attention's ``spec.layer_id`` becomes 0 for that view. Fuse projections first
        (``fuse_projections``); weights loaded later must have the stacked structure."""
        if self.layer_runs is not None:
            return
        runs = []  # [graphdef, states, start]
        for i, block in enumerate(self.layers):
            attn = block.self_attn
            attn.spec = dataclasses.replace(attn.spec, layer_id=0)
            graphdef, state = nnx.split(block)
            if runs and runs[-1][0] == graphdef:
                runs[-1][1].append(state)
            else:
                runs.append([graphdef, [state], i])
        self.layer_runs = nnx.List(
            [
                LayerRun(nnx.merge(gd, jax.tree.map(lambda *a: jnp.stack(a), *states)), start, len(states))
                for gd, states, start in runs
            ]
        )
        self.layers = nnx.List([])

    def _scan_layers(self, x, cos, sin, kv_cache, metadata, backend):
        flat = None
        if kv_cache is not None:
            if not getattr(kv_cache, "stacked", False):
                raise ValueError(
                    "this model's layers are stacked (stack_layers): it reads a stacked KV cache, "
                    "make_cache(..., stacked=True) or cache.stack()"
                )
            if kv_cache.num_layers != self.config.num_layers:
                raise ValueError(f"kv_cache has {kv_cache.num_layers} layers; the model {self.config.num_layers}")
            pages = kv_cache.num_pages
            total = kv_cache.num_layers * pages
            if metadata.num_pages is not None and metadata.num_pages > pages:
                raise ValueError(
                    f"metadata.num_pages={metadata.num_pages} exceeds the kv_cache's {pages} pages per layer"
                )
            flat = kv_cache.flat()
        metadata = jax.tree.map(jnp.asarray, metadata)  # a host plan's arrays are indexed by traced values
        for run in self.layer_runs:
            graphdef, state = nnx.split(run.block)

            def body(carry, xs, graphdef=graphdef):
                h, cache = carry
                params, i = xs
                md = metadata if cache is None else metadata.with_page_offset(i * pages, total)
                h, cache = nnx.merge(graphdef, params)(h, cos, sin, cache, md, backend)
                return (h, cache), None

            ids = jnp.arange(run.start, run.start + run.count, dtype=jnp.int32)
            (x, flat), _ = jax.lax.scan(body, (x, flat), (state, ids))
        return x, (None if kv_cache is None else kv_cache.unflat(flat))

    def logits(self, hidden):
        """f32[T, vocab]."""
        if self.lm_head is None:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden).astype(jnp.float32)
