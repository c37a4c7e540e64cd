"""Property-based fuzz (hypothesis) of every jattn op and the core backends against the
independent float64 loops of tests/naive.py.

Each property draws shapes from small buckets (so the jitted ops compile a bounded number
of programs), lengths (0 and 1, page boundaries and awkward non-multiples of the page
size, fewer keys than queries), page sizes, permuted page tables whose unused entries
point anywhere in the pool (other requests' pages included), NaN in every slot no real
token holds (unused pages, page tails, padded query / key rows), GQA ratios (MHA, GQA,
MQA) and feature combinations: causal / non-causal, sliding window, logit cap, sinks,
softmax scale, FP8 KV with scales, multi-token verify and draft blocks, LSE.

Drawn examples per property come from ``JATTN_FUZZ_EXAMPLES`` (default 4, plus one explicit
example per property with every feature on; the whole file runs in about 70 s
on one CPU core); ``JATTN_FUZZ_EXAMPLES=500`` is the long run. Runs are derandomized (the
same examples every run) unless ``JATTN_FUZZ_RANDOM=1``; ``JATTN_FUZZ_SHRINK=0`` reports a
failure without shrinking it. The Mosaic GPU kernel runs interpreted on the CPU (slow: a
quarter of the examples, tiny shapes); the tests marked ``gpu`` run it compiled at larger
shapes with ``JATTN_FUZZ_GPU_EXAMPLES`` examples (default 40). docs/TESTING.md has the
details.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import naive  # tests/naive.py
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

import jattn
from jattn import ForwardMode, LayerSpec, MHABackend, MHAConfig, MLABackend, MLAConfig, MLAKVCache, PagedKVCache
from jattn.pallas_kernels import combine
from jattn.pallas_kernels import mosaic_decode as mosaic
from jattn.pallas_kernels.interpret import gpu_interpret, interpreter_available, on_gpu

# ----------------------------------------------------------------------------- profiles

EXAMPLES = int(os.environ.get("JATTN_FUZZ_EXAMPLES", "4"))
GPU_EXAMPLES = int(os.environ.get("JATTN_FUZZ_GPU_EXAMPLES", "40"))
RANDOM = os.environ.get("JATTN_FUZZ_RANDOM", "") not in ("", "0")
SHRINK = os.environ.get("JATTN_FUZZ_SHRINK", "1") not in ("", "0")
NO_SHRINK = tuple(p for p in Phase if p is not Phase.shrink)

settings.register_profile(
    "jattn-fuzz",
    max_examples=EXAMPLES,
    deadline=None,  # an example that compiles a new program takes a second or more
    derandomize=not RANDOM,
    database=None,  # nothing written into the checkout; derandomized runs replay anyway
    print_blob=True,
    phases=tuple(Phase) if SHRINK else NO_SHRINK,  # JATTN_FUZZ_SHRINK=0: report failures as drawn
    # too_slow: examples compile jitted programs (and interpret kernels) by design.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
FUZZ = settings.get_profile("jattn-fuzz")
# Interpreted kernel examples take seconds each: fewer of them, and no shrinking (the
# failing example is reported as drawn).
SLOW = settings(FUZZ, max_examples=max(1, EXAMPLES // 4), phases=NO_SHRINK)
GPU = settings(FUZZ, max_examples=GPU_EXAMPLES)

# Batch sizes: an empty batch now and then (every op returns empty outputs for it).
BATCH = st.sampled_from([1, 2, 3, 1, 2, 3, 0])

needs_interp = pytest.mark.skipif(not interpreter_available(), reason="no Mosaic GPU interpreter in this JAX")

# ----------------------------------------------------------------------------- dtypes and tolerances

DTYPES = {
    "f32": np.float32,
    "bf16": ml_dtypes.bfloat16,
    "f16": np.float16,
    "fp8": ml_dtypes.float8_e4m3fn,
}


@dataclasses.dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float
    lse_atol: float = 1e-4
    lse_rtol: float = 1e-5


# The xla backend computes in f32 and rounds once to the output dtype (one ulp of slack).
XLA_TOL = {"f32": Tol(3e-5, 3e-5), "bf16": Tol(1e-4, 2.0**-8), "f16": Tol(3e-5, 2.0**-10)}
# The Mosaic kernel rounds P to the compute dtype (f16 for FP8 KV). Interpreted, the rest
# is f32 math: a third of tests/test_mosaic_decode.py's tolerances, which the GPU keeps
# (approximate exp / tanh there).
MOSAIC_TOL = {"bf16": Tol(2e-2, 2e-2, 2e-3, 2e-3), "f16": Tol(1e-2, 1e-2, 2e-3, 2e-3)}
MOSAIC_FP8_TOL = Tol(3e-2, 3e-2, 2e-3, 2e-3)
INTERP_TOL = {"bf16": Tol(6e-3, 6e-3, 1e-4, 1e-5), "f16": Tol(2e-3, 2e-3, 1e-4, 1e-5)}


def _mosaic_tol(c) -> Tol:
    if not on_gpu():
        return INTERP_TOL[c["q"]]
    return MOSAIC_FP8_TOL if c["kv"] == "fp8" else MOSAIC_TOL[c["q"]]


def _cast(x, dtype: str, scale: float = 1.0):
    """numpy array of dtype ``dtype`` (FP8: ``clamp(x / scale)`` as SEMANTICS.md writes it)."""
    if dtype == "fp8":
        return naive.quantize_fp8(x, scale)
    return np.asarray(x, np.float32).astype(DTYPES[dtype])


def _check(out, truth, *, tol: Tol, lse=None, truth_lse=None, rows=None, name="out"):
    """``|out - truth| <= atol + rtol |truth|`` everywhere, no NaN, rows that see no key
    exactly 0 (and LSE -inf). ``rows`` (bool) restricts the comparison to some rows."""
    out = naive.f64(out)
    assert out.shape == truth.shape, (name, out.shape, truth.shape)
    if rows is None:
        rows = np.ones(truth.shape[0], bool)
    o, t = out[rows], truth[rows]
    assert not np.isnan(o).any(), f"{name} has NaN"
    if truth_lse is not None:
        empty = np.isneginf(truth_lse[rows])
        assert (o[empty] == 0).all(), f"{name}: rows that see no key must be exactly 0"
    excess = np.abs(o - t) - (tol.atol + tol.rtol * np.abs(t))
    if excess.size and excess.max() > 0:
        i = np.unravel_index(int(np.argmax(excess)), excess.shape)
        raise AssertionError(
            f"{name}: |out - truth| = {abs(o[i] - t[i]):.3e} at {i} (out {o[i]:.6f}, truth {t[i]:.6f}) "
            f"exceeds {tol.atol:.1e} + {tol.rtol:.1e} * |truth|"
        )
    if lse is not None:
        naive.assert_lse(
            naive.f64(lse)[rows], truth_lse[rows], atol=tol.lse_atol, rtol=tol.lse_rtol, name=name + " lse"
        )


def _pow2(n: int, lo: int = 1) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


# ----------------------------------------------------------------------------- paged pools


class Pool:
    """Pages for requests of lengths ``lens``: a permuted page table whose entries past a
    request's last page point anywhere in the pool (other requests' pages included; never
    read), a pool size bucketed to a power of two, and optionally request 1 reading
    request 0's full pages as its prefix (a shared radix-cache prefix, read-only).
    Slots no request holds are NaN in :meth:`fill`."""

    def __init__(self, rng, lens, page_size: int, *, share: bool = False, min_pages: int = 4):
        self.page_size = ps = page_size
        self.lens = np.array([int(x) for x in lens], np.int32)
        need = [-(-int(x) // ps) for x in self.lens]
        self.width = _pow2(max(need + [1]))
        self.num_pages = _pow2(1 + sum(need) + 2, lo=min_pages)
        perm = rng.permutation(np.arange(1, self.num_pages))
        table = rng.integers(0, self.num_pages, size=(len(need), self.width))
        i = 0
        for b, nb in enumerate(need):
            table[b, :nb] = perm[i : i + nb]
            i += nb
        if share and len(need) > 1:
            k = min(int(self.lens[0]) // ps, need[1])
            table[1, :k] = table[0, :k]
        self.page_table = table.astype(np.int32)
        self.valid = np.zeros((self.num_pages, ps), bool)
        for b, length in enumerate(self.lens):
            for t in range(int(length)):
                self.valid[self.page_table[b, t // ps], t % ps] = True

    def fill(self, rng, tail_shape, scale: float = 1.0):
        x = (rng.standard_normal((self.num_pages, self.page_size) + tuple(tail_shape)) * scale).astype(np.float32)
        x[~self.valid] = np.nan
        return x

    def slot(self, b: int, t: int) -> int:
        return int(self.page_table[b, t // self.page_size]) * self.page_size + t % self.page_size


def _lengths(page_size: int, hi: int):
    """Lengths biased to the edges: 0, 1, around page boundaries, else anything <= hi."""
    edges = sorted({0, 1, max(page_size - 1, 0), page_size, page_size + 1, 2 * page_size + 1})
    return st.one_of(st.sampled_from([e for e in edges if e <= hi]), st.integers(0, hi))


def _features(draw, *, d: int, kv_dtypes=("f32", "bf16", "f16", "fp8")):
    """Options shared by the MHA ops: window, cap, sinks, scale, FP8 scales, dtypes, LSE."""
    kv = draw(st.sampled_from(kv_dtypes))
    qd = draw(st.sampled_from(["f32", "bf16", "f16"])) if kv in ("fp8", "f32") else kv
    fp8 = kv == "fp8"
    return dict(
        kv=kv,
        q=qd,
        window_left=draw(st.one_of(st.just(-1), st.integers(0, 12))),
        logit_cap=draw(st.sampled_from([0.0, 0.0, 1.0, 5.0, 30.0])),
        sinks=draw(st.booleans()),
        softmax_scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0).map(lambda s: round(s / math.sqrt(d), 4)))),
        k_scale=draw(st.sampled_from([0.25, 0.5, 1.5])) if fp8 else 1.0,
        v_scale=draw(st.sampled_from([0.3, 1.0, 2.0])) if fp8 else 1.0,
        return_lse=draw(st.booleans()),
    )


def _opts(c, sinks):
    return dict(
        window_left=c["window_left"],
        logit_cap=c["logit_cap"],
        sinks=sinks,
        softmax_scale=c["softmax_scale"],
        k_scale=c["k_scale"],
        v_scale=c["v_scale"],
    )


def _unpack(res, return_lse):
    return res if return_lse else (res, None)


# ----------------------------------------------------------------------------- paged decode (xla)


@st.composite
def decode_cases(draw):
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))  # 1: MHA; hkv 1 and group > 1: MQA
    d = draw(st.sampled_from([8, 16]))
    ps = draw(st.sampled_from([1, 4, 16]))
    bs = draw(BATCH)
    c = dict(
        hkv=hkv,
        hq=hkv * group,
        d=d,
        dv=draw(st.sampled_from([d, 8])),
        page_size=ps,
        lens=draw(st.lists(_lengths(ps, 40), min_size=bs, max_size=bs)),
        q_len=draw(st.integers(1, 4)),  # > 1: target verify (causal) or draft block (non-causal)
        is_causal=draw(st.booleans()),
        share=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    c.update(_features(draw, d=d))
    return c


def _decode_inputs(c):
    rng = np.random.default_rng(c["seed"])
    pool = Pool(rng, c["lens"], c["page_size"], share=c["share"])
    ks, vs = c["k_scale"], c["v_scale"]
    kc = _cast(pool.fill(rng, (c["hkv"], c["d"]), 3 * ks if c["kv"] == "fp8" else 1.0), c["kv"], ks)
    vc = _cast(pool.fill(rng, (c["hkv"], c["dv"]), 3 * vs if c["kv"] == "fp8" else 1.0), c["kv"], vs)
    n, bs = c["q_len"], len(c["lens"])
    q = rng.standard_normal((bs * n, c["hq"], c["d"])).astype(np.float32)
    for b, length in enumerate(c["lens"]):
        if length == 0:  # an empty (padding) request: even NaN queries give exactly 0
            q[b * n : (b + 1) * n] = np.nan
    q = _cast(q, c["q"])
    sinks = (rng.standard_normal(c["hq"]) * 2).astype(np.float32) if c["sinks"] else None
    return pool, q, kc, vc, sinks


# One explicit case per property turns every feature on at once (each runs in CI whatever
# the draws); the drawn cases add the variety.
KITCHEN_SINK = dict(
    window_left=5, logit_cap=5.0, sinks=True, softmax_scale=None, kv="fp8", q="bf16", k_scale=0.5, v_scale=2.0
)


@FUZZ
@given(decode_cases())
@example(
    c=dict(
        KITCHEN_SINK,
        hkv=2,
        hq=4,
        d=16,
        dv=8,
        page_size=4,
        lens=[0, 1, 37],
        q_len=3,
        is_causal=True,
        share=True,
        return_lse=True,
        seed=1,
    )
)
def test_mha_decode_xla(c):
    pool, q, kc, vc, sinks = _decode_inputs(c)
    kw = dict(max_seqlen_q=c["q_len"], is_causal=c["is_causal"], **_opts(c, sinks))
    res = jattn.mha_decode_with_kvcache(
        jnp.asarray(q),
        jnp.asarray(kc),
        jnp.asarray(vc),
        jnp.asarray(pool.page_table),
        jnp.asarray(pool.lens),
        return_lse=c["return_lse"],
        backend="xla",
        **dict(kw, sinks=None if sinks is None else jnp.asarray(sinks)),
    )
    out, lse = _unpack(res, c["return_lse"])
    assert out.dtype == q.dtype
    truth, truth_lse = naive.mha_decode(q, kc, vc, pool.page_table, pool.lens, **kw)
    _check(out, truth, tol=XLA_TOL[c["q"]], lse=lse, truth_lse=truth_lse)


# ----------------------------------------------------------------------------- extend over a paged prefix (xla)


@st.composite
def extend_cases(draw):
    hkv = draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([8, 16]))
    ps = draw(st.sampled_from([1, 4, 16]))
    bs = draw(BATCH)
    c = dict(
        hkv=hkv,
        hq=hkv * draw(st.sampled_from([1, 2, 4])),
        d=d,
        dv=d,
        page_size=ps,
        prefix=draw(st.lists(_lengths(ps, 33), min_size=bs, max_size=bs)),
        new=draw(st.lists(st.integers(0, 6), min_size=bs, max_size=bs)),
        pad_tokens=draw(st.integers(0, 3)),
        is_causal=draw(st.booleans()),
        share=False,
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    c.update(_features(draw, d=d))
    return c


@FUZZ
@given(extend_cases())
@example(
    c=dict(
        KITCHEN_SINK,
        kv="bf16",
        q="bf16",
        k_scale=1.0,
        v_scale=1.0,
        softmax_scale=0.2,
        hkv=1,
        hq=4,
        d=16,
        dv=16,
        page_size=4,
        prefix=[0, 13, 5],
        new=[3, 0, 6],
        pad_tokens=2,
        is_causal=True,
        share=False,
        return_lse=True,
        seed=2,
    )
)
def test_mha_extend_xla(c):
    rng = np.random.default_rng(c["seed"])
    lens = [p + n for p, n in zip(c["prefix"], c["new"])]
    pool = Pool(rng, lens, c["page_size"])
    ks, vs = c["k_scale"], c["v_scale"]
    kc = _cast(pool.fill(rng, (c["hkv"], c["d"]), 3 * ks if c["kv"] == "fp8" else 1.0), c["kv"], ks)
    vc = _cast(pool.fill(rng, (c["hkv"], c["dv"]), 3 * vs if c["kv"] == "fp8" else 1.0), c["kv"], vs)
    cu = np.concatenate([[0], np.cumsum(c["new"])]).astype(np.int32)
    total = int(cu[-1])
    q = np.full((total + c["pad_tokens"], c["hq"], c["d"]), np.nan, np.float32)  # padding rows: NaN
    q[:total] = rng.standard_normal((total, c["hq"], c["d"]))
    q = _cast(q, c["q"])
    sinks = (rng.standard_normal(c["hq"]) * 2).astype(np.float32) if c["sinks"] else None
    kw = dict(is_causal=c["is_causal"], **_opts(c, sinks))
    res = jattn.mha_extend_with_kvcache(
        jnp.asarray(q),
        jnp.asarray(kc),
        jnp.asarray(vc),
        jnp.asarray(pool.page_table),
        jnp.asarray(pool.lens),
        jnp.asarray(cu),
        max_seqlen_q=_pow2(max(c["new"] + [1])),
        return_lse=c["return_lse"],
        backend="xla",
        **dict(kw, sinks=None if sinks is None else jnp.asarray(sinks)),
    )
    out, lse = _unpack(res, c["return_lse"])
    truth, truth_lse = naive.mha_extend(q, kc, vc, pool.page_table, pool.lens, cu, **kw)
    _check(out, truth, tol=XLA_TOL[c["q"]], lse=lse, truth_lse=truth_lse)


# ----------------------------------------------------------------------------- ragged prefill (xla)


@st.composite
def prefill_cases(draw):
    hkv = draw(st.sampled_from([1, 2]))
    dqk = draw(st.sampled_from([8, 24]))  # 24 / 8 or 16: MLA-style head_dim_qk != head_dim_v
    bs = draw(BATCH)
    c = dict(
        hkv=hkv,
        hq=hkv * draw(st.sampled_from([1, 2, 4])),
        d=dqk,
        dv=draw(st.sampled_from([8, 16])),
        q_lens=draw(st.lists(st.integers(0, 9), min_size=bs, max_size=bs)),
        # separate key lengths (fewer keys than queries included), or the queries' own
        kv_lens=draw(st.one_of(st.none(), st.lists(st.integers(0, 14), min_size=bs, max_size=bs))),
        pad_tokens=draw(st.integers(0, 3)),
        is_causal=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    c.update(_features(draw, d=dqk, kv_dtypes=("f32", "bf16", "fp8")))
    return c


@FUZZ
@given(prefill_cases())
@example(
    c=dict(
        KITCHEN_SINK,
        q="f16",
        window_left=2,
        hkv=2,
        hq=4,
        d=24,
        dv=16,
        q_lens=[5, 0, 3],
        kv_lens=[9, 4, 1],  # request 2 has fewer keys than queries
        pad_tokens=1,
        is_causal=True,
        return_lse=True,
        seed=3,
    )
)
def test_mha_prefill_xla(c):
    rng = np.random.default_rng(c["seed"])
    cu_q = np.concatenate([[0], np.cumsum(c["q_lens"])]).astype(np.int32)
    kv_lens = c["q_lens"] if c["kv_lens"] is None else c["kv_lens"]
    cu_kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    tq, tkv = int(cu_q[-1]) + c["pad_tokens"], int(cu_kv[-1]) + c["pad_tokens"]
    if c["kv_lens"] is None:
        tkv = tq

    def ragged(rows, used, tail, scale=1.0):
        x = np.full((rows,) + tail, np.nan, np.float32)  # rows past the last request: NaN
        x[:used] = rng.standard_normal((used,) + tail) * scale
        return x

    ks, vs = c["k_scale"], c["v_scale"]
    fp8 = c["kv"] == "fp8"
    q = _cast(ragged(tq, int(cu_q[-1]), (c["hq"], c["d"])), c["q"])
    k = _cast(ragged(tkv, int(cu_kv[-1]), (c["hkv"], c["d"]), 3 * ks if fp8 else 1.0), c["kv"], ks)
    v = _cast(ragged(tkv, int(cu_kv[-1]), (c["hkv"], c["dv"]), 3 * vs if fp8 else 1.0), c["kv"], vs)
    sinks = (rng.standard_normal(c["hq"]) * 2).astype(np.float32) if c["sinks"] else None
    kw = dict(is_causal=c["is_causal"], **_opts(c, sinks))
    extra = {}
    if c["kv_lens"] is not None:
        extra = dict(cu_seqlens_kv=jnp.asarray(cu_kv), max_seqlen_kv=_pow2(max(kv_lens + [1])))
    res = jattn.mha_prefill(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(cu_q),
        max_seqlen_q=_pow2(max(c["q_lens"] + [1])),
        return_lse=c["return_lse"],
        backend="xla",
        **extra,
        **dict(kw, sinks=None if sinks is None else jnp.asarray(sinks)),
    )
    out, lse = _unpack(res, c["return_lse"])
    truth, truth_lse = naive.mha_prefill(q, k, v, cu_q, None if c["kv_lens"] is None else cu_kv, **kw)
    _check(out, truth, tol=XLA_TOL[c["q"]], lse=lse, truth_lse=truth_lse)


# ----------------------------------------------------------------------------- MLA absorbed decode (xla)


@st.composite
def mla_cases(draw):
    ps = draw(st.sampled_from([1, 4, 16]))
    bs = draw(BATCH)
    kv = draw(st.sampled_from(["f32", "bf16", "fp8"]))
    return dict(
        h=draw(st.sampled_from([1, 2, 4, 8])),
        rank=draw(st.sampled_from([16, 32])),
        rope=draw(st.sampled_from([8, 16])),
        page_size=ps,
        lens=draw(st.lists(_lengths(ps, 40), min_size=bs, max_size=bs)),
        q_len=draw(st.integers(1, 3)),
        is_causal=draw(st.booleans()),
        kv=kv,
        q=draw(st.sampled_from(["f32", "bf16"])) if kv != "bf16" else "bf16",
        kv_scale=draw(st.sampled_from([0.5, 2.0])) if kv == "fp8" else 1.0,
        softmax_scale=draw(st.floats(0.02, 0.5).map(lambda s: round(s, 4))),
        return_lse=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@FUZZ
@given(mla_cases())
@example(
    c=dict(
        h=8,
        rank=16,
        rope=8,
        page_size=4,
        lens=[0, 9, 30],
        q_len=3,
        is_causal=True,
        kv="fp8",
        q="bf16",
        kv_scale=0.5,
        softmax_scale=0.1,
        return_lse=True,
        seed=4,
    )
)
def test_mla_decode_xla(c):
    rng = np.random.default_rng(c["seed"])
    pool = Pool(rng, c["lens"], c["page_size"], share=True)
    width = c["rank"] + c["rope"]
    s = c["kv_scale"]
    kv = _cast(pool.fill(rng, (width,), 3 * s if c["kv"] == "fp8" else 1.0), c["kv"], s)
    n, bs = c["q_len"], len(c["lens"])
    q = _cast(rng.standard_normal((bs * n, c["h"], width)), c["q"])
    kw = dict(
        kv_lora_rank=c["rank"],
        softmax_scale=c["softmax_scale"],
        max_seqlen_q=n,
        is_causal=c["is_causal"],
        kv_scale=s,
    )
    res = jattn.mla_decode_with_kvcache(
        jnp.asarray(q),
        jnp.asarray(kv),
        jnp.asarray(pool.page_table),
        jnp.asarray(pool.lens),
        return_lse=c["return_lse"],
        backend="xla",
        **kw,
    )
    out, lse = _unpack(res, c["return_lse"])
    truth, truth_lse = naive.mla_decode(q, kv, pool.page_table, pool.lens, **kw)
    _check(out, truth, tol=XLA_TOL[c["q"]], lse=lse, truth_lse=truth_lse)


# ----------------------------------------------------------------------------- merge state


@FUZZ
@given(
    t=st.integers(1, 6),
    h=st.integers(1, 4),
    dtype=st.sampled_from(["f32", "bf16"]),
    empty_frac=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_attn_merge_state(t, h, dtype, empty_frac, seed):
    rng = np.random.default_rng(seed)
    o_a, o_b = (_cast(rng.standard_normal((t, h, 8)), dtype) for _ in range(2))
    lse_a, lse_b = ((rng.standard_normal((t, h)) * 6).astype(np.float32) for _ in range(2))
    lse_a[rng.random((t, h)) < empty_frac] = -np.inf  # an empty side (its o is 0, as the ops give)
    lse_b[rng.random((t, h)) < empty_frac] = -np.inf
    o_a[np.isneginf(lse_a)] = 0
    o_b[np.isneginf(lse_b)] = 0
    o, lse = jattn.attn_merge_state(*map(jnp.asarray, (o_a, lse_a, o_b, lse_b)))
    assert o.dtype == o_a.dtype
    truth, truth_lse = naive.merge_state(o_a, lse_a, o_b, lse_b)
    tol = Tol(1e-6, 1e-6, 1e-6, 1e-6) if dtype == "f32" else Tol(1e-6, 2.0**-8, 1e-6, 1e-6)
    _check(o, truth, tol=tol, lse=lse, truth_lse=truth_lse)


# ----------------------------------------------------------------------------- MLA prefill + prefix chunks + merge


@FUZZ
@given(
    h=st.sampled_from([1, 2, 4]),
    nope=st.sampled_from([8, 16]),
    v_dim=st.sampled_from([8, 12]),
    page_size=st.sampled_from([4, 16]),
    prefix=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    new_extra=st.lists(st.integers(0, 6), min_size=3, max_size=3),
    chunk=st.sampled_from([5, 16, 64]),
    scaling=st.one_of(st.none(), st.floats(0.05, 0.5).map(lambda s: round(s, 4))),
    seed=st.integers(0, 2**31 - 1),
)
def test_mla_prefill_prefix_chunks_merge(h, nope, v_dim, page_size, prefix, new_extra, chunk, scaling, seed):
    """MLABackend's non-absorbed prefill over the new tokens (causal, LSE), then one
    non-causal attention per planned prefix chunk (plan_prefix_chunks), merged with
    merge_state: equals causal attention over prefix + new tokens."""
    rng = np.random.default_rng(seed)
    rope, ps = 8, page_size
    bs = len(prefix)
    new = new_extra[:bs]
    lens = [p + n for p, n in zip(prefix, new)]
    cfg = MLAConfig(
        num_heads=h,
        kv_lora_rank=32,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_dim,
        page_size=ps,
        context_len=64,
        kernel_backend="xla",
        scaling=scaling,
        batch_buckets=(1, 2, 4),
    )
    be, layer = MLABackend(cfg), LayerSpec(0, h, 1, nope + rope)
    pool = Pool(rng, lens, ps)
    md = jattn.plan_extend(lens, new, page_size=ps, page_table=pool.page_table, batch_buckets=(1, 2, 4))
    t, cu = md.num_tokens, np.asarray(md.cu_seqlens_q)
    q_all = [rng.standard_normal((n, h, nope + rope)).astype(np.float32) for n in new]
    k_nope = [rng.standard_normal((L, h, nope)).astype(np.float32) for L in lens]
    k_pe = [rng.standard_normal((L, rope)).astype(np.float32) for L in lens]
    vv = [rng.standard_normal((L, h, v_dim)).astype(np.float32) for L in lens]

    def ragged(parts, rows, tail):
        x = np.full((rows,) + tail, np.nan, np.float32)
        cat = np.concatenate(parts) if parts else np.zeros((0,) + tail, np.float32)
        x[: len(cat)] = cat
        return jnp.asarray(x)

    qn = ragged([x[..., :nope] for x in q_all], t, (h, nope))
    qr = ragged([x[..., nope:] for x in q_all], t, (h, rope))
    sl = [slice(p, L) for p, L in zip(prefix, lens)]
    o, lse = be.forward_extend(
        qn,
        ragged([k[s] for k, s in zip(k_nope, sl)], t, (h, nope)),
        ragged([x[s] for x, s in zip(vv, sl)], t, (h, v_dim)),
        layer,
        md,
        q_rope=qr,
        k_rope=ragged([x[s] for x, s in zip(k_pe, sl)], t, (rope,)),
        return_lse=True,
    )
    # The cached prefix, per slot of the pool (NaN where no prefix token is).
    slots = pool.num_pages * ps
    pool_nope = np.full((slots, h, nope), np.nan, np.float32)
    pool_pe = np.full((slots, rope), np.nan, np.float32)
    pool_v = np.full((slots, h, v_dim), np.nan, np.float32)
    for b, p in enumerate(prefix):
        for j in range(p):
            s = pool.slot(b, j)
            pool_nope[s], pool_pe[s], pool_v[s] = k_nope[b][j], k_pe[b][j], vv[b][j]
    chunks = jattn.plan_prefix_chunks(prefix, pool.page_table, page_size=ps, chunk_size=chunk, batch_size=md.batch_size)
    assert len(chunks) == -(-max(prefix) // chunk)

    @functools.partial(jax.jit, static_argnums=0)
    def chunk_step(max_kv, o, lse, cu_kv, k, v, k_rope):
        oc, lc = be.forward_prefix_chunk(
            qn,
            k,
            v,
            layer,
            md.cu_seqlens_q,
            cu_kv,
            max_seqlen_q=md.max_seqlen_q,
            max_seqlen_kv=max_kv,
            q_rope=qr,
            k_rope=k_rope,
        )
        return be.merge_state(o, lse, oc, lc)

    for ch in chunks:
        idx = np.asarray(ch.slots)
        k, v, kr = (jnp.asarray(x[idx]) for x in (pool_nope, pool_v, pool_pe))
        o, lse = chunk_step(ch.max_seqlen_kv, o, lse, ch.cu_seqlens_kv, k, v, kr)
    truth = np.zeros((t, h, v_dim))
    truth_lse = np.full((t, h), -np.inf)
    for b in range(bs):
        k = np.concatenate([k_nope[b], np.broadcast_to(k_pe[b][:, None], (lens[b], h, rope))], -1)
        truth[cu[b] : cu[b + 1]], truth_lse[cu[b] : cu[b + 1]] = naive.attend_one(
            naive.f64(q_all[b]), naive.f64(k), naive.f64(vv[b]), causal=True, scale=cfg.softmax_scale
        )
    _check(o, truth, tol=Tol(1e-4, 1e-4, 1e-4, 1e-5), lse=lse, truth_lse=truth_lse)


# ----------------------------------------------------------------------------- MHABackend through the planners


@st.composite
def mha_backend_cases(draw):
    mode = draw(st.sampled_from(list(ForwardMode)[:4]))  # DECODE, TARGET_VERIFY, DRAFT_BLOCK, EXTEND
    ps = draw(st.sampled_from([1, 4, 16]))
    n = 1 if mode is ForwardMode.DECODE else draw(st.integers(2, 3))
    bs = draw(BATCH)
    d = draw(st.sampled_from([8, 16]))
    hkv = draw(st.sampled_from([1, 2]))
    kv = draw(st.sampled_from(["f32", "bf16", "fp8"]))
    c = dict(
        mode=mode,
        page_size=ps,
        q_len=n,
        hkv=hkv,
        hq=hkv * draw(st.sampled_from([1, 2, 4])),
        d=d,
        kv=kv,
        q="bf16" if kv == "bf16" else draw(st.sampled_from(["f32", "bf16"])),
        lens=draw(st.lists(_lengths(ps, 30), min_size=bs, max_size=bs)),
        new=draw(st.lists(st.integers(0, 5), min_size=bs, max_size=bs)),
        window_left=draw(st.one_of(st.just(-1), st.integers(0, 10))),
        logit_cap=draw(st.sampled_from([0.0, 0.0, 5.0])),
        sinks=draw(st.booleans()),
        scaling=draw(st.one_of(st.none(), st.floats(0.05, 0.5).map(lambda s: round(s, 4)))),
        non_causal=draw(st.booleans()) and draw(st.booleans()),
        k_scale=draw(st.sampled_from([0.25, 1.5])) if kv == "fp8" else 1.0,
        v_scale=draw(st.sampled_from([0.5, 2.0])) if kv == "fp8" else 1.0,
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    return c


@FUZZ
@given(mha_backend_cases())
@example(
    c=dict(
        mode=ForwardMode.TARGET_VERIFY,
        page_size=4,
        q_len=3,
        hkv=2,
        hq=4,
        d=8,
        kv="fp8",
        q="bf16",
        lens=[0, 13, 2],
        new=[0, 0, 0],
        window_left=3,
        logit_cap=5.0,
        sinks=True,
        scaling=None,
        non_causal=False,
        k_scale=0.25,
        v_scale=2.0,
        seed=5,
    )
)
@example(
    c=dict(
        mode=ForwardMode.EXTEND,
        page_size=4,
        q_len=1,
        hkv=1,
        hq=4,
        d=16,
        kv="bf16",
        q="bf16",
        lens=[0, 9, 5],
        new=[4, 0, 3],
        window_left=-1,
        logit_cap=0.0,
        sinks=False,
        scaling=0.2,
        non_causal=False,
        k_scale=1.0,
        v_scale=1.0,
        seed=6,
    )
)
def test_mha_backend(c):
    """init_forward_metadata (buckets, permuted req_to_page rows), the prefix written with
    set_kv_buffer, then forward_decode / forward_extend writing the new tokens: outputs equal
    naive attention over prefix + new K/V, padding rows are 0, and the cache holds exactly
    the tokens written (NaN everywhere else but the dummy page)."""
    rng = np.random.default_rng(c["seed"])
    mode, ps, d, hkv, hq = c["mode"], c["page_size"], c["d"], c["hkv"], c["hq"]
    bs = len(c["lens"])
    if mode.is_extend():
        new = c["new"]
        lens = [length + e for length, e in zip(c["lens"], new)]
    else:
        n = c["q_len"]
        lens = [0 if x == 0 else max(x, n) for x in c["lens"]]  # decode lengths count the n new tokens
        new = [n if x else 0 for x in lens]
    need = [-(-x // ps) for x in lens]
    context = 64
    num_pages = _pow2(1 + sum(need) + 2, lo=8)
    cfg = MHAConfig(
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=ps,
        context_len=context,
        num_pages=num_pages,
        kv_cache_dtype={"f32": "float32", "bf16": "bfloat16", "fp8": "fp8"}[c["kv"]],
        spec_num_tokens=c["q_len"],
        kernel_backend="xla",
        batch_buckets=(1, 2, 4),
    )
    layer = LayerSpec(
        1,
        hq,
        hkv,
        d,
        sliding_window_size=c["window_left"],
        logit_cap=c["logit_cap"],
        k_scale=c["k_scale"],
        v_scale=c["v_scale"],
        scaling=c["scaling"],
        non_causal=c["non_causal"],
    )
    be = MHABackend(cfg)
    # req_to_page has a spare row; requests sit in permuted rows
    r2p = np.zeros((bs + 1, cfg.max_num_pages), np.int32)
    perm = rng.permutation(np.arange(1, num_pages))
    rows = rng.permutation(bs + 1)[:bs]
    i = 0
    for b, nb in enumerate(need):
        r2p[rows[b], :nb] = perm[i : i + nb]
        i += nb
    # Each request's K/V stream (values representable in the cache dtype).
    store = "bf16" if c["kv"] == "bf16" else "f32"
    ks = [_cast(rng.standard_normal((x, hkv, d)), store) for x in lens]
    vs = [_cast(rng.standard_normal((x, hkv, d)), store) for x in lens]
    qs = [_cast(rng.standard_normal((e, hq, d)), c["q"]) for e in new]
    # Layer 1 of a NaN-filled two-layer cache holds each request's prefix (all but the new
    # tokens), written on the host as set_kv_buffer would (FP8: quantised with the scales).
    pools = [np.full((num_pages * ps, hkv, d), np.nan, np.float32) for _ in range(2)]
    for b in range(bs):
        for t in range(lens[b] - new[b]):
            s = r2p[rows[b], t // ps] * ps + t % ps
            pools[0][s], pools[1][s] = ks[b][t], vs[b][t]
    kc, vc = (
        _cast(x, c["kv"], sc).reshape(num_pages, ps, hkv, d) for x, sc in zip(pools, (c["k_scale"], c["v_scale"]))
    )
    nan = jnp.asarray(_cast(np.full(kc.shape, np.nan), c["kv"]))
    cache = PagedKVCache(k=(nan, jnp.asarray(kc)), v=(nan, jnp.asarray(vc)))
    extend = dict(extend_seq_lens=np.array(new)) if mode.is_extend() else {}
    md = be.init_forward_metadata(bs, rows, np.array(lens), r2p, mode, **extend)
    t = md.num_tokens
    q = np.full((t, hq, d), np.nan, np.float32).astype(DTYPES[c["q"]])  # padding tokens: NaN
    k = np.full((t, hkv, d), np.nan, np.float32).astype(DTYPES[store])
    v = k.copy()
    if mode.is_extend():
        cu = np.asarray(md.cu_seqlens_q)
        where = [slice(int(cu[b]), int(cu[b + 1])) for b in range(bs)]
    else:
        where = [slice(b * c["q_len"], b * c["q_len"] + new[b]) for b in range(bs)]
    for b in range(bs):
        q[where[b]], k[where[b]], v[where[b]] = qs[b], ks[b][lens[b] - new[b] :], vs[b][lens[b] - new[b] :]
    sinks = jnp.asarray(rng.standard_normal(hq) * 2, jnp.float32) if c["sinks"] else None
    fwd = be.forward_extend if mode.is_extend() else be.forward_decode
    step = jax.jit(lambda cache, md, q, k, v, sinks: fwd(q, k, v, layer, cache, md, sinks=sinks))
    out, cache2 = step(cache, md, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), sinks)
    out = np.asarray(out.astype(jnp.float32)).reshape(t, hq, d)
    real = np.zeros(t, bool)
    truth = np.zeros((t, hq, d))
    causal = mode is not ForwardMode.DRAFT_BLOCK and not layer.non_causal
    for b in range(bs):
        real[where[b]] = True
        if new[b] == 0:
            continue
        kk, vv = naive.f64(ks[b]), naive.f64(vs[b])
        if c["kv"] == "fp8":
            kk = naive.f64(naive.quantize_fp8(kk, layer.k_scale)) * layer.k_scale
            vv = naive.f64(naive.quantize_fp8(vv, layer.v_scale)) * layer.v_scale
        truth[where[b]], _ = naive.attend_one(
            naive.f64(qs[b]),
            kk,
            vv,
            causal=causal,
            window_left=layer.sliding_window_size,
            logit_cap=layer.logit_cap,
            sinks=None if sinks is None else np.asarray(sinks),
            scale=layer.scaling if layer.scaling is not None else 1 / math.sqrt(d),
        )
    assert (out[~real] == 0).all(), "padding rows must give exactly 0"
    _check(out, truth, tol=XLA_TOL[c["q"]], rows=real)
    # The cache holds every token written, at the plan's pages; other pages are untouched.
    assert np.isnan(naive.f64(cache2.k[0])).all(), "layer 0 was written"
    kc2 = naive.f64(np.asarray(cache2.k[1]))
    table = np.asarray(md.page_table)
    owned = np.zeros(num_pages, bool)
    for b in range(bs):
        want = ks[b] if c["kv"] != "fp8" else naive.quantize_fp8(ks[b], layer.k_scale)
        np.testing.assert_array_equal(naive.gather_paged(kc2, table[b], lens[b]), naive.f64(want))
        owned[table[b, : need[b]]] = True
    owned[jattn.DUMMY_PAGE] = True
    assert np.isnan(kc2[~owned]).all(), "a page no request owns was written"


# ----------------------------------------------------------------------------- MLABackend absorbed


@FUZZ
@example(mode=ForwardMode.DRAFT_EXTEND, h=4, page_size=4, kv="fp8", lens=[7, 0, 12], new=[3, 0, 2], spec=2, seed=7)
@given(
    mode=st.sampled_from([ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND]),
    h=st.sampled_from([1, 2, 4]),
    page_size=st.sampled_from([1, 4, 16]),
    kv=st.sampled_from(["f32", "bf16", "fp8"]),
    lens=st.lists(st.integers(0, 30), min_size=0, max_size=3),
    new=st.lists(st.integers(0, 4), min_size=3, max_size=3),
    spec=st.integers(2, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_mla_backend_absorbed(mode, h, page_size, kv, lens, new, spec, seed):
    rng = np.random.default_rng(seed)
    rank, rope, ps = 32, 8, page_size
    bs = len(lens)
    if mode is ForwardMode.DRAFT_EXTEND:
        new = new[:bs]
        lens = [x + e for x, e in zip(lens, new)]
    else:
        n = 1 if mode is ForwardMode.DECODE else spec
        lens = [0 if x == 0 else max(x, n) for x in lens]
        new = [n if x else 0 for x in lens]
    need = [-(-x // ps) for x in lens]
    num_pages = _pow2(1 + sum(need) + 2, lo=8)
    cfg = MLAConfig(
        num_heads=h,
        kv_lora_rank=rank,
        qk_nope_head_dim=16,
        qk_rope_head_dim=rope,
        v_head_dim=16,
        page_size=ps,
        context_len=64,
        num_pages=num_pages,
        kv_cache_dtype={"f32": "float32", "bf16": "bfloat16", "fp8": "fp8"}[kv],
        spec_num_tokens=spec,
        kernel_backend="xla",
        batch_buckets=(1, 2, 4),
    )
    kv_scale = 0.5 if kv == "fp8" else 1.0
    be, layer = MLABackend(cfg), LayerSpec(0, h, 1, rank + rope, k_scale=kv_scale)
    r2p = np.zeros((bs, cfg.max_num_pages), np.int32)
    perm = rng.permutation(np.arange(1, num_pages))
    i = 0
    for b, nb in enumerate(need):
        r2p[b, :nb] = perm[i : i + nb]
        i += nb
    store = "bf16" if kv == "bf16" else "f32"
    rows = [_cast(rng.standard_normal((x, rank + rope)) * (3 * kv_scale if kv == "fp8" else 1), store) for x in lens]
    # The prefix rows (all but the new tokens) written on the host into a NaN-filled pool.
    pool = np.full((num_pages * ps, rank + rope), np.nan, np.float32)
    for b in range(bs):
        for t in range(lens[b] - new[b]):
            pool[r2p[b, t // ps] * ps + t % ps] = rows[b][t]
    cache = MLAKVCache(kv=(jnp.asarray(_cast(pool, kv, kv_scale).reshape(num_pages, ps, -1)),), kv_lora_rank=rank)
    extend = dict(extend_seq_lens=np.array(new)) if mode.is_extend() else {}
    md = be.init_forward_metadata(bs, np.arange(bs), np.array(lens), r2p, mode, **extend)
    t = md.num_tokens
    qd = "bf16" if kv == "bf16" else "f32"
    q = np.full((t, h, rank + rope), np.nan, np.float32).astype(DTYPES[qd])  # padding tokens: NaN
    c_new = np.full((t, rank + rope), np.nan, np.float32).astype(DTYPES[store])
    if mode.is_extend():
        cu = np.asarray(md.cu_seqlens_q)
        where = [slice(int(cu[b]), int(cu[b + 1])) for b in range(bs)]
    else:
        where = [slice(b * md.max_seqlen_q, b * md.max_seqlen_q + new[b]) for b in range(bs)]
    qs = [_cast(rng.standard_normal((e, h, rank + rope)), qd) for e in new]
    for b in range(bs):
        q[where[b]], c_new[where[b]] = qs[b], rows[b][lens[b] - new[b] :]
    step = jax.jit(
        lambda cache, md, *a: be.forward_absorbed(a[0], a[1], None, layer, cache, md, q_rope=a[2], k_rope=a[3])
    )
    q_nope, q_rope, c_kv, k_rope = q[..., :rank], q[..., rank:], c_new[:, :rank], c_new[:, rank:]
    out, cache2 = step(cache, md, *map(jnp.asarray, (q_nope, c_kv, q_rope, k_rope)))
    out = np.asarray(out.astype(jnp.float32)).reshape(t, h, rank)
    real = np.zeros(t, bool)
    truth = np.zeros((t, h, rank))
    for b in range(bs):
        real[where[b]] = True
        if new[b] == 0:
            continue
        r = naive.f64(rows[b])
        if kv == "fp8":
            r = naive.f64(naive.quantize_fp8(r, kv_scale)) * kv_scale
        truth[where[b]], _ = naive.attend_one(
            naive.f64(qs[b]), r[:, None], r[:, None, :rank], causal=True, scale=cfg.softmax_scale
        )
    assert (out[~real] == 0).all(), "padding rows must give exactly 0"
    _check(out, truth, tol=XLA_TOL[qd] if kv != "fp8" else Tol(1e-4, 1e-4), rows=real)
    got = naive.f64(np.asarray(cache2.kv[0]))
    for b in range(bs):
        want = rows[b] if kv != "fp8" else naive.quantize_fp8(rows[b], kv_scale)
        np.testing.assert_array_equal(naive.gather_paged(got, np.asarray(md.page_table)[b], lens[b]), naive.f64(want))


# ----------------------------------------------------------------------------- Mosaic GPU decode kernel


@st.composite
def mosaic_cases(draw, big: bool = False):
    """Kernel cases: tiny shapes for the interpreter, larger ones on the GPU."""
    if big:
        # 5 and 10 KV heads and a group of 32: heads the all-heads kernel cannot tile
        # (mosaic_decode.no_all_heads_block), which run on the per-KV-head kernel
        hkv = draw(st.sampled_from([1, 2, 4, 8, 5, 10]))
        group = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
        d = draw(st.sampled_from([64, 128, 256]))
        ps = draw(st.sampled_from([16, 32, 64, 128]))
        bs = draw(st.integers(1, 4))
        lens = draw(st.lists(st.one_of(_lengths(ps, 1500), st.integers(0, 300)), min_size=bs, max_size=bs))
        n = draw(st.integers(1, 8))
        splits = draw(st.sampled_from([0, 0, 1, 2, 5, 17]))
        window = draw(st.one_of(st.just(-1), st.integers(0, 400)))
    else:
        # The interpreter simulates every CTA (split x request): a few seconds each.
        hkv = draw(st.sampled_from([1, 2]))
        group = draw(st.sampled_from([1, 2, 4]))
        d, ps = 64, draw(st.sampled_from([16, 32]))
        bs = draw(st.sampled_from([1, 1, 2]))
        lens = draw(st.lists(_lengths(ps, 64), min_size=bs, max_size=bs))
        n = draw(st.integers(1, 4))
        splits = draw(st.sampled_from([0, 1, 2]))
        window = draw(st.one_of(st.just(-1), st.integers(0, 40)))
    kv = draw(st.sampled_from(["bf16", "f16", "fp8"]))
    fp8 = kv == "fp8"
    return dict(
        big=big,
        hkv=hkv,
        hq=hkv * group,
        d=d,
        dv=d,
        page_size=ps,
        lens=lens,
        q_len=n,
        is_causal=draw(st.booleans()),
        share=draw(st.booleans()),
        kv=kv,
        q=draw(st.sampled_from(["bf16", "f16"])) if fp8 else kv,
        window_left=window,
        logit_cap=draw(st.sampled_from([0.0, 0.0, 5.0, 30.0])),
        sinks=draw(st.booleans()),
        softmax_scale=draw(st.one_of(st.none(), st.floats(0.3, 1.5).map(lambda s: round(s / math.sqrt(d), 4)))),
        k_scale=draw(st.sampled_from([0.25, 1.5])) if fp8 else 1.0,
        v_scale=draw(st.sampled_from([0.5, 2.0])) if fp8 else 1.0,
        traced_scales=draw(st.booleans()),  # k_scale / v_scale as f32 arrays instead of Python floats
        return_lse=draw(st.booleans()),
        splits=splits,  # 0: the kernel's choice (through jattn's dispatch); else forced
        overlap_qk=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
        kernel_opts=draw(_kernel_options()),
    )


@st.composite
def _kernel_options(draw):
    """``KernelOptions`` fields for a case besides ``overlap_qk`` (empty: the defaults):
    whether calls go to the per-KV-head kernel, its persistent launch, query-row tiles, FP8
    path (the e4m3 query, ``V^T`` in registers), pipelined loop and glue kernels; the split
    combine kernel; the all-heads kernel's FP8 converter warpgroup and balanced splits."""
    if draw(st.booleans()):
        return {}
    return dict(
        balanced_splits=draw(st.booleans()),
        heads_kernel=draw(st.booleans()),
        heads_persistent=draw(st.booleans()),
        heads_row_tile=draw(st.sampled_from([0, 16, 32])),
        fp8_heads=draw(st.booleans()),
        heads_v_regs=draw(st.booleans()),
        heads_overlap=draw(st.booleans()),
        heads_glue=draw(st.booleans()),
        kernel_combine=draw(st.booleans()),
        fp8_converter=draw(st.booleans()),
    )


def _naive_decode(c, q, kc, vc, pool, kw):
    """naive.mha_decode for the case; at GPU sizes only for the last KV head and its query
    heads (naive loops over every query and head in Python). Returns the truth, its LSE
    and the query heads they cover."""
    heads = np.arange(c["hq"])
    if c.get("big") and c["hkv"] > 1:
        group = c["hq"] // c["hkv"]
        kv_sel = np.array([c["hkv"] - 1])
        heads = (kv_sel[:, None] * group + np.arange(group)[None]).reshape(-1)
        q, kc, vc = q[:, heads], kc[:, :, kv_sel], vc[:, :, kv_sel]
        if kw.get("sinks") is not None:
            kw = dict(kw, sinks=kw["sinks"][heads])
    with np.errstate(invalid="ignore", over="ignore"):
        truth, truth_lse = naive.mha_decode(q, kc, vc, pool.page_table, pool.lens, **kw)
    return truth, truth_lse, heads


def _fp8_query(c, q, kc, vc, sinks, pool, call_kw, opts):
    """The query the call attends with: on an FP8 cache, where ``mosaic_decode`` with the
    options ``opts`` sends the call (no forced splits) to the per-KV-head kernel's
    e4m3-query path (``KernelOptions.fp8_heads``), ``q`` rounded as that path rounds it
    (docs/SEMANTICS.md; one scale per query-row tile with ``heads_row_tile``); else ``q``."""
    from jattn.checks import _window_within
    from jattn.pallas_kernels import mosaic_decode_heads

    if c["kv"] != "fp8" or c["splits"]:
        return q
    window = c["window_left"]
    if c["overlap_qk"]:  # through jattn.mha_decode_with_kvcache, which normalises the window
        window = _window_within(window, pool.width * c["page_size"])
    kw = {k: call_kw[k] for k in ("softmax_scale", "k_scale", "v_scale")}
    routed = mosaic.routed_heads_kernel(
        jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), c["q_len"], window, c["logit_cap"], sinks, **kw,
        is_causal=c["is_causal"], options=opts,
    )  # fmt: skip
    if routed is None or not routed.keywords.get("fp8_qk"):
        return q
    rounded = mosaic_decode_heads.fp8_qk_query(jnp.asarray(q), c["hkv"], c["q_len"], opts.heads_row_tile)
    return np.asarray(rounded, np.float32)


def _run_mosaic(c):
    pool, q, kc, vc, sinks = _decode_inputs(c)
    kw = dict(max_seqlen_q=c["q_len"], is_causal=c["is_causal"], **_opts(c, sinks))
    args = (jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(pool.page_table), jnp.asarray(pool.lens))
    call_kw = dict(kw, sinks=None if sinks is None else jnp.asarray(sinks), return_lse=c["return_lse"])
    if c["traced_scales"]:
        call_kw.update(k_scale=jnp.float32(c["k_scale"]), v_scale=jnp.float32(c["v_scale"]))
    reason = mosaic.unsupported_reason(*args[:3], **{k: v for k, v in call_kw.items() if k != "return_lse"})
    assume(reason is None or reason.startswith("no GPU"))
    if c["splits"]:  # explicit block sizes: the all-heads kernel, whatever the call
        assume(mosaic.one_kv_head_reason(kc, c["q_len"], c["window_left"], c["logit_cap"], sinks) is None)
        assume(not mosaic.no_all_heads_block(args[0], kc))
    opts = mosaic.KernelOptions()  # jattn's op runs the defaults
    if c["splits"] == 0 and c["overlap_qk"]:
        res = jattn.mha_decode_with_kvcache(*args, backend="mosaic", **call_kw)
    else:
        bsz = None
        if c["splits"]:
            bsz = mosaic.choose_block_sizes(
                batch=len(c["lens"]),
                num_kv_heads=c["hkv"],
                head_dim=c["d"],
                page_size=c["page_size"],
                max_pages=pool.width,
                m_rows=c["q_len"] * c["hq"],
                kv_itemsize=kc.dtype.itemsize,
            )
            bsz = dataclasses.replace(bsz, num_splits=c["splits"])
        opts = mosaic.KernelOptions(overlap_qk=c["overlap_qk"], **c.get("kernel_opts", {}))
        res = mosaic.mha_decode(*args, block_sizes=bsz, options=opts, **call_kw)
    out, lse = _unpack(res, c["return_lse"])
    assert out.dtype == q.dtype and out.shape == q.shape
    truth, truth_lse, heads = _naive_decode(c, _fp8_query(c, q, kc, vc, sinks, pool, call_kw, opts), kc, vc, pool, kw)
    tol = _mosaic_tol(c)
    out = np.asarray(out.astype(jnp.float32))[:, heads]
    lse = None if lse is None else np.asarray(lse)[:, heads]
    _check(out, truth, tol=tol, lse=lse, truth_lse=truth_lse, name="mosaic out")


# A plain bf16 decode of real lengths through jattn's dispatch (no forced split count).
PLAIN_DECODE = dict(
    big=False,
    hkv=2,
    hq=8,
    d=64,
    dv=64,
    page_size=16,
    q_len=1,
    is_causal=True,
    share=False,
    kv="bf16",
    q="bf16",
    window_left=-1,
    logit_cap=0.0,
    sinks=False,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    traced_scales=False,
    return_lse=True,
    splits=0,
    overlap_qk=True,
)


@needs_interp
@SLOW
@given(mosaic_cases())
@example(
    c=dict(
        KITCHEN_SINK,
        big=False,
        hkv=2,
        hq=4,
        d=64,
        dv=64,
        page_size=16,
        lens=[0, 37],
        q_len=3,
        is_causal=True,
        share=False,
        window_left=9,
        k_scale=0.25,
        traced_scales=True,
        return_lse=True,
        splits=1,
        overlap_qk=True,
        seed=8,
    )
)
@example(c=dict(PLAIN_DECODE, lens=[57, 1], seed=3))  # the kernel's own split count and combine
def test_mosaic_decode_interpreted(c):
    if on_gpu():
        pytest.skip("the interpreted kernel runs on the CPU; test_mosaic_decode_gpu runs it compiled")
    assume(sum(c["lens"]) > 0)  # a drawn all-empty batch writes zeros only (the XLA properties cover it)
    with gpu_interpret():
        _run_mosaic(c)


@pytest.mark.gpu
@GPU
@given(mosaic_cases(big=True))
def test_mosaic_decode_gpu(c):
    _run_mosaic(c)


# ----------------------------------------------------------------------------- Mosaic GPU prefill / extend kernel


@st.composite
def prefill_kernel_cases(draw, big: bool = False):
    """Ragged prefill (ragged K/V) or paged extend (K/V in a paged cache) for the Mosaic
    prefill kernel: tiny shapes for the interpreter, larger ones on the GPU."""
    paged = draw(st.booleans())
    dims = draw(st.sampled_from([(64, 64), (128, 128), (256, 256), (192, 128)] if big else [(64, 64)]))
    hkv = draw(st.sampled_from([1, 2, 4, 8] if big else [1, 2]))
    bs = draw(st.integers(1, 4) if big else st.sampled_from([1, 1, 2]))
    hi_q, hi_kv = (700, 2500) if big else (40, 48)
    edges = [0, 1, 127, 128, 129] if big else [0, 1, 8, 9]
    q_lens = draw(st.lists(st.one_of(st.sampled_from(edges), st.integers(0, hi_q)), min_size=bs, max_size=bs))
    extra = draw(st.lists(st.integers(0, hi_kv), min_size=bs, max_size=bs))  # prefix keys (extend)
    return dict(
        big=big,
        paged=paged,
        page_size=draw(st.sampled_from([16, 32, 64, 128] if big else [16, 32])) if paged else 0,
        hkv=hkv,
        hq=hkv * draw(st.sampled_from([1, 2, 4, 8] if big else [1, 2])),
        d=dims[0],
        dv=dims[1],
        q_lens=q_lens,
        # extend: keys = prefix + new; prefill: the queries' own keys, or separate key lengths
        kv_lens=[n + e for n, e in zip(q_lens, extra)] if paged or draw(st.booleans()) else None,
        pad_tokens=draw(st.integers(0, 5)),
        is_causal=draw(st.booleans()),
        window_left=draw(st.one_of(st.just(-1), st.integers(0, 800 if big else 20))),
        logit_cap=draw(st.sampled_from([0.0, 0.0, 5.0, 30.0])),
        sinks=draw(st.booleans()),
        softmax_scale=draw(st.one_of(st.none(), st.floats(0.3, 1.5).map(lambda x: round(x / math.sqrt(dims[0]), 4)))),
        q=draw(st.sampled_from(["bf16", "f16"])),
        return_lse=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
        options=draw(_prefill_options(big, dims)),
    )


@st.composite
def _prefill_options(draw, big: bool, dims: tuple[int, int]):
    """``PrefillOptions`` fields for a case (empty: the defaults, through jattn's op): the
    launch (one CTA per tile, or a persistent walk over an SM's worth or a few CTAs; not
    where 192/128 stages its output in the ring), the L2-section order with or without the
    fold, the loop variant (intra-warpgroup overlap or the early K wait), the key block."""
    if draw(st.booleans()):
        return {}
    persistent = draw(st.sampled_from([None, False] if dims[0] != dims[1] else [None, True, False]))
    ctas = (
        0 if persistent is False or dims[0] != dims[1] else draw(st.sampled_from([0, 7, 132] if big else [0, 1, 2, 3]))
    )
    loop = draw(st.sampled_from(["plain", "plain", "overlap_pv", "prefetch_k"]))
    return dict(
        persistent=persistent,
        ctas=ctas,
        l2_section_kib=draw(st.sampled_from([None, 0, 1, 2, 8, 32] if not big else [None, 0, 512, 2048, 24576])),
        fold_sections=draw(st.booleans()),
        overlap_pv=loop == "overlap_pv",
        prefetch_k=loop == "prefetch_k",
        block_kv=draw(st.sampled_from([0, 64])),
    )


def _prefill_call(c, name: str):
    """The op for a prefill kernel case: jattn's (``backend="mosaic"``) with the default
    options, else ``mosaic_prefill``'s own function with the drawn ``PrefillOptions``."""
    if not c.get("options"):
        op = {"mha_extend": jattn.mha_extend_with_kvcache, "mha_prefill": jattn.mha_prefill}[name]
        return functools.partial(op, backend="mosaic")
    from jattn.pallas_kernels import mosaic_prefill

    return functools.partial(getattr(mosaic_prefill, name), options=mosaic_prefill.PrefillOptions(**c["options"]))


def _run_mosaic_prefill(c):
    rng = np.random.default_rng(c["seed"])
    hq, hkv, d, dv, dt = c["hq"], c["hkv"], c["d"], c["dv"], c["q"]
    cu_q = np.concatenate([[0], np.cumsum(c["q_lens"])]).astype(np.int32)
    n_q = int(cu_q[-1])
    q = np.full((n_q + c["pad_tokens"], hq, d), np.nan, np.float32)  # padding rows: NaN
    q[:n_q] = rng.standard_normal((n_q, hq, d))
    q = _cast(q, dt)
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32) if c["sinks"] else None
    opts = dict(
        is_causal=c["is_causal"],
        window_left=c["window_left"],
        logit_cap=c["logit_cap"],
        sinks=sinks,
        softmax_scale=c["softmax_scale"],
    )
    jopts = dict(opts, sinks=None if sinks is None else jnp.asarray(sinks), return_lse=c["return_lse"])
    max_q = _pow2(max(c["q_lens"] + [1]))
    if c["paged"]:
        pool = Pool(rng, c["kv_lens"], c["page_size"])
        kc, vc = _cast(pool.fill(rng, (hkv, d)), dt), _cast(pool.fill(rng, (hkv, dv)), dt)
        args = (q, kc, vc, pool.page_table, pool.lens, cu_q)
        res = _prefill_call(c, "mha_extend")(*map(jnp.asarray, args), max_seqlen_q=max_q, **jopts)
    else:
        kv_lens = c["q_lens"] if c["kv_lens"] is None else c["kv_lens"]
        cu_kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
        n_kv = int(cu_kv[-1])
        if c["kv_lens"] is None:
            n_kv_rows = q.shape[0]
        else:
            n_kv_rows = n_kv + c["pad_tokens"]
        k = np.full((n_kv_rows, hkv, d), np.nan, np.float32)
        v = np.full((n_kv_rows, hkv, dv), np.nan, np.float32)
        k[:n_kv], v[:n_kv] = rng.standard_normal((n_kv, hkv, d)), rng.standard_normal((n_kv, hkv, dv))
        k, v = _cast(k, dt), _cast(v, dt)
        kv_kw = {}
        if c["kv_lens"] is not None:
            kv_kw = dict(cu_seqlens_kv=jnp.asarray(cu_kv), max_seqlen_kv=_pow2(max(kv_lens + [1])))
        res = _prefill_call(c, "mha_prefill")(*map(jnp.asarray, (q, k, v, cu_q)), max_seqlen_q=max_q, **kv_kw, **jopts)
    out, lse = _unpack(res, c["return_lse"])
    assert out.dtype == q.dtype
    if c["big"]:
        # naive's per-(query, head) loops are too slow at these sizes: the f32 reference
        # (which the CPU properties hold to naive) on the same rounded inputs, on the GPU
        from jattn import reference

        f32 = lambda a: jnp.asarray(np.asarray(a, np.float32))  # noqa: E731
        ropts = dict(opts, sinks=None if sinks is None else jnp.asarray(sinks), return_lse=True)
        if c["paged"]:
            truth, truth_lse = reference.mha_extend(
                f32(q),
                f32(kc),
                f32(vc),
                *map(jnp.asarray, (pool.page_table, pool.lens, cu_q)),
                max_seqlen_q=max_q,
                **ropts,
            )
        else:
            truth, truth_lse = reference.mha_prefill(
                f32(q), f32(k), f32(v), jnp.asarray(cu_q), max_seqlen_q=max_q, **kv_kw, **ropts
            )
        truth, truth_lse = naive.f64(truth), naive.f64(truth_lse)
        tol = Tol(3e-2, 3e-2, 3e-2, 3e-2)
    else:
        if c["paged"]:
            truth, truth_lse = naive.mha_extend(q, kc, vc, pool.page_table, pool.lens, cu_q, **opts)
        else:
            truth, truth_lse = naive.mha_prefill(q, k, v, cu_q, None if c["kv_lens"] is None else cu_kv, **opts)
        tol = INTERP_TOL[dt]
    _check(out, truth, tol=tol, lse=lse, truth_lse=truth_lse, name="mosaic prefill")


# A paged extend with every feature the interpreter runs quickly (sinks, an empty request).
PREFILL_EXAMPLE = dict(
    big=False,
    paged=True,
    page_size=16,
    hkv=2,
    hq=4,
    d=64,
    dv=64,
    q_lens=[9, 0, 30],
    kv_lens=[9 + 40, 5, 30 + 17],
    pad_tokens=3,
    is_causal=True,
    window_left=-1,
    logit_cap=0.0,
    sinks=True,
    softmax_scale=None,
    q="f16",
    return_lse=True,
    seed=4,
)


@needs_interp
@settings(SLOW, max_examples=max(2, EXAMPLES // 2))
@given(prefill_kernel_cases())
@example(c=PREFILL_EXAMPLE)
@example(  # a ragged prefill whose two CTAs walk the L2-section order (one KV head a section)
    c=dict(
        PREFILL_EXAMPLE,
        paged=False,
        page_size=0,
        q_lens=[40, 9, 17],
        kv_lens=None,
        pad_tokens=2,
        sinks=False,
        seed=5,
        options=dict(
            persistent=True, ctas=2, l2_section_kib=1, fold_sections=True, overlap_pv=True, prefetch_k=False, block_kv=0
        ),
    )
)
def test_mosaic_prefill_interpreted(c):
    if on_gpu():
        pytest.skip("the interpreted kernel runs on the CPU; test_mosaic_prefill_gpu runs it compiled")
    assume(sum(c["q_lens"]) > 0)
    with gpu_interpret():
        _run_mosaic_prefill(c)


@pytest.mark.gpu
@settings(GPU, max_examples=max(1, GPU_EXAMPLES // 2))
@given(prefill_kernel_cases(big=True))
def test_mosaic_prefill_gpu(c):
    _run_mosaic_prefill(c)


# ----------------------------------------------------------------------------- split-KV combine


@st.composite
def combine_cases(draw, big: bool = False):
    hq = draw(st.integers(1, 8))
    n = draw(st.integers(1, 4))
    return dict(
        splits=draw(st.integers(2, 300 if big else 40)),
        bs=draw(st.integers(1, 3)),
        hq=hq,
        q_len=n,
        extra_rows=draw(st.integers(0, 9)),
        d=draw(st.sampled_from([32, 64, 128, 256] if big else [32, 64])),
        sinks=draw(st.booleans()),
        v_scale=draw(st.sampled_from([None, 0.5, 2.0])),
        dtype=draw(st.sampled_from(["f32", "f16", "bf16"])),
        empty_frac=draw(st.sampled_from([0.0, 0.5, 0.95])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _run_combine(c, use_kernel: bool):
    rng = np.random.default_rng(c["seed"])
    m = c["q_len"] * c["hq"]
    rows = m + c["extra_rows"]
    s, bs, d = c["splits"], c["bs"], c["d"]
    o = _cast(rng.standard_normal((s, bs, rows, d)), c["dtype"])
    lse = (rng.standard_normal((s, bs, rows)) * 4).astype(np.float32)
    lse[rng.random((s, bs, rows)) < c["empty_frac"]] = -np.inf  # empty splits
    lse[:, -1, m - 1] = -np.inf  # a row no split has keys for
    o[:, :, m:] = np.nan  # rows past the query rows are never read
    sinks = (rng.standard_normal(c["hq"]) * 2).astype(np.float32) if c["sinks"] else None
    merge = jax.jit(
        lambda o, lse, sinks: combine.combine_splits(
            o,
            lse,
            q_len=c["q_len"],
            num_q_heads=c["hq"],
            sinks=sinks,
            v_scale=c["v_scale"],
            out_dtype=jnp.float32,
            use_kernel=use_kernel,
        )
    )
    out, lse_out = merge(jnp.asarray(o), jnp.asarray(lse), None if sinks is None else jnp.asarray(sinks))
    # float64: merge in base 2, natural-log LSE, then sinks and v_scale
    lse64, o64 = naive.f64(lse)[:, :, :m], naive.f64(o)[:, :, :m]
    mx = lse64.max(0)
    mxs = np.where(np.isneginf(mx), 0.0, mx)
    w = np.exp2(lse64 - mxs)
    ws = w.sum(0)
    empty = ws == 0
    truth = (w[..., None] * np.where(w[..., None] > 0, o64, 0)).sum(0) / np.where(empty, 1.0, ws)[..., None]
    truth_lse = np.where(empty, -np.inf, (mxs + np.log2(np.where(empty, 1.0, ws))) * math.log(2.0))
    if sinks is not None:
        sk = naive.f64(sinks)[np.arange(m) % c["hq"]][None]
        truth = truth * np.where(empty, 1.0, 1.0 / (1.0 + np.exp(sk - truth_lse)))[..., None]
    if c["v_scale"] is not None:
        truth = truth * c["v_scale"]
    shape = (bs * c["q_len"], c["hq"])
    _check(
        out,
        truth.reshape(shape + (d,)),
        tol=Tol(2e-5, 2e-5, 1e-5, 1e-5),
        lse=lse_out,
        truth_lse=truth_lse.reshape(shape),
        name="combine",
    )


@settings(FUZZ, max_examples=max(1, EXAMPLES // 2))
@given(combine_cases())
def test_combine_splits_xla(c):
    """The split merge as XLA ops (what the interpreted kernel and GPUs without jax-triton
    use), with empty splits (LSE -inf, whose weight is 0: the kernels write their partial
    output as 0, which the merge multiplies by that weight)."""
    if on_gpu():
        pytest.skip("test_combine_triton_gpu covers the GPU")
    _run_combine(c, use_kernel=False)


@pytest.mark.gpu
@GPU
@given(combine_cases(big=True))
def test_combine_triton_gpu(c):
    from jattn.pallas_kernels import triton_glue

    if not triton_glue.available():
        pytest.skip("jax-triton not installed here")
    _run_combine(c, use_kernel=True)


# ----------------------------------------------------------------------------- poison in masked keys


@st.composite
def poison_cases(draw, kernel: bool = False, big: bool = False):
    """A decode case in which keys inside ``L`` are hidden from the first query of their
    request (causal multi-token rows, or a sliding window); some of them hold NaN / Inf."""
    c = draw(mosaic_cases(big=big)) if kernel else draw(decode_cases())
    if c["window_left"] < 0 and (c["q_len"] < 2 or not c["is_causal"]):
        c["window_left"] = draw(st.integers(0, 3))
    low = c["q_len"] + max(c["window_left"], 0) + 2  # long enough for a key to be hidden
    c["lens"] = [max(x, low) for x in c["lens"]] or [low]
    c["poison"] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    c["poison_k"] = draw(st.booleans())
    return c


def _poisoned(c):
    """The case's inputs with poison at some key positions inside ``L`` that the first query
    of the request does not see (at least one per request). Truth: naive's, which reads the
    visible keys only (a row that sees poison is non-finite there and is not compared)."""
    pool, q, kc, vc, sinks = _decode_inputs(c)
    kc, vc = kc.copy(), vc.copy()
    kflat, vflat = kc.reshape((-1,) + kc.shape[2:]), vc.reshape((-1,) + vc.shape[2:])
    rng = np.random.default_rng(c["seed"] + 1)
    n = c["q_len"]
    for b, length in enumerate(c["lens"]):
        pos0 = length - n  # the first query's position
        hidden = [
            j
            for j in range(length)
            if (c["is_causal"] and j > pos0) or (c["window_left"] >= 0 and j < pos0 - c["window_left"])
        ]
        assert hidden, (length, n, c["window_left"])
        for j in set(rng.choice(hidden, size=max(1, len(hidden) // 2))):
            s = pool.slot(b, int(j))
            vflat[s] = c["poison"]
            if c["poison_k"]:
                kflat[s] = c["poison"]
    kw = dict(max_seqlen_q=n, is_causal=c["is_causal"], **_opts(c, sinks))
    truth, truth_lse, heads = _naive_decode(c, q, kc, vc, pool, kw)
    rows = np.isfinite(truth).all(axis=(1, 2))  # rows that see no poisoned key
    assert rows.any()
    return pool, q, kc, vc, sinks, kw, (truth, truth_lse, heads), rows


@settings(FUZZ, max_examples=max(2, EXAMPLES // 2))
@given(poison_cases())
def test_masked_keys_contribute_nothing_xla(c):
    """NaN / Inf in K or V at keys a query does not see (causal, window) never reach it."""
    pool, q, kc, vc, sinks, kw, (truth, truth_lse, _), rows = _poisoned(c)
    out, lse = jattn.mha_decode_with_kvcache(
        jnp.asarray(q),
        jnp.asarray(kc),
        jnp.asarray(vc),
        jnp.asarray(pool.page_table),
        jnp.asarray(pool.lens),
        return_lse=True,
        backend="xla",
        **dict(kw, sinks=None if sinks is None else jnp.asarray(sinks)),
    )
    _check(out, truth, tol=XLA_TOL[c["q"]], lse=lse, truth_lse=truth_lse, rows=rows, name="poisoned")


def _run_mosaic_poisoned(c):
    pool, q, kc, vc, sinks, kw, (truth, truth_lse, heads), rows = _poisoned(c)
    reason = mosaic.unsupported_reason(q, kc, vc, **kw)
    assume(reason is None or reason.startswith("no GPU"))
    out, lse = jattn.mha_decode_with_kvcache(
        jnp.asarray(q),
        jnp.asarray(kc),
        jnp.asarray(vc),
        jnp.asarray(pool.page_table),
        jnp.asarray(pool.lens),
        return_lse=True,
        backend="mosaic",
        **dict(kw, sinks=None if sinks is None else jnp.asarray(sinks)),
    )
    tol = _mosaic_tol(c)
    out, lse = np.asarray(out.astype(jnp.float32))[:, heads], np.asarray(lse)[:, heads]
    _check(out, truth, tol=tol, lse=lse, truth_lse=truth_lse, rows=rows, name="mosaic poisoned")


@needs_interp
@settings(SLOW, max_examples=max(1, EXAMPLES // 4))
@given(poison_cases(kernel=True))
@example(c=dict(PLAIN_DECODE, lens=[40, 23], q_len=3, window_left=-1, poison=np.nan, poison_k=False, seed=6))
def test_masked_keys_contribute_nothing_mosaic_interpreted(c):
    if on_gpu():
        pytest.skip("the interpreted kernel runs on the CPU")
    with gpu_interpret():
        _run_mosaic_poisoned(c)


@pytest.mark.gpu
@settings(GPU, max_examples=max(1, GPU_EXAMPLES // 4))
@given(poison_cases(kernel=True, big=True))
def test_masked_keys_contribute_nothing_mosaic_gpu(c):
    _run_mosaic_poisoned(c)
