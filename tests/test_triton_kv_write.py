"""The Triton KV-cache write (``jattn.pallas_kernels.triton_kv_write``).

CPU: the kernel source under Triton's interpreter on a torch pool
(``jattn.bridge.triton_native.set_kv_buffer``, a ``TRITON_INTERPRET=1`` subprocess),
compared with the float64 write of ``tests/naive.py``: bf16-free dtypes (f32, f16,
FP8 e4m3 with scales and saturation), slots out of range and negative (dropped),
no token at all and one token into the pool's last slot, every other slot left as it
was (NaN). GPU (marker ``gpu``): through jax-triton, equal to the XLA write bit for bit.
"""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from interpreted import run_in_interpreter
from naive import set_kv_buffer as write_f64

from jattn.pallas_kernels.interpret import on_gpu

CASES = {"f32": ("float32", None, None), "f16": ("float16", None, None), "fp8": ("float8_e4m3fn", 0.05, 2.0)}
PAGES, PS, HKV, D, DV, T = 6, 16, 2, 64, 32, 37
# edge writes: no token at all, and one token into the pool's very last slot
CASES.update(t0=("float32", None, None), last_slot=("float16", None, None))
LOCS = {"t0": [], "last_slot": [PAGES * PS - 1]}


def _inputs(name):
    dt, ks, vs = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    loc = rng.permutation(PAGES * PS)[:T].astype(np.int32)
    loc[3], loc[7] = PAGES * PS + 5, -2  # dropped
    k = (rng.standard_normal((T, HKV, D)) * 8).astype(np.float32)
    v = (rng.standard_normal((T, HKV, DV)) * 8).astype(np.float32)
    k[0, 0, :4] = [1e4, -1e4, 30.0, -30.0]  # saturate at +-448 after the scale
    k[1, 1, 5], v[2, 0, 3], k[4, 0, 0] = np.nan, np.nan, np.inf  # NaN stored as NaN (not +-448), Inf clamped
    if name in LOCS:
        loc = np.asarray(LOCS[name], np.int32)
        k, v = k[: len(loc)], v[: len(loc)]
    return dt, ks, vs, loc, k, v


def run_interpreted(name: str, path: str) -> None:
    import torch

    from jattn.bridge import triton_native

    dt, ks, vs, loc, k, v = _inputs(name)
    tdt = getattr(torch, dt)
    kc = torch.full((PAGES, PS, HKV, D), float("nan"), dtype=torch.float32).to(tdt)
    vc = torch.full((PAGES, PS, HKV, DV), float("nan"), dtype=torch.float32).to(tdt)
    triton_native.set_kv_buffer(
        kc, vc, torch.from_numpy(loc), torch.from_numpy(k), torch.from_numpy(v), k_scale=ks, v_scale=vs
    )
    np.savez(path, k=kc.float().numpy(), v=vc.float().numpy())


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_in_interpreter(tmp_path_factory, "test_triton_kv_write", {"run_interpreted": list(CASES)})


def _expected(name):
    dt, ks, vs, loc, k, v = _inputs(name)
    kc = np.full((PAGES, PS, HKV, D), np.nan, np.float32).astype(getattr(ml_dtypes, dt, dt))
    vc = np.full((PAGES, PS, HKV, DV), np.nan, np.float32).astype(getattr(ml_dtypes, dt, dt))
    keep = (loc >= 0) & (loc < PAGES * PS)  # the rest are dropped
    wk, wv = write_f64(kc, vc, loc[keep], k[keep], v[keep], k_scale=ks, v_scale=vs)
    return np.asarray(wk, np.float32), np.asarray(wv, np.float32)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_the_float64_write(name, interpreted):
    wk, wv = _expected(name)
    got = interpreted[name]
    for g, w in ((got["k"], wk), (got["v"], wv)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))  # NaN where nothing was written or NaN was
        if name == "fp8":
            # Triton's interpreter casts f32 -> e4m3 wrongly when rounding carries into the next
            # power of two (it gives half of it: 64 for 128), and rounds some subnormals one step
            # (2**-9) off. Those values, and only those, are
            # let through here; the GPU test compares every bit with XLA's write.
            w_abs = np.abs(np.nan_to_num(w))
            carry = (w_abs > 0) & (np.log2(np.maximum(w_abs, 1e-30)) % 1 == 0) & (g == w / 2)
            step = np.abs(np.nan_to_num(g) - np.nan_to_num(w)) == 2**-9  # a subnormal step off
            carry = (carry | step) & (np.nan_to_num(g) != np.nan_to_num(w))
            assert carry.mean() < 0.02
            np.testing.assert_array_equal(np.where(carry, w, g), w)
        else:
            np.testing.assert_array_equal(g, w)
    if name == "fp8":
        assert np.nanmax(np.abs(got["k"])) == 448.0  # saturated, not NaN or wrapped


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
@pytest.mark.parametrize("name", [n for n in CASES if n != "t0"])  # the triton backend refuses no tokens
def test_gpu_equals_the_xla_write(name):
    import jattn
    from jattn.pallas_kernels import triton_glue

    if not on_gpu() or not triton_glue.available():
        pytest.skip("needs a GPU with jax-triton")
    dt, ks, vs, loc, k, v = _inputs(name)
    kc = jnp.full((PAGES, PS, HKV, D), jnp.nan, jnp.dtype(dt))
    vc = jnp.full((PAGES, PS, HKV, DV), jnp.nan, jnp.dtype(dt))
    args = (kc, vc, jnp.asarray(loc), jnp.asarray(k), jnp.asarray(v))
    want = jattn.set_kv_buffer(*args, k_scale=ks, v_scale=vs, backend="xla")
    got = jattn.set_kv_buffer(*args, k_scale=ks, v_scale=vs, backend="triton")
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
