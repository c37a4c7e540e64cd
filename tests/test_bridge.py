"""jattn.bridge: conversions, torch pools, TorchMHABackend / TorchMLABackend.

CPU: every path against a torch reference (DLPack between torch CPU and JAX CPU is
zero-copy). GPU (marked ``gpu``): zero-copy, in-place JAX writes into the torch
pool, stream ordering in both directions with large buffers, bf16 and FP8.
"""

import contextlib
import functools
import gc
import math
import time
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from jattn import ForwardMode, MHAConfig, MLABackend, MLAConfig
from jattn.bridge import (
    DRAFT_EXTEND,
    AttentionLayer,
    BridgeError,
    TorchKVPool,
    TorchMHABackend,
    TorchMLABackend,
    TorchMLAKVPool,
    to_jax,
    to_torch,
)
from jattn.bridge.convert import to_jax_input
from jattn.bridge.pool import layer_spec

ON_GPU = jax.default_backend() == "gpu"
DEV = "cuda" if ON_GPU else "cpu"


# ----------------------------------------------------------------------------- torch reference


def ref_attention(q, K, V, *, n_new, causal=True, window=-1, cap=0.0, sinks=None, scale=None):
    """q [n, Hq, D], K/V [L, Hkv, D] (f32) of ONE request whose last ``n_new`` keys are
    the new tokens; query i sits at position L - n_new + i."""
    n, hq, d = q.shape
    L, hkv, dv = V.shape
    if L == 0:
        return torch.zeros(n, hq, dv)
    g = hq // hkv
    K = K.repeat_interleave(g, 1)
    V = V.repeat_interleave(g, 1)
    s = torch.einsum("nhd,lhd->hnl", q, K) * (scale or 1 / math.sqrt(d))
    if cap:
        s = cap * torch.tanh(s / cap)
    pos = torch.arange(n)[:, None] + (L - n_new)
    j = torch.arange(L)[None, :]
    mask = torch.ones(n, L, dtype=torch.bool)
    if causal:
        mask &= j <= pos
    if window >= 0:
        mask &= j >= pos - window
    s = s.masked_fill(~mask, -float("inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(hq, 1, 1).expand(hq, n, 1)], -1)
        p = torch.softmax(s, -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return torch.einsum("hnl,lhd->nhd", p, V)


def gather(buf, pages, L, page_size):
    slots = torch.tensor([pages[t // page_size] * page_size + t % page_size for t in range(L)], dtype=torch.long)
    idx = slots.to(buf.device)
    if buf.element_size() == 1:
        return buf.view(torch.uint8).index_select(0, idx).view(buf.dtype).float().cpu()
    return buf.index_select(0, idx).float().cpu()


def dequant(x, scale):
    return x.float() * scale


class Engine:
    """A tiny torch engine state: requests with pages in req_to_page."""

    def __init__(self, num_reqs, max_pages, page_size, rng, num_pages):
        self.page_size = page_size
        self.req_to_page = torch.zeros(num_reqs + 1, max_pages, dtype=torch.int32)
        free = list(rng.permutation(np.arange(1, num_pages)))  # page 0 is the dummy
        self.pages = []
        for r in range(num_reqs):
            p = [int(free.pop()) for _ in range(max_pages)]
            self.req_to_page[r + 1] = torch.tensor(p, dtype=torch.int32)
            self.pages.append(p)
        self.req_pool_indices = torch.arange(1, num_reqs + 1, dtype=torch.int32)

    def slots(self, r, start, n):
        return [
            self.pages[r][t // self.page_size] * self.page_size + t % self.page_size for t in range(start, start + n)
        ]


def mha_setup(
    kv_dtype=torch.bfloat16, hq=4, hkv=2, d=32, page_size=4, num_pages=64, layers=2, spec=1, context_len=64, **cfgkw
):
    cfg = MHAConfig(
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page_size,
        context_len=context_len,
        num_pages=num_pages,
        kv_cache_dtype="float8_e4m3fn" if kv_dtype == torch.float8_e4m3fn else "bfloat16",
        spec_num_tokens=spec,
        kernel_backend="xla",
        **cfgkw,
    )
    pool = TorchKVPool(
        num_layers=layers,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=kv_dtype,
        device=DEV,
    )
    return cfg, pool


def rand(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(torch.bfloat16).to(DEV)


# ----------------------------------------------------------------------------- conversions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int32])
def test_roundtrip_zero_copy(dtype):
    t = torch.zeros(64, 8, dtype=torch.float32).to(dtype).to(DEV)
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.shape == (64, 8)
    b = to_torch(a)
    assert b.data_ptr() == t.data_ptr() and b.dtype == dtype


def test_conversion_errors_and_explicit_copy():
    x = torch.zeros(16, 16, device=DEV)[:, :8]
    with pytest.raises(BridgeError, match="not contiguous"):
        to_jax(x)
    y = to_jax(x, copy=True)  # explicit, documented copy
    assert y.shape == (16, 8) and y.unsafe_buffer_pointer() != x.data_ptr()
    z = torch.zeros(64, dtype=torch.bfloat16, device=DEV)[1:]
    with pytest.raises(BridgeError, match="aligned"):
        to_jax(z)
    with pytest.raises(BridgeError, match=r"x\.dtype=torch\.int64 cannot be shared"):
        to_jax(torch.zeros(4, dtype=torch.int64, device=DEV), name="x")
    with pytest.raises(BridgeError, match=r"x must be a torch\.Tensor, got ndarray"):
        to_jax(np.zeros(4), name="x")
    # torch's lazy negation: the memory holds the other sign, so a view would read it wrongly
    neg = torch.arange(4.0, device=DEV)._neg_view()
    assert neg.is_neg() and neg.is_contiguous()
    with pytest.raises(BridgeError, match=r"x is a lazily negated or conjugated view"):
        to_jax(neg, name="x")
    np.testing.assert_array_equal(np.asarray(to_jax(neg, copy=True)), [-0.0, -1.0, -2.0, -3.0])
    np.testing.assert_array_equal(np.asarray(to_jax_input(neg, "x")), [-0.0, -1.0, -2.0, -3.0])


def test_torch_sees_pool_view():
    t = torch.zeros(8, 4, device=DEV)
    a = to_jax(t)
    t[3] = 7.0
    assert float(np.asarray(a)[3, 0]) == 7.0


def test_jax_writer_refused_on_cpu():
    if ON_GPU:
        pytest.skip("CPU-only behaviour")
    cfg, _ = mha_setup()
    with pytest.raises(BridgeError, match="CPU"):
        TorchMHABackend(cfg, kv_writer="jax")


# ----------------------------------------------------------------------------- MHA


def _run_mha_engine(kv_dtype, *, kv_writer="auto", window=-1, cap=0.0, with_sinks=False, seed=0, sync="event"):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    hq, hkv, d, ps = 4, 2, 32, 4
    cfg, pool = mha_setup(kv_dtype, hq, hkv, d, ps)
    be = TorchMHABackend(cfg, kv_writer=kv_writer, sync=sync)
    scale = 0.05 if kv_dtype == torch.float8_e4m3fn else None
    layers = [
        AttentionLayer(i, hq, hkv, d, sliding_window_size=window, logit_cap=cap, k_scale=scale, v_scale=scale and 0.03)
        for i in range(2)
    ]
    sinks = torch.randn(hq, device=DEV) if with_sinks else None
    eng = Engine(3, 16, ps, rng, cfg.num_pages)
    lens = [5, 0, 13]
    ptrs = [(pool.get_key_buffer(i).data_ptr(), pool.get_value_buffer(i).data_ptr()) for i in range(2)]
    kv_hist = {i: [([], []) for _ in lens] for i in range(2)}  # all K/V of each request (bf16)

    def remember(layer, k, v, n_new_per_req):
        """Append each request's new K/V rows (request-major) to its history."""
        row = 0
        for r, n in enumerate(n_new_per_req):
            kv_hist[layer.layer_id][r][0].append(k[row : row + n].cpu().view(n, hkv, d))
            kv_hist[layer.layer_id][r][1].append(v[row : row + n].cpu().view(n, hkv, d))
            row += n

    def check(out, q, layer, n_new_per_req, lens_now):
        o = out.float().cpu().view(-1, hq, d)
        row = 0
        for r, (n_new, L) in enumerate(zip(n_new_per_req, lens_now)):
            if n_new == 0:
                continue
            K = torch.cat(kv_hist[layer.layer_id][r][0]).float() if L else torch.zeros(0, hkv, d)
            V = torch.cat(kv_hist[layer.layer_id][r][1]).float() if L else torch.zeros(0, hkv, d)
            if kv_dtype == torch.float8_e4m3fn:  # the attention over the quantised history
                K, V = fp8_round(K, layer.k_scale), fp8_round(V, layer.v_scale)
            exp = ref_attention(
                q[row : row + n_new].float().cpu().view(n_new, hq, d),
                K,
                V,
                n_new=n_new,
                window=window,
                cap=cap,
                sinks=None if sinks is None else sinks.cpu(),
            )
            tol = 6e-2 if kv_dtype == torch.float8_e4m3fn else 2e-2
            torch.testing.assert_close(o[row : row + n_new], exp, atol=tol, rtol=tol)
            row += n_new

    # prefill (EXTEND, no prefix)
    ext = [5, 0, 13]
    be.init_forward_metadata(
        3,
        3,
        eng.req_pool_indices,
        torch.tensor(lens),
        eng.req_to_page,
        ForwardMode.EXTEND,
        extend_seq_lens=torch.tensor(ext),
        extend_prefix_lens=torch.zeros(3, dtype=torch.int32),
    )
    T = sum(ext)
    for layer in layers:
        q, k, v = rand(T, hq * d), rand(T, hkv * d), rand(T, hkv * d)
        remember(layer, k, v, ext)
        loc = torch.tensor(sum((eng.slots(r, 0, n) for r, n in enumerate(ext)), []), dtype=torch.int64, device=DEV)
        out = be.forward_extend(q, k, v, layer, loc, pool, 3, save_kv_cache=True, sinks=sinks)
        assert out.shape == (T, hq * d) and out.dtype == torch.bfloat16
        check(out, q, layer, ext, lens)
    # an extend over a prefix (second chunk of request 0, first of request 1)
    ext2 = [3, 2, 0]
    lens = [a + b for a, b in zip(lens, ext2)]
    be.init_forward_metadata(
        3,
        3,
        eng.req_pool_indices,
        torch.tensor(lens),
        eng.req_to_page,
        ForwardMode.EXTEND,
        extend_seq_lens=torch.tensor(ext2),
    )
    for layer in layers:
        T = sum(ext2)
        q, k, v = rand(T, hq * d), rand(T, hkv * d), rand(T, hkv * d)
        remember(layer, k, v, ext2)
        out = be.forward_extend(q, k, v, layer, None, pool, 3, save_kv_cache=True, sinks=sinks)
        check(out, q, layer, ext2, lens)
    # decode steps
    for step in range(3):
        lens = [x + 1 for x in lens]
        be.init_forward_metadata(3, 0, eng.req_pool_indices, torch.tensor(lens), eng.req_to_page, ForwardMode.DECODE)
        for layer in layers:
            q, k, v = rand(3, hq * d), rand(3, hkv * d), rand(3, hkv * d)
            remember(layer, k, v, [1, 1, 1])
            out = be.forward_decode(q, k, v, layer, None, pool, 3, save_kv_cache=True, sinks=sinks)
            assert out.shape == (3, hq * d)
            check(out, q, layer, [1, 1, 1], lens)
    # the pool was written in place: same buffers, holding the K and V the engine produced
    # (quantised with each one's own scale)
    for i in range(2):
        assert (pool.get_key_buffer(i).data_ptr(), pool.get_value_buffer(i).data_ptr()) == ptrs[i]
        for r, L in enumerate(lens):
            for buf, hist, sc in (
                (pool.get_key_buffer(i), 0, layers[i].k_scale),
                (pool.get_value_buffer(i), 1, layers[i].v_scale),
            ):
                want = torch.cat(kv_hist[i][r][hist]).float()
                if kv_dtype == torch.float8_e4m3fn:
                    want = fp8_round(want, sc) / sc
                torch.testing.assert_close(gather(buf, eng.pages[r], L, ps), want)
    return be


def fp8_round(x, scale):
    """``x`` as an FP8 pool holds it at ``scale`` (the write's rule), read back times ``scale``."""
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_mha_engine_prefill_extend_decode(kv_dtype):
    be = _run_mha_engine(kv_dtype)
    # one jitted function per (mode, layer shape); layers share them
    assert len(be._fns) <= 4


def test_mha_window_cap_sinks():
    _run_mha_engine(torch.bfloat16, window=3, cap=5.0, with_sinks=True, seed=1)


def test_mha_views_are_persistent_and_zero_copy():
    rng = np.random.default_rng(0)
    cfg, pool = mha_setup()
    be = TorchMHABackend(cfg)
    layer = AttentionLayer(0, 4, 2, 32)
    eng = Engine(2, 16, 4, rng, cfg.num_pages)
    for step, lens in enumerate(([3, 7], [4, 8])):
        be.init_forward_metadata(2, 0, eng.req_pool_indices, torch.tensor(lens), eng.req_to_page, ForwardMode.DECODE)
        be.forward_decode(rand(2, 128), rand(2, 64), rand(2, 64), layer, None, pool, 2, save_kv_cache=True)
        if step == 0:
            views = {k: v for k, v in be._views.items()}
            stages = dict(be._stage)
    assert be._views.keys() == views.keys()
    for k, v in views.items():
        assert be._views[k] is v  # not re-imported
        assert (
            v.jax.unsafe_buffer_pointer() == v.torch.data_ptr() == pool.get_key_buffer(0).data_ptr()
            or v.jax.unsafe_buffer_pointer() == pool.get_value_buffer(0).data_ptr()
        )
    assert stages.keys() == be._stage.keys()
    (fn,) = be._fns.values()
    assert fn._cache_size() == 1  # new values, same bucket: no retrace
    with pytest.raises(BridgeError, match=r"q\.dtype=torch\.float64 is not supported"):
        be.forward_decode(rand(2, 128).double(), None, None, layer, None, pool, 2, save_kv_cache=False)


def test_torch_write_then_jattn_read():
    """The engine writes K/V with the pool's own set_kv_buffer; jattn reads (save_kv_cache=False)."""
    rng = np.random.default_rng(2)
    hq, hkv, d, ps = 4, 2, 32, 4
    cfg, pool = mha_setup()
    be = TorchMHABackend(cfg)
    layer = AttentionLayer(1, hq, hkv, d)
    eng = Engine(1, 16, ps, rng, cfg.num_pages)
    L = 9
    k, v = rand(L, hkv, d), rand(L, hkv, d)
    pool.set_kv_buffer(layer, torch.tensor(eng.slots(0, 0, L), device=DEV), k, v)
    be.init_forward_metadata(1, 0, eng.req_pool_indices, torch.tensor([L]), eng.req_to_page, ForwardMode.DECODE)
    q = rand(1, hq * d)
    out = be.forward_decode(q, None, None, layer, None, pool, 1)
    exp = ref_attention(q.float().cpu().view(1, hq, d), k.float().cpu(), v.float().cpu(), n_new=1)
    torch.testing.assert_close(out.float().cpu().view(1, hq, d), exp, atol=2e-2, rtol=2e-2)


def test_mha_target_verify_and_cuda_graph_capture_replay():
    rng = np.random.default_rng(3)
    hq, hkv, d, ps, spec = 4, 2, 32, 4, 3
    cfg, pool = mha_setup(spec=spec)
    be = TorchMHABackend(cfg)
    layer = AttentionLayer(0, hq, hkv, d)
    eng = Engine(3, 16, ps, rng, cfg.num_pages)
    assert be.init_cuda_graph_state(4) == (1, 2, 4)
    # capture: an all-padding plan of bucket 4; the call compiles
    be.init_forward_metadata_capture_cuda_graph(4, 4 * spec, forward_mode=ForwardMode.TARGET_VERIFY)
    out = be.forward_decode(
        rand(4 * spec, hq * d),
        rand(4 * spec, hkv * d),
        rand(4 * spec, hkv * d),
        layer,
        None,
        pool,
        4,
        save_kv_cache=True,
    )
    assert out.shape == (4 * spec, hq * d)
    (fn,) = be._fns.values()
    assert fn._cache_size() == 1
    # replay with 3 real requests (padded to bucket 4): no retrace, right values
    K = [rand(L, hkv, d) for L in (6, 10, 3)]
    V = [rand(L, hkv, d) for L in (6, 10, 3)]
    for r, L in enumerate((6, 10, 3)):
        pool.set_kv_buffer(
            layer, torch.tensor(eng.slots(r, 0, L - spec), device=DEV), K[r][: L - spec], V[r][: L - spec]
        )
    be.init_forward_metadata_replay_cuda_graph(
        3, eng.req_pool_indices, torch.tensor([6, 10, 3]), eng.req_to_page, ForwardMode.TARGET_VERIFY
    )
    q = rand(3 * spec, hq * d)
    k = torch.cat([x[-spec:] for x in K]).view(3 * spec, -1)
    v = torch.cat([x[-spec:] for x in V]).view(3 * spec, -1)
    # padding to bucket 4 happens inside: pass 3 requests' rows
    out = be.forward_decode(q, k, v, layer, None, pool, 3, save_kv_cache=True)
    assert fn._cache_size() == 1
    for r in range(3):
        exp = ref_attention(
            q[r * spec : (r + 1) * spec].float().cpu().view(spec, hq, d),
            K[r].float().cpu(),
            V[r].float().cpu(),
            n_new=spec,
        )
        torch.testing.assert_close(
            out[r * spec : (r + 1) * spec].float().cpu().view(spec, hq, d), exp, atol=2e-2, rtol=2e-2
        )
    # SGLang's out-of-graph planning installs the same plan: same program, same values
    be.init_forward_metadata_out_graph(
        3, eng.req_pool_indices, torch.tensor([6, 10, 3]), eng.req_to_page, ForwardMode.TARGET_VERIFY
    )
    again = be.forward_decode(q, k, v, layer, None, pool, 3, save_kv_cache=True)
    assert fn._cache_size() == 1 and torch.equal(again, out)
    with pytest.raises(ValueError, match=r"in_capture: bs=3 is not one of the buckets \(1, 2, 4\)"):
        be.init_forward_metadata_out_graph(
            3,
            eng.req_pool_indices,
            torch.tensor([6, 10, 3]),
            eng.req_to_page,
            ForwardMode.TARGET_VERIFY,
            in_capture=True,
        )
    assert be.support_kv_cache_prewrite(ForwardMode.DECODE) and not be.support_kv_cache_prewrite(ForwardMode.EXTEND)


# ----------------------------------------------------------------------------- MLA


def mla_ref(q, kv, n_new, R, scale, causal=True):
    """q [n, H, R + r], kv [L, R + r] f32 -> [n, H, R]."""
    n, H, _ = q.shape
    L = kv.shape[0]
    s = torch.einsum("nhc,lc->hnl", q, kv) * scale
    if causal:
        pos = torch.arange(n)[:, None] + (L - n_new)
        s = s.masked_fill(~(torch.arange(L)[None, :] <= pos), -float("inf"))
    return torch.einsum("hnl,lc->nhc", torch.softmax(s, -1), kv[:, :R])


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_mla_decode_verify_draft_extend(kv_dtype):
    rng = np.random.default_rng(4)
    torch.manual_seed(4)
    R, r, H, ps = 64, 16, 4, 8
    cfg = MLAConfig(
        num_heads=H,
        kv_lora_rank=R,
        qk_nope_head_dim=32,
        qk_rope_head_dim=r,
        v_head_dim=32,
        page_size=ps,
        context_len=64,
        num_pages=24,
        spec_num_tokens=2,
        kv_cache_dtype="float8_e4m3fn" if kv_dtype == torch.float8_e4m3fn else "bfloat16",
    )
    pool = TorchMLAKVPool(
        num_layers=1, num_pages=24, page_size=ps, kv_lora_rank=R, qk_rope_head_dim=r, dtype=kv_dtype, device=DEV
    )
    kscale = 0.02 if kv_dtype == torch.float8_e4m3fn else None
    layer = AttentionLayer(0, H, 1, R + r, v_head_dim=R, k_scale=kscale)
    be = TorchMLABackend(cfg, pool)
    eng = Engine(2, 8, ps, rng, 24)
    scale = cfg.softmax_scale
    ptr = pool.get_key_buffer(0).data_ptr()
    hist = [[], []]
    lens = [0, 0]
    steps = [
        (ForwardMode.DECODE, [7, 12]),
        (ForwardMode.DECODE, [1, 1]),
        (ForwardMode.TARGET_VERIFY, [2, 2]),
        (DRAFT_EXTEND, [3, 1]),
        (ForwardMode.EXTEND, [5, 2]),  # absorbed inputs: the absorbed extend over the prefix
    ]
    # first fill some history with the pool's own writer (an engine's prefill)
    for rr, L in enumerate((6, 11)):
        c, kp = rand(L, R), rand(L, r)
        pool.set_mla_kv_buffer(layer, torch.tensor(eng.slots(rr, 0, L), device=DEV), c, kp)
        hist[rr].append(torch.cat([c, kp], -1).float().cpu())
        lens[rr] = L
    for mode, news in steps[1:]:
        lens = [a + b for a, b in zip(lens, news)]
        be.init_forward_metadata(
            2, 0, eng.req_pool_indices, torch.tensor(lens), eng.req_to_page, mode, extend_seq_lens=torch.tensor(news)
        )
        T = sum(news)
        q, qr, c, kp = rand(T, H * R), rand(T, H * r), rand(T, R), rand(T, r)
        row = 0
        for rr, n in enumerate(news):
            hist[rr].append(torch.cat([c[row : row + n], kp[row : row + n]], -1).float().cpu())
            row += n
        fwd = be.forward_decode if mode is ForwardMode.DECODE else be.forward_extend
        out = fwd(q, c, None, layer, None, save_kv_cache=True, q_rope=qr, k_rope=kp)
        assert out.shape == (T, H * R)
        row = 0
        for rr, n in enumerate(news):
            kv = torch.cat(hist[rr])
            if kv_dtype == torch.float8_e4m3fn:  # the attention over the quantised history
                kv = fp8_round(kv, kscale)
            qq = torch.cat([q[row : row + n].view(n, H, R), qr[row : row + n].view(n, H, r)], -1).float().cpu()
            exp = mla_ref(qq, kv, n, R, scale)
            tol = 8e-2 if kv_dtype == torch.float8_e4m3fn else 3e-2
            torch.testing.assert_close(out[row : row + n].float().cpu().view(n, H, R), exp, atol=tol, rtol=tol)
            row += n
    assert pool.get_key_buffer(0).data_ptr() == ptr
    for rr, hist_r in enumerate(hist):  # every request's latent rows, as the pool holds them
        if lens[rr]:
            want = torch.cat(hist_r)
            if kv_dtype == torch.float8_e4m3fn:
                want = fp8_round(want, kscale) / kscale
            torch.testing.assert_close(
                gather(pool.get_key_buffer(0).view(-1, R + r), eng.pages[rr], lens[rr], ps), want
            )


def _draft_mla(num_pages):
    """The multi-step draft tests' MLA config (latent 64 + 16, 4 heads, pages of 8,
    ``config.num_pages=num_pages``), a bf16 pool of 32 pages and its layer."""
    R, r, H, ps = 64, 16, 4, 8
    cfg = MLAConfig(
        num_heads=H,
        kv_lora_rank=R,
        qk_nope_head_dim=32,
        qk_rope_head_dim=r,
        v_head_dim=32,
        page_size=ps,
        context_len=64,
        num_pages=num_pages,
        batch_buckets=(4,),
    )
    pool = TorchMLAKVPool(
        num_layers=1, num_pages=32, page_size=ps, kv_lora_rank=R, qk_rope_head_dim=r, dtype=torch.bfloat16, device=DEV
    )
    return cfg, pool, AttentionLayer(0, H, 1, R + r, v_head_dim=R)


def test_mla_multistep_draft_loop():
    """SGLang's multi-step draft backend on a torch pool: step i of a chain draft sees its
    history plus the draft tokens of steps 0..i (written by the loop itself); a padding
    row stays out; a capture plan then replays with no retrace; topk > 1 is refused."""
    from jattn.bridge import TorchMLAMultiStepDraftBackend

    rng = np.random.default_rng(6)
    torch.manual_seed(6)
    R, r, H, ps, steps = 64, 16, 4, 8, 3
    cfg, pool, layer = _draft_mla(num_pages=32)
    ms = TorchMLAMultiStepDraftBackend(cfg, pool, topk=1, speculative_num_steps=steps + 1)
    assert ms.num_steps == steps and len(ms.attn_backends) == steps
    eng = Engine(3, 8, ps, rng, 32)
    hist = []
    for rr, L in enumerate((5, 9, 1)):  # the history before the first draft token
        c, kp = rand(L, R), rand(L, r)
        pool.set_mla_kv_buffer(layer, torch.tensor(eng.slots(rr, 0, L), device=DEV), c, kp)
        hist.append([torch.cat([c, kp], -1).float().cpu()])
    lens0 = torch.tensor([6, 10, 0])  # request 2 is a padding row this loop
    ms.init_forward_metadata(3, eng.req_pool_indices, lens0, eng.req_to_page)
    for i in range(steps):
        q, qr, c, kp = rand(3, H * R), rand(3, H * r), rand(3, R), rand(3, r)
        out = ms.forward_decode(i, q, c, None, layer, None, save_kv_cache=True, q_rope=qr, k_rope=kp)
        assert out.shape == (3, H * R)
        for rr in range(2):
            hist[rr].append(torch.cat([c[rr : rr + 1], kp[rr : rr + 1]], -1).float().cpu())
            qq = torch.cat([q[rr].view(1, H, R), qr[rr].view(1, H, r)], -1).float().cpu()
            exp = mla_ref(qq, torch.cat(hist[rr]), 1, R, cfg.softmax_scale)
            torch.testing.assert_close(out[rr].float().cpu().view(1, H, R), exp, atol=3e-2, rtol=3e-2)
        assert (out[2] == 0).all()  # the padding row's output
    # request 2's page holds its history only: the padding row wrote nothing there
    got = gather(pool.get_key_buffer(0).view(-1, R + r), eng.pages[2], 1, ps)
    torch.testing.assert_close(got, hist[2][0].to(torch.bfloat16).float())
    # CUDA-graph helpers: capture bucket 4, replay new lengths, one program per step
    assert ms.init_cuda_graph_state(4) == (4,) and ms.get_cuda_graph_seq_len_fill_value() == 0
    ms.init_forward_metadata_capture_cuda_graph(4)
    for i in range(steps):
        ms.forward_decode(i, rand(4, H * R), rand(4, R), None, layer, None, save_kv_cache=False, q_rope=rand(4, H * r))
    ms.init_forward_metadata_out_graph(2, eng.req_pool_indices, torch.tensor([3, 2]), eng.req_to_page)
    for i in range(steps):
        ms.forward_decode(i, rand(2, H * R), rand(2, R), None, layer, None, save_kv_cache=False, q_rope=rand(2, H * r))
    assert all(len(be._fns) == 1 for be in ms.attn_backends)
    assert all(f._cache_size() == 1 for be in ms.attn_backends for f in be._fns.values())
    with pytest.raises(NotImplementedError, match="topk=2"):
        TorchMLAMultiStepDraftBackend(cfg, pool, topk=2, speculative_num_steps=3)


def test_mla_multistep_passes_num_pages_and_req_to_token_pages_on():
    """Without ``config.num_pages`` the multi-step backend forwards the capture's and the
    plans' ``num_pages`` to every step, and takes the table as ``req_to_token_pages`` too,
    as :class:`TorchMLABackend` does."""
    from jattn.bridge import TorchMLAMultiStepDraftBackend

    R, r, H, NP = 64, 16, 4, 32
    cfg, pool, layer = _draft_mla(num_pages=None)
    ms = TorchMLAMultiStepDraftBackend(cfg, pool, topk=1, speculative_num_steps=3)
    ms.init_cuda_graph_state(4)
    ms.init_forward_metadata_capture_cuda_graph(4, num_pages=NP)
    for i in range(ms.num_steps):
        out = ms.forward_decode(i, rand(4, H * R), rand(4, R), None, layer, None, False, q_rope=rand(4, H * r))
        assert out.shape == (4, H * R)
    r2p = (torch.arange(4 * 8, dtype=torch.int32).reshape(4, 8) + 1) % NP
    rpi, lens = torch.arange(3, dtype=torch.int32), torch.tensor([5, 9, 0])
    ms.init_forward_metadata(3, rpi, lens, None, num_pages=NP, req_to_token_pages=r2p)
    ms.init_forward_metadata_replay_cuda_graph(3, rpi, lens, req_to_token_pages=r2p, num_pages=NP)
    for i in range(ms.num_steps):
        ms.forward_decode(i, rand(3, H * R), rand(3, R), None, layer, None, False, q_rope=rand(3, H * r))
    ms.init_forward_metadata(3, rpi, lens, r2p)  # no bound at all: refused when read
    with pytest.raises(ValueError, match="num_pages is None"):
        ms.forward_decode(0, rand(3, H * R), rand(3, R), None, layer, None, False, q_rope=rand(3, H * r))


def test_mla_pad_and_unpad_draft_extend_on_torch():
    """The torch helpers match the JAX ones; pad writes in place."""
    _, be, _ = _small_mla(2, 32, 16, 32)
    lens = torch.tensor([2, 0, 3])
    cu = torch.tensor([0, 2, 2, 5])
    q = rand(6, 4, 8)
    padded = torch.full((3, 3, 4, 8), float("nan"), dtype=q.dtype, device=q.device)
    out = be.pad_draft_extend_query(q, padded, lens, cu)
    assert out.data_ptr() == padded.data_ptr()
    want = MLABackend.pad_draft_extend_query(
        jnp.asarray(q.float().cpu().numpy()), jnp.full((3, 3, 4, 8), jnp.nan), lens.numpy(), cu.numpy()
    )
    np.testing.assert_array_equal(padded.float().cpu().numpy(), np.asarray(want))
    back = be.unpad_draft_extend_output(padded, cu, lens, 5)
    assert torch.equal(back, q[:5])
    with pytest.raises(ValueError, match=r"sum_seq_lens_q=6 must equal sum\(seq_lens_q\)=5"):
        be.unpad_draft_extend_output(padded, cu, lens, 6)


def _small_mla(H, P, r, Vd):
    """A small MLA config, its torch pool and backend, and one layer (prefill tests)."""
    cfg = MLAConfig(
        num_heads=H,
        kv_lora_rank=64,
        qk_nope_head_dim=P,
        qk_rope_head_dim=r,
        v_head_dim=Vd,
        page_size=8,
        context_len=64,
        num_pages=16,
    )
    pool = TorchMLAKVPool(num_layers=1, num_pages=16, page_size=8, kv_lora_rank=64, qk_rope_head_dim=r, device=DEV)
    return cfg, TorchMLABackend(cfg, pool), AttentionLayer(0, H, H, P + r, v_head_dim=Vd)


def _mla_prefill_expected(qn, qr, kn, kr, v, ext, scale):
    """Per request of the ragged MLA prefill inputs (``[T, H * width]`` rows, ``kr`` one rope
    row per token shared by the heads; ``ext`` the requests' lengths): its rows, its q and k
    (nope then rope columns, f32 on the CPU) and the causal reference output."""
    H = qr.shape[1] // kr.shape[1]
    P, r, Vd = qn.shape[1] // H, kr.shape[1], v.shape[1] // H
    row = 0
    for n in ext:
        rows = slice(row, row + n)
        q = torch.cat([qn[rows].view(n, H, P), qr[rows].view(n, H, r)], -1).float().cpu()
        k = torch.cat([kn[rows].view(n, H, P), kr[rows].view(n, 1, r).expand(n, H, r)], -1).float().cpu()
        yield rows, q, k, ref_attention(q, k, v[rows].view(n, H, Vd).float().cpu(), n_new=n, scale=scale)
        row += n


def test_mla_ragged_prefill_with_lse():
    torch.manual_seed(5)
    H, P, r, Vd = 2, 32, 16, 32
    cfg, be, layer = _small_mla(H, P, r, Vd)
    ext = [5, 9]
    r2p = torch.arange(1, 13, dtype=torch.int32).view(2, 6)
    be.init_forward_metadata(
        2, 2, torch.tensor([0, 1]), torch.tensor(ext), r2p, ForwardMode.EXTEND, extend_seq_lens=torch.tensor(ext)
    )
    T = sum(ext)
    qn, qr, kn, kr, v = rand(T, H * P), rand(T, H * r), rand(T, H * P), rand(T, r), rand(T, H * Vd)
    out, lse = be.forward_extend(qn, kn, v, layer, save_kv_cache=False, q_rope=qr, k_rope=kr, return_lse=True)
    assert out.shape == (T, H * Vd) and lse.shape == (T, H)
    for rows, q, k, exp in _mla_prefill_expected(qn, qr, kn, kr, v, ext, cfg.softmax_scale):
        n = q.shape[0]
        torch.testing.assert_close(out[rows].float().cpu().view(n, H, Vd), exp, atol=3e-2, rtol=3e-2)
        scores = torch.einsum("nhd,lhd->nhl", q, k) * cfg.softmax_scale
        causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]  # [query, key]
        want_lse = torch.logsumexp(scores.masked_fill(~causal[:, None, :], -float("inf")), -1)  # natural log
        torch.testing.assert_close(lse[rows].float().cpu(), want_lse, atol=2e-2, rtol=2e-3)
    with pytest.raises(ValueError, match="save_kv_cache"):
        be.forward_extend(qn, kn, v, layer, save_kv_cache=True, q_rope=qr, k_rope=kr)
    # SGLang asks for the LSE through the batch: the same pair
    fb = types.SimpleNamespace(mha_return_lse=True, attn_attend_prefix_cache=False)
    out2, lse2 = be.forward_extend(qn, kn, v, layer, fb, save_kv_cache=False, q_rope=qr, k_rope=kr)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    fb.mha_return_lse = False
    assert torch.equal(be.forward_extend(qn, kn, v, layer, fb, save_kv_cache=False, q_rope=qr, k_rope=kr), out)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_engine_jax_writer_in_place(kv_dtype):
    be = _run_mha_engine(kv_dtype, kv_writer="jax")
    assert be.kv_writer == "jax"
    for v in be._views.values():
        assert v.verified and v.jax.unsafe_buffer_pointer() == v.torch.data_ptr()


@pytest.mark.gpu
def test_gpu_auto_sync_resolves_to_stream():
    """On the GPU the default fences are on XLA's stream once the launch check passes."""
    assert TorchMHABackend(mha_setup()[0]).sync.mode == "stream"


@pytest.mark.gpu
def test_gpu_engine_stream_sync():
    """The engine loop with fences on XLA's compute stream (sync="stream")."""
    be = _run_mha_engine(torch.bfloat16, kv_writer="jax", sync="stream")
    assert be.sync.mode == "stream"


def test_xla_compute_stream_reads_once_per_device():
    """The stream probe runs a jitted buffer_callback; on the CPU there is no CUDA
    stream (None), on the GPU a nonzero pointer; the answer is cached per device."""
    from jattn.bridge.streams import xla_compute_stream

    dev = jax.devices()[0]
    a = xla_compute_stream(dev)
    assert xla_compute_stream(dev) == a
    assert (a is not None and a != 0) if ON_GPU else a is None


def test_backend_stream_only_in_stream_mode():
    """``backend.stream`` (XLA's stream for torch work, no fences) exists only where
    the fences are on XLA's stream: never on the CPU, never in event/host modes."""
    cfg, _ = mha_setup()
    assert TorchMHABackend(cfg, sync="event").stream is None
    be = TorchMHABackend(cfg)
    assert (be.stream is not None) == (ON_GPU and be.sync.mode == "stream")


def test_stream_sync_mode_accepted_on_every_platform():
    """sync="stream" is a valid mode; on the CPU it orders like "event" (torch CPU ops
    are synchronous and the output export waits for the result)."""
    if not ON_GPU:
        _run_mha_engine(torch.bfloat16, sync="stream")
    with pytest.raises(ValueError, match="'stream'"):
        TorchMHABackend(mha_setup()[0], sync="streams")


@pytest.mark.gpu
def test_gpu_torch_writer_engine():
    _run_mha_engine(torch.bfloat16, kv_writer="torch")


@pytest.mark.gpu
def test_gpu_torch_writer_planned_off_the_layer_stream():
    """Planned on torch's default stream while it is busy, layers run on ``backend.stream``:
    the plan's slot tensor (copied on the default stream) was read by the torch writer on
    the layer stream without waiting for that copy, and its memory could be reused while
    still read. The layer stream now waits for the planning stream once per plan."""
    cfg, pool = mha_setup(num_pages=64, page_size=16, d=128, hq=8, hkv=8, layers=1, context_len=1024)
    be = TorchMHABackend(cfg, sync="stream", kv_writer="torch")
    assert be.stream is not None
    layer = AttentionLayer(0, 8, 8, 128)
    r2p = torch.randperm(63, dtype=torch.int32)[:64].add(1).view(1, -1)
    q = torch.ones(1, 8 * 128, dtype=torch.bfloat16, device=DEV)
    for step, seq in enumerate((17, 40, 97, 3)):
        torch.cuda._sleep(50_000_000)  # the default stream is busy: the slots' copy waits
        be.init_forward_metadata(1, 0, torch.tensor([0]), torch.tensor([seq]), r2p, ForwardMode.DECODE)
        k = torch.full((1, 8 * 128), float(step + 1), dtype=torch.bfloat16, device=DEV)
        with torch.cuda.stream(be.stream):
            be.forward_decode(q, k, k, layer, None, pool, 1, save_kv_cache=True)
        torch.cuda.synchronize()
        slot = int(r2p[0, (seq - 1) // 16]) * 16 + (seq - 1) % 16
        got = pool.get_key_buffer(0).reshape(-1, 8 * 128)[slot].float()
        assert torch.equal(got, torch.full_like(got, step + 1)), (seq, got[:4])


@pytest.mark.gpu
def test_gpu_no_memory_growth():
    rng = np.random.default_rng(0)
    cfg, pool = mha_setup(num_pages=4096, page_size=16, d=128, hq=8, hkv=2)
    be = TorchMHABackend(cfg)
    layer = AttentionLayer(0, 8, 2, 128)
    eng = Engine(4, 4, 16, rng, 4096)
    be.init_forward_metadata(
        4, 0, eng.req_pool_indices, torch.tensor([20, 30, 40, 50]), eng.req_to_page, ForwardMode.DECODE
    )
    args = (rand(4, 8 * 128), rand(4, 2 * 128), rand(4, 2 * 128), layer, None, pool, 4)
    be.forward_decode(*args, save_kv_cache=True)
    torch.cuda.synchronize()
    dev = jax.devices()[0]
    j0 = dev.memory_stats()["bytes_in_use"]
    t0 = torch.cuda.memory_allocated()
    for _ in range(20):
        be.forward_decode(*args, save_kv_cache=True)
    torch.cuda.synchronize()
    pool_bytes = pool.get_key_buffer(0).numel() * 2
    assert dev.memory_stats()["bytes_in_use"] - j0 < pool_bytes // 4
    assert torch.cuda.memory_allocated() - t0 < pool_bytes // 4


def _on_stream(be, sync):
    """``shared``: the torch side runs on XLA's stream (``backend.stream``), no fences."""
    if sync == "shared":
        assert be.stream is not None
        return torch.cuda.stream(be.stream)
    return contextlib.nullcontext()


@pytest.mark.gpu
@pytest.mark.parametrize("sync", ["event", "stream", "shared"])
def test_gpu_stream_order_torch_write_then_jattn_read(sync):
    """Large torch write into the pool immediately followed by a jattn read (no sync)."""
    big = 1 << 15
    cfg, pool = mha_setup(num_pages=big, page_size=16, d=128, hq=8, hkv=8, layers=1, context_len=4096)
    be = TorchMHABackend(cfg, sync="stream" if sync == "shared" else sync)
    layer = AttentionLayer(0, 8, 8, 128)
    r2p = torch.arange(1, 257, dtype=torch.int32).view(1, 256)
    be.init_forward_metadata(1, 0, torch.tensor([0]), torch.tensor([4096]), r2p, ForwardMode.DECODE)
    q = torch.ones(1, 8 * 128, dtype=torch.bfloat16, device=DEV)
    for val in (1.0, -2.0, 3.0):
        with _on_stream(be, sync):
            torch.cuda._sleep(20_000_000)  # keep torch's stream busy: JAX must wait for it
            pool.get_value_buffer(0).fill_(val)  # ~1 GiB written by torch
            out = be.forward_decode(q, None, None, layer, None, pool, 1)
            assert torch.allclose(out.float(), torch.full_like(out.float(), val)), (val, out.float().mean())


@pytest.mark.gpu
@pytest.mark.parametrize("sync", ["event", "stream", "shared"])
def test_gpu_stream_order_jattn_write_then_torch_read(sync):
    """A jattn in-place write immediately followed by a torch read of the pool (no sync)."""
    cfg, pool = mha_setup(num_pages=1 << 14, page_size=16, d=128, hq=8, hkv=8, layers=1, context_len=4096)
    be = TorchMHABackend(cfg, sync="stream" if sync == "shared" else sync)
    layer = AttentionLayer(0, 8, 8, 128)
    n = 32
    r2p = torch.arange(1, 1 + 256 * n, dtype=torch.int32).view(n, 256)
    be.init_cuda_graph_state(32)
    be.init_forward_metadata(n, 0, torch.arange(n), torch.full((n,), 4096), r2p, ForwardMode.DECODE)
    for val in (1.0, -2.0):
        with _on_stream(be, sync):
            k = torch.full((n, 8 * 128), val, dtype=torch.bfloat16, device=DEV)
            be.forward_decode(
                torch.ones(n, 8 * 128, dtype=torch.bfloat16, device=DEV), k, k, layer, None, pool, n, save_kv_cache=True
            )
            # the read is enqueued on torch's stream right away
            slots = (r2p[:, 255] * 16 + 15).long().to(DEV)
            got = pool.get_key_buffer(0).index_select(0, slots)
            assert torch.all(got == val)


def test_output_alias_fallback_exports():
    """If the output buffer is not aliased (XLA:CPU never aliases DLPack imports), the
    backend falls back to exporting outputs, with the same values."""
    if ON_GPU:
        pytest.skip("CPU-only behaviour")
    rng = np.random.default_rng(6)
    cfg, pool = mha_setup()
    be = TorchMHABackend(cfg)
    be.alias_out = True
    layer = AttentionLayer(0, 4, 2, 32)
    eng = Engine(1, 16, 4, rng, cfg.num_pages)
    be.init_forward_metadata(1, 0, eng.req_pool_indices, torch.tensor([3]), eng.req_to_page, ForwardMode.DECODE)
    with pytest.warns(UserWarning, match="not aliased"):
        a = be.forward_decode(rand(1, 128), rand(1, 64), rand(1, 64), layer, None, pool, 1, save_kv_cache=True)
    assert not be.alias_out and a.shape == (1, 128)
    b = be.forward_decode(rand(1, 128), rand(1, 64), rand(1, 64), layer, None, pool, 1, save_kv_cache=True)
    assert b.shape == (1, 128)
    # a JAX-side KV write on that first call is refused there, not one call later
    be = TorchMHABackend(cfg)
    be.alias_out, be.kv_writer = True, "jax"
    be.init_forward_metadata(1, 0, eng.req_pool_indices, torch.tensor([3]), eng.req_to_page, ForwardMode.DECODE)
    with pytest.warns(UserWarning, match="not aliased"), pytest.raises(BridgeError, match="did not write the KV pool"):
        be.forward_decode(rand(1, 128), rand(1, 64), rand(1, 64), layer, None, pool, 1, save_kv_cache=True)


def test_example_runs():
    import pathlib
    import runpy

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "torch_bridge.py"
    mod = runpy.run_path(str(path))
    assert mod["main"]() == 0


def test_fast_path_plans_match_slow_path_and_follow_pool_moves():
    """The per-(layer, pool, signature, plan) closures give the slow path's results, write
    the pool the same way, are reused across steps of one bucket, and a moved pool buffer
    sends the call back to the slow path (re-import), never to stale memory."""
    rng = np.random.default_rng(7)
    hq, hkv, d = 4, 2, 32
    cfg, pool_a = mha_setup()
    _, pool_b = mha_setup()
    be_a, be_b = TorchMHABackend(cfg), TorchMHABackend(cfg)
    be_b.fast_path = False
    layers = [AttentionLayer(i, hq, hkv, d) for i in range(2)]
    eng = Engine(2, 16, 4, rng, cfg.num_pages)
    for step, lens in enumerate(([3, 7], [4, 8], [5, 9])):
        for be in (be_a, be_b):
            be.init_forward_metadata(
                2, 0, eng.req_pool_indices, torch.tensor(lens), eng.req_to_page, ForwardMode.DECODE
            )
        for layer in layers:
            q, k, v = rand(2, hq * d), rand(2, hkv * d), rand(2, hkv * d)
            loc = torch.tensor([eng.slots(0, lens[0] - 1, 1)[0], eng.slots(1, lens[1] - 1, 1)[0]], device=DEV)
            oa = be_a.forward_decode(q, k, v, layer, loc, pool_a, 2, save_kv_cache=True)
            ob = be_b.forward_decode(q, k, v, layer, loc, pool_b, 2, save_kv_cache=True)
            torch.testing.assert_close(oa, ob, atol=0, rtol=0)
            oa = be_a.forward_decode(q, None, None, layer, None, pool_a, 2)  # read-only signature
            ob = be_b.forward_decode(q, None, None, layer, None, pool_b, 2)
            torch.testing.assert_close(oa, ob, atol=0, rtol=0)
        if step == 0:
            plans = dict(be_a._plans)
    assert len(plans) == 4 and be_a._plans == plans  # built once, reused by later steps
    assert not be_b._plans
    for i in range(2):
        assert torch.equal(pool_a.get_key_buffer(i), pool_b.get_key_buffer(i))
        assert torch.equal(pool_a.get_value_buffer(i), pool_b.get_value_buffer(i))
    # the engine replaces layer 0's value buffer (e.g. a pool resize): the plan must notice
    for pool in (pool_a, pool_b):
        pool.v_buffer[0] = pool.v_buffer[0].clone() * 2
    q = rand(2, hq * d)
    oa = be_a.forward_decode(q, None, None, layers[0], None, pool_a, 2)
    ob = be_b.forward_decode(q, None, None, layers[0], None, pool_b, 2)
    torch.testing.assert_close(oa, ob, atol=0, rtol=0)
    key = next(k_ for k_, v_ in be_a._views.items() if k_[1:] == (0, "v"))
    assert be_a._views[key].torch.data_ptr() == pool_a.get_value_buffer(0).data_ptr()


def test_mla_chunked_prefix_cache_merge_equals_full_attention():
    """The seed's chunked-prefix path: causal attention over the new tokens, then one
    non-causal attention per cached prefix chunk (a chunk may hold 0 keys of a request),
    merged with merge_state, equals attention over prefix + new tokens."""
    torch.manual_seed(7)
    H, P, r, Vd = 2, 32, 16, 32
    cfg, be, layer = _small_mla(H, P, r, Vd)
    ext, pre, chunk = [3, 5], [10, 0], 4
    seq = [e + p for e, p in zip(ext, pre)]
    r2p = torch.arange(1, 13, dtype=torch.int32).view(2, 6)
    be.init_forward_metadata(
        2,
        2,
        torch.tensor([0, 1]),
        torch.tensor(seq),
        r2p,
        ForwardMode.EXTEND,
        extend_seq_lens=torch.tensor(ext),
        extend_prefix_lens=torch.tensor(pre),
    )
    T = sum(ext)
    q, k, v = rand(T, H * (P + r)), rand(T, H * (P + r)), rand(T, H * Vd)
    kp = [rand(p, H * (P + r)) for p in pre]  # the model's up-projected prefix K/V per request
    vp = [rand(p, H * Vd) for p in pre]
    o, lse = be.forward_extend(q, k, v, layer, save_kv_cache=False, return_lse=True)

    class Batch:
        attn_attend_prefix_cache = True

    fb = Batch()
    nchunks = -(-max(pre) // chunk)
    fb.prefix_chunk_cu_seq_lens, fb.prefix_chunk_max_seq_lens = [], []
    for c in range(nchunks):
        lens = [max(0, min(chunk, p - c * chunk)) for p in pre]
        fb.prefix_chunk_cu_seq_lens.append(torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32))
        fb.prefix_chunk_max_seq_lens.append(max(lens))
    for c in range(nchunks):
        fb.prefix_chunk_idx = c
        kc = torch.cat([kp[b][c * chunk : (c + 1) * chunk] for b in range(2)])
        vc = torch.cat([vp[b][c * chunk : (c + 1) * chunk] for b in range(2)])
        oc, lc = be.forward_extend(q, kc, vc, layer, forward_batch=fb, save_kv_cache=False)
        assert oc.shape == (T, H * Vd) and lc.shape == (T, H)
        if c * chunk >= pre[1]:  # request 1 has no keys in this chunk: zero-KV rows
            assert torch.all(oc[ext[0] :] == 0) and torch.all(torch.isneginf(lc[ext[0] :]))
        o, lse = be.merge_state(o, lse, oc, lc)
    row = 0
    for b, n in enumerate(ext):
        qq = q[row : row + n].view(n, H, P + r).float().cpu()
        kk = torch.cat([kp[b], k[row : row + n]]).view(-1, H, P + r).float().cpu()
        vv = torch.cat([vp[b], v[row : row + n]]).view(-1, H, Vd).float().cpu()
        exp = ref_attention(qq, kk, vv, n_new=n, scale=cfg.softmax_scale)
        torch.testing.assert_close(o[row : row + n].float().cpu().view(n, H, Vd), exp, atol=3e-2, rtol=3e-2)
        row += n


def test_bridge_holds_no_attention_semantics():
    """The adapters call the core backends: no bridge module imports the ops, the
    reference, the planners' privates or any private name of the core."""
    import ast
    import pathlib

    import jattn.bridge

    root = pathlib.Path(jattn.bridge.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jattn"):
                assert node.module not in ("jattn.ops", "jattn.reference"), (path.name, node.module)
                bad = [a.name for a in node.names if a.name.startswith("_")]
                assert not bad, (path.name, node.module, bad)
            if isinstance(node, ast.ImportFrom) and node.module is None and node.level == 0:
                continue
            if isinstance(node, ast.Import):
                assert not any(a.name in ("jattn.ops", "jattn.reference") for a in node.names), path.name


def test_bridge_cuda_graph_helpers_and_draft_block_fill():
    """The upstream CUDA-graph helpers come from the core; fill_block_decode_seq_lens
    refills the installed DFLASH plan and the next call attends over the new lengths."""
    cfg = MHAConfig(
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        context_len=32,
        num_pages=24,
        kv_cache_dtype="float32",
        dtype="float32",
        spec_num_tokens=2,
        kernel_backend="xla",
        batch_buckets=(2,),
    )
    be = TorchMHABackend(cfg)
    assert be.get_cuda_graph_seq_len_fill_value() == 0
    assert be.get_verify_buffers_to_fill_after_draft() == [None, None]
    assert be.support_kv_cache_prewrite(ForwardMode.DRAFT_BLOCK)
    assert not be.support_kv_cache_prewrite(DRAFT_EXTEND)
    g = torch.Generator().manual_seed(3)
    pool = TorchKVPool(
        num_layers=1, num_pages=24, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device=DEV
    )
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=g))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=g))
    layer = AttentionLayer(0, 4, 2, 16, non_causal=True)
    r2p = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]], dtype=torch.int32)
    q = torch.randn(4, 64, generator=g).to(DEV)
    be.init_forward_metadata(2, 0, torch.tensor([0, 1]), torch.tensor([6, 9]), r2p, ForwardMode.DRAFT_BLOCK)
    be.fill_block_decode_seq_lens(2, torch.tensor([21, 4]))
    filled = be.forward_decode(q, None, None, layer, None, pool, 2).clone()
    be.init_forward_metadata(2, 0, torch.tensor([0, 1]), torch.tensor([21, 4]), r2p, ForwardMode.DRAFT_BLOCK)
    fresh = be.forward_decode(q, None, None, layer, None, pool, 2)
    torch.testing.assert_close(filled, fresh, rtol=0, atol=0)
    be.init_forward_metadata(2, 0, torch.tensor([0, 1]), torch.tensor([6, 9]), r2p, ForwardMode.DRAFT_BLOCK)
    fresh = fresh.clone()  # on the GPU the output is a view the layer's next call overwrites
    old = be.forward_decode(q, None, None, layer, None, pool, 2)
    assert not torch.equal(old, fresh)


def test_unsupported_planning_inputs_are_refused():
    """tokenspeed's flat per-group cache tables are not supported: refused, never ignored."""
    be = TorchMHABackend(MHAConfig(num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4, kernel_backend="xla"))
    with pytest.raises(NotImplementedError, match=r"flat_block_tables"):
        be.init_forward_metadata(
            1,
            0,
            torch.tensor([0]),
            torch.tensor([3]),
            torch.tensor([[1]]),
            ForwardMode.DECODE,
            flat_block_tables={"full": torch.tensor([[1]])},
        )


def test_mla_full_width_query_without_q_rope():
    """The documented full-width absorbed query ([T, H * (R + r)], q_rope=None) equals the
    split form (q_nope with q_rope)."""
    be, pool, layer, H, R, r = _tiny_mla()
    g = torch.Generator().manual_seed(5)
    pool.kv_buffer[0].copy_(torch.randn(pool.kv_buffer[0].shape, generator=g))
    decode = functools.partial(be.forward_decode, token_to_kv_pool=pool)
    q_nope, q_rope = torch.randn(2, H, R, generator=g).to(DEV), torch.randn(2, H, r, generator=g).to(DEV)
    split = decode(q_nope.reshape(2, -1), None, None, layer, save_kv_cache=False, q_rope=q_rope.reshape(2, -1)).clone()
    full = decode(torch.cat([q_nope, q_rope], -1).reshape(2, -1), None, None, layer, save_kv_cache=False)
    torch.testing.assert_close(full, split, rtol=0, atol=0)
    assert split.abs().sum() > 0


def test_mla_llama_4_scaling_and_fused_rope():
    """``llama_4_scaling`` ([T, 1, 1]) equals the call on q and q_rope scaled per token by
    hand; ``cos_sin_cache`` (fused rope) is refused by name."""
    be, pool, layer, H, R, r = _tiny_mla()
    g = torch.Generator().manual_seed(7)
    pool.kv_buffer[0].copy_(torch.randn(pool.kv_buffer[0].shape, generator=g))
    decode = functools.partial(be.forward_decode, token_to_kv_pool=pool)
    q_nope = torch.randn(2, H * R, generator=g).to(DEV)
    q_rope = torch.randn(2, H * r, generator=g).to(DEV)
    s = torch.tensor([[[0.5]], [[2.5]]]).to(DEV)
    got = decode(q_nope, None, None, layer, save_kv_cache=False, q_rope=q_rope, llama_4_scaling=s).clone()
    want = decode(
        q_nope * s.reshape(2, 1), None, None, layer, save_kv_cache=False, q_rope=q_rope * s.reshape(2, 1)
    ).clone()
    plain = decode(q_nope, None, None, layer, save_kv_cache=False, q_rope=q_rope).clone()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, plain, atol=1e-3), "the scaling changed nothing"
    with pytest.raises(ValueError, match="llama_4_scaling shape"):
        decode(q_nope, None, None, layer, save_kv_cache=False, q_rope=q_rope, llama_4_scaling=s[:1])
    with pytest.raises(ValueError, match="cos_sin_cache is 4 wide"):
        decode(q_nope, None, None, layer, save_kv_cache=False, q_rope=q_rope, cos_sin_cache=torch.ones(16, 4))


def _np_pool(buf, ps):
    """A torch latent pool buffer as numpy [pages, page_size, width] (FP8 through its bytes)."""
    if buf.dtype == torch.float8_e4m3fn:
        a = buf.cpu().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    else:
        a = buf.cpu().numpy()
    return a.reshape(-1, ps, a.shape[-1])


@pytest.mark.parametrize(
    "kv_dtype,mode,is_neox",
    [
        (torch.float8_e4m3fn, ForwardMode.DECODE, False),
        (torch.float8_e4m3fn, DRAFT_EXTEND, True),
        (torch.float32, ForwardMode.TARGET_VERIFY, False),
    ],
)
def test_mla_fused_rope_and_fp8_query_match_the_core(kv_dtype, mode, is_neox):
    """``cos_sin_cache`` through the bridge (unrotated q_rope / k_rope, the pool's own
    writer on the CPU): the output and the pool afterwards equal the core MLABackend's
    fused call on the same plan and inputs (rope at the plan's positions; on FP8 the
    query quantised, llama_4_scaling after it)."""
    from jattn import MLABackend, MLAKVCache

    g = torch.Generator().manual_seed(13)
    H, R, r, ps, pages = 2, 16, 8, 4, 12
    fp8 = kv_dtype == torch.float8_e4m3fn
    cfg = MLAConfig(
        num_heads=H,
        kv_lora_rank=R,
        qk_nope_head_dim=8,
        qk_rope_head_dim=r,
        v_head_dim=8,
        page_size=ps,
        context_len=24,
        num_pages=pages,
        dtype="float32",
        kv_cache_dtype="float8_e4m3fn" if fp8 else "float32",
        spec_num_tokens=2,
        kernel_backend="xla",
    )
    pool = TorchMLAKVPool(
        num_layers=1, num_pages=pages, page_size=ps, kv_lora_rank=R, qk_rope_head_dim=r, dtype=kv_dtype, device=DEV
    )
    pool.kv_buffer[0].copy_((torch.randn(pool.kv_buffer[0].shape, generator=g) * 2).to(kv_dtype).to(DEV))
    before = _np_pool(pool.kv_buffer[0], ps).copy()
    layer = AttentionLayer(0, H, 1, R + r, v_head_dim=R, k_scale=0.5 if fp8 else None)
    be = TorchMLABackend(cfg, pool)
    r2p = torch.tensor([[1, 2, 3, 0, 0, 0], [4, 5, 0, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([11, 6])
    news = torch.tensor({ForwardMode.DECODE: [1, 1], ForwardMode.TARGET_VERIFY: [2, 2]}.get(mode, [3, 1]))
    plan = dict(extend_seq_lens=news)
    be.init_forward_metadata(2, 0, torch.tensor([0, 1]), lens, r2p, mode, **plan)
    n = int(news.sum())
    q = torch.randn(n, H * R, generator=g) * 50  # past 448 somewhere: clamped on FP8
    qr, c, kp = torch.randn(n, H * r, generator=g), torch.randn(n, R, generator=g), torch.randn(n, r, generator=g)
    s = torch.rand(n, 1, 1, generator=g) + 0.5
    ang = torch.arange(24.0)[:, None] / 10000 ** (torch.arange(0, r, 2) / r)
    cs = torch.cat([ang.cos(), ang.sin()], -1)
    fwd = be.forward_decode if mode is ForwardMode.DECODE else be.forward_extend
    dev = [x.to(DEV) for x in (q, qr, c, kp, cs, s)]
    kw = dict(q_rope=dev[1], k_rope=dev[3], cos_sin_cache=dev[4], is_neox=is_neox, llama_4_scaling=dev[5])
    out = fwd(dev[0], dev[2], None, layer, None, save_kv_cache=True, **kw).cpu().clone()
    # the core on the same plan, inputs and pool
    core = MLABackend(cfg)
    md = core.init_forward_metadata(2, np.arange(2), lens.numpy(), r2p.numpy(), mode, extend_seq_lens=news.numpy())
    t = md.num_tokens

    def pad(x, *shape):
        return jnp.pad(jnp.asarray(x.numpy()), ((0, t - n), (0, 0))).reshape(t, *shape)

    cache = MLAKVCache(kv=(jnp.asarray(before),), kv_lora_rank=R)
    want, cache = core.forward_absorbed(
        pad(q, H, R),
        pad(c, R),
        None,
        layer_spec(layer),
        cache,
        md,
        q_rope=pad(qr, H, r),
        k_rope=pad(kp, r),
        cos_sin_cache=jnp.asarray(cs.numpy()),
        is_neox=is_neox,
        llama_4_scaling=jnp.pad(jnp.asarray(s.numpy().reshape(-1)), (0, t - n), constant_values=1.0),
    )
    np.testing.assert_allclose(out.numpy(), np.asarray(want)[:n], rtol=1e-5, atol=1e-5)
    after = _np_pool(pool.kv_buffer[0], ps).astype(np.float32)
    core_pool = np.asarray(cache.kv[0]).astype(np.float32)
    real = np.ones(pages, bool)
    real[0] = False  # the dummy page takes the core's padding-row writes
    np.testing.assert_allclose(after[real], core_pool[real], rtol=1e-6, atol=1e-6)  # FP8: equal
    assert not np.array_equal(after, before.astype(np.float32)), "nothing was written"


# ----------------------------------------------------------------------------- parameters, pools, bounds


_R2P = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)


def _decode_fixture(seed=0, num_pages=16, layers=1):
    """A 2-request decode plan over a bf16 pool (4/2 heads x 32, page 4) holding random
    values in the requests' slots and NaN everywhere else; returns the backend, the pool,
    the layers, q and a generator."""
    g = torch.Generator().manual_seed(seed)
    cfg, pool = mha_setup(num_pages=num_pages, layers=layers)
    slots = torch.tensor([int(_R2P[b, t // 4]) * 4 + t % 4 for b, n in enumerate((9, 5)) for t in range(n)])
    for b in pool.k_buffer + pool.v_buffer:
        b.fill_(float("nan"))
        b[slots.to(b.device)] = torch.randn((len(slots),) + tuple(b.shape[1:]), generator=g).to(b.dtype).to(b.device)
    be = TorchMHABackend(cfg)
    be.init_forward_metadata(2, 0, torch.tensor([0, 1]), torch.tensor([9, 5]), _R2P, ForwardMode.DECODE)
    q = torch.randn(2, 128, generator=g).to(torch.bfloat16).to(DEV)
    return be, pool, [AttentionLayer(i, 4, 2, 32) for i in range(layers)], q, g


def _decode_ref(pool, q, sinks, layer_id=0):
    """The torch reference of :func:`_decode_fixture`'s decode with ``sinks``."""
    out = []
    for b, L in enumerate((9, 5)):
        K = gather(pool.k_buffer[layer_id], _R2P[b].tolist(), L, 4)
        V = gather(pool.v_buffer[layer_id], _R2P[b].tolist(), L, 4)
        qb = q[b : b + 1].float().cpu().view(1, 4, 32)
        out.append(ref_attention(qb, K, V, n_new=1, sinks=None if sinks is None else sinks.float().cpu()))
    return torch.cat(out).view(2, 128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fresh_sinks_each_call_are_read_each_call(dtype):
    """New sinks values at an address the bridge has seen before: every output follows the
    sinks passed (the bridge once kept a copy per data pointer and returned stale results).
    Half the calls rewrite one tensor in place (the same address for certain); the other
    half pass a fresh tensor, the previous one deleted so the allocator may reuse its
    address."""
    be, pool, (layer,), q, g = _decode_fixture()
    fixed = torch.empty(4, dtype=dtype, device=DEV)
    for i in range(30):
        new = (torch.randn(4, generator=g) * 3).to(dtype).to(DEV)
        sinks = fixed.copy_(new) if i % 2 else new
        out = be.forward_decode(q, None, None, layer, None, pool, 2, sinks=sinks)
        torch.testing.assert_close(out.float().cpu(), _decode_ref(pool, q, sinks), atol=2e-2, rtol=2e-2)
        del sinks, new, out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sinks_changed_in_place_are_seen(dtype):
    """An in-place change of the sinks tensor (its version counter moves) reaches the
    next call, on the fast path too."""
    be, pool, (layer,), q, g = _decode_fixture(1)
    sinks = torch.randn(4, generator=g).to(dtype).to(DEV)
    call = lambda: be.forward_decode(q, None, None, layer, None, pool, 2, sinks=sinks).float().cpu().clone()  # noqa: E731
    a = call()
    torch.testing.assert_close(call(), a, atol=0, rtol=0)  # the second call runs the plan
    sinks.add_(1)
    b = call()
    torch.testing.assert_close(b, _decode_ref(pool, q, sinks), atol=2e-2, rtol=2e-2)
    assert (b - a).abs().max() > 0.05
    sinks[1:3] = -4.0
    torch.testing.assert_close(call(), _decode_ref(pool, q, sinks), atol=2e-2, rtol=2e-2)


def test_sinks_made_under_inference_mode_are_read_each_call():
    """An inference-mode tensor has no version counter: the bridge re-reads it on every
    call (in or out of inference mode) instead of failing on ``_version``."""
    be, pool, (layer,), q, g = _decode_fixture(2)
    with torch.inference_mode():
        sinks = torch.randn(4, generator=g).to(DEV)
    out = be.forward_decode(q, None, None, layer, None, pool, 2, sinks=sinks)
    torch.testing.assert_close(out.float().cpu(), _decode_ref(pool, q, sinks), atol=2e-2, rtol=2e-2)
    with torch.inference_mode():
        sinks.add_(2.0)  # an in-place change no version counter records
        out = be.forward_decode(q, None, None, layer, None, pool, 2, sinks=sinks)
    torch.testing.assert_close(out.float().cpu(), _decode_ref(pool, q, sinks), atol=2e-2, rtol=2e-2)


def test_num_pages_of_init_forward_metadata_reaches_the_plan():
    """With ``config.num_pages`` None the engine passes the pool's page count per step."""
    cfg = MHAConfig(num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4, context_len=64, kernel_backend="xla")
    pool = TorchKVPool(num_layers=1, num_pages=64, page_size=4, num_kv_heads=2, head_dim=32, device=DEV)
    be = TorchMHABackend(cfg)
    r2p = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    be.init_forward_metadata(2, 0, torch.tensor([1, 2]), torch.tensor([3, 7]), r2p, ForwardMode.DECODE)
    assert be.forward_metadata.num_pages is None
    kw = dict(num_pages=pool.num_pages)
    be.init_forward_metadata(2, 0, torch.tensor([1, 2]), torch.tensor([3, 7]), r2p, ForwardMode.DECODE, **kw)
    assert be.forward_metadata.num_pages == pool.num_pages
    out = be.forward_decode(rand(2, 128), rand(2, 64), rand(2, 64), AttentionLayer(0, 4, 2, 32), None, pool, 2)
    assert torch.isfinite(out).all()
    be.init_cuda_graph_state(2)
    assert be.init_forward_metadata_capture_cuda_graph(2, **kw).num_pages == pool.num_pages


def test_fp8_pool_write_saturates_and_matches_the_reference_bits():
    """``TorchKVPool.set_kv_buffer`` on an FP8 pool: values past ``448 * scale`` are stored as
    +-448 (not NaN, not wrapped), NaN as NaN, and every byte equals the JAX reference's
    quantisation at the same scale."""
    from jattn import reference

    pool = TorchKVPool(
        num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float8_e4m3fn, device=DEV
    )
    k = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(5)) * 40
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 300.0, -225.0])  # all past 448 * 0.5 = 224
    k[1, 0, 0] = float("nan")
    loc = torch.tensor([5, 9, 2], dtype=torch.int32)
    pool.set_kv_buffer(AttentionLayer(0, 1, 1, 8), loc.to(DEV), k.to(DEV), k.to(DEV), k_scale=0.5, v_scale=0.25)
    for buf, scale in ((pool.k_buffer[0], 0.5), (pool.v_buffer[0], 0.25)):
        got = buf[loc.long().to(DEV)].float().cpu()
        want = reference.quantize_fp8(jnp.asarray(k.numpy()), scale)
        np.testing.assert_array_equal(got.numpy(), np.asarray(want, np.float32))
    assert pool.k_buffer[0][5, 0, :4].float().cpu().tolist() == [448.0, -448.0, 448.0, -448.0]


def test_f32_sinks_are_copied_not_aliased():
    """The bridge reads f32 sinks into a copy of its own (as it does bf16 ones): no memory
    shared with the caller's tensor, which it does not keep alive; a write the version
    counter does not see (through ``.data``) does not reach that copy."""
    import gc
    import weakref

    be, pool, (layer,), q, g = _decode_fixture(2)
    sinks = torch.randn(4, generator=g, dtype=torch.float32).to(DEV)
    a = be.forward_decode(q, None, None, layer, None, pool, 2, sinks=sinks).clone()
    (p,) = be._params.values()
    assert p.array.unsafe_buffer_pointer() != sinks.data_ptr()
    sinks.data.add_(5.0)  # bypasses the version counter: the copy stays what was read
    torch.testing.assert_close(be.forward_decode(q, None, None, layer, None, pool, 2, sinks=sinks), a, atol=0, rtol=0)
    ref = weakref.ref(sinks)
    del sinks
    gc.collect()
    assert ref() is None and not be._params


def test_fresh_sinks_tensors_leave_every_cache_bounded():
    """``sinks=param.float()`` on every call (a new tensor each time): 300 calls add no
    cache entries (once one per call, each pinning a tensor)."""
    be, pool, (layer,), q, g = _decode_fixture(3)
    param = torch.randn(4, generator=g).to(torch.bfloat16).to(DEV)
    for _ in range(300):
        out = be.forward_decode(q, None, None, layer, None, pool, 2, sinks=param.float())
    torch.testing.assert_close(out.float().cpu(), _decode_ref(pool, q, param), atol=2e-2, rtol=2e-2)
    assert len(be._params) <= 1 and len(be._plans) == 1
    sizes = be._cache_sizes()
    assert sizes["views"] == 2 and sizes["pools"] == 1, sizes


def test_cache_bounds_drop_the_oldest_entries_and_rebuild_them():
    """With bounds below the working set (6 layers, 3 plans and 4 views per pool, 2 specs)
    every cache stays within its bound and the outputs equal the unbounded slow path's."""
    be, pool, layers, q, g = _decode_fixture(4, layers=6)
    be.cache_bounds.update(plans=3, views=4)
    be._specs.maxsize = 2
    ref, pool_r, _, _, _ = _decode_fixture(4, layers=6)
    ref.fast_path = False
    for step in range(3):
        for layer in layers:
            a = be.forward_decode(q, None, None, layer, None, pool, 2)
            b = ref.forward_decode(q, None, None, layer, None, pool_r, 2)
            torch.testing.assert_close(a, b, atol=0, rtol=0)
            sizes = be._cache_sizes()
            assert sizes["plans"] <= 3 and sizes["views"] <= 4 and sizes["specs"] <= 2, sizes
    torch.testing.assert_close(a.float().cpu(), _decode_ref(pool, q, None, 5), atol=2e-2, rtol=2e-2)


def test_mha_pools_are_held_weakly():
    """A pool the engine drops is freed (buffers included) once its plans exist; the
    backend forgets its views and plans and goes on with a new pool."""
    import gc
    import weakref

    be, pool, (layer,), q, g = _decode_fixture(5)
    k = torch.randn(2, 64, generator=g).to(torch.bfloat16).to(DEV)
    for _ in range(2):  # slow path, then the plan
        be.forward_decode(q, k, k, layer, None, pool, 2, save_kv_cache=True)
        be.forward_decode(q, None, None, layer, None, pool, 2)
    assert len(be._plans) == 2
    pool_ref, buf_ref = weakref.ref(pool), weakref.ref(pool.k_buffer[0])
    del pool
    gc.collect()
    assert pool_ref() is None and buf_ref() is None
    sizes = be._cache_sizes()
    assert sizes["pools"] == sizes["views"] == sizes["plans"] == 0, sizes
    _, pool2 = mha_setup(num_pages=16, layers=1)
    out = be.forward_decode(q, None, None, layer, None, pool2, 2)
    torch.testing.assert_close(out.float().cpu(), _decode_ref(pool2, q, None), atol=2e-2, rtol=2e-2)


def _tiny_mla(pool_pages=8, pool_rank=16):
    """A tiny f32 MLA config (R 16, rope 8, 8 pages of 4), a backend bound to no pool,
    its absorbed layer, a decode plan of 2 requests, and a pool (``pool_pages`` pages,
    rank ``pool_rank``)."""
    H, R, r, ps = 2, 16, 8, 4
    cfg = MLAConfig(
        num_heads=H,
        kv_lora_rank=R,
        qk_nope_head_dim=8,
        qk_rope_head_dim=r,
        v_head_dim=8,
        page_size=ps,
        context_len=16,
        num_pages=8,
        dtype="float32",
        kv_cache_dtype="float32",
        kernel_backend="xla",
    )
    pool = TorchMLAKVPool(
        num_layers=1,
        num_pages=pool_pages,
        page_size=ps,
        kv_lora_rank=pool_rank,
        qk_rope_head_dim=r,
        dtype=torch.float32,
        device=DEV,
    )
    be = TorchMLABackend(cfg)
    r2p = torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0]], dtype=torch.int32)
    be.init_forward_metadata(2, 0, torch.tensor([0, 1]), torch.tensor([6, 3]), r2p, ForwardMode.DECODE)
    layer = AttentionLayer(0, H, 1, R + r, v_head_dim=R, scaling=0.3)
    return be, pool, layer, H, R, r


def test_mla_pools_are_held_weakly():
    import gc
    import weakref

    be, pool, layer, H, R, r = _tiny_mla()
    q, c, kr = torch.randn(2, H * (R + r)).to(DEV), torch.randn(2, R).to(DEV), torch.randn(2, r).to(DEV)
    be.forward_decode(q, c, None, layer, save_kv_cache=True, k_rope=kr, token_to_kv_pool=pool)
    assert len(be._views) == 1
    pool_ref, buf_ref = weakref.ref(pool), weakref.ref(pool.kv_buffer[0])
    del pool
    jax.effects_barrier()
    for _ in range(100):  # JAX drops its DLPack import once work still in flight on it is done
        gc.collect()
        if buf_ref() is None:
            break
        time.sleep(0.01)
    assert pool_ref() is None and buf_ref() is None
    sizes = be._cache_sizes()
    assert sizes["pools"] == sizes["views"] == 0, sizes


@pytest.mark.parametrize("save_kv_cache", [False, True])
def test_mha_pool_with_fewer_pages_than_config_is_refused(save_kv_cache):
    """Once clamped garbage (read-only) or an IndexError from index_copy_ (torch writer)."""
    be, _, (layer,), q, g = _decode_fixture(6)
    _, small = mha_setup(num_pages=8, layers=1)
    k = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(BridgeError, match=r"TorchKVPool: k_buffer\[layer 0\] has 8 pages, config.num_pages=16"):
        be.forward_decode(q, k, k, layer, None, small, 2, save_kv_cache=save_kv_cache)
    assert torch.all(small.k_buffer[0] == 0)  # nothing written before the refusal


def test_mha_layer_that_does_not_match_the_pool_is_refused():
    """Heads or head dims of a layer that differ from its pool buffers: a clear error,
    also where a reshape would have succeeded silently (4 x 16 over 2 x 32)."""
    be, pool, _, _, _ = _decode_fixture(7)
    cases = [
        (AttentionLayer(0, 8, 4, 32), r"k_buffer\[layer 0\] .*layer 0 has 4 KV heads x 32, the pool has 2 x 32"),
        (AttentionLayer(0, 4, 4, 16), r"k_buffer\[layer 0\] .*layer 0 has 4 KV heads x 16, the pool has 2 x 32"),
        (
            AttentionLayer(0, 4, 2, 32, v_head_dim=16),
            r"v_buffer\[layer 0\] .*layer 0 has 2 KV heads x 16, the pool has 2 x 32",
        ),
    ]
    for layer, msg in cases:
        q = torch.zeros(2, layer.tp_q_head_num * layer.qk_head_dim, dtype=torch.bfloat16, device=DEV)
        with pytest.raises(BridgeError, match=msg):
            be.forward_decode(q, None, None, layer, None, pool, 2)


def test_pool_page_size_that_differs_from_config_is_refused():
    be, _, (layer,), q, _ = _decode_fixture(8)
    pool = TorchKVPool(num_layers=1, num_pages=8, page_size=8, num_kv_heads=2, head_dim=32, device=DEV)
    with pytest.raises(BridgeError, match=r"page_size=8, config.page_size=4"):
        be.forward_decode(q, None, None, layer, None, pool, 2)


@pytest.mark.parametrize("save_kv_cache", [False, True])
def test_mla_pool_with_fewer_pages_or_another_width_is_refused(save_kv_cache):
    be, small, layer, H, R, r = _tiny_mla(pool_pages=4)
    q, c, kr = torch.randn(2, H * (R + r)).to(DEV), torch.randn(2, R).to(DEV), torch.randn(2, r).to(DEV)
    kw = dict(save_kv_cache=save_kv_cache, k_rope=kr)
    with pytest.raises(BridgeError, match=r"kv_buffer\[layer 0\] has 4 pages, config.num_pages=8"):
        be.forward_decode(q, c, None, layer, token_to_kv_pool=small, **kw)
    _, wide, *_ = _tiny_mla(pool_rank=32)
    with pytest.raises(
        BridgeError,
        match=r"kv_buffer\[layer 0\] .*40 wide per slot, config needs kv_lora_rank \+ "
        r"qk_rope_head_dim = 16 \+ 8 = 24",
    ):
        be.forward_decode(q, c, None, layer, token_to_kv_pool=wide, **kw)


# ----------------------------------------------------------------------------- input checks


def _mha_kv(n, g):
    return [torch.randn(n, w, generator=g).to(torch.bfloat16).to(DEV) for w in (128, 64, 64)]


def test_rows_that_differ_from_the_plan_are_refused():
    """q/k/v rows other than the plan's new tokens (or its bucket's rows) would leave a
    request silently uncomputed; refused on the slow path, the hot path, MLA, extend and
    capture plans alike."""
    cfg, pool = mha_setup(batch_buckets=(4,))
    be = TorchMHABackend(cfg)
    layer = AttentionLayer(0, 4, 2, 32)
    g = torch.Generator().manual_seed(0)
    r2p = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)
    be.init_forward_metadata(3, 0, torch.tensor([0, 1, 2]), torch.tensor([9, 5, 3]), r2p, ForwardMode.DECODE)
    q, k, v = _mha_kv(3, g)
    for _ in range(2):  # the second call runs the hot-path plan of this signature
        be.forward_decode(q, k, v, layer, None, pool, 3, save_kv_cache=True)
    assert be._plans
    # same bucket (4 rows), 2 requests: the hot-path plan's key matches 3 rows, still refused
    be.init_forward_metadata(2, 0, torch.tensor([0, 1]), torch.tensor([10, 6]), r2p, ForwardMode.DECODE)
    msg = r"q has 3 rows; the installed plan has 2 new tokens \(bs \* q_len = 2 \* 1\); its bucket has 4 rows"
    with pytest.raises(BridgeError, match=msg):
        be.forward_decode(q, k, v, layer, None, pool, 2, save_kv_cache=True)
    with pytest.raises(BridgeError, match=r"q has 1 rows; the installed plan has 2 new tokens"):
        be.forward_decode(q[:1], k[:1], v[:1], layer, None, pool, 2, save_kv_cache=True)
    assert be.forward_decode(q[:2], k[:2], v[:2], layer, None, pool, 2, save_kv_cache=True).shape == (2, 128)
    q4, k4, v4 = _mha_kv(4, g)  # the bucket's rows, padding included
    assert be.forward_decode(q4, k4, v4, layer, None, pool, 2, save_kv_cache=True).shape == (4, 128)
    # extend: sum(extend_seq_lens)
    be.init_forward_metadata(
        2, 2, torch.tensor([0, 1]), torch.tensor([3, 2]), r2p, ForwardMode.EXTEND, extend_seq_lens=torch.tensor([3, 2])
    )
    q, k, v = _mha_kv(4, g)
    with pytest.raises(BridgeError, match=r"q has 4 rows; the installed plan has 5 new tokens \(sum\(extend_seq_lens"):
        be.forward_extend(q, k, v, layer, None, pool, 2, save_kv_cache=True)
    # a capture plan: its bucket's rows only
    be.init_forward_metadata_capture_cuda_graph(4)
    q, k, v = _mha_kv(3, g)
    with pytest.raises(
        BridgeError, match=r"q has 3 rows; the installed plan is an all-padding capture plan of bucket 4"
    ):
        be.forward_decode(q, k, v, layer, None, pool, 4, save_kv_cache=True)
    # MLA (decode plan of 2 requests)
    mla, mpool, mlayer, H, R, r = _tiny_mla()
    qm, c, kr = torch.randn(1, H * (R + r)).to(DEV), torch.randn(1, R).to(DEV), torch.randn(1, r).to(DEV)
    with pytest.raises(BridgeError, match=r"q has 1 rows; the installed plan has 2 new tokens"):
        mla.forward_decode(qm, c, None, mlayer, save_kv_cache=True, k_rope=kr, token_to_kv_pool=mpool)


def test_input_shapes_are_checked():
    """A q/k/v (MLA: q, q_rope, c_kv, k_rope, prefill v) of the wrong width or rows: a
    message naming the input and its layout, not torch's reshape error."""
    be, pool, (layer,), q, g = _decode_fixture(9)
    _, k, v = _mha_kv(2, g)
    cases = [
        (
            (q[:, :48], k, v),
            r"q must be \[tokens, tp_q_head_num \* head_dim\] = \[2, 128\] or \[2, 4, 32\], got \(2, 48\)",
        ),
        ((q, k[:, :32], v), r"k must be \[tokens, tp_k_head_num \* head_dim\] \(q's tokens\) = \[2, 64\]"),
        ((q, k, torch.cat([v, v])), r"v must be .* = \[2, 64\] or \[2, 2, 32\], got \(4, 64\)"),
        ((q.view(2, 4, 32), k.view(2, 2, 32), v.view(2, 4, 16)), r"v must be .*got \(2, 4, 16\)"),
    ]
    for args, msg in cases:
        with pytest.raises(BridgeError, match=msg):
            be.forward_decode(*args, layer, None, pool, 2, save_kv_cache=True)
    assert be.forward_decode(q.view(2, 4, 32), k.view(2, 2, 32), v, layer, None, pool, 2).shape == (2, 128)
    mla, mpool, mlayer, H, R, r = _tiny_mla()
    q, qr, c, kr = (torch.randn(2, w).to(DEV) for w in (H * R, H * r, R, r))
    kw = dict(save_kv_cache=True, token_to_kv_pool=mpool)
    cases = [
        (dict(q=q[:, :20], k=c, q_rope=qr, k_rope=kr), r"q must be \[tokens, H \* kv_lora_rank\] \(with q_rope\)"),
        (
            dict(q=q, k=c, q_rope=None, k_rope=kr),
            r"q must be .*\(q_rope=None\) = \[2, 48\] or \[2, 2, 24\], got \(2, 32\)",
        ),
        (dict(q=q, k=c, q_rope=qr[:, :8], k_rope=kr), r"q_rope must be \[tokens, H \* qk_rope_head_dim\]"),
        (dict(q=q, k=c[:, :8], q_rope=qr, k_rope=kr), r"k must be c_kv \[tokens, kv_lora_rank\] .* = \[2, 16\]"),
        (dict(q=q, k=c, q_rope=qr, k_rope=kr[:1]), r"k_rope must be .* = \[2, 8\] or \[2, 1, 8\], got \(1, 8\)"),
    ]
    for a, msg in cases:
        with pytest.raises(BridgeError, match=msg):
            mla.forward_decode(a["q"], a["k"], None, mlayer, q_rope=a["q_rope"], k_rope=a["k_rope"], **kw)
    # the ragged prefill
    H, P, rr, Vd = 2, 32, 16, 32
    _, pbe, player = _small_mla(H, P, rr, Vd)
    pbe.init_forward_metadata(
        1,
        1,
        torch.tensor([0]),
        torch.tensor([3]),
        torch.tensor([[1, 2]], dtype=torch.int32),
        ForwardMode.EXTEND,
        extend_seq_lens=torch.tensor([3]),
    )
    qn, qr, kn, kr, v = rand(3, H * P), rand(3, H * rr), rand(3, H * P), rand(3, rr), rand(3, H * Vd)
    with pytest.raises(BridgeError, match=r"v must be \[tokens, H \* v_head_dim\] \(q's tokens\) = \[3, 64\]"):
        pbe.forward_extend(qn, kn, v[:, :40], player, save_kv_cache=False, q_rope=qr, k_rope=kr)
    with pytest.raises(BridgeError, match=r"k must be \[tokens, H \* \(qk_nope_head_dim \+ qk_rope_head_dim\)\]"):
        pbe.forward_extend(qn, kn, v, player, save_kv_cache=False, q_rope=qr)


def test_input_dtypes_and_sinks_shape_are_checked():
    """An integer, bool or f64 k/v (MLA: c_kv, k_rope, q_rope, prefill v) is refused naming
    it before the pool's writer casts it into the pool (decode with the torch writer wrote 7
    and 1.0 where an int32 k and a bool v were given), while a k/v of another float dtype
    than q is still written there as before; a sinks of another length than the query heads
    is refused on the slow path naming it (the native path broadcast one value over every
    head)."""
    be, pool, (layer,), q, g = _decode_fixture(9)
    _, k, v = _mha_kv(2, g)
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    cases = [
        ((q, k.to(torch.int32), v), {}, TypeError, r"k\.dtype=torch\.int32 must be a floating dtype"),
        ((q, k, v.bool()), {}, TypeError, r"v\.dtype=torch\.bool must be a floating dtype"),
        ((q, k.double(), v), {}, TypeError, r"k\.dtype=torch\.float64 must be a floating dtype"),
        ((q, k, v), dict(sinks=torch.zeros(1)), BridgeError, r"sinks must have shape \(4,\) \(one per query head\)"),
    ]  # fmt: skip
    for args, kw, err, msg in cases:
        with pytest.raises(err, match=msg):
            be.forward_decode(*args, layer, None, pool, 2, save_kv_cache=True, **kw)
    for a, b in zip(before, pool.k_buffer + pool.v_buffer):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), "a refused call wrote"
    other = torch.float32 if q.dtype != torch.float32 else torch.float16
    out = be.forward_decode(q, k.to(other), v.to(other), layer, None, pool, 2, save_kv_cache=True)  # the writer casts
    assert out.shape == (2, 128) and torch.isfinite(out).all()
    mla, mpool, mlayer, H, R, r = _tiny_mla()
    q, qr, c, kr = (torch.randn(2, w).to(DEV) for w in (H * R, H * r, R, r))
    kw = dict(save_kv_cache=True, token_to_kv_pool=mpool)
    for a, name in (
        (dict(q=q, k=c.to(torch.int32), q_rope=qr, k_rope=kr), "k"),
        (dict(q=q, k=c, q_rope=qr, k_rope=kr.bool()), "k_rope"),
        (dict(q=q, k=c, q_rope=qr.to(torch.int64), k_rope=kr), "q_rope"),
    ):
        with pytest.raises(TypeError, match=rf"{name}\.dtype=torch\.\w+ must be a floating dtype"):
            mla.forward_decode(a["q"], a["k"], None, mlayer, q_rope=a["q_rope"], k_rope=a["k_rope"], **kw)
    H, P, rr, Vd = 2, 32, 16, 32
    _, pbe, player = _small_mla(H, P, rr, Vd)
    pbe.init_forward_metadata(
        1, 1, torch.tensor([0]), torch.tensor([3]), torch.tensor([[1, 2]], dtype=torch.int32), ForwardMode.EXTEND,
        extend_seq_lens=torch.tensor([3]),
    )  # fmt: skip
    qn, qr, kn, kr, v = rand(3, H * P), rand(3, H * rr), rand(3, H * P), rand(3, rr), rand(3, H * Vd)
    with pytest.raises(TypeError, match=r"v\.dtype=torch\.int32 must be a floating dtype"):
        pbe.forward_extend(qn, kn, v.to(torch.int32), player, save_kv_cache=False, q_rope=qr, k_rope=kr)


def test_a_forward_that_does_not_serve_the_installed_plan_is_refused():
    """MHA: decode-kind plans run through forward_decode, extend plans through
    forward_extend (else an AttributeError from the core). MLA: forward_extend after a
    DECODE plan ran an absorbed decode, forward_decode after an EXTEND plan an absorbed
    draft extend over the ragged prefill's plan, both silently."""
    be, pool, (layer,), q, g = _decode_fixture(10)
    _, k, v = _mha_kv(2, g)
    with pytest.raises(
        BridgeError,
        match=r"forward_extend does not serve the installed plan's forward_mode=DECODE: .*call forward_decode",
    ):
        be.forward_extend(q, k, v, layer, None, pool, 2, save_kv_cache=True)
    be.init_forward_metadata(
        2, 2, torch.tensor([0, 1]), torch.tensor([1, 1]), _R2P, ForwardMode.EXTEND, extend_seq_lens=torch.tensor([1, 1])
    )
    with pytest.raises(
        BridgeError,
        match=r"forward_decode does not serve the installed plan's forward_mode=EXTEND: .*call forward_extend",
    ):
        be.forward_decode(q, k, v, layer, None, pool, 2, save_kv_cache=True)
    mla, mpool, mlayer, H, R, r = _tiny_mla()
    qm, c, kr = torch.randn(2, H * (R + r)).to(DEV), torch.randn(2, R).to(DEV), torch.randn(2, r).to(DEV)
    kw = dict(save_kv_cache=True, k_rope=kr, token_to_kv_pool=mpool)
    with pytest.raises(BridgeError, match=r"forward_extend does not serve the installed plan's forward_mode=DECODE"):
        mla.forward_extend(qm, c, None, mlayer, **kw)
    r2p = torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0]], dtype=torch.int32)
    mla.init_forward_metadata(
        2, 2, torch.tensor([0, 1]), torch.tensor([1, 1]), r2p, ForwardMode.EXTEND, extend_seq_lens=torch.tensor([1, 1])
    )
    with pytest.raises(
        BridgeError,
        match=r"forward_decode does not serve the installed plan's forward_mode=EXTEND: .*call forward_extend",
    ):
        mla.forward_decode(qm, c, None, mlayer, **kw)
    assert torch.all(mpool.kv_buffer[0] == 0)  # nothing written by the refused calls
    fresh = TorchMHABackend(mha_setup()[0])
    with pytest.raises(RuntimeError, match="call init_forward_metadata"):
        fresh.forward_decode(q, None, None, layer, None, pool, 2)


def test_layer_id_out_of_the_pool_is_refused():
    """layer_id=-1 read the last layer's buffers (Python's negative index); past the pool,
    an IndexError 'list index out of range'."""
    be, pool, _, q, _ = _decode_fixture(11, layers=2)
    with pytest.raises(BridgeError, match=r"layer.layer_id=-1 must be >= 0"):
        be.forward_decode(q, None, None, AttentionLayer(-1, 4, 2, 32), None, pool, 2)
    with pytest.raises(
        BridgeError, match=r"layer.layer_id=2 is out of range: the KV pool TorchKVPool holds layers 0 <="
    ):
        be.forward_decode(q, None, None, AttentionLayer(2, 4, 2, 32), None, pool, 2)

    class EnginePool:  # an engine's pool (SGLang's attributes) that indexes blindly
        layer_num, start_layer, page_size = 2, 4, 4
        k_buffer, v_buffer = pool.k_buffer, pool.v_buffer

        def get_key_buffer(self, i):
            return self.k_buffer[i - self.start_layer]

        def get_value_buffer(self, i):
            return self.v_buffer[i - self.start_layer]

    with pytest.raises(
        BridgeError, match=r"layer.layer_id=1 is out of range: .*EnginePool holds layers 4 <= layer_id < 6"
    ):
        be.forward_decode(q, None, None, AttentionLayer(1, 4, 2, 32), None, EnginePool(), 2)
    assert be.forward_decode(q, None, None, AttentionLayer(5, 4, 2, 32), None, EnginePool(), 2).shape == (2, 128)
    for call in (lambda: pool.get_key_buffer(-1), lambda: pool.get_value_buffer(2), lambda: pool.get_kv_buffer(-2)):
        with pytest.raises(
            BridgeError, match=r"layer_id=-?\d is out of range: the KV pool TorchKVPool holds layers 0 <= layer_id < 2"
        ):
            call()
    mla, mpool, mlayer, H, R, r = _tiny_mla()
    qm = torch.randn(2, H * (R + r)).to(DEV)
    with pytest.raises(BridgeError, match=r"layer.layer_id=3 is out of range: the KV pool TorchMLAKVPool"):
        mla.forward_decode(qm, None, None, AttentionLayer(3, H, 1, R + r, v_head_dim=R), token_to_kv_pool=mpool)
    with pytest.raises(BridgeError, match=r"layer_id=-1 is out of range: the KV pool TorchMLAKVPool"):
        mpool.get_key_buffer(-1)


def test_scales_that_are_not_one_finite_positive_value_are_refused():
    """A several-element k_scale used its first element; 0, negative, NaN or inf scales
    were accepted (an FP8 write with scale 0 saturates every value to +-448)."""
    for kw, msg in [
        (dict(k_scale=torch.tensor([0.5, 2.0])), r"layer.k_scale must be a number or a one-element tensor, got a"),
        (dict(k_scale=0.0), r"layer.k_scale=0.0 must be finite and positive"),
        (dict(v_scale=torch.tensor([-1.0])), r"layer.v_scale=-1.0 must be finite and positive"),
        (dict(scaling=float("nan")), r"layer.scaling=nan must be finite and positive"),
        (dict(scaling=float("inf")), r"layer.scaling=inf must be finite and positive"),
        (dict(scaling=0.0), r"layer.scaling=0.0 must be finite and positive"),
    ]:
        with pytest.raises(BridgeError, match=msg):
            layer_spec(AttentionLayer(0, 4, 2, 32, **kw))
    layer = AttentionLayer(0, 4, 2, 32)
    layer.k_scale_float = float("inf")
    with pytest.raises(BridgeError, match=r"layer.k_scale_float=inf must be finite and positive"):
        layer_spec(layer)
    assert layer_spec(AttentionLayer(0, 4, 2, 32, k_scale=torch.tensor([0.5]), scaling=0.2)).k_scale == 0.5
    # the backend refuses the layer before any work
    be, pool, _, q, _ = _decode_fixture(12)
    with pytest.raises(BridgeError, match=r"layer.scaling=-0.5 must be finite and positive"):
        be.forward_decode(q, None, None, AttentionLayer(0, 4, 2, 32, scaling=-0.5), None, pool, 2)
    # the pool's writer: scales of the FP8 quantisation
    _, fp8 = mha_setup(torch.float8_e4m3fn)
    k = rand(2, 2, 32)
    loc = torch.tensor([4, 5], device=DEV)
    for kw, msg in [
        (dict(k_scale=0.0), r"k_scale=0.0 must be finite and positive"),
        (dict(v_scale=float("nan")), r"v_scale=nan must be finite and positive"),
        (dict(k_scale=torch.tensor([1.0, 2.0])), r"k_scale must be a number or a one-element tensor, got shape \(2,\)"),
        # a one-element tensor scale is checked as the number it holds
        (dict(k_scale=torch.tensor(0.0)), r"k_scale=0.0 must be finite and positive"),
        (dict(v_scale=torch.tensor([float("inf")])), r"v_scale=inf must be finite and positive"),
        (dict(k_scale=torch.tensor(-2.0)), r"k_scale=-2.0 must be finite and positive"),
    ]:
        with pytest.raises(BridgeError, match=msg):
            fp8.set_kv_buffer(layer, loc, k, k, **kw)
    assert torch.all(fp8.k_buffer[0].float() == 0)  # nothing written (both scales are checked first)
    assert torch.all(fp8.v_buffer[0].float() == 0)
    fp8.set_kv_buffer(layer, loc, k, k, k_scale=torch.tensor(0.5), v_scale=2.0)
    assert fp8.k_buffer[0][4].float().abs().max() > 0
    fp8.set_kv_buffer(layer, loc, k, k, k_scale=torch.tensor([2.0]), v_scale=1.0)  # quantised with its value
    want = (k.float() / 2.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(fp8.k_buffer[0][4:6].view(torch.uint8), want.view(torch.uint8))


def test_a_buffer_shrunk_at_the_same_address_is_checked_again():
    """A pool buffer replaced by a smaller one at the same address (a view of its first
    pages) is checked again, on the slow path (a new call signature) and on the hot path
    of a repeated call (it checked only the address)."""
    be, pool, (layer,), q, _ = _decode_fixture(9)
    for _ in range(2):  # the second call sets up the hot path
        be.forward_decode(q, None, None, layer, None, pool, 2)
    full = pool.k_buffer[0]
    pool.k_buffer[0] = full[: 8 * 4]  # the same data pointer: 8 of the 16 pages
    msg = r"k_buffer\[layer 0\] has 8 pages, config.num_pages=16"
    with pytest.raises(BridgeError, match=msg):
        be.forward_decode(q, None, None, layer, None, pool, 2)  # the hot path's call
    with pytest.raises(BridgeError, match=msg):
        be.forward_decode(q, None, None, layer, None, pool, 2, sinks=torch.zeros(4, device=DEV))  # a new call
    pool.k_buffer[0] = full
    be.forward_decode(q, None, None, layer, None, pool, 2)


def test_bad_out_cache_loc_is_refused():
    """The torch writer's out_cache_loc: too short, out of the pool, negative or float
    gave torch's index_copy_ errors (or wrote where it should not), not naming it."""
    be, pool, (layer,), q, g = _decode_fixture(13)
    if ON_GPU:  # the torch writer reads out_cache_loc; "host" (default) checks only CPU tensors' values
        be = TorchMHABackend(be.config, kv_writer="torch")
        be.check_slot_values = "always"
        be.init_forward_metadata(2, 0, torch.tensor([0, 1]), torch.tensor([9, 5]), _R2P, ForwardMode.DECODE)
    _, k, v = _mha_kv(2, g)
    good = torch.as_tensor(np.asarray(be.forward_metadata.out_cache_loc)[:2].astype(np.int64), device=DEV)  # the plan's
    for _ in range(2):  # the hot-path plan checks them too
        be.forward_decode(q, k, v, layer, good, pool, 2, save_kv_cache=True)
    before = pool.k_buffer[0].clone()
    for loc, msg in [
        (good[:1], r"out_cache_loc must be 1-D with a slot for each of the 2 new tokens, got shape \(1,\)"),
        (good.view(2, 1), r"out_cache_loc must be 1-D .* got shape \(2, 1\)"),
        (torch.tensor([4, 64], device=DEV), r"out_cache_loc holds slot 64, outside the KV pool's slots \[0, 64\)"),
        (torch.tensor([-1, 4], device=DEV), r"out_cache_loc holds slot -1, outside the KV pool's slots \[0, 64\)"),
        (good.float(), r"out_cache_loc must hold integer slots, got dtype torch.float32"),
        # slots in the pool but not the plan's: attention reads the plan's (a stale slot)
        (
            good.flip(0),
            rf"out_cache_loc\[0\]={int(good[1])}, but the installed plan puts new token 0 at slot "
            rf"{int(good[0])} .* \(2 of 2 differ\)",
        ),
        (torch.stack([good[0], good[0] + 1]), rf"out_cache_loc\[1\]={int(good[0]) + 1}, .* \(1 of 2 differ\)"),
    ]:
        with pytest.raises(BridgeError, match=msg):
            be.forward_decode(q, k, v, layer, loc, pool, 2, save_kv_cache=True)
    torch.testing.assert_close(
        pool.k_buffer[0], before, rtol=0, atol=0, equal_nan=True
    )  # nothing written by the refused calls
    be.check_slot_values = "sometimes"
    with pytest.raises(ValueError, match=r"check_slot_values='sometimes' must be 'host', 'always' or 'never'"):
        be.forward_decode(q, k, v, layer, good, pool, 2, save_kv_cache=True)
    # MLA's torch writer
    mla, mpool, mlayer, H, R, r = _tiny_mla()
    if ON_GPU:
        mla = TorchMLABackend(mla.config, kv_writer="torch")
        r2p = torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0]], dtype=torch.int32)
        mla.init_forward_metadata(2, 0, torch.tensor([0, 1]), torch.tensor([6, 3]), r2p, ForwardMode.DECODE)
    mla.check_slot_values = "always"
    qm, c, kr = torch.randn(2, H * (R + r)).to(DEV), torch.randn(2, R).to(DEV), torch.randn(2, r).to(DEV)
    kw = dict(save_kv_cache=True, k_rope=kr, token_to_kv_pool=mpool)
    with pytest.raises(BridgeError, match=r"out_cache_loc holds slot 32, outside the KV pool's slots \[0, 32\)"):
        mla.forward_decode(qm, c, None, mlayer, out_cache_loc=torch.tensor([4, 32], device=DEV), **kw)
    mloc = np.asarray(mla.forward_metadata.out_cache_loc)[:2].astype(np.int64)
    before = mpool.kv_buffer[0].clone()
    with pytest.raises(
        BridgeError, match=rf"out_cache_loc\[1\]={mloc[1] + 1}, but the installed plan puts new token 1"
    ):
        mla.forward_decode(qm, c, None, mlayer, out_cache_loc=torch.tensor([mloc[0], mloc[1] + 1], device=DEV), **kw)
    torch.testing.assert_close(mpool.kv_buffer[0], before, rtol=0, atol=0, equal_nan=True)  # nothing written
    mla.forward_decode(qm, c, None, mlayer, out_cache_loc=torch.as_tensor(mloc, device=DEV), **kw)  # the plan's: fine
    # the pool's own writer names loc
    with pytest.raises(BridgeError, match=r"loc must be \[2\] \(one slot per row of cache_k\), got shape \(1,\)"):
        pool.set_kv_buffer(layer, good[:1], k, v)
    if not ON_GPU:
        with pytest.raises(BridgeError, match=r"loc holds slot 64, outside the pool's slots \[0, 64\)"):
            pool.set_kv_buffer(layer, torch.tensor([4, 64]), k, v)


def test_merge_state_checks_ranks_shapes_and_dtypes():
    """A 1-D LSE gave 'not enough values to unpack (expected 2, got 1)'."""
    _, be, _ = _small_mla(2, 32, 16, 32)
    o, lse = rand(5, 2, 32), torch.randn(5, 2, device=DEV)
    cases = [
        ((o, lse[:, 0], o, lse), r"lse_a must be \[T, H\] \(natural-log LSE\), got shape \(5,\)"),
        ((o, lse, o, lse[:4]), r"lse_b has shape \(4, 2\), lse_a \(5, 2\): they must be equal"),
        ((o, lse.int(), o, lse), r"lse_a must be a float tensor \(natural-log LSE\), got dtype torch.int32"),
        ((o[:4], lse, o, lse), r"o_a must be \[T, H, D\] or \[T, H \* D\] with T, H = 5, 2 \(lse_a's\), got shape"),
        ((o, lse, o.view(5, 64)[:, :63], lse), r"o_b must be .* got shape \(5, 63\)"),
        ((o, lse, o.view(5, 64), lse), r"o_b \(\(5, 64\), torch.bfloat16\) must match o_a \(\(5, 2, 32\)"),
        ((o, lse, o.float(), lse), r"o_b .* must match o_a .* in shape and dtype"),
        ((o.int(), lse, o.int(), lse), r"o_a.dtype must be bfloat16, float16 or float32, got torch.int32"),
    ]
    for args, msg in cases:
        with pytest.raises(BridgeError, match=msg):
            be.merge_state(*args)
    m, mlse = be.merge_state(o.view(5, 64), lse, o.view(5, 64), lse)
    assert m.shape == (5, 64) and mlse.shape == (5, 2)
    torch.testing.assert_close(mlse, lse + math.log(2), atol=1e-5, rtol=1e-5)
    # a contiguous view at an odd offset of a larger tensor is read (copied), not refused
    big = torch.randn(2 * lse.numel() + 1, device=DEV)
    off = big[1 : 1 + lse.numel()].view(5, 2)
    off.copy_(lse)
    m2, mlse2 = be.merge_state(o.view(5, 64), off, o.view(5, 64), lse)
    torch.testing.assert_close(mlse2, mlse, atol=0, rtol=0)
    torch.testing.assert_close(m2, m, atol=0, rtol=0)


def test_fast_path_follows_scales_set_after_a_warm_up():
    """FP8 scales set on the layer after warm-up calls (checkpoint scales loaded late): the
    hot path's cached plan follows them, as the slow path does. Before, it kept writing and
    reading with the scales of its first call (outputs off by 24 at the third step)."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 32
    cfg, pool_fast = mha_setup(torch.float8_e4m3fn, layers=1)
    _, pool_slow = mha_setup(torch.float8_e4m3fn, layers=1)
    fast, slow = TorchMHABackend(cfg, kv_writer="torch"), TorchMHABackend(cfg, kv_writer="torch")
    slow.fast_path = False
    layer_fast, layer_slow = AttentionLayer(0, hq, hkv, d), AttentionLayer(0, hq, hkv, d)
    eng = Engine(2, 16, 4, rng, cfg.num_pages)
    for step, lens in enumerate(([3, 7], [4, 8], [5, 9])):
        if step == 2:
            for layer in (layer_fast, layer_slow):
                layer.k_scale, layer.v_scale = 0.05, 0.03
        q, k, v = rand(2, hq * d), rand(2, hkv * d, scale=10), rand(2, hkv * d, scale=10)
        loc = torch.tensor([eng.slots(0, lens[0] - 1, 1)[0], eng.slots(1, lens[1] - 1, 1)[0]])
        outs = []
        for be, pool, layer in ((fast, pool_fast, layer_fast), (slow, pool_slow, layer_slow)):
            be.init_forward_metadata(
                2, 0, eng.req_pool_indices, torch.tensor(lens), eng.req_to_page, ForwardMode.DECODE
            )
            outs.append(be.forward_decode(q, k, v, layer, loc, pool, 2, save_kv_cache=True).float())
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        assert torch.equal(pool_fast.k_buffer[0].view(torch.uint8), pool_slow.k_buffer[0].view(torch.uint8))
    written = pool_fast.k_buffer[0][loc].float() * 0.05
    assert torch.equal(written, fp8_round(k.view(2, hkv, d).float(), 0.05))


def test_capture_takes_both_engines_argument_orders():
    """``init_forward_metadata_capture_cuda_graph`` in tokenspeed's order (bs,
    req_pool_indices, seq_lens, forward_mode) installs that mode's plan, as SGLang's order
    (bs, num_tokens, ...) does; before, tokenspeed's order silently installed a decode plan.
    ``num_tokens`` must be the bucket's token rows."""
    cfg, _ = mha_setup(torch.bfloat16, layers=1)
    be = TorchMHABackend(cfg, kv_writer="torch")
    rows = be.init_forward_metadata_capture_cuda_graph(
        4, torch.zeros(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32), ForwardMode.TARGET_VERIFY
    ).out_cache_loc.shape[0]
    assert ForwardMode.parse(be.forward_mode) is ForwardMode.TARGET_VERIFY
    be.init_forward_metadata_capture_cuda_graph(4, rows, forward_mode=ForwardMode.TARGET_VERIFY)
    with pytest.raises(BridgeError, match=rf"num_tokens=7 must be the {rows} token rows of bucket 4 in TARGET_VERIFY"):
        be.init_forward_metadata_capture_cuda_graph(4, 7, forward_mode=ForwardMode.TARGET_VERIFY)


def test_an_input_of_another_dtype_than_q_is_named():
    """k of another dtype than q (the inputs are staged in q's dtype) is refused naming k."""
    rng = np.random.default_rng(0)
    cfg, pool = mha_setup(torch.bfloat16, layers=1)
    be = TorchMHABackend(cfg, kv_writer="torch")
    layer = AttentionLayer(0, 4, 2, 32)
    eng = Engine(2, 16, 4, rng, cfg.num_pages)
    lens = torch.tensor([5, 7])
    be.init_forward_metadata(
        2, 2, eng.req_pool_indices, lens, eng.req_to_page, ForwardMode.EXTEND, extend_seq_lens=lens
    )
    q, k, v = rand(12, 4 * 32), rand(12, 2 * 32), rand(12, 2 * 32)
    with pytest.raises(TypeError, match=r"k\.dtype=torch\.float16 must be q's torch\.bfloat16"):
        be.forward_extend(q, k.half(), v, layer, None, pool, 2, save_kv_cache=True)


# ----------------------------------------------------------------------------- review of 2026-12-06


def test_pool_writer_refuses_rows_of_another_head_layout():
    """The pool's own writer took any row shape with the right element count: K of 4 KV
    heads x 16 went into a 2 x 32 pool, reinterpreted."""
    pool = TorchKVPool(num_layers=1, num_pages=4, page_size=4, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    layer, loc = AttentionLayer(0, 4, 2, 32), torch.tensor([5, 6, 7])
    k = torch.randn(3, 4, 16)
    with pytest.raises(BridgeError, match=r"must be \[3, 64\] \(or \[3, 2, 32\]\).*got \(3, 4, 16\)"):
        pool.set_kv_buffer(layer, loc, k, k)
    assert torch.all(pool.k_buffer[0] == 0)
    pool.set_kv_buffer(layer, loc, k.reshape(3, 64), k.reshape(3, 2, 32))  # both accepted forms
    assert torch.equal(pool.k_buffer[0][loc], k.reshape(3, 2, 32)) and torch.equal(
        pool.v_buffer[0][loc], pool.k_buffer[0][loc]
    )


def test_extend_plan_with_no_new_tokens_gives_no_rows():
    """An extend whose requests bring no new tokens crashed staging its 0 rows (a reshape
    with -1 of a zero-size tensor); it gives [0, Hq * Dv] and writes nothing."""
    cfg, pool = mha_setup(torch.bfloat16, layers=1)
    for b in pool.k_buffer + pool.v_buffer:
        b.copy_(torch.randn(b.shape).to(b.dtype))
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    be = TorchMHABackend(cfg)
    eng = Engine(2, 4, 4, np.random.default_rng(3), cfg.num_pages)
    be.init_forward_metadata(2, 0, eng.req_pool_indices, torch.tensor([5, 3]), eng.req_to_page, ForwardMode.EXTEND,
                             extend_seq_lens=torch.tensor([0, 0]))  # fmt: skip
    z, zk = torch.zeros(0, 4 * 32, dtype=torch.bfloat16), torch.zeros(0, 2 * 32, dtype=torch.bfloat16)
    out = be.forward_extend(z, zk, zk, AttentionLayer(0, 4, 2, 32), torch.zeros(0, dtype=torch.int64), pool, 2)
    assert tuple(out.shape) == (0, 128)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer))


def test_pool_buffer_of_another_dtype_is_a_bridge_error_naming_it():
    """It was a TypeError naming neither the buffer nor the layer; a buffer viewed as
    another dtype of the same width (same pointer and shape) is checked again too."""
    be, pool, _, q, _ = _decode_fixture(11, layers=2)
    layer1 = AttentionLayer(1, 4, 2, 32)
    be.forward_decode(q, None, None, layer1, None, pool, 2)
    good = pool.v_buffer[1]
    for other in (good.to(torch.float16), good.view(torch.float16)):
        pool.v_buffer[1] = other
        with pytest.raises(BridgeError, match=r"v_buffer\[layer 1\] has dtype torch.float16; config.kv_cache_dtype"):
            be.forward_decode(q, None, None, layer1, None, pool, 2)
    pool.v_buffer[1] = good
    be.forward_decode(q, None, None, layer1, None, pool, 2)


def test_block_seq_lens_past_int32_or_not_integers_are_refused():
    """``fill_block_decode_seq_lens`` cast to int32 silently: 2^32 + 9 and -2^32 + 9 became
    9, 9.9 became 9."""
    cfg, _ = mha_setup(torch.bfloat16, layers=1, spec=2)
    be = TorchMHABackend(cfg)
    eng = Engine(2, 8, 4, np.random.default_rng(4), cfg.num_pages)
    be.init_forward_metadata(2, 0, eng.req_pool_indices, torch.tensor([6, 9]), eng.req_to_page, ForwardMode.DRAFT_BLOCK)
    with pytest.raises(ValueError, match=r"block_seq_lens\[0\]=4294967305 does not fit int32"):
        be.fill_block_decode_seq_lens(2, torch.tensor([2**32 + 9, 21]))
    with pytest.raises(ValueError, match=r"block_seq_lens\[0\]=-4294967287 does not fit int32"):
        be.fill_block_decode_seq_lens(2, torch.tensor([-(2**32) + 9, 21]))  # wraps to 9 as well
    with pytest.raises(ValueError, match=r"block_seq_lens must hold integers, got dtype float32"):
        be.fill_block_decode_seq_lens(2, torch.tensor([9.9, 21.0]))
    be.fill_block_decode_seq_lens(2, torch.tensor([9, 21]))
    assert np.asarray(be.forward_metadata.cache_seqlens)[:2].tolist() == [9, 21]


def test_fp8_pool_divides_an_e4m3_input_by_its_scale_as_the_core_does():
    """The torch pool stored an already-e4m3 k as it was, ignoring k_scale, where
    ``jattn.set_kv_buffer`` (and every other writer) divides by the scale."""
    import jattn

    pool = TorchKVPool(num_layers=1, num_pages=4, page_size=4, num_kv_heads=2, head_dim=32, dtype=torch.float8_e4m3fn)
    k8 = (torch.randn(3, 2, 32) * 4).to(torch.float8_e4m3fn)
    loc = torch.tensor([5, 6, 7])
    pool.set_kv_buffer(AttentionLayer(0, 4, 2, 32), loc, k8, k8, k_scale=0.5, v_scale=0.25)
    kc = jnp.zeros((4, 4, 2, 32), jnp.float8_e4m3fn)
    k8j = jax.lax.bitcast_convert_type(jnp.asarray(k8.view(torch.uint8).numpy()), jnp.float8_e4m3fn)  # any backend
    nk, nv = jattn.set_kv_buffer(kc, kc, jnp.asarray(loc.numpy(), jnp.int32), k8j, k8j, k_scale=0.5, v_scale=0.25)
    for got, want in ((pool.k_buffer[0], nk), (pool.v_buffer[0], nv)):
        want = np.asarray(want).reshape(16, 2, 32)[loc.numpy()].view(np.uint8)
        np.testing.assert_array_equal(got[loc].view(torch.uint8).numpy(), want)


def test_sparse_tensors_and_pool_buffers_get_their_own_messages():
    """A sparse tensor was called 'not contiguous' (to_jax) or failed inside torch
    (to_jax_input); a misaligned pool buffer was told to pass copy=True, which the
    backends do not take (a pool is never copied)."""
    sp = torch.eye(4).to_sparse()
    with pytest.raises(BridgeError, match=r"t has layout torch.sparse_coo: the bridge takes dense"):
        to_jax(sp, name="t")
    with pytest.raises(BridgeError, match=r"q has layout torch.sparse_coo"):
        to_jax_input(sp, "q")
    be, pool, (layer,), q, _ = _decode_fixture(12)
    base = torch.zeros(pool.k_buffer[0].numel() + 1, dtype=torch.bfloat16)
    pool.k_buffer[0] = base[1:].view(pool.k_buffer[0].shape)
    with pytest.raises(
        BridgeError, match=r"k_buffer\[layer 0\].*not 64-byte aligned.*allocate it contiguous and aligned"
    ):
        be.forward_decode(q, None, None, layer, None, pool, 2)


def test_fp8_pool_write_is_the_ieee_quotient_on_every_device():
    """The torch pool's FP8 write gives the JAX writer's bytes at an inexact scale. On CUDA,
    torch divides by a host scalar as a product with its f32 reciprocal (one ulp off for many
    quotients, which moves about 0.75% of e4m3 values at scale 0.03 to the other neighbour):
    the pool divides by a device tensor. On the CPU both were right; the GPU run is the test."""
    import jattn

    n, g = 4096, torch.Generator().manual_seed(5)
    pool = TorchKVPool(
        num_layers=1, num_pages=n // 4, page_size=4, num_kv_heads=2, head_dim=32, dtype=torch.float8_e4m3fn, device=DEV
    )
    k = (torch.randn(n, 2, 32, generator=g) * 3).to(torch.bfloat16).to(DEV)
    loc = torch.randperm(n, generator=g).to(DEV)
    pool.set_kv_buffer(AttentionLayer(0, 4, 2, 32), loc, k, k, k_scale=0.03, v_scale=0.7)
    kc = jnp.zeros((n // 4, 4, 2, 32), jnp.float8_e4m3fn)
    nk, nv = jattn.set_kv_buffer(kc, kc, to_jax(loc.to(torch.int32)), to_jax(k), to_jax(k), k_scale=0.03, v_scale=0.7)
    for got, want in ((pool.k_buffer[0], nk), (pool.v_buffer[0], nv)):
        want = np.asarray(want).reshape(n, 2, 32).view(np.uint8)
        np.testing.assert_array_equal(got.view(torch.uint8).cpu().numpy(), want)


# ----------------------------------------------------------------------------- review of 2026-12-06 (ninth session)


def test_a_scale_tensor_replaced_at_the_freed_ones_address_is_read_again():
    """The layer's cached spec (and the fast path's plan) were keyed by the scale tensor's
    ``id`` and version: a new tensor at a freed one's address (version 0 again) kept the
    old scale for the pool's writes and the attention."""
    cfg = MHAConfig(
        num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4, context_len=64, num_pages=64,
        kv_cache_dtype="float8_e4m3fn", kernel_backend="xla",
    )  # fmt: skip
    be = TorchMHABackend(cfg)
    layer = AttentionLayer(0, 4, 2, 32, k_scale=torch.tensor(1.0), v_scale=1.0)
    assert be._spec(layer).k_scale == 1.0
    # New tensors, each kept alive until one lands at the freed address (the allocator
    # hands out its other free blocks first); a few fresh tries where it never does.
    t = old = None
    for _ in range(8):
        layer.k_scale = torch.tensor(1.0)
        assert be._spec(layer).k_scale == 1.0
        old = id(layer.k_scale)
        layer.k_scale = None  # freed: the spec cache holds it weakly
        gc.collect()
        held = []
        for _ in range(20_000):
            t = torch.tensor(4.0)
            if id(t) == old:
                break
            held.append(t)
        if id(t) == old:
            break
    assert id(t) == old, "no address was reused: the case did not arise"
    layer.k_scale = t
    assert be._spec(layer).k_scale == 4.0


def test_a_bool_out_cache_loc_is_refused_without_value_checks():
    """An ``out_cache_loc`` of bool dtype is refused by name ("must hold integer slots")
    even where its values are not checked (``check_slot_values="never"``, a CUDA tensor
    under the default "host"): the pool's writer casts the slots to int64, so a bool
    tensor would silently write its rows at slots 0 and 1 (the dummy page) instead of the
    plan's slots, and nothing would be written where the attention reads."""
    be, pool, (layer,), q, g = _decode_fixture(21)
    be = TorchMHABackend(be.config, kv_writer="torch")
    be.init_forward_metadata(2, 0, torch.tensor([0, 1]), torch.tensor([9, 5]), _R2P, ForwardMode.DECODE)
    be.check_slot_values = "never"
    _, k, v = _mha_kv(2, g)
    before = pool.k_buffer[0].clone()
    with pytest.raises(BridgeError, match=r"out_cache_loc must hold integer slots, got dtype torch.bool"):
        be.forward_decode(q, k, v, layer, torch.tensor([True, False], device=DEV), pool, 2, save_kv_cache=True)
    torch.testing.assert_close(pool.k_buffer[0], before, rtol=0, atol=0, equal_nan=True)  # nothing written


def test_extend_counts_only_the_first_bs_extend_lengths():
    """``extend_seq_lens`` may be longer than ``bs`` (an engine's buffer, int[>= bs]): the
    plan's new tokens are ``sum(extend_seq_lens[:bs])``, so a call with exactly those rows
    runs (and the stale entries past ``bs`` neither count nor make it be refused)."""
    cfg, pool = mha_setup(torch.bfloat16, layers=1)
    be = TorchMHABackend(cfg)
    eng = Engine(3, 8, 4, np.random.default_rng(1), cfg.num_pages)
    be.init_forward_metadata(
        2, 2, eng.req_pool_indices, torch.tensor([5, 7, 9]), eng.req_to_page, ForwardMode.EXTEND,
        extend_seq_lens=torch.tensor([5, 7, 9]),
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, w, generator=g).to(torch.bfloat16).to(DEV) for w in (128, 64, 64))
    out = be.forward_extend(q, k, v, AttentionLayer(0, 4, 2, 32), None, pool, save_kv_cache=True)
    assert out.shape == (12, 128) and torch.isfinite(out).all()


def test_mha_k_with_the_query_head_count_is_named():
    """Under GQA a ``k`` laid out with the query heads' count (``[tokens, tp_q_head_num *
    head_dim]``, a common mix-up) is refused naming ``k`` and its layout, not later by the
    pool's writer as ``cache_k`` (or, on the JAX writer, staged at the wrong width)."""
    be, pool, (layer,), q, g = _decode_fixture(10)
    _, k, v = _mha_kv(2, g)
    with pytest.raises(BridgeError, match=r"k must be \[tokens, tp_k_head_num \* head_dim\] .* got \(2, 128\)"):
        be.forward_decode(q, torch.cat([k, k], 1), v, layer, None, pool, 2, save_kv_cache=True)


def test_mla_llama_4_scaling_multiplies_in_f32():
    """``llama_4_scaling`` scales a bf16 query in f32 and rounds once back to bf16
    (SGLang's and the core's rule): a scale that bf16 cannot hold (1.003, which bf16
    rounds to 1.0) must still change the query, so the call equals the call on the query
    scaled by hand in f32, and differs from the unscaled call."""
    be, pool, layer, H, R, r = _tiny_mla()
    g = torch.Generator().manual_seed(8)
    pool.kv_buffer[0].copy_(torch.randn(pool.kv_buffer[0].shape, generator=g))
    decode = functools.partial(be.forward_decode, token_to_kv_pool=pool, save_kv_cache=False)
    q_nope = (torch.randn(2, H * R, generator=g) * 30).to(torch.bfloat16).to(DEV)
    q_rope = (torch.randn(2, H * r, generator=g) * 30).to(torch.bfloat16).to(DEV)
    s = torch.tensor([1.003, 0.997]).to(DEV)
    by_hand = lambda x: (x.float() * s.reshape(2, 1)).to(torch.bfloat16)  # noqa: E731
    assert not torch.equal(by_hand(q_nope), q_nope)
    got = decode(q_nope, None, None, layer, q_rope=q_rope, llama_4_scaling=s).clone()
    want = decode(by_hand(q_nope), None, None, layer, q_rope=by_hand(q_rope)).clone()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_mla_pool_writer_names_rows_of_the_wrong_width():
    """``TorchMLAKVPool.set_mla_kv_buffer`` refuses a c_kv or k_pe whose rows are not
    ``kv_lora_rank`` / ``qk_rope_head_dim`` wide with a message naming the argument and
    its layout (before any write), rather than torch's reshape error or, where the
    element count happens to fit, a silent misaligned write."""
    pool = TorchMLAKVPool(num_layers=1, num_pages=4, page_size=4, kv_lora_rank=16, qk_rope_head_dim=8,
                          dtype=torch.float32, device=DEV)  # fmt: skip
    layer = AttentionLayer(0, 2, 1, 24, v_head_dim=16)
    loc = torch.tensor([4, 5], device=DEV)
    with pytest.raises(BridgeError, match=r"cache_k_nope must be \[2, 16\] \(or \[2, 1, 16\]\), got \(2, 17\)"):
        pool.set_mla_kv_buffer(layer, loc, torch.zeros(2, 17, device=DEV), torch.zeros(2, 8, device=DEV))
    with pytest.raises(BridgeError, match=r"cache_k_rope must be \[2, 8\] \(or \[2, 1, 8\]\), got \(2, 4\)"):
        pool.set_mla_kv_buffer(layer, loc, torch.zeros(2, 16, device=DEV), torch.zeros(2, 4, device=DEV))
    assert torch.all(pool.kv_buffer[0] == 0)


def test_mla_multistep_refuses_a_step_past_the_loop_by_name():
    """``TorchMLAMultiStepDraftBackend.forward_decode(step, ...)`` takes steps in
    ``[0, num_steps)``: ``step == num_steps`` (one past the loop, an easy off-by-one in a
    caller) and a negative step (which would index from the end) are refused with a
    ValueError naming ``step`` and the range, before any backend is called."""
    from jattn.bridge import TorchMLAMultiStepDraftBackend

    cfg, pool, layer = _draft_mla(num_pages=32)
    ms = TorchMLAMultiStepDraftBackend(cfg, pool, topk=1, speculative_num_steps=3)
    assert ms.num_steps == 2
    for step in (2, -1):
        with pytest.raises(ValueError, match=rf"step={step} is not in \[0, num_steps=2\)"):
            ms.forward_decode(step, None, None, None, layer)


def test_req_to_page_wins_over_req_to_token_pages():
    """Given both, the planning calls use ``req_to_page`` and ignore SGLang's
    ``req_to_token_pages`` alias (the documented precedence): the plan's slots are those
    of ``req_to_page``'s pages."""
    cfg, _ = mha_setup(torch.bfloat16, layers=1)
    be = TorchMHABackend(cfg)
    eng = Engine(2, 8, 4, np.random.default_rng(2), cfg.num_pages)
    other = eng.req_to_page.flip(1).contiguous()
    be.init_forward_metadata(2, 0, eng.req_pool_indices, torch.tensor([3, 6]), eng.req_to_page, ForwardMode.DECODE,
                             req_to_token_pages=other)  # fmt: skip
    want = [eng.slots(0, 2, 1)[0], eng.slots(1, 5, 1)[0]]
    assert np.asarray(be.forward_metadata.out_cache_loc)[:2].tolist() == want


def test_sinks_whose_data_is_swapped_are_read_again():
    """A sinks tensor whose storage is swapped through ``.data`` (no version bump: torch
    only moves its pointer, shape or dtype) is read again on the next call, on the fast
    path too: new values at a new address reach the output, and a swap to another shape
    is refused by a sinks shape check instead of reusing the old copy."""
    be, pool, (layer,), q, g = _decode_fixture(3)
    sinks = torch.randn(4, generator=g).to(DEV)
    call = lambda: be.forward_decode(q, None, None, layer, None, pool, 2, sinks=sinks).float().cpu().clone()  # noqa: E731
    a = call()
    torch.testing.assert_close(call(), a, atol=0, rtol=0)  # the second call runs the plan
    v0 = sinks._version
    sinks.data = torch.full((4,), 5.0, device=DEV)  # new storage, same version counter
    assert sinks._version == v0
    b = call()
    torch.testing.assert_close(b, _decode_ref(pool, q, sinks), atol=2e-2, rtol=2e-2)
    assert (b - a).abs().max() > 0.05
    sinks.data = sinks.data[:2]  # same address, another shape: refused (the bridge's or the core's check)
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        call()


# ----------------------------------------------------------------------------- mutation review of the bridge package


def test_cpu_views_need_64_byte_alignment_and_inputs_off_it_are_copied():
    """JAX's CPU client views only 64-byte aligned buffers: a 32-byte offset view is refused
    by the bridge's own check (naming the offset), and a per-call input at that offset is
    copied first, so it is read with its values rather than refused by JAX."""
    if ON_GPU:
        pytest.skip("the CPU client's alignment (the GPU's is 16 bytes)")
    base = torch.randn(80, generator=torch.Generator().manual_seed(3))
    assert base.data_ptr() % 64 == 0
    x = base[8:72]  # 32 bytes in: aligned to 32, not to 64
    with pytest.raises(BridgeError, match=r"x's data pointer .* is not 64-byte aligned \(storage offset 8 elements\)"):
        to_jax(x, name="x")
    np.testing.assert_array_equal(np.asarray(to_jax_input(x, "x")), x.numpy())


def test_explicit_copies_share_no_memory_in_either_direction():
    """``copy=True`` copies even a tensor (or array) that could be shared: later writes to
    one side do not reach the other."""
    t = torch.randn(16, 8, generator=torch.Generator().manual_seed(4)).to(DEV)
    a = to_jax(t, copy=True)
    assert a.unsafe_buffer_pointer() != t.data_ptr()
    want = t.cpu().numpy().copy()
    t.mul_(2)
    np.testing.assert_array_equal(np.asarray(a), want)
    b = to_torch(a, copy=True)
    assert b.data_ptr() != a.unsafe_buffer_pointer()
    b.zero_()
    np.testing.assert_array_equal(np.asarray(a), want)


def test_a_cross_attention_layer_is_refused_by_name():
    layer = AttentionLayer(0, 4, 2, 32)
    layer.is_cross_attention = True
    with pytest.raises(NotImplementedError, match="cross attention is not supported by the torch bridge"):
        layer_spec(layer)


def test_mla_prefill_inputs_as_wide_as_absorbed_ones_run_the_prefill():
    """With ``qk_nope_head_dim == kv_lora_rank`` a prefill q_nope has the absorbed query's
    width: an ``EXTEND`` call reads it as the ragged prefill (its k and v given), not as
    an absorbed call over the pool."""
    torch.manual_seed(6)
    H, P, r, Vd = 2, 64, 16, 32
    cfg, be, layer = _small_mla(H, P, r, Vd)
    assert cfg.kv_lora_rank == P
    ext = [3, 4]
    r2p = torch.arange(1, 13, dtype=torch.int32).view(2, 6)
    be.init_forward_metadata(
        2, 2, torch.tensor([0, 1]), torch.tensor(ext), r2p, ForwardMode.EXTEND, extend_seq_lens=torch.tensor(ext)
    )
    T = sum(ext)
    qn, qr, kn, kr, v = rand(T, H * P), rand(T, H * r), rand(T, H * P), rand(T, r), rand(T, H * Vd)
    out = be.forward_extend(qn, kn, v, layer, save_kv_cache=False, q_rope=qr, k_rope=kr)
    assert out.shape == (T, H * Vd)
    for rows, q, _, exp in _mla_prefill_expected(qn, qr, kn, kr, v, ext, cfg.softmax_scale):
        torch.testing.assert_close(out[rows].float().cpu().view(q.shape[0], H, Vd), exp, atol=3e-2, rtol=3e-2)


def test_a_scale_tensor_changed_in_place_is_read_again():
    """A layer's scale tensor loaded in place (``copy_`` / ``fill_`` into the same tensor)
    after a first call: the cached spec follows its version, so the pool's writer and the
    attention use the new scale."""
    cfg = MHAConfig(
        num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4, context_len=64, num_pages=64,
        kv_cache_dtype="float8_e4m3fn", kernel_backend="xla",
    )  # fmt: skip
    be = TorchMHABackend(cfg)
    layer = AttentionLayer(0, 4, 2, 32, k_scale=torch.tensor(0.5), v_scale=torch.tensor(0.25))
    spec = be._spec(layer)
    assert (spec.k_scale, spec.v_scale) == (0.5, 0.25)
    layer.k_scale.fill_(2.0)
    layer.v_scale.mul_(3.0)
    spec = be._spec(layer)
    assert (spec.k_scale, spec.v_scale) == (2.0, 0.75)
