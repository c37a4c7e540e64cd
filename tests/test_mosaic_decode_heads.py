"""Tests of the per-KV-head Mosaic GPU decode kernel
(``jattn.pallas_kernels.mosaic_decode_heads``: keys as the MMA rows), and of the routing
that sends multi-token calls of ``mosaic_decode.mha_decode`` (and the ops) to it.

CPU: the Mosaic GPU interpreter (f16 queries, f16 or FP8 K/V, small) and the cuda
lowering. GPU (marker ``gpu``, bf16, full shapes): the compiled kernel. Both against the
f32 ``jattn.reference.mha_decode`` on fresh random draws: unused pages and page tails hold
NaN, page tables are permuted, and poison cases put a NaN in one cached V row (the rows
that see it must come out non-finite, every other row exact).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import reference
from jattn.pallas_kernels import mosaic_decode_heads as mh
from jattn.pallas_kernels.interpret import gpu_interpret, interpreter_available, on_gpu


@dataclasses.dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]
    hq: int = 4
    hkv: int = 2
    d: int = 64
    page_size: int = 64
    q_len: int = 1
    causal: bool = True
    num_splits: int | None = None
    poison: int = -1  # >= 0: key of request 0 (counted from its end) whose V holds a NaN
    fp8: bool = False  # FP8 e4m3 K/V with scales
    persistent: bool = False
    num_ctas: int | None = None  # CTAs of the persistent launch (None: the SM slots)
    softmax_scale: float | None = None  # None: 1/sqrt(d)
    row_tile: int = 0  # query rows per item (mha_decode_heads(row_tile=...))
    block: int = 64  # tokens per ring block
    fp8_qk: bool = False  # FP8: e4m3 query, S^T on the landed e4m3 K tile
    v_regs: bool = False  # fp8_qk: V^T into registers from the landed e4m3 tile
    overlap: bool = False  # v_regs: the next block's S^T in flight during this block's softmax
    balanced: bool = False  # one split size for every request (a long request takes more splits)


def _inputs(c: Case, seed: int):
    rng = np.random.default_rng(seed)
    bs, ps = len(c.lens), c.page_size
    max_pages = max(1, max(-(-n // ps) for n in c.lens)) + 1
    num_pages = bs * max_pages + 2
    shape = (num_pages, ps, c.hkv, c.d)
    k, v = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    table = rng.permutation(num_pages)[: bs * max_pages].reshape(bs, max_pages).astype(np.int32)
    for b, n in enumerate(c.lens):
        for t in range(n):
            k[table[b, t // ps], t % ps] = rng.standard_normal((c.hkv, c.d))
            v[table[b, t // ps], t % ps] = rng.standard_normal((c.hkv, c.d))
        npg = -(-n // ps)
        table[b, npg:] = rng.integers(0, num_pages, max_pages - npg)  # never read
    q = rng.standard_normal((bs * c.q_len, c.hq, c.d)).astype(np.float32)
    if c.fp8_qk and c.row_tile:  # the last query's rows (a tile of their own) at another e4m3 scale
        q[c.q_len - 1 :: c.q_len] *= 4
    return q, k, v, table, np.asarray(c.lens, np.int32)


def _poison(c: Case, v, table):
    """NaN in V (KV head 0) of key ``lens[0] - 1 - c.poison`` of request 0; returns the
    (row, query head) pairs that see it: request 0's queries that see the key, heads of KV head 0."""
    j = c.lens[0] - 1 - c.poison
    v[table[0, j // c.page_size], j % c.page_size, 0, 5] = np.nan
    i = np.arange(c.q_len)
    sees = (c.lens[0] - c.q_len + i >= j) if c.causal else np.ones(c.q_len, bool)
    return [(r, h) for r in np.flatnonzero(sees) for h in range(c.hq // c.hkv)]


def _check(c: Case, dtype, seed=0, tol=2e-2, deterministic=False):
    q, k, v, table, lens = _inputs(c, seed)
    bad = _poison(c, v, table) if c.poison >= 0 else []
    kw = dict(max_seqlen_q=c.q_len, is_causal=c.causal, return_lse=True, softmax_scale=c.softmax_scale)
    if c.fp8:  # the cache holds x / scale in e4m3; both sides read the same rounded values
        kw.update(k_scale=0.37, v_scale=0.61)
        kc = jnp.asarray(k / kw["k_scale"], jnp.float8_e4m3fn)
        vc = jnp.asarray(v / kw["v_scale"], jnp.float8_e4m3fn)
        q_ref = jnp.asarray(jnp.asarray(q, dtype), jnp.float32)
        if c.fp8_qk:  # the kernel attends with the query rounded to e4m3 (at its tiles' scales)
            q_ref = mh.fp8_qk_query(jnp.asarray(q, dtype), c.hkv, c.q_len, c.row_tile)
            assert not np.array_equal(np.asarray(q_ref), np.asarray(jnp.asarray(q, dtype), np.float32))
        want_o, want_lse = reference.mha_decode(q_ref, kc, vc, table, lens, **kw)
    else:
        r = lambda a: jnp.asarray(jnp.asarray(a, dtype), jnp.float32)  # noqa: E731
        kc, vc = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
        want_o, want_lse = reference.mha_decode(r(q), r(k), r(v), table, lens, **kw)
    want_o, want_lse = np.asarray(want_o), np.asarray(want_lse)
    args = (jnp.asarray(q, dtype), kc, vc, jnp.asarray(table), jnp.asarray(lens))
    kw.update(num_splits=c.num_splits, persistent=c.persistent, num_ctas=c.num_ctas, row_tile=c.row_tile)
    kw.update(block=c.block, fp8_qk=c.fp8_qk, v_regs=c.v_regs, overlap=c.overlap, balanced=c.balanced)
    o, lse = mh.mha_decode_heads(*args, **kw)
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    assert o.shape == q.shape and lse.shape == q.shape[:2]
    ok = np.ones(o.shape[:2], bool)
    for rr, hh in bad:
        assert not np.isfinite(o[rr, hh]).all(), "a row that sees a NaN V must be non-finite"
        ok[rr, hh] = False
    assert np.isfinite(o[ok]).all(), "NaN/Inf in a real row"
    np.testing.assert_allclose(o[ok], want_o[ok], atol=tol, rtol=tol)
    np.testing.assert_allclose(lse[ok], want_lse[ok], atol=tol, rtol=tol)
    empty = np.repeat(lens == 0, c.q_len)
    assert (o[empty] == 0).all() and np.isneginf(lse[empty]).all(), "a request with no keys: 0 / -inf"
    if deterministic:
        o2 = np.asarray(mh.mha_decode_heads(*args, **kw)[0], np.float32)
        assert np.array_equal(o2, o, equal_nan=True), "not deterministic"


CPU_CASES = [
    # lengths 0, 1, 97 (a page tail), two splits, GQA 2, page 64; poison seen by every row;
    # 12 items on 5 persistent CTAs (3, 3, 2, 2, 2 items; empty splits among them)
    Case(lens=(97, 1, 0), num_splits=2, poison=5, persistent=True, num_ctas=5),
    # causal verify, 3 queries x 4 heads (N = 16), page 128, a NaN in a key only the last
    # two queries see; the keys only later drafts see cross the block boundary at 128
    Case(lens=(129,), hq=8, hkv=2, d=128, page_size=128, q_len=3, poison=1),
    # non-causal draft block, 4 queries x 4 heads, two requests
    Case(lens=(70, 5), hq=4, hkv=1, q_len=4, causal=False, softmax_scale=0.31),
    # FP8 e4m3 K/V with scales, causal verify over a page tail, poison
    Case(lens=(75, 0), hq=4, hkv=2, q_len=2, fp8=True, poison=0, persistent=True, num_ctas=3),
    # pages of 16: four boxes per 64-token block, the last block past the last page; a
    # NaN only the last of 2 draft tokens sees
    # (one persistent CTA walks all six items through one ring)
    Case(lens=(97, 0, 33), hq=8, hkv=2, page_size=16, q_len=2, poison=0, persistent=True, num_ctas=1),
    # pages of 32, FP8: two boxes per block of the FP8 ring
    Case(lens=(70, 1), hq=4, hkv=1, page_size=32, fp8=True),
    # d128, 8 causal queries x 4 heads (N = 32): the two-slot ring of two CTAs per SM
    Case(lens=(150,), hq=8, hkv=2, d=128, q_len=8, poison=2, num_splits=3, persistent=True, num_ctas=4),
    # the same rows in two 16-row tiles (each tile an item; the NaN is seen by queries of
    # the second tile only), two requests, two splits
    Case(lens=(150, 7), hq=8, hkv=2, q_len=8, poison=2, num_splits=2, row_tile=16),
    # 3 queries x 8 heads = 24 rows in tiles of 16 (the second half padding), FP8 with an
    # e4m3 query (one scale per tile: the last query is 4x larger, so the tiles' differ), on
    # 3 persistent CTAs; a NaN every query sees
    Case(
        lens=(97, 0), hq=16, hkv=2, q_len=3, fp8=True, fp8_qk=True, poison=5, row_tile=16, persistent=True, num_ctas=3
    ),
    # FP8 with an e4m3 query (S^T on the landed K tile, V upcast alone), two splits, a NaN
    # every query sees
    Case(lens=(97, 1, 0), fp8=True, fp8_qk=True, poison=5, num_splits=2),
    # the same at 128-token blocks over pages of 64 (two boxes a block), a causal verify
    # of 3 tokens x 4 heads with a NaN the last two see
    Case(lens=(200, 70), hq=8, hkv=2, q_len=3, fp8=True, fp8_qk=True, block=128, poison=1),
    # V^T read into registers from the landed e4m3 tile: 64-token blocks, two splits, a
    # NaN every query sees; 128-token blocks over pages of 16, d128 (two V^T halves), a
    # non-causal draft block of 3 in one split (two blocks), a NaN near the end, a request
    # with no keys
    Case(lens=(97, 1, 0), fp8=True, fp8_qk=True, v_regs=True, poison=5, num_splits=2),
    Case(
        lens=(200, 70, 0),
        hq=8,
        hkv=2,
        d=128,
        page_size=16,
        q_len=3,
        causal=False,
        fp8=True,
        fp8_qk=True,
        v_regs=True,
        block=128,
        poison=1,
        num_splits=1,
    ),  # fmt: skip
    # the same with the next block's S^T in flight (overlap): several blocks per split,
    # requests of 0 and 1 keys; a non-causal draft block over pages of 16, one split, on 3
    # persistent CTAs
    Case(lens=(300, 1, 0), fp8=True, fp8_qk=True, v_regs=True, overlap=True, poison=5, num_splits=2),
    Case(
        lens=(200, 70, 0, 130),
        hq=8,
        hkv=2,
        d=128,
        page_size=16,
        q_len=2,
        causal=False,
        fp8=True,
        fp8_qk=True,
        v_regs=True,
        overlap=True,
        poison=0,
        num_splits=1,
        persistent=True,
        num_ctas=3,
    ),  # fmt: skip
    # V^T in registers for a causal verify (per-key NaN flags): 4 tokens x 2 heads in one
    # split with a NaN only the last two drafts see (d128, pages of 16); with overlap, a NaN
    # every draft sees inside the edge block (kept, not zeroed)
    Case(
        lens=(300, 70, 0),
        hq=4,
        hkv=2,
        d=128,
        page_size=16,
        q_len=4,
        fp8=True,
        fp8_qk=True,
        v_regs=True,
        poison=1,
        num_splits=1,
    ),  # fmt: skip
    Case(
        lens=(300, 70, 0),
        hq=8,
        hkv=2,
        q_len=3,
        fp8=True,
        fp8_qk=True,
        v_regs=True,
        overlap=True,
        poison=10,
        num_splits=1,
    ),  # fmt: skip
    # the same at 128-token blocks with overlap, on 2 persistent CTAs (the [128] flag row)
    Case(
        lens=(300, 70, 0, 1),
        hq=8,
        hkv=2,
        q_len=3,
        fp8=True,
        fp8_qk=True,
        v_regs=True,
        block=128,
        overlap=True,
        poison=1,
        num_splits=1,
        persistent=True,
        num_ctas=2,
    ),  # fmt: skip
    # 2-byte K/V with the next block's S^T in flight: a causal 3-token verify in one split
    # (NaN seen by the last two drafts), and an 8-token non-causal draft block at d128
    Case(lens=(300, 70, 0), hq=8, hkv=2, q_len=3, poison=1, num_splits=1, overlap=True),
    Case(lens=(150, 1), hq=8, hkv=2, d=128, page_size=16, q_len=8, causal=False, num_splits=1, overlap=True),
    # 128-token blocks of 2-byte K/V over pages of 16 (eight boxes a block), a draft block
    Case(lens=(150, 7, 0), hq=4, hkv=1, page_size=16, q_len=2, causal=False, block=128),
    # balanced splits (one split size for the call: here one block, so request 0 takes
    # five splits, request 1 one, request 3 two and request 2 none of the static count):
    # FP8 with the e4m3 query and a NaN every query sees; a causal 3-token verify over
    # pages of 16 with a NaN the last two drafts see, on 4 persistent CTAs
    Case(lens=(300, 1, 0, 97), fp8=True, fp8_qk=True, poison=5, num_splits=2, balanced=True),
    Case(
        lens=(257, 0, 1, 65), hq=8, hkv=2, page_size=16, q_len=3, poison=1, balanced=True, persistent=True, num_ctas=4
    ),
]


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
@pytest.mark.parametrize("c", CPU_CASES, ids=str)
def test_interpreted(c):
    with gpu_interpret():
        # a second run of a plain and of a persistent launch (5 CTAs) checks determinism
        _check(c, jnp.float16, deterministic=c in (CPU_CASES[0], CPU_CASES[2], CPU_CASES[7], CPU_CASES[-1]))


def _routing(monkeypatch, c: Case, seed: int):
    """A routing test's inputs (``_inputs``), the rounding to f16 ``r``, the f16 call
    arguments, the per-KV-head kernel's calls (``_spy``) and the all-heads kernel's (its
    entry stubbed to zeros, recording ``window_left``)."""
    from jattn.pallas_kernels import mosaic_decode as md

    inputs = _inputs(c, seed)
    q, k, v, table, lens = inputs
    r = lambda a: jnp.asarray(jnp.asarray(a, jnp.float16), jnp.float32)  # noqa: E731
    args = (jnp.asarray(q, jnp.float16), jnp.asarray(k, jnp.float16), jnp.asarray(v, jnp.float16), table, lens)
    calls = _spy(monkeypatch)
    all_heads = []
    monkeypatch.setattr(md, "_mha_decode", lambda q, *a, **k: all_heads.append(k["window_left"]) or jnp.zeros_like(q))
    return inputs, r, args, calls, all_heads


def _spy(monkeypatch):
    """Count the calls that reach ``mha_decode_heads`` (still running it)."""
    calls = []
    real = mh.mha_decode_heads

    def spy(*a, **k):
        calls.append(k.get("max_seqlen_q"))
        return real(*a, **k)

    monkeypatch.setattr(mh, "mha_decode_heads", spy)
    return calls


def test_kernel_options_are_checked_and_reach_the_heads_kernel(monkeypatch):
    """``KernelOptions`` refuses a bad value whatever the call (``heads_row_tile=7`` was
    taken by calls that stay on the all-heads kernel and refused by the others); an
    explicit ``num_stages`` below 1 is refused by name (an index or broadcast error deep
    in the build); ``kernel_combine=False`` reaches the per-KV-head kernel's combine (it
    always ran the Triton combine there)."""
    from jattn.pallas_kernels import decode_tuning as dt
    from jattn.pallas_kernels import mosaic_decode as md

    bad = [dict(heads_row_tile=t) for t in (7, 8, 64, True, False)] + [dict(overlap_qk=1), dict(fp8_heads=None)]
    for kw in bad:  # 8 and 64: no MMA shape of the kernel; False: not the int 0
        with pytest.raises(ValueError, match=f"KernelOptions.{next(iter(kw))}="):
            dt.KernelOptions(**kw)
    assert dt.KernelOptions(heads_row_tile=16, overlap_qk=np.False_).heads_row_tile == 16
    shape = dict(batch=2, num_kv_heads=2, head_dim=64, page_size=16, max_pages=4)
    cfg = dict(shape, num_pages=9, num_q_heads=8, q_len=1, is_causal=True, window_left=-1, logit_cap=0.0,
               kv_itemsize=2, q_itemsize=2, interpret=False, options=dt.KernelOptions())  # fmt: skip
    bs = dt.choose_block_sizes(**shape, m_rows=8, kv_itemsize=2)
    with pytest.raises(ValueError, match="block_sizes.num_stages=0 must be >= 1"):
        dt.decode_config(block_sizes=dataclasses.replace(bs, num_stages=0), **cfg)
    seen = []
    monkeypatch.setattr(
        mh, "decode", lambda *a, **k: seen.append((k["combine_kernel"], k["row_tile"], k["balanced"])) or a[0]
    )
    q, k = jnp.zeros((4, 32, 64), jnp.bfloat16), jnp.zeros((5, 16, 2, 64), jnp.bfloat16)  # 64 rows: routed
    table, lens = jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32)
    with gpu_interpret():
        for combine, tile, balanced in ((False, 0, None), (True, 16, True), (True, 0, False)):
            opts = md.KernelOptions(kernel_combine=combine, heads_row_tile=tile, balanced_splits=balanced)
            md.mha_decode(q, k, k, table, lens, max_seqlen_q=2, options=opts)
    assert [c for c, _, _ in seen] == [False, True, True]
    assert seen[1][1] == 16 and seen[0][1] != 16  # heads_row_tile reaches the kernel
    # balanced_splits=True reaches it; None (not yet timed on this kernel) keeps even splits
    assert [b for _, _, b in seen] == [False, True, False]


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
def test_balanced_splits_grow_the_static_count_and_pass_one_size(monkeypatch):
    """``balanced=True``: the kernel is built with a static split count grown by
    ``combine.balanced_split_count`` and reads the call's split size after the lengths
    (``combine.balanced_split_blocks`` of the lengths in 64-token blocks), which covers the
    longest request in that count; the result is the even-split result's."""
    from jattn.pallas_kernels import combine

    c = Case(lens=(300, 1, 0, 97, 64), num_splits=2)
    q, k, v, table, lens = _inputs(c, 11)
    args = (jnp.asarray(q, jnp.float16), jnp.asarray(k, jnp.float16), jnp.asarray(v, jnp.float16), table, lens)
    got, real = [], mh._run

    def spy(cfg, dtype, page_table, lens_op, *a):  # under jit: the lengths operand through a callback
        jax.debug.callback(lambda x: got.append((cfg, np.asarray(x))), lens_op)
        return real(cfg, dtype, page_table, lens_op, *a)

    monkeypatch.setattr(mh, "_run", spy)
    with gpu_interpret():
        even = np.asarray(mh.mha_decode_heads(*args, num_splits=2), np.float32)
        bal = np.asarray(mh.mha_decode_heads(*args, num_splits=2, balanced=True), np.float32)
    jax.effects_barrier()
    (cfg_e, lens_e), (cfg_b, lens_b) = got
    max_blocks = -(-table.shape[1] * c.page_size // 64)
    assert not cfg_e.balanced and cfg_e.num_splits == 2 and lens_e.tolist() == list(c.lens)
    assert cfg_b.balanced and cfg_b.num_splits == combine.balanced_split_count(2, c.hkv, max_blocks) > 2
    nblk = -(-np.asarray(c.lens) // 64)
    per = lens_b[-1]
    assert lens_b[:-1].tolist() == list(c.lens) and per * cfg_b.num_splits >= nblk.max() and per >= 1
    assert per < -(-nblk.max() // 2), "the balanced size should cut the longest request finer than two splits"
    np.testing.assert_allclose(bal, even, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
def test_verify_calls_route_to_heads_kernel(monkeypatch):
    """A causal verify of 2 tokens x 32 query heads (64 rows: one tile of the all-heads
    kernel, the smallest call routed) through ``jattn.ops`` on the mosaic backend runs the
    per-KV-head kernel and matches the reference; with a window (which it does not serve)
    and with ``heads_kernel=False`` the call goes to the all-heads kernel (its entry is
    stubbed here: its own tests run it)."""
    from jattn import ops
    from jattn.pallas_kernels import mosaic_decode as md

    (q, k, v, table, lens), r, args, calls, all_heads = _routing(
        monkeypatch, Case(lens=(70, 0), hq=32, hkv=2, q_len=2), 3
    )
    with gpu_interpret():
        want = np.asarray(reference.mha_decode(r(q), r(k), r(v), table, lens, max_seqlen_q=2))
        got = np.asarray(ops.mha_decode_with_kvcache(*args, backend="mosaic", max_seqlen_q=2), np.float32)
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
        assert calls == [2] and all_heads == []
        md.mha_decode(*args, max_seqlen_q=2, window_left=33)
        assert calls == [2] and all_heads == [33], "a window must keep the call on the all-heads kernel"
        md.mha_decode(*args, max_seqlen_q=2, options=md.KernelOptions(heads_kernel=False))
        assert calls == [2] and all_heads == [33, -1], "heads_kernel=False must keep the call on the all-heads kernel"
    # explicit scales as traced values, single-token decode and fewer than 64 rows stay
    # (q_len 2 x 16 heads); 4 tokens x 32 heads move
    assert md.heads_kernel_for(args[0], args[1], args[2], 2, -1, 0.0, None, None, jnp.float32(1), 1.0) is None
    assert md.heads_kernel_for(args[0], args[1], args[2], 1, -1, 0.0, None, None, 1.0, 1.0) is None
    assert md.heads_kernel_for(args[0][:, :16], args[1], args[2], 2, -1, 0.0, None, None, 1.0, 1.0) is None
    q4 = jnp.concatenate([args[0], args[0]])
    assert md.heads_kernel_for(q4, args[1], args[2], 4, -1, 0.0, None, None, 1.0, 1.0) is not None


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
@pytest.mark.parametrize("hq, hkv, q_len", [(10, 5, 1), (32, 1, 2)], ids=["five_kv_heads", "mqa_group_32_verify"])
def test_heads_the_all_heads_kernel_cannot_tile_take_the_per_kv_head_kernel(monkeypatch, hq, hkv, q_len):
    """Five KV heads (no all-heads KV block of 64..256 rows) and a GQA group of 32 (past
    the all-heads kernel's 16): the mosaic backend serves them on the per-KV-head kernel,
    ``heads_kernel=False`` notwithstanding, and matches the reference; with a window,
    which that kernel does not serve, the backend refuses them with the all-heads
    kernel's reason (auto passes such calls on)."""
    from jattn import ops
    from jattn.pallas_kernels import mosaic_decode as md

    c = Case(lens=(97, 0, 1), hq=hq, hkv=hkv, d=64, page_size=16, q_len=q_len)
    (q, k, v, table, lens), r, args, calls, all_heads = _routing(monkeypatch, c, 11)
    kw = dict(max_seqlen_q=q_len)
    with gpu_interpret():
        assert md.unsupported_reason(*args[:3], **kw) is None
        want = np.asarray(reference.mha_decode(r(q), r(k), r(v), table, lens, **kw))
        got = np.asarray(ops.mha_decode_with_kvcache(*args, backend="mosaic", **kw), np.float32)
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
        md.mha_decode(*args, **kw, options=md.KernelOptions(heads_kernel=False))
        assert calls == [q_len, q_len] and all_heads == []
        reason = md.unsupported_reason(*args[:3], **kw, window_left=5)
        assert reason is not None and ("GQA group size 32" in reason or "no KV block" in reason), reason
        with pytest.raises(NotImplementedError, match="mosaic"):
            ops.mha_decode_with_kvcache(*args, backend="mosaic", **kw, window_left=5)


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
def test_fp8_heads_option_routes_fp8_decode(monkeypatch):
    """By default (``KernelOptions.fp8_heads``) an FP8 single-token decode goes through
    ``mosaic_decode.mha_decode`` to the per-KV-head kernel with the e4m3 query, the f16 V
    tile (``heads_v_regs`` off) and 64-token blocks (matching the reference over that query), and so does a
    causal 2-token verify; every FP8 call with ``fp8_heads=False`` stays on the all-heads
    kernel (stubbed here: its own tests run it)."""
    from jattn.pallas_kernels import mosaic_decode as md

    c = Case(lens=(140, 0, 1), hq=8, hkv=2, fp8=True)
    q, k, v, table, lens = _inputs(c, 4)
    kc, vc = jnp.asarray(k / 0.5, jnp.float8_e4m3fn), jnp.asarray(v / 0.5, jnp.float8_e4m3fn)
    qh = jnp.asarray(q, jnp.float16)
    calls, real = [], mh.mha_decode_heads
    monkeypatch.setattr(
        mh, "mha_decode_heads", lambda *a, **k: calls.append((k["fp8_qk"], k["block"], k["v_regs"])) or real(*a, **k)
    )
    all_heads = []
    monkeypatch.setattr(md, "_mha_decode", lambda q, *a, **k: all_heads.append(1) or jnp.zeros_like(q))
    args = (qh, kc, vc, jnp.asarray(table), jnp.asarray(lens))
    assert md.KernelOptions().fp8_heads
    with gpu_interpret():
        got = md.mha_decode(*args, k_scale=0.5, v_scale=0.5)
        assert calls == [(True, 64, False)] and all_heads == []
        verify = (jnp.concatenate([qh, qh]), *args[1:])  # 2 queries per request (values unchecked)
        md.mha_decode(*verify, k_scale=0.5, v_scale=0.5, max_seqlen_q=2)
        assert calls == [(True, 64, False)] * 2 and all_heads == [], "a causal FP8 verify takes the e4m3 path"
        md.mha_decode(*args, k_scale=0.5, v_scale=0.5, options=md.KernelOptions(heads_v_regs=True))
        assert calls[2] == (True, 64, True), "heads_v_regs reads V^T into registers"
        md.mha_decode(*args, k_scale=0.5, v_scale=0.5, options=md.KernelOptions(fp8_heads=False))
        assert len(calls) == 3 and all_heads == [1], "fp8_heads=False keeps FP8 on the all-heads kernel"
    want = reference.mha_decode(mh.fp8_qk_query(qh, 2), kc, vc, table, lens, k_scale=0.5, v_scale=0.5)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
def test_one_kv_head_single_query_calls_take_the_per_kv_head_kernel(monkeypatch):
    """A call with one KV head and one query per request (which the all-heads kernel does
    not compile on jax 0.11) runs the per-KV-head kernel, ``heads_kernel=False``
    notwithstanding, and matches the reference; with a window (which that kernel does not
    serve), or with two queries per request, it stays on the all-heads kernel (stubbed)."""
    from jattn.pallas_kernels import mosaic_decode as md

    (q, k, v, table, lens), r, args, calls, all_heads = _routing(
        monkeypatch, Case(lens=(97, 0, 1), hq=1, hkv=1, d=64), 6
    )
    with gpu_interpret():
        got = md.mha_decode(*args, options=md.KernelOptions(heads_kernel=False))
        assert calls == [1] and all_heads == []
        md.mha_decode(*args, window_left=5)
        assert calls == [1] and all_heads == [5]
        q2 = jnp.concatenate([args[0], args[0]])
        md.mha_decode(q2, *args[1:], max_seqlen_q=2)
        assert calls == [1] and all_heads == [5, -1]
    want = reference.mha_decode(r(q), r(k), r(v), table, lens)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)
    # FP8: the e4m3 query by default; heads_kernel=False keeps the exact query (it took the
    # e4m3 path there too), on the per-KV-head kernel still; the pipelined loop
    # (heads_overlap) is not asked of that exact-query FP8 path, which has none (it raised)
    kc, vc = jnp.asarray(k, jnp.float8_e4m3fn), jnp.asarray(v, jnp.float8_e4m3fn)
    fp8 = []
    monkeypatch.setattr(
        mh, "mha_decode_heads", lambda q, *a, **kw: fp8.append((kw.get("fp8_qk", False), kw["overlap"])) or q
    )
    md.mha_decode(args[0], kc, vc, table, lens)
    md.mha_decode(args[0], kc, vc, table, lens, options=md.KernelOptions(heads_kernel=False))
    md.mha_decode(args[0], kc, vc, table, lens, options=md.KernelOptions(fp8_heads=False, heads_overlap=True))
    md.mha_decode(args[0], *args[1:], options=md.KernelOptions(heads_overlap=True))  # 2-byte: pipelined
    assert fp8 == [(True, False), (False, False), (False, False), (False, True)] and all_heads == [5, -1]
    # the batch-invariant mode runs the all-heads kernel alone: refused with the reason
    # (ops passed it explicit block sizes, which skip the route), except with a window
    with gpu_interpret():
        reason = md.unsupported_reason(args[0], args[1], args[2], batch_invariant=True)
        assert reason is not None and "one KV head and one query per request" in reason
        assert md.unsupported_reason(q2, args[1], args[2], max_seqlen_q=2, batch_invariant=True) is None
        assert md.unsupported_reason(*args[:3], window_left=5, batch_invariant=True) is None
        # a cap or sinks: neither kernel builds it (the all-heads kernel's build fails layout
        # inference on the GPU, the per-KV-head kernel has neither), so auto passes it on and
        # a direct call says why instead of failing in the build
        for kw in (dict(logit_cap=30.0), dict(sinks=jnp.zeros(1)), dict(window_left=5, logit_cap=30.0)):
            assert "one KV head and one query per request" in md.unsupported_reason(*args[:3], **kw)
            with pytest.raises(ValueError, match="one KV head and one query per request with a logit cap"):
                md.mha_decode(*args, **kw)
        assert md.unsupported_reason(q2, *args[1:3], max_seqlen_q=2, logit_cap=30.0) is None
    assert all_heads == [5, -1]


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
@pytest.mark.parametrize("q_len, v_regs", [(2, False), (1, True)])
def test_fp8_qk_error_is_the_size_of_the_cache_rounding(q_len, v_regs):
    """Against the exact query, the e4m3 query's extra error stays within 1.5x of what the
    FP8 cache's own rounding costs (the reference over the rounded cache against the exact
    K/V) on the output, and within 2.5x on the LSE (nine draws gave 0.4-0.9x and 1.0-2.2x;
    docs/PERF.md): a 2-token verify with the f16 V tile, and the default FP8 decode path
    (q_len 1, ``v_regs``)."""
    c = Case(lens=(300, 97), hq=8, hkv=2, d=128, q_len=q_len, fp8=True)
    q, k, v, table, lens = _inputs(c, 1)
    kc, vc = jnp.asarray(k / 0.37, jnp.float8_e4m3fn), jnp.asarray(v / 0.61, jnp.float8_e4m3fn)
    kw = dict(max_seqlen_q=q_len, return_lse=True, v_regs=v_regs)
    qh = jnp.asarray(q, jnp.float16)
    q32 = jnp.asarray(qh, jnp.float32)
    ref_kw = dict(max_seqlen_q=q_len, return_lse=True)
    rounded = reference.mha_decode(q32, kc, vc, table, lens, k_scale=0.37, v_scale=0.61, **ref_kw)
    exact = reference.mha_decode(q32, jnp.asarray(k), jnp.asarray(v), table, lens, **ref_kw)
    with gpu_interpret():
        got = mh.mha_decode_heads(
            qh, kc, vc, jnp.asarray(table), jnp.asarray(lens), k_scale=0.37, v_scale=0.61, fp8_qk=True, **kw
        )
    for i, (what, bound) in enumerate((("out", 1.5), ("lse", 2.5))):
        err_qk = np.abs(np.asarray(got[i], np.float32) - np.asarray(rounded[i])).max()
        err_cache = np.abs(np.asarray(rounded[i]) - np.asarray(exact[i])).max()
        assert 0 < err_qk <= bound * err_cache, (what, err_qk, err_cache)


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
def test_fp8_qk_non_finite_query_rows():
    """A query row with a NaN or an Inf comes out NaN where it sees a key (as the exact
    query's would), 0 / -inf where it sees none, and sets no scale for the other rows of
    its KV head (they match the reference over ``fp8_qk_query``)."""
    c = Case(lens=(150, 0), hq=8, hkv=2, fp8=True)
    q, k, v, table, lens = _inputs(c, 2)
    q[0, 1, 3], q[0, 6, 0], q[1, 2, 5] = np.nan, np.inf, np.nan  # request 1 sees no key
    kc, vc = jnp.asarray(k / 0.5, jnp.float8_e4m3fn), jnp.asarray(v / 0.5, jnp.float8_e4m3fn)
    qh = jnp.asarray(q, jnp.float16)
    want_o, want_lse = reference.mha_decode(
        mh.fp8_qk_query(qh, 2), kc, vc, table, lens, k_scale=0.5, v_scale=0.5, return_lse=True
    )
    with gpu_interpret():
        o, lse = mh.mha_decode_heads(
            qh, kc, vc, jnp.asarray(table), jnp.asarray(lens), k_scale=0.5, v_scale=0.5, return_lse=True,
            fp8_qk=True, v_regs=True,
        )  # fmt: skip
        # glue=False: XLA ops move the layouts around the rows combine and apply the NaN rows
        # after it (KernelOptions.heads_glue; here both arms run XLA ops, so the same bits)
        o2, lse2 = mh.mha_decode_heads(
            qh, kc, vc, jnp.asarray(table), jnp.asarray(lens), k_scale=0.5, v_scale=0.5, return_lse=True,
            fp8_qk=True, v_regs=True, glue=False,
        )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(o2, np.float32), np.asarray(o, np.float32))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    assert np.isnan(o[0, 1]).all() and np.isnan(o[0, 6]).all() and np.isnan(lse[0, [1, 6]]).all()
    assert (o[1] == 0).all() and (lse[1] == -np.inf).all()
    ok = np.ones(o.shape[:2], bool)
    ok[0, [1, 6]] = False
    assert np.isfinite(o[ok]).all()
    np.testing.assert_allclose(o[ok], np.asarray(want_o)[ok], atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse[ok], np.asarray(want_lse)[ok], atol=2e-2, rtol=2e-2)


GPU_CASES = [
    Case(lens=(4096, 97, 0, 1, 2049, 777), hq=32, hkv=8, d=128, poison=0),
    Case(lens=(3000, 65), hq=32, hkv=8, d=128, q_len=4, poison=1),
    Case(lens=(1000, 5, 300), hq=32, hkv=8, d=128, q_len=8, causal=False, page_size=128),
    Case(lens=(32768,), hq=32, hkv=8, d=128),
    Case(lens=(1500, 0, 64), hq=16, hkv=8, d=64, q_len=2, poison=1),
    Case(lens=(4096, 97, 0, 1, 2049), hq=32, hkv=8, d=128, fp8=True, poison=3),
    Case(lens=(3000, 65), hq=32, hkv=8, d=128, q_len=4, fp8=True, page_size=128),
    Case(lens=(4096, 97, 0, 1, 2049), hq=32, hkv=8, d=128, page_size=16, q_len=4, poison=1),
    Case(lens=(3000, 65, 777), hq=32, hkv=8, d=128, page_size=32, q_len=8, causal=False),
    # persistent CTAs walking many items of uneven length (a few, and one per SM slot)
    Case(lens=(4096, 97, 0, 1, 2049, 777), hq=32, hkv=8, d=128, q_len=4, persistent=True, num_ctas=7, poison=0),
    Case(lens=(4096, 97, 0, 1, 2049, 777), hq=32, hkv=8, d=128, q_len=4, persistent=True),
    Case(lens=(1500, 3, 64), hq=32, hkv=8, d=128, q_len=4, fp8=True, persistent=True, num_ctas=5),
    # 8-token verify in 16-row tiles (two items per split and KV head)
    Case(lens=(4096, 97, 0, 1, 2049, 777), hq=32, hkv=8, d=128, q_len=8, poison=2, row_tile=16),
    Case(lens=(3000, 65, 777), hq=32, hkv=8, d=128, page_size=16, q_len=8, causal=False, row_tile=16),
    # FP8 with an e4m3 query: 128-token blocks (the fast path's shape) and 64
    Case(lens=(4096, 97, 0, 1, 2049), hq=32, hkv=8, d=128, fp8=True, fp8_qk=True, block=128, poison=3),
    Case(lens=(3000, 65), hq=32, hkv=8, d=128, page_size=16, q_len=4, fp8=True, fp8_qk=True, block=128, poison=1),
    Case(lens=(1500, 0, 64), hq=16, hkv=8, d=64, page_size=128, q_len=2, fp8=True, fp8_qk=True),
    # the default FP8 path (fp8_qk, f16 V tile, 64-token blocks): decode, 8-token verify, draft block
    Case(lens=(4096, 97, 0, 1, 2049), hq=32, hkv=8, d=128, page_size=16, fp8=True, fp8_qk=True, poison=3),
    Case(lens=(3000, 65, 0, 1), hq=32, hkv=8, d=128, page_size=16, q_len=8, fp8=True, fp8_qk=True, poison=1),
    Case(lens=(2049, 97), hq=32, hkv=8, d=128, page_size=64, q_len=4, causal=False, fp8=True, fp8_qk=True),
    # and V^T in registers (q_len 1 over pages of 16 and 64; a non-causal draft block at d64)
    Case(
        lens=(4096, 97, 0, 1, 2049),
        hq=32,
        hkv=8,
        d=128,
        page_size=16,
        fp8=True,
        fp8_qk=True,
        v_regs=True,
        block=128,
        poison=3,
    ),  # fmt: skip
    Case(lens=(3000, 65, 1), hq=32, hkv=8, d=128, fp8=True, fp8_qk=True, v_regs=True, block=64, poison=0),
    Case(
        lens=(4096, 97, 0, 1, 2049),
        hq=32,
        hkv=8,
        d=128,
        page_size=16,
        fp8=True,
        fp8_qk=True,
        v_regs=True,
        overlap=True,
        poison=3,
    ),  # fmt: skip
    Case(
        lens=(3000, 65, 777),
        hq=32,
        hkv=8,
        d=128,
        q_len=4,
        causal=False,
        fp8=True,
        fp8_qk=True,
        v_regs=True,
        overlap=True,
        persistent=True,
        num_ctas=7,
    ),  # fmt: skip
    Case(
        lens=(1500, 0, 64),
        hq=16,
        hkv=8,
        d=64,
        page_size=32,
        q_len=4,
        causal=False,
        fp8=True,
        fp8_qk=True,
        v_regs=True,
        block=128,
        poison=2,
    ),  # fmt: skip
    Case(lens=(4096, 97, 0, 1, 2049, 777), hq=32, hkv=8, d=128, q_len=4, block=128),
    # FP8 causal verify with V^T in registers (per-key NaN flags), with and without overlap
    Case(
        lens=(3000, 65, 0, 1), hq=32, hkv=8, d=128, page_size=16, q_len=4, fp8=True, fp8_qk=True, v_regs=True, poison=1
    ),  # fmt: skip
    Case(
        lens=(4096, 97, 777), hq=32, hkv=8, d=128, q_len=2, fp8=True, fp8_qk=True, v_regs=True, overlap=True, poison=0
    ),  # fmt: skip
    # 2-byte K/V with overlap: the verify rows of the benchmark (q_len 4 causal, 8 causal)
    Case(lens=(4096, 97, 0, 1, 2049), hq=32, hkv=8, d=128, page_size=16, q_len=4, poison=1, overlap=True),
    Case(lens=(3000, 65, 777), hq=32, hkv=8, d=128, q_len=8, poison=2, overlap=True),
]


def _gpu_check(c: Case):
    if not on_gpu():
        pytest.skip("needs a GPU")
    _check(c, jnp.bfloat16, tol=3e-2, deterministic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=str)
def test_gpu(c):
    _gpu_check(c)


# balanced splits: the default FP8 path (e4m3 query, pages of 16) and a 4-token verify
GPU_BALANCED_CASES = [
    Case(
        lens=(4096, 97, 0, 1, 2049, 777),
        hq=32,
        hkv=8,
        d=128,
        page_size=16,
        fp8=True,
        fp8_qk=True,
        poison=3,
        balanced=True,
    ),  # fmt: skip
    Case(lens=(3000, 65, 0, 1), hq=32, hkv=8, d=128, page_size=16, q_len=4, poison=1, balanced=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_BALANCED_CASES, ids=str)
def test_gpu_balanced(c):
    _gpu_check(c)


@pytest.mark.gpu
def test_gpu_verify_through_ops(monkeypatch):
    """On the GPU, ``jattn.ops`` (auto backend) sends a causal 4-token verify at 32/8 heads
    to the per-KV-head kernel and gets the reference's result."""
    if not on_gpu():
        pytest.skip("needs a GPU")
    from jattn import ops

    c = Case(lens=(3000, 97, 0, 1), hq=32, hkv=8, d=128, q_len=4)
    q, k, v, table, lens = _inputs(c, 5)
    r = lambda a: jnp.asarray(jnp.asarray(a, jnp.bfloat16), jnp.float32)  # noqa: E731
    want = np.asarray(reference.mha_decode(r(q), r(k), r(v), table, lens, max_seqlen_q=4))
    calls = _spy(monkeypatch)
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), table, lens)
    got = np.asarray(ops.mha_decode_with_kvcache(*args, max_seqlen_q=4), np.float32)
    assert calls == [4]
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "hq, hkv, q_len, fp8", [(40, 10, 1, False), (40, 10, 2, True), (32, 1, 2, False), (64, 1, 1, True)], ids=str
)
def test_gpu_heads_the_all_heads_kernel_cannot_tile_through_ops(monkeypatch, hq, hkv, q_len, fp8):
    """On the GPU, ``jattn.ops`` with ``backend="mosaic"`` runs 40/10 heads (no all-heads
    KV block) and MQA groups of 32 and 64 on the per-KV-head kernel and gets the
    reference's result (FP8: the reference over the e4m3 query the kernel uses). Auto
    leaves them to the next kernel (KV heads not a multiple of 8: measured faster on
    Triton, docs/PERF.md)."""
    if not on_gpu():
        pytest.skip("needs a GPU")
    from jattn import ops
    from jattn.pallas_kernels import mosaic_decode as md

    c = Case(lens=(3000, 97, 0, 1), hq=hq, hkv=hkv, d=128, page_size=16, q_len=q_len)
    q, k, v, table, lens = _inputs(c, 9)
    kd = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, kd), jnp.asarray(v, kd), table, lens)
    qr = mh.fp8_qk_query(args[0], hkv, q_len, 0) if fp8 else args[0]
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    want = np.asarray(reference.mha_decode(f32(qr), f32(args[1]), f32(args[2]), table, lens, max_seqlen_q=q_len))
    calls = _spy(monkeypatch)
    assert md.unsupported_reason(*args[:3], max_seqlen_q=q_len) is None
    assert md.auto_skip_reason(*args[:3]) is not None
    got = np.asarray(ops.mha_decode_with_kvcache(*args, max_seqlen_q=q_len, backend="mosaic"), np.float32)
    assert calls == [q_len]
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_gpu_fp8_decode_through_ops(monkeypatch):
    """On the GPU, ``jattn.ops`` (auto backend) runs an FP8 single-token decode at 32/8
    heads on the per-KV-head kernel's e4m3-query path (the default) and gets the
    reference's result over the rounded query; poison in unused pages stays out."""
    if not on_gpu():
        pytest.skip("needs a GPU")
    from jattn import ops

    c = Case(lens=(3000, 97, 0, 1, 2049), hq=32, hkv=8, d=128, page_size=16, fp8=True)
    q, k, v, table, lens = _inputs(c, 6)
    kc, vc = jnp.asarray(k / 0.4, jnp.float8_e4m3fn), jnp.asarray(v / 0.7, jnp.float8_e4m3fn)
    qh = jnp.asarray(q, jnp.bfloat16)
    want = reference.mha_decode(mh.fp8_qk_query(qh, 8), kc, vc, table, lens, k_scale=0.4, v_scale=0.7)
    calls = _spy(monkeypatch)
    got = ops.mha_decode_with_kvcache(qh, kc, vc, jnp.asarray(table), jnp.asarray(lens), k_scale=0.4, v_scale=0.7)
    assert calls == [1]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len, fp8", [(1, True), (4, False), (2, True)])
def test_gpu_glue_kernels_same_bits(q_len, fp8):
    """On the GPU the Triton glue (the e4m3 query kernel, the combine reading the kernel's
    layout, NaN rows) gives the results of the XLA ops that move the layouts instead, at
    batch 1 (33 splits: the combine runs) and with a NaN query row: the same e4m3 query, so
    the same partials; the two combines may sum the splits in another order (f32)."""
    if not on_gpu():
        pytest.skip("needs a GPU")
    from jattn.pallas_kernels import e4m3_query

    if not e4m3_query._kernel_runs_here(128, 16):
        pytest.skip("needs jax-triton")
    c = Case(lens=(32768,), hq=32, hkv=8, d=128, q_len=q_len, fp8=fp8)
    q, k, v, table, lens = _inputs(c, 7)
    q[0, 3, 7] = np.nan
    dt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(table), jnp.asarray(lens))
    kw = dict(max_seqlen_q=q_len, return_lse=True, fp8_qk=fp8, v_regs=fp8, block=64 if fp8 else 128)
    on = mh.mha_decode_heads(*args, **kw)
    off = mh.mha_decode_heads(*args, glue=False, **kw)
    # bf16 outputs: one f32 ulp of difference can move a value to the next bf16 (2^-8)
    for a, b, tol in zip(on, off, (2.0**-7, 1e-5)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=tol, atol=tol)
    assert np.isnan(np.asarray(on[0], np.float32)[0, 3]).all()  # the NaN row sees keys


LOWER = [(32, 8, 128, 64, 1, True, False), (32, 8, 128, 64, 4, True, False), (16, 8, 64, 128, 8, False, False),
         (32, 8, 128, 64, 1, True, True), (32, 8, 128, 128, 4, True, True), (32, 8, 128, 16, 4, True, False),
         (32, 8, 128, 32, 1, True, True), (32, 8, 128, 16, 8, False, False),
         # heads the all-heads kernel cannot tile (10 KV heads; MQA groups of 32 and 64)
         (40, 10, 128, 16, 1, True, False), (40, 10, 128, 16, 2, True, True), (32, 1, 128, 64, 2, True, False),
         (64, 1, 128, 16, 1, True, True)]  # fmt: skip


@pytest.mark.skipif(on_gpu(), reason="the GPU runs the kernel itself")
@pytest.mark.parametrize("hq, hkv, d, page_size, q_len, causal, fp8", LOWER)
@pytest.mark.parametrize(
    "row_tile, block, fp8_qk, v_regs, overlap",
    [
        (0, 64, False, False, False),
        (16, 64, False, False, False),
        (0, 128, False, False, False),
        (0, 128, True, False, False),
        (0, 128, True, True, False),
        (0, 64, True, True, True),
        (0, 64, False, False, True),
    ],
)
def test_lowers_for_cuda(hq, hkv, d, page_size, q_len, causal, fp8, row_tile, block, fp8_qk, v_regs, overlap):
    """What the CPU can check of the compiled program: the cuda lowering (TMA boxes of
    the 2-D view, the transposed V operand, swizzles shared by one wgmma's operands)."""
    bs = 3
    if fp8_qk and not fp8:
        pytest.skip("fp8_qk is for FP8 caches")
    if overlap and fp8 and not v_regs:
        pytest.skip("overlap on an FP8 cache is for v_regs")
    q = jnp.zeros((bs * q_len, hq, d), jnp.bfloat16)
    pool = jnp.zeros((40, page_size, hkv, d), jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    pt, lens = jnp.zeros((bs, 10), jnp.int32), jnp.array([600, 1, 0], jnp.int32)

    def fn(q, k, v):
        kw = dict(max_seqlen_q=q_len, is_causal=causal, num_splits=2, row_tile=row_tile, block=block, fp8_qk=fp8_qk)
        kw.update(v_regs=v_regs, overlap=overlap)
        return mh.mha_decode_heads(q, k, v, pt, lens, **kw)

    text = jax.jit(fn).trace(q, pool, pool).lower(lowering_platforms=("cuda",)).as_text()
    assert "jattn_decode_heads" in text
    # the options the call asked for are the ones built (kernel name suffixes)
    assert ("_vregs" in text) == v_regs and ("_ovl" in text) == overlap


@pytest.mark.skipif(on_gpu(), reason="the GPU runs the kernel itself")
@pytest.mark.parametrize("q_len, fp8", [(1, True), (4, False)])
def test_balanced_lowers_for_cuda(q_len, fp8):
    """Balanced splits (the split size read after the lengths) lower for cuda on the
    default FP8 path and on a 4-token verify, and the kernel built is the balanced one."""
    q = jnp.zeros((3 * q_len, 32, 128), jnp.bfloat16)
    pool = jnp.zeros((40, 16, 8, 128), jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    pt, lens = jnp.zeros((3, 40), jnp.int32), jnp.array([600, 1, 0], jnp.int32)

    def fn(q, k, v):
        return mh.mha_decode_heads(q, k, v, pt, lens, max_seqlen_q=q_len, fp8_qk=fp8, balanced=True)

    text = jax.jit(fn).trace(q, pool, pool).lower(lowering_platforms=("cuda",)).as_text()
    assert "jattn_decode_heads" in text and "_bal" in text


def test_two_ctas_per_sm_where_they_fit():
    """2-byte K/V with N <= 32 runs two CTAs per SM (the ring shrinks to two slots where
    three would not fit half the SM's shared memory); FP8 and N = 64 run one."""

    def cfg(d, q_len, group, fp8=False):
        return mh.HeadsConfig(
            head_dim=d, group=group, kv_heads=8, q_len=q_len, is_causal=True, page_size=64, num_pages=9,
            max_pages=4, num_splits=1, batch=2, ctas=1, scale=1.0, fp8=fp8, interpret=False,
        )  # fmt: skip

    half = 114 * 1024 - 1024
    for c, paired, stages in [
        (cfg(128, 4, 4), True, 3),
        (cfg(128, 8, 4), True, 2),
        (cfg(64, 8, 4), True, 3),
        (cfg(128, 8, 8), False, 3),
        (cfg(128, 4, 4, fp8=True), False, 3),
    ]:
        assert (c.paired, c.stages) == (paired, stages), c
        assert not c.paired or c.smem_bytes(c.stages) <= half
    # the persistent launch: the SM slots, never more CTAs than items (8 KV heads x 2 requests)
    assert mh.launch_ctas(cfg(128, 4, 4), None) == 16
    assert mh.launch_ctas(dataclasses.replace(cfg(128, 4, 4), num_splits=40), None) == 2 * 132
    assert mh.launch_ctas(dataclasses.replace(cfg(128, 8, 8), num_splits=40), None) == 132
    assert mh.launch_ctas(cfg(128, 4, 4), 5) == 5 and mh.launch_ctas(cfg(128, 4, 4), -1) == 16
    # FP8 with the e4m3 query over 128-token blocks: the ring holds e4m3 tiles, Q is e4m3,
    # and V^T in registers drops the upcast tile; each is what leaves room for the slots
    fp8_qk = dict(fp8=True, fp8_qk=True, block=128)
    for c, paired, stages in [
        (dataclasses.replace(cfg(64, 1, 1), **fp8_qk), True, 3),
        (dataclasses.replace(cfg(64, 1, 1), **fp8_qk, v_regs=True), True, 6),
        (dataclasses.replace(cfg(128, 2, 8), **fp8_qk, v_regs=True), True, 3),
    ]:
        assert (c.paired, c.stages) == (paired, stages), c
        assert c.smem_bytes(c.stages) <= half


def test_split_count_fills_two_ctas_per_sm_within_the_blocks():
    """``choose_num_splits``: about two CTAs per SM over the (request, KV head, row tile)
    programs, never more splits than 64-token blocks of the page table (a partial last one
    counted)."""
    assert mh.choose_num_splits(1, 8, 4096) == -(-2 * 132 // 8)
    assert mh.choose_num_splits(2, 8, 4096, tiles=2) == -(-2 * 132 // 32)
    assert mh.choose_num_splits(1, 8, 100) == 2 and mh.choose_num_splits(1, 8, 64) == 1
    assert mh.choose_num_splits(1, 1, 1000, block=128) == 8


def test_unsupported_reasons():
    q = jnp.zeros((2, 32, 128), jnp.bfloat16)
    pool = jnp.zeros((4, 64, 8, 128), jnp.bfloat16)
    assert mh.unsupported_reason(q, pool, pool) is None
    assert mh.unsupported_reason(q, pool.astype(jnp.float8_e4m3fn), pool.astype(jnp.float8_e4m3fn)) is None
    assert "dtypes" in mh.unsupported_reason(q, pool.astype(jnp.float8_e4m3fn), pool)
    assert "dtypes" in mh.unsupported_reason(q, pool.astype(jnp.float16), pool.astype(jnp.float16))
    assert "page_size" in mh.unsupported_reason(q, pool[:, :8], pool[:, :8])
    assert "head_dim" in mh.unsupported_reason(q[..., :96], pool[..., :96], pool[..., :96])
    assert "max_seqlen_q" in mh.unsupported_reason(q, pool, pool, max_seqlen_q=9)
    assert "window_left" in mh.unsupported_reason(q, pool, pool, window_left=10)
    assert "sinks" in mh.unsupported_reason(q, pool, pool, sinks=jnp.zeros(32))
    assert "head_dim" in mh.unsupported_reason(q[..., :64], pool, pool)
    q256, pool256 = jnp.zeros((2, 32, 256), jnp.bfloat16), jnp.zeros((4, 64, 8, 256), jnp.bfloat16)
    assert "head_dim=256 (64 or 128)" in mh.unsupported_reason(q256, pool256, pool256)
    # at most 64 query rows per KV head (the MMA's widest N): 8 tokens x a group of 16 is 128
    q16 = jnp.zeros((16, 32, 128), jnp.bfloat16)
    assert mh.unsupported_reason(q16, pool[:, :, :4], pool[:, :, :4], max_seqlen_q=8) is None  # 8 x 8 rows
    assert "at most 64 rows" in mh.unsupported_reason(q16, pool[:, :, :2], pool[:, :, :2], max_seqlen_q=8)
    assert "not a multiple of max_seqlen_q=4" in mh.unsupported_reason(q[:1], pool, pool, max_seqlen_q=4)
    with pytest.raises(ValueError, match="page_size"):
        mh.mha_decode_heads(q, pool[:, :8], pool[:, :8], jnp.zeros((2, 1), jnp.int32), jnp.ones(2, jnp.int32))


def test_mha_decode_checks_the_plan_before_routing():
    """A page table or lengths of another batch than ``q``'s is refused by name on either
    kernel's path (a verify call would otherwise reach the per-KV-head kernel unchecked)."""
    from jattn.pallas_kernels import mosaic_decode as md

    q = jnp.zeros((8, 32, 128), jnp.bfloat16)  # 2 requests x 4 tokens
    pool = jnp.zeros((4, 64, 8, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="page_table shape"):
        md.mha_decode(q, pool, pool, jnp.zeros((3, 1), jnp.int32), jnp.ones(3, jnp.int32), max_seqlen_q=4)
    with pytest.raises(ValueError, match="cache_seqlens shape"):
        md.mha_decode(q, pool, pool, jnp.zeros((2, 1), jnp.int32), jnp.ones(3, jnp.int32), max_seqlen_q=4)
    # the per-KV-head kernel's and the MLA kernel's own entry points check it too (their
    # kernels read the query by the page table's batch: 2 rows and 3 requests read past q)
    from jattn.pallas_kernels import mosaic_mla

    for rows, batch in ((2, 3), (4, 2)):
        with pytest.raises(ValueError, match=rf"page_table shape \({batch}, 1\) != \(bs={rows}"):
            mh.mha_decode_heads(q[:rows], pool, pool, jnp.zeros((batch, 1), jnp.int32), jnp.ones(batch, jnp.int32))
        with pytest.raises(ValueError, match=rf"page_table shape \({batch}, 1\) != \(bs={rows}"):
            latent = jnp.zeros((4, 64, 576), jnp.bfloat16)
            mosaic_mla.mla_decode(
                jnp.zeros((rows, 16, 576), jnp.bfloat16),
                latent,
                jnp.zeros((batch, 1), jnp.int32),
                jnp.ones(batch, jnp.int32),
                kv_lora_rank=512,
                softmax_scale=0.1,
            )


@pytest.mark.parametrize("fp8", [False, True])
def test_direct_entry_points_with_no_requests(fp8):
    """No requests: empty outputs of the usual shapes and dtypes (LSE -inf), no launch, on
    the decode entry points the ops do not shield (the ops return empty calls before any
    kernel). An FP8 call went to the per-KV-head kernel, whose split combine failed on the
    empty batch; the all-heads path failed choosing its split count."""
    from jattn.pallas_kernels import mosaic_decode as md
    from jattn.pallas_kernels import mosaic_mla

    kv_dt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    pool = jnp.zeros((4, 16, 2, 64), kv_dt)
    pt, lens = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32)
    for q_len in (1, 4):
        q = jnp.zeros((0, 8, 64), jnp.bfloat16)
        for f in (md.mha_decode, mh.mha_decode_heads):
            o, lse = f(q, pool, pool, pt, lens, max_seqlen_q=q_len, return_lse=True)
            assert (o.shape, o.dtype, lse.shape, lse.dtype) == ((0, 8, 64), jnp.bfloat16, (0, 8), jnp.float32)
    q_dt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    o, lse = mosaic_mla.mla_decode(
        jnp.zeros((0, 16, 576), q_dt),
        jnp.zeros((4, 64, 576), kv_dt),
        pt,
        lens,
        kv_lora_rank=512,
        softmax_scale=0.1,
        return_lse=True,
    )
    assert (o.shape, o.dtype, lse.shape) == ((0, 16, 512), jnp.bfloat16, (0, 16))
    # no query heads: zero-width rows for every request
    o = md.mha_decode(
        jnp.zeros((2, 0, 64), jnp.bfloat16), pool, pool, jnp.zeros((2, 1), jnp.int32), jnp.ones(2, jnp.int32)
    )
    assert o.shape == (2, 0, 64)


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
def test_interpreter_compiles_each_warpgroup_program_once(monkeypatch):
    """Under ``gpu_interpret`` a kernel of 4 CTAs x 2 warpgroups compiles its body once (the
    interpreter alone compiles it per grid point and thread); a second call with new data
    compiles nothing and both match the reference."""
    import collections

    from jattn.pallas_kernels import interpret

    monkeypatch.setattr(interpret, "_compiled", collections.OrderedDict())  # empty: count this test's
    c = Case(lens=(70, 100), hq=8, hkv=2, q_len=2, causal=False)
    with gpu_interpret():
        from jax._src.pallas.mosaic.interpret import thread_map  # private, as the helper

        assert thread_map._run_jaxpr is interpret._run_jaxpr_compiled_once
        for seed in (1, 2):
            before = len(interpret._compiled)
            q, k, v, table, lens = _inputs(c, seed)
            f = [jnp.asarray(x, jnp.float16) for x in (q, k, v)]
            got = mh.mha_decode_heads(*f, table, lens, max_seqlen_q=2, is_causal=False, num_splits=1)
            r = [jnp.asarray(x, jnp.float32) for x in f]
            want = reference.mha_decode(*r, table, lens, max_seqlen_q=2, is_causal=False)
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)
            assert len(interpret._compiled) - before == (1 if seed == 1 else 0), len(interpret._compiled)


def test_row_tiles():
    """Row tiles split a KV head's rows only where the tile is smaller than the rows; a
    tile size the kernel has no MMA shape for is refused by name."""
    assert [mh.row_tiles(rows, 16) for rows in (8, 16, 17, 24, 32, 64)] == [1, 1, 2, 2, 2, 4]
    assert mh.row_tiles(64, 0) == 1 and mh.row_tiles(32, 32) == 1
    q = jnp.zeros((2 * 8, 8, 64), jnp.bfloat16)
    pool = jnp.zeros((4, 64, 2, 64), jnp.bfloat16)
    pt, lens = jnp.zeros((2, 2), jnp.int32), jnp.array([5, 0], jnp.int32)
    with pytest.raises(ValueError, match=r"row_tile=8 must be 0 \(no tiles\), 16 or 32"):
        mh.mha_decode_heads(q, pool, pool, pt, lens, max_seqlen_q=8, row_tile=8)
    with pytest.raises(ValueError, match=r"block=96 must be 64 or 128 tokens"):
        mh.mha_decode_heads(q, pool, pool, pt, lens, max_seqlen_q=8, block=96)
    for splits in (0, 1.5, True):  # 0 failed in a numpy reduction, naming nothing
        with pytest.raises(ValueError, match=rf"num_splits={splits!r} must be an int >= 1"):
            mh.mha_decode_heads(q, pool, pool, pt, lens, max_seqlen_q=8, num_splits=splits)
    with pytest.raises(ValueError, match=r"fp8_qk needs an FP8 e4m3 cache, got bfloat16"):
        mh.mha_decode_heads(q, pool, pool, pt, lens, max_seqlen_q=8, fp8_qk=True)
    with pytest.raises(ValueError, match=r"v_regs needs fp8_qk=True"):
        mh.mha_decode_heads(q, pool, pool, pt, lens, max_seqlen_q=8, v_regs=True)
    pool8 = pool.astype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"overlap on an FP8 cache needs v_regs=True"):
        mh.mha_decode_heads(q, pool8, pool8, pt, lens, max_seqlen_q=8, fp8_qk=True, overlap=True)
