"""Frozen model configurations with presets.

Two families:

* :class:`LlamaConfig`: decoder-only GQA transformers with RoPE, RMSNorm and a SwiGLU MLP.
  One config covers Llama 2 / 3, SmolLM2, Qwen2 (``qkv_bias=True``) and Qwen3
  (``qk_norm=True``).
* :class:`DeepseekConfig`: DeepSeek-V2 / V3 multi-head latent attention (MLA) with optional
  q LoRA, interleaved RoPE, YaRN, a dense SwiGLU MLP and an optional small MoE.

Both are hashable (they shape compiled programs) and build from a Hugging Face
``config.json`` dict with ``from_hf``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (the ``rope_scaling`` / ``rope_parameters`` of HF configs).

    ``rope_type``: ``default`` (none), ``linear`` (positions / factor), ``llama3``
    (smooth low/high-frequency blend) or ``yarn`` (NTK-by-parts plus an attention factor).
    """

    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not one of {ROPE_TYPES}")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None, max_position_embeddings: int | None = None) -> "RopeScaling":
        """From the config's ``rope_scaling`` dict; ``max_position_embeddings`` (the config's)
        stands in for a llama3 or YaRN config's missing ``original_max_position_embeddings``,
        as in Hugging Face's own computation."""
        if not d:
            return cls()
        rope_type = d.get("rope_type", d.get("type", "default")) or "default"
        kw: dict[str, Any] = {"rope_type": rope_type}
        for f in dataclasses.fields(cls):
            if f.name != "rope_type" and d.get(f.name) is not None:
                kw[f.name] = d[f.name]
        missing = "original_max_position_embeddings" not in kw
        if rope_type in ("llama3", "yarn") and missing and max_position_embeddings:
            kw["original_max_position_embeddings"] = int(max_position_embeddings)
        return cls(**kw)


LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Hugging Face's config classes' max_position_embeddings, for a config.json without the key
# (llama3 / YaRN rope scaling reads it as the pretraining length).
_HF_MAX_POSITIONS = {
    "llama": 2048,
    "mistral": 131072,
    "qwen2": 32768,
    "qwen3": 32768,
    "deepseek_v2": 2048,
    "deepseek_v3": 4096,
}


def _hf_max_positions(d: Mapping[str, Any], model_type: str) -> int:
    """The config's ``max_position_embeddings``, or its model class's default in Hugging Face."""
    return int(d.get("max_position_embeddings") or _HF_MAX_POSITIONS[model_type])


def _check_hf_activation(d: Mapping[str, Any]) -> None:
    """The MLPs here are SwiGLU with silu; a config asking for another activation is refused."""
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={act!r}: the models here use silu (SwiGLU) only")


def _hf_sliding_window(d: Mapping[str, Any], model_type: str) -> int:
    """The window a Hugging Face Llama-family config applies to every layer (0: none).
    Mistral applies ``sliding_window`` where it is set. Qwen 2/3 apply it to the layers
    that ``layer_types`` marks ``sliding_attention`` (older configs: with
    ``use_sliding_window``, from layer ``max_window_layers`` on): all of them or none is
    served here; a mix, which the uniform layers here do not model, is refused rather
    than ignored."""
    w = d.get("sliding_window", 4096 if model_type == "mistral" else None)  # MistralConfig's default
    if not w or model_type == "llama":  # Hugging Face's Llama has no window: it ignores the field
        return 0
    if model_type == "mistral":
        return int(w)
    if model_type in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window"):  # Hugging Face drops the window then, whatever else says
            return 0
        n = int(d.get("num_hidden_layers") or 0)
        kinds = d.get("layer_types") or [
            "sliding_attention" if i >= d.get("max_window_layers", 28) else "full" for i in range(n)
        ]
        windowed = {k == "sliding_attention" for k in kinds}
        if windowed <= {False}:
            return 0
        if windowed == {True}:
            return int(w)
    raise NotImplementedError(
        f"{model_type} config with sliding_window={w} (use_sliding_window={d.get('use_sliding_window')}, "
        f"max_window_layers={d.get('max_window_layers')}) is not supported: only a window on every layer or "
        "on none is"
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: RopeScaling, max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """Inverse frequencies f32[rotary_dim // 2] and the cos/sin multiplier (YaRN's attention factor)."""
    exponent = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / (theta**exponent)
    attn_factor = 1.0
    s = scaling
    if s.rope_type == "linear":
        inv_freq = inv_freq / s.factor
    elif s.rope_type == "llama3":
        old_len = s.original_max_position_embeddings
        low_wavelen = old_len / s.low_freq_factor
        high_wavelen = old_len / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, blended, scaled)
    elif s.rope_type == "yarn":
        factor = s.factor
        if s.attention_factor is not None:
            attn_factor = s.attention_factor
        elif s.mscale and s.mscale_all_dim:
            attn_factor = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
        else:
            attn_factor = _yarn_mscale(factor)

        def corr_dim(rot):
            orig = s.original_max_position_embeddings
            return rotary_dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

        low, high = corr_dim(s.beta_fast), corr_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrap = 1.0 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrap) + inv_freq * extrap
    return inv_freq.astype(np.float32), float(attn_factor)


def _dtype_name(x) -> str:
    return np.dtype(x).name if not isinstance(x, str) else x


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama-family decoder (GQA + RoPE + RMSNorm + SwiGLU)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    sliding_window: int = 0  # Mistral: each query sees its last ``sliding_window`` keys (0: all)
    dtype: str = "float32"  # activations
    param_dtype: str = "float32"
    name: str = "llama"

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ValueError(f"sliding_window={self.sliding_window!r} must be an int >= 0 (0: no window)")

    def replace(self, **kw) -> "LlamaConfig":
        return dataclasses.replace(self, **kw)

    def rope(self) -> tuple[np.ndarray, float]:
        return rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_q_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    # ---- presets -------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **kw) -> "LlamaConfig":
        base = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            name="tiny-llama",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def smollm2_135m(cls, **kw) -> "LlamaConfig":
        base = dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_q_heads=9,
            num_kv_heads=3,
            head_dim=64,
            rope_theta=100000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            name="SmolLM2-135M",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def llama2_7b(cls, **kw) -> "LlamaConfig":
        base = dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_layers=32,
            num_q_heads=32,
            num_kv_heads=32,
            head_dim=128,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            name="Llama-2-7B",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def llama3_8b(cls, **kw) -> "LlamaConfig":
        base = dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=500000.0,
            max_position_embeddings=8192,
            name="Llama-3-8B",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def llama3_1_8b(cls, **kw) -> "LlamaConfig":
        scaling = RopeScaling(
            "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        )
        return cls.llama3_8b(rope_scaling=scaling, max_position_embeddings=131072, name="Llama-3.1-8B", **kw)

    @classmethod
    def qwen2_0_5b(cls, **kw) -> "LlamaConfig":
        base = dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_layers=24,
            num_q_heads=14,
            num_kv_heads=2,
            head_dim=64,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
            qkv_bias=True,
            name="Qwen2-0.5B",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def qwen3_0_6b(cls, **kw) -> "LlamaConfig":
        base = dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_layers=28,
            num_q_heads=16,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            max_position_embeddings=40960,
            tie_word_embeddings=True,
            qk_norm=True,
            name="Qwen3-0.6B",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], **kw) -> "LlamaConfig":
        """From a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2, Qwen3, SmolLM2)."""
        d = dict(d)
        model_type = d.get("model_type", "llama")
        if model_type not in LLAMA_MODEL_TYPES:  # Gemma, Granite, ... share the weight names, not the math
            raise ValueError(
                f"model_type={model_type!r} is not supported (Llama-family: {', '.join(LLAMA_MODEL_TYPES)})"
            )
        _check_hf_activation(d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        hidden = d["hidden_size"]
        nq = d["num_attention_heads"]
        max_positions = _hf_max_positions(d, model_type)
        out = dict(
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_q_heads=nq,
            num_kv_heads=d.get("num_key_value_heads") or nq,
            head_dim=d.get("head_dim") or (128 if model_type == "qwen3" else hidden // nq),  # Qwen3Config's
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),  # the Hugging Face configs' default
            rope_theta=float(theta),
            rope_scaling=RopeScaling.from_hf(rope, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            sliding_window=_hf_sliding_window(d, model_type),
            o_bias=bool(d.get("attention_bias", False)) and model_type != "qwen2",
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3",),
            name=d.get("_name_or_path") or model_type,
        )
        out.update(kw)
        return cls(**out)


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """DeepSeek-V2 / V3 decoder with multi-head latent attention (MLA)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # MoE (layers >= first_k_dense_replace); first_k_dense_replace = num_layers gives none
    first_k_dense_replace: int = 0
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # The router: V3's sigmoid scores with a correction bias and top-2-sum group scores
    # ("sigmoid", "noaux_tc"), or V2's softmax scores, greedy or by group maxima ("softmax",
    # "greedy" / "group_limited_greedy").
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    dtype: str = "float32"
    param_dtype: str = "float32"
    name: str = "deepseek"

    def __post_init__(self):
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        methods = {"sigmoid": ("noaux_tc",), "softmax": ("greedy", "group_limited_greedy")}
        if self.topk_method not in methods.get(self.scoring_func, ()):
            raise ValueError(
                f"scoring_func={self.scoring_func!r} with topk_method={self.topk_method!r} is not a supported "
                f"router (sigmoid: noaux_tc; softmax: greedy or group_limited_greedy)"
            )
        if self.first_k_dense_replace < self.num_layers:
            self._check_moe()

    def _check_moe(self) -> None:
        """The routing settings of the MoE layers (a wrong one routed to no expert silently,
        or failed inside the first step with a reshape or top_k error)."""
        e, k, g, tg = self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group
        if e <= 0:
            raise ValueError("MoE layers need n_routed_experts > 0 (or first_k_dense_replace=num_layers)")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be > 0 for the MoE layers")
        if not 1 <= k <= e:
            raise ValueError(f"num_experts_per_tok={k} must be in [1, n_routed_experts={e}]")
        if self.topk_method in ("noaux_tc", "group_limited_greedy"):  # the routers that pick groups first
            if g < 1 or e % g:
                raise ValueError(f"n_group={g} must divide n_routed_experts={e}")
            if not 1 <= tg <= g:
                raise ValueError(f"topk_group={tg} must be in [1, n_group={g}]")
            if k > tg * (e // g):
                raise ValueError(
                    f"num_experts_per_tok={k} exceeds the {tg * (e // g)} experts of topk_group={tg} groups of {e // g}"
                )

    def replace(self, **kw) -> "DeepseekConfig":
        return dataclasses.replace(self, **kw)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def rope(self) -> tuple[np.ndarray, float]:
        return rope_inv_freq(self.qk_rope_head_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings)

    def softmax_scale(self) -> float:
        """``1/sqrt(P + r)``, times ``mscale^2`` when the rope scaling (YaRN) sets ``mscale_all_dim``,
        ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` (docs/SEMANTICS.md, DeepSeek MLA)."""
        scale = self.qk_head_dim**-0.5
        s = self.rope_scaling
        if s.rope_type != "default" and s.mscale_all_dim:
            m = _yarn_mscale(s.factor, s.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    # ---- presets -------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **kw) -> "DeepseekConfig":
        base = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            max_position_embeddings=512,
            first_k_dense_replace=2,
            name="tiny-deepseek",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def tiny_v3_attention(cls, **kw) -> "DeepseekConfig":
        """A tiny model around DeepSeek-V3's attention shapes: latent 512 + rope 64 (the
        576-wide cache the MLA decode kernels serve), qk 128 + 64 and v 128 (the 192/128
        prefill), 16 heads; two dense layers, hidden 256."""
        base = dict(
            hidden_size=256,
            num_heads=16,
            q_lora_rank=64,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            name="tiny-deepseek-v3-attention",
        )
        base.update(kw)
        return cls.tiny(**base)

    @classmethod
    def deepseek_v3(cls, **kw) -> "DeepseekConfig":
        scaling = RopeScaling(
            "yarn",
            factor=40.0,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=4096,
        )
        base = dict(
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            num_layers=61,
            num_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rope_scaling=scaling,
            max_position_embeddings=163840,
            first_k_dense_replace=3,
            moe_intermediate_size=2048,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            name="DeepSeek-V3",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def deepseek_v2_lite(cls, **kw) -> "DeepseekConfig":
        scaling = RopeScaling(
            "yarn",
            factor=40.0,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
            original_max_position_embeddings=4096,
        )
        base = dict(
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            num_layers=27,
            num_heads=16,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rope_scaling=scaling,
            max_position_embeddings=163840,
            first_k_dense_replace=1,
            moe_intermediate_size=1408,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            scoring_func="softmax",
            topk_method="greedy",
            name="DeepSeek-V2-Lite",
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], **kw) -> "DeepseekConfig":
        d = dict(d)
        _check_hf_activation(d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        v2 = d.get("model_type") == "deepseek_v2"  # its configs leave the softmax router implicit
        max_positions = _hf_max_positions(d, "deepseek_v2" if v2 else "deepseek_v3")
        if d.get("moe_layer_freq", 1) != 1:  # every layer from first_k_dense_replace on is MoE here
            raise ValueError(f"moe_layer_freq={d['moe_layer_freq']} is not supported (only 1)")
        out = dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=RopeScaling.from_hf(rope, max_positions),
            rope_interleave=bool(d.get("rope_interleave", True)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            first_k_dense_replace=d.get("first_k_dense_replace", 0),
            moe_intermediate_size=d.get("moe_intermediate_size", 0) or 0,
            n_routed_experts=d.get("n_routed_experts", 0) or 0,
            n_shared_experts=d.get("n_shared_experts", 0) or 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) or 0,
            n_group=d.get("n_group", 1) or 1,
            topk_group=d.get("topk_group", 1) or 1,
            norm_topk_prob=bool(d.get("norm_topk_prob", not v2)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            scoring_func=d.get("scoring_func") or ("softmax" if v2 else "sigmoid"),
            topk_method=d.get("topk_method") or ("greedy" if v2 else "noaux_tc"),
            name=d.get("_name_or_path") or d.get("model_type", "deepseek"),
        )
        out.update(kw)
        return cls(**out)
