"""The Triton KV-cache writes: MHA K/V (``jattn.pallas_kernels.triton_kv_write``) and the
MLA latent rows (``triton_mla_kv_write``).

CPU: the kernel sources under Triton's interpreter on a torch pool
(``jattn.bridge.triton_native.set_kv_buffer`` / ``set_mla_kv_buffer``, a
``TRITON_INTERPRET=1`` subprocess), compared with the float64 writes of
``tests/naive.py``: bf16-free dtypes (f32, f16, FP8 e4m3 with scales and saturation),
slots out of range and negative (dropped), no token at all and one token into the pool's
last slot, every other slot left as it was (NaN); for MLA also mixed input dtypes, 3-D
``[T, 1, width]`` inputs and a row wider than one column block. GPU (marker ``gpu``):
through jax-triton, equal to the XLA write bit for bit.
"""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from interpreted import run_in_interpreter
from naive import set_kv_buffer as write_f64
from naive import set_mla_kv_buffer as write_mla_f64

from jattn.pallas_kernels.interpret import on_gpu

CASES = {"f32": ("float32", None, None), "f16": ("float16", None, None), "fp8": ("float8_e4m3fn", 0.05, 2.0)}
PAGES, PS, HKV, D, DV, T = 6, 16, 2, 64, 32, 37
# edge writes: no token at all, and one token into the pool's very last slot
CASES.update(t0=("float32", None, None), last_slot=("float16", None, None))
LOCS = {"t0": [], "last_slot": [PAGES * PS - 1]}
# V rows wider than K rows (head_dim_v > head_dim is a legal cache): the launch's column
# blocks must cover the longer row, whichever of K and V it is
CASES.update(wide_v=("float32", None, None))
WIDTHS = {"wide_v": (16, 48)}  # K, V row widths where not (D, DV)


def _near_ties(scale: float, n: int = 21) -> np.ndarray:
    """f32 inputs whose quotients by ``scale`` (inexact) fall on or within 3 ulp of the
    midpoints between e4m3 neighbours: an approximate division rounds some of them to the
    other neighbour, so the GPU test's bit comparison with XLA (a true division) sees it."""
    mids = np.array([2.625, -11.5, 34.0], np.float32)  # between 2.5/2.75, 11/12, 32/36
    out = []
    for m in mids:
        x = np.float32(m * np.float64(scale))
        for k in range(-3, 4):
            out.append(x + np.float32(k) * np.spacing(x))
    return np.array(out[:n], np.float32)


def _quotients(shape, loc, rows, scale) -> np.ndarray:
    """Each written slot's ``x / scale`` in f32, as the kernel divides (NaN where nothing is)."""
    q = np.full(shape, np.nan, np.float32)
    for row, slot in zip(rows, loc):
        if 0 <= slot < shape[0] * shape[1]:
            q[slot // shape[1], slot % shape[1]] = np.asarray(row, np.float32) / np.float32(scale or 1.0)
    return q


def _inputs(name):
    dt, ks, vs = CASES[name]
    d, dv = WIDTHS.get(name, (D, DV))
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    loc = rng.permutation(PAGES * PS)[:T].astype(np.int32)
    loc[3], loc[7] = PAGES * PS, -2  # dropped: one past the last slot, and negative
    k = (rng.standard_normal((T, HKV, d)) * 8).astype(np.float32)
    v = (rng.standard_normal((T, HKV, dv)) * 8).astype(np.float32)
    k[0, 0, :4] = [1e4, -1e4, 30.0, -30.0]  # saturate at +-448 after the scale
    # NaN stored as NaN of its sign (not +-448), Inf clamped
    k[1, 1, 5], v[2, 0, 3], k[4, 0, 0] = np.nan, -np.nan, np.inf
    if ks is not None:
        k[5, 0, :21] = _near_ties(ks)
    if name in LOCS:
        loc = np.asarray(LOCS[name], np.int32)
        k, v = k[: len(loc)], v[: len(loc)]
    return dt, ks, vs, loc, k, v


def run_interpreted(name: str, path: str) -> None:
    import torch

    from jattn.bridge import triton_native

    dt, ks, vs, loc, k, v = _inputs(name)
    tdt = getattr(torch, dt)
    # the pools are the first PAGES pages of buffers one page longer: a write one slot past
    # the pool lands in the extra page, which must stay NaN
    kbig = torch.full((PAGES + 1, PS, HKV, k.shape[-1]), float("nan"), dtype=torch.float32).to(tdt)
    vbig = torch.full((PAGES + 1, PS, HKV, v.shape[-1]), float("nan"), dtype=torch.float32).to(tdt)
    kc, vc = kbig[:PAGES], vbig[:PAGES]
    triton_native.set_kv_buffer(
        kc, vc, torch.from_numpy(loc), torch.from_numpy(k), torch.from_numpy(v), k_scale=ks, v_scale=vs
    )
    past = torch.cat([kbig[PAGES:].float().ravel(), vbig[PAGES:].float().ravel()])
    np.savez(path, k=kc.float().numpy(), v=vc.float().numpy(), past=past.numpy())


# MLA latent rows [c_kv (R), k_pe (RPE)]: cache dtype, c_kv dtype, k_pe dtype, kv_scale, R, 3-D inputs
MLA_CASES = {
    "mla_f32": ("float32", "float16", "float32", None, 40, False),
    "mla_f16_3d": ("float16", "float32", "float16", None, 40, True),
    "mla_fp8": ("float8_e4m3fn", "float32", "float32", 0.05, 40, False),
    "mla_fp8_wide": ("float8_e4m3fn", "float16", "float32", 0.5, 1000, True),  # two column blocks
    "mla_t0": ("float32", "float32", "float32", None, 40, False),
    "mla_last_slot": ("float16", "float16", "float16", None, 40, False),
}
RPE = 8


def _mla_inputs(name):
    cache_dt, ckv_dt, kpe_dt, scale, r, three_d = MLA_CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    loc = rng.permutation(PAGES * PS)[:T].astype(np.int32)
    loc[3], loc[7] = PAGES * PS, -2  # dropped: one past the last slot, and negative
    c_kv = (rng.standard_normal((T, r)) * 8).astype(ckv_dt)
    k_pe = (rng.standard_normal((T, RPE)) * 8).astype(kpe_dt)
    c_kv[0, :4] = [1e4, -1e4, 30.0, -30.0]  # saturate at +-448 after the scale
    c_kv[1, 5], k_pe[2, 3], k_pe[4, 0] = np.nan, np.nan, np.inf  # NaN stored as NaN, Inf clamped
    k_pe[0, :2] = [-1e4, 1e4]
    if scale is not None and c_kv.dtype == np.float32:
        c_kv[5, :21] = _near_ties(scale)
    name_locs = {"mla_t0": [], "mla_last_slot": [PAGES * PS - 1]}
    if name in name_locs:
        loc = np.asarray(name_locs[name], np.int32)
        c_kv, k_pe = c_kv[: len(loc)], k_pe[: len(loc)]
    if three_d:
        c_kv, k_pe = c_kv[:, None], k_pe[:, None]
    return cache_dt, scale, r, loc, c_kv, k_pe


def run_mla_interpreted(name: str, path: str) -> None:
    import torch

    from jattn.bridge import triton_native

    cache_dt, scale, r, loc, c_kv, k_pe = _mla_inputs(name)
    big = torch.full((PAGES + 1, PS, r + RPE), float("nan"), dtype=torch.float32).to(getattr(torch, cache_dt))
    kv = big[:PAGES]  # a write one slot past the pool would land in the extra page
    got = triton_native.set_mla_kv_buffer(
        kv, torch.from_numpy(loc), torch.from_numpy(c_kv), torch.from_numpy(k_pe), kv_scale=scale
    )
    assert got is kv  # in place
    np.savez(path, kv=kv.float().numpy(), past=big[PAGES:].float().numpy())


# cases also written through the JAX entry points, their host code (slot count, grid) run
# on the CPU with the kernel interpreted
JAX_PATH_CASES = ["f16", "fp8", "wide_v"]
MLA_JAX_PATH_CASES = ["mla_fp8_wide", "mla_f16_3d"]


def run_jax_path(name: str, path: str) -> None:
    """In a TRITON_INTERPRET=1 process: the case (``jax_`` and its name) through
    ``triton_kv_write.set_kv_buffer`` or ``triton_mla_kv_write.set_mla_kv_buffer``, eagerly."""
    import jax
    import jax.numpy as jnp
    from interpreted import interpreted_triton_call

    from jattn.pallas_kernels import triton_glue, triton_kv_write, triton_mla_kv_write

    triton_glue.triton_call = interpreted_triton_call
    name = name.removeprefix("jax_")
    with jax.disable_jit():
        if name in MLA_CASES:
            cache_dt, scale, r, loc, c_kv, k_pe = _mla_inputs(name)
            kv = jnp.full((PAGES, PS, r + RPE), jnp.nan, getattr(jnp, cache_dt))
            kv = triton_mla_kv_write.set_mla_kv_buffer(kv, jnp.asarray(loc), c_kv, k_pe, kv_scale=scale)
            np.savez(path, kv=np.asarray(kv, np.float32))
            return
        dt, ks, vs, loc, k, v = _inputs(name)
        kc = jnp.full((PAGES, PS, HKV, k.shape[-1]), jnp.nan, getattr(jnp, dt))
        vc = jnp.full((PAGES, PS, HKV, v.shape[-1]), jnp.nan, getattr(jnp, dt))
        kc, vc = triton_kv_write.set_kv_buffer(kc, vc, jnp.asarray(loc), k, v, k_scale=ks, v_scale=vs)
    np.savez(path, k=np.asarray(kc, np.float32), v=np.asarray(vc, np.float32))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    jax_path = ["jax_" + n for n in JAX_PATH_CASES + MLA_JAX_PATH_CASES]
    return run_in_interpreter(
        tmp_path_factory,
        "test_triton_kv_write",
        {"run_interpreted": list(CASES), "run_mla_interpreted": list(MLA_CASES), "run_jax_path": jax_path},
    )


def _expected(name):
    dt, ks, vs, loc, k, v = _inputs(name)
    kc = np.full((PAGES, PS, HKV, k.shape[-1]), np.nan, np.float32).astype(getattr(ml_dtypes, dt, dt))
    vc = np.full((PAGES, PS, HKV, v.shape[-1]), np.nan, np.float32).astype(getattr(ml_dtypes, dt, dt))
    keep = (loc >= 0) & (loc < PAGES * PS)  # the rest are dropped
    wk, wv = write_f64(kc, vc, loc[keep], k[keep], v[keep], k_scale=ks, v_scale=vs)
    return np.asarray(wk, np.float32), np.asarray(wv, np.float32)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_the_float64_write(name, interpreted):
    wk, wv = _expected(name)
    got = interpreted[name]
    assert np.isnan(got["past"]).all(), "a write past the pool's last slot"
    _, ks, vs, loc, k, v = _inputs(name)
    for g, w, rows, scale in ((got["k"], wk, k, ks), (got["v"], wv, v, vs)):
        _assert_written(g, w, fp8=name == "fp8", quotient=_quotients(w.shape, loc, rows, scale))
    if name == "fp8":
        assert np.nanmax(np.abs(got["k"])) == 448.0  # saturated, not NaN or wrapped


def _assert_written(g, w, *, fp8: bool, quotient=None):
    """The interpreted pool ``g`` equals the float64 write ``w`` bit for bit (FP8: but for
    the interpreter's own rounding slips, below; ``quotient``: every slot's f32 ``x / scale``,
    where it lets through the exact ties the interpreter rounds away from even)."""
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))  # NaN where nothing was written or NaN was
    nan = np.isnan(w)
    np.testing.assert_array_equal(np.signbit(g[nan]), np.signbit(w[nan]))  # a NaN keeps its sign
    if not fp8:
        np.testing.assert_array_equal(g, w)
        return
    # Triton's interpreter casts f32 -> e4m3 wrongly when rounding carries into the next
    # power of two (it gives half of it: 64 for 128), and rounds some subnormals one step
    # (2**-9) off. Those values, and only those, are
    # let through here; the GPU test compares every bit with XLA's write.
    w_abs = np.abs(np.nan_to_num(w))
    carry = (w_abs > 0) & (np.log2(np.maximum(w_abs, 1e-30)) % 1 == 0) & (g == w / 2)
    g_abs = np.abs(np.nan_to_num(g))
    step = (np.abs(np.nan_to_num(g) - np.nan_to_num(w)) == 2**-9) & (np.minimum(g_abs, w_abs) < 2**-6)  # subnormal
    carry = carry | step
    if quotient is not None:  # an exact tie between two e4m3 neighbours (f16 inputs have them)
        x = np.clip(np.nan_to_num(quotient), -448.0, 448.0)
        carry |= (np.abs(x - np.nan_to_num(w)) == np.abs(x - np.nan_to_num(g))) & (np.abs(x) < 448)
    carry &= np.nan_to_num(g) != np.nan_to_num(w)
    assert carry.mean() < 0.02
    np.testing.assert_array_equal(np.where(carry, w, g), w)


def test_bridge_write_names_the_bad_argument():
    torch = pytest.importorskip("torch")
    from jattn.bridge import BridgeError, triton_native

    kc, vc = torch.zeros((2, 4, 1, 8)), torch.zeros((2, 4, 1, 8))
    loc = torch.zeros((3,), dtype=torch.int32)
    with pytest.raises(BridgeError, match=r"k \(3, 1, 4\) must be \[3, 1, 8\]"):
        triton_native.set_kv_buffer(kc, vc, loc, torch.zeros((3, 1, 4)), torch.zeros((3, 1, 8)))
    with pytest.raises(BridgeError, match="out_cache_loc.dtype=torch.int64"):
        triton_native.set_kv_buffer(kc, vc, loc.long(), torch.zeros((3, 1, 8)), torch.zeros((3, 1, 8)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_equals_the_xla_write(name):
    import jattn
    from jattn.pallas_kernels import triton_glue

    if not on_gpu() or not triton_glue.available():
        pytest.skip("needs a GPU with jax-triton")
    dt, ks, vs, loc, k, v = _inputs(name)
    kc = jnp.full((PAGES, PS, HKV, k.shape[-1]), jnp.nan, jnp.dtype(dt))
    vc = jnp.full((PAGES, PS, HKV, v.shape[-1]), jnp.nan, jnp.dtype(dt))
    args = (kc, vc, jnp.asarray(loc), jnp.asarray(k), jnp.asarray(v))
    want = jattn.set_kv_buffer(*args, k_scale=ks, v_scale=vs, backend="xla")
    got = jattn.set_kv_buffer(*args, k_scale=ks, v_scale=vs, backend="triton")
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _mla_expected(name):
    """The float64 write's pool, and each slot's f32 ``row / kv_scale`` (NaN where none)."""
    cache_dt, scale, r, loc, c_kv, k_pe = _mla_inputs(name)
    kv = np.full((PAGES, PS, r + RPE), np.nan, np.float32).astype(getattr(ml_dtypes, cache_dt, cache_dt))
    keep = (loc >= 0) & (loc < PAGES * PS)  # the rest are dropped
    want = np.asarray(write_mla_f64(kv, loc[keep], c_kv[keep], k_pe[keep], kv_scale=scale), np.float32)
    rows = np.concatenate([np.asarray(x, np.float32).reshape(len(loc), x.shape[-1]) for x in (c_kv, k_pe)], axis=1)
    return want, _quotients(kv.shape, loc, rows, scale)


@pytest.mark.parametrize("name", list(MLA_CASES))
def test_mla_interpreted_matches_the_float64_write(name, interpreted):
    (want, quotient), got = _mla_expected(name), interpreted[name]["kv"]
    assert np.isnan(interpreted[name]["past"]).all(), "a write past the pool's last slot"
    fp8 = "fp8" in name
    _assert_written(got, want, fp8=fp8, quotient=quotient)
    if name != "mla_t0":
        assert (~np.isnan(got)).sum() > 0  # something was written
    if fp8:
        assert np.nanmax(np.abs(got)) == 448.0  # saturated, not NaN or wrapped


@pytest.mark.parametrize("name", JAX_PATH_CASES + MLA_JAX_PATH_CASES)
def test_jax_entry_point_interpreted_matches_the_float64_write(name, interpreted):
    """The JAX entry points' host code (the pool's slot count, the grid over tokens and
    column blocks, the caches aliased in place): the GPU tests alone ran it before."""
    got = interpreted["jax_" + name]
    if name in MLA_CASES:
        want, quotient = _mla_expected(name)
        _assert_written(got["kv"], want, fp8="fp8" in name, quotient=quotient)
        return
    wk, wv = _expected(name)
    _, ks, vs, loc, k, v = _inputs(name)
    for g, w, rows, scale in ((got["k"], wk, k, ks), (got["v"], wv, v, vs)):
        _assert_written(g, w, fp8=name == "fp8", quotient=_quotients(w.shape, loc, rows, scale))


def test_mla_write_backends_and_errors():
    """``set_mla_kv_buffer``'s backend argument: a named backend is checked, mosaic has no
    write, triton needs a GPU with jax-triton, and a call with no tokens gives the cache as
    it is on every backend; the bridge's native write names a bad argument."""
    import jattn
    from jattn.pallas_kernels import triton_glue

    kv = jnp.full((2, 4, 12), jnp.nan, jnp.bfloat16)
    c_kv, k_pe = jnp.ones((3, 8), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    loc = jnp.array([0, 5, 7], jnp.int32)
    with pytest.raises(ValueError, match="backend"):
        jattn.set_mla_kv_buffer(kv, loc, c_kv, k_pe, backend="cuda")
    with pytest.raises(NotImplementedError, match="set_mla_kv_buffer: no mosaic kernel"):
        jattn.set_mla_kv_buffer(kv, loc, c_kv, k_pe, backend="mosaic")
    if not (on_gpu() and triton_glue.available()):
        with pytest.raises(NotImplementedError, match="set_mla_kv_buffer: the triton backend needs a CUDA GPU"):
            jattn.set_mla_kv_buffer(kv, loc, c_kv, k_pe, backend="triton")
    for backend in (None, "xla", "triton", "mosaic"):
        got = jattn.set_mla_kv_buffer(kv, loc[:0], c_kv[:0], k_pe[:0], backend=backend)
        assert got is kv
        kc, vc = jattn.set_kv_buffer(
            kv[..., None], kv[..., None], loc[:0], jnp.ones((0, 12, 1)), jnp.ones((0, 12, 1)), backend=backend
        )
        assert kc.shape == kv[..., None].shape and vc.shape == kc.shape
        # tokens but no heads, or no slots: nothing to write either (triton launched a zero grid)
        none = jnp.zeros((2, 4, 0, 8), jnp.bfloat16)
        assert (
            jattn.set_kv_buffer(none, none, loc, jnp.ones((3, 0, 8)), jnp.ones((3, 0, 8)), backend=backend)[0] is none
        )
        assert jattn.set_mla_kv_buffer(kv[:0], loc, c_kv, k_pe, backend=backend) is not None
    torch = pytest.importorskip("torch")
    from jattn.bridge import BridgeError, triton_native

    tkv, tloc = torch.zeros((2, 4, 12)), torch.zeros((3,), dtype=torch.int32)
    with pytest.raises(BridgeError, match=r"c_kv must be a torch.Tensor \[3, width\]"):
        triton_native.set_mla_kv_buffer(tkv, tloc, np.ones((3, 8)), torch.zeros((3, 4)))
    with pytest.raises(BridgeError, match=r"k_pe \(3, 2, 4\) must be float rows"):
        triton_native.set_mla_kv_buffer(tkv, tloc, torch.zeros((3, 8)), torch.zeros((3, 2, 4)))
    with pytest.raises(BridgeError, match="must give rows of width 12"):
        triton_native.set_mla_kv_buffer(tkv, tloc, torch.zeros((3, 8)), torch.zeros((3, 5)))
    with pytest.raises(BridgeError, match="out_cache_loc.dtype=torch.int64"):
        triton_native.set_mla_kv_buffer(tkv, tloc.long(), torch.zeros((3, 8)), torch.zeros((3, 4)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MLA_CASES))
def test_mla_gpu_equals_the_xla_write(name):
    import jattn
    from jattn.pallas_kernels import triton_glue

    if not on_gpu() or not triton_glue.available():
        pytest.skip("needs a GPU with jax-triton")
    cache_dt, scale, r, loc, c_kv, k_pe = _mla_inputs(name)
    kv = jnp.full((PAGES, PS, r + RPE), jnp.nan, jnp.dtype(cache_dt))
    args = (kv, jnp.asarray(loc), jnp.asarray(c_kv), jnp.asarray(k_pe))
    want = jattn.set_mla_kv_buffer(*args, kv_scale=scale, backend="xla")
    got = jattn.set_mla_kv_buffer(*args, kv_scale=scale, backend="triton")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    if name != "mla_t0":
        assert not np.array_equal(np.asarray(got, np.float32), np.asarray(kv, np.float32), equal_nan=True)
