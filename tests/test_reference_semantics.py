"""``jattn.reference`` against docs/SEMANTICS.md on awkward cases, through small float64
numpy computations written here from the page (independent of the reference and of
tests/naive.py): lengths 0, 1 and 97, a window at each edge (0, L - 1, L, past the
page table, near int32's limit), a logit cap on huge logits, sinks on empty rows, GQA
groups, several requests of different lengths, FP8 scales, extend over a paged prefix,
ragged prefill with its own key offsets, MLA absorbed decode and the merge rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import reference

TOL = dict(atol=3e-5, rtol=3e-5)


def _visible(big_l: int, n: int, i: int, causal: bool, wl: int) -> list[int]:
    pos = big_l - n + i  # SEMANTICS: query i sits at key position L - n + i
    return [j for j in range(big_l) if (not causal or j <= pos) and (wl < 0 or j >= pos - wl)]


def _attend(q, k, v, *, causal, wl=-1, cap=0.0, sinks=None, scale, v_scale=1.0):
    """One request: q [n, Hq, D], k [L, Hkv, D] (k_scale already in ``scale``), v [L, Hkv, Dv]."""
    n, hq = q.shape[:2]
    group = hq // k.shape[1]
    o, lse = np.zeros((n, hq, v.shape[2])), np.full((n, hq), -np.inf)
    for i in range(n):
        js = _visible(k.shape[0], n, i, causal, wl)
        if not js:
            continue  # empty row: o = 0, lse = -inf, sinks or not
        for h in range(hq):
            x = scale * (k[js, h // group] @ q[i, h])
            if cap > 0:
                x = cap * np.tanh(x / cap)
            m = x.max()
            e = np.exp(x - m)
            lse[i, h] = m + np.log(e.sum())  # natural log, without the sink
            with np.errstate(over="ignore"):  # a sink far above every score: all its mass
                den = e.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))
            o[i, h] = (e / den) @ v[js, h // group] * v_scale
    return o, lse


def _pool(rng, lens, page_size, hkv, dims):
    """Permuted pages; NaN in every slot no request holds (the dummy page, spare pages,
    page tails, table entries past each request's last page). Returns the pools (one per
    entry of ``dims``), the page table and each request's rows in float64."""
    need = [-(-n // page_size) for n in lens]
    num_pages = 2 + sum(need)
    perm = rng.permutation(np.arange(1, num_pages))
    pt = np.full((len(lens), max(need + [0]) + 1), perm[-1], np.int32)
    pools = [np.full((num_pages, page_size, hkv, d), np.nan, np.float32) for d in dims]
    rows = []
    first = 0
    for b, n in enumerate(lens):
        pt[b, : need[b]] = perm[first : first + need[b]]
        first += need[b]
        mine = [rng.standard_normal((n, hkv, d)).astype(np.float32) for d in dims]
        for t in range(n):
            for pool, x in zip(pools, mine):
                pool[pt[b, t // page_size], t % page_size] = x[t]
        rows.append([x.astype(np.float64) for x in mine])
    return pools, pt, rows


def _check(out, lse, want_o, want_lse):
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], **TOL)
    np.testing.assert_allclose(out, want_o, **TOL)
    assert (out[~fin] == 0).all()  # empty rows are exactly 0


DECODE_CASES = [
    # lens, q_len, causal, window_left, logit_cap, sinks, (Hq, Hkv), k_scale, v_scale
    ([0, 1, 97], 1, True, -1, 0.0, False, (4, 1), 1.0, 1.0),
    ([97, 0, 5, 1], 3, True, 0, 0.0, True, (8, 2), 0.5, 2.0),  # window of one key; L < n
    ([97, 16, 17], 4, True, 16, 0.0, False, (4, 4), 1.0, 1.0),  # window at L - 1 of one request
    ([97, 16, 17], 4, True, 17, 50.0, True, (4, 2), 1.0, 1.0),  # window = L: no key left out
    ([3, 97, 2], 4, False, 5, 0.0, True, (8, 2), 1.0, 1.0),  # DFLASH block with a window; L < n
    ([3, 97, 2], 4, False, -1, 1.0, False, (8, 8), 1.0, 1.0),
    ([3, 97, 2], 4, False, 2**31 - 1, 0.0, True, (4, 2), 1.0, 1.0),  # a window past every key
    ([40, 97, 1], 2, True, 2**40, 0.0, False, (4, 2), 1.0, 1.0),
    ([40, 97, 1], 2, True, 200, 0.0, False, (4, 2), 1.0, 1.0),  # wider than the page table
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}-n{c[1]}-c{int(c[2])}-w{c[3]}")
def test_mha_decode_against_float64(case):
    lens, n, causal, wl, cap, with_sinks, (hq, hkv), k_scale, v_scale = case
    rng = np.random.default_rng(len(lens) * 100 + n)
    (kc, vc), pt, rows = _pool(rng, lens, 16, hkv, (12, 6))
    q = rng.standard_normal((len(lens) * n, hq, 12)).astype(np.float32) * 2
    sinks = (rng.standard_normal(hq) * 3).astype(np.float32) if with_sinks else None
    out, lse = reference.mha_decode(
        q, kc, vc, pt, np.array(lens, np.int32), max_seqlen_q=n, is_causal=causal, window_left=wl,
        logit_cap=cap, sinks=sinks, softmax_scale=0.4, k_scale=k_scale, v_scale=v_scale, return_lse=True,
    )  # fmt: skip
    want_o, want_lse = np.zeros(out.shape), np.full(lse.shape, -np.inf)
    for b, (k, v) in enumerate(rows):
        sl = slice(b * n, (b + 1) * n)
        want_o[sl], want_lse[sl] = _attend(
            q[sl].astype(np.float64), k, v, causal=causal, wl=wl, cap=cap, sinks=sinks, scale=0.4 * k_scale,
            v_scale=v_scale,
        )  # fmt: skip
    _check(out, lse, want_o, want_lse)


def test_logit_cap_on_huge_logits_and_sinks_on_empty_rows():
    """Scores of 1e6 capped to c: a softmax over c * tanh(x / c), the scale (with k_scale)
    inside the tanh; a sink of 1e4 or -1e4 is neither scaled nor capped; rows with no key
    stay 0 / -inf with sinks."""
    rng = np.random.default_rng(7)
    lens, hq = [5, 0, 2], 4
    (kc, vc), pt, rows = _pool(rng, lens, 4, 2, (8, 8))
    q = (rng.standard_normal((len(lens) * 3, hq, 8)) * 1e5).astype(np.float32)
    sinks = np.array([1e4, -1e4, 0.0, 3.0], np.float32)
    out, lse = reference.mha_decode(
        q, kc, vc, pt, np.array(lens, np.int32), max_seqlen_q=3, logit_cap=30.0, sinks=sinks, softmax_scale=0.5,
        k_scale=2.0, return_lse=True,
    )  # fmt: skip
    want_o, want_lse = np.zeros(out.shape), np.full(lse.shape, -np.inf)
    for b, (k, v) in enumerate(rows):
        sl = slice(b * 3, (b + 1) * 3)
        want_o[sl], want_lse[sl] = _attend(
            q[sl].astype(np.float64), k, v, causal=True, cap=30.0, sinks=sinks, scale=1.0
        )
    _check(out, lse, want_o, want_lse)
    assert np.abs(np.asarray(lse)[np.isfinite(want_lse)]).max() <= 30.0 + np.log(5) + 1e-3
    assert (np.asarray(out)[:, 0] == 0).all()  # a sink of 1e4 takes all the mass


@pytest.mark.parametrize("wl", [-1, 0, 3, 2**31 - 1])
def test_mha_extend_over_a_paged_prefix_against_float64(wl):
    rng = np.random.default_rng(11)
    lens, new = [97, 1, 0, 20], [5, 1, 0, 20]  # a prefix of 92; no prefix; empty; a prefill
    (kc, vc), pt, rows = _pool(rng, lens, 16, 2, (8, 8))
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]) + 3, 4, 8)).astype(np.float32)
    q[cu[-1] :] = np.nan  # token-bucket padding rows
    out, lse = reference.mha_extend(
        q, kc, vc, pt, np.array(lens, np.int32), cu, max_seqlen_q=32, window_left=wl, return_lse=True
    )
    want_o, want_lse = np.zeros(out.shape), np.full(lse.shape, -np.inf)
    for b, (k, v) in enumerate(rows):
        sl = slice(cu[b], cu[b + 1])
        want_o[sl], want_lse[sl] = _attend(q[sl].astype(np.float64), k, v, causal=True, wl=wl, scale=8**-0.5)
    _check(out, lse, want_o, want_lse)


@pytest.mark.parametrize("causal,wl", [(True, -1), (True, 4), (False, -1), (False, 2**31 - 1)])
def test_mha_prefill_192_128_with_own_key_offsets_against_float64(causal, wl):
    """MLA's non-absorbed prefill shape: head_dim_qk 192, head_dim_v 128, scale 1/sqrt(192);
    keys with offsets of their own (more keys than queries, a request with no keys)."""
    rng = np.random.default_rng(13)
    nq, nk = [3, 1, 2, 0], [7, 1, 0, 4]
    cu_q = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(nk)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]) + 2, 4, 192)).astype(np.float32)
    k = rng.standard_normal((int(cu_k[-1]) + 1, 2, 192)).astype(np.float32)
    v = rng.standard_normal((int(cu_k[-1]) + 1, 2, 128)).astype(np.float32)
    k[-1], v[-1], q[cu_q[-1] :] = np.nan, np.nan, np.nan  # padding
    out, lse = reference.mha_prefill(
        q, k, v, cu_q, cu_k, max_seqlen_q=3, max_seqlen_kv=7, is_causal=causal, window_left=wl, return_lse=True
    )
    want_o, want_lse = np.zeros(out.shape), np.full(lse.shape, -np.inf)
    f64 = np.float64
    for b in range(len(nq)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want_o[sq], want_lse[sq] = _attend(
            q[sq].astype(f64), k[sk].astype(f64), v[sk].astype(f64), causal=causal, wl=wl, scale=192**-0.5
        )
    _check(out, lse, want_o, want_lse)


def test_mla_decode_against_float64():
    """576-wide latent rows, the value their first 512 columns, one KV head for all heads,
    the caller's scale 1/sqrt(192) (never 1/sqrt(576)), kv_scale on the scores and the output."""
    rng = np.random.default_rng(17)
    lens, n, h = [97, 0, 2], 2, 4
    (kv,), pt, rows = _pool(rng, lens, 64, 1, (576,))
    kv = kv[:, :, 0]
    q = rng.standard_normal((len(lens) * n, h, 576)).astype(np.float32) * 0.3
    out, lse = reference.mla_decode(
        q, kv, pt, np.array(lens, np.int32), kv_lora_rank=512, softmax_scale=192**-0.5, max_seqlen_q=n,
        kv_scale=0.5, return_lse=True,
    )  # fmt: skip
    assert out.shape == (len(lens) * n, h, 512)
    want_o, want_lse = np.zeros(out.shape), np.full(lse.shape, -np.inf)
    for b, (rows_b,) in enumerate(rows):
        sl = slice(b * n, (b + 1) * n)
        want_o[sl], want_lse[sl] = _attend(
            q[sl].astype(np.float64), rows_b, rows_b[:, :, :512], causal=True, scale=0.5 * 192**-0.5, v_scale=0.5
        )
    _check(out, lse, want_o, want_lse)


def test_merge_state_against_float64():
    rng = np.random.default_rng(19)
    o_a, o_b = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    lse_a = np.array([0.0, -np.inf, 3.0, -np.inf, 80.0], np.float32)[:, None].repeat(3, 1)
    lse_b = np.array([1.0, 2.0, -np.inf, -np.inf, -80.0], np.float32)[:, None].repeat(3, 1)
    o_a[lse_a == -np.inf] = 0  # an empty part's output is 0
    o_b[lse_b == -np.inf] = 0
    out, lse = reference.attn_merge_state(o_a, lse_a, o_b, lse_b)
    m = np.maximum(lse_a, lse_b).astype(np.float64)
    with np.errstate(invalid="ignore"):
        w_a, w_b = np.exp(lse_a - m), np.exp(lse_b - m)
    w_a[np.isneginf(m)], w_b[np.isneginf(m)] = 0, 0
    tot = w_a + w_b
    want = np.where(
        tot[..., None] > 0, (w_a[..., None] * o_a + w_b[..., None] * o_b) / np.maximum(tot, 1e-300)[..., None], 0
    )
    with np.errstate(divide="ignore"):
        want_lse = np.where(tot > 0, m + np.log(tot), -np.inf)
    _check(out, lse, want, want_lse)
    np.testing.assert_array_equal(np.asarray(out)[1], o_b[1])  # one side empty: the other unchanged
    np.testing.assert_array_equal(np.asarray(lse)[2], lse_a[2])


def test_reference_matmuls_ask_for_f32_precision():
    """The xla backend's score and P V matmuls are full f32 whatever the default matmul
    precision (TF32 on a GPU, bf16 passes on a TPU), so it stays the f32 oracle there."""
    from jattn import reference

    q = jnp.ones((2, 4, 64), jnp.bfloat16)
    k = jnp.ones((8, 16, 2, 64), jnp.bfloat16)
    pt = jnp.zeros((2, 4), jnp.int32)
    lens = jnp.array([5, 9], jnp.int32)
    with jax.default_matmul_precision("bfloat16"):
        text = jax.jit(lambda q, k: reference.mha_decode(q, k, k, pt, lens)).lower(q, k).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) >= 2 and all("HIGHEST" in line for line in dots), dots
