"""MLA fused rope + FP8 query quantisation (jattn.mla_rope, MLABackend with
``cos_sin_cache``), the FP8 latent write, and the MLA CUDA-graph helpers, against
hand-written float64 numpy."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import naive
import numpy as np
import pytest

import jattn
from jattn import DUMMY_PAGE, ForwardMode, LayerSpec, MLABackend, MLAConfig, MLAKVCache
from jattn.mla_rope import MLARope, apply_rope, quantize_query_fp8

FP8 = ml_dtypes.float8_e4m3fn


def np_cos_sin(max_pos, r, base=10000.0):
    """The rotary cache as SGLang / FlashInfer lay it out: [max_pos, r], cos then sin."""
    inv = 1.0 / base ** (np.arange(0, r, 2) / r)
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], -1)


def np_rope(x, pos, cs, is_neox):
    """float64 rope of x [T, ..., r] at positions pos [T] (written out pair by pair)."""
    x = naive.f64(x)
    r = x.shape[-1]
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        for i in range(r // 2):
            c, s = cs[pos[t], i], cs[pos[t], r // 2 + i]
            a, b = (i, i + r // 2) if is_neox else (2 * i, 2 * i + 1)
            out[t, ..., a] = x[t, ..., a] * c - x[t, ..., b] * s
            out[t, ..., b] = x[t, ..., b] * c + x[t, ..., a] * s
    return out


def np_q8(x):
    """Scale-1 saturating e4m3 quantisation, as float64."""
    return naive.f64(np.clip(naive.f64(x), -448, 448).astype(np.float32).astype(FP8))


@pytest.mark.parametrize("is_neox", [False, True])
def test_apply_rope_matches_float64(is_neox):
    rng = np.random.default_rng(11 + is_neox)
    t, h, r, max_pos = 7, 3, 10, 37  # r / 2 = 5: odd half
    cs = np_cos_sin(max_pos, r)
    pos = rng.integers(0, max_pos, t)
    pos[0], pos[-1] = 0, max_pos - 1
    x = rng.standard_normal((t, h, r)).astype(np.float32)
    got = apply_rope(jnp.asarray(x), jnp.asarray(pos, jnp.int32), jnp.asarray(cs, jnp.float32), is_neox=is_neox)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np_rope(x, pos, cs, is_neox), atol=2e-6, rtol=1e-5)
    # the other layout is a different rotation
    other = np_rope(x, pos, cs, not is_neox)
    assert not np.allclose(np.asarray(got), other, atol=1e-3)


def test_quantize_query_fp8_saturates_scale_one():
    x = np.array([0.0, 1.0, -3.3, 447.0, 460.0, 1e6, -1e6, 0.01, np.nan], np.float32)
    got = np.asarray(quantize_query_fp8(jnp.asarray(x)))
    assert got.dtype == FP8
    want = np.clip(x, -448, 448).astype(FP8)
    np.testing.assert_array_equal(got[:-1].astype(np.float32), want[:-1].astype(np.float32))
    assert got[5] == 448 and got[6] == -448 and np.isnan(got[-1].astype(np.float32))


def test_rope_errors_name_the_argument():
    x = jnp.ones((4, 2, 8))
    with pytest.raises(ValueError, match="cos_sin_cache is 6 wide"):
        apply_rope(x, jnp.zeros(4, jnp.int32), jnp.ones((10, 6)))
    with pytest.raises(ValueError, match="cos_sin_cache must be 2-D"):
        apply_rope(x, jnp.zeros(4, jnp.int32), jnp.ones((10,)))
    with pytest.raises(ValueError, match=r"positions has shape \(3,\)"):
        apply_rope(x, jnp.zeros(3, jnp.int32), jnp.ones((10, 8)))


def test_rope_refuses_what_it_would_truncate_clamp_or_misread():
    """Float positions were cast to int32 (1.7 rotated as 1), an empty cache gave a gather
    error, a rope width of 0 rotated the whole row (``x[..., -0:]``) and a k_pe of several
    heads a reshape error."""
    x = jnp.ones((3, 2, 4))
    cs = jnp.asarray(np_cos_sin(8, 4), jnp.float32)
    with pytest.raises(TypeError, match="positions.dtype=float32 must be an integer type"):
        apply_rope(x, jnp.array([0.5, 1.7, 2.2]), cs)
    with pytest.raises(ValueError, match=r"cos_sin_cache has no rows \(shape \(0, 4\)\)"):
        apply_rope(x, jnp.arange(3), jnp.zeros((0, 4)))
    with pytest.raises(ValueError, match=r"x must be \[tokens, ..., rope_dim\], got shape \(4,\)"):
        apply_rope(jnp.ones(4), jnp.arange(4), cs)
    rope = MLARope(jnp.arange(3, dtype=jnp.int32), cs)
    with pytest.raises(
        ValueError, match=r"k_pe must be \[tokens, rope_dim\] or \[tokens, 1, rope_dim\], got shape \(3, 2, 4\)"
    ):
        rope.key(jnp.ones((3, 2, 4)))
    for bad in (0, 9, 4.0):
        with pytest.raises(ValueError, match=rf"rope_dim={bad!r} must be an int in \[1, 8\]"):
            rope.rotate_tail(jnp.ones((3, 2, 8)), bad)
        with pytest.raises(ValueError, match=rf"rope_dim={bad!r} must be an int in \[1, 8\]"):
            rope.query(jnp.ones((3, 2, 8)), bad)
    np.testing.assert_array_equal(rope.rotate_tail(jnp.ones((3, 2, 8)), 4)[..., :4], 1.0)
    assert apply_rope(x, np.arange(3, dtype=np.int64), cs).shape == (3, 2, 4)


def _setup(rng, kv, spec=1, big_r=40, r=10, h=3, ps=8, num_pages=24):
    cfg = MLAConfig(
        num_heads=h,
        kv_lora_rank=big_r,
        qk_nope_head_dim=20,
        qk_rope_head_dim=r,
        v_head_dim=12,
        page_size=ps,
        context_len=96,
        num_pages=num_pages,
        kv_cache_dtype=kv,
        spec_num_tokens=spec,
        kernel_backend="xla",
        batch_buckets=(4,),
    )
    scale = 0.25 if kv == "fp8" else 1.0
    layer = LayerSpec(0, h, 1, big_r + r, k_scale=scale)
    cache = MLAKVCache.create(num_layers=1, num_pages=num_pages, page_size=ps, kv_lora_rank=big_r, rope_dim=r, dtype=kv)
    return cfg, MLABackend(cfg), layer, cache, scale


def _pages(rng, lens, ps, num_pages, width):
    r2p = np.zeros((len(lens), width), np.int32)
    perm, i = rng.permutation(np.arange(1, num_pages)), 0
    for b, n in enumerate(-(-x // ps) for x in lens):
        r2p[b, :n] = perm[i : i + n]
        i += n
    return r2p


CASES = [
    (ForwardMode.DECODE, "fp8", False),
    (ForwardMode.TARGET_VERIFY, "fp8", True),
    (ForwardMode.DRAFT_EXTEND, "fp8", False),
    (ForwardMode.DECODE, "float32", True),
    (ForwardMode.DRAFT_EXTEND, "float32", False),
]


@pytest.mark.parametrize("mode,kv,is_neox", CASES)
def test_mla_backend_fused_rope_and_fp8_query(mode, kv, is_neox):
    """MLABackend with ``cos_sin_cache``: q_pe / k_pe rotated at the plan's positions
    (``L - n + i``), the FP8 cache's query quantised with scale 1 (clamp +-448), the
    rotated k_pe written (quantised with kv_scale); against float64 numpy."""
    rng = np.random.default_rng(hash((mode.value, kv, is_neox)) % 2**32)
    spec = 3
    cfg, be, layer, cache, kv_scale = _setup(rng, kv, spec=spec)
    big_r, r, h, ps = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_heads, cfg.page_size
    n_new = {ForwardMode.DECODE: [1, 1, 1], ForwardMode.TARGET_VERIFY: [spec] * 3}.get(mode, [2, 1, 3])
    lens = [29, 3, 17]
    r2p = _pages(rng, lens, ps, cfg.num_pages, cfg.max_num_pages)
    cs = np_cos_sin(cfg.context_len, r)
    # every key row unrotated; history rows are rotated on the host and written first
    raw = [rng.standard_normal((L, big_r + r)) * 2 for L in lens]
    for x in raw:
        x[:, 0] *= 1e-3  # column 0 meets the query's clamped entry
    rot = [np.concatenate([x[:, :big_r], np_rope(x[:, big_r:], np.arange(len(x)), cs, is_neox)], -1) for x in raw]
    hist_loc = [r2p[b, t // ps] * ps + t % ps for b, L in enumerate(lens) for t in range(L - n_new[b])]
    hist = np.concatenate([rot[b][: L - n_new[b]] for b, L in enumerate(lens)]).astype(np.float32)
    kvl = jattn.set_mla_kv_buffer(
        jnp.full_like(cache.kv[0], jnp.nan),
        jnp.asarray(np.array(hist_loc, np.int32)),
        jnp.asarray(hist[:, :big_r]),
        jnp.asarray(hist[:, big_r:]),
        kv_scale=kv_scale,
    )
    cache = cache.replace_layer(0, kvl)
    extend = dict(extend_seq_lens=np.array(n_new)) if mode.is_extend() else {}
    md = be.init_forward_metadata(3, np.arange(3), np.array(lens), r2p, mode, **extend)
    t = md.num_tokens
    if mode.is_extend():
        cu = np.asarray(md.cu_seqlens_q)
        rows = [np.arange(cu[b], cu[b + 1]) for b in range(3)]
    else:
        rows = [b * md.max_seqlen_q + np.arange(n_new[b]) for b in range(3)]
    q_nope = rng.standard_normal((t, h, big_r)).astype(np.float32)
    q_nope[:, :, 0] = 600.0  # past 448: clamped on FP8
    q_pe = rng.standard_normal((t, h, r)).astype(np.float32)
    c_kv = np.zeros((t, big_r), np.float32)
    k_pe = np.zeros((t, r), np.float32)
    for b, L in enumerate(lens):
        c_kv[rows[b]], k_pe[rows[b]] = raw[b][L - n_new[b] :, :big_r], raw[b][L - n_new[b] :, big_r:]

    @jax.jit
    def step(cache, md, q_nope, c_kv, q_pe, k_pe, cs):
        return be.forward_absorbed(
            q_nope, c_kv, None, layer, cache, md, q_rope=q_pe, k_rope=k_pe, cos_sin_cache=cs, is_neox=is_neox
        )

    out, new_cache = step(cache, md, *map(jnp.asarray, (q_nope, c_kv, q_pe, k_pe)), jnp.asarray(cs, jnp.float32))
    out = np.asarray(out).reshape(t, h, big_r)
    got_pool = naive.f64(np.asarray(new_cache.kv[0]))
    for b, L in enumerate(lens):
        pos = np.asarray(md.positions)[rows[b]]
        np.testing.assert_array_equal(pos, L - n_new[b] + np.arange(n_new[b]))  # the plan's positions
        q = np.concatenate([naive.f64(q_nope[rows[b]]), np_rope(q_pe[rows[b]], pos, cs, is_neox)], -1)
        keys = rot[b]
        if kv == "fp8":
            q = np_q8(q)
            assert np.abs(q).max() == 448  # the clamp was exercised
            keys = naive.f64(naive.quantize_fp8(keys, kv_scale)) * kv_scale
        o, _ = naive.attend_one(q, keys[:, None], keys[:, None, :big_r], causal=True, scale=cfg.softmax_scale)
        tol = 2e-3 if kv == "fp8" else 2e-5
        np.testing.assert_allclose(out[rows[b]], o, atol=tol * np.abs(o).max(), rtol=tol)
        # what is written: the rotated k_pe (quantised with kv_scale on FP8)
        written = naive.gather_paged(got_pool, np.asarray(md.page_table)[b], L)[L - n_new[b] :]
        want = rot[b][L - n_new[b] :]
        if kv == "fp8":
            want = naive.f64(naive.quantize_fp8(want, kv_scale))
            np.testing.assert_allclose(written, want, rtol=0.07, atol=1e-6)  # one e4m3 rounding apart at most
            assert np.mean(written == want) > 0.99
        else:
            np.testing.assert_allclose(written, want, rtol=1e-5, atol=1e-5)


def _decode_of_two(rng, kv):
    """A decode plan of two requests (13 and 6 tokens) over a random cache of dtype ``kv``:
    ``(cfg, backend, layer, cache, kv_scale, metadata, cos_sin)``."""
    cfg, be, layer, cache, kv_scale = _setup(rng, kv)
    lens = [13, 6]
    r2p = _pages(rng, lens, cfg.page_size, cfg.num_pages, cfg.max_num_pages)
    md = be.init_forward_metadata(2, np.arange(2), np.array(lens), r2p, ForwardMode.DECODE)
    pool = rng.standard_normal(cache.kv[0].shape).astype(np.float32)
    cache = cache.replace_layer(0, jnp.asarray(pool).astype(cache.dtype))
    cs = jnp.asarray(np_cos_sin(cfg.context_len, cfg.qk_rope_head_dim), jnp.float32)
    return cfg, be, layer, cache, kv_scale, md, cs


def test_fused_rope_equals_rotating_first_and_llama_4_scaling_order():
    """Non-FP8: the fused call equals the plain call on inputs rotated beforehand. FP8:
    the query is quantised, then llama_4_scaling multiplies it and it is quantised again
    (SGLang's order); the full-width query (q_rope=None) gets the same rope."""
    rng = np.random.default_rng(3)
    for kv in ("float32", "fp8"):
        cfg, be, layer, cache, kv_scale, md, cs = _decode_of_two(rng, kv)
        big_r, r, h, t = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_heads, md.num_tokens
        qn = jnp.asarray(rng.standard_normal((t, h, big_r)) * 100, jnp.float32)
        qp = jnp.asarray(rng.standard_normal((t, h, r)), jnp.float32)
        s = jnp.asarray(rng.uniform(0.5, 3.0, t), jnp.float32)
        kw = dict(save_kv_cache=False)
        fused, _ = be.forward_decode(qn, None, None, layer, cache, md, q_rope=qp, cos_sin_cache=cs, **kw)
        full, _ = be.forward_decode(jnp.concatenate([qn, qp], -1), None, None, layer, cache, md, cos_sin_cache=cs, **kw)
        np.testing.assert_array_equal(np.asarray(fused), np.asarray(full))
        qp_rot = apply_rope(qp, md.positions, cs)
        scaled, _ = be.forward_decode(
            qn, None, None, layer, cache, md, q_rope=qp, cos_sin_cache=cs, llama_4_scaling=s, **kw
        )
        if kv == "float32":
            plain, _ = be.forward_decode(qn, None, None, layer, cache, md, q_rope=qp_rot, **kw)
            np.testing.assert_allclose(np.asarray(fused), np.asarray(plain), rtol=1e-6, atol=1e-6)
            want, _ = be.forward_decode(qn, None, None, layer, cache, md, q_rope=qp_rot, llama_4_scaling=s, **kw)
        else:
            q8 = quantize_query_fp8(jnp.concatenate([qn, qp_rot], -1))
            q8 = quantize_query_fp8(q8.astype(jnp.float32) * s[:, None, None]).astype(jnp.float32)
            want, _ = be.forward_decode(q8, None, None, layer, cache, md, **kw)
        np.testing.assert_allclose(np.asarray(scaled), np.asarray(want), rtol=1e-6, atol=1e-6)
        with pytest.raises(ValueError, match="cos_sin_cache is 4 wide"):
            be.forward_decode(qn, None, None, layer, cache, md, q_rope=qp, cos_sin_cache=cs[:, :4], **kw)


def test_forward_extend_prefill_fused_rope():
    """The ragged prefill with ``cos_sin_cache`` equals the prefill on q_rope / k_rope
    rotated beforehand at the plan's positions (k_rope shared by every head)."""
    rng = np.random.default_rng(9)
    cfg, be, layer, _, _ = _setup(rng, "float32")
    h, nope, r, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    new = [5, 11, 2]
    r2p = _pages(rng, new, cfg.page_size, cfg.num_pages, cfg.max_num_pages)
    md = be.init_forward_metadata(
        3, np.arange(3), np.array(new), r2p, ForwardMode.EXTEND, extend_seq_lens=np.array(new)
    )
    t = md.num_tokens
    q, k = (jnp.asarray(rng.standard_normal((t, h, nope)), jnp.float32) for _ in range(2))
    vv = jnp.asarray(rng.standard_normal((t, h, v)), jnp.float32)
    qr = jnp.asarray(rng.standard_normal((t, h, r)), jnp.float32)
    kr = jnp.asarray(rng.standard_normal((t, r)), jnp.float32)
    cs = np_cos_sin(64, r)
    pos = np.asarray(md.positions)
    got = be.forward_extend(q, k, vv, layer, md, q_rope=qr, k_rope=kr, cos_sin_cache=jnp.asarray(cs), is_neox=True)
    qr_rot = jnp.asarray(np_rope(qr, pos, cs, True), jnp.float32)
    kr_rot = jnp.asarray(np_rope(kr, pos, cs, True), jnp.float32)
    want = be.forward_extend(q, k, vv, layer, md, q_rope=qr_rot, k_rope=kr_rot)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_save_kv_and_prefix_chunk_fused_rope():
    """``save_kv`` and ``forward_prefix_chunk`` with ``cos_sin_cache`` equal the same calls
    on k_pe / q_rope rotated beforehand at the given positions (a chunked-prefix caller
    that hands the prefill unrotated inputs rotates its latent write and its chunks the
    same way); without ``positions`` they refuse."""
    rng = np.random.default_rng(13)
    cfg, be, layer, cache, _ = _setup(rng, "float32")
    h, nope, big_r, r, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    cs, t = np_cos_sin(64, r), 7
    pos = rng.permutation(40)[:t].astype(np.int32)
    loc = jnp.asarray(rng.permutation(np.arange(8, 8 + 3 * cfg.page_size))[:t], jnp.int32)
    c_kv = jnp.asarray(rng.standard_normal((t, big_r)), jnp.float32)
    k_pe = jnp.asarray(rng.standard_normal((t, 1, r)), jnp.float32)
    got = be.save_kv(layer, cache, loc, c_kv, k_pe, cos_sin_cache=jnp.asarray(cs), positions=jnp.asarray(pos))
    want = be.save_kv(layer, cache, loc, c_kv, jnp.asarray(np_rope(k_pe[:, 0], pos, cs, False), jnp.float32))
    np.testing.assert_allclose(np.asarray(got.kv), np.asarray(want.kv), rtol=1e-6, atol=1e-6)

    keys = [4, 0]  # the second request has no keys in this chunk
    cu_q, cu_kv = jnp.asarray([0, 3, t], jnp.int32), jnp.asarray([0, 4, 4], jnp.int32)
    q, qr = (jnp.asarray(rng.standard_normal((t, h, w)), jnp.float32) for w in (nope, r))
    k = jnp.asarray(rng.standard_normal((sum(keys), h, nope)), jnp.float32)
    kr = jnp.asarray(rng.standard_normal((sum(keys), r)), jnp.float32)
    vv = jnp.asarray(rng.standard_normal((sum(keys), h, v)), jnp.float32)
    kw = dict(max_seqlen_q=4, max_seqlen_kv=4, k_rope=kr)
    o, lse = be.forward_prefix_chunk(
        q, k, vv, layer, cu_q, cu_kv, q_rope=qr, cos_sin_cache=jnp.asarray(cs), positions=jnp.asarray(pos), **kw
    )
    qr_rot = jnp.asarray(np_rope(qr, pos, cs, False), jnp.float32)
    o2, lse2 = be.forward_prefix_chunk(q, k, vv, layer, cu_q, cu_kv, q_rope=qr_rot, **kw)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse2), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(lse)[3:] == -np.inf) and not np.asarray(o)[3:].any()
    # a chunk with no keys at all, k_rope given apart: the empty result, no crash on the reshape
    e = [jnp.zeros((0, h, w), jnp.float32) for w in (nope, v)]
    o0, lse0 = be.forward_prefix_chunk(
        q, e[0], e[1], layer, cu_q, jnp.zeros(3, jnp.int32), q_rope=qr, k_rope=jnp.zeros((0, r)),
        max_seqlen_q=4, max_seqlen_kv=1,
    )  # fmt: skip
    assert not np.asarray(o0).any() and np.all(np.asarray(lse0) == -np.inf)
    for call in (
        lambda: be.save_kv(layer, cache, loc, c_kv, k_pe, cos_sin_cache=jnp.asarray(cs)),
        lambda: be.forward_prefix_chunk(q, k, vv, layer, cu_q, cu_kv, q_rope=qr, cos_sin_cache=jnp.asarray(cs), **kw),
    ):
        with pytest.raises(ValueError, match="cos_sin_cache needs positions"):
            call()


def test_rope_clamps_positions_in_their_own_type_and_refuses_an_integer_cache():
    """Positions were cast to int32 before the clamp: uint32 2^31 + 3 and int64 2^32 + 3
    (which ``jnp.asarray`` wraps without x64) rotated as row 0 or row 3, not the last row.
    An integer ``cos_sin_cache`` was accepted."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 2, 4)), jnp.float32)
    cs_np = np_cos_sin(16, 4)
    cs = jnp.asarray(cs_np, jnp.float32)
    want = np_rope(np.asarray(x), np.array([15, 15, 0, 15]), cs_np, False)
    big = jnp.asarray(np_cos_sin(300, 4), jnp.float32)  # more rows than int8 / uint8 hold
    want_big = np_rope(np.asarray(x), np.array([100, 200, 0, 250]), np_cos_sin(300, 4), False)
    for pos in (np.array([100, 200, 0, 250], np.uint8), np.array([100, -56, -1, -6], np.int8)):
        pos_want = (
            want_big
            if pos.dtype == np.uint8
            else np_rope(np.asarray(x), np.array([100, 0, 0, 0]), np_cos_sin(300, 4), False)
        )
        np.testing.assert_allclose(np.asarray(apply_rope(x, jnp.asarray(pos), big)), pos_want, atol=2e-6, rtol=1e-5)
    for pos in (
        np.array([2**31 + 3, 2**32 + 3, -7, 16], np.int64),
        np.array([2**31 + 3, 2**32 - 1, 0, 16], np.uint32),
        jnp.array([2**31 + 3, 2**32 - 1, 0, 16], jnp.uint32),
    ):
        np.testing.assert_allclose(np.asarray(apply_rope(x, pos, cs)), want, atol=2e-6, rtol=1e-5)
    with pytest.raises(TypeError, match="cos_sin_cache.dtype=int32 must be a float type"):
        apply_rope(x, np.arange(4), jnp.ones((16, 4), jnp.int32))


def test_mla_backend_names_k_rope_before_the_fused_rope_checks_its_cache():
    """A ``k_rope`` of the wrong width with ``cos_sin_cache`` was reported as a bad
    ``cos_sin_cache`` (the rope ran before the width check)."""
    rng = np.random.default_rng(15)
    cfg, be, layer, cache, _ = _setup(rng, "float32")
    h, big_r, r = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    md = be.init_forward_metadata(2, np.arange(2), np.array([5, 3]), _pages(rng, [5, 3], 8, 24, 12), ForwardMode.DECODE)
    z = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    cs = jnp.asarray(np_cos_sin(cfg.context_len, r), jnp.float32)
    for k_rope in (z(4, r - 2), z(4, 2, r)):
        with pytest.raises(ValueError, match=rf"k_rope shape {re.escape(str(k_rope.shape))} must be \[T, {r}\]"):
            be.forward_decode(
                z(4, h, big_r), z(4, big_r), None, layer, cache, md, q_rope=z(4, h, r), k_rope=k_rope, cos_sin_cache=cs
            )


def test_mla_backend_refuses_misshapen_rope_and_latent_inputs():
    """A ``k_rope`` of one row would broadcast over every key, a ``c_kv`` / ``k_pe`` split
    other than the config's would store columns of ``c_kv`` as rope, and a ``q_rope`` of
    another token count fails in a concatenate: each is refused naming the argument."""
    rng = np.random.default_rng(14)
    cfg, be, layer, cache, _ = _setup(rng, "float32")
    h, nope, big_r, r, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    z = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    cu = jnp.asarray([0, 5], jnp.int32)
    kw = dict(max_seqlen_q=5, max_seqlen_kv=5)
    with pytest.raises(ValueError, match=r"k_rope shape \(1, 10\) must be \[5, 10\]"):
        be.forward_prefix_chunk(
            z(5, h, nope), z(5, h, nope), z(5, h, v), layer, cu, cu, q_rope=z(5, h, r), k_rope=z(1, r), **kw
        )
    with pytest.raises(ValueError, match=r"q_rope shape \(4, 3, 10\) must be \[5, 3, 10\]"):
        be.forward_prefix_chunk(
            z(5, h, nope), z(5, h, nope), z(5, h, v), layer, cu, cu, q_rope=z(4, h, r), k_rope=z(5, r), **kw
        )
    # MLA's decompressed K and V are per query head: fewer heads would be read as GQA, silently
    for k_heads, v_heads, name in ((1, h, "k"), (h, 1, "v")):
        with pytest.raises(ValueError, match=rf"{name} shape \(5, 1, \d+\) must be \[T, {h}, "):
            be.forward_prefix_chunk(
                z(5, h, nope), z(5, k_heads, nope), z(5, v_heads, v), layer, cu, cu, q_rope=z(5, h, r), k_rope=z(5, r),
                **kw,
            )  # fmt: skip
    loc = jnp.arange(2, dtype=jnp.int32) + 8
    with pytest.raises(ValueError, match=r"c_kv shape \(2, 44\) must be \[T, 40\].*kv_lora_rank"):
        be.save_kv(layer, cache, loc, z(2, big_r + 4), z(2, r - 4))
    with pytest.raises(ValueError, match="k_pe shape"):
        be.save_kv(layer, cache, loc, z(2, big_r), z(2, 2, r))
    with pytest.raises(ValueError, match="c_kv has 2 rows and k_pe 3"):
        be.save_kv(layer, cache, loc, z(2, big_r), z(3, r))
    md = be.init_forward_metadata(2, np.arange(2), np.array([5, 3]), _pages(rng, [5, 3], 8, 24, 12), ForwardMode.DECODE)
    with pytest.raises(ValueError, match="q_rope has 3 rows; it must have q's 4"):  # the plan's 4 rows (bucket 4)
        be.forward_decode(z(4, h, big_r), z(4, big_r), None, layer, cache, md, q_rope=z(3, h, r), k_rope=z(4, r))


def test_mla_rope_key_and_query_shapes():
    cs = jnp.asarray(np_cos_sin(8, 4), jnp.float32)
    rope = MLARope(jnp.arange(3, dtype=jnp.int32), cs, fp8=True)
    assert rope.key(jnp.ones((3, 1, 4))).shape == (3, 4) and rope.key(None) is None
    q = rope.query(jnp.ones((3, 2, 6), jnp.bfloat16), 4)
    assert q.dtype == jnp.bfloat16 and q.shape == (3, 2, 6)
    np.testing.assert_array_equal(np.asarray(q.astype(FP8).astype(jnp.bfloat16)), np.asarray(q))  # exact e4m3 values


# ----------------------------------------------------------------------------- the FP8 latent write


def test_fp8_latent_write_is_one_jitted_scatter_and_drops_bad_slots():
    """``MLABackend.save_kv`` on an FP8 cache: one jitted update (one scatter in the
    lowered program), ``clamp(row / kv_scale, -448, 448)`` as e4m3; slots outside the
    pool, negative ones included, are dropped and never wrap."""
    rng = np.random.default_rng(21)
    cfg, be, layer, cache, kv_scale = _setup(rng, "fp8", num_pages=4)
    big_r, r, ps = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.page_size
    slots = 4 * ps
    cache = cache.replace_layer(0, jnp.full_like(cache.kv[0], 7.0))
    loc = np.array([9, -1, slots, 3, -slots, slots + 5, 31], np.int32)
    rows = rng.standard_normal((len(loc), big_r + r)).astype(np.float32) * 100  # many past 448 * 0.25
    fn = jax.jit(lambda c, loc, a, b: be.save_kv(layer, c, loc, a, b))
    args = (cache, jnp.asarray(loc), jnp.asarray(rows[:, :big_r]), jnp.asarray(rows[:, big_r:]))
    hlo = fn.lower(*args).as_text()
    assert hlo.count('"stablehlo.scatter"') == 1, "the write is one scatter"
    got = np.asarray(fn(*args).kv[0]).reshape(slots, -1).astype(np.float32)
    want = np.full((slots, big_r + r), 7.0, np.float32)
    for i, s in enumerate(loc):
        if 0 <= s < slots:
            want[s] = np.clip(rows[i] / kv_scale, -448, 448).astype(FP8).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert (np.abs(got) == 448).any()  # the clamp was exercised


# ----------------------------------------------------------------------------- CUDA-graph helpers (MLA)


def test_mla_cuda_graph_capture_replay_and_fill_value():
    """MLA CUDA-graph flow: the all-padding capture plan compiles the step; replays of
    the same bucket (rows at the fill value 0 among them) never retrace; a fill-value row
    gives 0 and writes only the dummy page; no buffers to fill after the draft."""
    rng = np.random.default_rng(5)
    cfg, be, layer, cache, _ = _setup(rng, "fp8")
    big_r, r, h, ps = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_heads, cfg.page_size
    assert be.get_cuda_graph_seq_len_fill_value() == 0
    assert be.get_verify_buffers_to_fill_after_draft() == [None, None]
    assert be.init_cuda_graph_state(4) == (4,)
    traces = []

    @jax.jit
    def step(cache, md, q, c, kp, cs):
        traces.append(1)
        return be.forward_decode(q, c, None, layer, cache, md, k_rope=kp, q_rope=q[..., :r], cos_sin_cache=cs)

    cs = jnp.asarray(np_cos_sin(cfg.context_len, r), jnp.float32)
    cap = be.init_forward_metadata_capture_cuda_graph(4)
    inputs = lambda: (  # noqa: E731
        jnp.asarray(rng.standard_normal((4, h, big_r)), jnp.float32),
        jnp.asarray(rng.standard_normal((4, big_r)), jnp.float32),
        jnp.asarray(rng.standard_normal((4, r)), jnp.float32),
    )
    out, c0 = step(cache, cap, *inputs(), cs)
    assert (np.asarray(out) == 0).all()
    for lens in ([9, be.get_cuda_graph_seq_len_fill_value(), 30], [1, 17, 0, 2]):
        r2p = _pages(rng, [max(x, 1) for x in lens], ps, cfg.num_pages, cfg.max_num_pages)
        md = be.init_forward_metadata_replay_cuda_graph(len(lens), np.arange(len(lens)), np.array(lens), r2p)
        out, c1 = step(cache, md, *inputs(), cs)
        out = np.asarray(out).reshape(4, h, big_r)
        empty = [b for b in range(4) if b >= len(lens) or lens[b] == 0]
        assert (out[empty] == 0).all() and np.isfinite(out).all()
        changed = set(np.flatnonzero(np.asarray(c1.kv[0] != cache.kv[0]).any(axis=(1, 2))).tolist())
        real = {int(r2p[b, (x - 1) // ps]) for b, x in enumerate(lens) if x}
        assert changed <= real | {DUMMY_PAGE}
    assert len(traces) == 1


def test_explicit_positions_take_precedence_over_the_plans():
    """``positions=`` given beside a plan rotates at those positions, not the plan's."""
    rng = np.random.default_rng(4)
    cfg, be, layer, cache, _, md, cs = _decode_of_two(rng, "float32")
    big_r, r, h, t = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_heads, md.num_tokens
    qn = jnp.asarray(rng.standard_normal((t, h, big_r)), jnp.float32)
    qp = jnp.asarray(rng.standard_normal((t, h, r)), jnp.float32)
    pos = jnp.asarray(md.positions, jnp.int32) + 5
    kw = dict(save_kv_cache=False)
    got, _ = be.forward_decode(qn, None, None, layer, cache, md, q_rope=qp, cos_sin_cache=cs, positions=pos, **kw)
    want, _ = be.forward_decode(qn, None, None, layer, cache, md, q_rope=apply_rope(qp, pos, cs), **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    plan, _ = be.forward_decode(qn, None, None, layer, cache, md, q_rope=qp, cos_sin_cache=cs, **kw)
    assert not np.allclose(np.asarray(got), np.asarray(plan))
