"""Naive float64 attention written from docs/SEMANTICS.md, independently of
``jattn.reference``: explicit loops over requests, queries and heads; numpy only.

Everything here is deliberately slow and literal. Inputs may be numpy or JAX arrays
of any float dtype (FP8 included); they are converted to float64 first.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FP8_MAX = 448.0


def f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def attend_one(q, k, v, *, causal, window_left=-1, logit_cap=0.0, sinks=None, scale):
    """One request. q [n, Hq, Dqk], k [L, Hkv, Dqk], v [L, Hkv, Dv] (float64).

    Returns o [n, Hq, Dv] and the natural-log LSE [n, Hq] (without the sink).
    """
    n, hq, _ = q.shape
    big_l, hkv = k.shape[0], k.shape[1]
    dv = v.shape[2]
    group = hq // hkv
    o = np.zeros((n, hq, dv))
    lse = np.full((n, hq), -np.inf)
    for i in range(n):
        pos = big_l - n + i  # the query's own key position
        visible = []
        for j in range(big_l):
            if causal and j > pos:
                continue
            if window_left >= 0 and j < pos - window_left:
                continue
            visible.append(j)
        if not visible:
            continue  # o = 0, lse = -inf
        idx = np.array(visible)
        for h in range(hq):
            kh = h // group
            x = scale * (k[idx, kh, :] @ q[i, h, :])
            if logit_cap > 0:
                x = logit_cap * np.tanh(x / logit_cap)
            m = x.max()
            denom = np.exp(x - m).sum()
            lse[i, h] = m + math.log(denom)
            total = denom
            if sinks is not None:
                total = denom + math.exp(float(sinks[h]) - m)
            p = np.exp(x - m) / total
            o[i, h, :] = p @ v[idx, kh, :]
    return o, lse


def gather_paged(cache, page_table_row, length):
    """Tokens 0..length-1 of one request from a paged pool [pages, page_size, ...]."""
    cache = np.asarray(cache)
    page_size = cache.shape[1]
    rows = [cache[int(page_table_row[t // page_size]), t % page_size] for t in range(length)]
    if not rows:
        return np.zeros((0,) + cache.shape[2:], np.float64)
    return f64(np.stack(rows))


def mha_decode(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    *,
    max_seqlen_q=1,
    is_causal=True,
    window_left=-1,
    logit_cap=0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
):
    q = f64(q)
    page_table = np.asarray(page_table)
    lens = np.asarray(cache_seqlens)
    bs = page_table.shape[0]
    n = max_seqlen_q
    scale = 1 / math.sqrt(q.shape[2]) if softmax_scale is None else softmax_scale
    dv = np.asarray(v_cache).shape[3]
    out = np.zeros((bs * n, q.shape[1], dv))
    lse = np.full((bs * n, q.shape[1]), -np.inf)
    for b in range(bs):
        k = gather_paged(k_cache, page_table[b], int(lens[b])) * k_scale
        v = gather_paged(v_cache, page_table[b], int(lens[b])) * v_scale
        o_b, l_b = attend_one(
            q[b * n : (b + 1) * n],
            k,
            v,
            causal=is_causal,
            window_left=window_left,
            logit_cap=logit_cap,
            sinks=sinks,
            scale=scale,
        )
        out[b * n : (b + 1) * n], lse[b * n : (b + 1) * n] = o_b, l_b
    return out, lse


def mha_extend(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    cu_seqlens_q,
    *,
    is_causal=True,
    window_left=-1,
    logit_cap=0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
):
    """Ragged queries; rows past cu_seqlens_q[-1] are 0 with LSE -inf."""
    q = f64(q)
    page_table = np.asarray(page_table)
    lens = np.asarray(cache_seqlens)
    cu = np.asarray(cu_seqlens_q)
    scale = 1 / math.sqrt(q.shape[2]) if softmax_scale is None else softmax_scale
    dv = np.asarray(v_cache).shape[3]
    out = np.zeros((q.shape[0], q.shape[1], dv))
    lse = np.full((q.shape[0], q.shape[1]), -np.inf)
    for b in range(page_table.shape[0]):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi == lo:
            continue
        k = gather_paged(k_cache, page_table[b], int(lens[b])) * k_scale
        v = gather_paged(v_cache, page_table[b], int(lens[b])) * v_scale
        out[lo:hi], lse[lo:hi] = attend_one(
            q[lo:hi], k, v, causal=is_causal, window_left=window_left, logit_cap=logit_cap, sinks=sinks, scale=scale
        )
    return out, lse


def mha_prefill(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_kv=None,
    *,
    is_causal=True,
    window_left=-1,
    logit_cap=0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
):
    q, k, v = f64(q), f64(k) * k_scale, f64(v) * v_scale
    cu = np.asarray(cu_seqlens_q)
    cukv = cu if cu_seqlens_kv is None else np.asarray(cu_seqlens_kv)
    scale = 1 / math.sqrt(q.shape[2]) if softmax_scale is None else softmax_scale
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = np.full((q.shape[0], q.shape[1]), -np.inf)
    for b in range(len(cu) - 1):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi == lo:
            continue
        klo, khi = int(cukv[b]), int(cukv[b + 1])
        out[lo:hi], lse[lo:hi] = attend_one(
            q[lo:hi],
            k[klo:khi],
            v[klo:khi],
            causal=is_causal,
            window_left=window_left,
            logit_cap=logit_cap,
            sinks=sinks,
            scale=scale,
        )
    return out, lse


def mla_decode(
    q, kv_cache, page_table, cache_seqlens, *, kv_lora_rank, softmax_scale, max_seqlen_q=1, is_causal=True, kv_scale=1.0
):
    """Absorbed MLA: one latent KV head [R + r]; value = first R columns of the same row."""
    q = f64(q)
    page_table = np.asarray(page_table)
    lens = np.asarray(cache_seqlens)
    n = max_seqlen_q
    bs = page_table.shape[0]
    out = np.zeros((q.shape[0], q.shape[1], kv_lora_rank))
    lse = np.full((q.shape[0], q.shape[1]), -np.inf)
    for b in range(bs):
        rows = gather_paged(kv_cache, page_table[b], int(lens[b])) * kv_scale  # [L, R + r]
        k = rows[:, None, :]
        v = rows[:, None, :kv_lora_rank]
        out[b * n : (b + 1) * n], lse[b * n : (b + 1) * n] = attend_one(
            q[b * n : (b + 1) * n], k, v, causal=is_causal, scale=softmax_scale
        )
    return out, lse


def merge_state(o_a, lse_a, o_b, lse_b):
    o_a, lse_a, o_b, lse_b = f64(o_a), f64(lse_a), f64(o_b), f64(lse_b)
    o = np.zeros_like(o_a)
    lse = np.full_like(lse_a, -np.inf)
    for t in range(o_a.shape[0]):
        for h in range(o_a.shape[1]):
            if np.isnan(lse_a[t, h]) or np.isnan(lse_b[t, h]):  # a NaN state poisons the merge
                o[t, h], lse[t, h] = np.nan, np.nan
                continue
            m = max(lse_a[t, h], lse_b[t, h])
            if m == -np.inf:
                continue
            wa, wb = math.exp(lse_a[t, h] - m), math.exp(lse_b[t, h] - m)
            o[t, h] = (wa * o_a[t, h] + wb * o_b[t, h]) / (wa + wb)
            lse[t, h] = m + math.log(wa + wb)
    return o, lse


def quantize_fp8(x, scale=1.0):
    """``clamp(x / scale, -448, 448)`` as float8_e4m3fn (numpy / ml_dtypes)."""
    y = np.clip(f64(x) / scale, -FP8_MAX, FP8_MAX)
    return y.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)


def set_kv_buffer(k_cache, v_cache, out_cache_loc, k, v, *, k_scale=None, v_scale=None):
    kc, vc = np.array(k_cache), np.array(v_cache)
    page_size = kc.shape[1]
    fp8 = kc.dtype == ml_dtypes.float8_e4m3fn
    k, v = np.asarray(k), np.asarray(v)
    for t, slot in enumerate(np.asarray(out_cache_loc)):
        p, off = int(slot) // page_size, int(slot) % page_size
        if fp8:
            kc[p, off] = quantize_fp8(k[t], 1.0 if k_scale is None else k_scale)
            vc[p, off] = quantize_fp8(v[t], 1.0 if v_scale is None else v_scale)
        else:
            kc[p, off] = f64(k[t]).astype(kc.dtype)
            vc[p, off] = f64(v[t]).astype(vc.dtype)
    return kc, vc


def set_mla_kv_buffer(kv_cache, out_cache_loc, c_kv, k_pe, *, kv_scale=None):
    kv = np.array(kv_cache)
    page_size = kv.shape[1]
    c_kv, k_pe = f64(c_kv), f64(k_pe)
    t_total = len(np.asarray(out_cache_loc))
    c_kv, k_pe = c_kv.reshape(t_total, c_kv.shape[-1]), k_pe.reshape(t_total, k_pe.shape[-1])
    for t, slot in enumerate(np.asarray(out_cache_loc)):
        row = np.concatenate([c_kv[t], k_pe[t]])
        p, off = int(slot) // page_size, int(slot) % page_size
        if kv.dtype == ml_dtypes.float8_e4m3fn:
            kv[p, off] = quantize_fp8(row, 1.0 if kv_scale is None else kv_scale)
        else:
            kv[p, off] = row.astype(kv.dtype)
    return kv


# ----------------------------------------------------------------------------- test data helpers


class Pool:
    """A paged pool with randomly permuted pages; every slot not holding a real token is NaN
    (the dummy page 0, unused pages, and each request's tail past its length)."""

    def __init__(self, rng, lens, page_size, extra_pages=3, max_pages=None):
        self.page_size = page_size
        lens = [int(x) for x in lens]
        need = [-(-x // page_size) for x in lens]
        self.num_pages = 1 + sum(need) + extra_pages
        perm = rng.permutation(np.arange(1, self.num_pages))
        width = max(max(need, default=1), 1) if max_pages is None else max_pages
        # Entries past a request's last page point at NaN-filled unused pages (or page 0).
        spare = perm[sum(need) :]
        fill = np.concatenate([spare, [0]])
        self.page_table = rng.choice(fill, size=(len(lens), width)).astype(np.int32)
        i = 0
        for b, nb in enumerate(need):
            self.page_table[b, :nb] = perm[i : i + nb]
            i += nb
        self.lens = np.array(lens, np.int32)
        self.valid = np.zeros((self.num_pages, page_size), bool)
        for b, length in enumerate(lens):
            for t in range(length):
                self.valid[self.page_table[b, t // page_size], t % page_size] = True

    def fill(self, rng, tail_shape, dtype=np.float32, scale=1.0):
        """A [num_pages, page_size, *tail_shape] array: random where valid, NaN elsewhere."""
        x = rng.standard_normal((self.num_pages, self.page_size) + tuple(tail_shape)) * scale
        x = x.astype(np.float32)
        x[~self.valid] = np.nan
        return x.astype(dtype) if dtype is not np.float32 else x


def bf16_round(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def assert_close_lowp(out, truth, baseline, *, atol, name="out"):
    """err(kernel) <= 2 * err(reference run in low precision) + atol; NaN-free; exact where
    truth is exactly 0 (empty rows)."""
    out = f64(out)
    assert not np.isnan(out).any(), f"{name} has NaN"
    err = np.abs(out - truth).max(initial=0.0)
    base = np.abs(f64(baseline) - truth).max(initial=0.0)
    assert err <= 2 * base + atol, f"{name}: err {err:.3e} > 2 * {base:.3e} + {atol:.1e}"


def assert_lse(lse, truth, *, atol=1e-4, rtol=1e-5, name="lse"):
    lse = f64(lse)
    assert lse.shape == truth.shape, (lse.shape, truth.shape)
    assert not np.isnan(lse).any(), f"{name} has NaN"
    empty = np.isneginf(truth)
    assert np.array_equal(np.isneginf(lse), empty), f"{name}: -inf pattern differs"
    assert not np.isinf(lse[~empty]).any()
    np.testing.assert_allclose(lse[~empty], truth[~empty], atol=atol, rtol=rtol, err_msg=name)
