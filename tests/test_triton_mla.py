"""The Triton MLA absorbed decode kernel (``jattn.pallas_kernels.triton_mla``).

CPU: the kernel source under Triton's interpreter on torch CPU tensors
(``jattn.bridge.triton_native.mla_decode_partials``, a ``TRITON_INTERPRET=1``
subprocess; f32/f16), its split partials merged in float64 and compared with the
float64 MLA decode of ``tests/naive.py``. GPU (marker ``gpu``):
``mla_decode_with_kvcache(backend="triton")`` in bf16 and FP8 against the f32
reference. Latent width 64 + 16 on the CPU (the kernel takes any powers of two),
576 on the GPU. Unused pages and page tails hold NaN, page tables are permuted,
one case puts NaN in a later draft token that earlier queries do not see. Eight more CPU
cases are drawn at random from a fixed seed (``random_cases``; ``JATTN_TRITON_FUZZ_SEED``
and ``JATTN_TRITON_FUZZ_CASES`` draw others).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import assert_same_partials, merge_splits_f64, random_draw, run_in_interpreter
from naive import mla_decode as mla_f64

from jattn.pallas_kernels.interpret import on_gpu


@dataclasses.dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]
    heads: int = 4
    q_len: int = 1
    causal: bool = True
    rank: int = 64
    rope: int = 16
    page_size: int = 16
    num_splits: int | None = None
    poison: bool = False  # NaN in request 0's last token (seen only by its last query)
    dtype: str = "float32"
    tuning: tuple = ()  # triton_mla.Tuning fields other than the default's
    fp8: bool = False  # latent rows in FP8 e4m3 (the reference takes the same rounded rows)
    tol: float | None = None
    kv_scale: float = 1.0  # the cache's scale (on the scores here; the combine puts it on the output)
    zero_q_row: bool = False  # query row 0, head 0 all zeros (an e4m3 row scale must not divide by 0)


CASES = {
    "lens_0_1_97_two_splits": Case(lens=(97, 0, 1), num_splits=2),
    "lens_0_1_97_block_n64_warps8": Case(lens=(97, 0, 1), num_splits=2, tuning=(("block_n", 64), ("num_warps", 8))),
    "block_m64_fp16": Case(
        lens=(40, 75), heads=16, q_len=4, tuning=(("block_m", 64), ("block_n", 16)), dtype="float16"
    ),
    "verify_q3_poison": Case(lens=(70,), heads=8, q_len=3, poison=True, page_size=32),
    "heads_40_two_row_tiles_fp16": Case(lens=(33, 50), heads=20, q_len=2, causal=False, dtype="float16"),
    # one page per block (the page index loaded a block ahead), the tokens as the MMA rows;
    # FP8 cases without poison: the interpreter reads an e4m3 NaN as 480
    "swap1_one_page_prefetch": Case(
        lens=(97, 0, 1), num_splits=2, page_size=32, tuning=(("swap", 1), ("prefetch", 1), ("num_stages", 1))
    ),
    "swap2_verify_q3_poison": Case(
        lens=(70,), heads=8, q_len=3, poison=True, page_size=32, tuning=(("swap", 2), ("num_stages", 3))
    ),
    "swap2_prefetch_pages_of_16": Case(
        lens=(33, 50), heads=20, q_len=2, causal=False, tuning=(("swap", 2), ("prefetch", 1)), dtype="float16"
    ),
    "fp8_f16_math_swap2": Case(
        lens=(97, 0, 1), num_splits=2, page_size=32, fp8=True, dtype="float16", tuning=(("swap", 2), ("fp8_math", 1))
    ),
    "fp8_upcast_to_q": Case(lens=(40, 75), heads=16, q_len=2, fp8=True, dtype="float16", kv_scale=0.5),
    "fp8_e4m3_scores_prefetch": Case(
        lens=(97, 0, 1),
        page_size=32,
        q_len=2,
        fp8=True,
        dtype="float16",
        tol=6e-2,
        tuning=(("swap", 2), ("fp8_math", 2), ("prefetch", 1)),
        zero_q_row=True,
    ),
}


def random_cases(seed: int, n: int) -> dict[str, Case]:
    """``n`` cases drawn from ``seed``: lengths at and around the page and block edges
    (0 and 1 among them), heads, query lengths, causal or not, forced splits, FP8 with a
    scale, a poisoned token, and any ``triton_mla.Tuning`` the kernel takes. The names
    carry the seed, so the interpreter's subprocess draws the same cases."""
    rng = np.random.default_rng(seed)
    domains = dict(block_m=(16, 32, 64), block_n=(16, 32, 64), num_warps=(4, 8), num_stages=(1, 2, 3))
    domains.update(waves=(1, 2, 3), swap=(0, 1, 2), prefetch=(0, 1))
    out = {}
    for i in range(n):
        fp8 = bool(rng.random() < 0.3)
        q_len = int(rng.integers(1, 5))
        lens = tuple(int(x) for x in rng.choice((0, 1, 2, 15, 16, 17, 31, 33, 64, 97, 130), int(rng.integers(1, 4))))
        pick = {k: int(rng.choice(v)) for k, v in domains.items() if rng.random() < 0.5}
        if fp8 and rng.random() < 0.7:
            pick["fp8_math"] = int(rng.integers(1, 3))
        out[f"random_{seed}_{i}"] = Case(
            lens=lens,
            heads=int(rng.choice((1, 4, 8, 16, 20))),
            q_len=q_len,
            causal=bool(q_len == 1 or rng.random() < 0.7),
            rank=int(rng.choice((32, 64))),
            page_size=int(rng.choice((16, 32, 64))),
            num_splits=None if rng.random() < 0.5 else int(rng.integers(1, 5)),
            # FP8 rows without poison: the interpreter reads an e4m3 NaN as 480
            poison=bool(not fp8 and lens[0] > 0 and rng.random() < 0.5),
            dtype="float16" if fp8 or rng.random() < 0.5 else "float32",
            tuning=tuple(sorted(pick.items())),
            fp8=fp8,
            tol=6e-2 if pick.get("fp8_math") == 2 else None,
            kv_scale=float(rng.choice((1.0, 0.5))) if fp8 else 1.0,
        )
    return out


CASES.update(random_cases(*random_draw()))
SCALE = 0.19


def _inputs(name):
    c = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    bs, ps, w = len(c.lens), c.page_size, c.rank + c.rope
    max_pages = max(1, max(-(-n // ps) for n in c.lens)) + 1
    num_pages = bs * max_pages + 2
    kv = np.full((num_pages, ps, w), np.nan, np.float32)
    table = rng.permutation(num_pages)[: bs * max_pages].reshape(bs, max_pages).astype(np.int32)
    for b, n in enumerate(c.lens):
        for t in range(n):
            kv[table[b, t // ps], t % ps] = rng.standard_normal(w) * 0.5
        npg = -(-n // ps)
        table[b, npg:] = rng.integers(0, num_pages, max_pages - npg)
    q = (rng.standard_normal((bs * c.q_len, c.heads, w)) * 0.5).astype(np.float32)
    if c.zero_q_row:
        q[0, 0] = 0.0
    kv = kv.astype(jnp.float8_e4m3fn) if c.fp8 else kv.astype(c.dtype)
    return c, q.astype(c.dtype), kv, table, np.asarray(c.lens, np.int32)


def _poisoned(c, kv, table):
    j = c.lens[0] - 1
    kv = kv.copy()
    kv[table[0, j // c.page_size], j % c.page_size, 5] = np.nan
    sees = np.arange(c.q_len) == c.q_len - 1 if c.causal else np.ones(c.q_len, bool)
    return kv, np.flatnonzero(sees)


def run_interpreted(name: str, path: str) -> None:
    import torch

    from jattn.bridge import triton_native
    from jattn.pallas_kernels import triton_mla

    c, q, kv, table, lens = _inputs(name)
    tuning = dataclasses.replace(triton_mla.DEFAULT_TUNING, **dict(c.tuning))
    if c.poison:
        kv, _ = _poisoned(c, kv, table)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    kv_t = t(kv.view(np.uint8)).view(torch.float8_e4m3fn) if c.fp8 else t(kv)
    runs = []
    for _ in range(2):
        o, lse = triton_native.mla_decode_partials(
            t(q),
            kv_t,
            t(table),
            t(lens),
            kv_lora_rank=c.rank,
            softmax_scale=SCALE,
            kv_scale=c.kv_scale,
            max_seqlen_q=c.q_len,
            is_causal=c.causal,
            num_splits=c.num_splits,
            tuning=tuning,
        )
        runs.append((o.numpy(), lse.numpy()))
    np.savez(path, o=runs[0][0], lse=runs[0][1], o2=runs[1][0], lse2=runs[1][1])


# Cases also run through the JAX entry point (``triton_mla.mla_decode``), whose host code
# (tuning, grid, partial shapes, the combine with kv_scale on the output) runs on the CPU
# with ``triton_glue.triton_call`` launching the source under the interpreter.
JAX_PATH_CASES = ["fp8_upcast_to_q", "lens_0_1_97_two_splits"]


def run_jax_path(name: str, path: str) -> None:
    """In a TRITON_INTERPRET=1 process: the case through ``triton_mla.mla_decode`` (``name``
    is ``jax_`` and the case's name), eagerly."""
    import jax
    from interpreted import interpreted_triton_call

    from jattn.pallas_kernels import triton_glue, triton_mla

    c, q, kv, table, lens = _inputs(name.removeprefix("jax_"))
    triton_glue.triton_call = interpreted_triton_call
    with jax.disable_jit():
        out, lse = triton_mla.mla_decode(
            q, kv, table, lens, kv_lora_rank=c.rank, softmax_scale=SCALE, kv_scale=c.kv_scale,
            max_seqlen_q=c.q_len, is_causal=c.causal, return_lse=True, num_splits=c.num_splits,
            tuning=dataclasses.replace(triton_mla.DEFAULT_TUNING, **dict(c.tuning)),
        )  # fmt: skip
    np.savez(path, o=np.asarray(out, np.float32), lse=np.asarray(lse))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    runs = {"run_interpreted": list(CASES), "run_jax_path": ["jax_" + n for n in JAX_PATH_CASES]}
    return run_in_interpreter(tmp_path_factory, "test_triton_mla", runs)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_float64(name, interpreted):
    res = interpreted[name]
    c, q, kv, table, lens = _inputs(name)
    kv = kv.astype(np.float32) if c.fp8 else kv
    want, want_lse = mla_f64(  # the partials' values are unscaled: kv_scale is on the scores alone
        q, kv, table, lens, kv_lora_rank=c.rank, softmax_scale=SCALE * c.kv_scale, max_seqlen_q=c.q_len,
        is_causal=c.causal,
    )  # fmt: skip
    o, lse = merge_splits_f64(res["o"], res["lse"])
    bs = len(c.lens)
    out = o.reshape(bs * c.q_len, c.heads, c.rank)
    lse = lse.reshape(bs * c.q_len, c.heads)
    bad = _poisoned(c, kv, table)[1] if c.poison else np.zeros(0, int)
    rows = np.setdiff1d(np.arange(out.shape[0]), bad)
    if bad.size:
        assert not np.isfinite(out[bad]).all(axis=(1, 2)).any(), "a row that sees a NaN must be non-finite"
    assert np.isfinite(out[rows]).all(), "NaN leaked into a real row"
    tol = c.tol or (2e-2 if c.dtype == "float16" else 2e-4)
    np.testing.assert_allclose(out[rows], want[rows], atol=tol, rtol=tol)
    fin = np.isfinite(want_lse[rows])
    np.testing.assert_allclose(lse[rows][fin], want_lse[rows][fin], atol=tol, rtol=tol)
    empty = np.repeat(lens == 0, c.q_len)
    assert (out[empty] == 0).all() and np.isneginf(lse[empty]).all()
    assert_same_partials(res["o"], res["lse"], res["o2"], res["lse2"])  # deterministic


@pytest.mark.parametrize("name", JAX_PATH_CASES)
def test_jax_entry_point_interpreted_matches_float64(name, interpreted):
    """``mla_decode``'s output (``kv_scale`` on it, after the combine) and natural-log LSE
    against float64 (the GPU tests alone ran this host code: an FP8 cache's ``kv_scale``
    left off the output passed every CPU test)."""
    res = interpreted["jax_" + name]
    c, q, kv, table, lens = _inputs(name)
    kv = kv.astype(np.float32) if c.fp8 else kv
    want, want_lse = mla_f64(
        q, kv, table, lens, kv_lora_rank=c.rank, softmax_scale=SCALE * c.kv_scale, max_seqlen_q=c.q_len,
        is_causal=c.causal,
    )  # fmt: skip
    tol = 2e-2 if c.dtype == "float16" else 2e-4
    np.testing.assert_allclose(res["o"], want * c.kv_scale, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isneginf(res["lse"]), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(res["lse"][fin], want_lse[fin], atol=tol, rtol=tol)


def test_launch_params_and_reasons():
    from jattn.pallas_kernels import triton_mla as tm

    grid, params, launch = tm.launch_params(64, 16, 1, 4096)
    n = tm.DEFAULT_TUNING.block_n
    assert grid[:2] == (64, 1) and params["BLOCK_M"] == 16 and params["BLOCK_N"] == n
    assert launch == dict(num_warps=tm.DEFAULT_TUNING.num_warps, num_stages=tm.DEFAULT_TUNING.num_stages)
    t = tm.Tuning(block_m=32, block_n=32, waves=2)
    grid, params, _ = tm.launch_params(64, 16, 1, 4096, tuning=t)
    assert grid == (64, 1, 5) and params == dict(BLOCK_M=16, BLOCK_N=32, SPLITS=5, SWAP=0, FP8_MATH=0, PREFETCH=0)
    assert tm.launch_params(64, 128, 2, 4096, tuning=t)[0] == (64, 8, 1)  # 256 rows in tiles of 32
    assert tm.launch_params(64, 128, 2, 4096, tuning=tm.Tuning(block_m=64))[0][:2] == (64, 4)
    assert tm.launch_params(1, 16, 1, 300, tuning=t)[0] == (1, 1, 1)  # at least 256 tokens a split
    # the measured Hopper table; FP8 latent rows and other GPUs keep the default
    hop = tm.Tuning(block_m=64, block_n=64, num_warps=8, num_stages=2)
    assert tm.choose_tuning(128, 1, 2, sm=90) == tm.choose_tuning(16, 4, 2, sm=90) == hop
    assert tm.choose_tuning(16, 2, 2, sm=90) == tm.Tuning(block_n=64, num_warps=8, num_stages=3)
    assert tm.choose_tuning(16, 1, 2, sm=90) == tm.Tuning(block_n=64, num_warps=4, num_stages=3, swap=1)
    fp8 = tm.Tuning(block_n=64, num_warps=8, num_stages=1, fp8_math=1, prefetch=1)
    assert tm.choose_tuning(16, 1, 1, sm=90) == fp8 and tm.choose_tuning(16, 2, 1, sm=90) == tm.DEFAULT_TUNING
    assert tm.launch_params(1, 16, 1, 32768)[0] == (1, 1, tm.MAX_SPLITS)  # batch 1: 128 splits of 256 tokens
    assert tm.choose_tuning(128, 1, 1, sm=90) == tm.choose_tuning(128, 1, 2, sm=80) == tm.DEFAULT_TUNING
    assert tm.choose_tuning(16, 1, 4, sm=90) == tm.choose_tuning(128, 1, 4, sm=90) == tm.DEFAULT_TUNING  # f32 rows
    q = jnp.zeros((2, 16, 576), jnp.bfloat16)
    kv = jnp.zeros((4, 64, 576), jnp.bfloat16)
    assert tm.unsupported_reason(q, kv, kv_lora_rank=512) is None
    assert tm.unsupported_reason(q, kv.astype(jnp.float8_e4m3fn), kv_lora_rank=512) is None
    assert "powers of two" in tm.unsupported_reason(q, kv, kv_lora_rank=500)
    assert "max_seqlen_q=9" in tm.unsupported_reason(q, kv, kv_lora_rank=512, max_seqlen_q=9)
    assert tm.unsupported_reason(q, kv, kv_lora_rank=512, max_seqlen_q=8) is None
    for rope in (8, 24):  # rope columns too few for a dot, or not a power of two
        msg = tm.unsupported_reason(q[..., : 512 + rope], kv[..., : 512 + rope], kv_lora_rank=512)
        assert f"rope width {rope} must be powers of two >= 16" in msg
    assert "kv_cache dtype float16" in tm.unsupported_reason(q, kv.astype(jnp.float16), kv_lora_rank=512)
    # the smallest row tile is 16 rows (tl.dot's least M), whatever the call's rows
    assert tm.launch_params(2, 4, 1, 4096)[1]["BLOCK_M"] == 16
    assert tm.launch_params(2, 1, 1, 4096, tuning=tm.Tuning(block_m=64))[1]["BLOCK_M"] == 16
    # a last row tile of fewer rows than BLOCK_M is still launched (40 rows: two tiles of 32)
    assert tm.launch_params(2, 40, 1, 4096)[0][:2] == (2, 2) and tm.launch_params(2, 24, 1, 4096)[0][:2] == (2, 1)
    # an FP8 math choice reaches FP8 latent rows only (2-byte rows keep their own dtype)
    params = tm.launch_params(2, 16, 1, 4096, tuning=tm.Tuning(fp8_math=1))[1]
    pt = jnp.zeros((2, 64), jnp.int32)
    kw = dict(kv_lora_rank=512, q_len=1, is_causal=True, params=params)
    assert tm.constexprs(q, kv, pt, **kw)["FP8_MATH"] == 0
    assert tm.constexprs(q, kv.astype(jnp.float8_e4m3fn), pt, **kw)["FP8_MATH"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads, q_len, lens", [(16, 1, (4096, 97, 0, 1)), (128, 2, (1000, 65))])
def test_gpu_matches_reference(heads, q_len, lens, fp8):
    import jattn
    from jattn import reference
    from jattn.pallas_kernels import triton_glue

    if not on_gpu() or not triton_glue.available():
        pytest.skip("needs a GPU with jax-triton")
    rng = np.random.default_rng(0)
    ps, w = 64, 576
    per = max(-(-n // ps) for n in lens) + 1  # one column past the longest request
    pages = len(lens) * per + 3
    kv = np.full((pages, ps, w), np.nan, np.float32)  # unused pages and slots past a length: NaN
    table = rng.permutation(pages)[: len(lens) * per].reshape(len(lens), per).astype(np.int32)
    for b, n in enumerate(lens):
        t = np.arange(n)
        kv[table[b, t // ps], t % ps] = rng.standard_normal((n, w)) * 0.5
    q = (rng.standard_normal((len(lens) * q_len, heads, w)) * 0.5).astype(np.float32)
    kd = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    kw = dict(kv_lora_rank=512, softmax_scale=1 / 192**0.5, max_seqlen_q=q_len, return_lse=True)
    if fp8:  # a scale other than 1 (on the scores and on the output)
        kw["kv_scale"], kv = 0.5, kv / 0.5
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, kd), jnp.asarray(table), jnp.asarray(lens, jnp.int32))
    out, lse = jattn.mla_decode_with_kvcache(*args, backend="triton", **kw)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    want, want_lse = reference.mla_decode(f32(args[0]), f32(args[1]), args[2], args[3], **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=4e-2, rtol=4e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=4e-2, rtol=4e-2)
    again = jattn.mla_decode_with_kvcache(*args, backend="triton", **kw)[0]
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(out, np.float32))  # deterministic


# (tuning fields, FP8 cache, heads, q_len): choose_tuning's table (16 query rows: h16_n64_w4_s3_x1,
# fp8_h16_n64_w8_s1_f1_p) and the candidates that `bench mla --sweep` timed for 16 heads, q_len 1
GPU_TUNINGS = {
    "default": (dict(), False, 32, 2),
    "n64_w4_s3": (dict(block_n=64, num_warps=4, num_stages=3), False, 32, 2),
    "n64_w8_s3": (dict(block_n=64, num_warps=8, num_stages=3), False, 32, 2),
    "m64_n64_w8_s2": (dict(block_m=64, block_n=64, num_warps=8, num_stages=2), False, 32, 2),
    "h16_n64_w4_s3_x1": (dict(block_n=64, num_stages=3, swap=1), False, 16, 1),
    "h16_n32_w4_s4": (dict(block_n=32, num_stages=4), False, 16, 1),
    "h16_n32_w4_s4_x1": (dict(block_n=32, num_stages=4, swap=1), False, 16, 1),
    "h16_n32_w4_s5_x2": (dict(block_n=32, num_stages=5, swap=2), False, 16, 1),
    "h16_n64_w4_s2_x2": (dict(block_n=64, num_stages=2, swap=2), False, 16, 1),
    "h16_n64_w8_s2_x2": (dict(block_n=64, num_warps=8, num_stages=2, swap=2), False, 16, 1),
    "fp8_default": (dict(), True, 16, 1),
    "fp8_h16_n64_w8_s3_x2_f2": (dict(block_n=64, num_warps=8, num_stages=3, swap=2, fp8_math=2), True, 16, 1),
    "fp8_h16_n64_w8_s4_x2_f2": (dict(block_n=64, num_warps=8, num_stages=4, swap=2, fp8_math=2), True, 16, 1),
    "fp8_h16_n64_w4_s4_x2_f2": (dict(block_n=64, num_warps=4, num_stages=4, swap=2, fp8_math=2), True, 16, 1),
    "fp8_h16_n64_w8_s3_x1_f2": (dict(block_n=64, num_warps=8, num_stages=3, swap=1, fp8_math=2), True, 16, 1),
    "fp8_h16_n64_w8_s1_f1_p": (dict(block_n=64, num_warps=8, num_stages=1, fp8_math=1, prefetch=1), True, 16, 1),
    "fp8_h16_n64_w8_s3_f1": (dict(block_n=64, num_warps=8, num_stages=3, fp8_math=1), True, 16, 1),
    "fp8_h16_n64_w8_s3": (dict(block_n=64, num_warps=8, num_stages=3), True, 16, 1),
    "fp8_h16_n64_w8_s3_x2_f1": (dict(block_n=64, num_warps=8, num_stages=3, swap=2, fp8_math=1), True, 16, 1),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_TUNINGS))
def test_gpu_every_hopper_tuning(name):
    """Each launch choice of ``choose_tuning``'s table (and each candidate the sweep times)
    gives the reference's result, on lengths 0, 1, 97 and one not a multiple of any block,
    NaN in unused pages; prints its largest error (``-rP`` shows it)."""
    from jattn import reference
    from jattn.pallas_kernels import triton_glue
    from jattn.pallas_kernels import triton_mla as tm

    if not on_gpu() or not triton_glue.available():
        pytest.skip("needs a GPU with jax-triton")
    tuning, fp8, heads, q_len = GPU_TUNINGS[name]
    rng = np.random.default_rng(1)
    lens, ps, w = (3001, 97, 0, 1), 64, 576
    per = max(-(-n // ps) for n in lens) + 1
    pages = len(lens) * per + 3
    kv = np.full((pages, ps, w), np.nan, np.float32)
    table = rng.permutation(pages)[: len(lens) * per].reshape(len(lens), per).astype(np.int32)
    for b, n in enumerate(lens):
        t = np.arange(n)
        kv[table[b, t // ps], t % ps] = rng.standard_normal((n, w)) * 0.5
    q = (rng.standard_normal((len(lens) * q_len, heads, w)) * 0.5).astype(np.float32)
    args = (
        jnp.asarray(q, jnp.bfloat16),
        jnp.asarray(kv, jnp.float8_e4m3fn if fp8 else jnp.bfloat16),
        jnp.asarray(table),
        jnp.asarray(lens, jnp.int32),
    )
    kw = dict(kv_lora_rank=512, softmax_scale=1 / 192**0.5, max_seqlen_q=q_len, return_lse=True)
    out, lse = tm.mla_decode(*args, tuning=dataclasses.replace(tm.DEFAULT_TUNING, **tuning), **kw)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    want, want_lse = reference.mla_decode(f32(args[0]), f32(args[1]), args[2], args[3], **kw)
    out, want = np.asarray(out, np.float32), np.asarray(want)
    fin = np.isfinite(np.asarray(want_lse))
    err_lse = np.abs(np.asarray(lse) - np.asarray(want_lse))[fin].max()
    err = np.abs(out - want).max()
    print(f"{name}: max |out - ref| {err:.2e} (ref max {np.abs(want).max():.2e}), lse {err_lse:.2e}")
    np.testing.assert_allclose(out, want, atol=4e-2, rtol=4e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("kv_scale", [1.0, 0.5])
def test_the_combine_gets_the_splits_kv_scale_and_q_dtype(monkeypatch, kv_scale, fresh_jit_caches):
    """``triton_mla.mla_decode``'s host code with the launch and the combine stubbed: the
    combine merges the kernel's partials for the call's query length and heads, applies
    ``kv_scale`` (none for a Python 1.0) and writes q's dtype."""
    from jattn.pallas_kernels import combine, triton_glue, triton_mla

    seen = {}

    def fake_call(fn, *args, out_shape, **kw):
        seen["parts"] = out_shape
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shape)

    def fake_combine(o_part, lse_part, **kw):  # returns the v_scale it got (-1: none)
        seen["combine"] = kw
        return jnp.full((3,), -1.0 if kw["v_scale"] is None else kw["v_scale"]), lse_part

    monkeypatch.setattr(triton_glue, "triton_call", fake_call)
    monkeypatch.setattr(combine, "combine_splits", fake_combine)
    rng = np.random.default_rng(29)
    q = jnp.asarray(rng.standard_normal((6, 3, 80)), jnp.float16)
    kv = jnp.asarray(rng.standard_normal((7, 16, 80)), jnp.float16)
    table, lens = jnp.asarray(rng.permutation(6).reshape(2, 3), jnp.int32), jnp.asarray([40, 9], jnp.int32)
    got = triton_mla.mla_decode(
        q, kv, table, lens, kv_lora_rank=64, softmax_scale=0.1, kv_scale=kv_scale, max_seqlen_q=3, num_splits=2
    )
    kw = seen["combine"]
    assert kw["q_len"] == 3 and kw["num_q_heads"] == 3 and kw["out_dtype"] == jnp.float16 and kw["sinks"] is None
    assert (np.asarray(got) == (-1.0 if kv_scale == 1.0 else kv_scale)).all()
    assert seen["parts"][0].shape[1:] == (2, 9, 64) and seen["parts"][1].shape[1:] == (2, 9)
