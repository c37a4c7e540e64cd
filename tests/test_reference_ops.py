"""Every public op (backend="xla") against the independent float64 loops in tests/naive.py.

Cases combine the features (causal / non-causal, multi-token decode, sliding window,
logit cap, sinks, FP8 KV with scales, LSE, empty requests, GQA 1/4/8, 192/128 prefill,
MLA absorbed decode) over awkward lengths (0, 1, 97, page boundaries) with permuted page
tables, NaN in every unused slot/page and in padded query rows. Data is fresh and random.
"""

from __future__ import annotations

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import naive  # tests/naive.py (pytest puts tests/ on sys.path)
import numpy as np
import pytest

import jattn
from jattn.pallas_kernels.interpret import on_gpu

F32_TOL = dict(atol=2e-5, rtol=2e-5)
BF16_ATOL = 2e-3


def _lowp(dtype) -> bool:
    return dtype in ("bf16", "f16")


def _jdt(dtype):
    return {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]


def _round(x, dtype):
    if dtype == "bf16":
        return naive.bf16_round(x)
    if dtype == "f16":
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)
    return np.asarray(x, np.float32)


def _check(out, lse, truth, truth_lse, *, dtype, baseline=None):
    """out/lse from the op; truth from naive on the unrounded data; baseline from naive on
    the rounded data (only for bf16/f16)."""
    out = np.asarray(out, np.float64)
    assert out.shape == truth.shape, (out.shape, truth.shape)
    assert not np.isnan(out).any(), "output has NaN"
    empty_rows = np.isneginf(truth_lse)
    assert (out[empty_rows] == 0).all(), "rows that see no key must be exactly 0"
    if _lowp(dtype):
        naive.assert_close_lowp(out, truth, _round(baseline, dtype), atol=BF16_ATOL)
        if lse is not None:
            naive.assert_lse(lse, truth_lse, atol=2e-2, rtol=1e-2)
    else:
        np.testing.assert_allclose(out, truth, **F32_TOL)
        if lse is not None:
            naive.assert_lse(lse, truth_lse)


# ----------------------------------------------------------------------------- paged decode

# (id, dtype, lens, page_size, num_kv_heads, group, head_dim, q_len, causal, window, cap, sinks, fp8 scales)
DECODE_CASES = [
    ("f32-basic-g1", "f32", [0, 1, 97, 16, 33], 16, 2, 1, 32, 1, True, -1, 0.0, False, None),
    ("f32-verify-g4-window", "f32", [3, 97, 32, 50], 16, 2, 4, 32, 3, True, 20, 0.0, False, None),
    ("f32-draft-g8-cap-sinks", "f32", [4, 64, 97, 0], 8, 1, 8, 64, 4, False, -1, 5.0, True, None),
    ("fp8-scales-g4-lse", "fp8", [1, 97, 17, 0, 48], 16, 2, 4, 32, 1, True, -1, 0.0, False, (0.5, 2.0)),
    ("fp8-verify-window-sinks", "fp8", [5, 97, 33], 16, 1, 4, 32, 2, True, 9, 0.0, True, (0.25, 1.5)),
    ("bf16-g4-all", "bf16", [97, 48, 1, 0], 16, 2, 4, 64, 1, True, 7, 30.0, True, None),
    ("bf16-draft-window", "bf16", [8, 97, 31], 16, 2, 1, 32, 2, False, 11, 0.0, False, None),
    ("f32-page1", "f32", [0, 5, 13], 1, 1, 4, 16, 1, True, -1, 0.0, True, None),
    ("f16-verify-cap", "f16", [4, 96, 97], 32, 1, 8, 32, 4, True, -1, 2.0, False, None),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_mha_decode(case):
    _, dtype, lens, ps, hkv, group, d, q_len, causal, window, cap, use_sinks, fp8 = case
    rng = np.random.default_rng(zlib.crc32(case[0].encode()))
    hq = hkv * group
    pool = naive.Pool(rng, lens, ps)
    bs = len(lens)
    q = rng.standard_normal((bs * q_len, hq, d)).astype(np.float32)
    for b, length in enumerate(lens):
        if length == 0:  # padded rows: NaN queries must still give exactly 0
            q[b * q_len : (b + 1) * q_len] = np.nan
    sinks = rng.standard_normal(hq).astype(np.float32) * 2 if use_sinks else None
    scale = 0.7 / math.sqrt(d) if case[0].startswith("f32-verify") else None
    kw = dict(max_seqlen_q=q_len, is_causal=causal, window_left=window, logit_cap=cap, softmax_scale=scale)
    if fp8:
        ks, vs = fp8
        kc = naive.quantize_fp8(pool.fill(rng, (hkv, d), scale=3.0 * ks), ks)
        vc = naive.quantize_fp8(pool.fill(rng, (hkv, d), scale=3.0 * vs), vs)
        out, lse = jattn.mha_decode_with_kvcache(
            jnp.asarray(q),
            jnp.asarray(kc),
            jnp.asarray(vc),
            jnp.asarray(pool.page_table),
            jnp.asarray(pool.lens),
            sinks=None if sinks is None else jnp.asarray(sinks),
            k_scale=ks,
            v_scale=vs,
            return_lse=True,
            backend="xla",
            **kw,
        )
        truth, tl = naive.mha_decode(q, kc, vc, pool.page_table, pool.lens, sinks=sinks, k_scale=ks, v_scale=vs, **kw)
        _check(out, lse, truth, tl, dtype="f32")
        return
    kc, vc = pool.fill(rng, (hkv, d)), pool.fill(rng, (hkv, d))
    jd = _jdt(dtype)
    out, lse = jattn.mha_decode_with_kvcache(
        jnp.asarray(q, jd),
        jnp.asarray(kc, jd),
        jnp.asarray(vc, jd),
        jnp.asarray(pool.page_table),
        jnp.asarray(pool.lens),
        sinks=None if sinks is None else jnp.asarray(sinks),
        return_lse=True,
        backend="xla",
        **kw,
    )
    assert out.dtype == jd and lse.dtype == jnp.float32
    assert lse.shape == (bs * q_len, hq)
    truth, tl = naive.mha_decode(q, kc, vc, pool.page_table, pool.lens, sinks=sinks, **kw)
    base = None
    if _lowp(dtype):
        base, _ = naive.mha_decode(
            _round(q, dtype), _round(kc, dtype), _round(vc, dtype), pool.page_table, pool.lens, sinks=sinks, **kw
        )
    _check(out, lse, truth, tl, dtype=dtype, baseline=base)


def test_mha_decode_without_lse_matches_with_lse():
    rng = np.random.default_rng(1)
    pool = naive.Pool(rng, [20, 7], 8)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    kc, vc = jnp.asarray(pool.fill(rng, (2, 16))), jnp.asarray(pool.fill(rng, (2, 16)))
    args = (q, kc, vc, jnp.asarray(pool.page_table), jnp.asarray(pool.lens))
    out = jattn.mha_decode_with_kvcache(*args, backend="xla")
    out2, _ = jattn.mha_decode_with_kvcache(*args, backend="xla", return_lse=True)
    assert not isinstance(out, tuple)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))


# ----------------------------------------------------------------------------- paged extend

# (id, dtype, prefix_lens, new_lens, pad_tokens, page_size, hkv, group, d, causal, window, cap, sinks, fp8)
EXTEND_CASES = [
    ("f32-mixed-g4", "f32", [0, 30, 97, 0, 5], [7, 1, 3, 0, 0], 6, 16, 2, 4, 32, True, -1, 0.0, False, None),
    ("f32-long-new-window", "f32", [16, 0, 31], [97, 12, 2], 5, 16, 1, 8, 32, True, 13, 4.0, True, None),
    ("f32-noncausal-g1", "f32", [10, 64], [6, 1], 3, 16, 3, 1, 16, False, -1, 0.0, True, None),
    ("fp8-scales", "fp8", [33, 0, 16], [4, 17, 1], 4, 16, 2, 4, 32, True, 5, 0.0, False, (0.5, 0.75)),
    ("bf16-sinks-cap", "bf16", [47, 1], [50, 15], 7, 8, 2, 4, 64, True, -1, 20.0, True, None),
]


@pytest.mark.parametrize("case", EXTEND_CASES, ids=[c[0] for c in EXTEND_CASES])
def test_mha_extend(case):
    _, dtype, prefix, new, pad, ps, hkv, group, d, causal, window, cap, use_sinks, fp8 = case
    rng = np.random.default_rng(zlib.crc32(case[0].encode()))
    hq = hkv * group
    lens = [p + n for p, n in zip(prefix, new)]
    pool = naive.Pool(rng, lens, ps)
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    total = int(cu[-1]) + pad
    q = rng.standard_normal((total, hq, d)).astype(np.float32)
    q[int(cu[-1]) :] = np.nan  # padding tokens past cu[-1]
    max_q = max(max(new), 1) + 2  # a bucket above the real maximum
    sinks = rng.standard_normal(hq).astype(np.float32) if use_sinks else None
    kw = dict(is_causal=causal, window_left=window, logit_cap=cap)
    pt, sl = jnp.asarray(pool.page_table), jnp.asarray(pool.lens)
    js = None if sinks is None else jnp.asarray(sinks)
    if fp8:
        ks, vs = fp8
        kc = naive.quantize_fp8(pool.fill(rng, (hkv, d), scale=2 * ks), ks)
        vc = naive.quantize_fp8(pool.fill(rng, (hkv, d), scale=2 * vs), vs)
        out, lse = jattn.mha_extend_with_kvcache(
            jnp.asarray(q),
            jnp.asarray(kc),
            jnp.asarray(vc),
            pt,
            sl,
            jnp.asarray(cu),
            max_seqlen_q=max_q,
            sinks=js,
            k_scale=ks,
            v_scale=vs,
            return_lse=True,
            backend="xla",
            **kw,
        )
        truth, tl = naive.mha_extend(
            q, kc, vc, pool.page_table, pool.lens, cu, sinks=sinks, k_scale=ks, v_scale=vs, **kw
        )
        _check(out, lse, truth, tl, dtype="f32")
        assert np.all(np.asarray(out)[int(cu[-1]) :] == 0)
        return
    kc, vc = pool.fill(rng, (hkv, d)), pool.fill(rng, (hkv, d))
    jd = _jdt(dtype)
    out, lse = jattn.mha_extend_with_kvcache(
        jnp.asarray(q, jd),
        jnp.asarray(kc, jd),
        jnp.asarray(vc, jd),
        pt,
        sl,
        jnp.asarray(cu),
        max_seqlen_q=max_q,
        sinks=js,
        return_lse=True,
        backend="xla",
        **kw,
    )
    truth, tl = naive.mha_extend(q, kc, vc, pool.page_table, pool.lens, cu, sinks=sinks, **kw)
    base = None
    if _lowp(dtype):
        base, _ = naive.mha_extend(
            _round(q, dtype), _round(kc, dtype), _round(vc, dtype), pool.page_table, pool.lens, cu, sinks=sinks, **kw
        )
    _check(out, lse, truth, tl, dtype=dtype, baseline=base)
    assert np.all(np.asarray(out)[int(cu[-1]) :] == 0), "padding tokens must give exactly 0"
    assert np.all(np.isneginf(np.asarray(lse)[int(cu[-1]) :]))


# ----------------------------------------------------------------------------- ragged prefill

# (id, dtype, q_lens, kv_lens (None = same), hq, hkv, dqk, dv, pad, causal, window, cap, sinks)
PREFILL_CASES = [
    ("f32-mla-192-128", "f32", [97, 1, 0, 16], None, 2, 2, 192, 128, 3, True, -1, 0.0, False),
    ("bf16-mla-192-128", "bf16", [33, 64], None, 2, 2, 192, 128, 0, True, -1, 0.0, False),
    ("f32-gqa8-window-cap-sinks", "f32", [40, 9], None, 8, 1, 32, 32, 4, True, 6, 3.0, True),
    ("f32-kv-longer", "f32", [5, 3, 0, 2], [50, 3, 7, 0], 4, 1, 16, 24, 2, True, -1, 0.0, True),
    ("f32-noncausal-kv", "f32", [4, 7], [97, 1], 4, 2, 32, 32, 0, False, -1, 0.0, False),
    ("f32-kv-shorter-causal", "f32", [6, 3], [2, 3], 2, 1, 16, 16, 1, True, -1, 0.0, False),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_mha_prefill(case):
    _, dtype, q_lens, kv_lens, hq, hkv, dqk, dv, pad, causal, window, cap, use_sinks = case
    rng = np.random.default_rng(zlib.crc32(case[0].encode()))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cukv = None if kv_lens is None else np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    tq = int(cu[-1]) + pad
    tk = int((cu if cukv is None else cukv)[-1]) + 2
    q = rng.standard_normal((tq, hq, dqk)).astype(np.float32)
    q[int(cu[-1]) :] = np.nan
    k = rng.standard_normal((tk, hkv, dqk)).astype(np.float32)
    v = rng.standard_normal((tk, hkv, dv)).astype(np.float32)
    k[tk - 2 :] = np.nan  # keys past the last request
    v[tk - 2 :] = np.nan
    sinks = rng.standard_normal(hq).astype(np.float32) if use_sinks else None
    kw = dict(is_causal=causal, window_left=window, logit_cap=cap)
    max_q = max(q_lens)
    max_kv = max(q_lens if kv_lens is None else kv_lens) + 1
    jd = _jdt(dtype)
    out, lse = jattn.mha_prefill(
        jnp.asarray(q, jd),
        jnp.asarray(k, jd),
        jnp.asarray(v, jd),
        jnp.asarray(cu),
        None if cukv is None else jnp.asarray(cukv),
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
        sinks=None if sinks is None else jnp.asarray(sinks),
        return_lse=True,
        backend="xla",
        **kw,
    )
    assert out.shape == (tq, hq, dv)
    truth, tl = naive.mha_prefill(q, k, v, cu, cukv, sinks=sinks, **kw)
    base = None
    if _lowp(dtype):
        base, _ = naive.mha_prefill(_round(q, dtype), _round(k, dtype), _round(v, dtype), cu, cukv, sinks=sinks, **kw)
    _check(out, lse, truth, tl, dtype=dtype, baseline=base)
    assert np.all(np.asarray(out)[int(cu[-1]) :] == 0)


def test_mha_prefill_fp8_kv_scales():
    rng = np.random.default_rng(7)
    cu = np.array([0, 9, 30], np.int32)
    q = rng.standard_normal((30, 4, 32)).astype(np.float32)
    k8 = naive.quantize_fp8(rng.standard_normal((30, 2, 32)) * 0.3, 0.1)
    v8 = naive.quantize_fp8(rng.standard_normal((30, 2, 32)) * 5, 2.0)
    out, lse = jattn.mha_prefill(
        jnp.asarray(q),
        jnp.asarray(k8),
        jnp.asarray(v8),
        jnp.asarray(cu),
        max_seqlen_q=21,
        k_scale=0.1,
        v_scale=2.0,
        return_lse=True,
        backend="xla",
    )
    truth, tl = naive.mha_prefill(q, k8, v8, cu, k_scale=0.1, v_scale=2.0)
    _check(out, lse, truth, tl, dtype="f32")


# ----------------------------------------------------------------------------- MLA absorbed decode

# (id, dtype, lens, page_size, heads, R, r, q_len, kv fp8 scale)
MLA_CASES = [  # name, dtype, lengths, page size, heads, R, r, q_len, kv_scale, causal
    ("small-f32", "f32", [0, 1, 97, 64, 65], 16, 4, 64, 16, 1, None, True),
    ("small-verify", "f32", [2, 97, 33], 64, 8, 48, 16, 2, None, True),
    ("small-draft", "f32", [3, 97, 33], 16, 4, 64, 16, 3, None, False),  # a non-causal draft block
    ("small-fp8", "fp8", [97, 1, 0], 16, 4, 64, 16, 1, 0.5, True),
    ("small-bf16-verify", "bf16", [3, 50], 32, 4, 64, 32, 3, None, True),
    ("real-576-bf16", "bf16", [97, 130, 0], 64, 8, 512, 64, 1, None, True),
]


@pytest.mark.parametrize("case", MLA_CASES, ids=[c[0] for c in MLA_CASES])
def test_mla_decode(case):
    _, dtype, lens, ps, h, big_r, r, q_len, kv_scale, causal = case
    rng = np.random.default_rng(zlib.crc32(case[0].encode()))
    pool = naive.Pool(rng, lens, ps)
    bs = len(lens)
    width = big_r + r
    scale = 1 / math.sqrt(128 + 64)  # 1/sqrt(P + r), never 1/sqrt(576)
    q = rng.standard_normal((bs * q_len, h, width)).astype(np.float32)
    for b, length in enumerate(lens):
        if length == 0:
            q[b * q_len : (b + 1) * q_len] = np.nan
    kw = dict(kv_lora_rank=big_r, softmax_scale=scale, max_seqlen_q=q_len, is_causal=causal)
    pt, sl = jnp.asarray(pool.page_table), jnp.asarray(pool.lens)
    if kv_scale is not None:
        kv = naive.quantize_fp8(pool.fill(rng, (width,), scale=3 * kv_scale), kv_scale)
        out, lse = jattn.mla_decode_with_kvcache(
            jnp.asarray(q), jnp.asarray(kv), pt, sl, kv_scale=kv_scale, return_lse=True, backend="xla", **kw
        )
        truth, tl = naive.mla_decode(q, kv, pool.page_table, pool.lens, kv_scale=kv_scale, **kw)
        _check(out, lse, truth, tl, dtype="f32")
        return
    kv = pool.fill(rng, (width,))
    jd = _jdt(dtype)
    out, lse = jattn.mla_decode_with_kvcache(
        jnp.asarray(q, jd), jnp.asarray(kv, jd), pt, sl, return_lse=True, backend="xla", **kw
    )
    assert out.shape == (bs * q_len, h, big_r) and out.dtype == jd
    truth, tl = naive.mla_decode(q, kv, pool.page_table, pool.lens, **kw)
    base = None
    if _lowp(dtype):
        base, _ = naive.mla_decode(_round(q, dtype), _round(kv, dtype), pool.page_table, pool.lens, **kw)
    _check(out, lse, truth, tl, dtype=dtype, baseline=base)


# ----------------------------------------------------------------------------- merge state


def test_attn_merge_state_matches_naive():
    rng = np.random.default_rng(3)
    t, h, d = 11, 3, 16
    o_a, o_b = rng.standard_normal((2, t, h, d)).astype(np.float32)
    lse_a = (rng.standard_normal((t, h)) * 4).astype(np.float32)
    lse_b = (rng.standard_normal((t, h)) * 4).astype(np.float32)
    lse_a[0, :] = -np.inf  # a empty
    lse_b[1, :] = -np.inf  # b empty
    lse_a[2, :] = lse_b[2, :] = -np.inf  # both empty
    o_a[0] = o_b[1] = o_a[2] = o_b[2] = 0.0
    lse_a[3, 0], lse_b[3, 0] = 80.0, -80.0  # very unequal weights, no overflow
    o, lse = jattn.attn_merge_state(*map(jnp.asarray, (o_a, lse_a, o_b, lse_b)))
    to, tl = naive.merge_state(o_a, lse_a, o_b, lse_b)
    _check(o, lse, to, tl, dtype="f32")
    np.testing.assert_array_equal(np.asarray(o)[0], o_b[0])
    np.testing.assert_array_equal(np.asarray(o)[2], 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[2]))


@pytest.mark.parametrize("split", [0, 1, 37, 97])
def test_split_kv_then_merge_equals_full(split):
    """Keys of each request split in two parts (one may be empty); merging the two partial
    non-causal attentions with their LSEs gives attention over all keys."""
    rng = np.random.default_rng(split)
    q_lens, kv_lens = [3, 5, 1], [97, 60, 40]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), 8, 32)).astype(np.float32)
    ks = [rng.standard_normal((n, 2, 32)).astype(np.float32) for n in kv_lens]
    vs = [rng.standard_normal((n, 2, 16)).astype(np.float32) for n in kv_lens]

    def part(lo, hi):
        kk = [k[min(lo, len(k)) : min(hi, len(k))] for k in ks]
        vv = [v[min(lo, len(v)) : min(hi, len(v))] for v in vs]
        cukv = np.concatenate([[0], np.cumsum([len(x) for x in kk])]).astype(np.int32)
        return jattn.mha_prefill(
            jnp.asarray(q),
            jnp.asarray(np.concatenate(kk)),
            jnp.asarray(np.concatenate(vv)),
            jnp.asarray(cu),
            jnp.asarray(cukv),
            max_seqlen_q=5,
            max_seqlen_kv=97,
            is_causal=False,
            return_lse=True,
            backend="xla",
        )

    o_full, lse_full = part(0, 10**6)
    o_a, lse_a = part(0, split)
    o_b, lse_b = part(split, 10**6)
    o, lse = jattn.attn_merge_state(o_a, lse_a, o_b, lse_b)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_full), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_full), atol=1e-5, rtol=1e-5)
    truth, tl = naive.mha_prefill(
        q, np.concatenate(ks), np.concatenate(vs), cu, np.concatenate([[0], np.cumsum(kv_lens)]), is_causal=False
    )
    _check(o, lse, truth, tl, dtype="f32")


def test_merge_of_two_empty_parts_is_zero_and_neg_inf():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2, 8)), jnp.float32)
    k = jnp.full((2, 1, 8), jnp.nan, jnp.float32)
    cu = jnp.array([0, 4], jnp.int32)
    cukv = jnp.array([0, 0], jnp.int32)
    o_a, lse_a = jattn.mha_prefill(
        q, k, k, cu, cukv, max_seqlen_q=4, max_seqlen_kv=1, is_causal=False, return_lse=True, backend="xla"
    )
    o, lse = jattn.attn_merge_state(o_a, lse_a, o_a, lse_a)
    assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))


# ----------------------------------------------------------------------------- cache writes


@pytest.mark.parametrize("dtype", ["f32", "bf16", "fp8"])
def test_set_kv_buffer(dtype):
    rng = np.random.default_rng(11)
    pages, ps, hkv, d, dv = 6, 8, 2, 16, 8
    jd = jnp.float8_e4m3fn if dtype == "fp8" else _jdt(dtype)
    kc = jnp.asarray(rng.standard_normal((pages, ps, hkv, d)), jd)
    vc = jnp.asarray(rng.standard_normal((pages, ps, hkv, dv)), jd)
    loc = rng.permutation(pages * ps)[:13].astype(np.int32)
    k = rng.standard_normal((13, hkv, d)).astype(np.float32) * 3
    v = rng.standard_normal((13, hkv, dv)).astype(np.float32) * 3
    scales = dict(k_scale=0.25, v_scale=4.0) if dtype == "fp8" else {}
    nk, nv = jattn.set_kv_buffer(kc, vc, jnp.asarray(loc), jnp.asarray(k), jnp.asarray(v), **scales)
    tk, tv = naive.set_kv_buffer(kc, vc, loc, k, v, **scales)
    assert nk.dtype == jd and nv.dtype == jd
    np.testing.assert_array_equal(np.asarray(nk).astype(np.float32), tk.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(nv).astype(np.float32), tv.astype(np.float32))
    # under jit (no eager check of the slots) a slot past the pool and a negative one are
    # dropped, never wrapped into the pool
    bad = loc.copy()
    bad[3], bad[7] = pages * ps, -2
    keep = np.ones(13, bool)
    keep[[3, 7]] = False
    write = jax.jit(functools.partial(jattn.set_kv_buffer, **scales))
    nk, nv = write(kc, vc, jnp.asarray(bad), jnp.asarray(k), jnp.asarray(v))
    tk, tv = naive.set_kv_buffer(kc, vc, loc[keep], k[keep], v[keep], **scales)
    np.testing.assert_array_equal(np.asarray(nk).astype(np.float32), tk.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(nv).astype(np.float32), tv.astype(np.float32))


def test_fp8_write_then_read_round_trip_clamps():
    rng = np.random.default_rng(12)
    k_scale, v_scale = 0.5, 2.0
    kc = jnp.zeros((4, 4, 1, 8), jnp.float8_e4m3fn)
    vc = jnp.zeros((4, 4, 1, 8), jnp.float8_e4m3fn)
    k = rng.standard_normal((6, 1, 8)).astype(np.float32) * 50
    v = rng.standard_normal((6, 1, 8)).astype(np.float32) * 50
    k[0, 0, :4] = [1e4, -1e4, 448 * k_scale, -448 * k_scale * 1.01]
    v[0, 0, :2] = [1e6, -3e3]
    loc = np.arange(4, 10, dtype=np.int32)
    nk, nv = jattn.set_kv_buffer(
        kc, vc, jnp.asarray(loc), jnp.asarray(k), jnp.asarray(v), k_scale=k_scale, v_scale=v_scale
    )
    rk = np.asarray(nk).astype(np.float32).reshape(16, 1, 8)[loc] * k_scale
    rv = np.asarray(nv).astype(np.float32).reshape(16, 1, 8)[loc] * v_scale
    assert np.isfinite(rk).all() and np.isfinite(rv).all(), "FP8 casts must be clamped, never NaN"
    np.testing.assert_array_equal(rk[0, 0, :4], [448 * k_scale, -448 * k_scale, 448 * k_scale, -448 * k_scale])
    np.testing.assert_array_equal(rv[0, 0, :2], [448 * v_scale, -448 * v_scale])
    inside_k = np.abs(k) <= 448 * k_scale
    inside_v = np.abs(v) <= 448 * v_scale
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 (plus subnormal absolute error).
    assert np.all(np.abs(rk - k)[inside_k] <= np.abs(k)[inside_k] / 16 + 2**-9 * k_scale)
    assert np.all(np.abs(rv - v)[inside_v] <= np.abs(v)[inside_v] / 16 + 2**-9 * v_scale)
    # Slots not written are untouched.
    untouched = np.setdiff1d(np.arange(16), loc)
    assert np.all(np.asarray(nk).astype(np.float32).reshape(16, 8)[untouched] == 0)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_set_mla_kv_buffer(dtype):
    rng = np.random.default_rng(13)
    big_r, r = 64, 16
    jd = jnp.float8_e4m3fn if dtype == "fp8" else jnp.bfloat16
    kv = jnp.asarray(rng.standard_normal((5, 16, big_r + r)), jd)
    loc = rng.permutation(80)[:9].astype(np.int32)
    c_kv = rng.standard_normal((9, big_r)).astype(np.float32) * 100
    k_pe = rng.standard_normal((9, 1, r)).astype(np.float32) * 100
    scale = 0.125 if dtype == "fp8" else None
    new = jattn.set_mla_kv_buffer(kv, jnp.asarray(loc), jnp.asarray(c_kv), jnp.asarray(k_pe), kv_scale=scale)
    truth = naive.set_mla_kv_buffer(kv, loc, c_kv, k_pe, kv_scale=scale)
    assert np.isfinite(np.asarray(new).astype(np.float32)).all()
    np.testing.assert_array_equal(np.asarray(new).astype(np.float32), truth.astype(np.float32))
    bad = loc.copy()  # under jit: a slot past the pool and a negative one are dropped, not wrapped
    bad[2], bad[5] = 80, -1
    keep = np.ones(9, bool)
    keep[[2, 5]] = False
    new = jax.jit(functools.partial(jattn.set_mla_kv_buffer, kv_scale=scale))(
        kv, jnp.asarray(bad), jnp.asarray(c_kv), jnp.asarray(k_pe)
    )
    truth = naive.set_mla_kv_buffer(kv, loc[keep], c_kv[keep], k_pe[keep], kv_scale=scale)
    np.testing.assert_array_equal(np.asarray(new).astype(np.float32), truth.astype(np.float32))


# ----------------------------------------------------------------------------- determinism


def test_determinism_bit_identical():
    rng = np.random.default_rng(21)
    pool = naive.Pool(rng, [97, 33, 1], 16)
    q = jnp.asarray(rng.standard_normal((6, 8, 64)), jnp.bfloat16)
    kc = jnp.asarray(pool.fill(rng, (2, 64)), jnp.bfloat16)
    vc = jnp.asarray(pool.fill(rng, (2, 64)), jnp.bfloat16)
    args = (q, kc, vc, jnp.asarray(pool.page_table), jnp.asarray(pool.lens))
    kw = dict(max_seqlen_q=2, window_left=40, logit_cap=10.0, return_lse=True, backend="xla")
    a = jattn.mha_decode_with_kvcache(*args, **kw)
    b = jattn.mha_decode_with_kvcache(*args, **kw)
    for x, y in zip(a, b):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    cu = jnp.array([0, 40, 97], jnp.int32)
    qp = jnp.asarray(rng.standard_normal((97, 2, 192)), jnp.bfloat16)
    kp = jnp.asarray(rng.standard_normal((97, 2, 192)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((97, 2, 128)), jnp.bfloat16)
    p1 = jattn.mha_prefill(qp, kp, vp, cu, max_seqlen_q=64, return_lse=True, backend="xla")
    p2 = jattn.mha_prefill(qp, kp, vp, cu, max_seqlen_q=64, return_lse=True, backend="xla")
    for x, y in zip(p1, p2):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


# ----------------------------------------------------------------------------- random feature sweep


@pytest.mark.parametrize("seed", range(8))
def test_random_feature_combinations(seed):
    """Decode and extend with every feature drawn at random (seeded), f32 or FP8 KV."""
    rng = np.random.default_rng(1000 + seed)
    ps = int(rng.choice([1, 8, 16, 64]))
    hkv = int(rng.choice([1, 2]))
    hq = hkv * int(rng.choice([1, 4, 8]))
    d = int(rng.choice([16, 32]))
    q_len = int(rng.choice([1, 2, 4]))
    causal = bool(q_len == 1 or rng.random() < 0.6)
    window = int(rng.choice([-1, 0, 5, 40]))
    cap = float(rng.choice([0.0, 3.0]))
    sinks = rng.standard_normal(hq).astype(np.float32) if rng.random() < 0.5 else None
    fp8 = rng.random() < 0.35
    ks, vs = (float(rng.choice([0.25, 1.0, 3.0])), float(rng.choice([0.5, 2.0]))) if fp8 else (1.0, 1.0)
    lens = [int(x) for x in rng.choice([0, 1, 97, ps, ps + 1, 2 * ps - 1, 30], size=int(rng.integers(1, 5)))]
    lens = [x if x == 0 else max(x, q_len) for x in lens]
    pool = naive.Pool(rng, lens, ps)
    kc = pool.fill(rng, (hkv, d), scale=2 * ks)
    vc = pool.fill(rng, (hkv, d), scale=2 * vs)
    if fp8:
        kc, vc = naive.quantize_fp8(kc, ks), naive.quantize_fp8(vc, vs)
    kw = dict(is_causal=causal, window_left=window, logit_cap=cap, k_scale=ks, v_scale=vs)
    js = None if sinks is None else jnp.asarray(sinks)
    pt, sl = jnp.asarray(pool.page_table), jnp.asarray(pool.lens)
    q = rng.standard_normal((len(lens) * q_len, hq, d)).astype(np.float32)
    out, lse = jattn.mha_decode_with_kvcache(
        jnp.asarray(q),
        jnp.asarray(kc),
        jnp.asarray(vc),
        pt,
        sl,
        max_seqlen_q=q_len,
        sinks=js,
        return_lse=True,
        backend="xla",
        **kw,
    )
    truth, tl = naive.mha_decode(q, kc, vc, pool.page_table, pool.lens, max_seqlen_q=q_len, sinks=sinks, **kw)
    _check(out, lse, truth, tl, dtype="f32")
    # Extend over the same pool: each request's last n_b <= length tokens are new.
    new = [int(rng.integers(0, min(x, 9) + 1)) for x in lens]
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    qe = rng.standard_normal((int(cu[-1]) + 3, hq, d)).astype(np.float32)
    qe[int(cu[-1]) :] = np.nan
    out, lse = jattn.mha_extend_with_kvcache(
        jnp.asarray(qe),
        jnp.asarray(kc),
        jnp.asarray(vc),
        pt,
        sl,
        jnp.asarray(cu),
        max_seqlen_q=16,
        sinks=js,
        return_lse=True,
        backend="xla",
        **kw,
    )
    truth, tl = naive.mha_extend(qe, kc, vc, pool.page_table, pool.lens, cu, sinks=sinks, **kw)
    _check(out, lse, truth, tl, dtype="f32")


# ----------------------------------------------------------------------------- poison: masked keys add nothing

NAN, INF = float("nan"), float("inf")


def _sees(length, n, i, j, causal, window):
    """Whether query i of n (the request has `length` keys) sees key j (docs/SEMANTICS.md)."""
    pos = length - n + i
    return 0 <= j < length and (not causal or j <= pos) and (window < 0 or j >= pos - window)


def _poison(x, where, value):
    """x with `value` written at the index `where` (a copy; numpy)."""
    x = np.array(x, copy=True)
    x[where] = value
    return x


def _expect_poison(clean, poisoned_run, poisoned):
    """Rows flagged in `poisoned` (bool [T, Hq]) are NaN, output and LSE; every other row is
    what the clean data gives (the poison is in keys those rows do not see)."""
    (oc, lc), (op, lp) = clean, poisoned_run
    oc, op, lc, lp = (np.asarray(a, np.float32) for a in (oc, op, lc, lp))
    assert np.isnan(op[poisoned]).all() and np.isnan(lp[poisoned]).all(), "a row that sees a non-finite key"
    keep = ~poisoned
    assert np.isfinite(op[keep]).all()
    np.testing.assert_allclose(op[keep], oc[keep], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lp[keep], lc[keep], rtol=1e-6, atol=1e-6)


# (id, lens, q_len, page_size, hkv, group, causal, window, cap, spots); a spot is
# (request, key positions, kv head or None for all, "k" / "v" / "kv", value)
PAGED_POISON_CASES = [
    (
        "decode-window-own-pages",
        [40, 37],
        1,
        4,
        2,
        2,
        True,
        7,
        0.0,
        [(0, range(0, 28), None, "kv", NAN), (0, [31], 0, "v", INF), (0, [30], 1, "k", NAN), (1, [36], 0, "v", NAN)],
    ),
    (
        "verify-causal-window",
        [30, 9],
        3,
        8,
        2,
        2,
        True,
        5,
        0.0,
        [
            (0, [29], 0, "v", NAN),
            (0, [28], 1, "k", INF),
            (0, [22], 1, "v", -INF),
            (0, [21], 0, "k", NAN),
            (0, [10], 0, "v", NAN),
            (1, [8], 0, "k", NAN),
        ],
    ),
    (
        "draft-block-noncausal-window",
        [20],
        3,
        8,
        2,
        1,
        False,
        4,
        0.0,
        [(0, [13], 0, "v", INF), (0, [14], 0, "k", NAN), (0, [12], 1, "v", NAN), (0, [19], 1, "v", NAN)],
    ),
    ("verify-cap-k-inf", [25], 2, 8, 2, 2, True, -1, 5.0, [(0, [24], 0, "k", INF), (0, [23], 1, "k", -INF)]),
]


def _paged_poison_setup(case, rng):
    _, lens, q_len, ps, hkv, group, causal, window, cap, spots = case
    pool = naive.Pool(rng, lens, ps)
    d = 16
    kc, vc = pool.fill(rng, (hkv, d)), pool.fill(rng, (hkv, d))
    kp, vp = kc.copy(), vc.copy()
    hit = {}  # (request, key position, kv head) -> poisoned
    for b, js, h, which, value in spots:
        for j in js:
            page, off = pool.page_table[b, j // ps], j % ps
            heads = range(hkv) if h is None else [h]
            for hh in heads:
                if "k" in which:
                    kp[page, off, hh, 0] = value
                if "v" in which:
                    vp[page, off, hh, d - 1] = value
                hit[(b, j, hh)] = True
    return pool, (kc, vc), (kp, vp), hit


@pytest.mark.parametrize("case", PAGED_POISON_CASES, ids=[c[0] for c in PAGED_POISON_CASES])
def test_decode_masked_poison_adds_nothing(case):
    """NaN / Inf in keys a query does not see (causal future draft tokens, outside the
    window, the request's own out-of-window pages, K or V) change nothing; a query that
    sees one comes out NaN in the heads that read it, and only there."""
    _, lens, q_len, ps, hkv, group, causal, window, cap, spots = case
    rng = np.random.default_rng(zlib.crc32(case[0].encode()))
    pool, clean, bad, hit = _paged_poison_setup(case, rng)
    hq = hkv * group
    q = jnp.asarray(rng.standard_normal((len(lens) * q_len, hq, 16)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32)
    kw = dict(max_seqlen_q=q_len, is_causal=causal, window_left=window, logit_cap=cap, sinks=sinks)

    def run(kc, vc):
        return jattn.mha_decode_with_kvcache(
            q,
            jnp.asarray(kc),
            jnp.asarray(vc),
            jnp.asarray(pool.page_table),
            jnp.asarray(pool.lens),
            return_lse=True,
            backend="xla",
            **kw,
        )

    poisoned = np.zeros((len(lens) * q_len, hq), bool)
    for (b, j, h), _ in hit.items():
        for i in range(q_len):
            if _sees(lens[b], q_len, i, j, causal, window):
                poisoned[b * q_len + i, h * group : (h + 1) * group] = True
    _expect_poison(run(*clean), run(*bad), poisoned)
    # the extend op over the same pool: each request's last q_len tokens are new
    cu = jnp.asarray(np.arange(len(lens) + 1) * q_len, jnp.int32)
    ekw = dict(kw, max_seqlen_q=q_len + 1)

    def run_extend(kc, vc):
        return jattn.mha_extend_with_kvcache(
            q,
            jnp.asarray(kc),
            jnp.asarray(vc),
            jnp.asarray(pool.page_table),
            jnp.asarray(pool.lens),
            cu,
            return_lse=True,
            backend="xla",
            **ekw,
        )

    _expect_poison(run_extend(*clean), run_extend(*bad), poisoned)


def test_extend_prefill_future_tokens_do_not_poison_earlier_ones():
    """NaN in token 4's V leaves tokens 0-3 of a causal prefill (and extend) untouched."""
    rng = np.random.default_rng(5)
    hq, hkv, d = 4, 2, 16
    q_lens = [8, 5, 6]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1]) + 3
    q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    k[cu[-1] :], v[cu[-1] :] = NAN, INF  # keys past the last request
    spots = [(0, 4, 0, "v", NAN), (1, 3, 1, "k", -INF), (2, 5, 0, "k", NAN), (2, 1, 1, "v", INF)]
    kp, vp = k.copy(), v.copy()
    for b, j, h, which, value in spots:
        (kp if which == "k" else vp)[cu[b] + j, h, 3] = value

    for window in (-1, 2):

        def run(k, v, window=window):
            return jattn.mha_prefill(
                q,
                jnp.asarray(k),
                jnp.asarray(v),
                jnp.asarray(cu),
                max_seqlen_q=8,
                window_left=window,
                return_lse=True,
                backend="xla",
            )

        poisoned = np.zeros((t, hq), bool)
        for b, j, h, _, _ in spots:
            for i in range(q_lens[b]):
                if _sees(q_lens[b], q_lens[b], i, j, True, window):
                    poisoned[cu[b] + i, 2 * h : 2 * h + 2] = True
        assert not poisoned[:4].any() and poisoned[4:8, :2].all() == (window < 0)
        _expect_poison(run(k, v), run(kp, vp), poisoned)


def test_mla_prefill_and_prefix_chunk_poison():
    """MLA shapes (192/128 heads): the causal prefill, and a non-causal prefix chunk whose
    padding keys hold NaN: only rows that see a poisoned key are NaN."""
    rng = np.random.default_rng(6)
    h, dqk, dv = 2, 48, 32
    cu = np.array([0, 6, 9], np.int32)
    q = jnp.asarray(rng.standard_normal((11, h, dqk)), jnp.float32)
    k = rng.standard_normal((11, h, dqk)).astype(np.float32)
    v = rng.standard_normal((11, h, dv)).astype(np.float32)
    kp, vp = _poison(k, (2, 1, 0), NAN), _poison(v, (7, 0, 5), INF)

    def run(k, v, cu_kv=None, causal=True, max_kv=None):
        return jattn.mha_prefill(
            q,
            jnp.asarray(k),
            jnp.asarray(v),
            jnp.asarray(cu),
            None if cu_kv is None else jnp.asarray(cu_kv),
            max_seqlen_q=6,
            max_seqlen_kv=max_kv,
            is_causal=causal,
            return_lse=True,
            backend="xla",
        )

    poisoned = np.zeros((11, h), bool)
    poisoned[2:6, 1] = True  # request 0 rows >= 2 see key 2 (head 1)
    poisoned[7:9, 0] = True  # request 1 rows >= 1 see its key 1 (head 0)
    _expect_poison(run(k, v), run(kp, vp), poisoned)
    # a prefix chunk: request 0 has keys 0..4, request 1 none; keys 5.. are padding (NaN)
    cu_kv = np.array([0, 5, 5], np.int32)
    kc = rng.standard_normal((8, h, dqk)).astype(np.float32)
    vc = rng.standard_normal((8, h, dv)).astype(np.float32)
    kcp, vcp = _poison(kc, slice(5, None), NAN), _poison(vc, (slice(5, None), 1), INF)
    clean = run(kc, vc, cu_kv, False, 8)
    _expect_poison(clean, run(kcp, vcp, cu_kv, False, 8), np.zeros((11, h), bool))
    assert np.all(np.asarray(clean[0])[6:] == 0) and np.isneginf(np.asarray(clean[1])[6:]).all()
    poisoned = np.zeros((11, h), bool)
    poisoned[:6, 0] = True  # non-causal: every row of request 0 sees key 3
    _expect_poison(clean, run(_poison(kcp, (3, 0, 7), -INF), vcp, cu_kv, False, 8), poisoned)


def test_mla_decode_masked_poison():
    """MLA absorbed decode (one latent head; V is the c_kv part of the row, k_pe is K only)."""
    rng = np.random.default_rng(8)
    big_r, r, ps, h, q_len = 16, 8, 8, 4, 2
    lens = [20, 7]
    pool = naive.Pool(rng, lens, ps)
    kv = pool.fill(rng, (big_r + r,))
    spots = [(0, 19, 3, NAN), (0, 19, big_r + 2, INF), (1, 5, 0, NAN), (1, 6, big_r, -INF)]
    kvp = kv.copy()
    for b, j, col, value in spots:
        kvp[pool.page_table[b, j // ps], j % ps, col] = value
    q = jnp.asarray(rng.standard_normal((len(lens) * q_len, h, big_r + r)), jnp.float32)

    def run(cache):
        return jattn.mla_decode_with_kvcache(
            q,
            jnp.asarray(cache),
            jnp.asarray(pool.page_table),
            jnp.asarray(pool.lens),
            kv_lora_rank=big_r,
            softmax_scale=0.2,
            max_seqlen_q=q_len,
            return_lse=True,
            backend="xla",
        )

    poisoned = np.zeros((len(lens) * q_len, h), bool)
    for b, j, _, _ in spots:
        for i in range(q_len):
            poisoned[b * q_len + i] |= _sees(lens[b], q_len, i, j, True, -1)
    assert poisoned[1].all() and not poisoned[0].any()  # draft token 19 is masked for query 0
    _expect_poison(run(kv), run(kvp), poisoned)


# ----------------------------------------------------------------------------- empty calls


def _shapes(result):
    return [(tuple(x.shape), jnp.dtype(x.dtype)) for x in result]


@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_kernel_entry_points_launch_nothing_for_empty_calls(backend):
    """The kernels' own entry points (not only the ops, which route empty calls to the
    reference) return empty outputs for no requests / no query rows, without a launch: a
    grid of 0 blocks or a TMA descriptor of a 0-row array fails on the GPU. On this CPU
    a launch would fail too (no Triton runtime, no Mosaic GPU compiler outside the
    interpreter), so the test holds everywhere."""
    from jattn.pallas_kernels import (
        mosaic_decode,
        mosaic_mla,
        mosaic_prefill,
        triton_decode,
        triton_mla,
        triton_prefill,
    )

    dec, mla, pre = {
        "mosaic": (mosaic_decode, mosaic_mla, mosaic_prefill),
        "triton": (triton_decode, triton_mla, triton_prefill),
    }[backend]
    i32, bf16 = jnp.int32, jnp.bfloat16
    kc = jnp.zeros((4, 16, 2, 128), bf16)
    e_pt, e_len, cu0 = jnp.zeros((0, 2), i32), jnp.zeros((0,), i32), jnp.zeros((1,), i32)
    q0 = jnp.zeros((0, 4, 128), bf16)
    results = [
        dec.mha_decode(q0, kc, kc, e_pt, e_len, return_lse=True),
        mla.mla_decode(
            jnp.zeros((0, 16, 576), bf16),
            jnp.zeros((4, 16, 576), bf16),
            e_pt,
            e_len,
            kv_lora_rank=512,
            softmax_scale=0.1,
            return_lse=True,
        ),
        pre.mha_prefill(q0, q0[:, :2], q0[:, :2], cu0, max_seqlen_q=1, return_lse=True),
        pre.mha_extend(q0, kc, kc, e_pt, e_len, cu0, max_seqlen_q=1, return_lse=True),
    ]
    assert [_shapes(r) for r in results] == [
        [((0, 4, 128), bf16), ((0, 4), jnp.float32)],
        [((0, 16, 512), bf16), ((0, 16), jnp.float32)],
        [((0, 4, 128), bf16), ((0, 4), jnp.float32)],
        [((0, 4, 128), bf16), ((0, 4), jnp.float32)],
    ]


def _one_request_edges():
    """``test_gpu_compile``'s edge grid at one request and one query token: the share CPU
    CI lowers (the grid itself is marked ``gpu``)."""
    from test_gpu_compile import _EDGE_GRID, _id

    return {_id(c): c for c in _EDGE_GRID if c.get("bs", 1) == 1 and c.get("q_len", 1) == 1}


@pytest.mark.skipif(on_gpu(), reason="the GPU compiles the grid (test_gpu_compile)")
@pytest.mark.parametrize("name", list(_one_request_edges()))
def test_edge_sizes_lower_for_cuda(name, monkeypatch):
    """CPU CI's share of ``test_gpu_compile``'s edge grid: one request, page tables of 0 or 1
    columns, 1 query row, 0 key rows; each lowers for CUDA (TMA descriptors, page lookups)."""
    from test_gpu_compile import _compile, _edge_call

    monkeypatch.setenv("JATTN_LOWER_ONLY", "1")
    fn, args = _edge_call(_one_request_edges()[name])
    _compile(fn, *args)


def test_empty_sizes_give_empty_outputs():
    """No requests, max_seqlen_q = 0, no tokens, no pages: outputs of the usual shapes and
    dtypes (rows that exist are empty: 0 and -inf), on every backend that is asked."""
    i32, bf16 = jnp.int32, jnp.bfloat16
    kc = jnp.zeros((4, 16, 2, 8), bf16)
    vc = jnp.zeros((4, 16, 2, 6), bf16)
    e_pt, e_len = jnp.zeros((0, 2), i32), jnp.zeros((0,), i32)
    q0 = jnp.zeros((0, 4, 8), bf16)
    for backend in (None, "xla", "mosaic"):
        for mq in (1, 3, 0):
            r = jattn.mha_decode_with_kvcache(
                q0, kc, vc, e_pt, e_len, max_seqlen_q=mq, return_lse=True, backend=backend
            )
            assert _shapes(r) == [((0, 4, 6), bf16), ((0, 4), jnp.float32)]
    r = jattn.mha_decode_with_kvcache(
        q0, kc, vc, jnp.zeros((2, 2), i32), jnp.ones((2,), i32), max_seqlen_q=0, return_lse=True
    )
    assert _shapes(r) == [((0, 4, 6), bf16), ((0, 4), jnp.float32)]
    o, lse = jattn.mha_decode_with_kvcache(
        jnp.ones((2, 4, 8), bf16), kc, vc, jnp.zeros((2, 0), i32), jnp.zeros((2,), i32), return_lse=True
    )
    assert _shapes((o, lse)) == [((2, 4, 6), bf16), ((2, 4), jnp.float32)]
    assert (np.asarray(o, np.float32) == 0).all() and np.isneginf(np.asarray(lse)).all()
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]=1 must be in \[0, 0\]"):  # a length with no pages
        jattn.mha_decode_with_kvcache(jnp.ones((2, 4, 8), bf16), kc, vc, jnp.zeros((2, 0), i32), jnp.ones((2,), i32))
    # extend: no requests / every request with 0 new tokens / no token rows
    for q, pt, lens, cu, mq in [
        (q0, e_pt, e_len, jnp.zeros((1,), i32), 1),
        (jnp.ones((3, 4, 8), bf16), jnp.ones((2, 2), i32), jnp.array([5, 0], i32), jnp.zeros((3,), i32), 0),
        (q0, jnp.ones((2, 2), i32), jnp.array([5, 7], i32), jnp.zeros((3,), i32), 1),
    ]:
        o, lse = jattn.mha_extend_with_kvcache(q, kc, vc, pt, lens, cu, max_seqlen_q=mq, return_lse=True)
        assert _shapes((o, lse)) == [((q.shape[0], 4, 6), bf16), ((q.shape[0], 4), jnp.float32)]
        assert (np.asarray(o, np.float32) == 0).all() and np.isneginf(np.asarray(lse)).all()
    # ragged prefill (MLA-style head dims): no requests, max_seqlen_q = 0, max_seqlen_kv = 0
    k, v = jnp.ones((3, 2, 8), bf16), jnp.ones((3, 2, 6), bf16)
    for q, cu, cukv, mq, mkv in [
        (q0, jnp.zeros((1,), i32), None, 1, None),
        (jnp.ones((3, 4, 8), bf16), jnp.zeros((3,), i32), None, 0, None),
        (jnp.ones((3, 4, 8), bf16), jnp.array([0, 2, 3], i32), jnp.zeros((3,), i32), 2, 0),
    ]:
        o, lse = jattn.mha_prefill(q, k, v, cu, cukv, max_seqlen_q=mq, max_seqlen_kv=mkv, return_lse=True)
        assert _shapes((o, lse)) == [((q.shape[0], 4, 6), bf16), ((q.shape[0], 4), jnp.float32)]
        assert (np.asarray(o, np.float32) == 0).all() and np.isneginf(np.asarray(lse)).all()
    mla = jnp.zeros((4, 16, 12), bf16)
    for pt, lens, mq in [(e_pt, e_len, 1), (jnp.ones((2, 1), i32), jnp.ones((2,), i32), 0)]:
        r = jattn.mla_decode_with_kvcache(
            jnp.zeros((0, 4, 12), bf16),
            mla,
            pt,
            lens,
            kv_lora_rank=8,
            softmax_scale=0.1,
            max_seqlen_q=mq,
            return_lse=True,
        )
        assert _shapes(r) == [((0, 4, 8), bf16), ((0, 4), jnp.float32)]
    r = jattn.attn_merge_state(jnp.zeros((0, 4, 8)), jnp.zeros((0, 4)), jnp.zeros((0, 4, 8)), jnp.zeros((0, 4)))
    assert _shapes(r) == [((0, 4, 8), jnp.float32), ((0, 4), jnp.float32)]
    loc0 = jnp.zeros((0,), i32)
    new_k, new_v = jattn.set_kv_buffer(kc, vc, loc0, jnp.zeros((0, 2, 8)), jnp.zeros((0, 2, 6)))
    assert (np.asarray(new_k) == np.asarray(kc)).all() and new_v.shape == vc.shape
    for c_kv, k_pe in [(jnp.zeros((0, 8)), jnp.zeros((0, 4))), (jnp.zeros((0, 1, 8)), jnp.zeros((0, 1, 4)))]:
        assert (np.asarray(jattn.set_mla_kv_buffer(mla, loc0, c_kv, k_pe)) == 0).all()


@pytest.mark.parametrize("scale", [0.03, 0.05, 0.7, 1.0, 3e-5])
def test_fp8_quantisation_is_the_ieee_quotient_rounded_once(scale):
    """``quantize_fp8`` (jitted) equals torch's and Triton's f32 arithmetic bit for bit:
    numpy's IEEE quotient ``x / scale``, rounded once to e4m3 by ml_dtypes, ties to even.
    Normal and subnormal values, quotients on a tie, saturation at 448, NaN. XLA's own
    ``x / scalar`` is a product with the reciprocal, one ulp off for most quotients, which
    moved about 0.5% of the e4m3 values at scale 0.03 before the division was kept one."""
    import jax
    import ml_dtypes

    from jattn.reference import quantize_fp8, round_to_e4m3

    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(50000) * s for s in (1e-4, 1e-2, 0.5, 10.0, 300.0)])
    ties = np.float32([0.0029296875, 2**-6, 2**-7, 2**-9, 3 * 2**-10, 5 * 2**-11, 13.0 * 2**-4, 0.09765625])
    edges = np.float32([0.0, -0.0, 448.0, -448.0, 460.0, 1e6, 1e-30, np.nan])
    x = np.concatenate([x.astype(np.float32), ties * np.float32(scale), -ties * np.float32(scale), ties, edges])
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # bf16 inputs, as the caches get them
    y = np.clip(x / np.float32(scale), -448.0, 448.0)  # IEEE f32 quotient
    want = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(jax.jit(lambda a: quantize_fp8(a, scale))(jnp.asarray(x)), np.float32)
    np.testing.assert_array_equal(got, want)  # NaN positions equal too
    np.testing.assert_array_equal(np.asarray(round_to_e4m3(jnp.asarray(y))), want)


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_window_past_every_key_is_no_window(backend):
    """A window at least as wide as the page table's keys holds every key, so it gives
    the no-window bits; int32's limit and past it too (no kernel may wrap pos - window),
    including a non-causal draft block longer than its request (negative positions)."""
    from jattn.pallas_kernels.interpret import gpu_interpret, interpreter_available

    if backend == "mosaic" and not interpreter_available():
        pytest.skip("needs the Mosaic GPU interpreter")
    rng = np.random.default_rng(7)
    pool = rng.standard_normal((6, 16, 2, 64)).astype(np.float16)
    pool[5] = np.nan  # never read
    kc = vc = jnp.asarray(pool)
    pt = jnp.asarray([[2, 0, 4], [1, 3, 5]], jnp.int32)
    lens = jnp.asarray([37, 2], jnp.int32)
    q = jnp.asarray(rng.standard_normal((8, 4, 64)), jnp.float16)
    kw = dict(max_seqlen_q=4, is_causal=False, backend=backend, return_lse=True)
    with gpu_interpret():
        want = jattn.mha_decode_with_kvcache(q, kc, vc, pt, lens, **kw)
        for w in (48, 2**31 - 1, 2**40):
            got = jattn.mha_decode_with_kvcache(q, kc, vc, pt, lens, window_left=w, **kw)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
