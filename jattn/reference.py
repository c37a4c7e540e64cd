"""Plain-JAX reference implementations of every jattn op (the ``xla`` backend).

These are the oracle for every kernel test and the CPU fallback. They implement
docs/SEMANTICS.md exactly: f32 products and accumulation (the matmuls ask for full f32
precision, so a GPU's default TF32 or a TPU's bf16 passes do not apply), natural-log LSE,
empty rows give 0 and -inf.
The public wrappers with argument checks and backend dispatch are in :mod:`jattn.ops`;
the arguments here are the same.

All attention ops funnel into one chunked online-softmax core, ``_attend``: the keys
of request ``b`` are addressed by a function ``slot(b, j)`` into a flat key array
(``page_table`` lookups for paged caches, ``cu_seqlens_kv`` offsets for ragged
keys), so scores are materialised one key chunk at a time, never for every
request at the batch's maximum length.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jattn.checks import _window_within

FP8_E4M3_MAX = 448.0
_NEG_INF = float("-inf")
_F32 = jax.lax.Precision.HIGHEST  # the reference's matmuls in f32 whatever the default precision


def default_softmax_scale(head_dim_qk: int) -> float:
    """``1 / sqrt(head_dim_qk)``, the scale used when ``softmax_scale`` is None."""
    return 1.0 / math.sqrt(head_dim_qk)


#: Keys per chunk of a batch-invariant decode (``key_chunk``): fixed, so a request's sums do
#: not depend on the batch (the default chunk shrinks as the batch grows).
INVARIANT_KEY_CHUNK = 256


def _key_chunk(bs: int, num_q: int, num_q_heads: int, max_keys: int, fixed: int | None = None) -> int:
    """Keys per chunk: bounded so one f32 score tile stays near 16M elements (``fixed``:
    that many, whatever the batch)."""
    if fixed is not None:
        return max(1, min(fixed, max_keys))
    budget = max(1, (1 << 24) // max(1, bs * num_q * num_q_heads))
    chunk = 16
    while chunk * 2 <= min(budget, 1024):
        chunk *= 2
    return max(1, min(chunk, max_keys))


def _attend(
    q,  # f32-castable [bs, nq, Hq, Dqk]
    k_flat,  # [N, Hkv, Dqk]
    v_flat,  # [N, Hkv, Dv] or None: v is the first dim_v columns of k
    slot: Callable,  # (b i32[bs, 1], j i32[bs, C]) -> i32[bs, C] index into k_flat
    kv_len,  # i32[bs]
    q_pos,  # i32[bs, nq]: absolute key position of each query (L - n + i)
    *,
    max_keys: int,
    dim_v: int,
    is_causal: bool,
    window_left: int,
    logit_cap: float,
    sinks,  # f32[Hq] or None
    scale,  # python float or f32 scalar (softmax scale, k_scale folded in)
    v_scale,  # python float or f32 scalar
    key_chunk: int | None = None,  # keys per chunk (None: from the batch, see _key_chunk)
):
    """Returns (o f32[bs, nq, Hq, Dv], lse f32[bs, nq, Hq]).

    A masked key contributes nothing whatever its K and V hold: scores are selected to
    ``-inf`` and the P @ V product reads V with its non-finite entries replaced by 0, so
    no ``0 * NaN`` reaches a row. A row that sees a key whose K or V (in the row's KV
    head) holds a non-finite value comes out NaN (output and LSE): a per-row count,
    ``mask @ bad_key``, is kept alongside the online softmax. With a sliding window only
    the ``max_seqlen_q + window_left`` keys that some query of the request can see are
    visited (chunks start at each request's first visible key).
    """
    bs, nq, hq, dqk = q.shape
    hkv = k_flat.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv} (> 0)")
    group = hq // hkv
    window_left = _window_within(window_left, max_keys)  # and no int32 wrap of q_pos - window_left
    if window_left >= 0:  # keys [start, start + span) hold every key some query sees
        span = min(max_keys, nq + window_left)
        start = jnp.maximum(q_pos.min(axis=1) - window_left, 0) if nq else jnp.zeros((bs,), jnp.int32)
    else:
        span, start = max_keys, jnp.zeros((bs,), jnp.int32)
    if 0 in (bs, nq, hq, span, k_flat.shape[0]):  # nothing to attend: every row is empty
        return jnp.zeros((bs, nq, hq, dim_v), jnp.float32), jnp.full((bs, nq, hq), _NEG_INF, jnp.float32)
    qf = q.astype(jnp.float32).reshape(bs, nq, hkv, group, dqk)
    chunk = _key_chunk(bs, nq, hq, span, key_chunk)
    num_chunks = -(-span // chunk)
    b_idx = jnp.arange(bs, dtype=jnp.int32)[:, None]
    start = start.astype(jnp.int32)[:, None]  # [bs, 1]

    def body(c, carry):
        m, l, acc, nbad = carry  # [bs, hkv, g, nq], same, [bs, hkv, g, nq, dv], [bs, hkv, nq]
        j = start + c * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [bs, C]
        key_ok = (j < kv_len[:, None]) & (j < max_keys)  # [bs, C]
        idx = jnp.where(key_ok, slot(b_idx, j), 0)
        kc = k_flat[idx].astype(jnp.float32)  # [bs, C, hkv, dqk]
        bad = ~jnp.isfinite(kc).all(axis=-1)  # [bs, C, hkv]: K row holds NaN / Inf
        if v_flat is None:  # MLA: V is part of the K row, already in `bad`
            vc = kc[..., :dim_v]
        else:
            vc = v_flat[idx].astype(jnp.float32)
            bad = bad | ~jnp.isfinite(vc).all(axis=-1)
        vc = jnp.where(jnp.isfinite(vc), vc, 0.0)  # select, never 0 * NaN
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kc, precision=_F32) * scale
        if logit_cap > 0:
            s = logit_cap * jnp.tanh(s / logit_cap)
        jj = j[:, None, :]  # [bs, 1, C]
        qp = q_pos[:, :, None]  # [bs, nq, 1]
        mask = key_ok[:, None, :]
        if is_causal:
            mask = mask & (jj <= qp)
        if window_left >= 0:
            mask = mask & (jj >= qp - window_left)
        # Rows that see a non-finite key: a [bs, nq, C] @ [bs, C, hkv] count, no [q, k, d] tensor.
        nbad = nbad + jnp.einsum("bqk,bkh->bhq", mask.astype(jnp.float32), bad.astype(jnp.float32), precision=_F32)
        s = jnp.where(mask[:, None, None], s, _NEG_INF)  # [bs, hkv, g, nq, C]
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l_new = alpha * l + p.sum(axis=-1)
        acc_new = alpha[..., None] * acc + jnp.einsum("bhgqk,bkhd->bhgqd", p, vc, precision=_F32)
        return m_new, l_new, acc_new, nbad

    init = (
        jnp.full((bs, hkv, group, nq), _NEG_INF, jnp.float32),
        jnp.zeros((bs, hkv, group, nq), jnp.float32),
        jnp.zeros((bs, hkv, group, nq, dim_v), jnp.float32),
        jnp.zeros((bs, hkv, nq), jnp.float32),
    )
    m, l, acc, nbad = jax.lax.fori_loop(0, num_chunks, body, init)
    empty = l == 0.0
    lse = jnp.where(empty, _NEG_INF, jnp.where(empty, 0.0, m) + jnp.log(jnp.where(empty, 1.0, l)))
    denom = l
    if sinks is not None:
        sink = jnp.asarray(sinks, jnp.float32).reshape(hkv, group)[None, :, :, None]
        denom = l + jnp.exp(sink - jnp.where(empty, 0.0, m))
    o = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, denom)[..., None])
    o = o * v_scale
    poisoned = (nbad > 0)[:, :, None, :]  # [bs, hkv, 1, nq]
    o = jnp.where(poisoned[..., None], jnp.nan, o)
    lse = jnp.where(poisoned, jnp.nan, lse)
    # [bs, hkv, g, nq, dv] -> [bs, nq, hq, dv]
    o = o.transpose(0, 3, 1, 2, 4).reshape(bs, nq, hq, dim_v)
    lse = lse.transpose(0, 3, 1, 2).reshape(bs, nq, hq)
    return o, lse


def _paged_slot(page_table, page_size: int):
    num_pages_per_req = page_table.shape[1]

    def slot(b, j):
        col = jnp.minimum(j // page_size, num_pages_per_req - 1)
        return page_table[b, col] * page_size + j % page_size

    return slot


def _ragged_slot(cu_seqlens_kv):
    def slot(b, j):
        return cu_seqlens_kv[b] + j

    return slot


def _pad_queries(q, cu_seqlens_q, max_seqlen_q: int, kv_len):
    """Ragged q [T, H, D] -> per-request blocks [bs, max_q, H, D] (padding rows zero),
    and each query's absolute position ``L - n + i``."""
    i = jnp.arange(max_seqlen_q, dtype=jnp.int32)[None, :]
    n = (cu_seqlens_q[1:] - cu_seqlens_q[:-1])[:, None]
    tok = cu_seqlens_q[:-1, None] + i
    if q.shape[0] == 0:  # no query rows at all
        qb = jnp.zeros((tok.shape[0], max_seqlen_q) + q.shape[1:], q.dtype)
    else:
        qb = jnp.where((i < n)[:, :, None, None], q[jnp.clip(tok, 0, q.shape[0] - 1)], 0)
    return qb, kv_len[:, None] - n + i


def _attend_paged(qb, k_cache, v_cache, page_table, kv_len, q_pos, **opts):
    num_pages, page_size, hkv, d = k_cache.shape
    dv = v_cache.shape[-1]
    return _attend(
        qb,
        k_cache.reshape(num_pages * page_size, hkv, d),
        v_cache.reshape(num_pages * page_size, hkv, dv),
        _paged_slot(page_table, page_size),
        kv_len,
        q_pos,
        max_keys=page_table.shape[1] * page_size,
        dim_v=dv,
        **opts,
    )


def _padded_to_ragged(o_pad, lse_pad, cu_seqlens_q, num_tokens: int):
    """Gather padded per-request rows back to token-major; padding tokens give 0 / -inf."""
    if 0 in o_pad.shape[:2]:  # no request or no query rows: every token is padding
        return (
            jnp.zeros((num_tokens,) + o_pad.shape[2:], jnp.float32),
            jnp.full((num_tokens,) + lse_pad.shape[2:], _NEG_INF, jnp.float32),
        )
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(cu_seqlens_q, t, side="right") - 1, 0, o_pad.shape[0] - 1)
    i = jnp.clip(t - cu_seqlens_q[b], 0, o_pad.shape[1] - 1)
    real = t < cu_seqlens_q[-1]
    o = jnp.where(real[:, None, None], o_pad[b, i], 0.0)
    lse = jnp.where(real[:, None], lse_pad[b, i], _NEG_INF)
    return o, lse


def _finish(o, lse, dtype, return_lse):
    o = o.astype(dtype)
    return (o, lse) if return_lse else o


_OPTS = ("is_causal", "window_left", "logit_cap", "return_lse")


@functools.partial(jax.jit, static_argnames=("max_seqlen_q", "key_chunk") + _OPTS)
def mha_decode(
    q,  # [bs * q_len, Hq, D]
    k_cache,  # [num_pages, page_size, Hkv, D]
    v_cache,  # [num_pages, page_size, Hkv, Dv]
    page_table,  # i32[bs, max_pages]
    cache_seqlens,  # i32[bs], new tokens included
    *,
    max_seqlen_q: int = 1,
    is_causal: bool = True,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks=None,  # f32[Hq] or None
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse: bool = False,
    key_chunk: int | None = None,  # keys per online-softmax chunk (None: from the batch)
):
    """Paged decode, ``max_seqlen_q`` query tokens per request (request-major).

    q is ``[bs * max_seqlen_q, Hq, D]`` (bf16/fp16/f32), request ``b``'s tokens in rows
    ``b * max_seqlen_q ...``; the caches are ``[num_pages, page_size, Hkv, D|Dv]`` (bf16/fp16/
    f32/fp8 e4m3), k_scale and v_scale dequantise them (1.0 for non-FP8 caches). Returns out
    ``[bs * max_seqlen_q, Hq, Dv]`` in q's dtype, and with ``return_lse`` the natural-log LSE
    ``f32[bs * max_seqlen_q, Hq]``.
    """
    bs = page_table.shape[0]
    hq, d = q.shape[1:]
    scale = default_softmax_scale(d) if softmax_scale is None else softmax_scale
    qb = q.reshape(bs, max_seqlen_q, hq, d)
    kv_len = cache_seqlens.astype(jnp.int32)
    q_pos = kv_len[:, None] - max_seqlen_q + jnp.arange(max_seqlen_q, dtype=jnp.int32)[None]
    opts = dict(
        is_causal=is_causal,
        window_left=window_left,
        logit_cap=logit_cap,
        sinks=sinks,
        scale=scale * k_scale,
        v_scale=v_scale,
        key_chunk=key_chunk,
    )
    if key_chunk is None:
        o, lse = _attend_paged(qb, k_cache, v_cache, page_table, kv_len, q_pos, **opts)
    else:  # batch-invariant: each request by the same program, whatever the batch around it

        def one(x):
            o1, lse1 = _attend_paged(x[0][None], k_cache, v_cache, x[1][None], x[2][None], x[3][None], **opts)
            return o1[0], lse1[0]

        o, lse = jax.lax.map(one, (qb, page_table, kv_len, q_pos))
    return _finish(
        o.reshape(bs * max_seqlen_q, hq, o.shape[-1]), lse.reshape(bs * max_seqlen_q, hq), q.dtype, return_lse
    )


@functools.partial(jax.jit, static_argnames=("max_seqlen_q",) + _OPTS)
def mha_extend(
    q,  # [num_tokens, Hq, D] ragged
    k_cache,  # [num_pages, page_size, Hkv, D]
    v_cache,  # [num_pages, page_size, Hkv, Dv]
    page_table,  # i32[bs, max_pages]
    cache_seqlens,  # i32[bs]: prefix + new tokens
    cu_seqlens_q,  # i32[bs + 1]
    *,
    max_seqlen_q: int,
    is_causal: bool = True,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse: bool = False,
):
    """New tokens attend to the paged prefix and (causally) to themselves.

    q is ragged ``[num_tokens, Hq, D]``: request ``b`` owns rows ``cu_seqlens_q[b] :
    cu_seqlens_q[b + 1]`` (at most ``max_seqlen_q``), whose K/V are already in the cache;
    rows past ``cu_seqlens_q[-1]`` give 0 (LSE ``-inf``). Other arguments and the result
    as in :func:`mha_decode` (out ``[num_tokens, Hq, Dv]``, LSE ``f32[num_tokens, Hq]``).
    """
    d = q.shape[-1]
    scale = default_softmax_scale(d) if softmax_scale is None else softmax_scale
    kv_len = cache_seqlens.astype(jnp.int32)
    qb, q_pos = _pad_queries(q, cu_seqlens_q, max_seqlen_q, kv_len)
    o, lse = _attend_paged(
        qb,
        k_cache,
        v_cache,
        page_table,
        kv_len,
        q_pos,
        is_causal=is_causal,
        window_left=window_left,
        logit_cap=logit_cap,
        sinks=sinks,
        scale=scale * k_scale,
        v_scale=v_scale,
    )
    o, lse = _padded_to_ragged(o, lse, cu_seqlens_q, q.shape[0])
    return _finish(o, lse, q.dtype, return_lse)


@functools.partial(jax.jit, static_argnames=("max_seqlen_q", "max_seqlen_kv") + _OPTS)
def mha_prefill(
    q,  # [num_tokens, Hq, Dqk] ragged
    k,  # [num_kv_tokens, Hkv, Dqk] ragged
    v,  # [num_kv_tokens, Hkv, Dv] ragged
    cu_seqlens_q,  # i32[bs + 1]
    cu_seqlens_kv=None,  # i32[bs + 1]; defaults to cu_seqlens_q
    *,
    max_seqlen_q: int,
    max_seqlen_kv: int | None = None,
    is_causal: bool = True,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks=None,
    softmax_scale=None,
    k_scale=1.0,
    v_scale=1.0,
    return_lse: bool = False,
):
    """Ragged attention without a cache; ``head_dim_qk`` may differ from ``head_dim_v``.

    Request ``b`` has queries ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` and keys
    ``cu_seqlens_kv[b] : cu_seqlens_kv[b + 1]`` (``L`` of them); the causal mask is aligned
    bottom-right (query ``i`` of ``n`` sees ``j <= L - n + i``). ``max_seqlen_q`` /
    ``max_seqlen_kv`` bound the per-request lengths. Returns out ``[num_tokens, Hq, Dv]`` in
    q's dtype (rows past ``cu_seqlens_q[-1]`` are 0), and with ``return_lse`` the
    natural-log LSE ``f32[num_tokens, Hq]``.
    """
    if cu_seqlens_kv is None:
        cu_seqlens_kv = cu_seqlens_q
    if max_seqlen_kv is None:
        max_seqlen_kv = max_seqlen_q
    d = q.shape[-1]
    scale = default_softmax_scale(d) if softmax_scale is None else softmax_scale
    kv_len = (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).astype(jnp.int32)
    qb, q_pos = _pad_queries(q, cu_seqlens_q, max_seqlen_q, kv_len)
    o, lse = _attend(
        qb,
        k,
        v,
        _ragged_slot(cu_seqlens_kv.astype(jnp.int32)),
        kv_len,
        q_pos,
        max_keys=max_seqlen_kv,
        dim_v=v.shape[-1],
        is_causal=is_causal,
        window_left=window_left,
        logit_cap=logit_cap,
        sinks=sinks,
        scale=scale * k_scale,
        v_scale=v_scale,
    )
    o, lse = _padded_to_ragged(o, lse, cu_seqlens_q, q.shape[0])
    return _finish(o, lse, q.dtype, return_lse)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "max_seqlen_q", "is_causal", "return_lse"))
def mla_decode(
    q,  # [bs * q_len, H, R + r]: absorbed q_nope then rope(q_pe)
    kv_cache,  # [num_pages, page_size, R + r]: c_kv then k_pe
    page_table,  # i32[bs, max_pages]
    cache_seqlens,  # i32[bs]
    *,
    kv_lora_rank: int,
    softmax_scale,
    max_seqlen_q: int = 1,
    is_causal: bool = True,
    kv_scale=1.0,
    return_lse: bool = False,
):
    """MLA absorbed decode: one shared latent KV head; output is the latent [.., H, R].

    Scores are taken against the whole ``R + r`` row, the value is its first ``R`` columns.
    ``kv_scale`` dequantises an FP8 cache (folded into the scale and the output). Returns out
    ``[bs * max_seqlen_q, H, R]`` in q's dtype, and with ``return_lse`` the natural-log LSE
    ``f32[bs * max_seqlen_q, H]``.
    """
    bs = page_table.shape[0]
    num_pages, page_size, width = kv_cache.shape
    h = q.shape[1]
    qb = q.reshape(bs, max_seqlen_q, h, width)
    kv_len = cache_seqlens.astype(jnp.int32)
    q_pos = kv_len[:, None] - max_seqlen_q + jnp.arange(max_seqlen_q, dtype=jnp.int32)[None]
    o, lse = _attend(
        qb,
        kv_cache.reshape(num_pages * page_size, 1, width),
        None,
        _paged_slot(page_table, page_size),
        kv_len,
        q_pos,
        max_keys=page_table.shape[1] * page_size,
        dim_v=kv_lora_rank,
        is_causal=is_causal,
        window_left=-1,
        logit_cap=0.0,
        sinks=None,
        scale=softmax_scale * kv_scale,
        v_scale=kv_scale,
    )
    return _finish(
        o.reshape(bs * max_seqlen_q, h, kv_lora_rank),
        lse.reshape(bs * max_seqlen_q, h),
        q.dtype,
        return_lse,
    )


@jax.jit
def attn_merge_state(o_a, lse_a, o_b, lse_b):
    """Merge two partial attentions over disjoint key sets (natural-log LSE).

    o_*: [T, H, D] (any float dtype; the result has o_a's); lse_*: f32[T, H]. Both
    ``-inf`` gives ``o = 0, lse = -inf``. Returns ``(o [T, H, D], lse f32[T, H])``.
    """
    lse_a = lse_a.astype(jnp.float32)
    lse_b = lse_b.astype(jnp.float32)
    m = jnp.maximum(lse_a, lse_b)
    both_empty = jnp.isneginf(m)
    m_safe = jnp.where(both_empty, 0.0, m)
    w_a = jnp.exp(lse_a - m_safe)
    w_b = jnp.exp(lse_b - m_safe)
    tot = w_a + w_b
    safe_tot = jnp.where(both_empty, 1.0, tot)
    o = w_a[..., None] * o_a.astype(jnp.float32) + w_b[..., None] * o_b.astype(jnp.float32)
    o = jnp.where(both_empty[..., None], 0.0, o / safe_tot[..., None])
    lse = jnp.where(both_empty, _NEG_INF, m_safe + jnp.log(safe_tot))
    return o.astype(o_a.dtype), lse


def round_to_e4m3(y):
    """f32 ``y`` rounded to the nearest float8_e4m3fn value, ties to even, still in f32
    (|y| <= 448 and NaN expected: the caller clamps). Rounded here, the cast that follows
    is exact whatever route the compiler's conversion takes. Normal values keep 3 of the
    23 mantissa bits (round half to even on the bit pattern); below 2^-6 the subnormal
    step 2^-9 is fixed."""
    y = jnp.asarray(y, jnp.float32)
    u = jax.lax.bitcast_convert_type(y, jnp.uint32)
    keep = (u >> 20) & 1  # the last kept mantissa bit: ties go to even
    normal = jax.lax.bitcast_convert_type((u + jnp.uint32(0x7FFFF) + keep) & jnp.uint32(0xFFF00000), jnp.float32)
    sub = jnp.round(y * 512.0) / 512.0  # jnp.round: half to even; exact in f32
    return jnp.where(jnp.abs(y) < 2.0**-6, sub, jnp.where(jnp.isnan(y), y, normal))


def quantize_fp8(x, scale, dtype=jnp.float8_e4m3fn):
    """``clamp(x / scale, -448, 448)`` cast to FP8 e4m3 (casts do not saturate), in f32
    as torch and Triton compute it: the IEEE quotient, rounded once to e4m3 (nearest,
    ties to even). XLA rewrites a division by a broadcast scalar into a product with its
    reciprocal, one ulp off for many quotients, which moves those next to an e4m3 tie to
    the other neighbour (docs/TESTING.md, Findings); the divisor goes through an
    optimisation barrier so that the division stays one."""
    xf = x.astype(jnp.float32)
    den = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(scale, jnp.float32), xf.shape))
    y = jnp.clip(xf / den, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    if jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn):
        y = round_to_e4m3(y)
    return y.astype(dtype)


def _store(cache, loc, x, scale):
    flat = cache.reshape((cache.shape[0] * cache.shape[1],) + cache.shape[2:])
    if jnp.issubdtype(cache.dtype, jnp.floating) and jnp.finfo(cache.dtype).bits == 8:
        x = quantize_fp8(x, 1.0 if scale is None else scale, cache.dtype)
    else:
        x = x.astype(cache.dtype)
    # Out-of-range slots, negative ones included, are dropped (never wrapped into the pool).
    flat = flat.at[jnp.where(loc < 0, flat.shape[0], loc)].set(x, mode="drop")
    return flat.reshape(cache.shape)


@jax.jit
def set_kv_buffer(k_cache, v_cache, out_cache_loc, k, v, k_scale=None, v_scale=None):
    """Write new tokens' K/V at slots ``out_cache_loc`` (i32[T]); returns the caches.

    k: [T, Hkv, D], v: [T, Hkv, Dv] (any float dtype). FP8 caches store
    ``clamp(x / scale, -448, 448)`` (scale None = 1.0); other caches store ``x`` cast to
    their dtype and ignore the scales. Slots outside ``[0, num_pages * page_size)`` are
    dropped (the planners produce none).
    """
    loc = out_cache_loc.astype(jnp.int32)
    return _store(k_cache, loc, k, k_scale), _store(v_cache, loc, v, v_scale)


@jax.jit
def set_mla_kv_buffer(kv_cache, out_cache_loc, c_kv, k_pe, kv_scale=None):
    """Write latent rows ``[c_kv (R), k_pe (r)]`` at ``out_cache_loc``; returns the cache.

    c_kv: [T, R] or [T, 1, R]; k_pe: [T, r] or [T, 1, r] (any float dtype); kv_cache
    [num_pages, page_size, R + r]. FP8 caches store ``clamp(row / kv_scale, -448, 448)``.
    """
    t = out_cache_loc.shape[0]
    row = jnp.concatenate(
        [c_kv.reshape(t, c_kv.shape[-1]).astype(jnp.float32), k_pe.reshape(t, k_pe.shape[-1]).astype(jnp.float32)],
        axis=-1,
    )
    return _store(kv_cache, out_cache_loc.astype(jnp.int32), row, kv_scale)
