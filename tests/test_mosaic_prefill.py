"""Tests of the Mosaic GPU ragged prefill / paged extend kernel
(``jattn.pallas_kernels.mosaic_prefill``).

Each case runs on the CPU under the Mosaic GPU interpreter at small shapes (f16:
tile order, page addressing, ring, barriers, masks, softmax) and on an H200
(marker ``gpu``, bf16) at larger ones. The oracles are the f32
``jattn.reference.mha_prefill`` / ``mha_extend``. Inputs are fresh random draws;
the rows past the ragged totals, unused pages and page tails hold NaN.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import reference
from jattn.pallas_kernels import mosaic_prefill as mp
from jattn.pallas_kernels import prefill_plan
from jattn.pallas_kernels.interpret import gpu_interpret, interpreter_available, on_gpu


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]
    prefix: tuple[int, ...] | None = None  # keys before the queries (extend); None: 0
    hq: int = 4
    hkv: int = 2
    d: int = 64
    dv: int | None = None
    page_size: int = 0  # 0: ragged prefill; else paged extend
    causal: bool = True
    window_left: int = -1
    logit_cap: float = 0.0
    sinks: bool = False
    pad_tokens: int = 5  # NaN rows after the ragged q/k/v
    poison: int = -1  # >= 0: key of request 0 whose V is NaN (and the next key's K +inf)
    clean_edges: bool | None = None  # the kernel option (None: its default here)
    kv_fp8: bool = False  # K/V as FP8 e4m3 with the scales below (the oracle reads the same bytes)
    overlap: bool = False  # PrefillOptions(overlap_pv=True): the intra-warpgroup overlap
    ctas: int = 0  # > 0: PrefillOptions(persistent=True) with this many CTAs walking the tiles
    persistent: bool | None = None  # PrefillOptions(persistent=...) where ctas is 0 (None: the default)
    prefetch: bool = False  # PrefillOptions(prefetch_k=True): the next K awaited during P @ V
    l2: int | None = None  # PrefillOptions(l2_section_kib=l2): the launch order in L2 sections (None: auto)
    softmax_scale: float | None = None  # None: 1/sqrt(head_dim_qk)


_FP8_SCALES = (0.37, 1.9)  # k_scale, v_scale of the FP8 cases


def _kv(c: Case, a, dtype, which: int):
    """K (which=0) or V (1) as the kernel gets it: ``dtype``, or FP8 of ``a / scale``."""
    if not c.kv_fp8:
        return jnp.asarray(a, dtype)
    return reference.quantize_fp8(jnp.asarray(a, jnp.float32), _FP8_SCALES[which])


def _scales(c: Case):
    return dict(k_scale=_FP8_SCALES[0], v_scale=_FP8_SCALES[1]) if c.kv_fp8 else {}


def _inputs(c: Case, seed: int, dtype):
    rng = np.random.default_rng(seed)
    bs = len(c.q_lens)
    dv = c.dv or c.d
    prefix = c.prefix or (0,) * bs
    kv_lens = [p + n for p, n in zip(prefix, c.q_lens)]
    tq = sum(c.q_lens) + c.pad_tokens
    q = rng.standard_normal((tq, c.hq, c.d)).astype(np.float32)
    q[sum(c.q_lens) :] = np.nan
    cu_q = np.concatenate([[0], np.cumsum(c.q_lens)]).astype(np.int32)
    sinks = rng.standard_normal(c.hq).astype(np.float32) * 2 if c.sinks else None
    if not c.page_size:
        tk = sum(kv_lens) + c.pad_tokens
        k = rng.standard_normal((tk, c.hkv, c.d)).astype(np.float32)
        v = rng.standard_normal((tk, c.hkv, dv)).astype(np.float32)
        k[sum(kv_lens) :] = np.nan
        v[sum(kv_lens) :] = np.nan
        cu_kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
        return dict(q=q, k=k, v=v, cu_q=cu_q, cu_kv=cu_kv, sinks=sinks)
    ps = c.page_size
    max_pages = max(1, max(-(-n // ps) for n in kv_lens)) + 1
    num_pages = bs * max_pages + 3
    k = np.full((num_pages, ps, c.hkv, c.d), np.nan, np.float32)
    v = np.full((num_pages, ps, c.hkv, dv), np.nan, np.float32)
    table = rng.permutation(num_pages)[: bs * max_pages].reshape(bs, max_pages).astype(np.int32)
    for b, n in enumerate(kv_lens):
        for t in range(n):
            page, off = table[b, t // ps], t % ps
            k[page, off] = rng.standard_normal((c.hkv, c.d))
            v[page, off] = rng.standard_normal((c.hkv, dv))
        npg = -(-n // ps)
        table[b, npg:] = rng.integers(0, num_pages, max_pages - npg)  # never read
    return dict(q=q, k=k, v=v, cu_q=cu_q, table=table, lens=np.array(kv_lens, np.int32), sinks=sinks)


def _opts(c: Case):
    return dict(is_causal=c.causal, window_left=c.window_left, logit_cap=c.logit_cap, softmax_scale=c.softmax_scale)


def _kernel_opts(c: Case):
    # a poison case needs the edge cleaning, whatever the device's default
    options = None
    if c.overlap or c.ctas or c.prefetch or c.l2 is not None or c.persistent is not None:
        options = mp.PrefillOptions(
            overlap_pv=c.overlap,
            persistent=c.ctas > 0 or c.persistent,
            ctas=c.ctas,
            prefetch_k=c.prefetch,
            l2_section_kib=c.l2,
        )
    return dict(_opts(c), clean_edges=True if c.poison >= 0 else c.clean_edges, options=options)


def _run(c: Case, x, dtype):
    q, k, v = jnp.asarray(x["q"], dtype), _kv(c, x["k"], dtype, 0), _kv(c, x["v"], dtype, 1)
    s = None if x["sinks"] is None else jnp.asarray(x["sinks"])
    kw = dict(sinks=s, return_lse=True, **_kernel_opts(c), **_scales(c))
    if not c.page_size:
        return mp.mha_prefill(q, k, v, x["cu_q"], x["cu_kv"], **kw)
    return mp.mha_extend(q, k, v, x["table"], x["lens"], x["cu_q"], **kw)


def _oracle(c: Case, x, dtype):
    # the oracle sees the same rounded inputs, in f32
    r = lambda a: jnp.asarray(jnp.asarray(a, dtype), jnp.float32)  # noqa: E731
    k, v = (_kv(c, x[n], dtype, i).astype(jnp.float32) for i, n in enumerate("kv"))
    s = None if x["sinks"] is None else jnp.asarray(x["sinks"])
    mq = max(max(c.q_lens), 1)
    if not c.page_size:
        kv_lens = np.diff(x["cu_kv"])
        return reference.mha_prefill(
            r(x["q"]),
            k,
            v,
            jnp.asarray(x["cu_q"]),
            jnp.asarray(x["cu_kv"]),
            max_seqlen_q=mq,
            max_seqlen_kv=max(int(kv_lens.max(initial=0)), 1),
            sinks=s,
            return_lse=True,
            **_opts(c),
            **_scales(c),
        )
    return reference.mha_extend(
        r(x["q"]),
        k,
        v,
        jnp.asarray(x["table"]),
        jnp.asarray(x["lens"]),
        jnp.asarray(x["cu_q"]),
        max_seqlen_q=mq,
        sinks=s,
        return_lse=True,
        **_opts(c),
        **_scales(c),
    )


def _poison(c: Case, x):
    """NaN in V of key ``c.poison`` of request 0 and +inf in K of the key after it where
    request 0 has one (all heads); returns the query rows of request 0 that see either (they must come out
    non-finite, every other row as on clean data)."""
    j = c.poison
    prefix = (c.prefix or (0,) * len(c.q_lens))[0]
    kv0 = prefix + c.q_lens[0]
    assert j < kv0
    for key, arr, val in ((j, "v", np.nan), (j + 1, "k", np.inf))[: 1 + (j + 1 < kv0)]:
        if c.page_size:
            x[arr][x["table"][0, key // c.page_size], key % c.page_size] = val
        else:
            x[arr][x["cu_kv"][0] + key] = val
    pos = kv0 - c.q_lens[0] + np.arange(c.q_lens[0])  # each query's key position
    sees = pos >= j if c.causal else np.ones_like(pos, bool)
    if c.window_left >= 0:
        sees &= pos - c.window_left <= j + 1
    return np.flatnonzero(sees)


def _check(c: Case, dtype, seed=0, tol=2e-2, deterministic=True):
    x = _inputs(c, seed, dtype)
    want_o, want_lse = (np.asarray(a) for a in _oracle(c, x, dtype))  # on clean data
    bad = _poison(c, x) if c.poison >= 0 else np.zeros(0, int)
    out = _run(c, x, dtype)
    o, lse = np.asarray(out[0], np.float32), np.asarray(out[1])
    n = int(x["cu_q"][-1])
    rows = np.setdiff1d(np.arange(n), bad)
    if bad.size:
        assert not np.isfinite(o[bad]).all(axis=(1, 2)).any(), "a row that sees a NaN V must be non-finite"
    assert np.isfinite(o[rows]).all(), "NaN/Inf in a real row"
    np.testing.assert_allclose(o[rows], want_o[rows], atol=tol, rtol=tol)
    np.testing.assert_allclose(lse[rows], want_lse[rows], atol=tol, rtol=tol)
    assert (o[n:] == 0).all() and np.isneginf(lse[n:]).all(), "padding rows must be 0 / -inf"
    if deterministic:
        o2 = np.asarray(_run(c, x, dtype)[0], np.float32)
        assert np.array_equal(o2, o, equal_nan=True), "not deterministic"


# Interpreted: ragged tiles across requests with lengths 0 and 1 and a NaN/Inf-poisoned
# future key; the paged extend with pages smaller than a block, window, cap, sinks
# and poison; more KV blocks than ring stages on the GPU's default edge path (run
# twice: the determinism check); FP8 KV with poison; the non-causal 192/128 MLA shape;
# a request over several tiles; window, cap and sinks without a prefix; an extend whose
# prefixes end inside, at and before a page of 64.
CPU_CASES = [
    Case(q_lens=(97, 0, 1, 13), hq=2, hkv=1, poison=40),
    Case(
        q_lens=(9, 3), prefix=(40, 0), page_size=16, hq=2, hkv=1, window_left=20, logit_cap=5.0, sinks=True, poison=44
    ),
    # more KV blocks than ring stages (the ring wraps around), the GPU's default edge path
    Case(q_lens=(2, 40), prefix=(300, 0), page_size=32, hq=1, hkv=1, clean_edges=False),
    # FP8 KV: the producer's upcast into the f16 ring, pages smaller than a block, poison
    Case(q_lens=(5, 30), prefix=(90, 0), page_size=16, hq=2, hkv=1, kv_fp8=True, poison=92, softmax_scale=0.2),
    Case(q_lens=(21, 6), hq=2, hkv=2, d=192, dv=128, causal=False, softmax_scale=0.11),
    # request 1 starts 5 rows into an 8-row group (127 + 5 rows: two tiles) after a NaN in
    # request 0's last key, which request 1's first block reads and must zero
    Case(q_lens=(101, 127), poison=100),
    Case(q_lens=(70,), hq=2, hkv=1, window_left=20, logit_cap=5.0, sinks=True),
    Case(q_lens=(20, 1, 0), prefix=(150, 7, 4), page_size=64, hq=2, hkv=1),
    # a NaN below every query's window (prefix key 100; windows start at 127, the last key of
    # a 64-key block, and later) but in the window's first block, so only the edge cleaning
    # keeps the rows finite; the same for a non-causal window over a ragged prefill
    Case(q_lens=(9, 3), prefix=(147, 0), page_size=16, hq=2, hkv=1, window_left=20, poison=100),
    Case(q_lens=(40, 3), hq=2, hkv=1, causal=False, window_left=8, poison=5),
    # the intra-warpgroup overlap: runs of 4 unmasked blocks (the ring wraps), of 1, and
    # tiles with none; non-causal with masked first and last blocks around a run of 4
    Case(q_lens=(2, 40, 1), prefix=(600, 0, 129), page_size=32, hq=2, hkv=1, overlap=True),
    Case(q_lens=(97, 0, 1, 700), hq=2, hkv=1, causal=False, overlap=True),
    # the persistent launch: 2-3 CTAs walk every tile (rounds forwards and backwards, dead
    # items in the last round), the ring and barrier phases running on across tiles
    Case(q_lens=(97, 0, 1, 13), hq=2, hkv=1, poison=40, ctas=3),
    # one CTA per tile where the persistent launch is the default (d64, 2-byte K/V)
    Case(q_lens=(97, 0, 1, 13), hq=2, hkv=1, poison=40, persistent=False),
    Case(q_lens=(5, 30), prefix=(90, 0), page_size=16, hq=2, hkv=1, kv_fp8=True, poison=92, ctas=2),
    Case(q_lens=(2, 40, 1), prefix=(600, 0, 129), page_size=32, hq=2, hkv=1, overlap=True, ctas=3),
    # the launch in L2 sections of one KV head each (24-33 KB of K/V a head against 32 KiB),
    # persistent, the padding request's tiles and dead items last
    Case(q_lens=(97, 0, 1, 130), hq=2, hkv=2, poison=40, ctas=3, l2=32),
    # 192/128 with 128-key blocks, the output tiles in a V ring slot: tiles of 0 to 3 blocks
    Case(q_lens=(300, 0, 1, 40), hq=2, hkv=2, d=192, dv=128, poison=130),
    # PrefillOptions(prefetch_k=True) with the edge cleaning (a poison case), and over an FP8
    # paged prefix whose ring wraps
    Case(q_lens=(97, 0, 1, 13), hq=2, hkv=1, poison=40, prefetch=True),
    Case(q_lens=(5, 30), prefix=(90, 0), page_size=16, hq=2, hkv=1, kv_fp8=True, poison=92, prefetch=True),
]


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
@pytest.mark.parametrize("c", CPU_CASES, ids=str)
def test_interpreted(c):
    # A second run checks determinism; interpreted, one case does it (each run is minutes):
    # the ring-wrap case, the cheapest one with several KV blocks per tile.
    with gpu_interpret():
        _check(c, jnp.float16, deterministic=c == CPU_CASES[2])


GPU_CASES = [
    Case(q_lens=(1000, 0, 1, 97, 2049), hq=32, hkv=8, d=128, poison=500),
    Case(q_lens=(777, 300), hq=16, hkv=16, d=64, causal=False),
    Case(q_lens=(1500,), hq=8, hkv=2, d=256, window_left=300, logit_cap=30.0, sinks=True, poison=700),
    Case(q_lens=(900, 33), hq=16, hkv=16, d=192, dv=128, poison=10),
    Case(q_lens=(300, 5, 129), prefix=(2000, 0, 77), page_size=16, hq=32, hkv=8, d=128, poison=2100),
    Case(q_lens=(513, 64), prefix=(1000, 3000), page_size=64, hq=32, hkv=8, d=128, window_left=700),
    Case(q_lens=(256,), prefix=(4000,), page_size=128, hq=8, hkv=1, d=128),
    Case(q_lens=(300, 5, 129), prefix=(2000, 0, 77), page_size=16, hq=32, hkv=8, d=128, kv_fp8=True, poison=2100),
    Case(q_lens=(513, 64), prefix=(1000, 3000), page_size=64, hq=16, hkv=4, d=256, window_left=700, kv_fp8=True),
    Case(q_lens=(97, 1000), prefix=(33, 0), page_size=128, hq=16, hkv=16, d=64, causal=False, kv_fp8=True),
    Case(q_lens=(400, 1), hq=16, hkv=16, d=192, dv=128, kv_fp8=True, sinks=True),
    # the intra-warpgroup overlap at each head width, ragged and paged, bf16 and FP8
    Case(q_lens=(1000, 0, 1, 97, 2049), hq=32, hkv=8, d=128, poison=500, overlap=True),
    Case(q_lens=(777, 300), hq=16, hkv=16, d=64, causal=False, overlap=True),
    Case(q_lens=(1500,), hq=8, hkv=2, d=256, window_left=300, logit_cap=30.0, sinks=True, overlap=True),
    Case(q_lens=(900, 33), hq=16, hkv=16, d=192, dv=128, poison=10, overlap=True),
    Case(q_lens=(300, 5, 129), prefix=(2000, 0, 77), page_size=16, hq=32, hkv=8, d=128, overlap=True),
    Case(q_lens=(513, 64), prefix=(1000, 3000), page_size=64, hq=16, hkv=4, d=128, kv_fp8=True, overlap=True),
    # the persistent launch: 7 CTAs (many rounds each), and one per SM
    Case(q_lens=(1000, 0, 1, 97, 2049), hq=32, hkv=8, d=128, poison=500, ctas=7),
    Case(
        q_lens=(300, 5, 129),
        prefix=(2000, 0, 77),
        page_size=16,
        hq=32,
        hkv=8,
        d=128,
        kv_fp8=True,
        poison=2100,
        ctas=132,
    ),
    Case(q_lens=(1500,), hq=8, hkv=2, d=256, window_left=300, logit_cap=30.0, sinks=True, ctas=132),
    Case(q_lens=(777, 300), hq=16, hkv=16, d=64, causal=False, overlap=True, ctas=132),
    Case(q_lens=(777, 300), hq=16, hkv=16, d=64, causal=False, persistent=False),
    # causal d64 over 2-byte K/V: the persistent launch by default
    Case(q_lens=(1000, 0, 1, 97, 2049), hq=32, hkv=8, d=64, poison=500),
    # the launch in L2 sections: MHA with 2 KV heads a section (2,049 keys, 1 MB a head,
    # against 2 MiB), persistent by default; GQA over a paged prefix, one CTA per tile (FP8)
    Case(q_lens=(1000, 0, 1, 97, 2049), hq=16, hkv=16, d=128, poison=500, l2=2048),
    Case(q_lens=(300, 5, 129), prefix=(2000, 0, 77), page_size=16, hq=32, hkv=8, kv_fp8=True, poison=2100, l2=512),
    # prefetch_k with the edge cleaning (poison), ragged and over an FP8 paged prefix
    Case(q_lens=(1000, 0, 1, 97, 2049), hq=32, hkv=8, d=128, poison=500, prefetch=True),
    Case(
        q_lens=(300, 5, 129), prefix=(2000, 0, 77), page_size=16, hq=32, hkv=8, kv_fp8=True, poison=2100, prefetch=True
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=str)
def test_gpu(c):
    if not on_gpu():
        pytest.skip("needs a GPU")
    _check(c, jnp.bfloat16, tol=3e-2)


@pytest.mark.skipif(not (on_gpu() or interpreter_available()), reason="needs a GPU or the interpreter")
@pytest.mark.parametrize("n_q, with_sinks", [(0, False), (5, False), (5, True)], ids=str)
def test_empty_queries_or_keys(n_q, with_sinks):
    """No query rows, or query rows whose requests have no keys at all (``k``/``v`` with
    0 rows): the former returns empty arrays without a launch, the latter gives 0 and an
    LSE of -inf (or the sink's logit), as the reference does. A TMA descriptor cannot
    describe a 0-row array, so the kernel pads ``k``/``v`` to 8 rows there (the GPU
    raised a ZeroDivisionError at lowering before)."""
    rng = np.random.default_rng(3)
    dt = jnp.bfloat16 if on_gpu() else jnp.float16
    q = jnp.asarray(rng.standard_normal((n_q, 4, 128)), dt)
    k, v = jnp.zeros((0, 2, 128), dt), jnp.zeros((0, 2, 128), dt)
    cu_q = jnp.array([0, min(n_q, 3), n_q], jnp.int32)
    cu_kv = jnp.zeros((3,), jnp.int32)
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32) if with_sinks else None
    kw = dict(cu_seqlens_kv=cu_kv, sinks=sinks, return_lse=True, max_seqlen_q=4, max_seqlen_kv=1)
    with contextlib.nullcontext() if on_gpu() else gpu_interpret():
        out, lse = mp.mha_prefill(q, k, v, cu_q, **kw)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    ref, ref_lse = reference.mha_prefill(f32(q), f32(k), f32(v), cu_q, **kw)
    assert out.shape == (n_q, 4, 128) and lse.shape == (n_q, 4)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))
    if not on_gpu():  # what the GPU compiler sees, lowered on this CPU
        fn = functools.partial(mp.mha_prefill, **kw)
        text = jax.jit(fn).trace(q, k, v, cu_q).lower(lowering_platforms=("cuda",)).as_text()
        assert ("jattn_prefill" in text) == bool(n_q)


@pytest.mark.skipif(not (on_gpu() or interpreter_available()), reason="needs a GPU or the interpreter")
def test_extend_over_a_page_table_with_no_columns():
    """A page table with no columns holds no keys: query rows over it give 0 and an LSE
    of -inf (the sinks' logit with sinks), whatever ``cache_seqlens`` says under a trace,
    as the reference does with lengths clipped to the table (the op raises for such
    lengths where they are concrete). The page lookups indexed a column that was not
    there before (a TypeError at trace time)."""
    rng = np.random.default_rng(5)
    dt = jnp.bfloat16 if on_gpu() else jnp.float16
    q = jnp.asarray(rng.standard_normal((9, 4, 128)), dt)
    kc = jnp.asarray(rng.standard_normal((3, 16, 2, 128)), dt)
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    pt, lens, cu = jnp.zeros((2, 0), jnp.int32), jnp.array([5, 4], jnp.int32), jnp.array([0, 5, 9], jnp.int32)
    kw = dict(sinks=sinks, return_lse=True, max_seqlen_q=8)
    with contextlib.nullcontext() if on_gpu() else gpu_interpret():
        out, lse = jax.jit(functools.partial(mp.mha_extend, **kw))(q, kc, kc, pt, lens, cu)
    ref, ref_lse = reference.mha_extend(
        q.astype(jnp.float32), kc.astype(jnp.float32), kc.astype(jnp.float32), pt, jnp.zeros_like(lens), cu, **kw
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6)
    assert (np.asarray(out) == 0).all()


LOWER_CASES = [
    ("prefill", 128, 128, False, -1),
    ("prefill", 64, 64, False, -1),
    ("prefill", 192, 128, True, -1),
    ("prefill", 256, 256, True, 64),
    ("extend16", 128, 128, True, 64),
    ("extend16_fp8", 128, 128, True, -1),
    ("extend64_fp8", 256, 256, False, 64),
    ("prefill_fp8", 192, 128, True, -1),
]


@pytest.mark.skipif(on_gpu(), reason="the GPU runs the kernels themselves")
@pytest.mark.parametrize("mode, d, dv, clean, window", LOWER_CASES, ids=str)
def test_lowers_for_cuda(mode, d, dv, clean, window):
    """The kernel lowers for CUDA on this CPU: Mosaic GPU's layout inference and TMA
    tiling rules run at lowering, so this catches, without a GPU, programs the
    interpreter accepts and the GPU compiler rejects (e.g. a GMEM row count that is not
    a multiple of 8, which the kernel pads)."""

    t = 1001  # not a multiple of 8
    q = jnp.zeros((t, 8, d), jnp.bfloat16)
    cu = jnp.array([0, 500, t], jnp.int32)
    kvd = jnp.float8_e4m3fn if mode.endswith("_fp8") else jnp.bfloat16
    ps = 64 if mode.startswith("extend64") else 16
    if mode.startswith("prefill"):
        k, v = jnp.zeros((t, 2, d), kvd), jnp.zeros((t, 2, dv), kvd)

        def fn(q, k, v, cu):
            return mp.mha_prefill(q, k, v, cu, window_left=window, clean_edges=clean, return_lse=True)

        args = (q, k, v, cu)
    else:
        k, v = jnp.zeros((80, ps, 2, d), kvd), jnp.zeros((80, ps, 2, dv), kvd)
        pt, lens = jnp.zeros((2, 40), jnp.int32), jnp.array([600, 501], jnp.int32)

        def fn(q, k, v, cu):
            return mp.mha_extend(q, k, v, pt, lens, cu, window_left=window, clean_edges=clean)

        args = (q, k, v, cu)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "jattn_prefill" in text
    if clean:  # the same with the next K awaited during P @ V (PrefillOptions.prefetch_k)
        opts = mp.PrefillOptions(prefetch_k=True)
        if mode.startswith("prefill"):
            pf = lambda q, k, v, cu: mp.mha_prefill(q, k, v, cu, window_left=window, clean_edges=True, options=opts)  # noqa: E731
        else:
            pf = lambda q, k, v, cu: mp.mha_extend(
                q, k, v, pt, lens, cu, window_left=window, clean_edges=True, options=opts
            )  # noqa: E731
        assert "jattn_prefill" in jax.jit(pf).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # the persistent launch is the default where it was measured faster: d64 and d128, 2-byte K/V
    assert ("_persistent" in text) == (d == dv and d in (64, 128) and not mode.endswith("_fp8"))
    if mode == "extend16":  # the launch in L2 sections reads one more array
        opts = mp.PrefillOptions(l2_section_kib=64)
        lf = lambda q, k, v, cu: mp.mha_extend(q, k, v, pt, lens, cu, window_left=window, options=opts)  # noqa: E731
        assert "jattn_prefill" in jax.jit(lf).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _padded_plan_arrays(x, c: Case):
    """The kernel's view of a case's arrays: the padding request appended, as in
    ``mosaic_prefill._attention``."""
    t = x["q"].shape[0]
    cu_q = np.concatenate([x["cu_q"], [t]]).astype(np.int32)
    if c.page_size:
        kv_start = np.zeros(len(c.q_lens) + 1, np.int32)
        kv_len = np.concatenate([x["lens"], [0]]).astype(np.int32)
        table = np.concatenate([x["table"], np.zeros((1, x["table"].shape[1]), np.int32)])
    else:
        kv_start = np.concatenate([x["cu_kv"][:-1], [0]]).astype(np.int32)
        kv_len = np.concatenate([np.diff(x["cu_kv"]), [0]]).astype(np.int32)
        table = np.zeros((1, 1), np.int32)
    return cu_q, kv_start, kv_len, table


@pytest.mark.parametrize(
    "c",
    [
        Case(q_lens=(97, 0, 1, 13), poison=40),
        Case(q_lens=(9, 3), prefix=(40, 0), page_size=16, poison=44),
        Case(q_lens=(9, 3), prefix=(40, 0), page_size=16, poison=20),  # in the prefix: visible to all
        Case(q_lens=(9, 3), prefix=(40, 0), page_size=16, poison=48),  # the last new key
        Case(q_lens=(9, 3), prefix=(40, 0), page_size=16, poison=39),  # the last prefix key
        # with a window the first keys a row sees may lie in the prefix: always cleaned
        Case(q_lens=(9, 3), prefix=(147, 0), page_size=16, window_left=20, poison=100),
    ],
    ids=str,
)
def test_v_bad_flag(c):
    """The per-call check that turns the edge cleaning on: False on clean data even
    with NaN padding rows and NaN unused pages (else every call pays the cleaning),
    True for a non-finite V among the rows it covers (else the poison tests fail)."""
    x = _inputs(c, 0, jnp.float32)
    cu_q, kv_start, kv_len, table = _padded_plan_arrays(x, c)

    def flag(v):
        return bool(
            prefill_plan.v_may_be_nonfinite(
                jnp.asarray(v), cu_q, kv_start, kv_len, table, c.page_size, c.window_left, x["q"].shape[0]
            )
        )

    always = c.page_size > 0 and c.window_left >= 0  # an extend with a window: cleaned whatever V holds
    assert flag(x["v"]) == always, "clean data (NaN only in padding / unused pages) must not ask for the cleaning"
    _poison(c, x)
    prefix = (c.prefix or (0,))[0]
    # extend: only the new tokens' V is checked (the causal diagonal holds only them)
    assert flag(x["v"]) == (not c.page_size or c.poison >= prefix or always)


def test_merge_sides_places_every_row():
    """Each real row comes from the direct output or from exactly its side slot."""
    # starts 3, 70, 200, 205 are not 8-aligned; the last request's 64 rows, from an aligned
    # start, end on a chunk's last row (no side slot)
    cu_q = jnp.asarray([0, 3, 3, 70, 200, 205, 208, 272], jnp.int32)
    t, hq, dv = 280, 2, 4
    bs = cu_q.shape[0] - 1
    o = jnp.full((t, hq, dv), -1.0)
    lse = jnp.full((hq, t), -1.0)
    side = jnp.arange(2 * bs * 64, dtype=jnp.float32).reshape(2 * bs, 64, 1, 1) * jnp.ones((1, 1, hq, dv))
    lse_side = jnp.broadcast_to(jnp.arange(2 * bs * 64, dtype=jnp.float32).reshape(2 * bs, 1, 64), (2 * bs, hq, 64))
    out, out_lse = prefill_plan.merge_sides(o, lse, side, lse_side, cu_q)
    out, out_lse = np.asarray(out[:, 0, 0]), np.asarray(out_lse[:, 0])
    for b in range(bs):
        s, e = int(cu_q[b]), int(cu_q[b + 1])
        dq = s % 8
        for r in range(e - s):
            chunk, j = divmod(r + dq, 64)
            last = (e - s - 1 + dq) // 64
            straddles = (chunk == 0 and dq > 0) or (chunk == last and (chunk * 64 - dq + 64 > e - s))
            if chunk == 0 and dq > 0:
                want = (2 * b) * 64 + j
            elif straddles:
                want = (2 * b + 1) * 64 + j
            else:
                want = -1.0  # written by the kernel directly
            assert out[s + r] == want and out_lse[s + r] == want, (b, r)


@pytest.mark.parametrize("hq, group", [(8, 1), (8, 4), (6, 2)])
def test_section_items_orders_requests_then_sections(hq, group):
    """``prefill_plan.section_items``: a permutation of the (tile, head) items; the
    regrouped tiles are the same tiles, request by request (in the order of each
    request's longest tile), each request's still longest first; within a request the
    items run section by section, the section's query heads fastest, each section as
    many KV heads as the budget holds (at least one, at most all); the tiles of no
    request last, in place."""
    q_lens = [300, 0, 1, 1000, 129, 97]
    kv_lens = [300, 5, 40, 1000, 2000, 97]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1]) + 7
    cu_p, _, kl, _ = prefill_plan.with_padding_request(
        jnp.asarray(cu), jnp.zeros(6, jnp.int32), jnp.asarray(kv_lens), jnp.zeros((6, 1), jnp.int32), t
    )
    nt = -(-(t + 134 * 7) // 128)
    req0, loc0 = prefill_plan.tile_plan(cu_p, kl, nt, is_causal=True, window_left=-1)
    key_bytes, budget, hkv = 256, 1 << 18, hq // group  # 1,024 keys a KV head
    req, loc, item = (
        np.asarray(a)
        for a in prefill_plan.section_items(
            req0, loc0, kl, num_q_heads=hq, group=group, key_bytes=key_bytes, budget=budget
        )
    )
    req0, loc0 = np.asarray(req0), np.asarray(loc0)
    assert sorted(item) == list(range(nt * hq))
    assert sorted(zip(req, loc)) == sorted(zip(req0, loc0))
    live = req0 >= 0
    assert (req[~live] == -1).all() and (req[: live.sum()] >= 0).all()
    first = {b: int(np.argmax(req0 == b)) for b in set(req0[live].tolist())}
    runs = [int(b) for i, b in enumerate(req[live]) if i == 0 or b != req[i - 1]]
    assert runs == sorted(first, key=first.get)  # each request once, longest tile first
    for b in runs:
        assert list(loc[req == b]) == list(loc0[req0 == b])  # its tiles in the same order
    items = [(int(w) // hq, int(w) % hq) for w in item]
    pos = 0
    for b in runs:
        tiles = np.flatnonzero(req == b)
        hs = int(np.clip(budget // max(int(np.asarray(kl)[b]) * key_bytes, 1), 1, hkv))
        for s0 in range(0, hkv, hs):
            heads = list(range(s0 * group, min(s0 + hs, hkv) * group))
            want = [(int(tt), h) for tt in tiles for h in heads]
            assert items[pos : pos + len(want)] == want, (b, s0)
            pos += len(want)
    assert items[pos:] == [(w // hq, w % hq) for w in range(pos, nt * hq)]  # dead tiles in place
    assert any(int(np.asarray(kl)[b]) * key_bytes > budget for b in runs)  # a request of several sections


def _walk_loads(costs, ctas):
    """Each CTA's work in the persistent walk: round ``r`` gives CTA ``c`` launch position
    ``r * ctas + c`` in even rounds and ``r * ctas + ctas - 1 - c`` in odd ones."""
    loads = np.zeros(ctas)
    for w, x in enumerate(costs):
        r, c = divmod(w, ctas)
        loads[c if r % 2 == 0 else ctas - 1 - c] += x
    return loads


@pytest.mark.parametrize(
    "q_lens, hq, ctas, heads",
    # the third: 4 x 4096 MHA at 24 MiB sections (2 MiB a head), as measured on the GPU; the
    # last: sections of an odd item count (9 tiles x 3 heads)
    [((1024, 1024), 8, 6, 3), ((1500, 1500, 700), 8, 8, 3), ((4096,) * 4, 32, 132, 12), ((1152,) * 3, 9, 8, 3)],
)
def test_folded_sections_even_out_the_persistent_walk(q_lens, hq, ctas, heads):
    """``section_items(..., ctas=C)`` folds each section for the persistent walk: still
    a permutation of the items, each item within the round pairs its section spans, and
    the CTAs' work (a tile's key blocks plus one) even where the plain section order
    leaves it uneven (sections of ``heads`` heads of the longest request, ending
    mid-round)."""
    kv_lens = list(q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1])
    bs = len(q_lens)
    nt = -(-(t + 134 * bs) // 128)
    kl = jnp.asarray(np.array(kv_lens, np.int32))
    req0, loc0 = prefill_plan.tile_plan(jnp.asarray(cu), kl, nt, is_causal=True, window_left=-1)
    kw = dict(num_q_heads=hq, group=1, key_bytes=512, budget=heads * max(kv_lens) * 512)

    def loads_and_items(c):
        req, loc, item = (np.asarray(a) for a in prefill_plan.section_items(req0, loc0, kl, ctas=c, **kw))
        work = np.array([0 if r < 0 else -(-min((j + 1) * 128, kv_lens[r]) // 128) + 1 for r, j in zip(req, loc)])
        return _walk_loads(work[item // hq], ctas), item, req

    plain, item0, req = loads_and_items(0)
    folded, item, _ = loads_and_items(ctas)
    assert sorted(item) == list(range(nt * hq))
    # the fold moves an item only within the round pairs its section's plain order spans

    def section(w):  # (request, which section of its heads)
        b = int(req[w // hq])
        return b, (w % hq) // (hq if b < 0 else max(1, min(hq, kw["budget"] // (kv_lens[b] * 512))))

    span = {}  # section -> its first and last plain positions
    for p0, w in enumerate(item0):
        lo, hi = span.get(section(int(w)), (p0, p0))
        span[section(int(w))] = (min(lo, p0), max(hi, p0))
    for p, w in enumerate(item):
        lo, hi = span[section(int(w))]
        assert lo // (2 * ctas) <= p // (2 * ctas) <= hi // (2 * ctas), (p, int(w))
    assert plain.max() / plain.mean() > 1.06
    assert folded.max() / folded.mean() < 1.05, folded.max() / folded.mean()


@pytest.mark.parametrize(
    "q_lens, hq, heads",
    # the fold gains (the first), loses (the second: sections of 10 heads end mid-round), ties
    [((1000,), 40, 4), ((983, 249), 16, 10), ((2048,) * 3, 8, 1)],
)
def test_sections_fold_only_where_the_walk_gains_and_not_where_l2_holds_everything(q_lens, hq, heads):
    """With each tile's work (``tile_plan(with_work=True)``), ``section_items`` keeps the
    fold only where the walk's most loaded CTA gets no more work than in the plain
    section order (a tile: its keys plus 128), so it is never worse than either; and a
    call whose K/V fit in the budget keeps the default order (the identity)."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    bs, ctas = len(q_lens), 132
    nt = -(-(int(cu[-1]) + 134 * bs) // 128)
    kl = jnp.asarray(np.array(q_lens, np.int32))
    req0, loc0, work = prefill_plan.tile_plan(jnp.asarray(cu), kl, nt, is_causal=True, window_left=-1, with_work=True)
    kw = dict(num_q_heads=hq, group=1, key_bytes=512, budget=heads * max(q_lens) * 512)

    def walk_max(c, w=None):
        req, loc, item = (np.asarray(a) for a in prefill_plan.section_items(req0, loc0, kl, ctas=c, work=w, **kw))
        assert sorted(item) == list(range(nt * hq))
        cost = np.array([0 if r < 0 else min((j + 1) * 128, q_lens[r]) + 1 + 128 for r, j in zip(req, loc)])
        return _walk_loads(cost[item // hq], ctas).max()

    plain, folded, chosen = walk_max(0), walk_max(ctas), walk_max(ctas, work)
    assert chosen == min(plain, folded), (plain, folded, chosen)
    assert (folded < plain) == (q_lens == (1000,)) and (folded > plain) == (q_lens == (983, 249))
    # the whole call's K/V in one budget: the default order, untouched
    big = dict(kw, budget=sum(q_lens) * hq * 512)
    req, loc, item = prefill_plan.section_items(req0, loc0, kl, ctas=ctas, work=work, **big)
    assert (np.asarray(item) == np.arange(nt * hq)).all()
    assert (np.asarray(req) == np.asarray(req0)).all() and (np.asarray(loc) == np.asarray(loc0)).all()


def test_bench_option_sets_parse_and_refuse_unknown_names():
    from jattn.bench.prefill import parse_options

    assert parse_options("") == [("", None)]
    got = parse_options("default; overlap_pv=1,fence_softmax=0")
    assert got == [("", None), ("overlap_pv=1,fence_softmax=0", mp.PrefillOptions(overlap_pv=True))]
    assert parse_options("block_kv=64")[0][1] == mp.PrefillOptions(block_kv=64)
    # an ``int | None`` field stays an int: 0 turns the L2 sections off, not False
    assert parse_options("l2_section_kib=0")[0][1].l2_section_kib == 0
    assert parse_options("l2_section_kib=24576")[0][1].l2_section_kib == 24576
    for bad in ("overlap=1", "overlap_pv=x", "overlap_pv"):
        with pytest.raises(ValueError, match="NAME=INT"):
            parse_options(bad)


def test_l2_sections_are_on_by_default_only_where_each_query_head_has_its_own_kv_head(monkeypatch):
    """``PrefillOptions.l2_section_kib=None`` resolves to ``AUTO_L2_SECTION_KIB`` for
    MHA and MLA prefill (one query head a KV head) and to 0 with GQA; a set value is
    kept, and a bad one is refused by name. A call plans the sections (and lowers)
    exactly where the resolved value is not 0, folded for the persistent walk's CTAs
    unless ``fold_sections=False``."""
    from jattn.pallas_kernels.mosaic_prefill_config import AUTO_L2_SECTION_KIB, resolve_l2_section_kib

    auto = mp.PrefillOptions()
    assert resolve_l2_section_kib(auto, 32, 32) == AUTO_L2_SECTION_KIB > 0
    assert resolve_l2_section_kib(auto, 128, 128) == AUTO_L2_SECTION_KIB
    assert resolve_l2_section_kib(auto, 32, 8) == 0
    assert resolve_l2_section_kib(mp.PrefillOptions(l2_section_kib=0), 32, 32) == 0
    assert resolve_l2_section_kib(mp.PrefillOptions(l2_section_kib=64), 32, 8) == 64
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="l2_section_kib"):
            resolve_l2_section_kib(mp.PrefillOptions(l2_section_kib=bad), 4, 4)
    calls = []
    real = prefill_plan.section_items
    record = lambda *a, **kw: calls.append((kw["budget"], kw["ctas"])) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(prefill_plan, "section_items", record)
    q, cu = jnp.zeros((64, 4, 64), jnp.bfloat16), jnp.array([0, 64], jnp.int32)
    auto = AUTO_L2_SECTION_KIB << 10
    for hkv, options, want in (
        (4, None, [(auto, 12)]),  # d64: persistent by default, one CTA per item (4 heads x 3 tiles)
        (4, mp.PrefillOptions(persistent=False), [(auto, 0)]),  # one CTA per tile: nothing to fold for
        (1, None, []),
        (4, mp.PrefillOptions(l2_section_kib=0), []),
        (1, mp.PrefillOptions(l2_section_kib=8), [(8 << 10, 12)]),
        # the persistent walk folds the sections for its CTA count (at most one per item)
        (4, mp.PrefillOptions(persistent=True, ctas=3), [(auto, 3)]),
        (4, mp.PrefillOptions(persistent=True, ctas=50), [(auto, 12)]),  # 4 heads x 3 tiles (slack included)
        (4, mp.PrefillOptions(persistent=True, ctas=3, fold_sections=False), [(auto, 0)]),
    ):
        calls.clear()
        k = jnp.zeros((64, hkv, 64), jnp.bfloat16)
        fn = functools.partial(mp.mha_prefill, options=options)
        assert "jattn_prefill" in jax.jit(fn).trace(q, k, k, cu).lower(lowering_platforms=("cuda",)).as_text()
        assert calls == want, (hkv, options)


def test_persistent_launch_is_refused_where_the_output_borrows_the_ring():
    q, v = jnp.zeros((8, 1, 192), jnp.float16), jnp.zeros((8, 1, 128), jnp.float16)
    with pytest.raises(ValueError, match="head_dim == head_dim_v"):
        mp.mha_prefill(q, q, v, jnp.array([0, 8], jnp.int32), options=mp.PrefillOptions(persistent=True))


def test_persistent_launch_by_default_where_it_was_measured_faster():
    """``PrefillOptions(persistent=None)``: the persistent launch for equal widths 64 and 128
    over 2-byte K/V (docs/PERF.md); one CTA per tile at 256, for FP8 K/V, and for 192/128,
    whose output borrows a ring slot (the persistent launch is refused there)."""
    from jattn.pallas_kernels.mosaic_prefill_config import persistent_by_default

    assert persistent_by_default(64, 64, False) and persistent_by_default(128, 128, False)
    assert not persistent_by_default(256, 256, False) and not persistent_by_default(192, 128, False)
    assert not persistent_by_default(64, 64, True) and not persistent_by_default(128, 128, True)


def test_negative_cta_count_is_refused():
    q = jnp.zeros((8, 1, 64), jnp.float16)
    with pytest.raises(ValueError, match="PrefillOptions.ctas=-1"):
        mp.mha_prefill(q, q, q, jnp.array([0, 8], jnp.int32), options=mp.PrefillOptions(persistent=True, ctas=-1))


def test_block_kv_that_does_not_fit_is_refused_by_name():
    """``PrefillOptions.block_kv`` took any of 64 / 128 with two ring stages: 128 keys at
    head_dim 256 (or FP8 192/128), and 64 with two stages at FP8 head_dim 256, exceeded
    shared memory in the build. 64 takes the width's stages, 128 only where the width
    takes it by default; ``unsupported_reason`` refuses K/V whose dims disagree with q's."""
    assert mp._choose_blocks(256, 256, True, 64) == mp._choose_blocks(256, 256, True) == (64, 1)
    assert mp._choose_blocks(192, 128, False, 64) == (64, 2) and mp._choose_blocks(64, 64, True, 128) == (128, 2)
    for d, dv, fp8 in ((256, 256, False), (256, 256, True), (192, 128, True)):
        with pytest.raises(ValueError, match=rf"PrefillOptions.block_kv=128 at head dims {d}/{dv}"):
            mp._choose_blocks(d, dv, fp8, 128)
    q = jnp.zeros((8, 2, 256), jnp.float16)
    with pytest.raises(ValueError, match="PrefillOptions.block_kv=128 at head dims 256/256"):
        mp.mha_prefill(q, q, q, jnp.array([0, 8], jnp.int32), options=mp.PrefillOptions(block_kv=128))
    q64 = jnp.zeros((8, 2, 64), jnp.float16)
    assert "head_dim 64" in mp.unsupported_reason(q64, jnp.zeros((8, 2, 128), jnp.float16), q64)
    assert "head_dim 64" in mp.unsupported_reason(q64, q64, jnp.zeros((8, 1, 64), jnp.float16))


def test_a_cta_count_needs_the_persistent_launch():
    """``PrefillOptions(ctas=N)`` was ignored where the launch was not persistent: with
    ``persistent=False`` it is refused by name; with ``persistent=None`` it turns the
    persistent launch on (refused where the output borrows the ring, as ``True`` is)."""
    q = jnp.zeros((8, 1, 64), jnp.float16)
    with pytest.raises(ValueError, match="ctas=4 sizes the persistent launch; persistent=False"):
        mp.mha_prefill(q, q, q, jnp.array([0, 8], jnp.int32), options=mp.PrefillOptions(persistent=False, ctas=4))
    q192, v = jnp.zeros((8, 1, 192), jnp.float16), jnp.zeros((8, 1, 128), jnp.float16)
    with pytest.raises(ValueError, match="head_dim == head_dim_v"):
        mp.mha_prefill(q192, q192, v, jnp.array([0, 8], jnp.int32), options=mp.PrefillOptions(ctas=4))


def test_prefetch_k_and_overlap_pv_are_refused_together():
    q = jnp.zeros((8, 1, 64), jnp.float16)
    opts = mp.PrefillOptions(prefetch_k=True, overlap_pv=True)
    with pytest.raises(ValueError, match="prefetch_k and overlap_pv"):
        mp.mha_prefill(q, q, q, jnp.array([0, 8], jnp.int32), options=opts)


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
def test_extend_with_no_pages_or_heads_on_mosaic_gives_empty_rows():
    """A width-0 page table (no request has a key) or zero query heads: every backend gives
    the reference's zero rows and ``-inf`` LSE instead of failing inside the kernel's plan."""
    kc = jnp.ones((4, 16, 1, 64), jnp.float16)
    sl = jnp.zeros((2,), jnp.int32)
    cu = jnp.zeros((3,), jnp.int32)
    with gpu_interpret():
        for hq in (2, 0):
            q = jnp.ones((5, hq, 64), jnp.float16)
            pt = jnp.zeros((2, 0 if hq else 1), jnp.int32)
            out, lse = jattn.mha_extend_with_kvcache(
                q, kc, kc, pt, sl, cu, max_seqlen_q=4, return_lse=True, backend="mosaic"
            )
            assert out.shape == q.shape and not np.asarray(out, np.float32).any()
            assert lse.shape == (5, hq) and np.isneginf(np.asarray(lse)).all()


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
def test_array_softmax_scale_on_the_mosaic_kernels():
    """An f32 array ``softmax_scale`` (the ops accept one) is folded into the traced score
    scale instead of failing as an unhashable static argument: decode and prefill."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float16)
    kc = jnp.asarray(rng.standard_normal((6, 16, 2, 64)), jnp.float16)
    pt, sl = jnp.asarray([[1, 2], [3, 4]], jnp.int32), jnp.asarray([20, 9], jnp.int32)
    kw = dict(softmax_scale=jnp.float32(0.2), k_scale=jnp.float32(1.5))
    want = jattn.mha_decode_with_kvcache(q, kc, kc, pt, sl, softmax_scale=0.2, k_scale=1.5, backend="xla")
    with gpu_interpret():
        got = jattn.mha_decode_with_kvcache(q, kc, kc, pt, sl, backend="mosaic", **kw)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-3)
    # q, k, v drawn apart: with q = k the diagonal score dominates at any scale
    qp, kp, vp = (jnp.asarray(rng.standard_normal((21, 2, 64)), jnp.float16) for _ in range(3))
    cu = jnp.asarray([0, 13, 21], jnp.int32)
    want = jattn.mha_prefill(qp, kp, vp, cu, max_seqlen_q=13, softmax_scale=0.2, k_scale=1.5, backend="xla")
    with gpu_interpret():
        got = jattn.mha_prefill(qp, kp, vp, cu, max_seqlen_q=13, backend="mosaic", **kw)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-3)


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
def test_prefill_with_no_keys_on_mosaic_gives_empty_rows():
    """``k`` / ``v`` of zero rows (every request has zero keys): the reference's zero rows and
    ``-inf`` LSE on every backend, not a kernel over an empty array."""
    q = jnp.ones((5, 2, 64), jnp.float16)
    kv = jnp.ones((0, 1, 64), jnp.float16)
    cu_q, cu_kv = jnp.asarray([0, 5], jnp.int32), jnp.asarray([0, 0], jnp.int32)
    with gpu_interpret():
        out, lse = jattn.mha_prefill(
            q, kv, kv, cu_q, cu_kv, max_seqlen_q=5, max_seqlen_kv=1, is_causal=False, return_lse=True,
            backend="mosaic",
        )  # fmt: skip
    assert out.shape == q.shape and not np.asarray(out, np.float32).any() and np.isneginf(np.asarray(lse)).all()


def test_the_host_code_hands_the_kernel_its_configuration_and_scales(monkeypatch, fresh_jit_caches):
    """``mha_prefill``'s host code around a stubbed kernel: the head group, the edge
    cleaning (on by default for a window without causality, off where asked), the score
    scale ``k_scale / sqrt(head_dim)`` (q/k width, not v's), the sinks, the per-call V flag,
    FP8 K/V computing in f16, and the output: ``v_scale`` applied, in q's dtype, with the
    LSE ``[tokens, heads]``. The stub's LSE rows 0-2 carry the score scale, the head's sink
    and the V flag (traced operands) out; its output is 2 everywhere."""
    seen = []

    def fake_run(cfg, cdtype, arrays):
        seen.append((cfg, cdtype))
        tq, hq, bs, dv = arrays[8].shape[0], cfg.num_q_heads, arrays[3].shape[0] - 1, cfg.head_dim_v
        scales = arrays[7]
        lse = jnp.full((hq, tq), 0.25, jnp.float32)
        lse = lse.at[:, 0].set(scales[0]).at[:, 1].set(scales[1 : 1 + hq]).at[:, 2].set(scales[-1])
        o_side, lse_side = jnp.full((2 * bs, 64, hq, dv), -1.0, cdtype), jnp.full((2 * bs, hq, 64), -1.0, jnp.float32)
        return jnp.full((tq, hq, dv), 2.0, cdtype), lse, o_side, lse_side

    monkeypatch.setattr(mp, "run", fake_run)
    rng = np.random.default_rng(23)
    cu = jnp.array([0, 64, 128], jnp.int32)  # 8-aligned requests of 64 rows: no side slots
    q = jnp.asarray(rng.standard_normal((128, 2, 192)), jnp.bfloat16)
    k = reference.quantize_fp8(jnp.asarray(rng.standard_normal((128, 1, 192)), jnp.float32), 1.0)
    v = rng.standard_normal((128, 1, 128)).astype(np.float32)
    sinks = jnp.asarray(rng.standard_normal(2), jnp.float32)
    kw = dict(is_causal=False, window_left=5, sinks=sinks, k_scale=1.5, v_scale=0.5, return_lse=True)
    for bad in (False, True):
        v[70, 0, 3] = np.nan if bad else v[70, 0, 3]
        o, lse = mp.mha_prefill(q, k, reference.quantize_fp8(jnp.asarray(v), 1.0), cu, **kw)
        cfg, cdtype = seen[-1]
        assert cfg.group == 2 and cfg.clean_edges and cfg.ctas == 0 and cdtype == jnp.float16
        lse = np.asarray(lse)
        np.testing.assert_allclose(lse[0], 1.5 / np.sqrt(192), rtol=1e-6)
        np.testing.assert_array_equal(lse[1], np.asarray(sinks))
        assert (lse[2] == float(bad)).all(), "a NaN V inside a windowed request must turn the cleaning on"
        assert lse.shape == (128, 2) and (lse[3:] == 0.25).all()
        assert o.dtype == jnp.bfloat16 and (np.asarray(o, np.float32) == 1.0).all()
    o = mp.mha_prefill(q, k, reference.quantize_fp8(jnp.asarray(v), 1.0), cu)  # no v_scale: f16 -> q's bf16
    assert o.dtype == jnp.bfloat16 and (np.asarray(o, np.float32) == 2.0).all()
    # an explicit clean_edges=False wins over the default (and skips the V pass); no v_scale
    q64 = jnp.asarray(rng.standard_normal((128, 4, 64)), jnp.float16)
    o, lse = mp.mha_prefill(q64, q64, q64.at[3, 0, 0].set(jnp.nan), cu, clean_edges=False, return_lse=True)
    cfg, _ = seen[-1]
    assert not cfg.clean_edges and cfg.group == 1 and (np.asarray(lse)[2] == 0).all()
    assert o.dtype == jnp.float16 and (np.asarray(o) == 2.0).all()
    traced = len(seen)
    o, lse = mp.mha_prefill(q64[:, :0], q64, q64, cu, return_lse=True)  # no query heads: no launch
    assert len(seen) == traced and o.shape == (128, 0, 64) and lse.shape == (128, 0)
    assert mp._clean_edges(None, False, 8) and mp._clean_edges(None, True, -1) and not mp._clean_edges(None, False, -1)


def test_an_unknown_block_kv_is_refused():
    q = jnp.zeros((8, 1, 64), jnp.float16)
    for block in (32, 256, -64):
        with pytest.raises(ValueError, match=rf"PrefillOptions.block_kv={block}: 0 \(by head width\), 64 or 128"):
            mp.mha_prefill(q, q, q, jnp.array([0, 8], jnp.int32), options=mp.PrefillOptions(block_kv=block))
