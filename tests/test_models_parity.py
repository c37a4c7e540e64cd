"""jattn models vs Hugging Face transformers (eager) on the same random weights, on CPU.

initializer_range 0.4 makes attention peaked enough that masking / scale errors show.
Covered: full-sequence logits (Llama GQA with default / llama3 / linear / yarn RoPE, Qwen2
qkv bias, Qwen3 q/k norm, DeepSeek-V3 MLA with and without q LoRA, YaRN on, optionally a
small MoE); prefill + extend-over-prefix + incremental decode through the paged cache with
several concurrent requests of different lengths and permuted pages; greedy generation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from jattn.metadata import plan_decode, plan_extend  # noqa: E402
from jattn.models.attention import RaggedMetadata  # noqa: E402
from jattn.models.config import DeepseekConfig, LlamaConfig  # noqa: E402
from jattn.models.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from jattn.models.loading import deepseek_from_hf, llama_from_hf  # noqa: E402

VOCAB = 128
ATOL = 2e-4  # logits are O(10); f32 on both sides

_LLAMA_ROPES = {
    "default": None,
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
    },
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0},
}


def _hf_llama(rope="default", family="llama", seed=0):
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.4,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    if family in ("llama", "llama-tied"):
        if _LLAMA_ROPES[rope]:
            kw["rope_parameters"] = _LLAMA_ROPES[rope]
        hc = transformers.LlamaConfig(**kw, tie_word_embeddings=family == "llama-tied")
        hf = transformers.LlamaForCausalLM(hc)
        family = "llama"
    elif family == "mistral":  # a window shorter than the test's sequences
        hc = transformers.MistralConfig(**kw, sliding_window=5)
        hf = transformers.MistralForCausalLM(hc)
    elif family == "qwen2":
        kw.pop("head_dim")
        hc = transformers.Qwen2Config(**kw)
        hf = transformers.Qwen2ForCausalLM(hc)
    elif family == "qwen3":
        hc = transformers.Qwen3Config(**kw)
        hf = transformers.Qwen3ForCausalLM(hc)
    else:  # "qwen3-window": Qwen's window on every layer (max_window_layers 0)
        hc = transformers.Qwen3Config(**kw, use_sliding_window=True, sliding_window=5, max_window_layers=0)
        hf = transformers.Qwen3ForCausalLM(hc)
        family = "qwen3"
    hf.eval()
    if family != "llama":  # make biases / norm weights non-trivial
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if n.endswith("bias") or "q_norm" in n or "k_norm" in n:
                    p.normal_(0.0, 0.5)
                    if "norm" in n:
                        p.add_(1.0)
    d = hc.to_dict()
    d["model_type"] = family
    cfg = LlamaConfig.from_hf(d)
    return hf, llama_from_hf(cfg, hf.state_dict())


def _hf_deepseek(q_lora_rank, moe=False, seed=0, version=3, **extra):
    torch.manual_seed(seed)
    make = transformers.DeepseekV3Config if version == 3 else transformers.DeepseekV2Config
    hc = make(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1 if moe else 2,
        initializer_range=0.4,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "rope_theta": 10000.0,
        },
        attn_implementation="eager",
        **extra,
    )
    hf = (transformers.DeepseekV3ForCausalLM if version == 3 else transformers.DeepseekV2ForCausalLM)(hc).eval()
    if moe and version == 3:
        with torch.no_grad():
            for n, b in list(hf.named_buffers()) + list(hf.named_parameters()):
                if "e_score_correction_bias" in n:
                    b.normal_(0.0, 0.5)
    cfg = DeepseekConfig.from_hf(hc.to_dict())
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.softmax_scale() != cfg.qk_head_dim**-0.5
    return hf, deepseek_from_hf(cfg, hf.state_dict())


def _hf_logits(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([list(tokens)])).logits[0].numpy()


def _full_sequence_check(hf, model, lens=(7, 13, 1), seed=0):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, VOCAB, n) for n in lens]
    md = RaggedMetadata.from_lengths(lens)
    h, _ = model(jnp.asarray(np.concatenate(seqs), jnp.int32), jnp.asarray(RaggedMetadata.positions(lens)), None, md)
    logits = np.asarray(model.logits(h))
    off = 0
    for s in seqs:
        np.testing.assert_allclose(logits[off : off + len(s)], _hf_logits(hf, s), atol=ATOL, rtol=0)
        off += len(s)


@pytest.mark.parametrize("rope", sorted(_LLAMA_ROPES))
def test_llama_full_sequence_logits(rope):
    hf, model = _hf_llama(rope)
    _full_sequence_check(hf, model)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "qwen3-window", "llama-tied"])
def test_qwen_full_sequence_logits(family):
    hf, model = _hf_llama(family=family)
    if family in ("mistral", "qwen3-window"):
        assert model.config.sliding_window == 5
    _full_sequence_check(hf, model)


def test_mistral_sliding_window_paged_prefill_extend_decode():
    """Mistral's window (5 keys) through the paged cache: extend over a prefix, decode."""
    hf, model = _hf_llama(family="mistral")
    _paged_check(hf, model, page_size=4)


@pytest.mark.parametrize("q_lora_rank,moe", [(None, False), (24, False), (24, True)])
def test_deepseek_full_sequence_logits(q_lora_rank, moe):
    hf, model = _hf_deepseek(q_lora_rank, moe)
    _full_sequence_check(hf, model)


@pytest.mark.parametrize("version,topk_method", [(2, "greedy"), (2, "group_limited_greedy"), (3, None)])
def test_deepseek_routers_and_norm_eps(version, topk_method):
    """V2's softmax router (greedy, and by group maxima over two groups) and V3's, with an
    rms_norm_eps far from the latent norms' own 1e-6 (Hugging Face keeps theirs at 1e-6)."""
    extra = dict(rms_norm_eps=0.3, routed_scaling_factor=2.5)
    if version == 2:  # norm_topk_prob: Hugging Face's V2 router ignores it
        extra |= dict(topk_method=topk_method, norm_topk_prob=True)
    hf, model = _hf_deepseek(24, moe=True, version=version, **extra)
    cfg = model.config
    assert (cfg.scoring_func, cfg.rms_norm_eps) == ("softmax" if version == 2 else "sigmoid", 0.3)
    _full_sequence_check(hf, model)
    if version == 2:  # a V2 config.json without the key: transformers' default, off
        d = {k: v for k, v in hf.config.to_dict().items() if k != "norm_topk_prob"}
        assert DeepseekConfig.from_hf(d).norm_topk_prob is False


def _paged_check(hf, model, page_size, *, prompt_lens=(5, 11, 1), chunk=(3, 0, 0), decode_steps=4, seed=0):
    """Prefill (some prompts in two chunks: extend over a cached prefix), then decode
    steps, all requests together, pages permuted; logits vs HF on the same tokens."""
    rng = np.random.default_rng(seed)
    n_req = len(prompt_lens)
    total = [p + decode_steps for p in prompt_lens]
    seqs = [rng.integers(0, VOCAB, t) for t in total]
    pages_per = [-(-t // page_size) for t in total]
    num_pages = 1 + sum(pages_per) + 3
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((n_req, max(pages_per)), np.int32)
    off = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[off : off + n]
        off += n
    cache = model.make_cache(num_pages=num_pages, page_size=page_size, dtype="float32")
    # poison the cache: nothing unwritten may leak into outputs
    cache = type(cache)(
        **{
            f: tuple(jnp.full_like(x, jnp.nan) for x in getattr(cache, f))
            for f in ("k", "v", "kv")
            if hasattr(cache, f)
        },
        **({"kv_lora_rank": cache.kv_lora_rank} if hasattr(cache, "kv_lora_rank") else {}),
    )
    refs = [_hf_logits(hf, s) for s in seqs]

    def extend(done, new):
        seq_lens = np.array([d + n for d, n in zip(done, new)])
        md = plan_extend(seq_lens, np.array(new), page_size=page_size, page_table=table, num_pages=num_pages)
        toks = np.zeros(md.num_tokens, np.int32)
        toks[: sum(new)] = np.concatenate([seqs[b][d : d + n] for b, (d, n) in enumerate(zip(done, new))])
        return md, toks

    done = [0] * n_req
    phases = [list(chunk), [p - c for p, c in zip(prompt_lens, chunk)]]
    for new in phases:
        if sum(new) == 0:
            continue
        md, toks = extend(done, new)
        h, cache = model(jnp.asarray(toks), jnp.asarray(md.positions), cache, md)
        logits = np.asarray(model.logits(h))
        off = 0
        for b, n in enumerate(new):
            if n:
                np.testing.assert_allclose(
                    logits[off : off + n], refs[b][done[b] : done[b] + n], atol=ATOL, rtol=0, err_msg=f"extend req {b}"
                )
            off += n
            done[b] += n
    for _ in range(decode_steps):
        md = plan_decode(np.array(done) + 1, page_size=page_size, page_table=table, num_pages=num_pages)
        toks = np.zeros(md.num_tokens, np.int32)
        toks[:n_req] = [seqs[b][done[b]] for b in range(n_req)]
        h, cache = model(jnp.asarray(toks), jnp.asarray(md.positions), cache, md)
        logits = np.asarray(model.logits(h))
        for b in range(n_req):
            np.testing.assert_allclose(
                logits[b], refs[b][done[b]], atol=ATOL, rtol=0, err_msg=f"decode req {b} pos {done[b]}"
            )
            done[b] += 1


def test_llama_paged_prefill_extend_decode():
    hf, model = _hf_llama("llama3")
    _paged_check(hf, model, page_size=4)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_deepseek_paged_prefill_extend_decode(q_lora_rank):
    hf, model = _hf_deepseek(q_lora_rank)
    _paged_check(hf, model, page_size=4)


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_greedy_generation_matches_hf(arch):
    hf, model = _hf_llama("yarn") if arch == "llama" else _hf_deepseek(24)
    engine = Engine(
        model, EngineConfig(page_size=4, num_pages=48, max_context=48, batch_buckets=(1, 2, 4), token_buckets=(32, 64))
    )
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (6, 13, 1)]
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=7))
    for p, r in zip(prompts, reqs):
        assert r.status == "finished", r.error
        assert r.output_tokens == _hf_greedy(hf, p, 7)
    assert engine.allocator.num_free == engine.allocator.num_pages - 1


def test_deepseek_router_pairs_are_checked():
    with pytest.raises(ValueError, match="scoring_func='softmax' with topk_method='noaux_tc'"):
        DeepseekConfig.tiny(scoring_func="softmax", topk_method="noaux_tc")
    assert DeepseekConfig.deepseek_v2_lite().scoring_func == "softmax"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_experts_per_tok=0), r"num_experts_per_tok=0 must be in \[1, n_routed_experts=8\]"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be in \[1, n_routed_experts=8\]"),
        (dict(n_group=3), "n_group=3 must divide n_routed_experts=8"),
        (dict(topk_group=3), r"topk_group=3 must be in \[1, n_group=2\]"),
        (dict(topk_group=1, num_experts_per_tok=5), "num_experts_per_tok=5 exceeds the 4 experts of topk_group=1"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size=0 must be > 0"),
    ],
)
def test_deepseek_moe_routing_settings_are_checked(kw, match):
    """A router of 0 experts ran with MoE layers adding nothing; groups that do not divide
    the experts, or more groups / experts than there are, failed inside the first step."""
    base = dict(first_k_dense_replace=1, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2)
    base.update(n_group=2, topk_group=2)
    DeepseekConfig.tiny(**base)  # the base is valid
    with pytest.raises(ValueError, match=match):
        DeepseekConfig.tiny(**{**base, **kw})
    d = dataclasses.asdict(DeepseekConfig.deepseek_v2_lite())
    with pytest.raises(ValueError, match="moe_layer_freq=2 is not supported"):
        DeepseekConfig.from_hf({"model_type": "deepseek_v2", "moe_layer_freq": 2, **d})
