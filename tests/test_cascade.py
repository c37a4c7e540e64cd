"""Shared-prefix (cascade) decode (``jattn.cascade_decode``) against float64 attention
over each request's prefix + suffix keys (``tests/naive.py``), on fresh random data:
prefix lengths 0, 33 and 97 (not page multiples), suffixes of 1 to 40 tokens,
permuted page tables, NaN in every pool slot no request holds. On a GPU the same
cases run on the automatic backend (the mosaic decode kernel)."""

from __future__ import annotations

import numpy as np
import pytest
from naive import attend_one, gather_paged

import jattn
from jattn.cascade import prefix_chunk_size, prefix_split_count

HQ, HKV, D, PS = 8, 2, 64, 16


def _setup(seed, prefix_lens, group_size, q_len, suffix_max=40, hq=HQ, hkv=HKV):
    rng = np.random.default_rng(seed)
    g = len(prefix_lens)
    bs = g * group_size
    suffix_lens = rng.integers(q_len, suffix_max + 1, bs).astype(np.int32)
    suffix_lens[0] = q_len  # a suffix of only the new tokens
    pp = max(1, max(-(-n // PS) for n in prefix_lens))
    sp = max(1, -(-int(suffix_lens.max()) // PS)) + 1
    num_pages = g * pp + bs * sp + 3
    k = np.full((num_pages, PS, hkv, D), np.nan, np.float32)
    v = np.full((num_pages, PS, hkv, D), np.nan, np.float32)
    perm = rng.permutation(num_pages)
    ptab = perm[: g * pp].reshape(g, pp).astype(np.int32)
    stab = perm[g * pp : g * pp + bs * sp].reshape(bs, sp).astype(np.int32)
    for tab, lens in ((ptab, prefix_lens), (stab, suffix_lens)):
        for r, n in enumerate(lens):
            for t in range(n):
                k[tab[r, t // PS], t % PS] = rng.standard_normal((hkv, D))
                v[tab[r, t // PS], t % PS] = rng.standard_normal((hkv, D))
    q = rng.standard_normal((bs * q_len, hq, D)).astype(np.float32)
    return q, k, v, ptab, np.asarray(prefix_lens, np.int32), stab, suffix_lens


def _expected(q, k, v, ptab, plens, stab, slens, group_size, q_len, **kw):
    bs = stab.shape[0]
    out = np.zeros((bs * q_len,) + q.shape[1:])
    lse = np.zeros((bs * q_len, q.shape[1]))
    for b in range(bs):
        g = b // group_size
        keys = np.concatenate([gather_paged(k, ptab[g], plens[g]), gather_paged(k, stab[b], slens[b])])
        vals = np.concatenate([gather_paged(v, ptab[g], plens[g]), gather_paged(v, stab[b], slens[b])])
        rows = slice(b * q_len, (b + 1) * q_len)
        out[rows], lse[rows] = attend_one(np.float64(q[rows]), keys, vals, causal=True, scale=1 / np.sqrt(D), **kw)
    return out, lse


@pytest.mark.parametrize(
    "prefix_lens, group_size, q_len, opts",
    [
        ((97, 0, 33), 4, 1, {}),
        ((97, 33), 4, 2, dict(logit_cap=5.0)),
        ((40, 1), 6, 3, {}),  # chunks of 2 requests (2 * 3 rows <= 8)
        ((17,), 1, 1, dict(sinks=True)),
        # the extend prefix pass: 12 query rows per group; 3 page ranges of 3 pages,
        # so group 1's 33 tokens leave its last range empty and group 2 has none
        ((97, 33, 0), 4, 3, dict(prefix_splits=3)),
        ((97,), 3, 1, dict(prefix_pass="extend", logit_cap=5.0, sinks=True)),
    ],
)
def test_cascade_matches_float64(prefix_lens, group_size, q_len, opts):
    q, k, v, ptab, plens, stab, slens = _setup(len(prefix_lens) * 10 + q_len, prefix_lens, group_size, q_len)
    sinks = np.random.default_rng(5).standard_normal(HQ).astype(np.float32) if opts.get("sinks") else None
    cap = opts.get("logit_cap", 0.0)
    want, want_lse = _expected(q, k, v, ptab, plens, stab, slens, group_size, q_len, logit_cap=cap, sinks=sinks)
    out, lse = jattn.cascade_decode(
        q,
        k,
        v,
        ptab,
        plens,
        stab,
        slens,
        group_size=group_size,
        max_seqlen_q=q_len,
        logit_cap=cap,
        sinks=sinks,
        return_lse=True,
        prefix_pass=opts.get("prefix_pass"),
        prefix_splits=opts.get("prefix_splits"),
    )
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isfinite(out).all(), "NaN from an unused slot"
    np.testing.assert_allclose(out, want, atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(lse, want_lse, atol=2e-4, rtol=2e-4)


def test_cascade_equals_decode_over_the_joined_pages():
    """With page-aligned prefixes the concatenated page table is a plain decode: equal results."""
    q, k, v, ptab, plens, stab, slens = _setup(3, (32, 48), 3, 1)
    out = np.asarray(jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=3))
    rows = []
    for b in range(6):
        npre = plens[b // 3] // PS
        rows.append(np.concatenate([ptab[b // 3, :npre], stab[b], np.zeros(3 - npre, np.int32)]))
    table = np.stack(rows).astype(np.int32)
    want = np.asarray(jattn.mha_decode_with_kvcache(q, k, v, table, np.repeat(plens, 3) + slens))
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


def test_prefix_chunk_size_and_split_count():
    assert prefix_chunk_size(64, 1) == 8  # 64 requests: the prefix read 8 times, not 64
    assert prefix_chunk_size(6, 3) == 2
    assert prefix_chunk_size(7, 2) == 1
    assert prefix_chunk_size(4, 1) == 4
    # one group of 64 requests, 4 query heads per KV head: 256 rows on each of 8 KV heads
    # are 16 tiles; 16 ranges of a 16k prefix make 256 programs
    assert prefix_split_count(1, 256, 8, 16384) == 16
    assert prefix_split_count(1, 256, 8, 2048) == 2  # ranges of at least 1024 tokens
    assert prefix_split_count(16, 64, 8, 16384) == 2
    assert prefix_split_count(32, 64, 8, 16384) == 1  # 256 programs already
    assert prefix_split_count(1, 8, 4, 100) == 1


def test_merge_states_ignores_the_output_of_an_empty_part():
    """A part with LSE ``-inf`` contributes nothing whatever its output holds (NaN
    included: ``0 * NaN`` must not reach the row); all parts empty give 0 / -inf."""
    import jax.numpy as jnp

    from jattn.cascade import merge_states

    rng = np.random.default_rng(3)
    o1 = rng.standard_normal((2, 3, 4)).astype(np.float32)
    lse1 = rng.standard_normal((2, 3)).astype(np.float32)
    outs = jnp.asarray(np.stack([o1, np.full_like(o1, np.nan)]))
    lses = jnp.asarray(np.stack([lse1, np.full_like(lse1, -np.inf)]))
    o, lse = merge_states(outs, lses, jnp.float32)
    np.testing.assert_allclose(np.asarray(o), o1, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), lse1, rtol=1e-6)
    o, lse = merge_states(outs, jnp.full_like(lses, -jnp.inf), jnp.float32)
    assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()


def test_cascade_errors_name_the_argument():
    q, k, v, ptab, plens, stab, slens = _setup(1, (20,), 2, 1)
    with pytest.raises(ValueError, match=r"suffix_page_table has 2 rows; it must be groups \(1\) \* group_size \(3\)"):
        jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=3)
    with pytest.raises(ValueError, match=r"prefix_lens must have shape \(1,\)"):
        jattn.cascade_decode(q, k, v, ptab, np.zeros(2, np.int32), stab, slens, group_size=2)
    with pytest.raises(ValueError, match="prefix_chunk=3 must divide group_size=2"):
        jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=2, prefix_chunk=3)
    with pytest.raises(ValueError, match="prefix_pass='fast' must be"):
        jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=2, prefix_pass="fast")
    with pytest.raises(ValueError, match=r"prefix_splits=9 must be an int in \[1, 2\]"):
        jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=2, prefix_pass="extend", prefix_splits=9)
    for bad in (dict(prefix_pass="decode", prefix_splits=1), dict(prefix_chunk=1, prefix_splits=1)):
        with pytest.raises(ValueError, match="prefix_splits applies to prefix_pass='extend' only"):
            jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=2, **bad)
    with pytest.raises(ValueError, match=r"prefix_splits=-5 must be an int"):  # giving it selects extend
        jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=2, prefix_splits=-5)
    with pytest.raises(TypeError, match="page_table.dtype=int64 must be int32"):
        from jattn.cascade import cascade_tables

        cascade_tables(stab.astype(np.int64), slens, np.zeros(1, np.int32), group_size=2, page_size=PS)


@pytest.mark.parametrize("prefix_pass", ["decode", "extend"])
def test_cascade_row_that_sees_a_non_finite_value_is_non_finite(prefix_pass):
    """A NaN in a prefix value and an inf in a suffix value reach exactly the rows that
    see them, on both passes, as in one attention over the joined keys (the extend
    pass's merge had turned them into empty rows: o = 0, LSE -inf)."""
    q, k, v, ptab, plens, stab, slens = _setup(5, (20, 7), 2, 1)
    v[ptab[0, 0], 2, 1, 3] = np.nan  # group 0's prefix key 2: requests 0 and 1
    v[stab[3, 0], 0, 0, 0] = np.inf  # request 3's first suffix key
    o, lse = jattn.cascade_decode(
        q, k, v, ptab, plens, stab, slens, group_size=2, prefix_pass=prefix_pass, return_lse=True
    )
    bad = [bool(np.isnan(np.asarray(o)[b]).any()) for b in range(4)]
    assert bad == [True, True, False, True]
    assert np.isfinite(np.asarray(lse)[2]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "triton"])
@pytest.mark.parametrize("prefix_pass", ["decode", "extend"])
def test_gpu_cascade_on_the_kernels_matches_the_reference(prefix_pass, backend):
    """bf16 on the kernels (auto: Mosaic on Hopper; and Triton), both prefix passes
    (decode: chunks of 8 requests; extend: the group's 16 rows in one prefill tile over
    page ranges of the prefix), against the same call on xla in f32."""
    import jax.numpy as jnp

    from jattn.pallas_kernels import triton_glue

    if backend == "triton" and not triton_glue.available():
        pytest.skip("jax-triton is not installed")
    q, k, v, ptab, plens, stab, slens = _setup(9, (1000, 37), 16, 1, suffix_max=300)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
    out = jattn.cascade_decode(*bf, ptab, plens, stab, slens, group_size=16, prefix_pass=prefix_pass, backend=backend)
    want = jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=16, backend="xla")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)
    again = jattn.cascade_decode(*bf, ptab, plens, stab, slens, group_size=16, prefix_pass=prefix_pass, backend=backend)
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(out, np.float32))


def test_cascade_tables_from_a_decode_plan_equal_the_plain_decode_and_do_not_retrace():
    """Rows of a decode plan that share their first pages: the cascade over the derived
    tables equals the plain decode of the plan; a new grouping (prefix page counts) of
    the same shapes reuses the compiled program."""
    import jax

    from jattn.cascade import cascade_tables, check_shared_prefix

    rng = np.random.default_rng(11)
    group_size, groups, width = 4, 2, 8
    bs = groups * group_size
    num_pages = 64
    k = rng.standard_normal((num_pages, PS, HKV, D)).astype(np.float32)
    v = rng.standard_normal((num_pages, PS, HKV, D)).astype(np.float32)
    pages = rng.permutation(num_pages)
    table = np.zeros((bs, width), np.int32)
    shared = [pages[:3], pages[3:5]]  # group 0 shares 3 pages, group 1 two
    nxt = 5
    for b in range(bs):
        mine = width - len(shared[b // group_size])
        table[b] = np.concatenate([shared[b // group_size], pages[nxt : nxt + mine]])
        nxt += mine
    seq = np.array([3 * PS + 5, 3 * PS + 1, 3 * PS + 40, 3 * PS + 17, 2 * PS + 9, 2 * PS + 1, 2 * PS + 30, 2 * PS + 2])
    seq = seq.astype(np.int32)
    q = rng.standard_normal((bs, HQ, D)).astype(np.float32)
    traces = []

    @jax.jit
    def step(q, pt, sl, prefix_pages):
        traces.append(1)
        tabs = cascade_tables(pt, sl, prefix_pages, group_size=group_size, page_size=PS)
        return jattn.cascade_decode(q, k, v, *tabs, group_size=group_size)

    want = np.asarray(jattn.mha_decode_with_kvcache(q, k, v, table, seq))
    for pp in (np.array([3, 2], np.int32), np.array([1, 0], np.int32), np.array([0, 2], np.int32)):
        check_shared_prefix(table, seq, pp, group_size=group_size, page_size=PS)
        out = np.asarray(step(q, table, seq, pp))
        np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    assert len(traces) == 1, "a new grouping retraced"
    with pytest.raises(ValueError, match="request 5 does not share group 1's first 3 pages"):
        check_shared_prefix(table, seq, np.array([3, 3]), group_size=group_size, page_size=PS)
    short = seq.copy()
    short[1] = 3 * PS  # all of request 1 inside the shared pages: no room for its new token
    with pytest.raises(ValueError, match="request 1: seq_len 48 leaves fewer than q_len=1 new tokens"):
        check_shared_prefix(table, short, np.array([3, 2]), group_size=group_size, page_size=PS)


def test_cascade_extend_pass_on_the_mosaic_kernels_interpreted():
    """The extend prefix pass on the Mosaic GPU prefill kernel (non-causal, 9 query rows
    per group over a 37-token prefix in two page ranges, the second ending inside a page
    and NaN past it) and the suffix pass on the decode kernel, under the Mosaic GPU
    interpreter, fp16, 2 query heads on one KV head (the interpreter is slow per tile)."""
    import jax.numpy as jnp

    from jattn.pallas_kernels.interpret import gpu_interpret, interpreter_available, on_gpu

    if not on_gpu() and not interpreter_available():
        pytest.skip("no Mosaic GPU interpreter in this JAX")
    q, k, v, ptab, plens, stab, slens = _setup(21, (37,), 3, 3, suffix_max=20, hq=2, hkv=1)
    want, want_lse = _expected(q, k, v, ptab, plens, stab, slens, 3, 3)
    h = [jnp.asarray(a, jnp.float16) for a in (q, k, v)]
    with gpu_interpret():
        out, lse = jattn.cascade_decode(
            *h,
            ptab,
            plens,
            stab,
            slens,
            group_size=3,
            max_seqlen_q=3,
            prefix_splits=2,
            return_lse=True,
            backend="mosaic",
        )
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "NaN from an unused slot"
    np.testing.assert_allclose(out, want, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("prefix_pass", ["decode", "extend"])
def test_cascade_refuses_lengths_and_pages_outside_their_tables(prefix_pass):
    """Concrete lengths and page ids are checked on both prefix passes, the message naming
    the cascade's argument and its own row (the extend pass clipped a prefix longer than
    its table, or a negative one, silently; the decode pass named the repeated table)."""
    q, k, v, ptab, plens, stab, slens = _setup(1, (20, 33), 2, 1)
    run = dict(group_size=2, prefix_pass=prefix_pass)
    cap = ptab.shape[1] * PS
    for bad in (cap + 1, -1):
        with pytest.raises(ValueError, match=rf"prefix_lens\[1\]={bad} must be in \[0, {cap}\] \(prefix_page_table's"):
            jattn.cascade_decode(q, k, v, ptab, np.array([20, bad], np.int32), stab, slens, **run)
    p2 = ptab.copy()
    p2[1, 0] = k.shape[0]
    with pytest.raises(ValueError, match=rf"prefix_page_table\[1, 0\]={k.shape[0]} out of range"):
        jattn.cascade_decode(q, k, v, p2, plens, stab, slens, **run)
    s2 = slens.copy()
    s2[3] = -2
    with pytest.raises(ValueError, match=r"suffix_lens\[3\]=-2 must be in"):
        jattn.cascade_decode(q, k, v, ptab, plens, stab, s2, **run)


def test_cascade_argument_shapes_dtypes_and_sinks():
    q, k, v, ptab, plens, stab, slens = _setup(2, (20,), 2, 1)
    with pytest.raises(ValueError, match=r"sinks must have shape \(8,\)"):  # was broadcast over the heads
        jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=2, sinks=np.ones(1, np.float32))
    with pytest.raises(ValueError, match=r"prefix_page_table must be \[groups, max_prefix_pages\], got shape \(2,\)"):
        jattn.cascade_decode(q, k, v, ptab[0], plens, stab, slens, group_size=2)
    with pytest.raises(TypeError, match="prefix_lens.dtype=float32 must be int32"):  # was truncated
        jattn.cascade_decode(q, k, v, ptab, plens.astype(np.float32) + 0.5, stab, slens, group_size=2)
    for bad in (dict(prefix_chunk=1.0), dict(prefix_pass="extend", prefix_splits=True), dict(group_size=True)):
        with pytest.raises(ValueError, match="must"):
            jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, **{"group_size": 2, **bad})
    out = jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=np.int64(2), prefix_chunk=np.int32(1))
    np.testing.assert_allclose(out, jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=2), atol=1e-6)


def test_cascade_suffix_shorter_than_the_queries():
    """Query 0 of a request sits at ``L - n``: with a prefix, a suffix of ``n - 1`` tokens
    puts it on the prefix's last key (every prefix key visible: exact); a shorter one
    would hide prefix keys from it, which the prefix pass cannot do: refused, where the
    result was silently wrong. A group with no prefix is a plain decode (``L < n`` too)."""
    q, k, v, ptab, plens, stab, slens = _setup(4, (40, 0), 2, 3)
    slens[1], slens[2] = 2, 1
    want, want_lse = _expected(q, k, v, ptab, plens, stab, slens, 2, 3)
    for prefix_pass in ("decode", "extend"):
        out, lse = jattn.cascade_decode(
            q, k, v, ptab, plens, stab, slens, group_size=2, max_seqlen_q=3, return_lse=True, prefix_pass=prefix_pass
        )
        np.testing.assert_allclose(out, want, atol=2e-4, rtol=2e-4)
        np.testing.assert_allclose(lse, want_lse, atol=2e-4, rtol=2e-4)
    slens[1] = 1
    with pytest.raises(ValueError, match=r"suffix_lens\[1\]=1 must be >= max_seqlen_q - 1 = 2: group 0 has a prefix"):
        jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=2, max_seqlen_q=3)
    # under jit the lengths are traced: that request's rows come out NaN, the others as before
    import jax

    run = jax.jit(lambda pl, sl: jattn.cascade_decode(
        q, k, v, ptab, pl, stab, sl, group_size=2, max_seqlen_q=3, return_lse=True
    ))  # fmt: skip
    out, lse = (np.asarray(x) for x in run(plens, slens))
    assert np.isnan(out[3:6]).all() and np.isnan(lse[3:6]).all()
    ok = np.r_[0:3, 6:12]
    slens[1] = 2
    np.testing.assert_allclose(out[ok], want[ok], atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(lse[ok], want_lse[ok], atol=2e-4, rtol=2e-4)
    assert np.isfinite(np.asarray(run(plens, slens)[0])).all()  # the rule kept: no NaN


def test_cascade_tables_checks_concrete_groupings():
    """Eager ``cascade_tables`` checks the grouping (a row that does not hold its group's
    shared pages read the first row's pages silently); ``check_shared_prefix`` lets
    padding rows (length 0) sit in a group that shares nothing, as the planner does."""
    import jax

    from jattn.cascade import cascade_tables, check_shared_prefix

    table = np.array([[3, 4, 0], [3, 5, 0], [6, 7, 0], [0, 0, 0]], np.int32)
    seq = np.array([20, 18, 9, 0], np.int32)
    check_shared_prefix(table, seq, np.array([1, 0]), group_size=2, page_size=16)
    tabs = cascade_tables(table, seq, np.array([1, 0], np.int32), group_size=2, page_size=16)
    np.testing.assert_array_equal(tabs[3], [4, 2, 9, 0])
    with pytest.raises(ValueError, match="request 1 does not share group 0's first 2 pages"):
        cascade_tables(table, seq, np.array([2, 0], np.int32), group_size=2, page_size=16)
    with pytest.raises(ValueError, match="request 1: seq_len 16 leaves fewer than q_len=1 new tokens"):
        cascade_tables(
            table, np.array([20, 16, 9, 0], np.int32), np.array([1, 0], np.int32), group_size=2, page_size=16
        )
    with pytest.raises(ValueError, match=r"prefix_pages\[1\]=4 is outside \[0, 3\]"):
        cascade_tables(table, seq, np.array([0, 4], np.int32), group_size=2, page_size=16)
    with pytest.raises(ValueError, match="page_table has 4 rows, not a multiple of group_size=3"):
        cascade_tables(table, seq, np.array([1], np.int32), group_size=3, page_size=16)
    with pytest.raises(ValueError, match=r"prefix_pages \(2,\) \(one per group of 2\), got \(4,\) and \(3,\)"):
        cascade_tables(table, seq, np.array([1, 0, 0], np.int32), group_size=2, page_size=16)
    traced = jax.jit(lambda *a: cascade_tables(*a, group_size=2, page_size=16))(table, seq, np.array([1, 0], np.int32))
    np.testing.assert_array_equal(traced[3], tabs[3])


def test_default_prefix_splits_count_packed_rows_per_kv_head(monkeypatch):
    """The extend pass's default page ranges come from its packed rows per KV head on the
    KV heads (``prefix_split_count``'s contract; docs/PERF.md's 16 ranges for 1 x 64 with
    32 / 8 heads); the call passed the unpacked rows on the query heads (8 ranges there)."""
    import jattn.cascade as cascade

    calls = []
    real = cascade.prefix_split_count
    monkeypatch.setattr(cascade, "prefix_split_count", lambda *a: calls.append(a) or real(*a))
    q, k, v, ptab, plens, stab, slens = _setup(6, (40,), 4, 1)  # 4 requests, 8 / 2 heads
    jattn.cascade_decode(q, k, v, ptab, plens, stab, slens, group_size=4, prefix_pass="extend")
    assert calls == [(1, 4 * (HQ // HKV), HKV, ptab.shape[1] * PS)]
    assert real(1, 64 * 4, 8, 16384) == 16


def test_cascade_negative_suffix_under_jit_is_nan_at_one_query():
    """With one query a request needs ``suffix_lens >= 0``; under jit a negative length (a
    plan trimmed with ``with_seq_lens``) must not hand the row its group's whole prefix."""
    import jax

    q, k, v, ptab, plens, stab, slens = _setup(5, (40, 0), 2, 1)
    slens[1] = -8
    out, lse = (
        np.asarray(x)
        for x in jax.jit(
            lambda pl, sl: jattn.cascade_decode(q, k, v, ptab, pl, stab, sl, group_size=2, return_lse=True)
        )(plens, slens)
    )
    assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()
    slens[1] = 0  # a row of no suffix keys still sees its group's prefix: exact
    want, want_lse = _expected(q, k, v, ptab, plens, stab, slens, 2, 1)
    ok = np.r_[0, 2:4]
    np.testing.assert_allclose(out[ok], want[ok], atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(lse[ok], want_lse[ok], atol=2e-4, rtol=2e-4)


def test_cascade_row_without_keys_and_a_minus_inf_sink_is_zero():
    """A padding row (no prefix, suffix 0) under sinks where one head has no sink (-inf):
    0, as a plain decode gives, not 0 * NaN from the sink factor."""
    q, k, v, ptab, plens, stab, slens = _setup(3, (33,), 2, 1)
    sinks = np.random.default_rng(5).standard_normal(HQ).astype(np.float32)
    sinks[0] = -np.inf
    plens, slens = np.zeros(1, np.int32), slens.copy()
    slens[1] = 0
    out, lse = jattn.cascade_decode(
        q, k, v, ptab, plens, stab, slens, group_size=2, max_seqlen_q=1, sinks=sinks, return_lse=True
    )
    out, lse = np.asarray(out), np.asarray(lse)
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    want, _ = _expected(q[:1], k, v, ptab, plens, stab[:1], slens[:1], 1, 1, sinks=sinks)
    np.testing.assert_allclose(out[0], want[0], atol=2e-4, rtol=2e-4)
