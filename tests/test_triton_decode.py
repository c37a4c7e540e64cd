"""The Triton paged decode kernel (``jattn.pallas_kernels.triton_decode``).

CPU: the kernel source under Triton's interpreter on torch CPU tensors
(``jattn.bridge.triton_native``, a subprocess with ``TRITON_INTERPRET=1``; f16/f32, since the
interpreter's ``tl.dot`` is wrong on bf16), its split partials merged in float64
and compared with the float64 decode of ``tests/naive.py``. GPU (marker ``gpu``):
``jattn.mha_decode_with_kvcache(backend="triton")`` through jax-triton in bf16 and
FP8 against the f32 reference. Inputs are fresh random draws; unused pages and page
tails hold NaN, page tables are permuted, and poison cases put NaN in the V of a
draft token that earlier queries do not see. Eight more CPU cases are drawn at random from a
fixed seed (``random_cases``; ``JATTN_TRITON_FUZZ_SEED`` and ``JATTN_TRITON_FUZZ_CASES`` draw
others).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import assert_same_partials, merge_splits_f64, random_draw, run_in_interpreter
from naive import mha_decode as decode_f64

from jattn.pallas_kernels.interpret import on_gpu


@dataclasses.dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]
    hq: int = 8
    hkv: int = 2
    d: int = 64
    page_size: int = 16
    q_len: int = 1
    causal: bool = True
    window_left: int = -1
    logit_cap: float = 0.0
    num_splits: int | None = None
    poison: bool = False  # NaN in V of request 0's last token (seen only by its last query)
    hidden_nan: tuple[int, ...] = ()  # keys of request 0 with a NaN V that the window hides from every query
    dtype: str = "float32"
    v_scale: float = 1.0  # the bridge's native path (the split partials carry no v_scale)
    sinks: bool = False  # likewise


CASES = {
    "gqa4_lens_0_1_97_two_splits": Case(lens=(97, 0, 1, 40), num_splits=2),
    "verify_q3_causal_poison": Case(lens=(70, 33), hq=4, hkv=1, q_len=3, poison=True, page_size=32),
    "window_cap_fp16": Case(
        lens=(130, 5), hq=4, hkv=4, d=128, window_left=20, logit_cap=5.0, dtype="float16", sinks=True, v_scale=0.7
    ),
    "draft_block_noncausal": Case(lens=(50,), hq=2, hkv=2, q_len=4, causal=False, num_splits=3),
    # NaN V just outside the window (keys 100 and 108; the window starts at 109): no row
    # sees them, so none may come out non-finite (the window's edge block is cleaned)
    "window_hides_nan": Case(lens=(130, 5), hq=4, hkv=4, window_left=20, hidden_nan=(100, 108), num_splits=2),
    "window_hides_nan_q3": Case(lens=(130,), hq=4, hkv=2, q_len=3, window_left=20, hidden_nan=(100, 106)),
    # a window of 0 (each query sees only its own key) masks keys too
    "window0_hides_nan": Case(lens=(40,), hq=4, hkv=2, window_left=0, hidden_nan=(37,), num_splits=1),
}


def random_cases(seed: int, n: int) -> dict[str, Case]:
    """``n`` cases drawn from ``seed``: lengths at and around the page and block edges
    (0 and 1 among them), GQA groups, head sizes, query lengths, causal or not, a window,
    a logit cap, forced splits, sinks, ``v_scale`` and a poisoned token. The names carry
    the seed, so the interpreter's subprocess draws the same cases."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        q_len = int(rng.integers(1, 5))
        hkv = int(rng.choice((1, 2, 3)))
        lens = tuple(int(x) for x in rng.choice((0, 1, 2, 15, 16, 17, 33, 64, 97, 130), int(rng.integers(1, 4))))
        out[f"random_{seed}_{i}"] = Case(
            lens=lens,
            hq=hkv * int(rng.choice((1, 2, 4))),
            hkv=hkv,
            d=int(rng.choice((64, 64, 64, 128))),
            page_size=int(rng.choice((16, 32))),
            q_len=q_len,
            causal=bool(q_len == 1 or rng.random() < 0.7),
            window_left=int(rng.choice((3, 20, 40))) if rng.random() < 0.4 else -1,
            logit_cap=5.0 if rng.random() < 0.3 else 0.0,
            num_splits=None if rng.random() < 0.5 else int(rng.integers(1, 5)),
            poison=bool(lens[0] > 0 and rng.random() < 0.5),
            dtype=str(rng.choice(("float16", "float32"))),
            v_scale=float(rng.choice((1.0, 0.7))),
            sinks=bool(rng.random() < 0.3),
        )
    return out


CASES.update(random_cases(*random_draw()))


def _inputs(name):
    c = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    bs, ps = len(c.lens), c.page_size
    max_pages = max(1, max(-(-n // ps) for n in c.lens)) + 1
    num_pages = bs * max_pages + 2
    k = np.full((num_pages, ps, c.hkv, c.d), np.nan, np.float32)
    v = np.full((num_pages, ps, c.hkv, c.d), np.nan, np.float32)
    table = rng.permutation(num_pages)[: bs * max_pages].reshape(bs, max_pages).astype(np.int32)
    for b, n in enumerate(c.lens):
        for t in range(n):
            k[table[b, t // ps], t % ps] = rng.standard_normal((c.hkv, c.d))
            v[table[b, t // ps], t % ps] = rng.standard_normal((c.hkv, c.d))
        npg = -(-n // ps)
        table[b, npg:] = rng.integers(0, num_pages, max_pages - npg)  # never read
    q = rng.standard_normal((bs * c.q_len, c.hq, c.d)).astype(np.float32)
    k, v, q = k.astype(c.dtype), v.astype(c.dtype), q.astype(c.dtype)
    return c, q, k, v, table, np.asarray(c.lens, np.int32)


def _poisoned(c, v, table):
    """NaN in V of request 0's last token (with ``c.poison``) and of its ``c.hidden_nan``
    keys; the rows (of request 0) that see one (only the last token's can be seen)."""
    v = v.copy()
    for j in ((c.lens[0] - 1,) if c.poison else ()) + c.hidden_nan:
        v[table[0, j // c.page_size], j % c.page_size, :, 3] = np.nan
    sees = np.arange(c.q_len) == c.q_len - 1 if c.causal else np.ones(c.q_len, bool)
    return v, np.flatnonzero(sees) if c.poison else np.zeros(0, int)


def run_interpreted(name: str, path: str) -> None:
    """In a TRITON_INTERPRET=1 process: the kernel on torch CPU tensors, twice."""
    import torch

    from jattn.bridge import triton_native

    c, q, k, v, table, lens = _inputs(name)
    if c.poison or c.hidden_nan:
        v, _ = _poisoned(c, v, table)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    runs = []
    for _ in range(2):
        o, lse = triton_native.decode_partials(
            t(q),
            t(k),
            t(v),
            t(table),
            t(lens),
            max_seqlen_q=c.q_len,
            is_causal=c.causal,
            window_left=c.window_left,
            logit_cap=c.logit_cap,
            num_splits=c.num_splits,
        )
        runs.append((o.numpy(), lse.numpy()))
    # the bridge's native path: decode + combine launched on the torch tensors
    sk = torch.from_numpy(_sinks(name)) if c.sinks else None
    out, lse_n = triton_native.mha_decode(
        t(q),
        t(k),
        t(v),
        t(table),
        t(lens),
        max_seqlen_q=c.q_len,
        is_causal=c.causal,
        window_left=c.window_left,
        logit_cap=c.logit_cap,
        num_splits=c.num_splits,
        sinks=sk,
        v_scale=c.v_scale,
        return_lse=True,
    )
    np.savez(
        path, o=runs[0][0], lse=runs[0][1], o2=runs[1][0], lse2=runs[1][1], out=out.float().numpy(), lse_n=lse_n.numpy()
    )


def _sinks(name):
    return (np.random.default_rng(zlib.crc32(name.encode()) + 1).standard_normal(CASES[name].hq) * 2).astype(np.float32)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_in_interpreter(tmp_path_factory, "test_triton_decode", {"run_interpreted": list(CASES)})


def _expect(name):
    c, q, k, v, table, lens = _inputs(name)
    kw = dict(max_seqlen_q=c.q_len, is_causal=c.causal, window_left=c.window_left, logit_cap=c.logit_cap)
    want, want_lse = decode_f64(q, k, v, table, lens, **kw)  # on clean data
    bad = np.zeros(0, int)
    if c.poison or c.hidden_nan:
        _, bad = _poisoned(c, v, table)
    return c, want, want_lse, bad


def _compare(name, out, lse, atol):
    c, want, want_lse, bad = _expect(name)
    rows = np.setdiff1d(np.arange(out.shape[0]), bad)
    if bad.size:
        assert not np.isfinite(out[bad]).all(axis=(1, 2)).any(), "a row that sees a NaN V must be non-finite"
    assert np.isfinite(out[rows]).all(), "NaN/Inf leaked into a real row"
    np.testing.assert_allclose(out[rows], want[rows], atol=atol, rtol=atol)
    fin = np.isfinite(want_lse[rows])
    np.testing.assert_allclose(lse[rows][fin], want_lse[rows][fin], atol=atol, rtol=atol)
    empty = np.repeat(np.asarray(c.lens) == 0, c.q_len)
    assert (out[empty] == 0).all() and np.isneginf(lse[empty]).all()


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_float64(name, interpreted):
    res = interpreted[name]
    c = CASES[name]
    o, lse = merge_splits_f64(res["o"], res["lse"])  # [bs, q_len * hq, D]
    bs = len(c.lens)
    out = o.reshape(bs, c.q_len, c.hq, c.d).reshape(bs * c.q_len, c.hq, c.d)
    _compare(name, out, lse.reshape(bs * c.q_len, c.hq), atol=2e-2 if c.dtype == "float16" else 2e-4)
    assert_same_partials(res["o"], res["lse"], res["o2"], res["lse2"])  # deterministic


@pytest.mark.parametrize("name", list(CASES))
def test_bridge_native_path_equals_the_jax_path(name, interpreted):
    """``jattn.bridge.triton_native.mha_decode`` (decode + combine launched on torch tensors,
    sinks and v_scale in the combine) against ``jattn.mha_decode_with_kvcache`` on JAX."""
    import jattn

    res = interpreted[name]
    c, q, k, v, table, lens = _inputs(name)
    if c.poison or c.hidden_nan:
        v, bad = _poisoned(c, v, table)
    kw = dict(max_seqlen_q=c.q_len, is_causal=c.causal, window_left=c.window_left, logit_cap=c.logit_cap)
    sk = jnp.asarray(_sinks(name)) if c.sinks else None
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    want, want_lse = jattn.mha_decode_with_kvcache(
        f32(q),
        f32(k),
        f32(v),
        jnp.asarray(table),
        jnp.asarray(lens),
        sinks=sk,
        v_scale=c.v_scale,
        return_lse=True,
        backend="xla",
        **kw,
    )
    want, want_lse = np.asarray(want), np.asarray(want_lse)
    out, lse = res["out"], res["lse_n"]
    rows = np.setdiff1d(np.arange(out.shape[0]), bad if c.poison or c.hidden_nan else [])
    if c.poison or c.hidden_nan:
        assert not np.isfinite(out[bad]).all(axis=(1, 2)).any()
    tol = 2e-2 if c.dtype == "float16" else 2e-4
    np.testing.assert_allclose(out[rows], want[rows], atol=tol, rtol=tol)
    fin = np.isfinite(want_lse[rows])
    np.testing.assert_allclose(lse[rows][fin], want_lse[rows][fin], atol=tol, rtol=tol)


def test_bridge_native_path_names_the_bad_argument():
    torch = pytest.importorskip("torch")
    from jattn.bridge import BridgeError, triton_native

    q = torch.zeros((2, 4, 64))
    kc = torch.zeros((3, 16, 2, 64))
    pt, sl = torch.zeros((2, 2), dtype=torch.int32), torch.ones((2,), dtype=torch.int32)
    with pytest.raises(BridgeError, match="page_table.dtype=torch.int64"):
        triton_native.mha_decode(q, kc, kc, pt.long(), sl)
    with pytest.raises(BridgeError, match="k_cache with shape .* is not contiguous"):
        triton_native.mha_decode(q, kc.transpose(1, 2).contiguous().transpose(1, 2), kc, pt, sl)
    with pytest.raises(BridgeError, match=r"q has 2 rows; it must be batch \(2\) \* max_seqlen_q \(2\)"):
        triton_native.mha_decode(q, kc, kc, pt, sl, max_seqlen_q=2)
    with pytest.raises(BridgeError, match="v_cache.dtype=torch.float16"):
        triton_native.mha_decode(q, kc, kc.half(), pt, sl)
    with pytest.raises(BridgeError, match="TRITON_INTERPRET=1"):
        triton_native.mha_decode(q, kc, kc, pt, sl)


def test_launch_params():
    from jattn.pallas_kernels import triton_decode as td

    grid, p = td.launch_params(64, 32, 8, 128, 1, 4096)
    assert grid == (64, 8, 1) and p == dict(BLOCK_M=16, BLOCK_N=64, SPLITS=1)
    grid, p = td.launch_params(1, 32, 8, 128, 4, 32768)
    assert grid == (1, 8, 33) and p["BLOCK_M"] == 16
    assert td.launch_params(2, 64, 1, 256, 8, 512)[1] == dict(BLOCK_M=512, BLOCK_N=32, SPLITS=2)


def test_unsupported_reasons():
    from jattn.pallas_kernels import triton_decode as td

    q = jnp.zeros((2, 8, 128), jnp.bfloat16)
    kc = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
    assert td.unsupported_reason(q, kc, kc) is None
    assert td.unsupported_reason(q, kc.astype(jnp.float8_e4m3fn), kc.astype(jnp.float8_e4m3fn)) is None
    assert "head_dim=96" in td.unsupported_reason(q[..., :96], kc[..., :96], kc[..., :96])
    assert "max_seqlen_q=9" in td.unsupported_reason(q, kc, kc, max_seqlen_q=9)
    assert "cache dtype" in td.unsupported_reason(q, kc.astype(jnp.float16), kc.astype(jnp.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_matches_reference(name, fp8):
    """Through jax-triton in bf16 (the cases' shapes), and with an FP8 cache."""
    import jattn
    from jattn import reference
    from jattn.pallas_kernels import triton_glue

    if not on_gpu() or not triton_glue.available():
        pytest.skip("needs a GPU with jax-triton")
    c, q, k, v, table, lens = _inputs(name)
    if c.poison or c.hidden_nan:
        v, bad = _poisoned(c, v, table)
    kw = dict(
        max_seqlen_q=c.q_len, is_causal=c.causal, window_left=c.window_left, logit_cap=c.logit_cap, return_lse=True
    )
    kd = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    if fp8:  # scales other than 1, each on its own operand (K's in the kernel, V's in the combine)
        kw.update(k_scale=0.5, v_scale=0.7)
        k, v = k / 0.5, v / 0.7
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, kd), jnp.asarray(v, kd), jnp.asarray(table), jnp.asarray(lens))
    out, lse = jattn.mha_decode_with_kvcache(*args, backend="triton", **kw)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    want, want_lse = reference.mha_decode(f32(args[0]), f32(args[1]), f32(args[2]), args[3], args[4], **kw)
    out, want = np.asarray(out, np.float32), np.asarray(want)
    rows = np.setdiff1d(np.arange(out.shape[0]), bad if c.poison or c.hidden_nan else [])
    np.testing.assert_allclose(out[rows], want[rows], atol=4e-2, rtol=4e-2)
    np.testing.assert_allclose(np.asarray(lse)[rows], np.asarray(want_lse)[rows], atol=4e-2, rtol=4e-2)


@pytest.mark.gpu
def test_gpu_torch_launch_equals_jax_path_and_captures_in_a_cuda_graph():
    """The same source launched natively on torch CUDA tensors: its partials equal the
    jax-triton launch's (LSEs everywhere, outputs where a split had keys: an empty split's
    rows are left unwritten), and a torch CUDA graph of the launch replays to the same values."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    import jax

    from jattn.bridge import triton_native
    from jattn.pallas_kernels import triton_decode as td
    from jattn.pallas_kernels import triton_glue

    if not triton_glue.available():
        pytest.skip("needs jax-triton")
    name = "gqa4_lens_0_1_97_two_splits"
    c, q, k, v, table, lens = _inputs(name)
    dev = lambda a, dt=torch.bfloat16: torch.from_numpy(np.ascontiguousarray(a)).to("cuda", dt)  # noqa: E731
    tq, tk, tv = dev(q), dev(k), dev(v)
    tt, tl_ = dev(table, torch.int32), dev(lens, torch.int32)
    o, lse = triton_native.decode_partials(tq, tk, tv, tt, tl_, num_splits=2)
    torch.cuda.synchronize()
    grid, params = td.launch_params(len(c.lens), c.hq, c.hkv, c.d, 1, table.shape[1] * c.page_size, 2)
    jargs = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)] + [jnp.asarray(table), jnp.asarray(lens)]
    kw = td._constexprs(
        jargs[0], jargs[1], jargs[3], q_len=1, is_causal=True, window_left=-1, logit_cap=0.0, params=params
    )
    jo, jl = triton_glue.triton_call(
        td._decode_kernel,
        *jargs,
        td._scale(None, 1.0, c.d),
        out_shape=(
            jax.ShapeDtypeStruct(tuple(o.shape), jnp.float32),
            jax.ShapeDtypeStruct(tuple(lse.shape), jnp.float32),
        ),
        grid=grid,
        name="t",
        num_warps=4,
        num_stages=2,
        **kw,
    )
    assert_same_partials(o.cpu().numpy(), lse.cpu().numpy(), np.asarray(jo), np.asarray(jl))
    written = ~np.isneginf(np.asarray(jl))
    assert written.any() and not written.all()  # the case has empty splits and written ones
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        triton_native.decode_partials(tq, tk, tv, tt, tl_, num_splits=2)  # warm-up on the capture stream
        with torch.cuda.graph(g, stream=s):
            og, lg = triton_native.decode_partials(tq, tk, tv, tt, tl_, num_splits=2)
    g.replay()
    torch.cuda.synchronize()
    assert_same_partials(og.cpu().numpy(), lg.cpu().numpy(), o.cpu().numpy(), lse.cpu().numpy())


@pytest.mark.gpu
def test_gpu_bridge_native_equals_jax_triton_and_replays_in_a_cuda_graph():
    """``triton_native.mha_decode`` on CUDA tensors = ``mha_decode_with_kvcache(backend="triton")``
    bit for bit (the same kernels), and its launches replay from a torch CUDA graph."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    import jattn
    from jattn.bridge import triton_native
    from jattn.pallas_kernels import triton_glue

    if not triton_glue.available():
        pytest.skip("needs jax-triton")
    c, q, k, v, table, lens = _inputs("verify_q3_causal_poison")
    dev = lambda a, dt=torch.bfloat16: torch.from_numpy(np.ascontiguousarray(a)).to("cuda", dt)  # noqa: E731
    targs = (dev(q), dev(k), dev(v), dev(table, torch.int32), dev(lens, torch.int32))
    kw = dict(max_seqlen_q=c.q_len, is_causal=c.causal, return_lse=True)
    out, lse = triton_native.mha_decode(*targs, **kw)
    jargs = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)] + [jnp.asarray(table), jnp.asarray(lens)]
    jout, jlse = jattn.mha_decode_with_kvcache(*jargs, backend="triton", **kw)
    np.testing.assert_array_equal(out.float().cpu().numpy(), np.asarray(jout, np.float32))
    np.testing.assert_array_equal(lse.cpu().numpy(), np.asarray(jlse))
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        triton_native.mha_decode(*targs, **kw)
        with torch.cuda.graph(g, stream=s):
            gout, glse = triton_native.mha_decode(*targs, **kw)
    g.replay()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(gout.float().cpu().numpy(), out.float().cpu().numpy())


def test_refuses_a_query_tile_over_shared_memory():
    """Many query rows per KV head (an MQA model's 128 heads, 8-token verify) need a q tile
    past shared memory: refused with the reason (auto falls back) instead of a failed launch."""
    import jax.numpy as jnp

    from jattn.pallas_kernels import triton_decode as td

    k = jnp.zeros((4, 16, 1, 128), jnp.bfloat16)
    msg = td.unsupported_reason(jnp.zeros((8, 128, 128), jnp.bfloat16), k, k, max_seqlen_q=8)
    assert msg is not None and "1024 query rows per KV head" in msg and "shared memory" in msg
    assert td.unsupported_reason(jnp.zeros((8, 32, 128), jnp.bfloat16), k, k, max_seqlen_q=8) is None


def test_ampere_refusals_fp8_and_f32_shared_memory(monkeypatch):
    """On sm80 / sm86 Triton has no e4m3 type: every Triton op refused FP8 nothing and
    failed to compile (auto sends Ampere to Triton); now they give the reason and auto
    falls back to XLA. f32 decode tiles needed about 2.5x the shared memory the check
    counted (110,720 bytes compiled for sm86 against an estimate of 41,984): refused."""
    import jax.numpy as jnp

    from jattn.pallas_kernels import interpret, triton_glue, triton_kv_write, triton_mla, triton_mla_kv_write
    from jattn.pallas_kernels import triton_decode as td
    from jattn.pallas_kernels import triton_prefill as tp

    monkeypatch.setattr(interpret, "on_gpu", lambda: True)
    monkeypatch.setattr(triton_glue, "capability", lambda: 86)
    monkeypatch.setattr(td, "device_kind", lambda: "ampere")
    monkeypatch.setattr(triton_mla, "device_kind", lambda: "ampere")
    f8, bf = jnp.float8_e4m3fn, jnp.bfloat16
    q, k8 = jnp.zeros((2, 8, 128), bf), jnp.zeros((4, 16, 2, 128), f8)
    want = "FP8 e4m3 needs compute capability 8.9 or newer in Triton (this GPU: 8.6)"
    assert td.unsupported_reason(q, k8, k8) == want
    assert tp.unsupported_reason(q, k8, k8) == want
    lat = jnp.zeros((4, 16, 576), f8)
    assert triton_mla.unsupported_reason(jnp.zeros((2, 8, 576), bf), lat, kv_lora_rank=512) == want
    loc, rows = jnp.zeros(3, jnp.int32), jnp.zeros((3, 2, 128), bf)
    assert triton_kv_write.unsupported_reason(k8, k8, loc, rows, rows) == want
    assert triton_mla_kv_write.unsupported_reason(lat, loc, jnp.zeros((3, 512), bf), jnp.zeros((3, 64), bf)) == want
    kb = jnp.zeros((4, 16, 2, 128), bf)
    assert td.unsupported_reason(q, kb, kb) is None  # bf16 is fine there
    f32 = jnp.float32
    q32, k32 = jnp.zeros((2, 16, 128), f32), jnp.zeros((4, 16, 2, 128), f32)
    assert "shared memory" in td.unsupported_reason(q32, k32, k32, max_seqlen_q=2)  # 16 rows: 110,720 bytes
    assert "shared memory" in triton_mla.unsupported_reason(
        jnp.zeros((2, 8, 576), f32), jnp.zeros((4, 16, 576), f32), kv_lora_rank=512
    )
    monkeypatch.setattr(triton_glue, "capability", lambda: 89)
    assert td.unsupported_reason(q, k8, k8) is None


def test_capability_reads_the_devices_version_string(monkeypatch):
    """``triton_glue.capability`` parses ``compute_capability`` ("8.9" is 89: Ada has e4m3,
    "8.6" is not sm80); the other tests stub the function itself. No CUDA device: 80."""
    import types

    import jax

    from jattn.pallas_kernels import triton_glue

    for cc, want in (("8.9", 89), ("8.6", 86), ("9.0", 90), ("10.0", 100), (None, 80)):
        monkeypatch.setattr(jax, "devices", lambda cc=cc: [types.SimpleNamespace(compute_capability=cc)])
        assert triton_glue.capability() == want, cc
