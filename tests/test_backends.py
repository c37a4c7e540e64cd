"""MHABackend / MLABackend end to end against tests/naive.py, the synthetic demo, the CLI."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import naive  # tests/naive.py
import numpy as np
import pytest

import jattn
import jattn.demo
from jattn import (
    DUMMY_PAGE,
    ForwardMode,
    LayerSpec,
    MHABackend,
    MHAConfig,
    MLABackend,
    MLAConfig,
    MLAKVCache,
    PageAllocator,
    PagedKVCache,
)

# ----------------------------------------------------------------------------- MHA end to end


class _History:
    """Per-request q/k/v streams and the pages the request holds."""

    def __init__(self, rng, n, hq, hkv, d):
        self.q = rng.standard_normal((n, hq, d)).astype(np.float32)
        self.k = rng.standard_normal((n, hkv, d)).astype(np.float32)
        self.v = rng.standard_normal((n, hkv, d)).astype(np.float32)
        self.len = 0
        self.pages: list[int] = []


@pytest.mark.parametrize("variant", ["f32", "fp8-window-cap-sinks"])
def test_mha_backend_prefill_extend_decode_verify(variant):
    rng = np.random.default_rng(0 if variant == "f32" else 1)
    fp8 = variant.startswith("fp8")
    hq, hkv, d, ps, num_pages = 8, 2, 32, 16, 40
    cfg = MHAConfig(
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=ps,
        context_len=256,
        num_pages=num_pages,
        kv_cache_dtype="fp8" if fp8 else "float32",
        spec_num_tokens=3,
        kernel_backend="xla",
        batch_buckets=(2, 4),
    )
    ks, vs = (0.5, 0.25) if fp8 else (1.0, 1.0)
    layer = LayerSpec(
        1, hq, hkv, d, sliding_window_size=21 if fp8 else -1, logit_cap=8.0 if fp8 else 0.0, k_scale=ks, v_scale=vs
    )
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32) if fp8 else None
    be = MHABackend(cfg)
    cache = PagedKVCache.create(
        num_layers=2, num_pages=num_pages, page_size=ps, num_kv_heads=hkv, head_dim=d, dtype=cfg.kv_cache_dtype
    )
    # NaN everywhere in layer 1 that no token has written: it must never leak.
    cache = cache.replace_layer(1, jnp.full_like(cache.k[1], jnp.nan), jnp.full_like(cache.v[1], jnp.nan))
    alloc = PageAllocator(num_pages)
    reqs = [_History(rng, 120, hq, hkv, d) for _ in range(3)]
    r2p = np.zeros((3, cfg.max_num_pages), np.int32)
    decode_step = jax.jit(lambda c, md, q, k, v: be.forward_decode(q, k, v, layer, c, md, sinks=sinks))
    extend_step = jax.jit(lambda c, md, q, k, v: be.forward_extend(q, k, v, layer, c, md, sinks=sinks))

    def truth(r, lo, hi):
        k, v = r.k[:hi], r.v[:hi]
        if fp8:
            k = naive.f64(naive.quantize_fp8(k, ks)) * ks
            v = naive.f64(naive.quantize_fp8(v, vs)) * vs
        o, _ = naive.attend_one(
            naive.f64(r.q[lo:hi]),
            naive.f64(k),
            naive.f64(v),
            causal=True,
            window_left=layer.sliding_window_size,
            logit_cap=layer.logit_cap,
            sinks=None if sinks is None else np.asarray(sinks),
            scale=1 / math.sqrt(d),
        )
        return o

    def grow(i, r, n):
        need = PageAllocator.pages_for(r.len + n, ps) - len(r.pages)
        r.pages += alloc.alloc(need)
        r2p[i, : len(r.pages)] = r.pages

    def extend(new):
        nonlocal cache
        for i, (r, n) in enumerate(zip(reqs, new)):
            grow(i, r, n)
        lens = [r.len + n for r, n in zip(reqs, new)]
        md = be.init_forward_metadata(
            3, np.arange(3), np.array(lens), r2p, ForwardMode.EXTEND, extend_seq_lens=np.array(new)
        )
        t = md.num_tokens
        q = np.full((t, hq, d), np.nan, np.float32)  # padding tokens: NaN
        k = np.full((t, hkv, d), np.nan, np.float32)
        v = np.full((t, hkv, d), np.nan, np.float32)
        cu = np.asarray(md.cu_seqlens_q)
        for i, (r, n) in enumerate(zip(reqs, new)):
            sl = slice(cu[i], cu[i + 1])
            q[sl], k[sl], v[sl] = r.q[r.len : r.len + n], r.k[r.len : r.len + n], r.v[r.len : r.len + n]
        out, cache = extend_step(cache, md, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
        out = np.asarray(out).reshape(t, hq, d)
        assert (out[cu[3] :] == 0).all(), "padding tokens must give exactly 0"
        for i, (r, n) in enumerate(zip(reqs, new)):
            np.testing.assert_allclose(out[cu[i] : cu[i + 1]], truth(r, r.len, r.len + n), atol=1e-4, rtol=1e-4)
            r.len += n

    def decode(mode, n):
        nonlocal cache
        for i, r in enumerate(reqs):
            grow(i, r, n)
        md = be.init_forward_metadata(3, np.arange(3), np.array([r.len + n for r in reqs]), r2p, mode)
        assert md.max_seqlen_q == n and md.batch_size == 4
        q = np.full((4 * n, hq, d), np.nan, np.float32)  # padded row 3: NaN
        k = np.full((4 * n, hkv, d), np.nan, np.float32)
        v = np.full((4 * n, hkv, d), np.nan, np.float32)
        for i, r in enumerate(reqs):
            q[i * n : (i + 1) * n] = r.q[r.len : r.len + n]
            k[i * n : (i + 1) * n] = r.k[r.len : r.len + n]
            v[i * n : (i + 1) * n] = r.v[r.len : r.len + n]
        out, cache = decode_step(cache, md, jnp.asarray(q).reshape(4 * n, hq * d), jnp.asarray(k), jnp.asarray(v))
        out = np.asarray(out).reshape(4 * n, hq, d)
        assert (out[3 * n :] == 0).all(), "padded rows must give exactly 0"
        for i, r in enumerate(reqs):
            np.testing.assert_allclose(out[i * n : (i + 1) * n], truth(r, r.len, r.len + n), atol=1e-4, rtol=1e-4)
            r.len += n

    extend([37, 16, 1])  # prefill, no prefix
    extend([5, 0, 40])  # extend over a prefix (one request adds nothing)
    decode(ForwardMode.DECODE, 1)
    decode(ForwardMode.DECODE, 1)
    decode(ForwardMode.TARGET_VERIFY, 3)
    assert [r.len for r in reqs] == [47, 21, 46]
    # Layer 0 was never touched; the dummy page took only padding writes (in layer 1).
    assert not np.asarray(cache.k[0]).astype(np.float32).any()
    for r in reqs:
        alloc.free(r.pages)
    assert alloc.num_free == num_pages - 1


# ----------------------------------------------------------------------------- MLA


def _mla_setup(rng, *, big_r=64, r=16, h=4, ps=16, num_pages=32, spec=1, dtype="float32"):
    cfg = MLAConfig(
        num_heads=h,
        kv_lora_rank=big_r,
        qk_nope_head_dim=32,
        qk_rope_head_dim=r,
        v_head_dim=24,
        page_size=ps,
        context_len=256,
        num_pages=num_pages,
        kv_cache_dtype=dtype,
        spec_num_tokens=spec,
        kernel_backend="xla",
        batch_buckets=(4, 8),
    )
    layer = LayerSpec(0, h, 1, big_r + r)
    cache = MLAKVCache.create(
        num_layers=1, num_pages=num_pages, page_size=ps, kv_lora_rank=big_r, rope_dim=r, dtype=dtype
    )
    cache = cache.replace_layer(0, jnp.full_like(cache.kv[0], jnp.nan))
    return cfg, MLABackend(cfg), layer, cache


def _mla_pages(rng, lens, ps, num_pages, width):
    need = [-(-x // ps) for x in lens]
    perm = rng.permutation(np.arange(1, num_pages))
    r2p = np.zeros((len(lens), width), np.int32)
    i = 0
    for b, n in enumerate(need):
        r2p[b, :n] = perm[i : i + n]
        i += n
    return r2p


@pytest.mark.parametrize("mode,n", [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 2)])
def test_mla_backend_forward_decode_absorbed_with_save(mode, n):
    rng = np.random.default_rng(n)
    cfg, be, layer, cache = _mla_setup(rng, spec=2)
    big_r, r, h = 64, 16, 4
    lens = [97, 2, 33]
    r2p = _mla_pages(rng, lens, 16, 32, cfg.max_num_pages)
    # History (all but the new tokens) written with set_mla_kv_buffer.
    md = be.init_forward_metadata(3, np.arange(3), np.array(lens), r2p, mode)
    rows = {b: rng.standard_normal((L, big_r + r)).astype(np.float32) for b, L in enumerate(lens)}
    hist_loc = [r2p[b, t // 16] * 16 + t % 16 for b, L in enumerate(lens) for t in range(L - n)]
    hist = np.concatenate([rows[b][: L - n] for b, L in enumerate(lens)])
    kv = jattn.set_mla_kv_buffer(
        cache.kv[0],
        jnp.asarray(np.array(hist_loc, np.int32)),
        jnp.asarray(hist[:, :big_r]),
        jnp.asarray(hist[:, big_r:]),
    )
    cache = cache.replace_layer(0, kv)
    t = md.num_tokens  # 4 * n (bucket 4)
    q_nope = rng.standard_normal((t, h, big_r)).astype(np.float32)
    q_rope = rng.standard_normal((t, h, r)).astype(np.float32)
    c_kv = np.full((t, big_r), np.nan, np.float32)
    k_rope = np.full((t, r), np.nan, np.float32)
    q_nope[3 * n :] = np.nan
    for b, L in enumerate(lens):
        c_kv[b * n : (b + 1) * n], k_rope[b * n : (b + 1) * n] = rows[b][L - n :, :big_r], rows[b][L - n :, big_r:]
    step = jax.jit(lambda c, md, *a: be.forward_decode(a[0], a[1], None, layer, c, md, q_rope=a[2], k_rope=a[3]))
    out, new_cache = step(cache, md, *map(jnp.asarray, (q_nope, c_kv, q_rope, k_rope)))
    out = np.asarray(out).reshape(t, h, big_r)
    assert (out[3 * n :] == 0).all()
    q = np.concatenate([q_nope, q_rope], -1)
    for b, L in enumerate(lens):
        o, _ = naive.attend_one(
            naive.f64(q[b * n : (b + 1) * n]),
            naive.f64(rows[b])[:, None, :],
            naive.f64(rows[b])[:, None, :big_r],
            causal=True,
            scale=cfg.softmax_scale,
        )
        np.testing.assert_allclose(out[b * n : (b + 1) * n], o, atol=1e-4, rtol=1e-4)
    assert cfg.softmax_scale == pytest.approx(1 / math.sqrt(32 + 16))
    # The cache holds exactly the rows written; only page 0 took the padding row's writes.
    got = np.asarray(new_cache.kv[0])
    for b, L in enumerate(lens):
        np.testing.assert_array_equal(naive.gather_paged(got, r2p[b], L), rows[b])
    untouched = np.ones(32, bool)
    untouched[np.unique(r2p[r2p > 0])] = False
    untouched[DUMMY_PAGE] = False
    assert np.isnan(got[untouched]).all()


def test_mla_backend_forward_decode_real_576():
    rng = np.random.default_rng(5)
    cfg = MLAConfig(
        num_heads=16,
        page_size=64,
        context_len=512,
        num_pages=8,
        kv_cache_dtype="bfloat16",
        kernel_backend="xla",
        batch_buckets=(2,),
    )
    be = MLABackend(cfg)
    layer = LayerSpec(0, 16, 1, 576)
    cache = MLAKVCache.create(num_layers=1, num_pages=8, page_size=64, dtype="bfloat16")
    lens = [130, 64]
    r2p = _mla_pages(rng, lens, 64, 8, cfg.max_num_pages)
    rows = [naive.bf16_round(rng.standard_normal((L, 576))) for L in lens]
    loc = np.array([r2p[b, t // 64] * 64 + t % 64 for b, L in enumerate(lens) for t in range(L)], np.int32)
    allrows = np.concatenate(rows)
    cache = be.save_kv(layer, cache, jnp.asarray(loc), jnp.asarray(allrows[:, :512]), jnp.asarray(allrows[:, 512:]))
    md = be.init_forward_metadata(2, np.arange(2), np.array(lens), r2p, ForwardMode.DECODE)
    q = naive.bf16_round(rng.standard_normal((2, 16, 576)))
    out, _ = be.forward_decode(jnp.asarray(q, jnp.bfloat16), None, None, layer, cache, md, save_kv_cache=False)
    out = np.asarray(out.astype(jnp.float32)).reshape(2, 16, 512)
    assert cfg.softmax_scale == pytest.approx(1 / math.sqrt(192))
    for b in range(2):
        o, _ = naive.attend_one(
            naive.f64(q[b : b + 1]),
            naive.f64(rows[b])[:, None],
            naive.f64(rows[b])[:, None, :512],
            causal=True,
            scale=1 / math.sqrt(192),
        )
        naive.assert_close_lowp(out[b : b + 1], o, naive.bf16_round(o), atol=2e-3)


def test_mla_backend_forward_draft_extend_padding_is_inert():
    rng = np.random.default_rng(7)
    cfg, be, layer, cache = _mla_setup(rng)
    big_r, r, h = 64, 16, 4
    new = [3, 1, 0, 5]
    lens = [40, 17, 9, 5]
    r2p = _mla_pages(rng, lens, 16, 32, cfg.max_num_pages)
    rows = {b: rng.standard_normal((L, big_r + r)).astype(np.float32) for b, L in enumerate(lens)}
    hist_loc = [r2p[b, t // 16] * 16 + t % 16 for b, L in enumerate(lens) for t in range(L - new[b])]
    hist = np.concatenate([rows[b][: L - new[b]] for b, L in enumerate(lens)])
    cache = be.save_kv(
        layer,
        cache,
        jnp.asarray(np.array(hist_loc, np.int32)),
        jnp.asarray(hist[:, :big_r]),
        jnp.asarray(hist[:, big_r:]),
    )
    md = be.init_forward_metadata(
        4, np.arange(4), np.array(lens), r2p, ForwardMode.EXTEND, extend_seq_lens=np.array(new)
    )
    assert md.max_seqlen_q == 8 and md.num_tokens == 16
    cu = np.asarray(md.cu_seqlens_q)
    t, real = md.num_tokens, int(cu[4])

    def inputs(fill):
        q = np.full((t, h, big_r + r), fill, np.float32)
        c_kv = np.full((t, big_r), fill, np.float32)
        k_rope = np.full((t, r), fill, np.float32)
        qs = rng.standard_normal((real, h, big_r + r)).astype(np.float32)
        q[:real] = qs
        for b in range(4):
            c_kv[cu[b] : cu[b + 1]] = rows[b][lens[b] - new[b] :, :big_r]
            k_rope[cu[b] : cu[b + 1]] = rows[b][lens[b] - new[b] :, big_r:]
        return q, c_kv, k_rope

    step = jax.jit(lambda c, md, q, c_kv, k_rope: be.forward_draft_extend(q, c_kv, None, layer, c, md, k_rope=k_rope))
    rng_state = rng.bit_generator.state
    q1, c1, r1 = inputs(np.nan)
    out1, cache1 = step(cache, md, *map(jnp.asarray, (q1, c1, r1)))
    rng.bit_generator.state = rng_state
    q2, c2, r2 = inputs(1e4)  # different garbage in the padding tokens
    out2, cache2 = step(cache, md, *map(jnp.asarray, (q2, c2, r2)))
    out1 = np.asarray(out1).reshape(t, h, big_r)
    np.testing.assert_array_equal(out1, np.asarray(out2).reshape(t, h, big_r))
    assert (out1[real:] == 0).all()
    for b in range(4):
        o, _ = naive.attend_one(
            naive.f64(q1[cu[b] : cu[b + 1]]),
            naive.f64(rows[b])[:, None],
            naive.f64(rows[b])[:, None, :big_r],
            causal=True,
            scale=cfg.softmax_scale,
        )
        np.testing.assert_allclose(out1[cu[b] : cu[b + 1]], o, atol=1e-4, rtol=1e-4)
    g1, g2 = np.asarray(cache1.kv[0]), np.asarray(cache2.kv[0])
    np.testing.assert_array_equal(g1[1:], g2[1:])  # padding writes only touch the dummy page
    for b, L in enumerate(lens):
        np.testing.assert_array_equal(naive.gather_paged(g1, r2p[b], L), rows[b])


def test_mla_backend_chunked_prefix_equals_full_attention():
    """Causal attention over the new tokens + non-causal attention to each prefix chunk,
    merged, equals causal attention over prefix + new. Chunk 2 has 0 keys for two requests
    and chunk 1 has 0 keys for one."""
    rng = np.random.default_rng(11)
    cfg, be, layer, _ = _mla_setup(rng)
    h, p, r, dv = 4, 32, 16, 24
    prefix, new = [50, 0, 20], [7, 5, 3]
    chunk = 32
    md = jattn.plan_extend(
        np.add(prefix, new),
        np.array(new),
        page_size=16,
        page_table=np.arange(1, 25, dtype=np.int32).reshape(3, 8),  # the plan's slots only (the K/V are given)
        batch_buckets=(4,),
    )
    t = md.num_tokens
    cu = np.asarray(md.cu_seqlens_q)
    layer = LayerSpec(0, h, 1, p + r)
    toks = [np.add(prefix, new)[b] for b in range(3)]
    q_nope = [rng.standard_normal((new[b], h, p)).astype(np.float32) for b in range(3)]
    q_pe = [rng.standard_normal((new[b], h, r)).astype(np.float32) for b in range(3)]
    k_nope = [rng.standard_normal((toks[b], h, p)).astype(np.float32) for b in range(3)]
    k_pe = [rng.standard_normal((toks[b], r)).astype(np.float32) for b in range(3)]
    vv = [rng.standard_normal((toks[b], h, dv)).astype(np.float32) for b in range(3)]

    def ragged(parts, rows, tail):
        out = np.full((rows,) + tail, np.nan, np.float32)
        cat = np.concatenate(parts) if parts else np.zeros((0,) + tail)
        out[: len(cat)] = cat
        return jnp.asarray(out)

    qn = ragged(q_nope, t, (h, p))
    qr = ragged(q_pe, t, (h, r))
    kn = ragged([k_nope[b][prefix[b] :] for b in range(3)], t, (h, p))
    kr = ragged([k_pe[b][prefix[b] :] for b in range(3)], t, (r,))
    vn = ragged([vv[b][prefix[b] :] for b in range(3)], t, (h, dv))
    o, lse = be.forward_extend(qn, kn, vn, layer, md, q_rope=qr, k_rope=kr, return_lse=True)
    assert np.isfinite(np.asarray(o)).all()
    for c in range(2):
        lo, hi = c * chunk, (c + 1) * chunk
        sl = [slice(min(lo, prefix[b]), min(hi, prefix[b])) for b in range(3)]
        nkv = [s.stop - s.start for s in sl]
        if c == 1:
            assert nkv[1] == 0 and nkv[2] == 0
        cukv = np.zeros(5, np.int32)
        cukv[1:4] = np.cumsum(nkv)
        cukv[4] = cukv[3]
        rows_kv = int(cukv[-1]) + 3
        oc, lc = be.forward_prefix_chunk(
            qn,
            ragged([k_nope[b][sl[b]] for b in range(3)], rows_kv, (h, p)),
            ragged([vv[b][sl[b]] for b in range(3)], rows_kv, (h, dv)),
            layer,
            md.cu_seqlens_q,
            jnp.asarray(cukv),
            max_seqlen_q=md.max_seqlen_q,
            max_seqlen_kv=chunk,
            q_rope=qr,
            k_rope=ragged([k_pe[b][sl[b]] for b in range(3)], rows_kv, (r,)),
        )
        lc_np = np.asarray(lc)
        for b in range(3):
            if nkv[b] == 0:
                assert (np.asarray(oc)[cu[b] : cu[b + 1]] == 0).all()
                assert np.isneginf(lc_np[cu[b] : cu[b + 1]]).all()
        o, lse = be.merge_state(o, lse, oc, lc)
    o, lse = np.asarray(o), np.asarray(lse)
    assert (o[cu[3] :] == 0).all() and np.isneginf(lse[cu[3] :]).all()
    for b in range(3):
        q = np.concatenate([q_nope[b], q_pe[b]], -1)
        k = np.concatenate([k_nope[b], np.broadcast_to(k_pe[b][:, None], (toks[b], h, r))], -1)
        to, tl = naive.attend_one(naive.f64(q), naive.f64(k), naive.f64(vv[b]), causal=True, scale=1 / math.sqrt(p + r))
        np.testing.assert_allclose(o[cu[b] : cu[b + 1]], to, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(lse[cu[b] : cu[b + 1]], tl, atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------- modes, padding rows, DFLASH fill


def test_forward_mode_parse_and_one_decode_rule():
    import enum

    class Other(enum.Enum):  # another engine's enum, matched by name
        DECODE = 1
        TARGET_VERIFY = 2
        MIXED = 3
        DRAFT_EXTEND_V2 = 4
        DRAFT_EXTEND = 5  # SGLang's v1: a ragged extend (it was read as the v2 mode)

    assert ForwardMode.parse("target_verify") is ForwardMode.TARGET_VERIFY
    assert ForwardMode.parse(Other.MIXED) is ForwardMode.EXTEND
    assert ForwardMode.parse(Other.DRAFT_EXTEND_V2) is ForwardMode.DRAFT_EXTEND
    assert ForwardMode.parse(Other.DRAFT_EXTEND) is ForwardMode.EXTEND
    assert ForwardMode.parse("draft_extend") is ForwardMode.DRAFT_EXTEND  # jattn's own value

    class Mirror(enum.Enum):  # a copy of jattn's enum (values and all): read by value
        DRAFT_EXTEND = "draft_extend"
        EXTEND = "extend"

    assert ForwardMode.parse(Mirror.DRAFT_EXTEND) is ForwardMode.DRAFT_EXTEND
    assert ForwardMode.parse(Mirror.EXTEND) is ForwardMode.EXTEND
    with pytest.raises(ValueError, match=r"unknown forward_mode 'idle'"):
        ForwardMode.parse("idle")
    be = MHABackend(MHAConfig(num_q_heads=2, num_kv_heads=1, head_dim=8, spec_num_tokens=3))
    decode_modes = {m for m in ForwardMode if be.support_kv_cache_prewrite(m)}
    assert decode_modes == {ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_BLOCK}
    assert not be.support_kv_cache_prewrite(None)
    assert [be.q_len(m) for m in decode_modes] and be.q_len(ForwardMode.DECODE) == 1
    assert be.q_len(ForwardMode.DRAFT_BLOCK) == 3
    assert be.get_cuda_graph_seq_len_fill_value() == 0
    assert be.get_verify_buffers_to_fill_after_draft() == [None, None]
    # plans record their mode; the mode and causality must agree
    md = jattn.plan_decode([4], page_size=4, page_table=[[1]], q_len=2, is_causal=False)
    assert md.forward_mode is ForwardMode.DRAFT_BLOCK
    with pytest.raises(ValueError, match=r"disagree"):
        jattn.plan_decode([4], page_size=4, page_table=[[1]], q_len=2, forward_mode=ForwardMode.DRAFT_BLOCK)
    with pytest.raises(ValueError, match=r"use plan_extend"):
        jattn.plan_decode([4], page_size=4, page_table=[[1]], forward_mode="extend")


def _decode_setup(rng, *, ps=4, num_pages=40, hq=4, hkv=2, d=16, q_len=2, spec=None):
    cfg = MHAConfig(
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=ps,
        context_len=40,
        num_pages=num_pages,
        kv_cache_dtype="float32",
        kernel_backend="xla",
        spec_num_tokens=spec or q_len,
        batch_buckets=(4,),
    )
    cache = PagedKVCache(
        k=(jnp.asarray(rng.standard_normal((num_pages, ps, hkv, d)), jnp.float32),),
        v=(jnp.asarray(rng.standard_normal((num_pages, ps, hkv, d)), jnp.float32),),
    )
    r2p = np.zeros((3, cfg.max_num_pages), np.int32)
    r2p[:, :10] = rng.permutation(np.arange(1, num_pages))[:30].reshape(3, 10)  # permuted pages
    return cfg, MHABackend(cfg), LayerSpec(0, hq, hkv, d), cache, r2p


def test_zero_length_rows_are_padding():
    """A row given with length 0 (the CUDA-graph fill value) is padding: exactly 0 out, its
    new K/V written to the dummy page only, other rows unchanged."""
    rng = np.random.default_rng(7)
    cfg, be, layer, cache, r2p = _decode_setup(rng, q_len=2)
    lens = np.array([9, be.get_cuda_graph_seq_len_fill_value(), 17])
    md = be.init_forward_metadata(3, [0, 1, 2], lens, r2p, ForwardMode.TARGET_VERIFY)
    assert (md.out_cache_loc.reshape(4, 2)[[1, 3]] // cfg.page_size == DUMMY_PAGE).all()
    q = jnp.asarray(rng.standard_normal((8, 4, 16)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((8, 2, 16)), jnp.float32)
    out, new = jax.jit(lambda c, m: be.forward_decode(q, kv, kv, layer, c, m))(cache, md)
    out = np.asarray(out).reshape(4, 2, -1)
    assert (out[1] == 0).all() and (out[3] == 0).all()
    changed = np.argwhere(np.asarray(new.k[0] != cache.k[0]).any(axis=(1, 2, 3)))[:, 0]
    real_pages = {int(r2p[b, p // cfg.page_size]) for b, n in ((0, 9), (2, 17)) for p in (n - 2, n - 1)}
    assert set(changed.tolist()) <= real_pages | {DUMMY_PAGE}
    ref, _ = naive.mha_decode(
        np.asarray(q).reshape(4, 2, 4, 16)[[0, 2]].reshape(4, 4, 16),
        new.k[0],
        new.v[0],
        md.page_table[[0, 2]],
        md.cache_seqlens[[0, 2]],
        max_seqlen_q=2,
    )
    np.testing.assert_allclose(out[[0, 2]].reshape(4, 4, 16), ref, atol=1e-5, rtol=1e-5)


def test_fill_block_decode_seq_lens_matches_replanning():
    """DFLASH: refilling a draft-block plan's lengths inside jit equals planning the new
    lengths on the host (slots, positions, output), clamped to [spec, context_len]."""
    rng = np.random.default_rng(8)
    cfg, be, layer, cache, r2p = _decode_setup(rng, q_len=3)
    md0 = be.init_forward_metadata(3, [0, 1, 2], [5, 12, 3], r2p, ForwardMode.DRAFT_BLOCK)
    new_lens = np.array([11, 1, 60])  # 1 -> spec_num_tokens (3), 60 -> context_len (40)
    q = jnp.asarray(rng.standard_normal((12, 4, 16)), jnp.float32)

    @jax.jit
    def step(c, md, lens):
        md = be.fill_block_decode_seq_lens(md, 3, lens)
        return md, be.forward_decode(q, None, None, layer, c, md, save_kv_cache=False)[0]

    filled, out = step(cache, md0, new_lens)
    want = be.init_forward_metadata(3, [0, 1, 2], [11, 3, 40], r2p, ForwardMode.DRAFT_BLOCK)
    for f in ("cache_seqlens", "out_cache_loc", "positions", "page_table"):
        np.testing.assert_array_equal(np.asarray(getattr(filled, f)), getattr(want, f), err_msg=f)
    ref, _ = be.forward_decode(q, None, None, layer, cache, want, save_kv_cache=False)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    # a length of 0 keeps its row a padding row (it was clamped up to spec_num_tokens: a
    # real row of 3 keys with an output), as planning it on the host does
    filled, out = step(cache, md0, np.array([11, 0, 60]))
    want = be.init_forward_metadata(3, [0, 1, 2], [11, 0, 40], r2p, ForwardMode.DRAFT_BLOCK)
    for f in ("cache_seqlens", "out_cache_loc", "positions"):
        np.testing.assert_array_equal(np.asarray(getattr(filled, f)), getattr(want, f), err_msg=f)
    assert int(filled.cache_seqlens[1]) == 0 and not np.asarray(out)[3:6].any()
    with pytest.raises(ValueError, match=r"needs a DRAFT_BLOCK plan"):
        be.fill_block_decode_seq_lens(be.init_forward_metadata(1, [0], [5], r2p), 1, [6])


def test_extend_reads_new_kv_written_by_the_caller():
    """kv_in_cache: an extend over a prefix whose new K/V the caller wrote equals one that
    writes them itself; without either it refuses."""
    rng = np.random.default_rng(9)
    cfg, be, layer, cache, r2p = _decode_setup(rng)
    md = be.init_forward_metadata(2, [0, 1], [13, 6], r2p, ForwardMode.EXTEND, extend_seq_lens=[5, 2])
    t = md.num_tokens
    q = jnp.asarray(rng.standard_normal((t, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((t, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((t, 2, 16)), jnp.float32)
    out_a, cache_a = be.forward_extend(q, k, v, layer, cache, md)
    kc, vc = jattn.set_kv_buffer(*cache.layer(0), md.out_cache_loc, k, v)
    written = cache.replace_layer(0, kc, vc)
    out_b, _ = be.forward_extend(q, k, v, layer, written, md, save_kv_cache=False, kv_in_cache=True)
    np.testing.assert_array_equal(np.asarray(out_a), np.asarray(out_b))
    assert np.abs(np.asarray(out_a)[:7]).sum() > 0
    with pytest.raises(ValueError, match=r"kv_in_cache=True"):
        be.forward_extend(q, k, v, layer, written, md, save_kv_cache=False)


def test_layer_scales_on_a_non_fp8_cache_are_ignored_and_non_causal_layers_extend():
    """A layer's ``k_scale``/``v_scale`` apply to FP8 caches only (on an f32 cache the
    outputs equal those of a layer without scales); a ``non_causal`` layer's extend, over a
    prefix and as a ragged prefill, attends to every key of its request."""
    rng = np.random.default_rng(12)
    cfg, be, layer, cache, r2p = _decode_setup(rng)
    scaled = LayerSpec(0, 4, 2, 16, k_scale=0.5, v_scale=2.0)
    for lens, new in (([13, 6], [5, 2]), ([5, 2], [5, 2])):  # over a prefix; no prefix (ragged)
        md = be.init_forward_metadata(2, [0, 1], lens, r2p, ForwardMode.EXTEND, extend_seq_lens=new)
        t = md.num_tokens
        q = jnp.asarray(rng.standard_normal((t, 4, 16)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((t, 2, 16)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((t, 2, 16)), jnp.float32)
        out, written = be.forward_extend(q, k, v, layer, cache, md)
        np.testing.assert_array_equal(np.asarray(be.forward_extend(q, k, v, scaled, cache, md)[0]), np.asarray(out))
        full, _ = be.forward_extend(q, k, v, dataclasses.replace(layer, non_causal=True), cache, md)
        full = np.asarray(full).reshape(t, 4, 16)
        cu = np.asarray(md.cu_seqlens_q)
        for b in range(2):
            kb = naive.gather_paged(written.k[0], r2p[b], lens[b])
            vb = naive.gather_paged(written.v[0], r2p[b], lens[b])
            qb = naive.f64(np.asarray(q)[cu[b] : cu[b + 1]])
            want, _ = naive.attend_one(qb, kb, vb, causal=False, scale=1 / 4)
            np.testing.assert_allclose(full[cu[b] : cu[b + 1]], want, atol=1e-4, rtol=1e-4)
    md = be.init_forward_metadata(3, [0, 1, 2], [9, 4, 1], r2p, ForwardMode.DECODE)
    q = jnp.asarray(rng.standard_normal((4, 4, 16)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((4, 2, 16)), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(be.forward_decode(q, kv, kv, scaled, cache, md)[0]),
        np.asarray(be.forward_decode(q, kv, kv, layer, cache, md)[0]),
    )


# ----------------------------------------------------------------------------- registry, demo, CLI


def test_registry():
    assert jattn.get_backend("mha") is MHABackend
    assert jattn.get_backend("mla", arch="MLA") is MLABackend
    assert jattn.registered_backends()["mha"] == frozenset({"MHA"})


def test_synthetic_demo_passes():
    ok, worst, compiles = jattn.demo.run(
        num_requests=5, num_q_heads=4, num_kv_heads=2, head_dim=32, num_pages=48, max_new=6, verbose=False
    )
    assert ok, worst
    assert compiles <= 8, compiles


def test_cli_help_lists_subcommands():
    res = subprocess.run([sys.executable, "-m", "jattn", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for cmd in ("demo", "generate", "bench"):
        assert cmd in res.stdout


# ----------------------------------------------------------------------------- page-id bound


def test_backends_refuse_plans_not_checked_against_their_cache():
    """An out-of-range page id never reaches a kernel: a plan checked against no bound, or
    against more pages than the cache has, is refused at trace time; with config.num_pages
    None the planning path takes the cache's page count, and a jitted step sees one
    static bound (no retrace)."""
    rng = np.random.default_rng(3)
    num_pages, ps = 12, 4
    layer = LayerSpec(0, 4, 2, 8)
    cache = PagedKVCache(
        k=(jnp.asarray(rng.standard_normal((num_pages, ps, 2, 8)), jnp.float32),),
        v=(jnp.asarray(rng.standard_normal((num_pages, ps, 2, 8)), jnp.float32),),
    )
    be = MHABackend(MHAConfig(4, 2, 8, page_size=ps, context_len=32, kernel_backend="xla", batch_buckets=(2,)))
    assert be.page_bound() is None and be.page_bound(num_pages) == num_pages
    r2p = np.array([[3, 4, 0, 0, 0, 0, 0, 0], [5, 10**6, 0, 0, 0, 0, 0, 0]])
    q = jnp.ones((2, 32), jnp.float32)
    unchecked = be.init_forward_metadata(2, np.arange(2), np.array([7, 6]), r2p)
    assert unchecked.num_pages is None
    with pytest.raises(ValueError, match=r"metadata\.num_pages is None: the plan's page_table ids .* num_pages=12"):
        be.forward_decode(q, None, None, layer, cache, unchecked)
    with pytest.raises(ValueError, match=r"req_to_page\[1, 1\]=1000000 out of range \[0, 12\)"):
        be.init_forward_metadata(2, np.arange(2), np.array([7, 6]), r2p, num_pages=num_pages)
    too_big = jattn.plan_decode([7, 6], page_size=ps, page_table=[[3, 4], [5, 20]], num_pages=21, max_pages=8)
    with pytest.raises(
        ValueError, match=r"metadata\.num_pages=21 exceeds the KV cache's 12 pages: the plan's page_table"
    ):
        be.forward_decode(q, None, None, layer, cache, too_big)
    ext = jattn.plan_extend([7, 6], [7, 6], page_size=ps, page_table=[[3, 4], [5, 20]], num_pages=21)
    kv = jnp.ones((ext.num_tokens, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"metadata\.num_pages=21 exceeds"):
        be.forward_extend(jnp.ones((ext.num_tokens, 32), jnp.float32), kv, kv, layer, cache, ext)
    # the cache's page count through the planning path: capture, then replays, one trace
    traces = []

    @jax.jit
    def step(cache, md, q):
        traces.append(1)
        return be.forward_decode(q, None, None, layer, cache, md)

    cap = be.init_forward_metadata_capture_cuda_graph(2, num_pages=num_pages)
    step(cache, cap, q)
    r2p[1, 1] = 11
    for lens in ([7, 6], [2, 8]):
        md = be.init_forward_metadata_replay_cuda_graph(2, np.arange(2), np.array(lens), r2p, num_pages=num_pages)
        out, _ = step(cache, md, q)
        assert np.isfinite(np.asarray(out)).all()
    assert len(traces) == 1
    # config.num_pages wins over the argument (plans of one backend share one bound)
    be2 = MHABackend(MHAConfig(4, 2, 8, page_size=ps, context_len=32, num_pages=10, kernel_backend="xla"))
    assert be2.init_forward_metadata(2, np.arange(2), np.array([7, 3]), r2p, num_pages=12).num_pages == 10


def test_mla_backend_refuses_unchecked_plans():
    rng = np.random.default_rng(4)
    cfg, be, layer, cache = _mla_setup(rng, num_pages=8)
    r2p = _mla_pages(rng, [20, 3], 16, 8, cfg.max_num_pages)
    q = jnp.ones((4, 4, 64 + 16), jnp.float32)
    md = be.init_forward_metadata(2, np.arange(2), np.array([20, 3]), r2p)
    assert md.num_pages == 8
    be.forward_decode(q, None, None, layer, cache, md, save_kv_cache=False)
    unchecked = jattn.plan_decode([20, 3], page_size=16, page_table=r2p, batch_buckets=(4,))
    with pytest.raises(ValueError, match=r"metadata\.num_pages is None: the plan's page_table ids .* num_pages=8"):
        be.forward_decode(q, None, None, layer, cache, unchecked, save_kv_cache=False)
    big = jattn.plan_extend(
        [20, 3], [2, 1], page_size=16, page_table=r2p, num_pages=9, forward_mode=ForwardMode.DRAFT_EXTEND
    )
    with pytest.raises(ValueError, match=r"metadata\.num_pages=9 exceeds the KV cache's 8 pages"):
        be.forward_draft_extend(jnp.ones((big.num_tokens, 4, 80), jnp.float32), None, None, layer, cache, big, False)


def test_mla_backend_llama_4_scaling_scales_the_query():
    """``llama_4_scaling`` equals the same call on a query scaled per token by hand (in
    f32), in decode and in draft extend; a wrong shape is refused by name."""
    from jattn.backends import apply_llama_4_scaling

    rng = np.random.default_rng(11)
    cfg, be, layer, cache = _mla_setup(rng)
    big_r, r, h = 64, 16, 4
    lens = [40, 9]
    r2p = _mla_pages(rng, lens, 16, 32, cfg.max_num_pages)
    rows = rng.standard_normal((sum(lens), big_r + r)).astype(np.float32)
    loc = np.array([r2p[b, t // 16] * 16 + t % 16 for b, L in enumerate(lens) for t in range(L)], np.int32)
    cache = be.save_kv(layer, cache, jnp.asarray(loc), jnp.asarray(rows[:, :big_r]), jnp.asarray(rows[:, big_r:]))
    for mode, kw in ((ForwardMode.DECODE, {}), (ForwardMode.EXTEND, {"extend_seq_lens": np.array([3, 1])})):
        md = be.init_forward_metadata(2, np.arange(2), np.array(lens), r2p, mode, **kw)
        t = md.num_tokens
        q_nope = jnp.asarray(rng.standard_normal((t, h, big_r)), jnp.float32)
        q_rope = jnp.asarray(rng.standard_normal((t, h, r)), jnp.float32)
        s = jnp.asarray(rng.uniform(0.5, 3.0, (t, 1, 1)), jnp.float32)
        got, _ = be.forward_absorbed(
            q_nope, None, None, layer, cache, md, save_kv_cache=False, q_rope=q_rope, llama_4_scaling=s
        )
        want, _ = be.forward_absorbed(q_nope * s, None, None, layer, cache, md, save_kv_cache=False, q_rope=q_rope * s)
        plain, _ = be.forward_absorbed(q_nope, None, None, layer, cache, md, save_kv_cache=False, q_rope=q_rope)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        assert not np.allclose(np.asarray(got), np.asarray(plain), atol=1e-3), "the scaling changed nothing"
    with pytest.raises(ValueError, match="llama_4_scaling shape"):
        apply_llama_4_scaling(jnp.zeros((4, 2, 8)), jnp.ones((3,)))


def test_mla_init_forward_metadata_out_graph():
    """SGLang's out-of-graph planning: the capture plan of a bucket and later plans of the
    same bucket run one compiled step; an extend plans as an extend; a capture at a size
    that is no bucket is refused."""
    rng = np.random.default_rng(9)
    cfg, be, layer, cache = _mla_setup(rng, spec=2)
    traces = []

    @jax.jit
    def step(cache, md, q):
        traces.append(1)
        return be.forward_decode(q, None, None, layer, cache, md, save_kv_cache=False)

    outs = []
    for lens, mode, capture in (
        ([5, 9, 2, 3], ForwardMode.TARGET_VERIFY, True),
        ([97, 2, 33], ForwardMode.TARGET_VERIFY, False),
        ([40, 7], ForwardMode.TARGET_VERIFY, False),
    ):
        r2p = _mla_pages(rng, lens, 16, 32, cfg.max_num_pages)
        for b, n in enumerate(lens):  # this request's rows hold finite values
            for t in range(n):
                p = r2p[b, t // 16]
                cache = cache.replace_layer(0, cache.kv[0].at[p, t % 16].set(rng.standard_normal(80)))
        md = be.init_forward_metadata_out_graph(len(lens), np.arange(len(lens)), np.array(lens), r2p, mode, capture)
        assert md.batch_size == 4 and md.forward_mode is ForwardMode.TARGET_VERIFY
        want = be.init_forward_metadata(len(lens), np.arange(len(lens)), np.array(lens), r2p, mode)
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), md, want))
        q = jnp.asarray(rng.standard_normal((4 * 2, 4, 80)), jnp.float32)
        out, _ = step(cache, md, q)
        outs.append(np.asarray(out)[: 2 * len(lens)])
    assert len(traces) == 1 and all(np.isfinite(o).all() for o in outs)
    ext = be.init_forward_metadata_out_graph(
        2,
        np.arange(2),
        np.array([20, 3]),
        _mla_pages(rng, [20, 3], 16, 32, 8),
        ForwardMode.EXTEND,
        extend_seq_lens=np.array([4, 3]),
    )
    assert ext.forward_mode is ForwardMode.EXTEND and ext.num_tokens >= 7
    with pytest.raises(ValueError, match=r"in_capture: bs=3 is not one of the buckets \(4, 8\)"):
        be.init_forward_metadata_out_graph(3, np.arange(3), np.array([5, 9, 1]), r2p, in_capture=True)


def test_cuda_graph_planning_with_power_of_two_buckets():
    """``batch_buckets=None`` (powers of two, as the planners read it) serves the CUDA-graph
    calls too: the captured sizes, the capture plan and the in_capture check."""
    for be in (
        MHABackend(MHAConfig(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, num_pages=8, batch_buckets=None)),
        MLABackend(
            MLAConfig(
                num_heads=2,
                kv_lora_rank=8,
                qk_rope_head_dim=4,
                qk_nope_head_dim=4,
                v_head_dim=4,
                page_size=4,
                num_pages=8,
                batch_buckets=None,
            )
        ),  # fmt: skip
    ):
        assert be.init_forward_metadata_capture_cuda_graph(4).batch_size == 4  # before the state: any power of two
        with pytest.raises(ValueError, match=r"in_capture: bs=3 is not one of the powers of two"):
            be.init_forward_metadata_out_graph(3, np.arange(3), np.array([1, 2, 3]), np.ones((3, 1), np.int32),
                                               in_capture=True)  # fmt: skip
        assert be.init_cuda_graph_state(12) == (1, 2, 4, 8, 12)
        assert be.init_forward_metadata_capture_cuda_graph(12).batch_size == 12


def test_mla_pad_and_unpad_draft_extend():
    """SGLang's pad / unpad helpers: tokens first in each padded row (the rest kept),
    the inverse gives the ragged rows back; jittable; lengths that do not fit or do not
    add up are refused, naming the argument."""
    rng = np.random.default_rng(12)
    lens = np.array([3, 0, 1, 4], np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + 2, 2, 5)), jnp.float32)  # 2 padding tokens at the end
    base = jnp.full((4, 4, 2, 5), jnp.nan, jnp.float32)
    padded = MLABackend.pad_draft_extend_query(q, base, lens, cu)
    for b, n in enumerate(lens):
        np.testing.assert_array_equal(np.asarray(padded[b, :n]), np.asarray(q[cu[b] : cu[b] + n]))
        assert np.isnan(np.asarray(padded[b, n:])).all()
    again = jax.jit(MLABackend.pad_draft_extend_query)(q, base, lens, cu)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(padded))
    back = jax.jit(MLABackend.unpad_draft_extend_output, static_argnums=3)(padded, cu, lens, int(cu[-1]))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(q[: cu[-1]]))
    with pytest.raises(ValueError, match=r"seq_lens_q \[3, 0, 5, 4\] must be in \[0, max_q=4\]"):
        MLABackend.pad_draft_extend_query(q, base, np.array([3, 0, 5, 4]), np.array([0, 3, 3, 8, 12]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q \[0, 3, 3, 5, 8\] must be the running sum"):
        MLABackend.pad_draft_extend_query(q, base, lens, np.array([0, 3, 3, 5, 8]))
    with pytest.raises(ValueError, match=r"padded_q shape \(4, 4, 2, 6\) must be \[bs, max_q, \*\(2, 5\)\]"):
        MLABackend.pad_draft_extend_query(q, jnp.zeros((4, 4, 2, 6)), lens, cu)
    with pytest.raises(ValueError, match=r"sum_seq_lens_q=9 must equal sum\(seq_lens_q\)=8"):
        MLABackend.unpad_draft_extend_output(padded, cu, lens, 9)


def test_mla_layer_k_scale_on_a_non_fp8_cache_is_ignored():
    """A layer's ``k_scale`` applies to FP8 latent caches only (docs/SEMANTICS.md: the
    scale dequantises e4m3 values): on an f32 latent cache the MLA absorbed decode of a
    layer with ``k_scale=0.5`` equals that of the same layer without a scale, as it does
    for the MHA backend."""
    rng = np.random.default_rng(31)
    cfg, be, layer, cache = _mla_setup(rng)
    big_r, r, h = 64, 16, 4
    lens = [40, 7]
    r2p = _mla_pages(rng, lens, 16, 32, cfg.max_num_pages)
    loc = np.array([r2p[b, t // 16] * 16 + t % 16 for b, L in enumerate(lens) for t in range(L)], np.int32)
    rows = rng.standard_normal((loc.size, big_r + r)).astype(np.float32)
    kv = jattn.set_mla_kv_buffer(
        cache.kv[0], jnp.asarray(loc), jnp.asarray(rows[:, :big_r]), jnp.asarray(rows[:, big_r:])
    )
    cache = cache.replace_layer(0, kv)
    md = be.init_forward_metadata(2, np.arange(2), np.array(lens), r2p, ForwardMode.DECODE)
    t = md.num_tokens
    q_nope = jnp.asarray(rng.standard_normal((t, h, big_r)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((t, h, r)), jnp.float32)
    scaled = dataclasses.replace(layer, k_scale=0.5)
    plain = be.forward_decode(q_nope, None, None, layer, cache, md, save_kv_cache=False, q_rope=q_rope)[0]
    got = be.forward_decode(q_nope, None, None, scaled, cache, md, save_kv_cache=False, q_rope=q_rope)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
