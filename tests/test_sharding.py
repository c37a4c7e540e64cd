"""Serving across devices (``jattn.sharding``, ``jattn.models.parallel``, ``EngineConfig.mesh``).

The sharded checks need several devices, which a CPU process gets only from
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before JAX starts. The suite runs
in-process (pytest-xdist workers with one device), so the checks run in subprocesses:

* each check of :data:`CHECKS` (sharded result against the one-device result of the same
  call) runs in a process of its own with 4 virtual devices (so that the pytest-xdist
  workers share them) and reports ``ok``, a failure with its traceback, or ``skip: reason``;
* two processes under ``jax.distributed.initialize`` (gloo CPU collectives), 2 virtual
  devices each, run :func:`multihost_case` on the 4 devices of both and must give what
  the one-process run of it gave.

Inputs are fresh random draws (never zeros); unused pool slots hold NaN (never read);
sizes are awkward (head dims 12 and 20, vocabularies of 101, lengths off the page size).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import socket
import subprocess
import sys
import traceback

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([HERE, ROOT, env.get("PYTHONPATH", "")])
    return env


# ============================================================================ helpers (subprocess side)


def _mesh(axis="tp", n=None):
    import jax
    from jax.sharding import Mesh

    devs = jax.devices() if n is None else jax.devices()[:n]
    return Mesh(np.array(devs), (axis,))


def _tiny_moe_deepseek():
    """The tiny DeepSeek config with MoE layers from layer 1 on (4 experts, 2 a token, 2 groups)."""
    from jattn.models.config import DeepseekConfig

    return DeepseekConfig.tiny(
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=16,
    )


def _close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
    fin = np.isfinite(b)
    assert np.isfinite(a[fin]).all(), "non-finite where the reference is finite"
    np.testing.assert_allclose(a[fin], b[fin], atol=tol, rtol=tol)


def _pool(rng, lens, ps, hkv, d, dv, extra_pages=2):
    """Random pools with NaN in every slot no request holds; a permuted page table."""
    need = [-(-n // ps) for n in lens]
    num_pages = 1 + sum(need) + extra_pages
    ids = iter(rng.permutation(np.arange(1, num_pages)))
    pt = np.zeros((len(lens), max(need + [1])), np.int32)
    kc = rng.standard_normal((num_pages, ps, hkv, d)).astype(np.float32)
    vc = rng.standard_normal((num_pages, ps, hkv, dv)).astype(np.float32)
    used = np.zeros((num_pages, ps), bool)
    for b, n in enumerate(lens):
        for j in range(need[b]):
            pt[b, j] = next(ids)
        for t in range(n):
            used[pt[b, t // ps], t % ps] = True
    kc[~used], vc[~used] = np.nan, np.nan
    return kc, vc, pt, num_pages


# (name, lens, q_len, page_size, hq, hkv, d, options)
DECODE_CASES = [
    ("gqa_replicated_kv_sinks_cap", [13, 0, 6], 1, 4, 8, 2, 12, dict(logit_cap=5.0, sinks=True)),
    ("mqa_window_verify", [9, 17], 3, 4, 4, 1, 20, dict(window_left=5)),
    ("kv_split_noncausal_draft", [7, 11, 4], 4, 8, 8, 8, 12, dict(is_causal=False, softmax_scale=0.3)),
]


def check_ops_decode():
    import jax
    import jax.numpy as jnp

    import jattn
    from jattn.sharding import TensorParallel

    tp = TensorParallel(_mesh())
    for i, (name, lens, q_len, ps, hq, hkv, d, opts) in enumerate(DECODE_CASES):
        rng = np.random.default_rng(100 + i)
        kc, vc, pt, _ = _pool(rng, lens, ps, hkv, d, d)
        md = jattn.plan_decode(np.array(lens), page_size=ps, page_table=pt, q_len=q_len, batch_buckets=(4,))
        q = rng.standard_normal((md.num_tokens, hq, d)).astype(np.float32)
        kw = dict(opts, max_seqlen_q=q_len, return_lse=True, backend="xla")
        if kw.pop("sinks", False):
            kw["sinks"] = rng.standard_normal(hq).astype(np.float32)
        for dt in (jnp.float32, jnp.bfloat16):
            args = (jnp.asarray(q, dt), jnp.asarray(kc, dt), jnp.asarray(vc, dt), md.page_table, md.cache_seqlens)
            ref = jattn.mha_decode_with_kvcache(*args, **kw)
            out = jax.jit(lambda *a: tp.mha_decode_with_kvcache(*a, **kw))(*args)
            assert out[0].sharding.spec[1] == "tp", (name, out[0].sharding)
            tol = 1e-5 if dt == jnp.float32 else 1e-2
            _close(out[0], ref[0], tol)
            _close(out[1], ref[1], 1e-5)


def check_ops_extend():
    import jax

    import jattn
    from jattn.sharding import TensorParallel

    tp = TensorParallel(_mesh())
    rng = np.random.default_rng(7)
    seq, ext, ps, hq, hkv, d = np.array([19, 5, 0, 9]), np.array([6, 5, 0, 1]), 4, 12, 2, 20
    kc, vc, pt, _ = _pool(rng, seq, ps, hkv, d, d)
    md = jattn.plan_extend(seq, ext, page_size=ps, page_table=pt, batch_buckets=(4,))
    q = rng.standard_normal((md.num_tokens, hq, d)).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    kw = dict(max_seqlen_q=md.max_seqlen_q, window_left=7, sinks=sinks, return_lse=True, backend="xla")
    args = (q, kc, vc, md.page_table, md.cache_seqlens, md.cu_seqlens_q)
    ref = jattn.mha_extend_with_kvcache(*args, **kw)
    out = jax.jit(lambda *a: tp.mha_extend_with_kvcache(*a, **kw))(*args)
    _close(out[0], ref[0], 1e-5)
    _close(out[1], ref[1], 1e-5)


def check_ops_prefill():
    import jax

    import jattn
    from jattn.sharding import TensorParallel

    tp = TensorParallel(_mesh())
    rng = np.random.default_rng(8)
    cu_q, cu_kv = np.array([0, 5, 6, 13], np.int32), np.array([0, 9, 9, 21], np.int32)
    hq, hkv, dqk, dv = 4, 4, 20, 12
    q = rng.standard_normal((16, hq, dqk)).astype(np.float32)  # 3 padding rows
    k = rng.standard_normal((24, hkv, dqk)).astype(np.float32)
    v = rng.standard_normal((24, hkv, dv)).astype(np.float32)
    k[21:], v[21:] = np.nan, np.nan  # past cu_kv[-1]: never read
    for causal in (True, False):
        kw = dict(max_seqlen_q=7, max_seqlen_kv=12, is_causal=causal, logit_cap=4.0, return_lse=True, backend="xla")
        ref = jattn.mha_prefill(q, k, v, cu_q, cu_kv, **kw)
        out = jax.jit(lambda *a: tp.mha_prefill(*a, **kw))(q, k, v, cu_q, cu_kv)
        _close(out[0], ref[0], 1e-5)
        _close(out[1], ref[1], 1e-5)
    # MQA prefill without separate key lengths (the KV head replicated to every device)
    kw = dict(max_seqlen_q=7, backend="xla")
    ref = jattn.mha_prefill(q, k[:16, :1], v[:16, :1], cu_q, **kw)
    out = jax.jit(lambda *a: tp.mha_prefill(*a, **kw))(q, k[:16, :1], v[:16, :1], cu_q)
    _close(out, ref, 1e-5)


def check_backend_mha():
    """TensorParallelMHABackend: decode and extend (with and without prefix), the new
    K/V written to each device's heads; outputs and the cache afterwards."""
    import jax

    import jattn
    from jattn.sharding import TensorParallel, TensorParallelMHABackend

    mesh = _mesh()
    tp = TensorParallel(mesh)
    rng = np.random.default_rng(9)
    hq, hkv, d, ps, pages = 8, 2, 12, 4, 24
    cfg = jattn.MHAConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, num_pages=pages)
    ref_be = jattn.MHABackend(cfg)
    be = TensorParallelMHABackend(ref_be, mesh)
    layer = jattn.LayerSpec(layer_id=1, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, sliding_window_size=6)
    base = rng.standard_normal((2, 2, pages, ps, hkv, d)).astype(np.float32)
    cache = jattn.PagedKVCache(k=tuple(base[0]), v=tuple(base[1]))
    tp_cache = tp.shard_kv_cache(cache)
    sinks = rng.standard_normal(hq).astype(np.float32)
    req_to_page = rng.permutation(np.arange(1, pages))[:18].reshape(3, 6)
    steps = [
        ("extend", np.array([7, 12, 3]), np.array([7, 12, 3])),  # prefill, no prefix
        ("extend", np.array([10, 13, 9]), np.array([3, 1, 6])),  # extend over a prefix
        ("decode", np.array([11, 14, 10]), None),
    ]
    for mode, seq, ext in steps:
        fm = jattn.ForwardMode.EXTEND if mode == "extend" else jattn.ForwardMode.DECODE
        md = ref_be.init_forward_metadata(3, np.arange(3), seq, req_to_page, fm, extend_seq_lens=ext)
        q = rng.standard_normal((md.num_tokens, hq * d)).astype(np.float32)
        k = rng.standard_normal((md.num_tokens, hkv, d)).astype(np.float32)
        v = rng.standard_normal((md.num_tokens, hkv, d)).astype(np.float32)
        fwd = "forward_extend" if mode == "extend" else "forward_decode"
        run_ref = jax.jit(lambda c, md, q, k, v: getattr(ref_be, fwd)(q, k, v, layer, c, md, sinks=sinks))
        run_tp = jax.jit(lambda c, md, q, k, v: getattr(be, fwd)(q, k, v, layer, c, md, sinks=sinks))
        out_ref, cache = run_ref(cache, md, q, k, v)
        out, tp_cache = run_tp(tp_cache, md, q, k, v)
        _close(out, out_ref, 1e-5)
        for got, want in ((tp_cache.k[1], cache.k[1]), (tp_cache.v[1], cache.v[1])):
            np.testing.assert_array_equal(np.asarray(got), np.repeat(np.asarray(want), 2, axis=2))
    try:
        be.forward_decode(q, k, v, layer, cache, md)  # logical heads: 2 < 4 devices
    except ValueError as e:
        assert "physical" in str(e) and "kv_cache layer 1" in str(e), e
    else:
        raise AssertionError("a cache without the physical KV heads was accepted")


def check_mosaic_interpreted():
    """The Mosaic decode kernel inside shard_map under the Mosaic GPU interpreter."""
    import jax.numpy as jnp

    import jattn
    from jattn.pallas_kernels.interpret import gpu_interpret, interpreter_available
    from jattn.sharding import TensorParallel

    if not interpreter_available():
        return "skip: the Mosaic GPU interpreter is not available in this jax"
    if os.environ.get("JATTN_SHARDING_MOSAIC") != "1":
        return (
            "skip: the Mosaic GPU interpreter is unreliable inside shard_map on several virtual devices "
            "(jax 0.10.2: one pass, then 'Barrier remains allocated' raised in its callback thread and a hang; "
            "docs/TESTING.md); JATTN_SHARDING_MOSAIC=1 runs it"
        )
    tp = TensorParallel(_mesh(n=2))
    rng = np.random.default_rng(10)
    kc, vc, pt, _ = _pool(rng, [20, 3], 16, 2, 64, 64)
    kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
    md = jattn.plan_decode(np.array([20, 3]), page_size=16, page_table=pt, batch_buckets=None)
    q = jnp.asarray(rng.standard_normal((md.num_tokens, 4, 64)), jnp.bfloat16)
    kc, vc = jnp.asarray(kc, jnp.bfloat16), jnp.asarray(vc, jnp.bfloat16)
    ref = jattn.mha_decode_with_kvcache(q, kc, vc, md.page_table, md.cache_seqlens, backend="xla")
    try:
        with gpu_interpret():
            out = tp.mha_decode_with_kvcache(q, kc, vc, md.page_table, md.cache_seqlens, backend="mosaic")
            out = np.asarray(out)
    except AssertionError as e:
        if "Barrier remains allocated" in str(e):
            return f"skip: the Mosaic GPU interpreter fails inside shard_map on 2 devices: {str(e)[:160]}"
        raise
    _close(out, ref, 2e-2)


def _llama(rng_seed, **kw):
    from flax import nnx

    from jattn.models.config import LlamaConfig
    from jattn.models.llama import Llama

    base = dict(hidden_size=40, intermediate_size=72, num_q_heads=4, num_kv_heads=2, head_dim=12, vocab_size=101)
    return Llama(LlamaConfig.tiny(**dict(base, **kw)), rngs=nnx.Rngs(rng_seed))


def _llama_steps(model, backend, cache, tokens_rng, ps, num_pages):
    """Prefill (two requests, one chunked), an extend over the prefix, two decodes; the
    hidden states of each step."""
    import jax

    import jattn

    req = np.array([[3, 1, 7, 0], [5, 2, 6, 4]], np.int32)
    plans = [
        jattn.plan_extend(np.array([6, 4]), np.array([6, 4]), page_size=ps, page_table=req, num_pages=num_pages),
        jattn.plan_extend(np.array([9, 7]), np.array([3, 3]), page_size=ps, page_table=req, num_pages=num_pages),
        jattn.plan_decode(np.array([10, 8]), page_size=ps, page_table=req, num_pages=num_pages),
        jattn.plan_decode(np.array([11, 9]), page_size=ps, page_table=req, num_pages=num_pages),
    ]
    run = jax.jit(lambda m, c, t, md: m(t, md.positions, c, md, backend=backend))
    outs = []
    for md in plans:
        tokens = tokens_rng.integers(0, model.config.vocab_size, md.num_tokens).astype(np.int32)
        hidden, cache = run(model, cache, tokens, md)
        outs.append(np.asarray(model.logits(hidden)))
    return outs, run, (model, cache, tokens, plans[-1])


def _collectives(run, args) -> dict:
    txt = run.lower(*args).compile().as_text()
    kinds = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
    return {k: len(re.findall(r"\b" + k + r"(?:-start)?\(", txt)) for k in kinds}


def check_llama_tp():
    from jattn.models import parallel
    from jattn.models.llama import default_mha_backend

    mesh = _mesh()
    cases = [
        dict(qkv_bias=True, qk_norm=True),  # 2 KV heads on 4 devices: replicated
        dict(num_q_heads=8, num_kv_heads=4, head_dim=10, num_layers=3, tie_word_embeddings=True),
    ]
    for i, kw in enumerate(cases):
        model = _llama(20 + i, **kw)
        ps, pages = 4, 8
        ref, _, _ = _llama_steps(
            model,
            default_mha_backend(model.config, ps),
            model.make_cache(num_pages=pages, page_size=ps),
            np.random.default_rng(i),
            ps,
            pages,
        )
        tp_model = parallel.tensor_parallel(model, mesh)
        be = parallel.tensor_parallel_backend(tp_model, mesh, page_size=ps)
        cache = parallel.make_cache(tp_model, be, num_pages=pages, page_size=ps)
        out, run, args = _llama_steps(tp_model, be, cache, np.random.default_rng(i), ps, pages)
        for a, b in zip(out, ref):
            _close(a, b, 2e-5)
        n = tp_model.config.num_layers
        got = _collectives(run, args)
        assert got == dict(_NO_COLLECTIVES, **{"all-reduce": 2 * n}), got
        if kw.get("qkv_bias"):  # a column-parallel bias is split with its weight's columns
            bias = tp_model.layers[0].self_attn.q_proj.bias[...]
            assert tuple(bias.sharding.spec) == ("tp",), bias.sharding.spec
    # the rules, by name
    for kw, words in (
        (dict(num_q_heads=6, num_kv_heads=2, head_dim=8), "num_q_heads=6"),
        (dict(num_q_heads=12, num_kv_heads=3), "multiple of num_kv_heads=3"),
        (dict(intermediate_size=70), "intermediate_size=70"),
    ):
        try:
            parallel.tensor_parallel(_llama(0, **kw), mesh)
        except ValueError as e:
            assert words in str(e) and "'tp'" in str(e), e
        else:
            raise AssertionError(f"{kw} was accepted")


_NO_COLLECTIVES = {"all-reduce": 0, "all-gather": 0, "all-to-all": 0, "collective-permute": 0, "reduce-scatter": 0}


def check_engine_tp():
    """The engine on a mesh: the same tokens as on one device (greedy and sampled), and
    no new program in steady state (traces and the jit cache stay put)."""
    from jattn.models.engine import Engine, EngineConfig, SamplingParams

    model = _llama(30, num_q_heads=8, num_kv_heads=2, head_dim=12)
    rng = np.random.default_rng(31)
    prompts = [list(rng.integers(0, 101, n)) for n in (5, 11, 3, 8)]
    params = [
        SamplingParams(max_new_tokens=6),
        SamplingParams(max_new_tokens=5, temperature=0.8, top_p=0.9, seed=3),
    ] * 2
    ec = dict(page_size=4, num_pages=40, max_context=64, batch_buckets=(4,), token_buckets=(32,), max_prefill_tokens=24)
    ref = [r.output_tokens for r in Engine(model, EngineConfig(**ec)).generate(prompts, params)]
    eng = Engine(model, EngineConfig(**ec, mesh=_mesh()))
    assert [r.output_tokens for r in eng.generate(prompts, params)] == ref
    eng.check_invariants()
    # parallel samples on the mesh: 4 samples of an 11-token prompt share its first two
    # pages, and their decode steps are cascade plans
    fam = SamplingParams(max_new_tokens=5, temperature=0.9, seed=7, n=4)
    one = Engine(model, EngineConfig(**ec, cascade=True))
    want = [s.output_tokens for s in one.samples(one.generate([prompts[1]], fam)[0].rid)]
    cas = Engine(model, EngineConfig(**ec, cascade=True, mesh=_mesh()))
    got = [s.output_tokens for s in cas.samples(cas.generate([prompts[1]], fam)[0].rid)]
    assert got == want and cas.metrics.cascade_steps > 0 and cas.metrics.shared_tokens > 0, (got, want)
    cas.check_invariants()
    traces, programs = eng.metrics.compilations, eng._step._cache_size()
    # the same workload shape again with new prompts: the same programs, nothing new
    prompts2 = [list(rng.integers(0, 101, len(p))) for p in prompts]
    ref2 = [r.output_tokens for r in Engine(model, EngineConfig(**ec)).generate(prompts2, params)]
    assert [r.output_tokens for r in eng.generate(prompts2, params)] == ref2
    assert (eng.metrics.compilations, eng._step._cache_size()) == (traces, programs), (
        "recompiled in steady state",
        (traces, programs),
        (eng.metrics.compilations, eng._step._cache_size()),
    )
    try:
        Engine(model, EngineConfig(**ec, mesh=_mesh(), mesh_axis="model"))
    except ValueError as e:
        assert "axis='model'" in str(e), e
    else:
        raise AssertionError("an axis not in the mesh was accepted")


def check_engine_dp_mla():
    """The engine serving an MLA model data-parallel over 4 devices: more requests than one
    device's batch (placed on the devices with the most free pages), chunked prefill,
    parallel samples (on their parent's device), preemption when a device's pool runs out;
    the same tokens as on one device, also with overlap scheduling, and no new program in
    steady state."""
    from flax import nnx

    from jattn.models.deepseek import Deepseek
    from jattn.models.engine import Engine, EngineConfig, SamplingParams

    cfg = _tiny_moe_deepseek()
    model = Deepseek(cfg, rngs=nnx.Rngs(50))
    rng = np.random.default_rng(51)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (5, 19, 3, 8, 12, 7, 30, 4, 9)]
    params = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=5, temperature=0.8, top_p=0.9, seed=3)]
    params = (params * 5)[: len(prompts)]
    params[4] = SamplingParams(max_new_tokens=4, temperature=0.7, seed=9, n=3)
    ec = dict(page_size=4, max_context=48, batch_buckets=(2, 4), token_buckets=(16, 32), max_prefill_tokens=16)
    one = Engine(model, EngineConfig(**ec, num_pages=200, overlap=False))
    ref = one.generate(prompts, params)
    want = [[s.output_tokens for s in one.samples(r.rid)] for r in ref]
    # 4 devices of 10 pages: 9 usable each, so the longer requests preempt on their device
    eng = Engine(model, EngineConfig(**ec, num_pages=10, mesh=_mesh("dp"), mesh_axis="dp", overlap=False))
    assert eng.dp == 4 and len(eng.pools) == 4
    seen = set()
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while eng.has_work():
        eng.step()
        eng.check_invariants()
        seen.update(r.device for r in eng.running + eng.prefilling)
        fam = eng.samples(rids[4])
        assert len({r.device for r in fam if r.pages}) <= 1, "a parallel sample left its parent's device"
    got = [[s.output_tokens for s in eng.samples(r)] for r in rids]
    assert got == want, (got, want)
    assert seen == {0, 1, 2, 3}, f"requests ran only on devices {seen}"
    assert eng.metrics.preemptions > 0, "the small pools never preempted"
    assert all(p.num_free == p.num_pages - 1 for p in eng.pools)
    traces, programs = eng.metrics.compilations, eng._step._cache_size()
    eng.generate([list(rng.integers(0, cfg.vocab_size, len(p))) for p in prompts], params)
    eng.check_invariants()
    assert (eng.metrics.compilations, eng._step._cache_size()) == (traces, programs), "recompiled in steady state"
    # overlap scheduling on the mesh: the same tokens
    ov = Engine(model, EngineConfig(**ec, num_pages=10, mesh=_mesh("dp"), mesh_axis="dp", overlap=True))
    rids = [ov.add_request(p, sp) for p, sp in zip(prompts, params)]
    while ov.has_work():
        ov.step()
        ov.check_invariants()
    assert [[s.output_tokens for s in ov.samples(r)] for r in rids] == want


def check_mla_dp():
    """DeepSeek (MLA + a MoE layer) data-parallel over 4 devices: each device its own
    requests (one has none) and pool; hidden states equal each device's own one-device run."""
    import jax
    from flax import nnx

    import jattn
    from jattn.models import parallel
    from jattn.models.deepseek import Deepseek, default_mla_backend
    from jattn.sharding import stack_plans

    cfg = _tiny_moe_deepseek()
    model = Deepseek(cfg, rngs=nnx.Rngs(40))
    mesh = _mesh("dp")
    dp_model = parallel.data_parallel(model, mesh)
    ps, pages = 4, 10
    be = parallel.data_parallel_backend(dp_model, mesh, page_size=ps)
    ref_be = default_mla_backend(cfg, ps)
    rng = np.random.default_rng(41)
    # per device: (prefix lengths, new tokens) of its requests; device 2 holds none
    ranks = [([0, 0], [5, 3]), ([0], [7]), ([], []), ([0, 0], [2, 6])]
    tables = [rng.permutation(np.arange(1, pages))[: 2 * 4].reshape(2, 4).astype(np.int32) for _ in ranks]

    def plans_for(step):
        out = []
        for (_, new), pt in zip(ranks, tables):
            b = len(new)
            pre = np.array(new, np.int64) * step if b else np.zeros(0, np.int64)
            if step < 2:
                ext = np.array(new, np.int64)
                out.append(
                    jattn.plan_extend(
                        pre + ext,
                        ext,
                        page_size=ps,
                        page_table=pt[:b],
                        batch_buckets=(2,),
                        token_buckets=(16,),
                        max_pages=4,
                        num_pages=pages,
                    )
                )
            else:
                out.append(
                    jattn.plan_decode(
                        pre + 1, page_size=ps, page_table=pt[:b], batch_buckets=(2,), max_pages=4, num_pages=pages
                    )
                )
        return out

    run_dp = jax.jit(lambda m, c, t, md: m(t, md.positions, c, md, backend=be))
    run_ref = jax.jit(lambda m, c, t, md: m(t, md.positions, c, md, backend=ref_be))
    cache = parallel.make_cache(dp_model, be, num_pages=pages, page_size=ps)
    ref_caches = [model.make_cache(num_pages=pages, page_size=ps) for _ in ranks]
    for step in range(3):  # prefill, an extend over that prefix (absorbed), a decode
        plans = plans_for(step)
        toks = [rng.integers(0, cfg.vocab_size, p.num_tokens).astype(np.int32) for p in plans]
        hidden, cache = run_dp(dp_model, cache, np.concatenate(toks), stack_plans(plans))
        hidden = np.asarray(hidden).reshape(len(ranks), -1, cfg.hidden_size)
        for r, (p, t) in enumerate(zip(plans, toks)):
            want, ref_caches[r] = run_ref(model, ref_caches[r], t, p)
            real = int(np.asarray(p.cu_seqlens_q)[-1]) if hasattr(p, "cu_seqlens_q") else int(p.num_reqs)
            _close(hidden[r][:real], np.asarray(want)[:real], 2e-5)
    assert cache.kv[0].sharding.spec == jax.sharding.PartitionSpec("dp"), cache.kv[0].sharding
    # the fused rope through the wrapper: unrotated q_rope / k_rope, a rope table on every
    # device, each device's tokens at its own plan's positions (a decode over the cache above)
    layer = model.layers[0].self_attn.spec
    H, R, r = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    table = rng.standard_normal((64, r)).astype(np.float32)
    plans = plans_for(2)
    t = plans[0].num_tokens
    q, qr = rng.standard_normal((4 * t, H, R)), rng.standard_normal((4 * t, H, r))
    kv, kr = rng.standard_normal((4 * t, R)), rng.standard_normal((4 * t, r))
    q, qr, kv, kr = (x.astype(np.float32) for x in (q, qr, kv, kr))
    rope_kw = dict(q_rope=qr, k_rope=kr, cos_sin_cache=table, is_neox=True)
    out, _ = jax.jit(lambda c, md: be.forward_decode(q, kv, None, layer, c, md, **rope_kw))(cache, stack_plans(plans))
    out = np.asarray(out).reshape(4, t, -1)
    for d, p in enumerate(plans):
        sl = slice(d * t, (d + 1) * t)
        kw = dict(rope_kw, q_rope=qr[sl], k_rope=kr[sl])
        want, _ = ref_be.forward_decode(q[sl], kv[sl], None, layer, ref_caches[d], p, **kw)
        _close(out[d][: int(p.num_reqs)], np.asarray(want)[: int(p.num_reqs)], 2e-5)
    try:
        stack_plans([plans[0], dataclasses.replace(plans[1], page_size=8)])
    except ValueError as e:
        assert "page_size" in str(e), e
    else:
        raise AssertionError("plans of different page sizes were stacked")
    # token arrays are split over the devices: a leading size that does not divide is named
    rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    try:
        be.save_kv(
            jattn.LayerSpec(0, 1, 1, rank + rope), cache, np.zeros(6, np.int32),
            np.zeros((6, rank), np.float32), np.zeros((6, rope), np.float32),
        )  # fmt: skip
    except ValueError as e:
        assert "out_cache_loc has leading size 6" in str(e) and "multiple of 4" in str(e), e
    else:
        raise AssertionError("6 slots were split over 4 devices")


def _dp_mla_eager(mesh, rng):
    """An eager data-parallel MLA decode over ``mesh``'s axis on global arrays (which span
    processes on a multi-process mesh: its value checks, which read them on the host,
    raised there)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jattn import ForwardMode, LayerSpec, MLABackend, MLAConfig
    from jattn.kv_cache import MLAKVCache
    from jattn.plan_stack import stack_plans
    from jattn.sharding import DataParallelMLABackend, put

    dims = dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    cfg = MLAConfig(**dims, page_size=4, context_len=32, num_pages=10, dtype="float32", kv_cache_dtype="float32",
                    batch_buckets=(2,))  # fmt: skip
    inner = MLABackend(cfg)
    ax = mesh.axis_names[0]
    n, split = mesh.devices.size, P(mesh.axis_names[0])
    plan = inner.init_forward_metadata(
        2, np.arange(2), np.array([9, 5]), np.arange(1, 9).reshape(2, 4), ForwardMode.DECODE
    )
    plans = jax.tree_util.tree_map(lambda x: put(np.asarray(x), mesh, split), stack_plans([plan] * n))
    pool = MLAKVCache((put(rng.standard_normal((10 * n, 4, 24)).astype(np.float32), mesh, split),), 16)
    q = put(rng.standard_normal((n * plan.num_tokens, 2, 24)).astype(np.float32), mesh, split)
    layer = LayerSpec(0, 2, 1, 16, v_head_dim=8)
    return DataParallelMLABackend(inner, mesh, ax).forward_decode(q, None, None, layer, pool, plans, False)[0]


def multihost_case(mesh) -> dict:
    """A tensor-parallel Llama prefill, one TP decode op, the engine on ``mesh`` serving
    a Llama model tensor-parallel and a DeepSeek model data-parallel; host arrays out
    (replicated on every process)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jattn
    from jattn.models import parallel
    from jattn.sharding import TensorParallel, put

    model = _llama(50, num_q_heads=8, num_kv_heads=2)
    ps, pages = 4, 8
    tp_model = parallel.tensor_parallel(model, mesh)
    be = parallel.tensor_parallel_backend(tp_model, mesh, page_size=ps)
    cache = parallel.make_cache(tp_model, be, num_pages=pages, page_size=ps)
    rep = NamedSharding(mesh, P())
    req = np.array([[3, 1, 7, 0], [5, 2, 6, 4]], np.int32)
    md = jattn.plan_extend(np.array([6, 4]), np.array([6, 4]), page_size=ps, page_table=req, num_pages=pages)
    tokens = np.random.default_rng(51).integers(0, 101, md.num_tokens).astype(np.int32)
    run = jax.jit(lambda m, c, t, md: m.logits(m(t, md.positions, c, md, backend=be)[0]), out_shardings=rep)
    out = {"llama_logits": run(tp_model, cache, tokens, md)}
    rng = np.random.default_rng(52)
    kc, vc, pt, _ = _pool(rng, [13, 5], 4, 2, 12, 12)
    kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
    dmd = jattn.plan_decode(np.array([13, 5]), page_size=4, page_table=pt, batch_buckets=None)
    q = rng.standard_normal((dmd.num_tokens, 8, 12)).astype(np.float32)
    tp = TensorParallel(mesh)
    dec = jax.jit(lambda *a: tp.mha_decode_with_kvcache(*a, backend="xla"), out_shardings=rep)
    out["decode"] = dec(put(q, mesh), put(kc, mesh), put(vc, mesh), dmd.page_table, dmd.cache_seqlens)
    out["dp_eager"] = jax.jit(lambda x: x, out_shardings=rep)(_dp_mla_eager(mesh, rng))
    out = {k: np.asarray(v.addressable_data(0)) for k, v in out.items()}
    # the engine on the mesh, as is
    from jattn.models.engine import Engine, EngineConfig, SamplingParams

    prompts = [list(rng.integers(0, 101, n)) for n in (5, 9)]
    ec = dict(page_size=4, num_pages=24, max_context=32, batch_buckets=(2,), token_buckets=(16,), max_prefill_tokens=16)
    reqs = Engine(model, EngineConfig(**ec, mesh=mesh)).generate(prompts, SamplingParams(max_new_tokens=4))
    out["engine_tokens"] = np.array([r.output_tokens for r in reqs])
    # the engine serving an MLA model data-parallel over the same mesh (each device a pool)
    from flax import nnx

    from jattn.models.config import DeepseekConfig
    from jattn.models.deepseek import Deepseek

    mla = Deepseek(DeepseekConfig.tiny(), rngs=nnx.Rngs(53))
    prompts = [list(rng.integers(0, mla.config.vocab_size, n)) for n in (5, 9, 3, 7, 6)]
    reqs = Engine(mla, EngineConfig(**ec, mesh=mesh)).generate(prompts, SamplingParams(max_new_tokens=3))
    out["engine_dp_tokens"] = np.array([r.output_tokens for r in reqs])
    return out


def check_multihost_reference(out_dir):
    np.savez(os.path.join(out_dir, "multihost_reference.npz"), **multihost_case(_mesh()))


def check_tp_sinks_named_globally():
    """Sinks of the wrong shape are refused with the global head count; inside shard_map the
    message named each device's slice ("must have shape (2,) ..., got (1,)" for 2 sinks of 4
    heads), and 3 sinks over 2 devices failed in shard_map's divisibility check."""
    import jax.numpy as jnp

    from jattn.sharding import TensorParallel

    tp = TensorParallel(_mesh(n=2))
    rng = np.random.default_rng(3)
    kc, vc, pt, _ = _pool(rng, [6], 4, 2, 8, 8)
    q = jnp.asarray(rng.standard_normal((1, 4, 8)), jnp.float32)
    args = (q, jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(pt), jnp.array([6], jnp.int32))
    for n in (2, 3, 8):
        try:
            tp.mha_decode_with_kvcache(*args, sinks=jnp.zeros(n))
        except ValueError as e:
            assert f"sinks must have shape (4,) (one per query head), got ({n},)" in str(e), e
        else:
            raise AssertionError(f"sinks of shape ({n},) accepted for 4 query heads")


def _refused(call, *words):
    try:
        call()
    except ValueError as e:
        assert all(w in str(e) for w in words), (words, e)
    else:
        raise AssertionError(f"accepted; expected a ValueError naming {words}")


def check_tp_eager_calls():
    """Outside jit, the tensor-parallel ops check the global arguments' values as the
    one-device op does (inside shard_map each device saw traced slices: a page id past the
    pool, a length past the table, a zero scale and a NaN sink were all accepted) and
    compile one program per call signature (each call compiled about 9 afresh).
    TensorParallelMHABackend refuses q/k/v of the wrong head layout by name (it reshaped
    them silently) and k without v."""
    import jax.numpy as jnp
    from jax._src import monitoring

    import jattn
    from jattn.sharding import TensorParallel, TensorParallelMHABackend

    mesh = _mesh()
    tp = TensorParallel(mesh)
    rng = np.random.default_rng(8)
    hq, hkv, d, ps = 8, 4, 12, 4
    kc, vc, pt, pages = _pool(rng, [11, 6], ps, hkv, d, d)
    kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
    lens = jnp.array([11, 6], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, hq, d)), jnp.float32)
    args = (q, jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(pt), lens)
    bad_pt = jnp.asarray(pt).at[0, 1].set(pages + 3)
    _refused(lambda: tp.mha_decode_with_kvcache(*args[:3], bad_pt, lens), "page_table[0, 1]", "out of range")
    _refused(lambda: tp.mha_decode_with_kvcache(*args[:4], lens.at[0].set(99)), "cache_seqlens[0]=99")
    _refused(lambda: tp.mha_decode_with_kvcache(*args, k_scale=jnp.float32(0)), "k_scale=0.0")
    _refused(lambda: tp.mha_decode_with_kvcache(*args, sinks=jnp.full((hq,), jnp.nan)), "sinks[0]=nan")
    cu = jnp.array([0, 1, 2], jnp.int32)
    _refused(lambda: tp.mha_extend_with_kvcache(*args, cu.at[1].set(3), max_seqlen_q=1), "cu_seqlens_q")
    compiles = [0]

    def count(event, duration, **kw):
        compiles[0] += event == "/jax/core/compile/backend_compile_duration"

    monitoring.register_event_duration_secs_listener(count)
    scale = dict(k_scale=jnp.float32(0.5))  # an array keyword is an argument of the one program, not a constant
    ref = jattn.mha_decode_with_kvcache(*args, backend="xla", logit_cap=3.0, **scale)
    outs = []
    for i in range(3):
        before = compiles[0]
        outs.append(tp.mha_decode_with_kvcache(*args, backend="xla", logit_cap=3.0, **scale))
        assert i == 0 or compiles[0] == before, f"eager call {i} compiled {compiles[0] - before} programs"
    for out in outs:
        _close(out, ref, 1e-6)
    # sinks as a list, as the one-device op takes them (one argument, not hq leaves)
    sinks = [0.5] * hq
    _close(tp.mha_decode_with_kvcache(*args, sinks=sinks), jattn.mha_decode_with_kvcache(*args, sinks=sinks), 1e-6)
    # the backend wrapper: the inner backend's shape rules
    inner = jattn.MHABackend(jattn.MHAConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps,
                                             num_pages=pages))  # fmt: skip
    be = TensorParallelMHABackend(inner, mesh)
    layer = jattn.LayerSpec(layer_id=0, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    cache = tp.shard_kv_cache(jattn.PagedKVCache(k=(kc,), v=(vc,)))
    md = inner.init_forward_metadata(2, np.arange(2), np.array([5, 3]), pt[:, :2], jattn.ForwardMode.EXTEND,
                                     extend_seq_lens=np.array([5, 3]))  # fmt: skip
    qt = rng.standard_normal((md.num_tokens, hq * d)).astype(np.float32)
    kt = rng.standard_normal((md.num_tokens, hkv, d)).astype(np.float32)
    fwd = be.forward_extend
    _refused(lambda: fwd(qt.reshape(-1, 4, 24), kt, kt, layer, cache, md), "q shape", "[T, 8, 12]")
    _refused(lambda: fwd(qt, kt.reshape(-1, 2, 24), kt, layer, cache, md), "k shape", "[T, 4, 12]")
    _refused(lambda: fwd(qt, kt, None, layer, cache, md), "k and v must both be given")
    # and the inner call's value checks on the global plan and sinks (each device's were
    # traced: a page id past the pool was read through a clamped gather, NaN sinks taken),
    # sinks as a list as the one-device backend takes them (shard_map refused them)
    bad = dataclasses.replace(md, page_table=np.asarray(md.page_table).copy())
    bad.page_table[0, 1] = pages + 5
    _refused(lambda: fwd(qt, kt, kt, layer, cache, bad), "page_table[0, 1]", "out of range")
    _refused(lambda: fwd(qt, kt, kt, layer, cache, md, sinks=np.full(hq, np.nan, np.float32)), "sinks[0]=nan")
    out, _ = fwd(qt, kt, kt, layer, cache, md, sinks=[0.5] * hq)
    want, _ = inner.forward_extend(qt, kt, kt, layer, jattn.PagedKVCache(k=(kc,), v=(vc,)), md, sinks=[0.5] * hq)
    _close(out, want, 1e-5)
    # a non-causal layer checks the plan as non-causal: its new tokens need not be the last
    # of the cached length (here 5 and 3 new tokens over lengths 2 and 3), which a causal
    # check refuses; the one-device backend takes the call
    free = dataclasses.replace(layer, non_causal=True)
    short = dataclasses.replace(md, cache_seqlens=jnp.array([2, 3], jnp.int32))
    out, _ = fwd(qt, kt, kt, free, cache, short)
    want, _ = inner.forward_extend(qt, kt, kt, free, jattn.PagedKVCache(k=(kc,), v=(vc,)), short)
    _close(out, want, 1e-5)


def check_mla_dp_one_device():
    """An MLA engine on a mesh of one device (a one-GPU host's ``Mesh(jax.devices(),
    ("dp",))``) gives the tokens of the engine without a mesh (every request failed: the
    engine passes a one-device axis its plan unstacked); the wrapper's ``save_kv`` takes the
    fused rope's arguments as ``MLABackend.save_kv`` does, and ``forward_prefix_chunk`` runs
    on each device's own rows."""
    from flax import nnx

    from jattn.kv_cache import MLAKVCache
    from jattn.models.config import DeepseekConfig
    from jattn.models.deepseek import Deepseek, default_mla_backend
    from jattn.models.engine import Engine, EngineConfig, SamplingParams
    from jattn.sharding import DataParallelMLABackend

    cfg = DeepseekConfig.tiny()
    model = Deepseek(cfg, rngs=nnx.Rngs(60))
    rng = np.random.default_rng(61)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (5, 9, 1)]
    ec = dict(page_size=4, num_pages=24, max_context=32, batch_buckets=(2, 4), token_buckets=(16,))
    sp = SamplingParams(max_new_tokens=3)
    want = [r.output_tokens for r in Engine(model, EngineConfig(**ec)).generate(prompts, sp)]
    got = Engine(model, EngineConfig(**ec, mesh=_mesh("dp", n=1), mesh_axis="dp")).generate(prompts, sp)
    assert [(r.status, r.output_tokens) for r in got] == [("finished", w) for w in want], (got, want)
    # save_kv with the fused rope: k_pe arrives unrotated, rotated at each device's positions
    inner = default_mla_backend(cfg, 4)
    be = DataParallelMLABackend(inner, _mesh("dp"))
    R, r, pages = cfg.kv_lora_rank, cfg.qk_rope_head_dim, 6
    layer = model.layers[0].self_attn.spec
    pool = rng.standard_normal((4 * pages, 4, R + r)).astype(np.float32)
    cache = MLAKVCache((pool,), R)
    loc = np.concatenate([rng.permutation(np.arange(4, pages * 4))[:3] for _ in range(4)]).astype(np.int32)
    c_kv, k_pe = rng.standard_normal((12, R)).astype(np.float32), rng.standard_normal((12, r)).astype(np.float32)
    pos, table = rng.integers(0, 32, 12).astype(np.int32), rng.standard_normal((32, r)).astype(np.float32)
    got = be.save_kv(layer, cache, loc, c_kv, k_pe, cos_sin_cache=table, is_neox=True, positions=pos)
    got = np.asarray(got.kv[0]).reshape(4, pages, 4, R + r)
    for dev in range(4):
        sl = slice(3 * dev, 3 * dev + 3)
        one = MLAKVCache((pool.reshape(4, pages, 4, R + r)[dev],), R)
        want = inner.save_kv(layer, one, loc[sl], c_kv[sl], k_pe[sl], cos_sin_cache=table, is_neox=True,
                             positions=pos[sl])  # fmt: skip
        np.testing.assert_array_equal(got[dev], np.asarray(want.kv[0]))
    # a prefix chunk on each device's own tokens and keys (it ran unsharded, through the
    # inner backend, on the devices' offsets concatenated); device 2's requests have no keys
    nope, H = cfg.qk_nope_head_dim, cfg.num_heads
    tq, tk, dv = 8, 12, cfg.v_head_dim
    cu_q = np.array([[0, 3, 5], [0, 8, 8], [0, 2, 6], [0, 1, 1]], np.int32)
    cu_kv = np.array([[0, 7, 12], [0, 4, 4], [0, 0, 0], [0, 9, 11]], np.int32)
    q = rng.standard_normal((4 * tq, H, nope + r)).astype(np.float32)
    k = rng.standard_normal((4 * tk, H, nope + r)).astype(np.float32)
    v = rng.standard_normal((4 * tk, H, dv)).astype(np.float32)
    pos = rng.integers(0, 32, 4 * tq).astype(np.int32)
    kw = dict(max_seqlen_q=8, max_seqlen_kv=9, cos_sin_cache=table, is_neox=False)
    o, lse = be.forward_prefix_chunk(q, k, v, layer, cu_q.reshape(-1), cu_kv.reshape(-1), positions=pos, **kw)
    for dev in range(4):
        sq, sk = slice(dev * tq, (dev + 1) * tq), slice(dev * tk, (dev + 1) * tk)
        wo, wl = inner.forward_prefix_chunk(q[sq], k[sk], v[sk], layer, cu_q[dev], cu_kv[dev], positions=pos[sq], **kw)
        real = int(cu_q[dev, -1])
        np.testing.assert_allclose(np.asarray(o)[sq][:real], np.asarray(wo)[:real], atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(lse)[sq][:real], np.asarray(wl)[:real])
    assert np.isneginf(np.asarray(lse)[2 * tq : 2 * tq + 6]).all()


def check_mla_dp_draft_block():
    """DFLASH under data parallelism: ``fill_block_decode_seq_lens`` on a stacked plan took
    it as one plan of ``n * B`` rows (lengths mixed across devices); it fills each device's
    plan now. Planning every device with one ``batch_buckets`` (so the plans stack) was not
    possible: decode ignored the argument and extend raised a TypeError."""
    import jax
    import jax.numpy as jnp

    from jattn import ForwardMode, MLABackend, MLAConfig
    from jattn.plan_stack import stack_plans
    from jattn.sharding import DataParallelMLABackend

    cfg = MLAConfig(
        num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, page_size=4,
        context_len=32, num_pages=20, dtype="float32", kv_cache_dtype="float32", spec_num_tokens=2,
        batch_buckets=(1, 2, 4),
    )  # fmt: skip
    inner = MLABackend(cfg)
    dp = DataParallelMLABackend(inner, _mesh("dp"))
    rng = np.random.default_rng(70)
    counts, plans, lens = [1, 2, 0, 2], [], []
    for b in counts:
        r2p = rng.permutation(np.arange(1, 20))[:16].reshape(2, 8).astype(np.int32)
        seq = np.array([6, 9][:b], np.int32)
        plans.append(dp.init_forward_metadata(b, np.arange(b), seq, r2p, ForwardMode.DRAFT_BLOCK, batch_buckets=(2,)))
        lens.append(np.array([8, 11], np.int32))
    assert [p.batch_size for p in plans] == [2] * 4  # one bucket for all, as asked
    ext = dp.init_forward_metadata(1, [0], [3], r2p, ForwardMode.EXTEND, extend_seq_lens=[1], batch_buckets=(4,))
    assert ext.batch_size == 4
    st = stack_plans(plans)
    want = stack_plans([inner.fill_block_decode_seq_lens(p, counts[d], lens[d]) for d, p in enumerate(plans)])
    got = jax.jit(dp.fill_block_decode_seq_lens)(st, jnp.asarray(counts, jnp.int32), np.concatenate(lens))
    for f in ("cache_seqlens", "out_cache_loc", "positions", "num_reqs", "page_table"):
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)), err_msg=f)
    try:
        dp.fill_block_decode_seq_lens(st, sum(counts), np.concatenate(lens))
    except ValueError as e:
        assert "one request count per device" in str(e)
    else:
        raise AssertionError("a single bs was taken for a stacked plan")


def check_mla_dp_eager_values():
    """Outside jit the data-parallel MLA wrapper checks each device's values as the
    one-device backend does (inside shard_map they were traced and passed): a page id past
    the device's pool (it read the next device's pages), offsets past a device's rows or
    decreasing, a request longer than max_seqlen_q, a zero or NaN llama_4_scaling. On a
    one-device axis fill_block_decode_seq_lens takes a plain plan and bs, as the inner
    backend does, and gives a plain plan back."""
    from jattn import ForwardMode, LayerSpec, MLABackend, MLAConfig
    from jattn.kv_cache import MLAKVCache
    from jattn.plan_stack import stack_plans
    from jattn.sharding import DataParallelMLABackend

    cfg = MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                    page_size=4, context_len=32, num_pages=10, dtype="float32", kv_cache_dtype="float32",
                    batch_buckets=(2,), spec_num_tokens=2)  # fmt: skip
    inner = MLABackend(cfg)
    dp = DataParallelMLABackend(inner, _mesh("dp"))
    layer = LayerSpec(0, 2, 1, 16, v_head_dim=8)
    rng = np.random.default_rng(90)
    cache = MLAKVCache((rng.standard_normal((40, 4, 24)).astype(np.float32),), 16)
    r2p = np.arange(1, 9, dtype=np.int32).reshape(2, 4)
    plans = [inner.init_forward_metadata(2, np.arange(2), np.array([9, 5]), r2p, ForwardMode.DECODE)] * 4
    t = plans[0].num_tokens
    q = rng.standard_normal((4 * t, 2, 24)).astype(np.float32)
    pt = np.asarray(plans[0].page_table).copy()
    pt[0, 1] = 13  # device 1's page 3
    bad = stack_plans([plans[0]] * 3 + [dataclasses.replace(plans[0], page_table=pt)])
    dec = dp.forward_decode
    _refused(lambda: dec(q, None, None, layer, cache, bad, False), "device 3 of mesh axis 'dp'", "page_table[0, 1]=13")
    scale = np.ones(4 * t, np.float32)
    scale[5] = 0
    plan = stack_plans(plans)
    _refused(lambda: dec(q, None, None, layer, cache, plan, False, llama_4_scaling=scale), "llama_4_scaling[5]=0.0")
    H, nope, r, dv = 2, 8, 8, 8
    qp = rng.standard_normal((16, H, nope + r)).astype(np.float32)
    kp = rng.standard_normal((24, H, nope + r)).astype(np.float32)
    vp = rng.standard_normal((24, H, dv)).astype(np.float32)
    cu_q, cu_kv = np.array([0, 2, 4] * 4, np.int32), np.array([0, 3, 6] * 4, np.int32)
    chunk = functools.partial(dp.forward_prefix_chunk, max_seqlen_q=2, max_seqlen_kv=3)
    _refused(lambda: chunk(qp, kp, vp, layer, cu_q, np.r_[cu_kv[:3], [0, 5, 4], cu_kv[6:]]),
             "device 1 of mesh axis 'dp'", "cu_seqlens_kv must be non-decreasing")  # fmt: skip
    _refused(lambda: chunk(qp, kp, vp, layer, np.r_[cu_q[:9], [0, 2, 6]], cu_kv), "cu_seqlens_q[-1]=6 exceeds the 4")
    _refused(lambda: chunk(qp, kp, vp, layer, np.r_[[0, 1, 4], cu_q[3:]], cu_kv), "request 1 has 3 tokens")
    o, _ = chunk(qp, kp, vp, layer, cu_q, cu_kv)
    assert np.isfinite(np.asarray(o)).all()
    one = DataParallelMLABackend(inner, _mesh("dp", n=1))
    blk = inner.init_forward_metadata(1, [0], [6], r2p, ForwardMode.DRAFT_BLOCK)
    got = one.fill_block_decode_seq_lens(blk, 1, np.array([8, 0], np.int32))
    want = inner.fill_block_decode_seq_lens(blk, 1, np.array([8, 0], np.int32))
    assert np.shape(got.num_reqs) == () and np.array_equal(got.cache_seqlens, want.cache_seqlens)


CHECKS = {
    "tp_sinks": check_tp_sinks_named_globally,
    "mla_dp_eager_values": check_mla_dp_eager_values,
    "tp_eager": check_tp_eager_calls,
    "mla_dp_one_device": check_mla_dp_one_device,
    "mla_dp_draft_block": check_mla_dp_draft_block,
    "ops_decode": check_ops_decode,
    "ops_extend": check_ops_extend,
    "ops_prefill": check_ops_prefill,
    "backend_mha": check_backend_mha,
    "mosaic_interpreted": check_mosaic_interpreted,
    "llama_tp": check_llama_tp,
    "engine_tp": check_engine_tp,
    "mla_dp": check_mla_dp,
    "engine_dp_mla": check_engine_dp_mla,
    "multihost_reference": check_multihost_reference,
}


def run_checks(out_dir: str, names: list[str]) -> None:
    """Subprocess entry (4 virtual devices): the checks ``names``, each result in ``results.json``."""
    import jax

    assert jax.device_count() == 4, jax.devices()
    results = {}
    for name in names:
        fn = CHECKS[name]
        try:
            res = fn(out_dir) if name == "multihost_reference" else fn()
            results[name] = res if isinstance(res, str) else "ok"
        except Exception:  # noqa: BLE001 - reported to the test of that check
            results[name] = traceback.format_exc()
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f)


def run_multihost(process_id: int, port: int, out_dir: str) -> None:
    """Subprocess entry: one of two processes, 2 virtual devices each, 4 in the mesh."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert (jax.device_count(), jax.local_device_count(), jax.process_count()) == (4, 2, 2)
    np.savez(os.path.join(out_dir, f"multihost_{process_id}.npz"), **multihost_case(_mesh()))


# ============================================================================ tests (main process)


def _run_checks(tmp_path_factory, names: list[str]) -> tuple[str, dict]:
    """One 4-device subprocess runs the checks ``names``: (its output folder, the results)."""
    d = str(tmp_path_factory.mktemp("sharding"))
    code = f"import test_sharding as t; t.run_checks({d!r}, {names!r})"
    r = subprocess.run([sys.executable, "-c", code], env=_env(4), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    with open(os.path.join(d, "results.json")) as f:
        return d, json.load(f)


# Each check runs in its own subprocess (a few seconds of start-up each), so that the
# pytest-xdist workers share them: one process for all of them took about 5 minutes on one
# worker. The multihost reference runs in the multihost test.
@pytest.mark.parametrize("name", [n for n in CHECKS if n != "multihost_reference"])
def test_sharded_equals_unsharded(name, tmp_path_factory):
    res = _run_checks(tmp_path_factory, [name])[1][name]
    if res.startswith("skip: "):
        pytest.skip(res[len("skip: ") :])
    assert res == "ok", res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multihost_two_processes_equal_one_process(tmp_path_factory):
    """Two processes (jax.distributed, gloo) of 2 devices each = one process of 4."""
    import jax

    if not hasattr(jax.config, "jax_cpu_collectives_implementation"):
        pytest.skip("this jax has no CPU collectives option (jax_cpu_collectives_implementation)")
    d, results = _run_checks(tmp_path_factory, ["multihost_reference"])
    assert results["multihost_reference"] == "ok", results["multihost_reference"]
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"import test_sharding as t; t.run_multihost({i}, {port}, {d!r})"],
            env=_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        errs.append((p.returncode, err[-3000:]))
    assert all(rc == 0 for rc, _ in errs), errs
    ref = np.load(os.path.join(d, "multihost_reference.npz"))
    for i in range(2):
        got = np.load(os.path.join(d, f"multihost_{i}.npz"))
        for k in ref.files:
            np.testing.assert_allclose(got[k], ref[k], atol=1e-5, rtol=1e-5, err_msg=f"process {i}: {k}")


# ---- in-process: the rules, which need no devices


def test_head_partition_rules():
    from jattn.sharding import HeadPartition

    hp = HeadPartition(8, 2, 4)
    assert (hp.kv_replicas, hp.physical_kv_heads, hp.local_q_heads, hp.local_kv_heads) == (2, 4, 2, 1)
    hp = HeadPartition(16, 8, 4)
    assert (hp.kv_replicas, hp.physical_kv_heads, hp.local_q_heads, hp.local_kv_heads) == (1, 8, 4, 2)
    for args, words in (
        ((6, 2, 4), "num_q_heads=6 must be divisible by the size 4 of mesh axis 'tp'"),
        ((12, 6, 4), "num_kv_heads=6 must be divisible by the size 4"),
        ((12, 3, 4), "must be a multiple of num_kv_heads=3"),
        ((8, 3, 2), "num_kv_heads=3 must be divisible by the size 2"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            HeadPartition(*args)


@pytest.mark.parametrize(
    "args,words",
    [
        ((8.0, 2, 4), "num_q_heads=8.0 must be an int >= 1"),
        ((0, 2, 2), "num_q_heads=0 must be an int >= 1"),  # passed: 0 query heads per device
        ((8, 2, True), "the size of mesh axis 'tp' must be an int >= 1, got True"),
        ((8, 2.0, 2), "num_kv_heads=2.0 must be an int >= 1"),
    ],
)
def test_head_partition_counts_are_ints(args, words):
    from jattn.sharding import HeadPartition, TensorParallel

    with pytest.raises(ValueError, match=re.escape(words)):
        HeadPartition(*args)
    # TensorParallel's helpers pass them on unconverted (int() made 8.7 heads 8)
    tp = TensorParallel(_mesh())
    with pytest.raises(ValueError, match="num_kv_heads=2.5 must be an int"):
        tp.physical_kv_heads(2.5)
    with pytest.raises(ValueError, match="num_kv_heads=True must be an int"):
        tp.create_kv_cache(num_layers=1, num_pages=2, page_size=4, num_kv_heads=True, head_dim=8)
    with pytest.raises(ValueError, match="num_q_heads=8.7 must be an int"):
        tp.heads(8.7, 1)


def test_stack_plans_stacks_cascade_prefix_pages():
    """A cascade plan's prefix_pages (an array) was compared as a static field: the
    truth value of an array was ambiguous. It is per-device data, concatenated."""
    import jattn
    from jattn.sharding import stack_plans

    pt = np.array([[1, 2, 0], [1, 3, 0], [4, 5, 0], [4, 6, 0]], np.int32)

    def plan(prefix_pages, group_size=2):
        return jattn.plan_decode(
            np.array([6, 7, 5, 8]), page_size=4, page_table=pt, group_size=group_size,
            prefix_pages=prefix_pages, batch_buckets=None,
        )  # fmt: skip

    md = stack_plans([plan([1, 1]), plan([1, 0])])
    np.testing.assert_array_equal(md.prefix_pages, [1, 1, 1, 0])
    assert md.group_size == 2 and md.page_table.shape == (8, 2)
    assert stack_plans([plan(None, 1)] * 2).prefix_pages is None
    with pytest.raises(ValueError, match="the static field group_size differs across the plans"):
        stack_plans([plan([1, 1]), plan(None, 1)])
    ext = [
        jattn.plan_extend(
            np.array(sl), np.array(new), page_size=4, page_table=np.array([[1, 2], [3, 4]]), batch_buckets=(2,)
        )
        for sl, new in (([5, 3], [5, 3]), ([6, 8], [1, 2]))
    ]
    md = stack_plans(ext)  # has_prefix: any plan's; max_seqlen_q: the largest bound
    assert md.has_prefix and md.max_seqlen_q == max(p.max_seqlen_q for p in ext)


def test_expand_kv_copies_each_head_to_its_query_heads():
    from jattn.sharding import HeadPartition

    hp = HeadPartition(8, 2, 4)
    x = np.random.default_rng(0).standard_normal((3, 2, 5)).astype(np.float32)
    y = np.asarray(hp.expand_kv(x, 1))
    group_logical, group_physical = 8 // 2, 8 // 4
    for h in range(8):  # query head h reads the same values through either layout
        np.testing.assert_array_equal(y[:, h // group_physical], x[:, h // group_logical])
    with pytest.raises(ValueError, match="logical"):
        hp.expand_kv(x[:, :1], 1)


def test_wrappers_name_the_bad_mesh_and_axis():
    import jax
    from jax.sharding import Mesh

    from jattn.sharding import DataParallelMLABackend, TensorParallel, stack_plans

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    with pytest.raises(ValueError, match="axis='dp' is not an axis of the mesh"):
        TensorParallel(mesh, "dp")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        DataParallelMLABackend(None, "not a mesh", "dp")
    with pytest.raises(ValueError, match="plans is empty"):
        stack_plans([])
    # a stacked pool is not laid out by head per layer: refused, not split on the wrong axis
    from jattn import LayerSpec, MHABackend, MHAConfig, PagedKVCache
    from jattn.sharding import TensorParallelMHABackend

    stacked = PagedKVCache.create(num_layers=2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8, stacked=True)
    with pytest.raises(ValueError, match="shard_kv_cache: the KV cache is stacked"):
        TensorParallel(mesh, "tp").shard_kv_cache(stacked)
    be = TensorParallelMHABackend(MHABackend(MHAConfig(num_q_heads=2, num_kv_heads=2, head_dim=8, page_size=4)), mesh)
    with pytest.raises(ValueError, match="TensorParallelMHABackend: the KV cache is stacked"):
        be._local(LayerSpec(1, 2, 2, 8), stacked, None)


def test_engine_places_a_request_on_the_device_with_room_and_most_free_pages():
    from jattn.models.pages import PagePool, place

    pools = [PagePool(8), PagePool(8)]
    pools[0].alloc(3)
    assert place(pools, [1, 0], [True, True]) == 1  # the most free pages
    assert place(pools, [1, 0], [True, False]) == 0  # the only one with room
    assert place(pools, [0, 0], [False, False]) is None
    pools[1].alloc(3)
    assert place(pools, [2, 1], [True, True]) == 1  # equal free pages: fewer requests


def test_page_pool_counts_holders_and_names_a_leak():
    from jattn.models.pages import PagePool

    pool = PagePool(6)
    a = pool.alloc(2)
    pool.hold(a[:1])  # a shared prompt page: two holders
    pool.check({a[0]: 2, a[1]: 1})
    pool.unref(a)  # a[0] still held once, a[1] free again
    assert pool.num_free == 4 and pool.refs == {a[0]: 1}
    with pytest.raises(RuntimeError, match="page holders of device 1's pool differ"):
        pool.check({}, "device 1's pool")
    pool.allocator.alloc(1)  # taken from the free list behind the pool's back
    with pytest.raises(RuntimeError, match="pages leaked in the pool: 3 free \\+ 1 held != 5"):
        pool.check({a[0]: 1})


def test_page_pool_refuses_a_bad_release_whole():
    """A page dropped more times than it is held, or never held, raises before any count
    changes (the pages dropped before the bad one were lost: in neither the counts nor the
    free list); so does holding a page not in use."""
    from jattn.models.pages import PagePool

    pool = PagePool(5)
    x = pool.alloc(2)
    with pytest.raises(ValueError, match=rf"unref: page {x[0]} is dropped 2 times but has 1 holders"):
        pool.unref([x[0], x[0]])
    with pytest.raises(ValueError, match=r"unref: page 3 is dropped 1 times but has 0 holders"):
        pool.unref([x[1], 3])
    assert pool.refs == {x[0]: 1, x[1]: 1} and pool.num_free == 2
    with pytest.raises(ValueError, match=r"hold: page 3 is not in use"):
        pool.hold([x[0], 3])
    assert pool.refs == {x[0]: 1, x[1]: 1}
    pool.hold([x[0]])
    pool.unref([x[0], x[0], x[1]])  # a page listed twice drops two holders
    assert pool.refs == {} and pool.num_free == 4


def check_llama_tp_replicated_kv_bias():
    """Tensor-parallel Llama with 2 KV heads on 4 devices (each KV head replicated twice)
    and random, nonzero q/k/v biases: the replicated k/v biases must follow their heads'
    weights (head h's bias on both of h's copies), so the steps equal the unsharded model."""
    import jax.numpy as jnp
    from flax import nnx

    from jattn.models import parallel
    from jattn.models.llama import default_mha_backend

    mesh = _mesh()
    model = _llama(30, qkv_bias=True)
    rng = np.random.default_rng(30)
    for layer in model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias = nnx.Param(jnp.asarray(rng.standard_normal(proj.bias[...].shape), proj.bias[...].dtype))
    ps, pages = 4, 8
    ref, _, _ = _llama_steps(
        model, default_mha_backend(model.config, ps), model.make_cache(num_pages=pages, page_size=ps),
        np.random.default_rng(1), ps, pages,
    )  # fmt: skip
    tp_model = parallel.tensor_parallel(model, mesh)
    assert tp_model.config.num_kv_heads == 4  # replicated
    be = parallel.tensor_parallel_backend(tp_model, mesh, page_size=ps)
    cache = parallel.make_cache(tp_model, be, num_pages=pages, page_size=ps)
    out, _, _ = _llama_steps(tp_model, be, cache, np.random.default_rng(1), ps, pages)
    for a, b in zip(out, ref):
        _close(a, b, 2e-5)


CHECKS["llama_tp_replicated_kv_bias"] = check_llama_tp_replicated_kv_bias


def test_tensor_parallel_replicates_kv_biases_with_their_heads(tmp_path_factory):
    """:func:`check_llama_tp_replicated_kv_bias` in a 4-device subprocess: the
    replicated KV heads' biases are repeated per head (``[h0, h0, h1, h1]``), as their
    weights are; the other Llama checks' biases are zero, so they cannot see it."""
    res = _run_checks(tmp_path_factory, ["llama_tp_replicated_kv_bias"])[1]["llama_tp_replicated_kv_bias"]
    assert res == "ok", res
