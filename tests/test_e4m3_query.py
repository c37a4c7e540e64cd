"""The e4m3 queries of the FP8 decode kernels (``jattn.pallas_kernels.e4m3_query``): the
per-KV-head kernel's tiles and the MLA kernel's rows. The power-of-two scale rule, the XLA
ops against float64 oracles written here, and the Triton kernels against the XLA ops bit
for bit (under Triton's interpreter on torch CPU tensors, and through jax-triton on a
GPU)."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import run_in_interpreter

from jattn.pallas_kernels import e4m3_query

# (batch, q heads, kv heads, q_len, tiles, width, head_dim, dtype)
CASES = {
    "q1_g4_w16_f16": (3, 8, 2, 1, 1, 16, 64, "float16"),
    "q3_g4_w16_f32": (2, 8, 2, 3, 1, 16, 128, "float32"),
    "q5_g4_two_tiles_f16": (2, 8, 2, 5, 2, 16, 64, "float16"),
    "q2_g8_w16_f32_mla_like": (1, 8, 1, 2, 1, 16, 128, "float32"),
    "q8_g8_w64_f32": (1, 16, 2, 8, 1, 64, 128, "float32"),
    "q3_g8_w32_f16": (2, 16, 2, 3, 1, 32, 64, "float16"),
    "q4_g8_tiles2_w16_f32": (2, 16, 2, 4, 2, 16, 64, "float32"),
    "edge_amax_f32": (1, 12, 12, 1, 1, 16, 64, "float32"),  # one row per item, see _query
}

# largest magnitudes of the edge case's items: 448 and its neighbours, 1.75 * 2^k and the next
# float above, the largest float, a value past which the scale is capped at 2^126 (2^-120;
# subnormals stay out: XLA on the CPU flushes them), 1, and a power of two
_EDGE_AMAX = np.array(
    [448.0, np.nextafter(np.float32(448), np.float32(0)), np.nextafter(np.float32(448), np.float32(1e9)),
     1.75 * 2.0**-5, np.nextafter(np.float32(1.75 * 2.0**-5), np.float32(1)), 1.75 * 2.0**20,
     np.nextafter(np.float32(1.75 * 2.0**20), np.float32(1e30)), np.finfo(np.float32).max, 2.0**-120, 2.0**-100,
     1.0, 2.0**7],
    np.float32,
)  # fmt: skip


def _query(name):
    """Random rows at mixed magnitudes; one row with a NaN, one with an Inf, one item of
    zeros (the last request's KV head 0 at q_len 1), and one tiny item."""
    bs, hq, hkv, q_len, tiles, width, d, dt = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if name == "edge_amax_f32":  # item h: amax _EDGE_AMAX[h] exactly, -0.0 and entries that round to -0
        mag = rng.uniform(0.25, 1.0, (1, hq, d)) * rng.choice([-1.0, 1.0], (1, hq, d))
        x = mag.astype(np.float32) * _EDGE_AMAX[None, :, None]  # no subnormal entries
        x[0, :, 0] = _EDGE_AMAX
        x[0, :, 1] = -0.0
        x[0, :, 2] = -_EDGE_AMAX * np.where(_EDGE_AMAX >= 2.0**-100, 2.0**-20, 2.0**-5).astype(np.float32)
        return x, hkv, q_len, tiles, width
    q = rng.standard_normal((bs * q_len, hq, d)) * np.exp(rng.uniform(-3, 6, (bs * q_len, hq, 1)))
    q[..., 3] = -q[..., 3] * 2.0**-24  # negative entries far below their item's largest: e4m3 -0
    q[0, 1, 5] = np.nan
    q[-1, -1, 0] = np.inf if q_len > 1 else -np.inf
    if q_len == 1:
        q[-1, : hq // hkv] = 0.0
        q[0, hq // hkv :] *= 1e-4
    return q.astype(dt), hkv, q_len, tiles, width


def _oracle(q, hkv, q_len, tiles, width):
    """float64 per item: rows gathered, non-finite rows zeroed and flagged, the largest
    power of two s with amax * s <= 448, q * s rounded to e4m3 (nearest, ties even)."""
    import ml_dtypes

    q = np.asarray(q, np.float64)
    rows, hq, d = q.shape
    bs, g = rows // q_len, hq // hkv
    q8 = np.zeros((bs, hkv, tiles * width, d), np.float32)
    factor = np.zeros((bs, hkv, tiles))
    bad = np.zeros((bs, hkv, tiles * width), bool)
    for b in range(bs):
        for h in range(hkv):
            x = np.zeros((tiles * width, d))
            for k in range(q_len * g):
                row = q[b * q_len + k // g, h * g + k % g]
                bad[b, h, k] = not np.isfinite(row).all()
                x[k] = 0.0 if bad[b, h, k] else row
            for t in range(tiles):
                xt = x[t * width : (t + 1) * width]
                amax = np.abs(xt).max()
                e = 0 if amax == 0 else min(126, int(np.floor(np.log2(448.0 / amax))))
                while amax and amax * 2.0 ** (e + 1) <= 448.0 and e < 126:  # guard the log's rounding
                    e += 1
                while amax * 2.0**e > 448.0:
                    e -= 1
                y = np.clip(xt * 2.0**e, -448, 448).astype(np.float32)
                q8[b, h, t * width : (t + 1) * width] = y
                factor[b, h, t] = 2.0**-e
    return q8.astype(np.float32).astype(ml_dtypes.float8_e4m3fn), factor, bad


def _bytes(q8):
    """e4m3 values as their bytes (so -0 and +0 differ)."""
    import ml_dtypes

    q8 = np.asarray(q8)
    return (q8 if q8.dtype == np.uint8 else q8.astype(ml_dtypes.float8_e4m3fn)).view(np.uint8)


def _check(name, q8, factor, bad):
    ref_q8, ref_f, ref_bad = _oracle(*_query(name))
    np.testing.assert_array_equal(_bytes(q8), _bytes(ref_q8))
    np.testing.assert_array_equal(np.asarray(factor, np.float64), ref_f)
    np.testing.assert_array_equal(np.asarray(bad) != 0, ref_bad)


def test_pow2_scale_is_the_largest_fitting_power_of_two():
    f32 = np.float32
    tiny = np.finfo(f32).tiny
    amax = np.array(
        [448.0, 447.99997, 448.00003, 1.75, np.nextafter(f32(1.75), f32(2)), 1.0, 0.5, 3.0e38, tiny, tiny / 8, 1e-30],
        f32,
    )
    rng = np.random.default_rng(3)
    amax = np.concatenate([amax, np.exp(rng.uniform(-80, 80, 2000)).astype(f32)])
    s = np.asarray(e4m3_query.pow2_scale(jnp.asarray(amax)), np.float64)
    a = amax.astype(np.float64)
    assert np.all(np.log2(s) == np.round(np.log2(s)))  # powers of two
    assert np.all(a * s <= 448.0)
    top = s < 2.0**126
    assert np.all(a[top] * s[top] * 2 > 448.0)  # the largest such
    assert s[0] == 1.0 and s[1] == 1.0 and s[2] == 0.5
    assert e4m3_query.pow2_scale(jnp.float32(0.0)) == 1.0


@pytest.mark.parametrize("name", list(CASES))
def test_xla_ops_match_float64(name):
    q, hkv, q_len, tiles, width = _query(name)
    _check(name, *e4m3_query.query_tiles(jnp.asarray(q), hkv, q_len, tiles, width, use_kernel=False))


def run_interpreted(name: str, path: str) -> None:
    """Run in a TRITON_INTERPRET=1 process: the kernel on torch CPU tensors, twice."""
    import torch

    from jattn.pallas_kernels import triton_glue

    q, hkv, q_len, tiles, width = _query(name)
    bs, d = q.shape[0] // q_len, q.shape[2]
    grid, params = e4m3_query.tiles_launch(q.shape, hkv, q_len, tiles, width)
    runs = []
    for i64 in (params["I64"], True):  # the second run: the int64 offsets of huge batches, same result
        q8 = torch.full((bs, hkv, tiles * width, d), float("nan"), dtype=torch.float8_e4m3fn)
        factor = torch.full((bs, hkv, tiles), float("nan"), dtype=torch.float32)
        bad = torch.full((bs, hkv, tiles * width), 7, dtype=torch.int8)
        kw = {**params, "I64": i64}
        triton_glue.launch_interpreted(e4m3_query._tiles_kernel, grid, torch.from_numpy(q), q8, factor, bad, **kw)
        runs.append((q8.view(torch.uint8).numpy(), factor.numpy(), bad.numpy()))
    np.savez(path, q8=runs[0][0], factor=runs[0][1], bad=runs[0][2], q8b=runs[1][0])


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    runs = {"run_interpreted": list(CASES), "run_rows_interpreted": list(ROW_CASES)}
    return run_in_interpreter(tmp_path_factory, "test_e4m3_query", runs)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_interpreted(name, interpreted):
    res = interpreted[name]
    _check(name, res["q8"], res["factor"], res["bad"])
    np.testing.assert_array_equal(res["q8"], res["q8b"])
    q, hkv, q_len, tiles, width = _query(name)
    xla = e4m3_query.query_tiles(jnp.asarray(q), hkv, q_len, tiles, width, use_kernel=False)
    np.testing.assert_array_equal(res["q8"], _bytes(xla[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_triton_kernel_matches_xla(name, dtype):
    """Through jax-triton: the same bits as the XLA ops, bf16 queries too."""
    if not e4m3_query._kernel_runs_here(64, 16):
        pytest.skip("needs a CUDA GPU with jax-triton")
    q, hkv, q_len, tiles, width = _query(name)
    q = jnp.asarray(q.astype(np.float32)).astype(dtype)
    got = jax.jit(lambda x: e4m3_query.query_tiles(x, hkv, q_len, tiles, width))(q)
    want = e4m3_query.query_tiles(q, hkv, q_len, tiles, width, use_kernel=False)
    assert got[0].dtype == jnp.float8_e4m3fn and got[2].dtype == jnp.int8
    np.testing.assert_array_equal(_bytes(got[0]), _bytes(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[2]) != 0, np.asarray(want[2]))


# ---------------------------------------------------------------------------
# MLA rows: (batch, rows, rows padded to 8, rows padded to the 64-row tiles, width, dtype)
ROW_CASES = {
    "r16_w576_f32": (2, 16, 16, 64, 576, "float32"),
    "r20_w576_f16_padded": (3, 20, 24, 64, 576, "float16"),
    "r130_three_tiles_f32": (1, 130, 136, 192, 576, "float32"),
    "r5_w64_f16": (2, 5, 8, 64, 64, "float16"),
}


def _rows_query(name):
    """Rows at mixed magnitudes; a row with a NaN, one with an Inf, a row of zeros, a tiny row,
    negative entries far below their row's largest (e4m3 -0)."""
    bs, m, _, _, w, dt = ROW_CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q = rng.standard_normal((bs, m, w)) * np.exp(rng.uniform(-3, 6, (bs, m, 1)))
    q[..., 3] = -np.abs(q[..., 3]) * 2.0**-24
    q[0, 1, 5], q[-1, -1, 0], q[0, 2] = np.nan, np.inf, 0.0
    q[-1, 0] *= 1e-4
    return q.astype(dt)


def _rows_oracle(q, m8, tile_rows):
    import ml_dtypes

    q = np.asarray(q, np.float64)
    bs, m, w = q.shape
    q8 = np.zeros((bs, m8, w), np.float32)
    factor = np.ones((bs, tile_rows))
    for b in range(bs):
        for r in range(m):
            x = q[b, r]
            if not np.isfinite(x).all():
                q8[b, r] = np.nan
                continue
            amax, e = np.abs(x).max(), 0
            if amax:
                e = min(126, int(np.floor(np.log2(448.0 / amax))))
                while amax * 2.0 ** (e + 1) <= 448.0 and e < 126:
                    e += 1
                while amax * 2.0**e > 448.0:
                    e -= 1
            q8[b, r] = np.clip(x * 2.0**e, -448, 448)
            factor[b, r] = 2.0**-e
    return q8.astype(ml_dtypes.float8_e4m3fn), factor


def _check_rows(name, q8, factor):
    bs, m, m8, tile_rows, w, dt = ROW_CASES[name]
    ref_q8, ref_f = _rows_oracle(_rows_query(name), m8, tile_rows)
    got = _bytes(q8)
    nan_rows = np.isnan(ref_q8.astype(np.float32)).any(axis=-1)
    # a NaN row: every byte an e4m3 NaN (0x7F or 0xFF), whatever its sign
    assert ((got[nan_rows] & 0x7F) == 0x7F).all()
    np.testing.assert_array_equal(got[~nan_rows], _bytes(ref_q8)[~nan_rows])
    np.testing.assert_array_equal(np.asarray(factor, np.float64), ref_f)


@pytest.mark.parametrize("name", list(ROW_CASES))
def test_rows_xla_ops_match_float64(name):
    bs, m, m8, tile_rows, w, dt = ROW_CASES[name]
    _check_rows(name, *e4m3_query.query_rows_e4m3(jnp.asarray(_rows_query(name)), m8, tile_rows, use_kernel=False))


def run_rows_interpreted(name: str, path: str) -> None:
    """Run in a TRITON_INTERPRET=1 process: the rows kernel on torch CPU tensors, twice."""
    import torch

    from jattn.pallas_kernels import triton_glue

    bs, m, m8, tile_rows, w, dt = ROW_CASES[name]
    q = _rows_query(name)
    grid, params, _ = e4m3_query.rows_launch(q.shape, m8, tile_rows)
    runs = []
    for i64 in (params["I64"], True):  # the second run: the int64 offsets of huge batches, same result
        q8 = torch.full((bs, m8, w), 0x55, dtype=torch.uint8).view(
            torch.float8_e4m3fn
        )  # not NaN: the NaN rows are written
        factor = torch.full((bs, tile_rows), float("nan"), dtype=torch.float32)
        kw = {**params, "I64": i64}
        triton_glue.launch_interpreted(e4m3_query._rows_kernel, grid, torch.from_numpy(q), q8, factor, **kw)
        runs.append((q8.view(torch.uint8).numpy(), factor.numpy()))
    np.savez(path, q8=runs[0][0], factor=runs[0][1], q8b=runs[1][0])


@pytest.mark.parametrize("name", list(ROW_CASES))
def test_rows_kernel_interpreted(name, interpreted):
    res = interpreted[name]
    _check_rows(name, res["q8"], res["factor"])
    np.testing.assert_array_equal(res["q8"], res["q8b"])
    bs, m, m8, tile_rows, w, dt = ROW_CASES[name]
    xla = e4m3_query.query_rows_e4m3(jnp.asarray(_rows_query(name)), m8, tile_rows, use_kernel=False)
    finite = ~np.isnan(np.asarray(xla[0]).astype(np.float32))
    np.testing.assert_array_equal(res["q8"][finite], _bytes(xla[0])[finite])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ROW_CASES))
def test_gpu_rows_kernel_matches_xla(name):
    if not e4m3_query._kernel_runs_here(64, 16):
        pytest.skip("needs a CUDA GPU with jax-triton")
    bs, m, m8, tile_rows, w, dt = ROW_CASES[name]
    q = jnp.asarray(_rows_query(name).astype(np.float32)).astype(jnp.bfloat16)
    got = jax.jit(lambda x: e4m3_query.query_rows_e4m3(x, m8, tile_rows))(q)
    want = e4m3_query.query_rows_e4m3(q, m8, tile_rows, use_kernel=False)
    finite = ~np.isnan(np.asarray(want[0]).astype(np.float32))
    np.testing.assert_array_equal(np.isnan(np.asarray(got[0]).astype(np.float32)), ~finite)
    np.testing.assert_array_equal(_bytes(got[0])[finite], _bytes(want[0])[finite])
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_launches_switch_to_int64_offsets_past_int32():
    """The kernels' offsets go to int64 where an input or output passes 2^31 - 1 elements
    (FP8 MHA decode with 32 KV heads of group 1 at d128 from 32,768 requests: the tiles pad
    each head's row to 16; MLA rows of 128 heads x 576 from about 29,000 requests)."""
    _, p = e4m3_query.tiles_launch((32767, 32, 128), 32, 1, 1, 16)
    assert not p["I64"]
    _, p = e4m3_query.tiles_launch((32768, 32, 128), 32, 1, 1, 16)
    assert p["I64"]
    assert not e4m3_query.rows_launch((1000, 128, 576), 128, 128)[1]["I64"]
    assert e4m3_query.rows_launch((30000, 128, 576), 128, 128)[1]["I64"]
