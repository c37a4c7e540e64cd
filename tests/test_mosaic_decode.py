"""Tests of the Mosaic GPU paged decode kernel (``jattn.pallas_kernels.mosaic_decode``).

The same cases run twice: on the CPU under the Mosaic GPU interpreter at small
shapes (CI checks the kernel's addressing, pipeline, masks and combine there),
and on an H200 (marker ``gpu``) at full shapes. The oracle is the f32
``jattn.reference.mha_decode``. Inputs are fresh random draws; unused pages and
padded page-table slots are filled with NaN to prove they never leak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import reference
from jattn.pallas_kernels import mosaic_decode as md
from jattn.pallas_kernels.combine import NUM_SMS
from jattn.pallas_kernels.interpret import gpu_interpret, interpreter_available, on_gpu

FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]
    hq: int = 8
    hkv: int = 8
    d: int = 64
    page_size: int = 16
    q_len: int = 1
    causal: bool = True
    window_left: int = -1
    logit_cap: float = 0.0
    sinks: bool = False
    dtype: str = "bfloat16"
    kv: str = "same"  # "same" or "fp8"
    extra_pages: int = 3  # NaN-filled pages that no request uses
    seed: int = 0
    splits: int = 0  # KV splits per request (0: the kernel's choice)
    softmax_scale: float | None = None  # None: 1/sqrt(d)


def _inputs(c: Case, seed: int):
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(c.dtype)
    bs = len(c.lens)
    max_pages = max(1, max(-(-l // c.page_size) for l in c.lens)) + 1  # one padded column
    num_pages = bs * max_pages + c.extra_pages
    shape = (num_pages, c.page_size, c.hkv, c.d)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    perm = rng.permutation(num_pages)
    table = perm[: bs * max_pages].reshape(bs, max_pages).astype(np.int32)
    used = np.zeros(num_pages, bool)
    for b, l in enumerate(c.lens):
        npg = -(-l // c.page_size)
        used[table[b, :npg]] = True
        # tokens past the length inside the last page are garbage too
        if l % c.page_size:
            k[table[b, npg - 1], l % c.page_size :] = np.nan
            v[table[b, npg - 1], l % c.page_size :] = np.nan
        table[b, npg:] = rng.integers(0, num_pages, max_pages - npg)  # never read
    k[~used] = np.nan
    v[~used] = np.nan
    k_scale = v_scale = 1.0
    if c.kv == "fp8":
        k_scale, v_scale = 0.37, 0.61
        kq = jnp.asarray(np.clip(k / k_scale, -448, 448)).astype(FP8)
        vq = jnp.asarray(np.clip(v / v_scale, -448, 448)).astype(FP8)
    else:
        kq, vq = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    q = jnp.asarray(rng.standard_normal((bs * c.q_len, c.hq, c.d)), dtype)
    sinks = jnp.asarray(rng.standard_normal(c.hq) * 2, jnp.float32) if c.sinks else None
    return (q, kq, vq, jnp.asarray(table), jnp.asarray(c.lens, jnp.int32), sinks, k_scale, v_scale)


def _kwargs(c: Case, sinks, k_scale, v_scale):
    return dict(
        max_seqlen_q=c.q_len,
        is_causal=c.causal,
        window_left=c.window_left,
        logit_cap=c.logit_cap,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        softmax_scale=c.softmax_scale,
        return_lse=True,
    )


# The options these tests run with: the defaults, except that every call stays on this
# (all-heads) kernel: FP8 calls (its converter and in-chain upcast) and multi-token calls
# of 64 query rows or more, which KernelOptions.fp8_heads and heads_kernel send to the
# per-KV-head kernel by default; that kernel and the routing are tested in
# tests/test_mosaic_decode_heads.py.
BASE = md.KernelOptions(fp8_heads=False, heads_kernel=False, balanced_splits=False)


def _block_sizes(c: Case, k, table, options: md.KernelOptions):
    """Explicit tiling for cases that pin the split count."""
    if not c.splits:
        return None
    bs = md.choose_block_sizes(
        batch=len(c.lens),
        num_kv_heads=c.hkv,
        head_dim=c.d,
        page_size=c.page_size,
        max_pages=table.shape[1],
        m_rows=c.q_len * c.hq,
        kv_itemsize=jnp.dtype(k.dtype).itemsize,
        options=options,
    )
    return dataclasses.replace(bs, num_splits=c.splits)


def _check(c: Case, *, interpret: bool, seed: int | None = None, options: md.KernelOptions = BASE):
    q, k, v, table, lens, sinks, ks, vs = _inputs(c, c.seed if seed is None else seed)
    kw = _kwargs(c, sinks, ks, vs)
    bsz = _block_sizes(c, k, table, options)
    if interpret:
        with gpu_interpret():
            out, lse = md.mha_decode(q, k, v, table, lens, block_sizes=bsz, options=options, **kw)
    else:
        out, lse = md.mha_decode(q, k, v, table, lens, block_sizes=bsz, options=options, **kw)
    ref_out, ref_lse = reference.mha_decode(q, k, v, table, lens, **kw)
    out = np.asarray(out, np.float32)
    ref_out = np.asarray(ref_out, np.float32)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert out.shape == ref_out.shape and out.dtype == np.float32
    assert not np.isnan(out).any(), "NaN leaked into the output"
    tol = 2e-2 if c.kv == "same" else 3e-2
    np.testing.assert_allclose(out, ref_out, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=2e-3, rtol=2e-3)
    # empty rows are exactly 0
    for b, l in enumerate(c.lens):
        if l == 0:
            assert np.all(out[b * c.q_len : (b + 1) * c.q_len] == 0)
    return out


# Small shapes for the interpreter (each case is a few seconds on a 2-core CPU).
CPU_CASES = {
    # 2 KV heads and 3 splits (the last one empty): the interpreter's cost grows with
    # splits x requests x KV heads, and the lengths are what this case is for
    "lens_0_1_97": Case(lens=(0, 1, 97), hq=8, hkv=2, page_size=32, splits=3, softmax_scale=0.29),
    "mha_group1_page32": Case(lens=(45, 20), hq=8, page_size=32),
    "group2_d128": Case(lens=(33,), hq=16, d=128),
    "group4_page64": Case(lens=(50, 17), hq=32, page_size=64),
    "group16": Case(lens=(21,), hq=128),
    "qlen4_causal": Case(lens=(40, 5), q_len=4),
    "qlen4_noncausal": Case(lens=(40, 9), q_len=4, causal=False),
    # request 0's window starts on the last key of a 64-key block (151 - 24 = 127)
    "window": Case(lens=(152, 20), hq=8, hkv=2, window_left=24),
    "window_qlen3": Case(lens=(77,), q_len=3, window_left=5),
    # one split: the CTA's first block is the window's (block 4 of 300 keys), not block 0
    "window_one_split": Case(lens=(300, 30), hq=8, hkv=2, window_left=24, splits=1),
    "logit_cap_sinks": Case(lens=(38, 0), logit_cap=5.0, sinks=True),
    "fp16": Case(lens=(29, 64), dtype="float16"),
    "fp8_kv_scales": Case(lens=(37, 16), kv="fp8", softmax_scale=0.21),
    "fp8_kv_qlen2_fp16": Case(lens=(29,), kv="fp8", q_len=2, dtype="float16"),
    "page128_qlen8_two_tiles": Case(lens=(40,), hq=16, page_size=128, q_len=8),
    "hkv2_group4_tail": Case(lens=(45, 7), hq=8, hkv=2, page_size=32),
    # a piece in a page's second half (not clamped at the page start): its box ends up to
    # three tokens into the page's NaN tail, which the kernel itself must zero
    "hkv2_tail_mid_page": Case(lens=(77, 7), hq=8, hkv=2, page_size=128),
    "hkv4_group7_qlen2": Case(lens=(37,), hq=28, hkv=4, q_len=2),
    # one split: the kernel's output is final up to v_scale and sinks (no merge)
    "one_split_fp8_sinks": Case(lens=(61, 0, 7), kv="fp8", sinks=True, splits=1),
    "one_split_bf16": Case(lens=(50, 1), hq=16, splits=1),
    "three_splits_qlen2": Case(lens=(97, 2), q_len=2, splits=3),
    # more KV blocks than ring stages in one CTA: the ring wraps around
    "ring_wraps_one_split": Case(lens=(65,), hq=8, hkv=8, d=64, page_size=16, splits=1),
    # two splits of 13 blocks: balanced splits must take 7 blocks a split (the even size)
    "two_splits_13_blocks": Case(lens=(200, 3), hq=8, hkv=8, d=64, page_size=16, splits=2),
    # 12 query rows a request (a group of 3): the one tile loads 16 rows, rounded up to 8
    "group3_rows_not_a_multiple_of_8": Case(lens=(37, 5), hq=12, hkv=4),
}


needs_interp = pytest.mark.skipif(not interpreter_available(), reason="no Mosaic GPU interpreter in this JAX")


@needs_interp
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_interpreted(name):
    if on_gpu():
        pytest.skip("interpreter tests run on the CPU")
    _check(CPU_CASES[name], interpret=True)


def _flipped(option: str) -> md.KernelOptions:
    """The options of these tests (``BASE``) with ``option`` set to its other value."""
    return dataclasses.replace(BASE, **{option: not getattr(BASE, option)})


# (option, case): each case runs with the option's non-default setting.
# overlap_qk: the plain block loop instead of the software-pipelined one. (The
# combine runs as XLA ops under the interpreter whatever kernel_combine says; the
# Triton combine kernel has its own CPU test, tests/test_combine.py.)
# fp8_converter: the compute warpgroup upcasts each FP8 tile itself, in the plain loop
# (the default: a converter warpgroup upcasts them).
OTHER_SETTING_CPU = [
    ("overlap_qk", n)
    for n in ("lens_0_1_97", "logit_cap_sinks", "qlen4_causal", "hkv2_group4_tail", "one_split_bf16", "window")
] + [("fp8_converter", "fp8_kv_scales"), ("fp8_converter", "fp8_kv_qlen2_fp16")]
# balanced_splits: the split size chosen from the lengths (request 97 over several splits
# of one block beside the empty and one-block requests; the window's own first block)
OTHER_SETTING_CPU += [
    ("balanced_splits", n) for n in ("lens_0_1_97", "window", "qlen4_causal", "fp8_kv_scales", "two_splits_13_blocks")
]


@needs_interp
@pytest.mark.parametrize("option,name", OTHER_SETTING_CPU)
def test_interpreted_other_option_setting(option, name):
    """A kernel option's other setting gives the same answers."""
    if on_gpu():
        pytest.skip("interpreter tests run on the CPU")
    _check(CPU_CASES[name], interpret=True, options=_flipped(option))


def test_every_case_runs_the_all_heads_kernel():
    """No case of this file reaches the per-KV-head kernel under BASE (its own tests cover
    it: mha_decode asks heads_kernel_for only with heads_kernel on and no explicit
    block sizes), while the default options would send the two-tile verify cases there."""
    assert not BASE.heads_kernel and not BASE.fp8_heads
    cases = {**CPU_CASES, **GPU_CASES, **{n: c for n, (c, _) in POISON_CPU.items()}}
    routed = set()
    for name, c in cases.items():
        q = jnp.zeros((len(c.lens) * c.q_len, c.hq, c.d), jnp.dtype(c.dtype))
        k = jnp.zeros((4, c.page_size, c.hkv, c.d), FP8 if c.kv == "fp8" else q.dtype)
        args = (q, k, k, c.q_len, c.window_left, c.logit_cap, None, c.softmax_scale, 1.0, 1.0)
        if not c.splits and md.heads_kernel_for(*args, is_causal=c.causal) is not None:
            routed.add(name)
    assert {"verify_qlen4_two_wgs", "page128_qlen8_two_tiles", "qlen4_verify", "qlen8_noncausal"} <= routed


def test_options_are_static_and_hashable():
    """Options key the compiled program: equal options hash equal, others differ."""
    a, b = md.KernelOptions(), md.KernelOptions(overlap_qk=True, kernel_combine=True)
    assert a == b and hash(a) == hash(b)
    assert _flipped("overlap_qk") != BASE and _flipped("kernel_combine") != BASE and BASE != a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.overlap_qk = False


@needs_interp
def test_interpreted_deterministic():
    if on_gpu():
        pytest.skip("interpreter tests run on the CPU")
    c = Case(lens=(70, 3), hkv=2, q_len=2, splits=2)  # two splits with keys: the merge runs
    a = _check(c, interpret=True)
    b = _check(c, interpret=True)
    np.testing.assert_array_equal(a, b)


def test_errors_name_the_limit():
    q = jnp.zeros((2, 16, 64), jnp.bfloat16)
    k = jnp.zeros((4, 8, 8, 64), jnp.bfloat16)
    assert "page_size=8" in md.unsupported_reason(q, k, k, max_seqlen_q=1)
    k = jnp.zeros((4, 16, 8, 96), jnp.bfloat16)
    q96 = jnp.zeros((2, 16, 96), jnp.bfloat16)
    assert "head_dim=96" in md.unsupported_reason(q96, k, k, max_seqlen_q=1)
    k = jnp.zeros((4, 16, 8, 64), jnp.bfloat16)
    q256 = jnp.zeros((2, 256, 64), jnp.bfloat16)
    # the all-heads kernel's limits on heads (on a GPU the per-KV-head kernel takes these
    # calls: tests/test_mosaic_decode_heads.py)
    from jattn.pallas_kernels import decode_tuning

    assert "group size 32" in decode_tuning.unsupported_reason(q256, k, k, max_seqlen_q=1)
    # no KV block of 64..256 rows: 5 KV heads, page 16 (16 * 4 pages * 5 = 320 rows)
    k5 = jnp.zeros((4, 16, 5, 64), jnp.bfloat16)
    q5 = jnp.zeros((2, 10, 64), jnp.bfloat16)
    assert "num_kv_heads=5 with page_size=16" in decode_tuning.unsupported_reason(q5, k5, k5, max_seqlen_q=1)
    assert "float16" in md.unsupported_reason(
        jnp.zeros((2, 16, 64), jnp.bfloat16), k.astype(jnp.float16), k.astype(jnp.float16), max_seqlen_q=1
    )
    q = jnp.zeros((2, 16, 64), jnp.bfloat16)
    assert "max_seqlen_q=9" in md.unsupported_reason(jnp.zeros((9, 16, 64), jnp.bfloat16), k, k, max_seqlen_q=9)
    assert "float32" in md.unsupported_reason(jnp.zeros((2, 16, 64), jnp.float32), k, k, max_seqlen_q=1)
    # FP8 at head_dim 256 over 8 KV heads: no block and ring (with the converter's f16 ring) fit
    k8 = jnp.zeros((4, 16, 8, 256), jnp.float8_e4m3fn)
    msg = md.unsupported_reason(jnp.zeros((2, 16, 256), jnp.bfloat16), k8, k8, max_seqlen_q=1)
    assert msg is not None and "fits in shared memory" in msg
    assert "fits" not in (md.unsupported_reason(jnp.zeros((2, 16, 256), jnp.bfloat16), k8.astype(q.dtype),
                                                k8.astype(q.dtype), max_seqlen_q=1) or "")  # fmt: skip
    with pytest.raises(NotImplementedError, match="page_size=8"):
        md.mha_decode(
            q,
            jnp.zeros((4, 8, 8, 64), jnp.bfloat16),
            jnp.zeros((4, 8, 8, 64), jnp.bfloat16),
            jnp.zeros((2, 1), jnp.int32),
            jnp.zeros((2,), jnp.int32),
        )


def test_auto_dispatch_skips_measured_slow_shapes(monkeypatch):
    """Auto picks mosaic on Hopper only where it was measured faster than xla; an
    explicit backend="mosaic" still runs the kernel."""
    from jattn import dispatch, ops

    q = jnp.zeros((2, 9, 64), jnp.bfloat16)
    k3 = jnp.zeros((4, 16, 3, 64), jnp.bfloat16)
    k8 = jnp.zeros((4, 16, 8, 64), jnp.bfloat16)
    q8 = jnp.zeros((2, 16, 64), jnp.bfloat16)
    assert "num_kv_heads=3" in md.auto_skip_reason(q, k3, k3)
    assert md.auto_skip_reason(q8, k8, k8) is None
    monkeypatch.setattr(dispatch, "device_kind", lambda: "hopper")
    monkeypatch.setattr(md, "unsupported_reason", lambda *a, **k: None)
    table, lens = jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32)
    picked = []
    monkeypatch.setattr(md, "mha_decode", lambda *a, **k: picked.append("mosaic") or a[0])
    monkeypatch.setattr(ops.reference, "mha_decode", lambda *a, **k: picked.append("xla") or a[0])
    ops.mha_decode_with_kvcache(q, k3, k3, table, lens)
    ops.mha_decode_with_kvcache(q8, k8, k8, table, lens)
    ops.mha_decode_with_kvcache(q, k3, k3, table, lens, backend="mosaic")
    assert picked == ["xla", "mosaic", "mosaic"]


# ---------------------------------------------------------------------------
# Poison: NaN / Inf in keys a query does not see must change nothing.
NAN, INF = float("nan"), float("inf")


def _sees(length, n, i, j, causal, window):
    pos = length - n + i
    return 0 <= j < length and (not causal or j <= pos) and (window < 0 or j >= pos - window)


def _poison_check(c: Case, spots, *, interpret: bool, options: md.KernelOptions = BASE):
    """Runs the kernel on caches poisoned at ``spots`` and checks it against the f32
    reference on the clean caches. A spot is ``(request, key positions, kv head or None
    (all), "k" / "v" / "kv", value, checked)``: a query that does not see the key must
    come out as on clean data; with ``checked`` a query that sees it must be non-finite
    in the heads that read that kv head (other heads of that query are not checked).
    Unused pages and page tails hold NaN as in every case here."""
    q, k, v, table, lens, sinks, ks, vs = _inputs(c, c.seed)
    kw = _kwargs(c, sinks, ks, vs)
    ref_out, _ = reference.mha_decode(q, k, v, table, lens, **kw)
    kp, vp = np.array(k), np.array(v)
    tab = np.asarray(table)
    group = c.hq // c.hkv
    n_tok = len(c.lens) * c.q_len
    seen = np.zeros((n_tok, c.hq), bool)  # must be non-finite
    touched = np.zeros(n_tok, bool)  # query tokens that see some poisoned key
    for b, js, h, which, value, checked in spots:
        heads = range(c.hkv) if h is None else [h]
        for j in js:
            page, off = tab[b, j // c.page_size], j % c.page_size
            for hh in heads:
                if "k" in which:
                    kp[page, off, hh, 0] = value
                if "v" in which:
                    vp[page, off, hh, c.d - 1] = value
                for i in range(c.q_len):
                    if _sees(c.lens[b], c.q_len, i, j, c.causal, c.window_left):
                        touched[b * c.q_len + i] = True
                        if checked:
                            seen[b * c.q_len + i, hh * group : (hh + 1) * group] = True
    kp, vp = jnp.asarray(kp, k.dtype), jnp.asarray(vp, v.dtype)
    bsz = _block_sizes(c, k, table, options)
    if interpret:
        with gpu_interpret():
            out, _ = md.mha_decode(q, kp, vp, table, lens, block_sizes=bsz, options=options, **kw)
    else:
        out, _ = md.mha_decode(q, kp, vp, table, lens, block_sizes=bsz, options=options, **kw)
    out = np.asarray(out, np.float32)
    ref_out = np.asarray(ref_out, np.float32)
    assert (~np.isfinite(out[seen])).any(axis=-1).all(), "a query that sees a non-finite V or K came out finite"
    tol = 2e-2 if c.kv == "same" else 3e-2
    clean = ~touched
    assert clean.any()
    assert np.isfinite(out[clean]).all(), "poison in masked keys leaked into the output"
    np.testing.assert_allclose(out[clean], ref_out[clean], atol=tol, rtol=tol)


# (case, spots); positions are chosen against each case's masks (see _sees)
POISON_CPU = {
    # q_len 4 * 32 heads = two 64-row tiles: two compute warpgroups share each V tile
    "verify_qlen4_two_wgs": (
        Case(lens=(40, 5), hq=32, hkv=4, d=64, q_len=4),
        [
            (0, [39], 1, "v", NAN, True),
            (0, [38], 2, "v", INF, True),
            (0, [37], 0, "k", NAN, True),
            (0, [39], 3, "k", INF, False),
            (1, [4], 0, "v", -INF, True),
        ],
    ),
    "window_own_pages": (
        Case(lens=(90, 20), hq=8, hkv=4, window_left=24),
        [(0, range(0, 64), None, "kv", NAN, True), (0, [64], 3, "v", INF, True), (1, [3], 2, "v", NAN, True)],
    ),
    "window_qlen3": (
        Case(lens=(77,), q_len=3, window_left=5),
        [
            (0, [69], 0, "v", INF, True),
            (0, [68], 1, "kv", NAN, True),
            (0, [76], 1, "v", NAN, True),
            (0, [76], 2, "k", NAN, True),
        ],
    ),
    "noncausal_window_qlen4": (
        Case(lens=(40, 9), q_len=4, causal=False, window_left=6),
        [(0, [30], 0, "v", NAN, True), (0, [29], 2, "kv", INF, True), (1, [2], 4, "v", NAN, True)],
    ),
    "fp8_qlen2": (
        Case(lens=(37, 16), kv="fp8", q_len=2),
        [(0, [36], 0, "v", NAN, True), (0, [36], 1, "k", NAN, True), (1, [15], 3, "v", NAN, True)],
    ),
    "hkv2_tail_qlen2": (
        Case(lens=(45, 7), hq=8, hkv=2, page_size=32, q_len=2),
        [(0, [44], 1, "v", NAN, True), (1, [6], 0, "v", INF, True), (0, [43], 0, "k", NAN, True)],
    ),
}


@needs_interp
@pytest.mark.parametrize("name", list(POISON_CPU))
def test_interpreted_masked_poison(name):
    """NaN / Inf in future draft tokens, outside the window (the request's own pages
    included), in masked K, in page tails and unused pages: only queries that see a
    poisoned key are non-finite."""
    if on_gpu():
        pytest.skip("interpreter tests run on the CPU")
    c, spots = POISON_CPU[name]
    _poison_check(c, spots, interpret=True)


@needs_interp
def test_interpreted_masked_poison_other_loop():
    """The same with the plain block loop (overlap_qk's other setting)."""
    if on_gpu():
        pytest.skip("interpreter tests run on the CPU")
    c, spots = POISON_CPU["verify_qlen4_two_wgs"]
    _poison_check(c, spots, interpret=True, options=_flipped("overlap_qk"))


# Full shapes on the GPU.
GPU_CASES = {
    "llama8b_b4_l4096_p16": Case(lens=(4096, 1, 97, 3000), hq=32, hkv=8, d=128),
    "llama8b_b3_p64_ragged": Case(lens=(2049, 0, 777), hq=32, hkv=8, d=128, page_size=64),
    "b1_l32768": Case(lens=(32768,), hq=32, hkv=8, d=128),
    "page32": Case(lens=(1000, 64), hq=32, hkv=8, d=128, page_size=32),
    "page128": Case(lens=(1000, 129), hq=32, hkv=8, d=128, page_size=128),
    "d64_group1": Case(lens=(513, 97), hq=16, hkv=16, d=64),
    "d256_group2": Case(lens=(300, 97), hq=16, hkv=8, d=256),
    "group16": Case(lens=(300, 97), hq=128, hkv=8, d=128),
    "group8_page16": Case(lens=(1500, 97), hq=64, hkv=8, d=128),
    "qlen4_verify": Case(lens=(1000, 37), hq=32, hkv=8, d=128, q_len=4),
    "qlen8_noncausal": Case(lens=(600, 9), hq=32, hkv=8, d=128, q_len=8, causal=False),
    "window_cap_sinks": Case(lens=(2000, 50), hq=32, hkv=8, d=128, window_left=127, logit_cap=30.0, sinks=True),
    "fp16": Case(lens=(900, 1), hq=32, hkv=8, d=128, dtype="float16"),
    "fp8": Case(lens=(900, 31), hq=32, hkv=8, d=128, kv="fp8"),
    "fp8_qlen4_page64": Case(lens=(700, 5), hq=32, hkv=8, d=128, kv="fp8", q_len=4, page_size=64),
    # num_kv_heads not a multiple of 8: aligned tail boxes
    "hkv2_group4": Case(lens=(1001, 45), hq=8, hkv=2, d=128),
    "hkv4_group7": Case(lens=(999, 3), hq=28, hkv=4, d=128),
    "hkv3_group3_page64": Case(lens=(517, 61), hq=9, hkv=3, d=128, page_size=64),
    "hkv4_fp8": Case(lens=(333, 18), hq=16, hkv=4, d=128, kv="fp8"),
    "one_split_sinks_fp8": Case(lens=(1500, 0, 97), hq=32, hkv=8, d=128, kv="fp8", sinks=True, splits=1),
    "splits5_page64": Case(lens=(2000, 50), hq=32, hkv=8, d=128, page_size=64, splits=5),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu(name):
    c = GPU_CASES[name]
    q, k, v, *_ = _inputs(c, 0)
    reason = md.unsupported_reason(q, k, v, max_seqlen_q=c.q_len)
    if reason is not None:
        pytest.skip(reason)
    _check(c, interpret=False)
    _check(c, interpret=False, seed=1)


OVERLAP_GPU = [
    "llama8b_b4_l4096_p16",
    "b1_l32768",
    "d256_group2",
    "qlen4_verify",
    "hkv2_group4",
    "window_cap_sinks",
    "group16",
    "llama8b_b3_p64_ragged",
]


@pytest.mark.gpu
@pytest.mark.parametrize("name", OVERLAP_GPU)
def test_gpu_overlap_qk_option(name):
    """The block loop with the other setting of overlap_qk (both must stay right)."""
    _check(GPU_CASES[name], interpret=False, options=_flipped("overlap_qk"))


BALANCED_GPU = ["llama8b_b4_l4096_p16", "llama8b_b3_p64_ragged", "window_cap_sinks", "qlen4_verify", "fp8"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", BALANCED_GPU)
def test_gpu_balanced_splits_option(name):
    """Balanced splits (the split size from the lengths) give the same answers."""
    _check(GPU_CASES[name], interpret=False, options=_flipped("balanced_splits"))


def test_balanced_splits_default_rule():
    """``KernelOptions(balanced_splits=None)`` (the default) balances calls of several
    requests of at most 64 query rows over a 2-byte cache (``decode_tuning.balanced_for``);
    True / False win over the rule, and block sizes from ``choose_block_sizes`` passed back
    run as the default call would (its balanced split count, balanced)."""
    kw = dict(num_pages=4096, page_size=16, max_pages=256, num_kv_heads=8, head_dim=128, is_causal=True,
              logit_cap=0.0, window_left=-1, q_itemsize=2, interpret=False)  # fmt: skip
    auto = md.KernelOptions()
    assert auto.balanced_splits is None

    def config(batch, kv_itemsize=2, options=auto, block_sizes=None, hq=32, q_len=1):
        return md.decode_config(batch=batch, kv_itemsize=kv_itemsize, options=options, block_sizes=block_sizes,
                                num_q_heads=hq, q_len=q_len, **kw)  # fmt: skip

    assert config(2).balanced and config(64).balanced and config(4, q_len=2).balanced  # 64 rows: one tile
    assert not config(1).balanced and not config(4, kv_itemsize=1).balanced
    assert not config(4, q_len=4).balanced  # two 64-row tiles: not timed balanced
    on, off = (dataclasses.replace(auto, balanced_splits=b) for b in (True, False))
    assert config(1, options=on).balanced and config(4, q_len=4, options=on).balanced
    assert not config(4, options=off).balanced
    shape = dict(batch=32, num_kv_heads=8, head_dim=128, page_size=16, max_pages=256, m_rows=32, kv_itemsize=2)
    chosen, even = md.choose_block_sizes(**shape), md.choose_block_sizes(**shape, options=off)
    assert chosen.num_splits > even.num_splits and config(32).bs == chosen
    assert config(32, block_sizes=chosen).balanced and not config(32, options=off, block_sizes=chosen).balanced
    with pytest.raises(ValueError, match=r"balanced_splits='yes' must be True or False \(or None"):
        md.KernelOptions(balanced_splits="yes")


def test_heads_kernel_preference_rule():
    """``decode_tuning.prefer_heads_kernel``: multi-token calls of at least 64 query rows
    over a 2-byte cache (measured faster there, docs/PERF.md); single tokens, fewer rows and
    FP8 caches (the converter warpgroup's path) stay on the all-heads kernel."""
    from jattn.pallas_kernels.decode_tuning import prefer_heads_kernel

    assert prefer_heads_kernel(2, 32, 2) and prefer_heads_kernel(8, 8, 2) and prefer_heads_kernel(4, 128, 2)
    assert not prefer_heads_kernel(1, 64, 2) and not prefer_heads_kernel(1, 128, 2)  # one token
    assert not prefer_heads_kernel(2, 31, 2) and not prefer_heads_kernel(3, 21, 2)  # 62 and 63 rows
    assert not prefer_heads_kernel(2, 32, 1) and not prefer_heads_kernel(8, 64, 1)  # FP8


def test_balanced_split_size_evens_out_an_uneven_batch():
    """The balanced split size covers the longest request in the launch's splits, counts
    a window's blocks from its first one, and on an uneven batch of 64 x 4096 (lengths
    from 512 to 4096) cuts the counted makespan (CTAs in waves of the SMs, each its
    blocks plus the fixed cost) well below the even split's."""
    opts = dataclasses.replace(BASE, balanced_splits=True)
    rng = np.random.default_rng(0)
    lens = rng.integers(512, 4097, 64).astype(np.int32)
    kw = dict(num_pages=64 * 256, page_size=16, max_pages=256, num_kv_heads=8, num_q_heads=32, head_dim=128,
              q_len=1, is_causal=True, logit_cap=0.0, block_sizes=None, kv_itemsize=2, q_itemsize=2,
              interpret=False)  # fmt: skip
    even = md.decode_config(batch=64, window_left=-1, options=BASE, **kw)
    cfg = md.decode_config(batch=64, window_left=-1, options=opts, **kw)
    assert cfg.balanced and not even.balanced and cfg.bs.num_splits >= even.bs.num_splits
    btb = cfg.bs.block_tokens * cfg.bs.pages_per_block
    nblk = -(-lens // btb)
    per = int(md._balanced_split_size(cfg, jnp.asarray(lens))[0])
    assert per * cfg.bs.num_splits >= nblk.max()

    def makespan(ctas_per_request, size):
        return -(-int(np.sum(ctas_per_request)) // NUM_SMS) * (size + md.BALANCED_OVERHEAD_BLOCKS)

    even_chunk = -(-nblk // even.bs.num_splits)
    assert makespan(-(-nblk // per), per) < 0.75 * makespan(even.bs.num_splits * np.ones(64), even_chunk.max())
    # a window: request 0 walks 3 blocks (its window's), however long it is
    win = md.decode_config(batch=2, window_left=2 * btb, options=opts, **kw)
    wlens = jnp.asarray([4000, 3 * btb], jnp.int32)
    per_w = int(md._balanced_split_size(win, wlens)[0])
    assert per_w * win.bs.num_splits >= 3 and per_w <= 3


FP8_GPU = ["fp8", "fp8_qlen4_page64", "hkv4_fp8", "one_split_sinks_fp8"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", FP8_GPU)
@pytest.mark.parametrize("option", ["fp8_converter", "overlap_qk"])
def test_gpu_fp8_loop_options(name, option):
    """FP8 KV with the settings other than the default: the in-chain upcast
    (no converter warpgroup), and the converter with the plain block loop."""
    opts = dataclasses.replace(BASE, fp8_converter=True)
    if option == "overlap_qk":
        opts = dataclasses.replace(opts, overlap_qk=False)
    else:
        opts = dataclasses.replace(opts, fp8_converter=False)
    _check(GPU_CASES[name], interpret=False, options=opts)


COMBINE_GPU = ["b1_l32768", "window_cap_sinks", "fp8", "splits5_page64", "qlen4_verify"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", COMBINE_GPU)
def test_gpu_xla_combine_option(name):
    """kernel_combine=False (XLA ops) against the reference, as the default is."""
    _check(GPU_CASES[name], interpret=False, options=_flipped("kernel_combine"))


@pytest.mark.gpu
def test_gpu_combine_kernel_is_the_triton_one():
    """On a GPU with jax-triton the default merges splits with the Triton kernel
    (one jax-triton custom call in the program), and no Pallas Triton call remains."""
    from jattn.pallas_kernels import triton_glue

    if not triton_glue.available():
        pytest.skip("jax-triton not installed here")
    c = GPU_CASES["b1_l32768"]
    q, k, v, table, lens, *_ = _inputs(c, 0)
    hlo = jax.jit(lambda *a: md.mha_decode(*a)).lower(q, k, v, table, lens).as_text()
    assert hlo.count("triton_kernel_call") == 1, hlo[:2000]
    assert "xla.gpu.triton" not in hlo


@pytest.mark.gpu
def test_gpu_deterministic_and_jit_metadata():
    c = GPU_CASES["llama8b_b4_l4096_p16"]
    q, k, v, table, lens, *_ = _inputs(c, 2)
    f = jax.jit(lambda q, k, v, t, l: md.mha_decode(q, k, v, t, l))
    a = np.asarray(f(q, k, v, table, lens), np.float32)
    b = np.asarray(f(q, k, v, table, lens), np.float32)
    np.testing.assert_array_equal(a, b)
    # new metadata values, same shapes: no retrace
    n = f._cache_size()
    f(q, k, v, table[::-1], lens[::-1]).block_until_ready()
    assert f._cache_size() == n


POISON_GPU = {
    "qlen4_verify": (
        GPU_CASES["qlen4_verify"],
        [
            (0, [999], 1, "v", NAN, True),
            (0, [998], 2, "v", INF, True),
            (0, [997], 0, "k", NAN, True),
            (1, [36], 5, "v", -INF, True),
            (1, [35], None, "kv", NAN, True),
        ],
    ),
    "window_cap_sinks": (
        GPU_CASES["window_cap_sinks"],
        [(0, range(0, 1856), None, "kv", NAN, True), (0, [1871], 3, "v", INF, True), (1, [3], 2, "v", NAN, True)],
    ),
    "fp8_qlen4_page64": (
        GPU_CASES["fp8_qlen4_page64"],
        [(0, [699], 0, "v", NAN, True), (0, [698], 1, "k", NAN, True), (1, [4], 3, "v", NAN, True)],
    ),
    "hkv2_group4": (GPU_CASES["hkv2_group4"], [(0, [1000], 1, "v", NAN, True), (0, [999], 0, "k", NAN, True)]),
    "qlen8_noncausal": (GPU_CASES["qlen8_noncausal"], [(0, [599], 3, "v", NAN, True)]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(POISON_GPU))
def test_gpu_masked_poison(name):
    c, spots = POISON_GPU[name]
    _poison_check(c, spots, interpret=False)
    if name == "qlen4_verify":
        _poison_check(c, spots, interpret=False, options=_flipped("overlap_qk"))


@pytest.mark.gpu
def test_gpu_out_of_range_page_ids_stay_in_pool():
    c = Case(lens=(100, 50), hq=32, hkv=8, d=128)
    q, k, v, table, lens, *_ = _inputs(c, 3)
    bad = table.at[0, 0].set(10**6).at[1, 1].set(-5)
    out = md.mha_decode(q, k, v, bad, lens)
    assert out.shape == q.shape  # no fault; ids are clamped into the pool


LOWER_CASES = {
    "qlen1": Case(lens=(300, 5), hq=32, hkv=8, d=128),
    "qlen4_causal_window": Case(lens=(300, 5), hq=32, hkv=8, d=128, q_len=4, window_left=100),
    "draft_block": Case(lens=(300, 9), hq=16, hkv=4, q_len=8, causal=False),
    "fp8_sinks_cap": Case(lens=(300,), hq=32, hkv=8, d=128, kv="fp8", sinks=True, logit_cap=30.0),
    "fp8_qlen4_window": Case(lens=(300, 5), hq=32, hkv=8, d=128, kv="fp8", q_len=4, window_left=100),
    "d256_page64": Case(lens=(500,), hq=16, hkv=2, d=256, page_size=64, q_len=2),
}


@pytest.mark.skipif(on_gpu(), reason="the GPU runs the kernel itself")
@pytest.mark.parametrize("name", list(LOWER_CASES))
def test_lowers_for_cuda(name, monkeypatch):
    """The kernel lowers for CUDA on this CPU: Mosaic GPU's layout inference and TMA
    rules run at lowering, so programs the interpreter accepts but the GPU compiler
    rejects fail here, without a GPU."""
    c = LOWER_CASES[name]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernel's "GPU here?" check
    q, k, v, table, lens, sinks, ks, vs = _inputs(c, 0)
    kw = _kwargs(c, sinks, ks, vs)
    # the all-heads kernel itself, then the default, which sends the calls the per-KV-head
    # kernel takes (here: draft_block) there
    routed = md.heads_kernel_for(q, k, v, c.q_len, kw.get("window_left", -1), kw.get("logit_cap", 0.0),
                                 kw.get("sinks"), None, kw.get("k_scale", 1.0), kw.get("v_scale", 1.0),
                                 md.KernelOptions().fp8_heads, c.causal)  # fmt: skip
    for opts, kernel in ((md.KernelOptions(heads_kernel=False), "jattn_paged_decode"),
                       (md.KernelOptions(), "jattn_decode_heads" if routed else "jattn_paged_decode")):  # fmt: skip
        fn = jax.jit(lambda q, k, v, table, lens, o=opts: md.mha_decode(q, k, v, table, lens, options=o, **kw))
        text = fn.trace(q, k, v, table, lens).lower(lowering_platforms=("cuda",)).as_text()
        assert kernel in text, kernel
    assert (routed is not None) == (name == "draft_block"), "the one case here that the per-KV-head kernel takes"


@pytest.mark.skipif(on_gpu(), reason="the GPU runs the kernel itself")
@pytest.mark.parametrize("name", ["fp8_sinks_cap", "fp8_qlen4_window"])
def test_fp8_converter_lowers_for_cuda(name, monkeypatch):
    """The FP8 converter warpgroup's program lowers for CUDA (layout inference, TMA),
    and it is a different program from the in-chain upcast's (one more warpgroup)."""
    c = LOWER_CASES[name]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q, k, v, table, lens, sinks, ks, vs = _inputs(c, 0)
    kw = _kwargs(c, sinks, ks, vs)
    texts = []
    for conv in (True, False):
        opts = md.KernelOptions(fp8_converter=conv)
        fn = jax.jit(lambda q, k, v, table, lens, o=opts: md.mha_decode(q, k, v, table, lens, options=o, **kw))
        texts.append(fn.trace(q, k, v, table, lens).lower(lowering_platforms=("cuda",)).as_text())
    assert "_conv2" in texts[0] and "_conv2" not in texts[1]


@pytest.mark.skipif(on_gpu(), reason="the GPU runs the kernel itself")
def test_fp8_in_chain_upcast_ring_lowers_within_shared_memory(monkeypatch):
    """FP8 without the converter at head_dim 256: the chosen ring counts the in-chain
    upcast's f16 K and V tiles, so it lowers for CUDA within shared memory (without them
    counted a ring one stage deeper was chosen, over the limit: a GPU compile failure)."""
    c = Case(lens=(300,), hq=32, hkv=8, d=256, page_size=64, kv="fp8")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q, k, v, table, lens, sinks, ks, vs = _inputs(c, 0)
    kw = _kwargs(c, sinks, ks, vs)
    opts = md.KernelOptions(fp8_converter=False)
    fn = jax.jit(lambda q, k, v, table, lens: md.mha_decode(q, k, v, table, lens, options=opts, **kw))
    assert "jattn_paged_decode" in fn.trace(q, k, v, table, lens).lower(lowering_platforms=("cuda",)).as_text()


def test_block_shape_is_the_nearest_to_the_target_rows():
    """``block_shape``: the KV block nearest 128 rows (64 at head_dim 256), whole pages
    gathered where one page of all KV heads is fewer rows (up to 16 pages of 16 tokens)."""
    from jattn.pallas_kernels.decode_tuning import block_shape

    assert block_shape(1, 128, 16) == (16, 8) and block_shape(2, 128, 16) == (16, 4)
    assert block_shape(8, 128, 16) == (16, 1) and block_shape(8, 128, 64) == (16, 1)
    assert block_shape(1, 256, 16) == (16, 4) and block_shape(8, 256, 64) == (8, 1)
    assert block_shape(1, 128, 16, target_n=256) == (16, 16)
    # two compute warpgroups only for an even count of 64-row query tiles (3 tiles: one)
    kw = dict(batch=2, num_kv_heads=8, head_dim=128, page_size=16, max_pages=8, kv_itemsize=2)
    assert [md.choose_block_sizes(m_rows=m, **kw).compute_wgs for m in (64, 128, 160, 192, 256)] == [1, 2, 1, 1, 2]


def test_split_counts_count_ctas_and_partial_blocks():
    """``choose_block_sizes``'s split count: ``choose_num_splits`` over the CTAs of a request
    (two 64-row tiles on two warpgroups are one CTA), over the KV blocks of the page table
    (a last partial block counted), and balanced, over every request's CTAs."""
    even = md.KernelOptions(balanced_splits=False)
    kw = dict(num_kv_heads=8, head_dim=128, page_size=16, kv_itemsize=2)
    # one CTA of 2 warpgroups, 200 blocks of 8 tokens: a split per SM slot
    assert md.choose_block_sizes(batch=1, max_pages=100, m_rows=128, options=even, **kw) == md.BlockSizes(
        8, 1, 4, 132, 2
    )
    # three tiles of one warpgroup each: three CTAs a request; balanced, 3 requests x 3 CTAs
    assert md.choose_block_sizes(batch=3, max_pages=100, m_rows=192, options=even, **kw).num_splits == 29
    balanced = md.KernelOptions(balanced_splits=True)
    assert md.choose_block_sizes(batch=3, max_pages=100, m_rows=192, options=balanced, **kw).num_splits == 30
    # 5 pages in blocks of 4 pages: two blocks, the last one partial, so two splits
    one_head = dict(num_kv_heads=1, head_dim=256, page_size=16, kv_itemsize=2, options=even)
    assert md.choose_block_sizes(batch=1, max_pages=5, m_rows=16, **one_head) == md.BlockSizes(16, 4, 2, 2, 1)


def test_all_heads_reasons_for_rows_windows_sinks_and_kv_dtype():
    """The all-heads kernel's rules beside the shapes: whole requests of query rows, a window
    of -1 or more, one sink per query head, a KV cache of q's dtype or e4m3 (not e5m2); and
    auto leaves 4 KV heads (not a multiple of 8) to the next kernel."""
    from jattn.pallas_kernels import decode_tuning

    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((4, 16, 8, 64)), jnp.bfloat16)
    sinks = jnp.asarray(rng.standard_normal(16), jnp.float32)
    with gpu_interpret():
        reason = functools.partial(decode_tuning.unsupported_reason, q, k, k)
        assert reason(max_seqlen_q=2, window_left=-1, sinks=sinks) is None
        assert reason(max_seqlen_q=4, window_left=0) is None
        assert "q rows 3 not a multiple of max_seqlen_q=2" in decode_tuning.unsupported_reason(
            q[:3], k, k, max_seqlen_q=2
        )
        assert "window_left=-2" in reason(window_left=-2)
        assert "sinks shape (8,)" in reason(sinks=sinks[:8])
        e5 = k.astype(jnp.float8_e5m2)
        assert "must match q dtype" in decode_tuning.unsupported_reason(q, e5, e5)
        e4 = k.astype(jnp.float8_e4m3fn)
        assert decode_tuning.unsupported_reason(q, e4, e4) is None
    k4 = k[:, :, :4]
    assert "num_kv_heads=4" in md.auto_skip_reason(q, k4, k4)


def test_block_sizes_over_shared_memory_are_refused():
    """Explicit block sizes that do not fit with the FP8 converter's ring raise a clear
    error at trace time, naming block_sizes (not Mosaic's shared-memory failure)."""
    from jattn.pallas_kernels import decode_tuning as dt

    kw = dict(batch=2, num_kv_heads=8, head_dim=128, page_size=64, max_pages=32, m_rows=32, kv_itemsize=1)
    plain = dt.choose_block_sizes(options=dt.KernelOptions(fp8_converter=False), **kw)  # no f16 ring
    cfg = dict(
        batch=2,
        num_pages=70,
        page_size=64,
        max_pages=32,
        num_kv_heads=8,
        num_q_heads=32,
        head_dim=128,
        q_len=1,
        is_causal=True,
        window_left=-1,
        logit_cap=0.0,
        kv_itemsize=1,
        q_itemsize=2,
        interpret=False,
    )
    with pytest.raises(ValueError, match="block_sizes=.*shared memory"):
        dt.decode_config(block_sizes=plain, options=dt.KernelOptions(fp8_converter=True), **cfg)
    assert dt.decode_config(block_sizes=plain, options=dt.KernelOptions(fp8_converter=False), **cfg).bs == plain
    conv = dt.choose_block_sizes(**kw)  # the default options: the converter's ring counted
    assert dt.decode_config(block_sizes=conv, options=dt.KernelOptions(), **cfg).convert_stages == 2
    # two compute warpgroups need an even count of 64-row query tiles (32 rows: one tile), and a split
    with pytest.raises(ValueError, match=r"compute_wgs=2: the 1 query tile\(s\) of 64 rows must split evenly"):
        dt.decode_config(block_sizes=dataclasses.replace(conv, compute_wgs=2), options=dt.KernelOptions(), **cfg)
    with pytest.raises(ValueError, match=r"num_splits=0 must be >= 1"):
        dt.decode_config(block_sizes=dataclasses.replace(conv, num_splits=0), options=dt.KernelOptions(), **cfg)
    # a piece that does not divide the page (its TMA box ran past the page into the next
    # one's rows, which belong to another page id), pages per block without whole pages, and
    # a block that is not a multiple of 64 rows or over 256: were accepted
    plain8 = dataclasses.replace(conv, num_stages=2)
    for bt, ppb, rule in (
        (48, 1, "block_tokens must divide page_size=64"),
        (32, 2, "pages_per_block > 1 needs whole pages"),
        (2, 1, "= 16 rows; it must be a multiple of 64 and at most 256"),
        (64, 1, "= 512 rows; it must be a multiple of 64 and at most 256"),
    ):
        bad = dataclasses.replace(plain8, block_tokens=bt, pages_per_block=ppb)
        with pytest.raises(ValueError, match=rule):
            dt.decode_config(block_sizes=bad, options=dt.KernelOptions(), **cfg)


@pytest.mark.skipif(on_gpu(), reason="the GPU runs the kernels themselves")
def test_op_routes_to_the_per_kv_head_kernel_what_only_it_serves(monkeypatch):
    """FP8 calls that no all-heads block fits (3 KV heads at head_dim 128, a group of 32)
    were refused by ``ops`` under ``backend="mosaic"`` (and left to other backends under
    auto) although ``mosaic_decode.mha_decode`` sends them to the per-KV-head kernel, which
    serves them; batch-invariant calls keep the all-heads kernel's check. FP8 at head_dim
    256 is refused with the converter's ring named, and the option without it is taken."""
    import jattn
    from jattn import dispatch

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "device_kind", lambda: "hopper")
    S, f8 = jax.ShapeDtypeStruct, jnp.float8_e4m3fn

    def call(d, hkv, group, ps=64, bs=2, pages=16, **kw):
        kv = S((bs * pages + 1, ps, hkv, d), f8)
        args = (S((bs, hkv * group, d), jnp.bfloat16), kv, kv, S((bs, pages), jnp.int32), S((bs,), jnp.int32))
        op = functools.partial(jattn.mha_decode_with_kvcache, k_scale=0.5, v_scale=0.5, backend="mosaic", **kw)
        return jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    for d, hkv, group, ps in ((128, 3, 4, 64), (128, 2, 32, 16)):
        assert "jattn_decode_heads" in call(d, hkv, group, ps)
        with pytest.raises(NotImplementedError, match="fits in shared memory|group size 32"):
            call(d, hkv, group, ps, batch_invariant=True)
    with pytest.raises(
        NotImplementedError, match=r"converter's f16 ring \(KernelOptions\(fp8_converter=False\) fits\)"
    ):
        call(256, 8, 4)
    k8 = jnp.zeros((4, 64, 8, 256), f8)
    q = jnp.zeros((2, 32, 256), jnp.bfloat16)
    assert md.all_heads_unsupported_reason(q, k8, k8, options=md.KernelOptions(fp8_converter=False)) is None


def _op_fp8_heads_only(c: Case, interpret: bool):
    """The op under ``backend="mosaic"`` on an FP8 call that only the per-KV-head kernel
    serves (refused before): its e4m3-query path against the f32 reference over the rounded
    query, NaN in unused pages and page tails."""
    import jattn
    from jattn.pallas_kernels import mosaic_decode_heads as mh

    q, k, v, table, lens, _, ks, vs = _inputs(c, 0)
    kw = dict(max_seqlen_q=1, k_scale=ks, v_scale=vs, return_lse=True)
    with gpu_interpret() if interpret else contextlib.nullcontext():
        out, lse = jattn.mha_decode_with_kvcache(q, k, v, table, lens, backend="mosaic", **kw)
    ref, ref_lse = reference.mha_decode(mh.fp8_qk_query(q, c.hkv), k, v, table, lens, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=3e-2, rtol=1e-3)


@pytest.mark.skipif(on_gpu(), reason="interpreter tests run on the CPU")
def test_op_runs_fp8_calls_only_the_per_kv_head_kernel_serves_interpreted():
    _op_fp8_heads_only(Case(lens=(97, 1, 0, 70), hq=12, hkv=3, d=128, page_size=64, kv="fp8"), True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "c",
    [
        Case(lens=(97, 1, 0, 300), hq=12, hkv=3, d=128, page_size=64, kv="fp8"),
        Case(lens=(97, 1, 0, 300), hq=64, hkv=2, d=128, page_size=16, kv="fp8"),
    ],
    ids=["fp8_3_kv_heads", "fp8_group_32"],
)
def test_gpu_op_runs_fp8_calls_only_the_per_kv_head_kernel_serves(c):
    if not on_gpu():
        pytest.skip("needs a GPU")
    _op_fp8_heads_only(c, False)
