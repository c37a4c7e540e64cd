"""Tests of the Mosaic GPU MLA absorbed decode kernels: ``jattn.pallas_kernels.mosaic_mla``
(query rows as the MMA rows) and the keys-as-rows kernel it runs with ``keys_as_rows=True``
(``mosaic_mla_heads.mla_decode``, at most 32 query rows per request).

Each case runs on the CPU under the Mosaic GPU interpreter (f16, small) and on an
H200 (marker ``gpu``, bf16, full shapes) against the f32 ``jattn.reference.mla_decode``.
Inputs are fresh random draws; unused pages and the page tails past each request's
length hold NaN, page tables are permuted, and poison cases put a NaN in the V part
of one cached row (rows that see it must come out non-finite, every other row exact).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jattn import reference
from jattn.mla_rope import quantize_query_fp8
from jattn.pallas_kernels import mosaic_mla as mm
from jattn.pallas_kernels.interpret import gpu_interpret, interpreter_available, on_gpu

R, W = 512, 576


@dataclasses.dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]
    heads: int = 16
    q_len: int = 1
    causal: bool = True
    page_size: int = 64
    num_splits: int | None = None
    poison: int = -1  # >= 0: key of request 0 (counted from its end) whose V holds a NaN
    keys_as_rows: bool = False  # mosaic_mla_heads.mla_decode instead
    fp8: bool = False  # an e4m3 latent cache, kv_scale 0.5; q e4m3-valued as the MLA backend makes it
    raw_q: bool = False  # FP8: q as drawn (the kernel's e4m3 rounding of it is the error)
    e4m3_q: bool = False  # FP8: q passed in e4m3 (read as it is: no row scales); the output is bf16
    v_regs: bool = True  # FP8: V^T read into registers where it can be (MLADecodeConfig.v_regs)
    softmax_scale: float | None = None  # None: 1/sqrt(192)
    kv_scale: float | None = None  # a 2-byte cache's scale (the read applies it whatever the dtype)
    balanced: bool = False  # mla_decode(balanced_splits=True): the split size from the lengths


@contextlib.contextmanager
def _v_regs(on: bool):
    """``mosaic_mla.FP8_V_REGS`` set to ``on`` for the block: False, the upcast always; True
    (the default), V^T read into registers where a row tile has at most 32 query rows."""
    old, mm.FP8_V_REGS = mm.FP8_V_REGS, on
    try:
        yield
    finally:
        mm.FP8_V_REGS = old


def _inputs(c: Case, seed: int):
    rng = np.random.default_rng(seed)
    bs, ps = len(c.lens), c.page_size
    max_pages = max(1, max(-(-n // ps) for n in c.lens)) + 1
    num_pages = bs * max_pages + 2
    kv = np.full((num_pages, ps, W), np.nan, np.float32)
    table = rng.permutation(num_pages)[: bs * max_pages].reshape(bs, max_pages).astype(np.int32)
    for b, n in enumerate(c.lens):
        for t in range(n):
            kv[table[b, t // ps], t % ps] = rng.standard_normal(W) * 0.5
        npg = -(-n // ps)
        table[b, npg:] = rng.integers(0, num_pages, max_pages - npg)  # never read
    q = (rng.standard_normal((bs * c.q_len, c.heads, W)) * 0.5).astype(np.float32)
    return q, kv, table, np.asarray(c.lens, np.int32)


def _poison(c: Case, kv, table):
    """NaN in V of key ``lens[0] - 1 - c.poison`` of request 0; returns the output rows
    (query index i of request 0) that see it."""
    j = c.lens[0] - 1 - c.poison
    kv[table[0, j // c.page_size], j % c.page_size, 7] = np.nan
    i = np.arange(c.q_len)
    sees = (c.lens[0] - c.q_len + i >= j) if c.causal else np.ones(c.q_len, bool)
    return np.flatnonzero(sees)


def _check(c: Case, dtype, seed=0, tol=2e-2, deterministic=True):
    q, kv, table, lens = _inputs(c, seed)
    scale = 1.0 / np.sqrt(192.0) if c.softmax_scale is None else c.softmax_scale
    kw = dict(kv_lora_rank=R, softmax_scale=scale, max_seqlen_q=c.q_len, is_causal=c.causal, return_lse=True)
    kv_dtype = dtype
    if c.kv_scale is not None:
        kw["kv_scale"] = c.kv_scale
    if c.fp8:
        # a traced kv_scale (a kernel operand) in the verify cases, a Python number otherwise
        kv_dtype, kw["kv_scale"] = jnp.float8_e4m3fn, jnp.float32(0.5) if c.q_len > 1 else 0.5
        if not c.raw_q:
            q = np.asarray(quantize_query_fp8(q), np.float32)
    r = lambda a, dt=dtype: jnp.asarray(jnp.asarray(a, dt), jnp.float32)  # noqa: E731
    want_o, want_lse = (np.asarray(a) for a in reference.mla_decode(r(q), r(kv, kv_dtype), table, lens, **kw))
    bad = _poison(c, kv, table) if c.poison >= 0 else np.zeros(0, int)
    q_dtype = jnp.float8_e4m3fn if c.e4m3_q else dtype
    args = (jnp.asarray(q, q_dtype), jnp.asarray(kv, kv_dtype), jnp.asarray(table), jnp.asarray(lens))
    kw.update(num_splits=c.num_splits, keys_as_rows=c.keys_as_rows, balanced_splits=c.balanced)
    with _v_regs(c.v_regs):
        o, lse = mm.mla_decode(*args, **kw)
    assert o.dtype == (jnp.bfloat16 if c.e4m3_q else dtype)
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    assert o.shape == (len(c.lens) * c.q_len, c.heads, R) and lse.shape == o.shape[:2]
    rows = np.setdiff1d(np.arange(o.shape[0]), bad)
    if bad.size:
        assert not np.isfinite(o[bad]).all(axis=(1, 2)).any(), "a row that sees a NaN V must be non-finite"
    assert np.isfinite(o[rows]).all(), "NaN/Inf in a real row"
    np.testing.assert_allclose(o[rows], want_o[rows], atol=tol, rtol=tol)
    np.testing.assert_allclose(lse[rows], want_lse[rows], atol=tol, rtol=tol)
    empty = np.repeat(lens == 0, c.q_len)
    assert (o[empty] == 0).all() and np.isneginf(lse[empty]).all(), "a request with no keys: 0 / -inf"
    if deterministic:
        with _v_regs(c.v_regs):
            o2 = np.asarray(mm.mla_decode(*args, **kw)[0], np.float32)
        assert np.array_equal(o2, o, equal_nan=True), "not deterministic"


# Interpreted: slow (the 576-wide tiles), so the default run keeps two cases.
CPU_CASES = [
    # lengths 0, 1, 97 and a page tail; pages smaller than a block; two splits; poison
    # (both kernels); a softmax scale other than 1/sqrt(192)
    Case(lens=(97, 0, 1), heads=4, page_size=32, num_splits=2, poison=3, softmax_scale=0.1),
    Case(
        lens=(97, 0, 1),
        heads=4,
        page_size=32,
        num_splits=2,
        poison=3,
        keys_as_rows=True,
        softmax_scale=0.1,
        kv_scale=0.5,
    ),
    # keys as rows: causal verify, 3 queries x 8 heads (N = 32), pages of 16, a NaN only
    # the last two queries see
    Case(lens=(75, 2), heads=8, q_len=3, page_size=16, num_splits=2, poison=1, keys_as_rows=True),
    # keys as rows, a non-causal draft block of 2 (every query sees the NaN)
    Case(lens=(40, 3), heads=8, q_len=2, causal=False, page_size=16, poison=0, keys_as_rows=True),
    # causal verify: 3 queries x 16 heads in one row tile, an edge over two blocks, the
    # first draft's last key (63) the last of block 0 and poisoned
    Case(lens=(65,), heads=16, q_len=3, page_size=64, poison=1),
    # a non-causal draft block over pages of 16
    Case(lens=(130, 64), heads=8, q_len=2, causal=False, page_size=16),
    # two row tiles (80 rows): the last tile loads and writes only its 16 real rows
    Case(lens=(70,), heads=40, q_len=2, page_size=64),
    # FP8 latent cache: lengths 0, 1, 97 over pages of 32 and two splits with poison (the
    # feeder's V upcast and edge clean; a softmax scale of 0.1); causal verify in one row tile
    Case(lens=(97, 0, 1), heads=4, page_size=32, num_splits=2, poison=3, fp8=True, softmax_scale=0.1),
    Case(lens=(66, 200), heads=16, q_len=3, page_size=64, poison=1, fp8=True),
    # an e4m3 query, read with no row scales (a traced kv_scale: the scale operand alone)
    Case(lens=(97, 0, 1), heads=8, q_len=2, page_size=32, num_splits=2, poison=0, fp8=True, e4m3_q=True),
    # FP8 cases up to 32 query rows read V^T into registers (the first and last above); the
    # same on the upcast path: poison, lengths 0, 1, 97, two splits; an e4m3 query. And V^T in
    # registers for a causal verify of 2 x 16 rows, the poison seen by the last query only,
    # over an edge block of a request's third block, in one split and in three.
    # (test_interpreter_pool.py runs two requests of four splits each on one core.)
    Case(lens=(97, 0, 1), heads=4, page_size=32, num_splits=2, poison=3, fp8=True, v_regs=False),
    Case(lens=(97, 0, 1), heads=8, q_len=2, page_size=32, num_splits=2, poison=0, fp8=True, e4m3_q=True, v_regs=False),
    Case(lens=(130, 5), heads=16, q_len=2, page_size=64, num_splits=1, poison=1, fp8=True),
    Case(lens=(130, 5), heads=16, q_len=2, page_size=64, num_splits=3, poison=1, fp8=True),
    # balanced splits: a split size of one block, so request 0 (3 blocks, poison) takes three
    # splits, the request of 97 two, the others one or none; FP8 with V^T in registers
    Case(lens=(150, 0, 1, 97), heads=4, page_size=32, poison=3, balanced=True),
    Case(lens=(150, 0, 1, 97), heads=8, q_len=2, page_size=32, poison=1, fp8=True, balanced=True),
]


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
@pytest.mark.parametrize("c", CPU_CASES, ids=str)
def test_interpreted(c):
    # A second run checks determinism; interpreted, two cases do it (one per kernel).
    with gpu_interpret():
        _check(c, jnp.float16, deterministic=c in (CPU_CASES[2], CPU_CASES[4], CPU_CASES[8], CPU_CASES[-1]))


GPU_CASES = [
    Case(lens=(4096, 97, 0, 1, 2049, 777), heads=16, page_size=64, poison=0),
    Case(lens=(3000, 65), heads=128, q_len=2, page_size=64, poison=1),
    Case(lens=(1000, 5, 300), heads=64, q_len=4, page_size=32),
    Case(lens=(513, 4000), heads=32, q_len=8, causal=False, page_size=16),
    Case(lens=(32768,), heads=16, page_size=128),
    Case(lens=(1500, 0, 64), heads=32, q_len=3, page_size=64, poison=2),  # a last tile of 32 rows
    # keys as rows: 16 heads; q_len 2 x 16 heads (N = 32), pages of 16, causal, poison; 32
    # heads, pages of 32
    Case(lens=(4096, 97, 0, 1, 2049, 777), heads=16, page_size=64, poison=0, keys_as_rows=True),
    Case(lens=(3001, 97, 0, 1), heads=16, q_len=2, page_size=16, poison=1, keys_as_rows=True),
    Case(lens=(2049, 1, 777), heads=32, page_size=32, poison=0, keys_as_rows=True),
    # FP8 latent cache (the e4m3 Q K^T, the feeder's V upcast)
    Case(lens=(4096, 97, 0, 1, 2049, 777), heads=16, page_size=64, poison=0, fp8=True),
    Case(lens=(3000, 65), heads=128, q_len=2, page_size=64, poison=1, fp8=True),
    Case(lens=(513, 4000), heads=32, q_len=8, causal=False, page_size=16, fp8=True),
    Case(lens=(1000, 5, 300), heads=64, q_len=4, page_size=32, fp8=True, raw_q=True),
    Case(lens=(32768,), heads=16, page_size=128, fp8=True),
    Case(lens=(4096, 97, 0, 1, 2049, 777), heads=16, page_size=64, poison=0, fp8=True, e4m3_q=True),
    Case(lens=(3000, 65), heads=128, q_len=2, page_size=64, poison=1, fp8=True, e4m3_q=True),
    # balanced splits: uneven lengths, 16 and 128 heads, FP8
    Case(lens=(4096, 97, 0, 1, 2049, 777), heads=16, page_size=64, poison=0, balanced=True),
    Case(lens=(3000, 65, 700), heads=128, q_len=2, page_size=64, poison=1, balanced=True),
    Case(lens=(4096, 97, 0, 1, 2049, 777), heads=16, page_size=64, poison=0, fp8=True, balanced=True),
]
# the FP8 cases of at most 32 query rows (V^T in registers) also on the upcast path
GPU_CASES += [dataclasses.replace(c, v_regs=False) for c in GPU_CASES if c.fp8 and c.heads * c.q_len <= 32]


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=str)
def test_gpu(c):
    if not on_gpu():
        pytest.skip("needs a GPU")
    _check(c, jnp.bfloat16, tol=5e-2 if c.raw_q else 3e-2)


@st.composite
def _fuzz_cases(draw, small: bool = False):
    """A random case: heads, query length, page size, lengths (short ones near the block
    edges; long ones to 5,000 on the GPU), the cache dtype and the query's form, causal or
    not, forced or chosen splits, balanced splits, poison, scales; each option only where
    the kernel takes it (keys as rows: a 2-byte cache and at most 32 query rows;
    balanced: no forced split count). ``small``: shapes the interpreter runs in seconds
    (4 or 8 heads, at most 3 requests of at most 140 keys)."""
    keys_as_rows = draw(st.sampled_from([False, False, False, True]))
    if small:
        heads, q_len = draw(st.sampled_from([4, 8])), draw(st.integers(1, 3))
    elif keys_as_rows:
        heads = draw(st.sampled_from([16, 32]))
        q_len = draw(st.integers(1, 32 // heads))
    else:
        heads, q_len = draw(st.sampled_from([16, 32, 64, 128])), draw(st.integers(1, 8))
    bs = draw(st.integers(1, 3 if small else 5))
    length = st.integers(0, 140) if small else st.one_of(st.integers(0, 70), st.integers(60, 300), st.integers(0, 5000))
    lens = tuple(draw(st.lists(length, min_size=bs, max_size=bs)))
    fp8 = not keys_as_rows and draw(st.booleans())
    e4m3_q = fp8 and draw(st.booleans())
    splits = [None, None, 1, 2, 3] if small else [None, None, 1, 2, 5, 17]
    num_splits = None if keys_as_rows else draw(st.sampled_from(splits))
    return Case(
        lens=lens,
        heads=heads,
        q_len=q_len,
        causal=draw(st.booleans()),
        page_size=draw(st.sampled_from(mm.SUPPORTED_PAGE_SIZES)),
        num_splits=num_splits,
        poison=draw(st.integers(-1, min(lens[0], 6) - 1)),
        keys_as_rows=keys_as_rows,
        fp8=fp8,
        raw_q=fp8 and not e4m3_q and draw(st.booleans()),
        e4m3_q=e4m3_q,
        v_regs=draw(st.booleans()),
        softmax_scale=draw(st.sampled_from([None, 0.05, 0.12])),
        kv_scale=None if fp8 else draw(st.sampled_from([None, 0.7])),
        balanced=num_splits is None and not keys_as_rows and draw(st.booleans()),
    )


def _fuzz_settings(env: str, default: int):
    """Hypothesis settings of the fuzz properties: ``env`` examples (each compiles or
    interprets a kernel), derandomized unless ``JATTN_FUZZ_RANDOM=1``, nothing stored."""
    return settings(
        max_examples=int(os.environ.get(env, str(default))),
        deadline=None,
        derandomize=os.environ.get("JATTN_FUZZ_RANDOM", "") in ("", "0"),
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
@_fuzz_settings("JATTN_MLA_FUZZ_CPU_EXAMPLES", 4)
@given(c=_fuzz_cases(small=True), seed=st.integers(0, 2**31 - 1))
def test_interpreted_fuzz(c, seed):
    """Random combinations of the kernel's options at small shapes, interpreted (f16)."""
    with gpu_interpret():
        _check(c, jnp.float16, seed=seed, tol=5e-2 if c.raw_q else 3e-2)


@pytest.mark.gpu
@_fuzz_settings("JATTN_MLA_FUZZ_EXAMPLES", 12)
@given(c=_fuzz_cases(), seed=st.integers(0, 2**31 - 1))
def test_gpu_fuzz(c, seed):
    """Random combinations of the GPU cases' options against the f32 reference, with the
    same poison, NaN padding, empty-request and determinism checks as :func:`test_gpu`."""
    if not on_gpu():
        pytest.skip("needs a GPU")
    _check(c, jnp.bfloat16, seed=seed, tol=5e-2 if c.raw_q else 3e-2)


def _check_non_finite_query_rows(c: Case, dtype, nan_head: int, **mla_kw):
    """An FP8 latent cache, three requests (the last with no keys), ``q`` in ``dtype`` with
    an Inf (request 0, head 2), a NaN (request 1, head ``nan_head``) and a -Inf (request 2):
    those rows come out NaN where they see a key, 0 / -inf where they see none; the others
    match the reference over the rounded query (``e4m3_query.query_rows_e4m3``)."""
    from jattn.pallas_kernels import e4m3_query

    q, kv, table, lens = _inputs(c, 3)
    q[0, 2, 9], q[1, nan_head, 0], q[2, 1, 1] = np.inf, np.nan, -np.inf
    qx, kv8 = jnp.asarray(q, dtype), jnp.asarray(kv, jnp.float8_e4m3fn)
    kw = dict(kv_lora_rank=R, softmax_scale=0.1, kv_scale=0.5, return_lse=True)
    o, lse = (
        np.asarray(a, np.float32) for a in mm.mla_decode(qx, kv8, jnp.asarray(table), jnp.asarray(lens), **mla_kw, **kw)
    )
    h = c.heads
    q8, f = e4m3_query.query_rows_e4m3(qx.reshape(3, h, W), -(-h // 8) * 8, 64, use_kernel=False)
    rounded = np.asarray(q8, np.float32)[:, :h] * np.asarray(f)[:, :h, None]
    want_o, want_lse = (
        np.asarray(a)
        for a in reference.mla_decode(jnp.asarray(rounded), jnp.asarray(kv8, jnp.float32), table, lens, **kw)
    )
    assert np.isnan(o[0, 2]).all() and np.isnan(o[1, nan_head]).all() and np.isnan(lse[[0, 1], [2, nan_head]]).all()
    assert (o[2] == 0).all() and np.isneginf(lse[2]).all()
    ok = np.ones(o.shape[:2], bool)
    ok[0, 2] = ok[1, nan_head] = ok[2] = False
    np.testing.assert_allclose(o[ok], want_o[ok], atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse[ok], want_lse[ok], atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
def test_fp8_non_finite_query_rows_interpreted():
    """The CPU twin of the GPU case below: an f16 query, 4 heads, two splits."""
    with gpu_interpret():
        _check_non_finite_query_rows(
            Case(lens=(97, 65, 0), heads=4, page_size=32, fp8=True, raw_q=True), jnp.float16, 1, num_splits=2
        )


@pytest.mark.gpu
def test_gpu_fp8_non_finite_query_rows():
    """A bf16 query on an FP8 latent cache, quantised per row by the Triton rows kernel (an
    Inf was clamped to 448 before): see :func:`_check_non_finite_query_rows`."""
    if not on_gpu():
        pytest.skip("needs a GPU")
    _check_non_finite_query_rows(Case(lens=(3000, 97, 0), heads=16, fp8=True, raw_q=True), jnp.bfloat16, 5)


@pytest.mark.skipif(on_gpu(), reason="the GPU runs the kernel itself")
@pytest.mark.parametrize(
    "heads, q_len, page_size, fp8",
    [(16, 1, 64, 0), (128, 2, 16, 0), (32, 4, 128, 0), (16, 2, 16, 0), (32, 1, 32, 0), (8, 4, 128, 0)]
    + [(16, 1, 64, 1), (128, 2, 16, 1), (8, 4, 128, 1)]
    + [(16, 1, 64, 2), (128, 2, 16, 2)]  # 2: an e4m3 query (no row scales)
    + [(32, 1, 64, 2), (8, 4, 128, 1), (4, 1, 32, 1)]  # V^T in registers up to 32 rows
    + [(16, 1, 64, 5), (16, 2, 16, 5)],  # 5: the upcast forced (an e4m3 query)
)
def test_lowers_for_cuda(heads, q_len, page_size, fp8):
    """Mosaic GPU's layout inference and TMA rules (and the shared-memory limit) run at
    lowering: this catches on the CPU programs the interpreter accepts and the GPU
    compiler rejects."""
    bs = 3
    q = jnp.zeros((bs * q_len, heads, W), jnp.float8_e4m3fn if fp8 in (2, 5) else jnp.bfloat16)
    kv = jnp.zeros((40, page_size, W), jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    pt, lens = jnp.zeros((bs, 10), jnp.int32), jnp.array([600, 1, 0], jnp.int32)

    kw = dict(kv_lora_rank=R, softmax_scale=0.1, max_seqlen_q=q_len, num_splits=2, kv_scale=0.5 if fp8 else 1.0)
    for keys in (False, True) if q_len * heads <= 32 and not fp8 else (False,):

        def fn(q, kv):
            return mm.mla_decode(q, kv, pt, lens, keys_as_rows=keys, **kw)  # noqa: B023

        with _v_regs(fp8 != 5):
            text = jax.jit(fn).trace(q, kv).lower(lowering_platforms=("cuda",)).as_text()
        assert ("jattn_mla_decode_heads" if keys else "jattn_mla_decode_p") in text
        assert ("_fp8" in text) == bool(fp8)
        assert ("_vregs" in text) == (fp8 in (1, 2) and heads * q_len <= 32)


def test_v_regs_needs_fp8_and_32_rows():
    from jattn.pallas_kernels.mosaic_mla_config import MLADecodeConfig

    kw = dict(width=W, rank=R, is_causal=True, page_size=64, num_pages=4, max_pages=2, num_splits=1)
    kw.update(score_scale=0.1, interpret=True)
    assert MLADecodeConfig(num_heads=16, q_len=2, fp8=True, v_regs=True, **kw).n_cols == 32
    for heads, q_len, fp8 in ((16, 3, True), (128, 1, True), (16, 1, False)):
        with pytest.raises(ValueError, match="v_regs needs an FP8 cache and at most 32 query rows"):
            MLADecodeConfig(num_heads=heads, q_len=q_len, fp8=fp8, v_regs=True, **kw)


def test_row_tiles_and_ring_of_the_config():
    """``MLADecodeConfig``'s row counts (rows rounded up to 8, the last row tile's rows) and
    ring depth (the landing ring's with FP8, else two slots)."""
    from jattn.pallas_kernels.mosaic_mla_config import NUM_STAGES, MLADecodeConfig

    kw = dict(width=W, rank=R, is_causal=True, page_size=64, num_pages=4, max_pages=2, num_splits=1)
    kw.update(score_scale=0.1, interpret=True)
    shapes = ((40, 2, 80, 2, 16), (5, 3, 16, 1, 16), (128, 2, 256, 4, 64), (4, 1, 8, 1, 8))
    for heads, q_len, rows8, tiles, last in shapes:  # heads, q_len: rows8, row tiles, last tile's rows
        c = MLADecodeConfig(num_heads=heads, q_len=q_len, **kw)
        assert (c.m_rows8, c.m_tiles, c.last_rows8) == (rows8, tiles, last), (heads, q_len)
    assert MLADecodeConfig(num_heads=16, q_len=1, **kw).stages == NUM_STAGES == 2
    assert MLADecodeConfig(num_heads=16, q_len=1, fp8=True, land_stages=4, **kw).stages == 4


def test_register_split_fits_the_launch():
    """The warpgroups' ``set_max_registers`` counts (producer decrease, two increases) sum to
    at most three times the launch's 168 per thread (an increase only takes what a decrease
    gave back; past it the increase waits for ever: a hang on the GPU alone), each a
    multiple of 8 in [24, 256]."""
    from jattn.pallas_kernels.mosaic_mla_config import REGISTERS, REGISTERS_FP8

    for regs in (REGISTERS, REGISTERS_FP8):
        assert len(regs) == 3 and sum(regs) <= 3 * 168, regs
        assert all(r % 8 == 0 and 24 <= r <= 256 for r in regs), regs


def test_unsupported_reasons():
    q = jnp.zeros((2, 16, W), jnp.bfloat16)
    kv = jnp.zeros((4, 64, W), jnp.bfloat16)
    q8, kv8 = q.astype(jnp.float8_e4m3fn), kv.astype(jnp.float8_e4m3fn)
    if not on_gpu():  # no GPU and no interpreter: refused by name (NotImplementedError in the ops)
        assert "no GPU" in mm.unsupported_reason(q, kv, kv_lora_rank=R)
    with gpu_interpret() if not on_gpu() else contextlib.nullcontext():
        assert mm.unsupported_reason(q, kv, kv_lora_rank=R) is None
        assert mm.unsupported_reason(q, kv.astype(jnp.float8_e4m3fn), kv_lora_rank=R) is None
        assert mm.unsupported_reason(q8, kv8, kv_lora_rank=R) is None
    assert "float8_e4m3fn" in mm.unsupported_reason(q, kv.astype(jnp.float8_e5m2), kv_lora_rank=R)
    assert "e4m3 with an e4m3 cache" in mm.unsupported_reason(q8, kv, kv_lora_rank=R)
    assert "576 / 512" in mm.unsupported_reason(q[..., :320], kv[..., :320], kv_lora_rank=256)
    assert "page_size" in mm.unsupported_reason(q, jnp.zeros((4, 8, W), jnp.bfloat16), kv_lora_rank=R)
    assert "max_seqlen_q" in mm.unsupported_reason(q, kv, kv_lora_rank=R, max_seqlen_q=9)
    # a direct call refuses them by name (a 48-row page read past the page and hung)
    table, lens = jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32)
    for bad_q, bad_kv, match in ((q, kv[:, :48], "page_size=48"), (q[..., :320], kv[..., :320], "576 / 512")):
        with pytest.raises(ValueError, match=rf"mosaic_mla.mla_decode: .*{match}"):
            mm.mla_decode(
                bad_q, bad_kv, table, lens, kv_lora_rank=R if match != "576 / 512" else 256, softmax_scale=0.1
            )
    # the keys-as-rows kernel: at most 32 query rows a request, scales known when traced
    from jattn.pallas_kernels import mosaic_mla_heads as mlh

    assert mlh.unsupported_reason(q, kv, kv_lora_rank=R, softmax_scale=0.1) is None
    assert "32 rows" in mlh.unsupported_reason(q, kv, kv_lora_rank=R, softmax_scale=0.1, max_seqlen_q=4)
    assert "Python numbers" in mlh.unsupported_reason(q, kv, kv_lora_rank=R, softmax_scale=jnp.float32(0.1))
    assert "dtypes" in mlh.unsupported_reason(q, kv.astype(jnp.float8_e4m3fn), kv_lora_rank=R, softmax_scale=0.1)
    # query rows that are not whole requests of max_seqlen_q tokens, and a rank of 0 or past
    # the latent width: the kernel would read each request's queries at the wrong rows, or
    # columns past the rank, without an error
    assert mlh.unsupported_reason(q, kv, kv_lora_rank=R, softmax_scale=0.1, max_seqlen_q=2) is None
    assert "not a multiple of max_seqlen_q=2" in mlh.unsupported_reason(
        q[:1], kv, kv_lora_rank=R, softmax_scale=0.1, max_seqlen_q=2
    )
    for rank in (0, W + 64):
        assert "latent width" in mlh.unsupported_reason(q, kv, kv_lora_rank=rank, softmax_scale=0.1)


def test_balanced_split_size_evens_out_uneven_lengths():
    """``balanced_split_size``: equal lengths get the split of ``choose_num_splits``; uneven
    ones a size every request shares, at least what covers the longest in the static
    split count, with a predicted makespan no longer than the per-request split's; and
    ``balanced_splits`` refuses a fixed ``num_splits`` and the keys-as-rows kernel."""
    block = mm.BLOCK_N

    def makespan(nblk, per):  # CTAs in launch order to the first free SM (block times)
        loads = np.zeros(mm.NUM_SMS)
        for n in nblk:
            for lo in range(0, max(int(n), 1), per):
                loads[np.argmin(loads)] += min(per, n - lo) + mm.SPLIT_OVERHEAD_BLOCKS if n else 0
        return loads.max()

    for bs, max_blocks in ((64, 64), (128, 64), (1, 512), (8, 256)):
        s_even = mm.choose_num_splits(bs, 1, max_blocks)
        s = mm.balanced_num_splits(bs, 1, max_blocks)
        assert s >= s_even
        lens = jnp.full((bs,), max_blocks * block, jnp.int32)
        per = int(mm.balanced_split_size(lens, block, s, 1, max_blocks)[0])
        assert per == -(-max_blocks // s_even), (bs, max_blocks, per)
    for bs, m_tiles, max_blocks in ((8, 2, 64), (64, 1, 64), (2, 1, 512)):  # the longest is covered
        s = mm.balanced_num_splits(bs, m_tiles, max_blocks)
        for longest in (block * s + 1, 2 * block * s + 1, block * max_blocks - 1, block * max_blocks):
            if longest > block * max_blocks:
                continue
            lens = jnp.asarray([longest] + [1] * (bs - 1), jnp.int32)
            per = int(mm.balanced_split_size(lens, block, s, m_tiles, max_blocks)[0])
            assert per * s >= -(-longest // block), (bs, m_tiles, max_blocks, longest, per, s)
    empty = mm.balanced_split_size(jnp.zeros((4,), jnp.int32), block, 3, 1, 10)  # no keys at all
    assert 1 <= int(empty[0]) <= 10
    rng = np.random.default_rng(0)
    lens_np = rng.integers(512, 4097, 64).astype(np.int32)
    s = mm.balanced_num_splits(64, 1, 64)
    per = int(mm.balanced_split_size(jnp.asarray(lens_np), block, s, 1, 64)[0])
    nblk = -(-lens_np // block)
    assert -(-nblk.max() // s) <= per < -(-64 // mm.choose_num_splits(64, 1, 64))
    static = max(-(-n // 2) for n in nblk) + mm.SPLIT_OVERHEAD_BLOCKS  # 2 splits each, one wave
    assert makespan(nblk, per) < 0.85 * static, (makespan(nblk, per), static)
    q = jnp.zeros((1, 16, W), jnp.bfloat16)
    kv, table, one = jnp.zeros((2, 64, W), jnp.bfloat16), jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    kw = dict(kv_lora_rank=R, softmax_scale=0.1, balanced_splits=True)
    with pytest.raises(ValueError, match="balanced_splits .*num_splits"):
        mm.mla_decode(q, kv, table, one, num_splits=2, **kw)
    with pytest.raises(ValueError, match="balanced_splits .*keys_as_rows"):
        mm.mla_decode(q, kv, table, one, keys_as_rows=True, **kw)
    with pytest.raises(ValueError, match="balanced_splits='no' must be True, False or None"):
        mm.mla_decode(q, kv, table, one, **dict(kw, balanced_splits="no"))


def test_balanced_splits_default_rule(monkeypatch):
    """With ``balanced_splits`` unnamed a call takes balanced splits whenever it has several
    requests, at every head count, query length and cache dtype; a named choice, a fixed
    ``num_splits`` and ``BALANCED_SPLITS = False`` win over the rule."""
    seen = []
    monkeypatch.setattr(mm, "_mla_decode", lambda *a, **k: seen.append((k["balanced"], k["num_splits"])))

    def default_of(bs, heads, q_len=1, dtype=jnp.bfloat16, **kw):
        q = jnp.zeros((bs * q_len, heads, W), dtype if jnp.dtype(dtype).itemsize == 2 else jnp.bfloat16)
        kv, table = jnp.zeros((8, 64, W), dtype), jnp.zeros((bs, 4), jnp.int32)
        mm.mla_decode(
            q, kv, table, jnp.ones((bs,), jnp.int32), kv_lora_rank=R, softmax_scale=0.1, max_seqlen_q=q_len, **kw
        )
        return seen[-1][0]

    assert default_of(2, 16) and default_of(64, 64) and default_of(8, 16, q_len=4)
    assert default_of(4, 16, dtype=jnp.float16) and default_of(4, 16, dtype=jnp.float8_e4m3fn)
    assert default_of(4, 128) and default_of(4, 16, q_len=8)  # two row tiles
    assert not default_of(1, 16) and not default_of(1, 128, dtype=jnp.float8_e4m3fn)  # one request
    assert not default_of(4, 16, balanced_splits=False) and default_of(1, 16, balanced_splits=True)
    assert not default_of(4, 16, num_splits=2) and seen[-1][1] == 2
    monkeypatch.setattr(mm, "BALANCED_SPLITS", False)
    assert not default_of(4, 16) and not default_of(64, 128)
    assert mm.balanced_by_default(4) is False


def test_choose_num_splits():
    assert mm.choose_num_splits(1, 1, 512) == 128  # batch 1 at 32k: one wave, 4 blocks each
    q, cache = jnp.zeros((2, 16, W), jnp.bfloat16), jnp.zeros((4, 64, W), jnp.bfloat16)
    for splits, rows in ((0, False), (-2, False), (2.0, False), (0, True), (True, True)):  # passed on unchecked
        with pytest.raises(ValueError, match=rf"num_splits={splits!r} must be an int >= 1"):
            mm.mla_decode(
                q, cache, jnp.zeros((2, 2), jnp.int32), jnp.array([5, 0], jnp.int32), kv_lora_rank=R,
                softmax_scale=0.1, num_splits=splits, keys_as_rows=rows,
            )  # fmt: skip
    assert mm.choose_num_splits(64, 1, 64) == 2  # 64 x 4096: 128 CTAs in one wave
    assert mm.choose_num_splits(128, 1, 64) == 1  # 128 x 4096: one wave already
    assert mm.choose_num_splits(128, 2, 64) == 1
    assert mm.choose_num_splits(4, 1, 1) == 1  # a block or two: no split


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
def test_deepseek_engine_interpreted_matches_xla():
    """The serving engine on a DeepSeek model with the kernel's shapes (latent 512 + rope
    64, 16 heads, f16): the Mosaic MLA decode and prefill kernels, interpreted, give the
    xla reference's greedy tokens."""
    from flax import nnx

    from jattn.models.config import DeepseekConfig
    from jattn.models.deepseek import Deepseek
    from jattn.models.engine import Engine, EngineConfig, SamplingParams

    cfg = DeepseekConfig.tiny_v3_attention(
        num_layers=1, first_k_dense_replace=1, dtype="float16", param_dtype="float16"
    )
    model = Deepseek(cfg, rngs=nnx.Rngs(3), std=0.3)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (5, 37)]

    def run(backend):
        config = EngineConfig(
            page_size=16, num_pages=64, max_context=128, batch_buckets=(2,), token_buckets=(64,), kernel_backend=backend
        )
        return [r.output_tokens for r in Engine(model, config).generate(prompts, SamplingParams(max_new_tokens=4))]

    want = run("xla")
    with gpu_interpret():
        assert run("mosaic") == want


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="traced under the CPU interpreter")
def test_an_e4m3_query_reaches_the_kernel_unquantised():
    """Through the op, an e4m3 query goes to the Mosaic kernel as it is: the call has no
    per-row quantisation (its ``abs`` of the query), which a bf16 query's call has."""
    import jattn

    kv8 = jnp.zeros((8, 64, W), jnp.float8_e4m3fn)
    pt, lens = jnp.zeros((2, 3), jnp.int32), jnp.array([100, 5], jnp.int32)

    def call(q):
        return jattn.mla_decode_with_kvcache(q, kv8, pt, lens, kv_lora_rank=R, softmax_scale=0.1, backend="mosaic")

    with gpu_interpret():
        jaxprs = {dt: str(jax.make_jaxpr(call)(jnp.zeros((2, 16, W), dt))) for dt in (jnp.float8_e4m3fn, jnp.bfloat16)}
    assert "abs" not in jaxprs[jnp.float8_e4m3fn]
    assert "abs" in jaxprs[jnp.bfloat16]


def test_the_host_code_hands_the_kernel_and_the_combine_their_operands(monkeypatch):
    """``mla_decode``'s host code with the kernel and the combine stubbed out (eagerly): the
    split count (``choose_num_splits`` / ``balanced_num_splits`` of the call's row tiles and
    key blocks), the score scale (built in where both factors are numbers, else an operand),
    the query rows padded to a multiple of 8 (per-row e4m3 for a 2-byte query over an FP8
    cache, an e4m3 query as it is), the partials' dtype (f16 over an FP8 cache), and the
    combine's ``kv_scale`` and output dtype (bf16 for an e4m3 query)."""
    seen = {}

    def fake_run(cfg, part_dtype, table, lens, scale, qs, q3, kv):
        seen.update(cfg=cfg, part_dtype=part_dtype, scale=scale, qs=qs, q3=q3)
        s, bs = cfg.num_splits, q3.shape[0]
        return jnp.zeros((s, bs, cfg.m_rows8, R), part_dtype), jnp.zeros((s, bs, cfg.m_rows8), jnp.float32)

    def fake_combine(o_part, lse_part, **kw):
        seen["combine"] = kw
        return o_part, lse_part

    monkeypatch.setattr(mm, "run", fake_run)
    monkeypatch.setattr(mm, "combine_splits", fake_combine)
    rng = np.random.default_rng(17)

    def call(bs, heads, q_len, q_dtype, kv_dtype, pages=3, page_size=32, **kw):
        q = jnp.asarray(rng.standard_normal((bs * q_len, heads, W)) * 0.5, q_dtype)
        kv = jnp.asarray(rng.standard_normal((bs * pages, page_size, W)) * 0.5, kv_dtype)
        table = jnp.asarray(rng.permutation(bs * pages).reshape(bs, pages), jnp.int32)
        lens = jnp.asarray(rng.integers(1, pages * page_size + 1, bs), jnp.int32)
        with jax.disable_jit():
            mm.mla_decode(q, kv, table, lens, kv_lora_rank=R, max_seqlen_q=q_len, **kw)
        return q

    # 15 query rows (5 heads x 3): padded to 16 with zeros; both scales numbers: built in
    q = call(2, 5, 3, jnp.float16, jnp.float16, softmax_scale=0.1, kv_scale=0.5, num_splits=2)
    cfg, q3 = seen["cfg"], seen["q3"]
    assert cfg.score_scale == pytest.approx(0.05) and seen["scale"] is None and seen["qs"] is None
    assert q3.shape == (2, 16, W) and (q3[:, 15] == 0).all()
    np.testing.assert_array_equal(np.asarray(q3[:, :15]), np.asarray(q).reshape(2, 15, W))
    assert seen["part_dtype"] == jnp.float16
    assert seen["combine"]["v_scale"] == 0.5 and seen["combine"]["out_dtype"] == jnp.float16
    # traced scales: their product is the kernel's operand, kv_scale the combine's
    call(2, 5, 3, jnp.float16, jnp.float16, softmax_scale=jnp.float32(0.1), kv_scale=jnp.float32(0.5), num_splits=2)
    assert seen["cfg"].score_scale is None
    np.testing.assert_allclose(np.asarray(seen["scale"]), [0.05], rtol=1e-6)
    assert float(seen["combine"]["v_scale"]) == 0.5
    # a bf16 query over an FP8 cache: e4m3 rows with factors, f16 partials, a bf16 output
    call(2, 5, 3, jnp.bfloat16, jnp.float8_e4m3fn, softmax_scale=0.1, kv_scale=0.5, num_splits=2)
    assert seen["cfg"].row_scales and seen["q3"].dtype == jnp.float8_e4m3fn and seen["qs"] is not None
    assert seen["part_dtype"] == jnp.float16 and seen["combine"]["out_dtype"] == jnp.bfloat16
    # an e4m3 query: as it is (no factors), a bf16 output
    call(2, 5, 3, jnp.float8_e4m3fn, jnp.float8_e4m3fn, softmax_scale=0.1, kv_scale=0.5, num_splits=2)
    assert not seen["cfg"].row_scales and seen["qs"] is None and seen["q3"].dtype == jnp.float8_e4m3fn
    assert seen["part_dtype"] == jnp.float16 and seen["combine"]["out_dtype"] == jnp.bfloat16
    # the chosen split counts: 8 requests, 80 query rows (two row tiles), 16 key blocks
    for balanced, choose in ((False, mm.choose_num_splits), (True, mm.balanced_num_splits)):
        call(8, 40, 2, jnp.float16, jnp.float16, pages=32, softmax_scale=0.1, balanced_splits=balanced)
        assert seen["cfg"].num_splits == choose(8, 2, 16) and seen["cfg"].balanced == balanced
    assert mm.choose_num_splits(8, 2, 16) != mm.choose_num_splits(8, 1, 16)  # the row tiles count


def test_no_requests_give_a_bf16_output_for_an_e4m3_query():
    """With no requests (nothing launched) the output is bf16 for an e4m3 query, as with requests."""
    q = jnp.zeros((0, 16, W), jnp.float8_e4m3fn)
    kv = jnp.asarray(np.random.default_rng(2).standard_normal((4, 64, W)), jnp.float8_e4m3fn)
    o, lse = mm.mla_decode(
        q, kv, jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32), kv_lora_rank=R, softmax_scale=0.1,
        return_lse=True,
    )  # fmt: skip
    assert o.shape == (0, 16, R) and o.dtype == jnp.bfloat16 and lse.shape == (0, 16) and lse.dtype == jnp.float32


def test_a_direct_call_checks_its_plan_and_launches_nothing_without_heads():
    """``mla_decode`` refuses a page table or lengths that do not describe q's requests by
    name (a length past the batch was read as the next array's words), and a call with no
    query heads returns empty rows without building the kernel."""
    rng = np.random.default_rng(31)
    q = jnp.asarray(rng.standard_normal((2, 16, W)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((4, 64, W)), jnp.bfloat16)
    kw = dict(kv_lora_rank=R, softmax_scale=0.1)
    table, lens = jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([70, 9], jnp.int32)
    with pytest.raises(ValueError, match="page_table shape"):
        mm.mla_decode(q, kv, table[:1], lens, **kw)
    with pytest.raises(ValueError, match="cache_seqlens shape"):
        mm.mla_decode(q, kv, table, jnp.asarray([70, 9, 5], jnp.int32), **kw)
    o, lse = mm.mla_decode(q[:, :0], kv, table, lens, return_lse=True, **kw)
    assert o.shape == (2, 0, R) and o.dtype == jnp.bfloat16 and lse.shape == (2, 0)
