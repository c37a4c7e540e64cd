"""Planners (plan_decode / plan_extend), the page allocator, and no-retrace under jit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import DUMMY_PAGE, ForwardMode, LayerSpec, MHABackend, MHAConfig, PageAllocator, PagedKVCache
from jattn.kv_cache import PagePoolExhausted
from jattn.metadata import bucket


def _fields(md):
    return {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}


def _assert_same_md(a, b):
    assert type(a) is type(b)
    fa, fb = _fields(a), _fields(b)
    for name in fa:
        np.testing.assert_array_equal(np.asarray(fa[name]), np.asarray(fb[name]), err_msg=name)


# ----------------------------------------------------------------------------- plan_decode


@pytest.mark.parametrize("q_len", [1, 3])
def test_plan_decode_padding_slots_positions(q_len):
    rng = np.random.default_rng(q_len)
    ps = 16
    seq_lens = np.array([97, 16, 17, 3])
    need = -(-seq_lens // ps)
    pages = rng.permutation(np.arange(1, 40))
    pt = np.zeros((4, 8), np.int64)
    i = 0
    for b, n in enumerate(need):
        pt[b, :n] = pages[i : i + n]
        i += n
    md = jattn.plan_decode(
        seq_lens, page_size=ps, page_table=pt, q_len=q_len, num_pages=40, batch_buckets=(1, 2, 8, 16)
    )
    assert md.batch_size == 8 and md.max_seqlen_q == q_len and md.page_size == ps
    assert md.num_tokens == 8 * q_len and int(md.num_reqs) == 4
    assert md.page_table.dtype == np.int32 and md.cache_seqlens.dtype == np.int32
    assert md.out_cache_loc.dtype == np.int32 and md.positions.dtype == np.int32
    np.testing.assert_array_equal(md.cache_seqlens, [97, 16, 17, 3, 0, 0, 0, 0])
    assert (md.page_table[4:] == DUMMY_PAGE).all()
    assert md.page_table.shape[1] == 8  # power-of-two bucket of the 7 pages needed
    loc = md.out_cache_loc.reshape(8, q_len)
    pos = md.positions.reshape(8, q_len)
    assert (loc[4:] == DUMMY_PAGE * ps).all(), "padding writes go to the dummy slot"
    for b, length in enumerate(seq_lens):
        for i in range(q_len):
            p = length - q_len + i
            assert pos[b, i] == p
            assert loc[b, i] == pt[b, p // ps] * ps + p % ps
    # Real entries of the table are kept; entries past a request's pages are the dummy page.
    for b, n in enumerate(need):
        np.testing.assert_array_equal(md.page_table[b, :n], pt[b, :n])
        assert (md.page_table[b, n:] == DUMMY_PAGE).all()


def test_plan_decode_req_to_page_equals_page_table():
    rng = np.random.default_rng(5)
    req_to_page = rng.permutation(np.arange(1, 64))[:60].reshape(10, 6)  # no page in two rows
    idx = np.array([7, 2, 9])
    seq_lens = np.array([80, 1, 33])
    a = jattn.plan_decode(seq_lens, page_size=16, req_to_page=req_to_page, req_pool_indices=idx, num_pages=64)
    b = jattn.plan_decode(seq_lens, page_size=16, page_table=req_to_page[idx], num_pages=64)
    _assert_same_md(a, b)


def test_bucket_sizes():
    assert [bucket(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert bucket(3, (1, 4, 12)) == 4 and bucket(5, (12, 4, 1)) == 12
    with pytest.raises(ValueError, match="batch size=13 exceeds the largest bucket 12"):
        bucket(13, (1, 4, 12), name="batch size")
    for bs, want in [(1, 1), (3, 4), (9, 16), (100, 128)]:
        pt = np.arange(1, bs + 1, dtype=np.int32)[:, None]  # one page of its own per request
        md = jattn.plan_decode(np.full(bs, 5), page_size=8, page_table=pt)
        assert md.batch_size == want and md.num_tokens == want


# ----------------------------------------------------------------------------- plan_extend


def test_plan_extend_ragged_padding_positions():
    ps = 8
    seq_lens = np.array([20, 5, 9, 12])
    ext = np.array([4, 5, 0, 3])
    prefix = seq_lens - ext
    pt = np.array([[3, 4, 5, 0], [6, 0, 0, 0], [7, 8, 0, 0], [9, 10, 0, 0]])
    md = jattn.plan_extend(
        seq_lens, ext, page_size=ps, page_table=pt, extend_prefix_lens=prefix, num_pages=11, batch_buckets=(8,)
    )
    assert md.batch_size == 8 and int(md.num_reqs) == 4
    assert md.num_tokens == 16  # 12 tokens -> token bucket >= 16
    assert md.max_seqlen_q == 8  # longest request (5) -> power-of-two bucket
    assert md.has_prefix and md.is_causal
    np.testing.assert_array_equal(md.cu_seqlens_q, [0, 4, 9, 9, 12, 12, 12, 12, 12])
    np.testing.assert_array_equal(md.cache_seqlens, [20, 5, 9, 12, 0, 0, 0, 0])
    np.testing.assert_array_equal(md.prefix_lens, [16, 0, 9, 9, 0, 0, 0, 0])
    want_pos = [16, 17, 18, 19, 0, 1, 2, 3, 4, 9, 10, 11]
    np.testing.assert_array_equal(md.positions[:12], want_pos)
    rows = [0] * 4 + [1] * 5 + [3] * 3
    for t, (b, p) in enumerate(zip(rows, want_pos)):
        assert md.out_cache_loc[t] == pt[b, p // ps] * ps + p % ps
    assert (md.out_cache_loc[12:] == DUMMY_PAGE * ps).all()
    assert (md.page_table[4:] == DUMMY_PAGE).all()


def test_plan_extend_prefill_buckets_and_req_to_page():
    rng = np.random.default_rng(9)
    seq_lens = np.array([97, 1, 33])
    r2p = rng.integers(1, 50, size=(6, 8))
    idx = np.array([5, 0, 3])
    kw = dict(page_size=16, num_pages=50, token_buckets=(64, 256), max_seqlen_q_buckets=(32, 128))
    a = jattn.plan_extend(seq_lens, seq_lens, req_to_page=r2p, req_pool_indices=idx, **kw)
    b = jattn.plan_extend(seq_lens, seq_lens, page_table=r2p[idx], **kw)
    _assert_same_md(a, b)
    assert not a.has_prefix
    assert a.num_tokens == 256 and a.max_seqlen_q == 128
    np.testing.assert_array_equal(a.positions[:97], np.arange(97))


# ----------------------------------------------------------------------------- allocator


def test_page_allocator_alloc_free():
    alloc = PageAllocator(6)
    assert alloc.num_free == 5
    a = alloc.alloc(3)
    b = alloc.alloc(2)
    assert DUMMY_PAGE not in a + b and sorted(a + b) == [1, 2, 3, 4, 5]
    assert alloc.alloc(0) == [] and alloc.num_free == 0
    with pytest.raises(PagePoolExhausted, match=r"asked for 1 pages, 0 of 5 free"):
        alloc.alloc(1)
    alloc.free(a)
    assert alloc.num_free == 3
    c = alloc.alloc(3)
    assert sorted(c) == sorted(a)
    with pytest.raises(PagePoolExhausted, match="page pool exhausted"):
        alloc.alloc(4)
    assert alloc.num_free == 0, "a failed alloc must not take pages"
    assert PageAllocator.pages_for(33, 16) == 3 and PageAllocator.pages_for(0, 16) == 0


def test_page_allocator_never_hands_out_dummy_page():
    alloc = PageAllocator(50)
    seen = set()
    rng = np.random.default_rng(0)
    held = []
    for _ in range(200):
        if held and rng.random() < 0.5:
            alloc.free(held.pop(rng.integers(len(held))))
        elif alloc.num_free:
            got = alloc.alloc(int(rng.integers(1, alloc.num_free + 1)))
            held.append(got)
            seen.update(got)
        live = [p for h in held for p in h]
        assert len(live) == len(set(live)), "a page is held twice"
        assert alloc.num_free + len(live) == 49
    assert DUMMY_PAGE not in seen


def test_page_allocator_double_free_and_bad_ids():
    alloc = PageAllocator(8)
    pages = alloc.alloc(3)
    alloc.free(pages[:1])
    with pytest.raises(ValueError, match=r"page \d+ is not allocated \(double free\?\)"):
        alloc.free(pages[:1])
    with pytest.raises(ValueError, match=r"page 0 out of range \[1, 8\)"):
        alloc.free([0])
    with pytest.raises(ValueError, match="out of range"):
        alloc.free([8])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([pages[1], pages[1]])  # a duplicate inside one call
    alloc.free(pages[1:])
    assert alloc.num_free == 7
    assert len(set(alloc.alloc(7))) == 7
    with pytest.raises(ValueError, match="num_pages=1 must be >= 2"):
        PageAllocator(1)


# ----------------------------------------------------------------------------- no retrace


def _mha_setup(num_pages=64):
    cfg = MHAConfig(
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=8,
        context_len=256,
        num_pages=num_pages,
        kv_cache_dtype="float32",
        kernel_backend="xla",
        batch_buckets=(2, 4, 8),
    )
    be = MHABackend(cfg)
    layer = LayerSpec(0, 4, 2, 16)
    cache = PagedKVCache.create(
        num_layers=1, num_pages=num_pages, page_size=8, num_kv_heads=2, head_dim=16, dtype="float32"
    )
    return cfg, be, layer, cache


def test_decode_step_does_not_retrace_within_a_bucket():
    cfg, be, layer, cache = _mha_setup()
    traces = []

    @jax.jit
    def step(cache, md, q, k, v):
        traces.append(md.batch_size)
        return be.forward_decode(q, k, v, layer, cache, md)

    rng = np.random.default_rng(0)
    r2p = rng.permutation(np.arange(1, 64))[: 8 * 32].reshape(-1)[: 8 * 7].reshape(8, 7)
    r2p = np.pad(r2p, ((0, 0), (0, cfg.max_num_pages - 7)))

    def run(bs, lens):
        md = be.init_forward_metadata(bs, np.arange(bs), np.array(lens), r2p, ForwardMode.DECODE)
        n = md.num_tokens
        q = jnp.asarray(rng.standard_normal((n, 64)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((n, 2, 16)), jnp.float32)
        out, _ = step(cache, md, q, k, k)
        assert np.isfinite(np.asarray(out)).all()
        return md

    run(3, [5, 40, 9])
    run(4, [1, 2, 55, 17])  # new values, same bucket (4)
    run(3, [12, 1, 1])
    assert len(traces) == 1, traces
    run(5, [3, 3, 3, 3, 3])  # bucket 8: one more trace
    run(7, [9, 1, 30, 3, 2, 4, 56])
    assert traces == [4, 8]


def test_extend_step_does_not_retrace_within_a_bucket():
    cfg, be, layer, cache = _mha_setup()
    traces = []

    @jax.jit
    def step(cache, md, q, k, v):
        traces.append((md.num_tokens, md.max_seqlen_q, md.has_prefix))
        return be.forward_extend(q, k, v, layer, cache, md)

    rng = np.random.default_rng(1)
    r2p = np.pad(rng.permutation(np.arange(1, 64))[:56].reshape(8, 7), ((0, 0), (0, cfg.max_num_pages - 7)))

    def run(bs, lens, ext):
        md = be.init_forward_metadata(
            bs,
            np.arange(bs),
            np.array(lens),
            r2p,
            ForwardMode.EXTEND,
            extend_seq_lens=np.array(ext),
            token_buckets=(32, 64),
            max_seqlen_q_buckets=(16, 32),
        )
        n = md.num_tokens
        q = jnp.asarray(rng.standard_normal((n, 4, 16)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((n, 2, 16)), jnp.float32)
        out, _ = step(cache, md, q, k, k)
        assert np.isfinite(np.asarray(out)).all()

    run(3, [20, 9, 30], [5, 9, 12])  # with a prefix
    run(4, [16, 2, 7, 50], [16, 1, 7, 3])
    run(3, [40, 11, 1], [1, 10, 0])
    assert len(traces) == 1, traces
    run(3, [10, 6, 1], [10, 6, 1])  # no prefix: the prefill path is another (static) program
    run(4, [1, 12, 3, 2], [1, 12, 3, 2])
    assert len(traces) == 2, traces
    run(2, [10, 6], [10, 6])  # batch bucket 2
    assert len(traces) == 3, traces


def test_capture_then_replay_metadata_does_not_retrace():
    """The CUDA-graph analogue: a placeholder plan of a bucket compiles; replay plans of the
    same bucket reuse the program. The placeholder (all padding) gives exactly 0."""
    cfg, be, layer, cache = _mha_setup()
    assert be.init_cuda_graph_state(6) == (2, 4, 6)
    traces = []

    @jax.jit
    def step(cache, md, q):
        traces.append(1)
        return be.forward_decode(q, None, None, layer, cache, md)

    rng = np.random.default_rng(2)
    cache = PagedKVCache(
        k=(jnp.asarray(rng.standard_normal(cache.k[0].shape), jnp.float32),),
        v=(jnp.asarray(rng.standard_normal(cache.v[0].shape), jnp.float32),),
    )
    cap = be.init_forward_metadata_capture_cuda_graph(6)
    assert cap.batch_size == 6 and int(cap.num_reqs) == 0
    out, _ = step(cache, cap, jnp.asarray(rng.standard_normal((6, 64)), jnp.float32))
    assert (np.asarray(out) == 0).all()
    r2p = np.pad(rng.permutation(np.arange(1, 64))[:35].reshape(5, 7), ((0, 0), (0, cfg.max_num_pages - 7)))
    rep = be.init_forward_metadata_replay_cuda_graph(5, np.arange(5), np.array([9, 1, 40, 56, 3]), r2p)
    assert rep.batch_size == 6
    out, _ = step(cache, rep, jnp.asarray(rng.standard_normal((6, 64)), jnp.float32))
    assert len(traces) == 1
    out = np.asarray(out)
    assert np.isfinite(out).all() and (out[5] == 0).all() and np.abs(out[:5]).sum() > 0


# ----------------------------------------------------------------------------- page-id bound


def test_plans_record_the_page_bound_they_were_checked_against():
    """A plan records num_pages (static); ids at or past it are refused, and without it
    (None) ids are not range-checked, which the backends refuse (tests below)."""
    pt = np.array([[3, 5], [10**6, 0]])
    md = jattn.plan_decode([20, 5], page_size=16, page_table=pt)
    assert md.num_pages is None and int(md.page_table[1, 0]) == 10**6
    with pytest.raises(ValueError, match=r"page_table\[1, 0\]=1000000 out of range \[0, 64\) \(num_pages"):
        jattn.plan_decode([20, 5], page_size=16, page_table=pt, num_pages=64)
    with pytest.raises(ValueError, match=r"page_table\[1, 0\]=1000000 out of range \[0, 64\)"):
        jattn.plan_extend([20, 5], [2, 5], page_size=16, page_table=pt, num_pages=64)
    md = jattn.plan_decode([20, 5], page_size=16, page_table=[[3, 5], [63, 0]], num_pages=64)
    assert md.num_pages == 64
    md = jattn.plan_extend([20, 5], [2, 5], page_size=16, page_table=[[3, 5], [63, 0]], num_pages=np.int64(64))
    assert md.num_pages == 64 and type(md.num_pages) is int
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"num_pages=.* must be a positive int"):
            jattn.plan_decode([5], page_size=16, page_table=[[3]], num_pages=bad)
    # the bound is a static field: plans of one pool share a treedef, another bound does not
    a = jattn.plan_decode([5, 9], page_size=4, page_table=[[3, 2, 0], [4, 5, 6]], num_pages=8)
    b = jattn.plan_decode([2, 12], page_size=4, page_table=[[7, 0, 0], [1, 2, 3]], num_pages=8)
    c = jattn.plan_decode([2, 12], page_size=4, page_table=[[7, 0, 0], [1, 2, 3]], num_pages=9)
    tree = jax.tree_util.tree_structure
    assert tree(a) == tree(b) and tree(a) != tree(c)
    # with_seq_lens (the DFLASH fill) keeps it
    assert a.with_seq_lens(np.array([4, 8])).num_pages == 8
    # lengths past the page table or negative: refused; under jit, no write lands
    cap = a.page_table.shape[1] * 4
    for bad in ([4, cap + 1], [-1, 4]):
        with pytest.raises(ValueError, match=rf"seq_lens\[\d\]=.* must be in \[0, {cap}\]"):
            a.with_seq_lens(np.array(bad))
    traced = jax.jit(lambda lens: a.with_seq_lens(lens))(np.array([4, cap + 1], np.int32))
    assert int(traced.out_cache_loc[1]) == 0  # the dummy page, not another token's slot
    # lengths that are not one int per request, and request counts outside them: refused
    for bad, msg in (
        ([4, 8], r"seq_lens must be an int array \[n <= batch_size=2\], got list"),
        (np.array([4.5, 8.0]), r"got ndarray float64\[2\]"),
        (np.array([[4, 8]]), r"got ndarray int64\[1, 2\]"),
        (np.array([4, 8, 1]), r"got ndarray int64\[3\]"),
    ):
        with pytest.raises(ValueError, match=msg):
            a.with_seq_lens(bad)
    for nr in (-1, 3, 1.0):
        with pytest.raises(ValueError, match=rf"num_reqs={nr!r} must be an int in \[0, len\(seq_lens\)=2\]"):
            a.with_seq_lens(np.array([4, 8]), nr)
    with pytest.raises(ValueError, match=r"num_reqs=2 must be an int in \[0, len\(seq_lens\)=1\]"):
        a.with_seq_lens(np.array([4]), 2)  # a request would be emptied silently
    # a length reaching a column the planner gave the dummy page: two requests would write
    # (and read back) the slot padded rows write
    tight = jattn.plan_decode([4, 4], page_size=4, page_table=[[3, 2], [4, 5]], max_pages=2)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=5 reaches page_table\[0, 1\], the reserved dummy page 0"):
        tight.with_seq_lens(np.array([5, 5]))
    assert int(tight.with_seq_lens(np.array([4, 3])).out_cache_loc[1]) == 4 * 4 + 2

    # with_page_offset: the shifted plan stays inside the larger pool, or is refused
    assert a.with_page_offset(8, 16).num_pages == 16 and int(a.with_page_offset(8, 16).page_table[1, 2]) == 14
    for off in (-1, 9):
        with pytest.raises(ValueError, match=r"with_page_offset: offset=.* must be in \[0, 8\]"):
            a.with_page_offset(off, 16)
    # an unchecked plan stays unchecked: shifting it bounds nothing
    assert jattn.plan_decode([20, 5], page_size=16, page_table=pt).with_page_offset(3, 100).num_pages is None


def test_with_seq_lens_on_device_lengths_reads_no_plan_back(monkeypatch):
    """A multi-step plan's steps (device lengths, per layer when eager) copy nothing of the
    plan to the host; host lengths may read the page table back for their check."""
    import jattn.metadata as meta

    seen = []
    real = meta._concrete
    monkeypatch.setattr(meta, "_concrete", lambda x: seen.append(np.shape(x)) or real(x))
    plan = jattn.plan_decode([4, 9], page_size=4, page_table=[[3, 2, 1], [4, 5, 6]], num_pages=8)
    plan.with_seq_lens(jnp.asarray([4, 8], jnp.int32))
    assert plan.page_table.shape not in seen and () not in seen
    seen.clear()
    plan.with_seq_lens(np.array([4, 8]))
    assert plan.page_table.shape in seen


def test_plan_prefix_chunks_slots_are_each_chunks_own_tokens():
    """Chunk ``c`` of request ``b`` holds prefix tokens ``c * chunk + [0, n)`` at their slots
    ``page * page_size + offset`` (prefixes over several chunks, one of none), padded with
    the dummy slot."""
    ps, chunk = 4, 5
    pre = np.array([13, 0, 9])
    pt = np.array([[7, 3, 9, 2], [1, 1, 1, 1], [5, 8, 6, 1]])
    chunks = jattn.plan_prefix_chunks(pre, pt, page_size=ps, chunk_size=chunk, batch_size=4)
    assert len(chunks) == 3
    for c, ch in enumerate(chunks):
        n = np.clip(pre - c * chunk, 0, chunk)
        np.testing.assert_array_equal(ch.cu_seqlens_kv, np.concatenate([[0], np.cumsum(n), [n.sum()]]))
        want = [pt[b, p // ps] * ps + p % ps for b in range(3) for p in c * chunk + np.arange(n[b])]
        np.testing.assert_array_equal(ch.slots[: len(want)], want)
        assert (np.asarray(ch.slots[len(want) :]) == DUMMY_PAGE * ps).all()


def test_plan_prefix_chunks_checks_page_ids():
    pt = np.array([[2, 70], [5, 0]])
    jattn.plan_prefix_chunks([20, 3], pt, page_size=16, chunk_size=8)  # no bound given: not range-checked
    with pytest.raises(ValueError, match=r"page_table\[0, 1\]=70 out of range \[0, 64\)"):
        jattn.plan_prefix_chunks([20, 3], pt, page_size=16, chunk_size=8, num_pages=64)
    chunks = jattn.plan_prefix_chunks([20, 3], pt, page_size=16, chunk_size=8, num_pages=71)
    assert max(int(c.slots.max()) for c in chunks) < 71 * 16


def test_with_seq_lens_keeps_rows_past_num_reqs_empty():
    """Rows past ``num_reqs`` (padding of the bucket) get length 0 and the dummy slot,
    for host and device lengths alike."""
    md = jattn.plan_decode(
        [5, 6, 7], page_size=4, page_table=np.array([[1, 2], [3, 4], [5, 6]]), num_pages=8, batch_buckets=(4,)
    )
    for lens in (np.array([5, 6, 7]), jnp.array([5, 6, 7], jnp.int32)):
        out = md.with_seq_lens(lens, 2)
        np.testing.assert_array_equal(out.cache_seqlens, [5, 6, 0, 0])
        np.testing.assert_array_equal(np.asarray(out.out_cache_loc)[2:], 0)


def test_cascade_plan_with_a_partial_last_group():
    """Three requests in groups of two are two groups (the last one partial): one
    ``prefix_pages`` entry per group, a count of whole groups refused by name."""
    kw = dict(page_size=4, page_table=np.array([[1, 2], [1, 3], [4, 5]]), num_pages=8, batch_buckets=(4,), group_size=2)
    np.testing.assert_array_equal(jattn.plan_decode([6, 7, 5], prefix_pages=[1, 0], **kw).prefix_pages, [1, 0])
    with pytest.raises(ValueError, match="prefix_pages has 1 entries; the 3 requests form 2 groups"):
        jattn.plan_decode([6, 7, 5], prefix_pages=[1], **kw)


def test_plan_decode_reads_the_mode_off_q_len_and_causality():
    kw = dict(page_size=4, page_table=np.array([[1]]))
    assert jattn.plan_decode([3], **kw).forward_mode is ForwardMode.DECODE
    assert jattn.plan_decode([3], q_len=2, **kw).forward_mode is ForwardMode.TARGET_VERIFY
    assert jattn.plan_decode([3], q_len=2, is_causal=False, **kw).forward_mode is ForwardMode.DRAFT_BLOCK


def test_with_seq_lens_takes_host_lengths_shorter_than_q_len():
    """A length below ``q_len`` (the first tokens of a verify block have no position yet):
    those rows write the dummy slot, and no clash with another request is reported."""
    md = jattn.plan_decode([3, 3], page_size=4, page_table=np.array([[1], [3]]), q_len=3, num_pages=8, max_pages=2)
    np.testing.assert_array_equal(
        np.asarray(md.with_seq_lens(np.array([2, 2])).out_cache_loc)[:6], [0, 4, 5, 0, 12, 13]
    )
