"""``batch_invariant=True`` decode: a request's output bits do not depend on its batch.

Five requests (lengths 0, 1, 97, 200, 41; permuted pages, NaN in every unused slot and
page) are decoded together, padded to a bucket of 8, and each alone and in a batch of three,
all with one page-table width: the rows must be equal bit for bit. XLA's decode and the
Mosaic GPU kernel (interpreted on the CPU) run through ``jattn.mha_decode_with_kvcache``
with a small ``pallas_kernels.combine.INVARIANT_SPLIT_TOKENS`` so that every call splits the keys several ways; the
Triton kernel runs interpreted (a ``TRITON_INTERPRET=1`` subprocess, fp16) through
``jattn.bridge.triton_native`` with the split count the op would pass. Without the flag the
Mosaic split count follows the batch, which is what the mode removes.
"""

from __future__ import annotations

import numpy as np
import pytest
from interpreted import run_in_interpreter

import jattn
from jattn.pallas_kernels import combine

LENS = (0, 1, 97, 200, 41)
PS, HQ, HKV, D, WIDTH = 64, 4, 2, 64, 4  # pages of 64: fewer page copies for the interpreted Mosaic calls
SPLIT_TOKENS = 64  # -> 4 splits over the 256-token width


def _inputs(dtype):
    rng = np.random.default_rng(5)
    num_pages = len(LENS) * WIDTH + 3
    k = np.full((num_pages, PS, HKV, D), np.nan, np.float32)
    v = np.full((num_pages, PS, HKV, D), np.nan, np.float32)
    table = rng.permutation(num_pages)[: len(LENS) * WIDTH].reshape(len(LENS), WIDTH).astype(np.int32)
    for b, n in enumerate(LENS):
        t = np.arange(n)
        k[table[b, t // PS], t % PS] = rng.standard_normal((n, HKV, D))
        v[table[b, t // PS], t % PS] = rng.standard_normal((n, HKV, D))
    q = rng.standard_normal((8, HQ, D)).astype(np.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), table, np.asarray(LENS, np.int32)


def _batches(small: bool = False):
    """(rows of the request set, padded to) for: all five in a bucket of 8, three of them
    alone (lengths 97, 41 and 0), and three together in a bucket of 4 (``small``: the
    first two alone only; the Mosaic interpreter is slow)."""
    yield list(range(5)), 8
    for b in (2, 4) if small else (2, 4, 0):
        yield [b], 1
    if not small:
        yield [3, 1, 4], 4


def _padded(rows, pad, q, table, lens):
    pt = np.zeros((pad, WIDTH), np.int32)
    pt[: len(rows)] = table[rows]
    sl = np.zeros(pad, np.int32)
    sl[: len(rows)] = lens[rows]
    qq = np.zeros((pad, HQ, D), q.dtype)
    qq[: len(rows)] = q[rows]
    return qq, pt, sl


def _batch_dependent_defaults(monkeypatch):
    """Default split counts (Mosaic) and key chunks (XLA) that change with the batch at these
    small widths, as they do at serving widths: 2 splits / 128-key chunks alone, 1 split /
    32-key chunks in a batch, the Mosaic splits even (a default batch of several requests
    would take balanced splits, whose shared size may land on the same bits at these
    widths). The batch-invariant mode must override all of it."""
    from jattn import reference
    from jattn.pallas_kernels import decode_tuning

    monkeypatch.setattr(decode_tuning, "choose_num_splits", lambda batch, m, blocks, *a: 1 if batch > 1 else 2)
    monkeypatch.setattr(
        decode_tuning, "balanced_for", lambda options, batch, m_rows, kv_itemsize: bool(options.balanced_splits)
    )
    real = reference._key_chunk
    monkeypatch.setattr(
        reference, "_key_chunk", lambda bs, nq, hq, n, fixed=None: real(bs, nq, hq, n, fixed or (32 if bs > 1 else 128))
    )


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_request_bits_do_not_depend_on_the_batch(backend, monkeypatch):
    import contextlib

    import jax.numpy as jnp

    from jattn.pallas_kernels.interpret import gpu_interpret, interpreter_available, on_gpu

    if backend == "mosaic" and not on_gpu() and not interpreter_available():
        pytest.skip("no Mosaic GPU interpreter in this JAX")
    ctx = gpu_interpret if backend == "mosaic" and not on_gpu() else contextlib.nullcontext

    monkeypatch.setattr(combine, "INVARIANT_SPLIT_TOKENS", SPLIT_TOKENS)
    _batch_dependent_defaults(monkeypatch)
    q, k, v, table, lens = _inputs(np.float32)
    kj, vj = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    got = {}
    lse_off = {}  # request 2's LSE bits without the mode, by batch
    for rows, pad in _batches(small=backend == "mosaic" and not on_gpu()):
        qq, pt, sl = _padded(rows, pad, q, table, lens)
        qb, ptj, slj = jnp.asarray(qq, jnp.bfloat16), jnp.asarray(pt), jnp.asarray(sl)
        with ctx():
            out, lse = jattn.mha_decode_with_kvcache(
                qb, kj, vj, ptj, slj, backend=backend, batch_invariant=True, return_lse=True
            )
            if 2 in rows and len(lse_off) < 2:
                lse_off[len(rows)] = np.asarray(
                    jattn.mha_decode_with_kvcache(qb, kj, vj, ptj, slj, backend=backend, return_lse=True)[1]
                )[rows.index(2)]
        out, lse = np.asarray(out, np.float32), np.asarray(lse)
        for i, b in enumerate(rows):
            if b in got:
                np.testing.assert_array_equal(out[i], got[b][0], err_msg=f"request {b} in batch {rows}")
                np.testing.assert_array_equal(lse[i], got[b][1], err_msg=f"request {b}'s LSE in batch {rows}")
            got[b] = out[i], lse[i]
    assert len(got) == 5 and all(np.isfinite(x).all() for x, _ in got.values()) and not got[0][0].any()  # len 0: 0
    a, b = lse_off.values()
    assert not np.array_equal(a, b), "without the mode the defaults gave the same bits: the test could not fail"


def test_mosaic_split_count_follows_the_batch_unless_invariant(monkeypatch):
    from jattn.pallas_kernels import mosaic_decode as md

    monkeypatch.setattr(combine, "INVARIANT_SPLIT_TOKENS", SPLIT_TOKENS)
    kw = dict(num_kv_heads=HKV, head_dim=D, page_size=PS, max_pages=1024, m_rows=HQ, kv_itemsize=2)
    assert md.choose_block_sizes(batch=1, **kw).num_splits != md.choose_block_sizes(batch=8, **kw).num_splits
    q, k, v, table, lens = _inputs(np.float32)
    pick = jattn.ops._invariant_splits(md.mha_decode, q[:1], k, table[:1], 1)
    assert pick["block_sizes"].num_splits == 4
    assert not pick["options"].balanced_splits  # a split size from the other requests' lengths
    assert jattn.ops._invariant_splits(md.mha_decode, q, k, table, 1) == pick


def run_interpreted(name: str, path: str) -> None:
    import torch

    from jattn.bridge import triton_native
    from jattn.pallas_kernels import triton_decode

    combine.INVARIANT_SPLIT_TOKENS = SPLIT_TOKENS
    q, k, v, table, lens = _inputs(np.float16)
    splits = jattn.ops._invariant_splits(triton_decode.mha_decode, q, k, table, 1)["num_splits"]  # the op's
    assert splits == -(-WIDTH * PS // SPLIT_TOKENS)
    res = {}
    for j, (rows, pad) in enumerate(_batches()):
        qq, pt, sl = _padded(rows, pad, q, table, lens)
        t = torch.from_numpy
        out = triton_native.mha_decode(t(qq), t(k), t(v), t(pt), t(sl), num_splits=splits)
        res[f"batch{j}"] = out.float().numpy()
        res[f"rows{j}"] = np.asarray(rows)
    np.savez(path, **res)


def test_interpreted_triton_request_bits_do_not_depend_on_the_batch(tmp_path_factory):
    res = run_in_interpreter(tmp_path_factory, "test_batch_invariant", {"run_interpreted": ["triton"]})["triton"]
    got = {}
    for j in range(len(list(_batches()))):
        out, rows = res[f"batch{j}"], res[f"rows{j}"]
        for i, b in enumerate(rows.tolist()):
            if b in got:
                np.testing.assert_array_equal(out[i], got[b], err_msg=f"request {b} in batch {rows.tolist()}")
            got[b] = out[i]
    assert all(np.isfinite(x).all() for x in got.values())


def test_triton_split_count_follows_the_batch_unless_invariant():
    """At a serving width the Triton decode's default split count changes with the batch;
    the batch-invariant one (what the interpreted test launches) does not."""
    import jax.numpy as jnp

    from jattn.pallas_kernels import triton_decode

    width = 4096
    default = {bs: triton_decode.launch_params(bs, 32, 8, 128, 1, width)[1]["SPLITS"] for bs in (1, 8, 64)}
    assert len(set(default.values())) > 1, default
    k = jnp.zeros((4, 16, 8, 128), jnp.bfloat16)
    pick = {
        bs: jattn.ops._invariant_splits(
            triton_decode.mha_decode, jnp.zeros((bs, 32, 128)), k, jnp.zeros((bs, width // 16), jnp.int32), 1
        )
        for bs in (1, 8, 64)
    }
    assert len({p["num_splits"] for p in pick.values()}) == 1


def test_backend_config_turns_the_mode_on(monkeypatch):
    """``MHAConfig(batch_invariant=True)``: the backend's decode calls carry the flag."""
    import jax.numpy as jnp

    from jattn import LayerSpec, MHABackend, MHAConfig, PagedKVCache
    from jattn.metadata import plan_decode

    seen = []
    real = jattn.ops.mha_decode_with_kvcache
    monkeypatch.setattr(
        jattn.ops, "mha_decode_with_kvcache", lambda *a, **k: seen.append(k["batch_invariant"]) or real(*a, **k)
    )
    q, k, v, table, lens = _inputs(np.float32)
    table = table + 1  # the planner keeps page 0 for padding rows
    k, v = np.concatenate([k[:1], k]), np.concatenate([v[:1], v])
    cache = PagedKVCache(k=(jnp.asarray(np.nan_to_num(k)),), v=(jnp.asarray(np.nan_to_num(v)),))
    md = plan_decode(lens, page_size=PS, page_table=table, batch_buckets=(8,), num_pages=k.shape[0])
    for flag in (True, False):
        cfg = MHAConfig(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS, batch_invariant=flag)
        MHABackend(cfg).forward_decode(jnp.asarray(q), None, None, LayerSpec(0, HQ, HKV, D), cache, md, False)
    assert seen == [True, False]


def test_backend_config_takes_the_plain_decode_on_a_cascade_plan(monkeypatch):
    """A cascade plan on a batch-invariant backend: its decode runs the plain, invariant
    op (the cascade's prefix pass would tie a request's bits to its group), and a
    request's bits are those of it planned alone."""
    import jax.numpy as jnp

    from jattn import LayerSpec, MHABackend, MHAConfig, PagedKVCache, cascade
    from jattn.metadata import plan_decode

    monkeypatch.setattr(combine, "INVARIANT_SPLIT_TOKENS", SPLIT_TOKENS)
    cascades = []
    real = cascade.cascade_decode
    monkeypatch.setattr(cascade, "cascade_decode", lambda *a, **k: cascades.append(1) or real(*a, **k))
    q, k, v, table, lens = _inputs(np.float32)
    table = table + 1  # the planner keeps page 0 for padding rows
    k, v = np.concatenate([k[:1], k]), np.concatenate([v[:1], v])
    cache = PagedKVCache(k=(jnp.asarray(np.nan_to_num(k)),), v=(jnp.asarray(np.nan_to_num(v)),))
    rows = [3, 1]  # requests 3 and 1 share their first page: one group of 2
    pt = table[rows].copy()
    pt[1, 0] = pt[0, 0]
    sl = lens[rows] + np.array([0, PS])  # request 1 reads past the shared page
    layer = LayerSpec(0, HQ, HKV, D)
    kw = dict(page_size=PS, batch_buckets=(2,), num_pages=k.shape[0])
    grouped = plan_decode(sl, page_table=pt, group_size=2, prefix_pages=np.array([1]), **kw)
    got = {}
    for flag in (True, False):
        cfg = MHAConfig(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS, batch_invariant=flag)
        out, _ = MHABackend(cfg).forward_decode(jnp.asarray(q[:2]), None, None, layer, cache, grouped, False)
        got[flag] = np.asarray(out)
    assert len(cascades) == 1  # the batch-invariant backend took none
    cfg = MHAConfig(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS, batch_invariant=True)
    for i in range(2):
        alone = plan_decode(sl[i : i + 1], page_table=pt[i : i + 1], **dict(kw, batch_buckets=(1,)))
        want, _ = MHABackend(cfg).forward_decode(jnp.asarray(q[i : i + 1]), None, None, layer, cache, alone, False)
        np.testing.assert_array_equal(got[True][i], np.asarray(want)[0])
    np.testing.assert_allclose(got[False], got[True], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_gpu_request_bits_do_not_depend_on_the_batch(backend):
    """At serving shapes (GQA 32/8, d128, page 64, a 4096-token width): request 0 decoded
    alone and inside batches of 7, 31 and 127 others gives the same bits."""
    import jax
    import jax.numpy as jnp

    from jattn.pallas_kernels import triton_glue
    from jattn.pallas_kernels.interpret import on_gpu

    if not on_gpu() or (backend == "triton" and not triton_glue.available()):
        pytest.skip("needs a GPU (and jax-triton for the triton backend)")
    rng = np.random.default_rng(1)
    ps, hq, hkv, d, width, bs = 64, 32, 8, 128, 64, 128
    kc = jax.random.normal(jax.random.key(0), (bs * width + 1, ps, hkv, d), jnp.bfloat16)
    vc = jax.random.normal(jax.random.key(1), (bs * width + 1, ps, hkv, d), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(bs * width).reshape(bs, width) + 1, jnp.int32)
    lens = jnp.asarray(rng.integers(1, width * ps, bs), jnp.int32)
    q = jax.random.normal(jax.random.key(2), (bs, hq, d), jnp.bfloat16)
    outs = [
        np.asarray(
            jattn.mha_decode_with_kvcache(q[:n], kc, vc, table[:n], lens[:n], backend=backend, batch_invariant=True)[0],
            np.float32,
        )
        for n in (1, 8, 32, 128)
    ]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_xla_request_bits_at_batches_past_the_default_chunk():
    """XLA's decode: its default key chunk shrinks as the batch grows, and its code for a
    batch differs from its code for one request; in this mode a request's bits are the same
    alone and in batches of 3 and 300."""
    rng = np.random.default_rng(7)
    bs, hq, d, ps, width = 300, 64, 16, 16, 64  # 300 * 64 query rows: a 512-key chunk by default
    k = rng.standard_normal((width, ps, 1, d)).astype(np.float32)
    v = rng.standard_normal((width, ps, 1, d)).astype(np.float32)
    pt = np.tile(np.arange(width, dtype=np.int32)[None], (bs, 1))
    lens = rng.integers(1, width * ps + 1, bs).astype(np.int32)
    q = (rng.standard_normal((bs, hq, d)) * 3).astype(np.float32)
    rows = {
        n: np.asarray(jattn.mha_decode_with_kvcache(q[:n], k, v, pt[:n], lens[:n], backend="xla", batch_invariant=True))
        for n in (1, 3, bs)
    }
    np.testing.assert_array_equal(rows[1][0], rows[bs][0])
    np.testing.assert_array_equal(rows[3], rows[bs][:3])
