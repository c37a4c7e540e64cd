"""The split-KV merge (``jattn.pallas_kernels.combine``) and the two-state merge
(``jattn.pallas_kernels.merge_state``, ``attn_merge_state``) against float64 merges.

Three runs of the same cases: the Triton kernel's source under Triton's CPU
interpreter on torch tensors (a subprocess with ``TRITON_INTERPRET=1``, which
Triton reads at import), the XLA ops on the CPU, and the kernel through
jax-triton on a GPU (marker ``gpu``). Inputs are fresh random draws; rows past
the query rows are NaN (never read), some splits and one whole row are empty, and
one case of each has no rows at all (empty outputs).
"""

from __future__ import annotations

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import run_in_interpreter
from naive import merge_state as merge_state_f64

from jattn.pallas_kernels import combine, merge_state

# (splits, bs, rows, m_rows, head_dim, num_q_heads, sinks, v_scale, partial dtype)
CASES = {
    "two_splits": (2, 3, 32, 32, 128, 32, False, None, "float32"),
    "33_splits_rows_padded_fp16": (33, 2, 16, 9, 64, 9, True, 0.61, "float16"),
    "132_splits_batch1": (132, 1, 32, 32, 128, 32, False, None, "float32"),
    "d256_sinks": (5, 4, 64, 64, 256, 16, True, None, "float32"),
    "300_splits_two_chunks": (300, 1, 8, 8, 64, 8, True, 2.0, "float16"),
    "batch0_sinks": (3, 0, 16, 16, 64, 16, True, None, "float32"),  # no rows: empty outputs
}


# The per-KV-head kernel's layout (combine.HeadsLayout), read in place:
# (splits, bs, kv_heads, group, q_len, width, tiles, head_dim, nan rows, v_scale)
HEADS_CASES = {
    "heads_q1_g4_w16_nan": (33, 2, 2, 4, 1, 16, 1, 64, True, None),
    "heads_q5_g4_two_tiles": (3, 2, 2, 4, 5, 16, 2, 128, True, 0.75),
    "heads_latent_h16_q2": (5, 1, 1, 16, 2, 32, 1, 512, False, None),
    "heads_one_split_nan": (1, 3, 2, 2, 3, 16, 1, 64, True, None),
    # column blocks narrower than D (several programs per row): MLA at batch 1, a long verify
    "heads_latent_132_splits": (132, 1, 1, 16, 2, 32, 1, 512, True, None),
    "heads_q8_100_splits_two_tiles": (100, 2, 2, 4, 8, 16, 2, 128, True, 1.5),
    "heads_q8_g8_w64_65_splits": (65, 1, 2, 8, 8, 64, 1, 128, True, None),  # two chunks of 64
    "heads_mqa_264_splits": (264, 1, 1, 4, 1, 16, 1, 64, True, None),  # two chunks of 256
}


def _heads_inputs(name):
    """Heads-layout partials (padding columns NaN), their rows-layout twins built by
    explicit loops, and the NaN-row flags in both layouts."""
    splits, bs, hkv, g, q_len, n, tiles, d, nan, v_scale = HEADS_CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    o = rng.standard_normal((splits, bs, hkv, tiles, d, n)).astype(np.float32)
    lse = (rng.standard_normal((splits, bs, hkv, tiles, n)) * 4).astype(np.float32)
    flags = rng.random((bs, hkv, tiles, n)) < 0.3 if nan else np.zeros((bs, hkv, tiles, n), bool)
    hq, m = hkv * g, q_len * hkv * g
    o_rows = np.full((splits, bs, m, d), np.nan, np.float32)
    lse_rows = np.full((splits, bs, m), np.nan, np.float32)
    flag_rows = np.zeros((bs, m), bool)
    for i in range(q_len):
        for h in range(hkv):
            for j in range(g):
                r, k = i * hq + h * g + j, i * g + j
                t, c = divmod(k, n)
                o_rows[:, :, r] = o[:, :, h, t, :, c]
                lse_rows[:, :, r] = lse[:, :, h, t, c]
                flag_rows[:, r] = flags[:, h, t, c]
    used = np.zeros((hkv, tiles, n), bool)
    used.reshape(hkv, -1)[:, : q_len * g] = True
    o = np.where(used[:, :, None, :], o, np.float32(np.nan))  # padding columns are never read
    lse = np.where(used, lse, np.float32(np.nan))
    lse[-1] += 12.0  # the last split dominates: a kernel's later chunk of splits rescales the earlier
    lse_rows[-1] += 12.0
    lse[::2, :1] = -np.inf  # empty splits (first request)
    lse_rows[::2, :1] = -np.inf
    lse[:, -1, 0, 0, 0] = -np.inf  # query 0, head 0 of the last request sees no key
    lse_rows[:, -1, 0] = -np.inf
    flag_rows[-1, 0] = flags[-1, 0, 0, 0] = True  # ... and is flagged: it stays 0 / -inf
    # an empty split's output is never read by a merge; one split is final: its kernel writes 0
    fill = np.float32(np.nan if splits > 1 else 0)
    o = np.where(np.isneginf(lse)[..., None, :], fill, o)
    o_rows = np.where(np.isneginf(lse_rows)[..., None], fill, o_rows)
    return o, lse, flags, o_rows, lse_rows, flag_rows, q_len, hq, v_scale


def _heads_expected(name):
    *_, o_rows, lse_rows, flag_rows, q_len, hq, v_scale = _heads_inputs(name)
    ref, ref_lse = _merge_ref(o_rows, lse_rows, q_len * hq, None, v_scale, hq)
    bad = flag_rows & np.isfinite(ref_lse)
    return np.where(bad[..., None], np.nan, ref), np.where(bad, np.nan, ref_lse)


def _compare_heads(name, out, lse_out):
    ref, ref_lse = _heads_expected(name)
    out, lse_out = (
        np.asarray(out, np.float64).reshape(ref.shape),
        np.asarray(lse_out, np.float64).reshape(ref_lse.shape),
    )
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))  # flagged rows that saw a key, and only those
    np.testing.assert_allclose(np.nan_to_num(out), np.nan_to_num(ref), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.isnan(lse_out), np.isnan(ref_lse))
    np.testing.assert_array_equal(np.isneginf(lse_out), np.isneginf(ref_lse))
    np.testing.assert_array_equal(np.isnan(lse_out), np.isnan(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse_out[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)


def _heads_layout(name):
    splits, bs, hkv, g, q_len, n, tiles, d, nan, v_scale = HEADS_CASES[name]
    return combine.HeadsLayout(kv_heads=hkv, group=g, width=n, tiles=tiles)


# attn_merge_state: (tokens, heads, head_dim, dtype of o_a, dtype of o_b)
MERGE_CASES = {
    "t97_h3_d128_f32": (97, 3, 128, "float32", "float32"),
    "t1_h8_d192_fp16": (1, 8, 192, "float16", "float16"),
    "t33_h5_d96_f16_f32": (33, 5, 96, "float16", "float32"),
    "t300_h4_d512_f32": (300, 4, 512, "float32", "float32"),
    "t0_h3_d128_f32": (0, 3, 128, "float32", "float32"),  # no rows: empty outputs
}


def _merge_inputs(name):
    """Random partial states; some rows empty on one side, one row empty on both."""
    t, h, d, da, db = MERGE_CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    o_a = rng.standard_normal((t, h, d)).astype(da)
    o_b = rng.standard_normal((t, h, d)).astype(db)
    lse_a = (rng.standard_normal((t, h)) * 4).astype(np.float32)
    lse_b = (rng.standard_normal((t, h)) * 4).astype(np.float32)
    lse_a[::4, 0] = -np.inf  # only b has keys
    lse_b[1::5, -1] = -np.inf  # only a has keys
    lse_a[-1:, :], lse_b[-1:, :] = -np.inf, -np.inf  # neither: o = 0, lse = -inf
    o_a[-1:], o_b[-1:] = np.nan, np.inf  # ... whatever the empty states' o hold
    lse_b[::7, h // 2] += 30.0  # one side dominates
    if t > 4 and h > 1:  # a NaN state: NaN out and LSE, also beside an empty other side
        lse_a[2, 1], lse_a[3, 1], lse_b[3, 1] = np.nan, np.nan, -np.inf
    return o_a, lse_a, o_b, lse_b


def _compare_merge(name, out, lse_out, atol):
    o_a, lse_a, o_b, lse_b = _merge_inputs(name)
    ref, ref_lse = merge_state_f64(o_a, lse_a, o_b, lse_b)
    out, lse_out = np.asarray(out, np.float64), np.asarray(lse_out, np.float64)
    assert out.shape == ref.shape and lse_out.shape == ref_lse.shape
    np.testing.assert_allclose(out, ref, atol=atol, rtol=atol)
    np.testing.assert_array_equal(np.isneginf(lse_out), np.isneginf(ref_lse))
    np.testing.assert_array_equal(np.isnan(lse_out), np.isnan(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse_out[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
    assert np.all(out[-1:] == 0)  # the row with no keys on either side


def _inputs(name):
    splits, bs, rows, m, d, hq, sinks, v_scale, dt = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # same draw in the subprocess
    o = rng.standard_normal((splits, bs, rows, d)).astype(dt)
    lse = (rng.standard_normal((splits, bs, rows)) * 4).astype(np.float32)
    lse[::3, :1] = -np.inf  # empty splits
    lse[:, -1:, min(1, m - 1)] = -np.inf  # a row with no keys at all
    o[:, :, m:] = np.nan  # rows past m are never read
    o[np.isneginf(lse)] = np.nan  # nor are the outputs of empty splits
    sk = (rng.standard_normal(hq) * 2).astype(np.float32) if sinks else None
    return o, lse, sk, v_scale, m, hq


def _merge_ref(o, lse, m, sinks, v_scale, hq):
    """float64 merge, as the module docstring states it."""
    lse = np.asarray(lse, np.float64)[:, :, :m]
    o = np.where(np.isneginf(lse)[..., None], 0.0, np.asarray(o, np.float64)[:, :, :m])  # weight 0
    mx = lse.max(0)
    mxs = np.where(np.isneginf(mx), 0.0, mx)
    w = np.exp2(lse - mxs)
    ws = w.sum(0)
    empty = ws == 0
    out = (w[..., None] * o).sum(0) / np.where(empty, 1.0, ws)[..., None]
    lse_n = np.where(empty, -np.inf, (mxs + np.log2(np.where(empty, 1.0, ws))) * np.log(2.0))
    if sinks is not None:
        s = np.asarray(sinks, np.float64)[np.arange(m) % hq][None]
        out = out * np.where(empty, 1.0, 1.0 / (1.0 + np.exp(s - lse_n)))[..., None]
    if v_scale is not None:
        out = out * v_scale
    return out, lse_n


def _compare(name, out, lse_out, atol):
    o, lse, sk, v_scale, m, hq = _inputs(name)
    ref, ref_lse = _merge_ref(o, lse, m, sk, v_scale, hq)
    out, lse_out = np.asarray(out, np.float64), np.asarray(lse_out, np.float64)
    assert out.shape == ref.shape and lse_out.shape == ref_lse.shape
    assert not np.isnan(out).any(), "NaN from rows past m leaked"
    np.testing.assert_allclose(out, ref, atol=atol, rtol=atol)
    np.testing.assert_array_equal(np.isneginf(lse_out), np.isneginf(ref_lse))
    np.testing.assert_array_equal(np.isnan(lse_out), np.isnan(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse_out[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
    assert np.all(out[-1:, min(1, m - 1)] == 0)  # the row with no keys


# ---------------------------------------------------------------------------
# Triton kernel source under Triton's interpreter (CPU, torch tensors).
def _launch_twice(path, kernel, grid, inputs, bs, m, d, **constexprs) -> None:
    """``kernel`` under Triton's interpreter on torch CPU tensors, twice, its outputs
    ``[bs, m, d]`` / ``[bs, m]`` NaN-poisoned before each run; both runs saved to ``path``."""
    import torch

    from jattn.pallas_kernels import triton_glue

    runs = []
    for _ in range(2):
        out = torch.full((bs, m, d), float("nan"), dtype=torch.float32)
        lse_out = torch.full((bs, m), float("nan"), dtype=torch.float32)
        triton_glue.launch_interpreted(kernel, grid, *[torch.from_numpy(x) for x in inputs], out, lse_out, **constexprs)
        runs.append((out.numpy(), lse_out.numpy()))
    np.savez(path, out=runs[0][0], lse=runs[0][1], out2=runs[1][0], lse2=runs[1][1])


def run_interpreted(name: str, path: str) -> None:
    """Run in a TRITON_INTERPRET=1 process: the kernel on torch CPU tensors, twice;
    outputs saved to ``path``."""
    o, lse, sk, v_scale, m, hq = _inputs(name)
    splits, bs, rows, d = o.shape
    grid, params = combine.combine_launch_params(splits, bs, m, d)
    sk = sk if sk is not None else np.zeros(hq, np.float32)
    vs = np.array([1.0 if v_scale is None else v_scale], np.float32)
    _launch_twice(
        path, combine._combine_kernel, grid, (lse, o, sk, vs), bs, m, d,
        NUM_SPLITS=splits, BS=bs, ROWS=rows, ROWS_LSE=rows, M_ROWS=m, D=d, HQ=hq,
        HAS_SINKS=CASES[name][6], HAS_VSCALE=v_scale is not None, **params,
    )  # fmt: skip


def run_heads_interpreted(name: str, path: str) -> None:
    """Like :func:`run_interpreted`, for the heads-layout kernel with NaN-row flags."""
    o, lse, flags, _, _, _, q_len, hq, v_scale = _heads_inputs(name)
    splits, bs, d = o.shape[0], o.shape[1], o.shape[4]
    grid, params, _ = combine.heads_launch_params(splits, _heads_layout(name), bs, q_len, d)
    vs = np.array([1.0 if v_scale is None else v_scale], np.float32)
    _launch_twice(
        path, combine._combine_heads_kernel, grid, (lse, o, vs, flags.astype(np.int8)), bs, q_len * hq, d,
        HAS_VSCALE=v_scale is not None, HAS_NAN_ROWS=True, **params,
    )  # fmt: skip


def run_merge_interpreted(name: str, path: str) -> None:
    """Like :func:`run_interpreted`, for the two-state merge kernel (outputs NaN-poisoned
    before the run, so a row the kernel skips fails the comparison)."""
    import torch

    from jattn.pallas_kernels import triton_glue

    o_a, lse_a, o_b, lse_b = _merge_inputs(name)
    t, h, d = o_a.shape
    grid, params = merge_state.merge_launch_params(t * h, d)
    runs = []
    for _ in range(2):
        out = torch.full((t * h, d), float("nan"), dtype=torch.float32)
        lse_out = torch.full((t * h,), float("nan"), dtype=torch.float32)
        triton_glue.launch_interpreted(
            merge_state._merge_kernel,
            grid,
            torch.from_numpy(o_a.astype(np.float32).reshape(t * h, d)),
            torch.from_numpy(lse_a.reshape(t * h)),
            torch.from_numpy(o_b.astype(np.float32).reshape(t * h, d)),
            torch.from_numpy(lse_b.reshape(t * h)),
            out,
            lse_out,
            **params,
        )
        runs.append((out.numpy().reshape(t, h, d), lse_out.numpy().reshape(t, h)))
    np.savez(path, out=runs[0][0], lse=runs[0][1], out2=runs[1][0], lse2=runs[1][1])


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_in_interpreter(
        tmp_path_factory,
        "test_combine",
        {
            "run_interpreted": list(CASES),
            "run_merge_interpreted": list(MERGE_CASES),
            "run_heads_interpreted": list(HEADS_CASES),
        },
    )


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_interpreted_matches_float64(name, interpreted):
    res = interpreted[name]
    _compare(name, res["out"], res["lse"], atol=2e-5)
    # deterministic: a second run is bit-identical
    np.testing.assert_array_equal(res["out"], res["out2"])
    np.testing.assert_array_equal(res["lse"], res["lse2"])


@pytest.mark.parametrize("name", list(HEADS_CASES))
def test_triton_kernel_interpreted_reads_heads_layout(name, interpreted):
    res = interpreted[name]
    _compare_heads(name, res["out"], res["lse"])
    np.testing.assert_array_equal(res["out"], res["out2"])
    np.testing.assert_array_equal(res["lse"], res["lse2"])


@pytest.mark.parametrize("name", list(HEADS_CASES))
@pytest.mark.parametrize("use_kernel", [False, True])
def test_combine_splits_heads_layout(name, use_kernel):
    """``combine_splits(heads=..., nan_rows=...)``: XLA ops here (the layout moved to rows
    first); the Triton kernel reading it in place on a GPU with jax-triton."""
    o, lse, flags, *_, q_len, hq, v_scale = _heads_inputs(name)
    out, lse_out = combine.combine_splits(
        jnp.asarray(o),
        jnp.asarray(lse),
        q_len=q_len,
        num_q_heads=hq,
        sinks=None,
        v_scale=v_scale,
        out_dtype=jnp.float32,
        use_kernel=use_kernel,
        heads=_heads_layout(name),
        nan_rows=jnp.asarray(flags),
    )
    assert out.shape == (o.shape[1] * q_len, hq, o.shape[4]) and lse_out.shape == out.shape[:2]
    _compare_heads(name, out, lse_out)


@pytest.mark.parametrize("splits", [1, 3])
def test_combine_splits_heads_layout_with_no_requests(splits):
    """An empty batch in the heads layout: empty outputs of the usual shapes (the layout
    change reshaped with a -1, ambiguous on a zero-size axis, and raised)."""
    heads = combine.HeadsLayout(kv_heads=2, group=4, width=16, tiles=1)
    out, lse = combine.combine_splits(
        jnp.zeros((splits, 0, 2, 1, 64, 16)),
        jnp.zeros((splits, 0, 2, 1, 16)),
        q_len=1,
        num_q_heads=8,
        sinks=None,
        v_scale=None,
        out_dtype=jnp.float16,
        use_kernel=True,
        heads=heads,
        nan_rows=jnp.zeros((0, 2, 1, 16), jnp.int8),
    )
    assert (out.shape, out.dtype, lse.shape) == ((0, 8, 64), jnp.float16, (0, 8))


@pytest.mark.parametrize("name", list(MERGE_CASES))
def test_merge_kernel_interpreted_matches_float64(name, interpreted):
    res = interpreted[name]
    _compare_merge(name, res["out"], res["lse"], atol=2e-5)
    np.testing.assert_array_equal(res["out"], res["out2"])
    np.testing.assert_array_equal(res["lse"], res["lse2"])


def test_merge_launch_params():
    # whole rows per program, 4096 elements: 32 rows of 128; d 96 pads to 128 columns
    assert merge_state.merge_launch_params(1000, 128) == ((32,), dict(R=1000, D=128, DP=128, BLOCK_R=32))
    assert merge_state.merge_launch_params(3, 96) == ((1,), dict(R=3, D=96, DP=128, BLOCK_R=4))
    assert merge_state.merge_launch_params(10, 512)[0] == (2,)


@pytest.mark.parametrize("backend", [None, "xla", "triton"])
@pytest.mark.parametrize("name", list(MERGE_CASES))
def test_attn_merge_state_matches_float64(name, backend):
    """The op on each backend that runs here (triton: a GPU with jax-triton)."""
    import jattn

    if backend == "triton" and not merge_state.kernel_runs_here():
        pytest.skip("the triton merge needs a CUDA GPU with jax-triton")
    o_a, lse_a, o_b, lse_b = _merge_inputs(name)
    out, lse_out = jattn.attn_merge_state(*map(jnp.asarray, (o_a, lse_a, o_b, lse_b)), backend=backend)
    assert out.dtype == o_a.dtype and lse_out.dtype == jnp.float32
    _compare_merge(name, out, lse_out, atol=2e-3 if o_a.dtype == np.float16 else 2e-5)


def test_attn_merge_state_backends():
    import jattn
    from jattn.ops import op_backend

    x, lse = jnp.ones((2, 1, 8)), jnp.zeros((2, 1))
    with pytest.raises(NotImplementedError, match="no mosaic kernel"):
        jattn.attn_merge_state(x, lse, x, lse, backend="mosaic")
    assert op_backend("attn_merge_state") == ("xla", None)  # auto: XLA's fusion (measured faster)
    if merge_state.kernel_runs_here():
        assert op_backend("attn_merge_state", "triton") == ("triton", None)
    else:
        with pytest.raises(NotImplementedError, match="needs a CUDA GPU with jax-triton"):
            jattn.attn_merge_state(x, lse, x, lse, backend="triton")
        assert op_backend("attn_merge_state", "triton")[0] == "xla"


def test_merge_state_launch_from_jax(monkeypatch):
    """``merge_state``'s host code with the launch stubbed (the XLA merge of the flattened
    operands): the flattened ``(token, head)`` rows and f32 LSEs it passes, the grid and
    constants of :func:`merge_state.merge_launch_params`, o_a's dtype out, the shapes put
    back; no launch with ``use_kernel=False`` or with nothing to merge."""
    from jattn import reference
    from jattn.pallas_kernels import triton_glue

    calls = []

    def fake_call(fn, o_a, lse_a, o_b, lse_b, *, out_shape, grid, name, **kw):
        assert fn is merge_state._merge_kernel and lse_a.dtype == lse_b.dtype == jnp.float32
        calls.append((grid, {k: kw[k] for k in ("R", "D", "DP", "BLOCK_R")}))
        o, lse = reference.attn_merge_state(o_a[:, None], lse_a[:, None], o_b[:, None], lse_b[:, None])
        assert [s.shape for s in out_shape] == [o_a.shape, lse_a.shape]
        return o.astype(out_shape[0].dtype)[:, 0], lse[:, 0].astype(out_shape[1].dtype)

    monkeypatch.setattr(triton_glue, "triton_call", fake_call)
    monkeypatch.setattr(merge_state, "kernel_runs_here", lambda: True)
    o_a, lse_a, o_b, lse_b = _merge_inputs("t33_h5_d96_f16_f32")
    o, lse = merge_state.merge_state(jnp.asarray(o_a), jnp.asarray(lse_a, jnp.bfloat16), jnp.asarray(o_b), lse_b)
    assert calls == [merge_state.merge_launch_params(33 * 5, 96)]
    assert o.dtype == jnp.float16 and o.shape == (33, 5, 96) and lse.dtype == jnp.float32 and lse.shape == (33, 5)
    want, want_lse = merge_state_f64(o_a, np.asarray(jnp.asarray(lse_a, jnp.bfloat16), np.float32), o_b, lse_b)
    np.testing.assert_allclose(np.asarray(o, np.float32), want, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5, rtol=1e-5)
    merge_state.merge_state(jnp.asarray(o_a), lse_a, jnp.asarray(o_b), lse_b, use_kernel=False)
    merge_state.merge_state(*(jnp.asarray(a) for a in _merge_inputs("t0_h3_d128_f32")))
    assert len(calls) == 1


def test_launch_interpreted_refuses_without_the_env(monkeypatch):
    from jattn.pallas_kernels import triton_glue

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_glue.launch_interpreted(combine._combine_kernel, (1,))


# ---------------------------------------------------------------------------
# XLA ops (and the dispatcher) on whatever JAX runs on.
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("use_kernel", [False, True])
def test_combine_splits_matches_float64(name, use_kernel):
    """``combine_splits``: XLA ops on the CPU whatever ``use_kernel`` says; on a GPU
    with jax-triton, ``use_kernel=True`` is the Triton kernel."""
    o, lse, sk, v_scale, m, hq = _inputs(name)
    splits, bs, rows, d = o.shape
    out, lse_out = combine.combine_splits(
        jnp.asarray(o),
        jnp.asarray(lse),
        q_len=m // hq,
        num_q_heads=hq,
        sinks=None if sk is None else jnp.asarray(sk),
        v_scale=v_scale,
        out_dtype=jnp.float32,
        use_kernel=use_kernel,
    )
    assert out.shape == (bs * (m // hq), hq, d) and lse_out.shape == (bs * (m // hq), hq)
    _compare(name, np.asarray(out).reshape(bs, m, d), np.asarray(lse_out).reshape(bs, m), atol=2e-5)


@pytest.mark.parametrize("sinks,v_scale", [(False, None), (True, 0.5)])
def test_one_split_is_final_up_to_sinks_and_v_scale(sinks, v_scale):
    rng = np.random.default_rng(7)
    hq, q_len, bs, d = 4, 2, 3, 64
    o = rng.standard_normal((1, bs, 16, d)).astype(np.float32)
    lse = (rng.standard_normal((1, bs, 16)) * 3).astype(np.float32)
    lse[0, 1, :] = -np.inf
    o[0, 1] = 0.0  # the kernel writes 0 for a row with no keys
    o[:, :, q_len * hq :] = np.nan
    sk = (rng.standard_normal(hq)).astype(np.float32) if sinks else None
    out, lse_out = combine.combine_splits(
        jnp.asarray(o),
        jnp.asarray(lse),
        q_len=q_len,
        num_q_heads=hq,
        sinks=None if sk is None else jnp.asarray(sk),
        v_scale=v_scale,
        out_dtype=jnp.float32,
        use_kernel=True,
    )
    ref, ref_lse = _merge_ref(o, lse, q_len * hq, sk, v_scale, hq)
    np.testing.assert_allclose(np.asarray(out).reshape(ref.shape), ref, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse_out).reshape(ref_lse.shape)), np.isneginf(ref_lse))


def test_heads_launch_params():
    """Every shape the per-KV-head decode can send: power-of-two chunks and column blocks
    that divide D, at most 8192 elements a program and 64 a thread, one grid row per item."""
    for d in (64, 128, 512):
        for width in (16, 32, 64):
            for tiles, q_len in ((1, 1), (2, 4), (4, 8)):
                for splits in (1, 2, 3, 33, 64, 65, 132, 257, 264, 600):
                    heads = combine.HeadsLayout(kv_heads=2, group=4, width=width, tiles=tiles)
                    grid, p, warps = combine.heads_launch_params(splits, heads, 3, q_len, d)
                    chunk, dc = p["CHUNK"], p["DC"]
                    assert chunk & (chunk - 1) == 0 and dc & (dc - 1) == 0 and d % dc == 0 and dc >= 2
                    assert chunk * dc * width <= 8192 and 1 <= warps <= 4
                    assert chunk * dc * width <= 64 * 32 * warps
                    assert grid == (3 * 2 * tiles, d // dc)
    with pytest.raises(ValueError, match="powers of two"):
        combine.heads_launch_params(4, combine.HeadsLayout(1, 4, 16, 1), 1, 1, 96)


def test_launch_params():
    with pytest.raises(ValueError, match="head_dim=96"):
        combine.combine_launch_params(4, 1, 8, 96)
    # batch 1 on 132 splits: one round of 256 splits, 4 column blocks of 32
    assert combine.combine_launch_params(132, 1, 32, 128) == ((1, 32, 4), dict(CHUNK=256, DC=32))
    # 2 splits: whole rows per program
    assert combine.combine_launch_params(2, 64, 32, 128) == ((64, 32, 1), dict(CHUNK=2, DC=128))
    # past 256 splits: chunks of 256
    assert combine.combine_launch_params(300, 1, 8, 64)[1] == dict(CHUNK=256, DC=32)


def test_nothing_imports_pallas_triton():
    """No Python file of the repository imports Pallas's Triton lowering
    (``jax.experimental.pallas.triton``, deprecated since JAX 0.11)."""
    import ast

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bad = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [x for x in dirnames if not x.startswith(".") and x != "build"]
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                else:
                    continue
                if any(
                    n == "jax.experimental.pallas.triton" or n.startswith("jax.experimental.pallas.triton.")
                    for n in names
                ):
                    bad.append(f"{os.path.relpath(path, root)}:{node.lineno}")
    assert not bad, bad


# ---------------------------------------------------------------------------
# GPU: the kernel through jax-triton.
@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][1]])  # batch 0: the CPU runs
def test_gpu_triton_combine_matches_float64(name):
    from jattn.pallas_kernels import triton_glue

    if not triton_glue.available():
        pytest.skip("jax-triton not installed here")
    o, lse, sk, v_scale, m, hq = _inputs(name)
    splits, bs, rows, d = o.shape
    f = jax.jit(
        lambda o, lse, sk: combine._combine_triton(
            o,
            lse,
            sk,
            v_scale,
            None,
            m_rows=m,
            num_q_heads=hq,
            out_dtype=jnp.dtype(jnp.float32),
            heads=None,
            q_len=m // hq,
        )  # fmt: skip
    )
    args = (jnp.asarray(o), jnp.asarray(lse), None if sk is None else jnp.asarray(sk))
    out, lse_out = f(*args)
    _compare(name, out, lse_out, atol=2e-5)
    out2, lse2 = f(*args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
    assert "triton_kernel_call" in f.lower(*args).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in MERGE_CASES if MERGE_CASES[n][0]])  # t=0 never launches it
def test_gpu_triton_merge_matches_float64(name):
    if not merge_state.kernel_runs_here():
        pytest.skip("jax-triton not installed here")
    args = tuple(map(jnp.asarray, _merge_inputs(name)))
    f = jax.jit(merge_state.merge_state)
    out, lse_out = f(*args)
    _compare_merge(name, out, lse_out, atol=2e-3 if args[0].dtype == jnp.float16 else 2e-5)
    out2, lse2 = f(*args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
    np.testing.assert_array_equal(np.asarray(lse_out), np.asarray(lse2))
    assert "triton_kernel_call" in f.lower(*args).as_text()
