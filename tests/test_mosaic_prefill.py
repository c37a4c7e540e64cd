"""Tests of the Mosaic GPU ragged prefill / paged extend kernel
(``jattn.pallas_kernels.mosaic_prefill``).

Each case runs on the CPU under the Mosaic GPU interpreter at small shapes (f16:
tile order, page addressing, ring, barriers, masks, softmax) and on an H200
(marker ``gpu``, bf16) at larger ones. The oracles are the f32
``jattn.reference.mha_prefill`` / ``mha_extend``. Inputs are fresh random draws;
the rows past the ragged totals, unused pages and page tails hold NaN.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jattn import reference
from jattn.pallas_kernels import mosaic_prefill as mp
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
    return dict(is_causal=c.causal, window_left=c.window_left, logit_cap=c.logit_cap)


def _run(c: Case, x, dtype):
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    s = None if x["sinks"] is None else jnp.asarray(x["sinks"])
    if not c.page_size:
        return mp.mha_prefill(
            cast(x["q"]), cast(x["k"]), cast(x["v"]), x["cu_q"], x["cu_kv"], sinks=s, return_lse=True, **_opts(c)
        )
    return mp.mha_extend(
        cast(x["q"]),
        cast(x["k"]),
        cast(x["v"]),
        x["table"],
        x["lens"],
        x["cu_q"],
        sinks=s,
        return_lse=True,
        **_opts(c),
    )


def _oracle(c: Case, x, dtype):
    # the oracle sees the same rounded inputs, in f32
    r = lambda a: jnp.asarray(jnp.asarray(a, dtype), jnp.float32)  # noqa: E731
    s = None if x["sinks"] is None else jnp.asarray(x["sinks"])
    mq = max(max(c.q_lens), 1)
    if not c.page_size:
        kv_lens = np.diff(x["cu_kv"])
        return reference.mha_prefill(
            r(x["q"]),
            r(x["k"]),
            r(x["v"]),
            jnp.asarray(x["cu_q"]),
            jnp.asarray(x["cu_kv"]),
            max_seqlen_q=mq,
            max_seqlen_kv=max(int(kv_lens.max(initial=0)), 1),
            sinks=s,
            return_lse=True,
            **_opts(c),
        )
    return reference.mha_extend(
        r(x["q"]),
        r(x["k"]),
        r(x["v"]),
        jnp.asarray(x["table"]),
        jnp.asarray(x["lens"]),
        jnp.asarray(x["cu_q"]),
        max_seqlen_q=mq,
        sinks=s,
        return_lse=True,
        **_opts(c),
    )


def _check(c: Case, dtype, seed=0, tol=2e-2):
    x = _inputs(c, seed, dtype)
    o, lse = _run(c, x, dtype)
    want_o, want_lse = _oracle(c, x, dtype)
    n = int(x["cu_q"][-1])
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    assert np.isfinite(o[:n]).all(), "NaN/Inf in a real row"
    np.testing.assert_allclose(o[:n], np.asarray(want_o)[:n], atol=tol, rtol=tol)
    np.testing.assert_allclose(lse[:n], np.asarray(want_lse)[:n], atol=tol, rtol=tol)
    assert (o[n:] == 0).all() and np.isneginf(lse[n:]).all(), "padding rows must be 0 / -inf"
    o2, _ = _run(c, x, dtype)
    assert np.array_equal(np.asarray(o2, np.float32), o, equal_nan=True), "not deterministic"


# Interpreted (slow: about a minute per case on one CI core, so the default run keeps
# three that cover ragged tiles across requests with lengths 0 and 1, the paged
# extend with pages smaller than a block plus window, cap and sinks, and the
# non-causal 192/128 MLA shape; `-m slow` runs the rest).
CPU_CASES = [
    Case(q_lens=(97, 0, 1, 13)),
    Case(q_lens=(9, 3), prefix=(40, 0), page_size=16, hq=2, hkv=1, window_left=20, logit_cap=5.0, sinks=True),
    Case(q_lens=(21, 6), hq=2, hkv=2, d=192, dv=128, causal=False),
    pytest.param(Case(q_lens=(130, 5)), marks=pytest.mark.slow),
    pytest.param(Case(q_lens=(70,), hq=2, hkv=1, window_left=20, logit_cap=5.0, sinks=True), marks=pytest.mark.slow),
    pytest.param(Case(q_lens=(20, 1, 0), prefix=(150, 7, 4), page_size=64, hq=2, hkv=1), marks=pytest.mark.slow),
]


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
@pytest.mark.parametrize("c", CPU_CASES, ids=str)
def test_interpreted(c):
    with gpu_interpret():
        _check(c, jnp.float16)


GPU_CASES = [
    Case(q_lens=(1000, 0, 1, 97, 2049), hq=32, hkv=8, d=128),
    Case(q_lens=(777, 300), hq=16, hkv=16, d=64, causal=False),
    Case(q_lens=(1500,), hq=8, hkv=2, d=256, window_left=300, logit_cap=30.0, sinks=True),
    Case(q_lens=(900, 33), hq=16, hkv=16, d=192, dv=128),
    Case(q_lens=(300, 5, 129), prefix=(2000, 0, 77), page_size=16, hq=32, hkv=8, d=128),
    Case(q_lens=(513, 64), prefix=(1000, 3000), page_size=64, hq=32, hkv=8, d=128, window_left=700),
    Case(q_lens=(256,), prefix=(4000,), page_size=128, hq=8, hkv=1, d=128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=str)
def test_gpu(c):
    if not on_gpu():
        pytest.skip("needs a GPU")
    _check(c, jnp.bfloat16, tol=3e-2)
