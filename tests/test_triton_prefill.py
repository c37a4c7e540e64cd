"""The Triton ragged prefill / paged extend kernel (``jattn.pallas_kernels.triton_prefill``).

CPU: the kernel source under Triton's interpreter on torch CPU tensors (``jattn.bridge.triton_native.prefill``,
a subprocess with ``TRITON_INTERPRET=1``; f16/f32 queries, since the interpreter's
``tl.dot`` is wrong on bf16; one case with an FP8 e4m3 cache), each case run twice
(bit-identical) and compared with the float64 loops of ``tests/naive.py``. GPU (marker
``gpu``): ``jattn.mha_prefill`` / ``jattn.mha_extend_with_kvcache`` with
``backend="triton"`` through jax-triton in bf16 and FP8 against the f32 reference.

Inputs are fresh random draws at awkward sizes (lengths 0, 1, 97); padding query and key
rows, unused pages and page tails hold NaN, page tables are permuted, and poison cases
put NaN in the V of a key that earlier queries do not see. Eight more CPU cases are drawn
at random from a fixed seed (``random_cases``; ``JATTN_TRITON_FUZZ_SEED`` and
``JATTN_TRITON_FUZZ_CASES`` draw others).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from interpreted import random_draw, run_in_interpreter
from naive import Pool
from naive import mha_extend as extend_f64
from naive import mha_prefill as prefill_f64

from jattn.pallas_kernels.interpret import on_gpu


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "prefill" (ragged K/V) or "extend" (paged cache)
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...] | None = None  # prefill: None = q_lens; extend: cache lengths
    hq: int = 4
    hkv: int = 2
    d: int = 64
    dv: int = 64
    page_size: int = 16
    causal: bool = True
    window_left: int = -1
    logit_cap: float = 0.0
    sinks: bool = False
    k_scale: float = 1.0
    v_scale: float = 1.0
    poison: int | None = None  # NaN in V of request 0's key at this position
    dtype: str = "float32"
    fp8: bool = False  # FP8 e4m3 K/V (extend)
    pad: int = 3  # padding query rows past cu_seqlens_q[-1]
    block_m: int | None = None
    block_n: int | None = None
    softmax_scale: float | None = None  # None: 1 / sqrt(d)


CASES = {
    "prefill_gqa_lens_0_1_97_small_tiles": Case("prefill", (97, 0, 1, 40), block_m=32, block_n=16),
    # a negative scale: the kernel runs it as a positive one on negated queries
    "prefill_causal_poison_future_v": Case(
        "prefill", (70, 33), hq=2, hkv=1, poison=41, block_m=16, block_n=16, softmax_scale=-0.2
    ),
    "prefill_192_128_longer_kv_fp16": Case(  # a negative scale: q's columns past 128 too
        "prefill",
        (20, 1, 9),
        kv_lens=(50, 7, 0),
        hq=2,
        hkv=2,
        d=192,
        dv=128,
        dtype="float16",
        block_m=16,
        softmax_scale=-0.1,
    ),
    "prefill_noncausal_window_cap_sinks": Case(
        "prefill", (33, 5), causal=False, window_left=9, logit_cap=4.0, sinks=True, block_m=16, block_n=16
    ),
    # a NaN V (key 5) that the non-causal window hides from every query of request 0 but
    # that sits in a block some of them visit: the edge cleaning keeps their rows finite
    "prefill_noncausal_window_poison_hidden": Case(
        "prefill", (40, 3), causal=False, window_left=8, poison=5, block_m=16, block_n=16
    ),
    "extend_permuted_pages_lens_0_1_97": Case("extend", (30, 1, 0, 40), kv_lens=(97, 1, 0, 40), hq=8, hkv=2),
    "extend_fp16_window_cap_sinks_scales_poison": Case(
        "extend",
        (25, 3),
        kv_lens=(60, 3),
        hq=4,
        hkv=1,
        d=128,
        dv=128,
        page_size=32,
        window_left=12,
        logit_cap=5.0,
        sinks=True,
        k_scale=0.5,
        v_scale=2.0,
        poison=50,
        dtype="float16",
        block_m=16,
        block_n=16,
    ),
    "extend_fp8_d256": Case(
        "extend", (5, 17), kv_lens=(40, 17), hq=2, hkv=1, d=256, dv=256, page_size=8, k_scale=0.7, v_scale=1.5,
        dtype="float16", fp8=True, block_m=16,
    ),
    # a window whose first key is the last key of a block for a tile's first row (window 17,
    # 16-key blocks: the tile at query 32 sees keys 15..32, the one at 48 keys 31..48): the
    # first key block must be the one holding that key, not the next
    "prefill_causal_window_first_key_ends_a_block": Case(
        "prefill", (64, 5), hq=2, hkv=1, window_left=17, block_m=16, block_n=16
    ),
}  # fmt: skip


def random_cases(seed: int, n: int) -> dict[str, Case]:
    """``n`` cases drawn from ``seed``: ragged prefill or paged extend, query lengths at
    and around the tile edges (0 and 1 among them), longer key sides, GQA groups, head
    sizes (192/128 for prefill), causal or not, a window, a logit cap, sinks, scales, FP8
    (extend), a poisoned key, a softmax scale and the tiles. The names carry the seed, so
    the interpreter's subprocess draws the same cases."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        kind = str(rng.choice(("prefill", "extend")))
        q_lens = tuple(int(x) for x in rng.choice((0, 1, 2, 15, 16, 17, 33, 40), int(rng.integers(1, 4))))
        kv_lens = tuple(q + int(rng.choice((0, 0, 1, 9, 30))) for q in q_lens)
        hkv = int(rng.choice((1, 2)))
        d, dv = (192, 128) if kind == "prefill" and rng.random() < 0.2 else (int(rng.choice((64, 128))),) * 2
        fp8 = bool(kind == "extend" and rng.random() < 0.3)
        out[f"random_{seed}_{i}"] = Case(
            kind,
            q_lens,
            kv_lens=None if kind == "prefill" and rng.random() < 0.4 else kv_lens,
            hq=hkv * int(rng.choice((1, 2, 4))),
            hkv=hkv,
            d=d,
            dv=dv,
            page_size=int(rng.choice((8, 16, 32))),
            causal=bool(rng.random() < 0.7),
            window_left=int(rng.choice((3, 12, 25))) if rng.random() < 0.4 else -1,
            logit_cap=4.0 if rng.random() < 0.3 else 0.0,
            sinks=bool(rng.random() < 0.3),
            k_scale=float(rng.choice((1.0, 0.5))) if kind == "extend" else 1.0,
            v_scale=float(rng.choice((1.0, 2.0))) if kind == "extend" else 1.0,
            # FP8 rows without poison: the interpreter reads an e4m3 NaN as a number
            poison=int(rng.integers(0, q_lens[0])) if q_lens[0] > 0 and not fp8 and rng.random() < 0.5 else None,
            dtype="float16" if fp8 or rng.random() < 0.5 else "float32",
            fp8=fp8,
            block_m=None if rng.random() < 0.4 else int(rng.choice((16, 32, 64))),
            block_n=None if rng.random() < 0.4 else int(rng.choice((16, 32))),
            softmax_scale=None if rng.random() < 0.7 else float(rng.choice((0.3, -0.2))),
        )
    return out


CASES.update(random_cases(*random_draw()))


# GPU only (long enough that tiles of 128 rows have blocks below the diagonal), each
# at several launches (block_m, block_n, warps, stages).
GPU_CASES = {
    "gpu_prefill_d128_long_poison": Case("prefill", (700, 0, 1, 300, 1000), hq=8, hkv=2, d=128, dv=128, poison=500),
    "gpu_extend_d128_long_window_cap_sinks": Case(
        "extend", (300, 1, 200), kv_lens=(900, 1, 1000), hq=8, hkv=2, d=128, dv=128, page_size=64,
        window_left=333, logit_cap=30.0, sinks=True,
    ),
    "gpu_prefill_d256_long": Case("prefill", (600, 1, 300), hq=4, hkv=1, d=256, dv=256),
    "gpu_prefill_192_128_long": Case("prefill", (600, 300), hq=4, hkv=2, d=192, dv=128),
}  # fmt: skip
GPU_LAUNCHES = {
    128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)],
    192: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
    256: [(64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 4)],
}


def _offsets(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _inputs(name):
    """The case's arrays (numpy): q, k, v (FP8 as ml_dtypes), cu_q, and cu_kv (prefill)
    or page_table and cache_seqlens (extend); NaN wherever no real token is."""
    c = CASES[name] if name in CASES else GPU_CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    cu_q = _offsets(c.q_lens)
    t = int(cu_q[-1]) + c.pad
    q = rng.standard_normal((t, c.hq, c.d)).astype(np.float32)
    q[cu_q[-1] :] = np.nan  # padding rows: never reach a real row, come out 0
    sinks = rng.standard_normal(c.hq).astype(np.float32) if c.sinks else None
    if c.kind == "prefill":
        kv_lens = c.q_lens if c.kv_lens is None else c.kv_lens
        cu_kv = _offsets(kv_lens)
        n = int(cu_kv[-1]) + 5
        k = rng.standard_normal((n, c.hkv, c.d)).astype(np.float32)
        v = rng.standard_normal((n, c.hkv, c.dv)).astype(np.float32)
        k[cu_kv[-1] :] = np.nan
        v[cu_kv[-1] :] = np.nan
        if c.poison is not None:
            v[cu_kv[0] + c.poison, :, 3] = np.nan
        extra = dict(cu_seqlens_kv=None if c.kv_lens is None else cu_kv)
    else:
        pool = Pool(rng, c.kv_lens, c.page_size, max_pages=max(-(-x // c.page_size) for x in c.kv_lens) + 2)
        k, v = pool.fill(rng, (c.hkv, c.d)), pool.fill(rng, (c.hkv, c.dv))
        if c.poison is not None:
            j = c.poison
            v[pool.page_table[0, j // c.page_size], j % c.page_size, :, 3] = np.nan
        extra = dict(page_table=pool.page_table, cache_seqlens=pool.lens)
    kd = ml_dtypes.float8_e4m3fn if c.fp8 else c.dtype
    return c, q.astype(c.dtype), k.astype(kd), v.astype(kd), cu_q, sinks, extra


def _options(c, sinks):
    return dict(
        is_causal=c.causal,
        window_left=c.window_left,
        logit_cap=c.logit_cap,
        sinks=sinks,
        k_scale=c.k_scale,
        v_scale=c.v_scale,
        softmax_scale=c.softmax_scale,
    )


def _seen_by(c, cu_q, extra):
    """Query rows (of request 0) that see the poisoned key."""
    if c.poison is None:
        return np.zeros(0, int)
    n = c.q_lens[0]
    big_l = (c.q_lens if c.kv_lens is None else c.kv_lens)[0]
    pos = big_l - n + np.arange(n)
    sees = np.ones(n, bool) if not c.causal else c.poison <= pos
    if c.window_left >= 0:
        sees &= c.poison >= pos - c.window_left
    return cu_q[0] + np.flatnonzero(sees)


def run_interpreted(name: str, path: str) -> None:
    """In a TRITON_INTERPRET=1 process: the kernel on torch CPU tensors, twice."""
    import torch

    from jattn.bridge import triton_native

    c, q, k, v, cu_q, sinks, extra = _inputs(name)

    def t(a):
        a = np.ascontiguousarray(a)
        if a.dtype == ml_dtypes.float8_e4m3fn:
            return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
        return torch.from_numpy(a)

    kw = {key: (None if val is None else t(val)) for key, val in extra.items()}
    runs = []
    for _ in range(2):
        o, lse = triton_native.prefill(
            t(q), t(k), t(v), t(cu_q), **kw, **_options(c, sinks), block_m=c.block_m, block_n=c.block_n
        )
        runs.append((o.float().numpy(), lse.numpy()))
    np.savez(path, o=runs[0][0], lse=runs[0][1], o2=runs[1][0], lse2=runs[1][1])


# Cases also run through the JAX entry points (``mha_prefill`` / ``mha_extend``), whose host
# code (parameter vector, padding request, tile list, grid, LSE) runs on the CPU with
# ``triton_glue.triton_call`` launching the source under the interpreter: a head width
# 192/128 with a negative scale, and an extend with sinks, scales and a poisoned key.
JAX_PATH_CASES = ["prefill_192_128_longer_kv_fp16", "extend_fp16_window_cap_sinks_scales_poison"]


def run_jax_path(name: str, path: str) -> None:
    """In a TRITON_INTERPRET=1 process: the case through ``triton_prefill.mha_prefill`` /
    ``mha_extend`` (``name`` is ``jax_`` and the case's name), eagerly."""
    import jax
    from interpreted import interpreted_triton_call

    from jattn.pallas_kernels import triton_glue
    from jattn.pallas_kernels import triton_prefill as tp

    c, q, k, v, cu_q, sinks, extra = _inputs(name.removeprefix("jax_"))
    triton_glue.triton_call = interpreted_triton_call
    kw = dict(_options(c, sinks), return_lse=True, block_m=c.block_m, block_n=c.block_n)
    more = {}
    with jax.disable_jit():
        if c.kind == "prefill":
            o, lse = tp.mha_prefill(q, k, v, cu_q, extra["cu_seqlens_kv"], **kw)
            # the default scale, 1/sqrt(head_dim_qk) (not of the value width), given and not
            for tag, scale in (("default", None), ("given", q.shape[-1] ** -0.5)):
                kw.update(softmax_scale=scale)
                more[tag] = np.asarray(tp.mha_prefill(q, k, v, cu_q, extra["cu_seqlens_kv"], **kw)[0], np.float32)
        else:
            o, lse = tp.mha_extend(q, k, v, extra["page_table"], extra["cache_seqlens"], cu_q, **kw)
    np.savez(path, o=np.asarray(o, np.float32), lse=np.asarray(lse), **more)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    runs = {"run_interpreted": list(CASES), "run_jax_path": ["jax_" + n for n in JAX_PATH_CASES]}
    return run_in_interpreter(tmp_path_factory, "test_triton_prefill", runs)


def _expect(name):
    """float64 truth on the clean data (the poisoned V entry restored to a finite value)."""
    c, q, k, v, cu_q, sinks, extra = _inputs(name)
    v = np.asarray(v, np.float64)
    if c.poison is not None:
        v = np.where(np.isnan(v), 0.0, v)  # only the attention of rows that do not see it is compared
    kw = _options(c, sinks)
    if c.kind == "prefill":
        return prefill_f64(q, k, v, cu_q, extra["cu_seqlens_kv"], **kw)
    return extend_f64(q, k, v, extra["page_table"], extra["cache_seqlens"], cu_q, **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_float64(name, interpreted):
    res = interpreted[name]
    c, _, _, _, cu_q, _, extra = _inputs(name)
    out, lse = res["o"], res["lse"]
    want, want_lse = _expect(name)
    bad = _seen_by(c, cu_q, extra)
    if bad.size:
        assert not np.isfinite(out[bad]).all(axis=(1, 2)).any(), "a row that sees a NaN V must be non-finite"
    rows = np.setdiff1d(np.arange(out.shape[0]), bad)
    assert np.isfinite(out[rows]).all(), "NaN/Inf leaked into a real row"
    atol = 2e-2 if c.dtype == "float16" else 2e-4
    np.testing.assert_allclose(out[rows], want[rows], atol=atol, rtol=atol)
    np.testing.assert_array_equal(np.isneginf(lse[rows]), np.isneginf(want_lse[rows]))
    fin = np.isfinite(want_lse[rows])
    np.testing.assert_allclose(lse[rows][fin], want_lse[rows][fin], atol=1e-3, rtol=1e-4)
    empty = np.isneginf(want_lse[rows]).all(axis=1)
    assert (out[rows][empty] == 0).all()
    assert (out[cu_q[-1] :] == 0).all() and np.isneginf(lse[cu_q[-1] :]).all()  # padding rows
    np.testing.assert_array_equal(res["o"], res["o2"])  # deterministic
    np.testing.assert_array_equal(res["lse"], res["lse2"])


@pytest.mark.parametrize("name", JAX_PATH_CASES)
def test_jax_entry_points_interpreted_match_the_torch_launch(name, interpreted):
    """The JAX entry points give the torch launch's outputs and natural-log LSE (the GPU
    tests alone ran their host code: a scale from the value width, a sink read past the
    parameters, a grid over KV heads or a base-2 LSE there passed every CPU test); the
    192/128 case's default scale is that of the query width."""
    jax_run, torch_run = interpreted["jax_" + name], interpreted[name]
    assert np.isfinite(torch_run["lse"]).any()
    np.testing.assert_allclose(jax_run["o"], torch_run["o"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax_run["lse"], torch_run["lse"], rtol=1e-6, atol=1e-6)
    if "default" in jax_run.files:
        np.testing.assert_array_equal(jax_run["default"], jax_run["given"])


@pytest.mark.parametrize("causal,window", [(True, -1), (False, -1), (True, 5)])
def test_tile_plan_covers_every_row_once(causal, window):
    """The device-side tile list (JAX and torch give the same): every query row of every
    request in exactly one tile, longest work first, no tile for an empty request."""
    torch = pytest.importorskip("torch")
    from jattn.bridge import triton_native
    from jattn.pallas_kernels import triton_prefill as tp

    q_lens, kv_lens = np.array([97, 0, 1, 40, 16, 3]), np.array([97, 4, 1, 300, 16, 0])
    cu = _offsets(q_lens)
    bm = 16
    nt = tp.num_tiles_bound(int(cu[-1]), len(q_lens), bm)
    kw = dict(block_m=bm, is_causal=causal, window_left=window)
    req, q0 = (np.asarray(a) for a in tp.tile_plan(jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), nt, **kw))
    treq, tq0 = triton_native.prefill_tile_plan(
        torch.from_numpy(cu), torch.from_numpy(kv_lens.astype(np.int32)), nt, **kw
    )
    np.testing.assert_array_equal(req, treq.numpy())
    np.testing.assert_array_equal(q0[req >= 0], tq0.numpy()[req >= 0])
    covered = np.zeros(int(cu[-1]), int)
    for b, r0 in zip(req[req >= 0], q0[req >= 0]):
        covered[cu[b] + r0 : cu[b] + min(r0 + bm, q_lens[b])] += 1
    np.testing.assert_array_equal(covered, 1)
    assert (req[: (req >= 0).sum()] >= 0).all()  # the empty slots last
    assert 1 not in req and (req == 0).sum() == 7


def test_unsupported_reasons_and_registration():
    from jattn import ops
    from jattn.pallas_kernels import triton_prefill as tp

    assert ops.KERNELS["triton"]["mha_prefill"] == ops.KERNELS["triton"]["mha_extend"] == "triton_prefill"
    q = jnp.zeros((5, 8, 128), jnp.bfloat16)
    k = jnp.zeros((5, 2, 128), jnp.bfloat16)
    kc = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
    f8 = jnp.float8_e4m3fn
    assert tp.unsupported_reason(q, k, k, max_seqlen_q=5, max_seqlen_kv=5, is_causal=True) is None
    assert tp.unsupported_reason(q, kc.astype(f8), kc.astype(f8), max_seqlen_q=5) is None
    assert tp.unsupported_reason(q[..., :64].astype(jnp.float16), kc[..., :64].astype(jnp.float16), kc[..., :64]) == (
        "k dtype float16 differs from v's bfloat16"
    )
    q192 = jnp.zeros((5, 8, 192), jnp.bfloat16)
    assert tp.unsupported_reason(q192, jnp.zeros((5, 2, 192), jnp.bfloat16), k) is None
    assert "head dims 96/96" in tp.unsupported_reason(q[..., :96], k[..., :96], k[..., :96])
    assert "q dtype float32" in tp.unsupported_reason(q.astype(jnp.float32), k.astype(jnp.float32), k)
    assert "not a multiple" in tp.unsupported_reason(q[:, :3], k, k)
    assert "not a multiple" in tp.unsupported_reason(q, k[:, :0], k[:, :0])  # no KV heads: a reason, no crash
    f16 = k.astype(jnp.float16)  # K/V of another 2-byte type than q's
    assert "k/v dtype float16 (q's dtype bfloat16" in tp.unsupported_reason(q, f16, f16)


def _gpu_args(name, fp8):
    c, q, k, v, cu_q, sinks, extra = _inputs(name)
    kd = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    f32 = lambda a: jnp.asarray(np.asarray(a, np.float32))  # noqa: E731
    args = (jnp.asarray(f32(q), jnp.bfloat16), jnp.asarray(f32(k), kd), jnp.asarray(f32(v), kd))
    opts = _options(c, None if sinks is None else jnp.asarray(sinks))
    if c.softmax_scale is not None:  # the ops take scales > 0 only; the kernel's own launch
        opts["softmax_scale"] = abs(c.softmax_scale)  # runs the negative one (interpreted)
    opts.update(return_lse=True, max_seqlen_q=max(c.q_lens))
    if c.kind == "prefill":
        kv_lens = c.q_lens if c.kv_lens is None else c.kv_lens
        cu_kv = extra["cu_seqlens_kv"]
        rest = (jnp.asarray(cu_q), None if cu_kv is None else jnp.asarray(cu_kv))
        if cu_kv is not None:
            opts["max_seqlen_kv"] = max(kv_lens)
    else:
        rest = (jnp.asarray(extra["page_table"]), jnp.asarray(extra["cache_seqlens"]), jnp.asarray(cu_q))
    return c, args, rest, opts, _seen_by(c, cu_q, extra)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_matches_reference(name, fp8):
    """Through the ops with backend="triton" (jax-triton) in bf16, and with FP8 K/V."""
    import jattn
    from jattn import reference
    from jattn.pallas_kernels import triton_glue

    if not on_gpu() or not triton_glue.available():
        pytest.skip("needs a GPU with jax-triton")
    c, args, rest, opts, bad = _gpu_args(name, fp8)
    if c.kind == "prefill":
        op, ref = jattn.mha_prefill, reference.mha_prefill
    else:
        op, ref = jattn.mha_extend_with_kvcache, reference.mha_extend
    out, lse = op(*args, *rest, backend="triton", **opts)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    want, want_lse = ref(*(f32(a) for a in args), *rest, **opts)
    out, want = np.asarray(out, np.float32), np.asarray(want)
    rows = np.setdiff1d(np.arange(out.shape[0]), bad)
    assert np.isfinite(out[rows]).all()
    np.testing.assert_allclose(out[rows], want[rows], atol=4e-2, rtol=4e-2)
    np.testing.assert_allclose(np.asarray(lse)[rows], np.asarray(want_lse)[rows], atol=4e-2, rtol=4e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,launch", [(n, x) for n, c in GPU_CASES.items() for x in GPU_LAUNCHES[c.d]], ids=lambda v: str(v)
)
def test_gpu_launches_match_reference(name, launch):
    """Long requests (blocks below the diagonal, windows, pages) at each launch that the
    Hopper defaults choose among, against the f32 reference."""
    from jattn import reference
    from jattn.pallas_kernels import triton_glue
    from jattn.pallas_kernels import triton_prefill as tp

    if not on_gpu() or not triton_glue.available():
        pytest.skip("needs a GPU with jax-triton")
    c, args, rest, opts, bad = _gpu_args(name, False)
    kw = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), launch))
    if c.kind == "prefill":
        out, lse = tp.mha_prefill(*args, *rest, **opts, **kw)
        want, want_lse = reference.mha_prefill(*(jnp.asarray(a, jnp.float32) for a in args), *rest, **opts)
    else:
        out, lse = tp.mha_extend(*args, *rest, **opts, **kw)
        want, want_lse = reference.mha_extend(*(jnp.asarray(a, jnp.float32) for a in args), *rest, **opts)
    out, want = np.asarray(out, np.float32), np.asarray(want)
    if bad.size:
        assert not np.isfinite(out[bad]).all(axis=(1, 2)).any()
    rows = np.setdiff1d(np.arange(out.shape[0]), bad)
    assert np.isfinite(out[rows]).all()
    np.testing.assert_allclose(out[rows], want[rows], atol=4e-2, rtol=4e-2)
    np.testing.assert_allclose(np.asarray(lse)[rows], np.asarray(want_lse)[rows], atol=4e-2, rtol=4e-2)


@pytest.mark.gpu
def test_gpu_torch_launch_equals_jax_path():
    """The same source launched natively on torch CUDA tensors gives the jax-triton result."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    from jattn.bridge import triton_native
    from jattn.pallas_kernels import triton_glue
    from jattn.pallas_kernels import triton_prefill as tp

    if not triton_glue.available():
        pytest.skip("needs jax-triton")
    name = "extend_permuted_pages_lens_0_1_97"
    c, args, rest, opts, _ = _gpu_args(name, False)
    opts.pop("max_seqlen_q")
    opts.pop("return_lse")
    jo, jl = tp.mha_extend(*args, *rest, return_lse=True, **opts)
    dev = lambda a: torch.from_numpy(np.asarray(a.astype(jnp.float32))).to("cuda")  # noqa: E731
    tq, tk, tv = (dev(a).to(torch.bfloat16).contiguous() for a in args)
    i32 = lambda a: torch.from_numpy(np.asarray(a)).to("cuda", torch.int32)  # noqa: E731
    o, lse = triton_native.prefill(
        tq, tk, tv, i32(rest[2]), page_table=i32(rest[0]), cache_seqlens=i32(rest[1]), **opts
    )
    torch.cuda.synchronize()
    np.testing.assert_array_equal(o.float().cpu().numpy(), np.asarray(jo, np.float32))
    np.testing.assert_array_equal(lse.cpu().numpy(), np.asarray(jl))


def test_launch_table_and_sweep_parsing():
    """The Hopper launches measured fastest on the H200 (docs/PERF.md), the sm80 launch
    unchanged, overrides kept; ``bench prefill --triton-sweep``'s launch syntax."""
    from jattn.bench.prefill import parse_launches
    from jattn.pallas_kernels import triton_prefill as tp

    assert tp.launch_params(128, 128, sm=90) == (64, 64, 4, 3)
    assert tp.launch_params(64, 64, sm=90) == (64, 64, 4, 3)
    assert tp.launch_params(128, 128, sm=90, paged=True) == (128, 128, 8, 3)
    assert tp.launch_params(256, 256, sm=90) == (128, 64, 8, 2)
    assert tp.launch_params(192, 128, sm=90) == (128, 64, 8, 3)
    assert tp.launch_params(128, 128, sm=80) == (128, 64, 8, 2)
    assert tp.launch_params(256, 256, sm=80, paged=True) == (64, 32, 8, 2)
    assert tp.launch_params(128, 128, sm=90, block_m=16, num_stages=2) == (16, 64, 4, 2)
    assert tp.launch_params(128, 128, sm=90, block_n=32, num_warps=8) == (64, 32, 8, 3)  # the sweep's overrides
    # head_dim_qk as one dot of a power of two, or two (192 = 128 + 64)
    assert [tp._split_dim(d) for d in (64, 128, 192, 256)] == [(64, 0), (128, 0), (128, 64), (256, 0)]
    assert parse_launches("default, 128x64w8s3") == [None, (128, 64, 8, 3)]
    with pytest.raises(ValueError, match="BMxBNwWsS"):
        parse_launches("128x64")


def test_jax_launch_params_fold_k_scale_into_the_softmax_scale():
    """The jax-triton path's parameter vector (``triton_prefill._params``) is ``[softmax
    scale * k_scale, v_scale, sinks...]`` in f32, the layout the kernel reads and the one
    ``bridge.triton_native.prefill`` builds: the interpreted tests run the torch launch, so
    without this only the GPU tests would see a dropped ``k_scale`` or ``v_scale`` on the
    JAX path. ``softmax_scale=None`` means ``1 / sqrt(head_dim)``."""
    from jattn.pallas_kernels import triton_prefill as tp

    sinks = np.array([0.25, -1.0], np.float32)
    got = np.asarray(tp._params(0.5, 3.0, 0.25, sinks, 64))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.array([1.5, 0.25, 0.25, -1.0], np.float32))
    got = np.asarray(tp._params(None, 2.0, 1.0, None, 64))
    np.testing.assert_array_equal(got, np.array([0.25, 1.0], np.float32))
