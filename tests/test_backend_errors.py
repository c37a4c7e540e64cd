"""Bad input to MHABackend / MLABackend and their configs: a layer, plan, config or array
that disagrees with the call gets an error naming the argument and its rule (several of
these ran silently before, under ``jit`` or even eagerly)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import ForwardMode, LayerSpec, MHABackend, MHAConfig, MLABackend, MLAConfig, MLAKVCache, PagedKVCache
from jattn.backends import apply_llama_4_scaling

F32 = jnp.float32
HQ, HKV, D, PS, PAGES = 4, 2, 16, 4, 40


def _mha(rng):
    cfg = MHAConfig(
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=PS,
        context_len=40,
        num_pages=PAGES,
        kv_cache_dtype="float32",
        kernel_backend="xla",
        batch_buckets=(4,),
    )
    be = MHABackend(cfg)
    kv = jnp.asarray(rng.standard_normal((PAGES, PS, HKV, D)), F32)
    cache = PagedKVCache(k=(kv,), v=(kv,))
    r2p = np.zeros((3, cfg.max_num_pages), np.int32)
    r2p[:, :10] = rng.permutation(np.arange(1, PAGES))[:30].reshape(3, 10)
    lens, new = np.array([9, 5, 17]), np.array([3, 2, 4])
    plans = dict(
        decode=be.init_forward_metadata(3, np.arange(3), lens, r2p),
        extend=be.init_forward_metadata(3, np.arange(3), lens, r2p, ForwardMode.EXTEND, extend_seq_lens=new),
        prefill=be.init_forward_metadata(3, np.arange(3), new, r2p, ForwardMode.EXTEND, extend_seq_lens=new),
    )
    return be, LayerSpec(0, HQ, HKV, D), cache, plans


def _x(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), F32)


def test_mha_backend_arrays_must_match_the_layer_and_the_plan():
    rng = np.random.default_rng(0)
    be, layer, cache, plans = _mha(rng)
    ext = plans["prefill"]
    t = ext.num_tokens
    q, kv = _x(rng, t, HQ, D), _x(rng, t, HKV, D)
    out, _ = be.forward_extend(q.reshape(t, -1), kv, kv, layer, cache, ext)  # flat rows are fine
    assert out.shape == (t, HQ * D)
    # A layer with half the query heads reshaped q into twice the rows: under jit the
    # ragged prefill ran on them with no error.
    half = LayerSpec(0, 2, 2, D)
    with pytest.raises(
        ValueError, match=r"q shape \(16, 4, 16\) must be \[T, 2, 16\] or \[T, 32\] \(layer\.num_q_heads"
    ):
        jax.jit(lambda m: be.forward_extend(q, kv, kv, half, cache, m))(ext)
    with pytest.raises(ValueError, match=r"v shape \(16, 2, 16\) must be \[T, 2, 8\] .*head_dim_v"):
        be.forward_extend(q, kv, kv, LayerSpec(0, HQ, HKV, D, v_head_dim=8), cache, ext)
    # Rows that are not the plan's tokens: under jit the offsets are traced and the op
    # cannot tell; the missing rows were read clipped, extra rows came back as output.
    for name, args in (("q", (q[:8], kv, kv)), ("k", (q, kv[:8], kv[:8])), ("q", (jnp.concatenate([q, q]), kv, kv))):
        with pytest.raises(ValueError, match=rf"{name} has \d+ rows; it must have one per token of the plan"):
            jax.jit(lambda m, a=args: be.forward_extend(*a, layer, cache, m, save_kv_cache=False, kv_in_cache=True))(
                ext
            )
    # k / v of None: named where they are needed, allowed where they are not read.
    with pytest.raises(ValueError, match=r"forward_extend needs k and v"):
        be.forward_extend(q, None, None, layer, cache, ext, save_kv_cache=False, kv_in_cache=True)
    pre = plans["extend"]
    qp, kvp = _x(rng, pre.num_tokens, HQ, D), _x(rng, pre.num_tokens, HKV, D)
    _, written = be.forward_extend(qp, kvp, kvp, layer, cache, pre)
    want, _ = be.forward_extend(qp, kvp, kvp, layer, written, pre, save_kv_cache=False, kv_in_cache=True)
    got, _ = be.forward_extend(qp, None, None, layer, written, pre, save_kv_cache=False, kv_in_cache=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    dec = plans["decode"]
    qd, kvd = _x(rng, dec.num_tokens, HQ, D), _x(rng, dec.num_tokens, HKV, D)
    with pytest.raises(ValueError, match=r"k shape \(4, 2, 16\) must be \[T, 1, 16\] or \[T, 16\]"):
        be.forward_decode(qd, kvd, kvd, LayerSpec(0, HQ, 1, D), cache, dec)
    # A layer that disagrees with its cache, the new K/V already in it: the op grouped the
    # query heads by the cache's KV heads and returned a width the layer did not promise.
    msg = r"layer 0's {} cache has 2 KV heads x 16, the layer layer\.num_kv_heads={} x layer\.{}={}"
    with pytest.raises(ValueError, match=msg.format("k", 1, "head_dim", 16)):
        be.forward_decode(qd, None, None, LayerSpec(0, HQ, 1, D), cache, dec)
    with pytest.raises(ValueError, match=msg.format("v", 2, "head_dim_v", 8)):
        be.forward_decode(qd, None, None, LayerSpec(0, HQ, HKV, D, v_head_dim=8), cache, dec)
    with pytest.raises(ValueError, match=msg.format("v", 2, "head_dim_v", 8)):
        kv8 = _x(rng, pre.num_tokens, HKV, 8)
        be.forward_extend(qp, kvp, kv8, LayerSpec(0, HQ, HKV, D, v_head_dim=8), cache, pre, save_kv_cache=False,
                          kv_in_cache=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"k and v must both be given or both be None"):
        be.forward_extend(qp, None, kvp, layer, written, pre, save_kv_cache=False, kv_in_cache=True)


def test_backends_refuse_a_plan_of_the_other_kind():
    rng = np.random.default_rng(1)
    be, layer, cache, plans = _mha(rng)
    dec, ext = plans["decode"], plans["extend"]
    x = _x(rng, ext.num_tokens, HQ, D)
    with pytest.raises(ValueError, match=r"forward_extend needs a plan of type ExtendMetadata \(from plan_extend\), "):
        be.forward_extend(x[:4], x[:4, :2], x[:4, :2], layer, cache, dec)  # was an AttributeError
    with pytest.raises(ValueError, match=r"forward_decode needs a plan of type DecodeMetadata .*forward_mode="):
        be.forward_decode(x, None, None, layer, cache, ext)
    # MLA: a draft-extend plan's ragged rows were read as bs * max_q padded rows, silently.
    cfg, mla, mla_layer, mla_cache = _mla(rng)
    r2p = np.zeros((3, cfg.max_num_pages), np.int32)
    r2p[:, :4] = rng.permutation(np.arange(1, 32))[:12].reshape(3, 4)
    draft = mla.init_forward_metadata(
        3, np.arange(3), [9, 5, 17], r2p, ForwardMode.DRAFT_EXTEND, extend_seq_lens=[3, 2, 4]
    )
    assert draft.num_tokens == draft.batch_size * draft.max_seqlen_q  # the shapes fit: no op error
    q = _x(rng, draft.num_tokens, 4, 80)
    with pytest.raises(ValueError, match=r"forward_decode needs a plan of type DecodeMetadata"):
        mla.forward_decode(q, None, None, mla_layer, mla_cache, draft, save_kv_cache=False)
    mdec = mla.init_forward_metadata(3, np.arange(3), [9, 5, 17], r2p)
    with pytest.raises(ValueError, match=r"forward_draft_extend needs a plan of type ExtendMetadata"):
        mla.forward_draft_extend(q[:4], None, None, mla_layer, mla_cache, mdec, save_kv_cache=False)
    with pytest.raises(ValueError, match=r"forward_extend needs a plan of type ExtendMetadata"):
        mla.forward_extend(_x(rng, 4, 4, 48), _x(rng, 4, 4, 48), _x(rng, 4, 4, 24), mla_layer, mdec)


def _mla(rng, **kw):
    cfg = MLAConfig(
        **{
            **dict(num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24),
            **dict(page_size=16, context_len=256, num_pages=32, kv_cache_dtype="float32", kernel_backend="xla"),
            **dict(batch_buckets=(4, 8)),
            **kw,
        }
    )
    cache = MLAKVCache.create(num_layers=1, num_pages=32, page_size=16, kv_lora_rank=64, rope_dim=16, dtype="float32")
    return cfg, MLABackend(cfg), LayerSpec(0, 4, 1, 80), cache


def test_mla_backend_arrays_must_match_the_config_cache_and_plan():
    rng = np.random.default_rng(2)
    cfg, be, layer, cache = _mla(rng)
    r2p = np.zeros((3, cfg.max_num_pages), np.int32)
    r2p[:, :4] = rng.permutation(np.arange(1, 32))[:12].reshape(3, 4)
    dec = be.init_forward_metadata(3, np.arange(3), [9, 5, 17], r2p)
    q = _x(rng, dec.num_tokens, 4, 80)
    # A config whose latent split differs from the cache's at the same width (48 + 32 vs
    # 64 + 16) read the wrong columns as the value, silently.
    _, other, _, _ = _mla(rng, kv_lora_rank=48, qk_rope_head_dim=32)
    with pytest.raises(
        ValueError, match=r"kv_lora_rank=64 \+ rope 16 wide; config\.kv_lora_rank=48 and config\.qk_rope"
    ):
        other.forward_decode(q, None, None, layer, cache, dec, save_kv_cache=False)
    with pytest.raises(ValueError, match=r"config\.kv_lora_rank=48"):
        other.save_kv(layer, cache, dec.out_cache_loc, q[:, 0, :48], q[:, 0, 48:])
    # The absorbed query's widths and heads come from the config and the layer.
    with pytest.raises(ValueError, match=r"q shape \(4, 4, 32\) must be \[T, 4, 64\] or \[T, 256\]"):
        be.forward_decode(q[..., :32], None, None, layer, cache, dec, save_kv_cache=False, q_rope=q[..., 64:])
    with pytest.raises(ValueError, match=r"q_rope shape \(4, 4, 8\) must be \[T, 4, 16\]"):
        be.forward_decode(q[..., :64], None, None, layer, cache, dec, save_kv_cache=False, q_rope=q[..., 72:])
    with pytest.raises(ValueError, match=r"q shape \(4, 4, 80\) must be \[T, 2, 80\] or \[T, 160\]"):
        be.forward_decode(q, None, None, LayerSpec(0, 2, 1, 80), cache, dec, save_kv_cache=False)
    # Draft extend: fewer query rows than the plan's tokens were padded from clipped rows.
    draft = be.init_forward_metadata(
        3, np.arange(3), [9, 5, 17], r2p, ForwardMode.DRAFT_EXTEND, extend_seq_lens=[3, 2, 4]
    )
    qd = _x(rng, draft.num_tokens, 4, 80)
    with pytest.raises(
        ValueError, match=r"q has 8 rows; it must have one per token of the plan \(metadata\.num_tokens=16"
    ):
        be.forward_draft_extend(qd[:8], None, None, layer, cache, draft, save_kv_cache=False)
    # Ragged prefill: q / k / v checked against the config's widths (the softmax scale and
    # the rotated columns are the config's), the layer's heads and the plan's rows.
    ext = be.init_forward_metadata(3, np.arange(3), [3, 2, 4], r2p, ForwardMode.EXTEND, extend_seq_lens=[3, 2, 4])
    t = ext.num_tokens
    qx, kx, vx = _x(rng, t, 4, 48), _x(rng, t, 4, 48), _x(rng, t, 4, 24)
    assert be.forward_extend(qx, kx, vx, layer, ext).shape == (t, 4, 24)
    with pytest.raises(ValueError, match=r"q shape \(16, 4, 40\) must be \[T, 4, 48\] \(layer\.num_q_heads x config"):
        be.forward_extend(qx[..., :24], kx[..., :32], vx, layer, ext, q_rope=qx[..., 32:], k_rope=kx[:, 0, 32:])
    with pytest.raises(ValueError, match=r"q_rope shape \(16, 4, 8\) must be \[16, 4, 16\]"):
        be.forward_extend(qx[..., :32], kx[..., :32], vx, layer, ext, q_rope=qx[..., 40:], k_rope=kx[:, 0, 40:])
    with pytest.raises(ValueError, match=r"q shape \(16, 4, 48\) must be \[T, 2, 48\]"):
        be.forward_extend(qx, kx, vx, LayerSpec(0, 2, 1, 80), ext)
    with pytest.raises(
        ValueError, match=r"v shape \(16, 4, 16\) must be \[T, 4, 24\] \(layer\.num_q_heads x config\.v_head_dim\)"
    ):
        be.forward_extend(qx, kx, vx[..., :16], layer, ext)
    with pytest.raises(ValueError, match=r"q has 8 rows; it must have one per token of the plan"):
        jax.jit(lambda m: be.forward_extend(qx[:8], kx, vx, layer, m))(ext)
    cu = jnp.array([0, 3, 5, 9, 9], jnp.int32)
    with pytest.raises(ValueError, match=r"v shape \(16, 4, 16\) must be \[T, 4, 24\]"):
        be.forward_prefix_chunk(qx, kx, vx[..., :16], layer, cu, cu, max_seqlen_q=4, max_seqlen_kv=4)


@pytest.mark.parametrize(
    "scale,err,match",
    [
        (-np.ones(4, np.float32), ValueError, r"llama_4_scaling\[0\]=-1\.0 must be finite and > 0"),
        (np.array([1, 1, np.nan, 1], np.float32), ValueError, r"llama_4_scaling\[2\]=nan must be finite and > 0"),
        (np.ones((4, 1, 1, 1), np.float32), ValueError, r"llama_4_scaling shape \(4, 1, 1, 1\) must be \[T\]"),
        (np.ones(4, bool), TypeError, r"llama_4_scaling\.dtype=bool must be a real number type"),
        (np.ones(4, np.complex64), TypeError, r"llama_4_scaling\.dtype=complex64 must be a real number type"),
    ],
)
def test_llama_4_scaling_out_of_range(scale, err, match):
    q = jnp.ones((4, 2, 8), F32)
    with pytest.raises(err, match=match):
        apply_llama_4_scaling(q, scale)
    assert apply_llama_4_scaling(q, np.full((4, 1), 2, np.int32)).sum() == 2 * q.sum()  # ints are scales


_MHA = dict(num_q_heads=4, num_kv_heads=2, head_dim=16)
_MLA = dict(num_heads=4)


@pytest.mark.parametrize(
    "cls,kw,err,match",
    [
        (MHAConfig, dict(_MHA, page_size=0), ValueError, r"page_size=0 must be a positive int"),
        (MHAConfig, dict(_MHA, page_size=4.0), ValueError, r"page_size=4\.0 must be a positive int"),
        (MHAConfig, dict(_MHA, num_q_heads=3), ValueError, r"num_q_heads=3 must be divisible by num_kv_heads=2"),
        (MHAConfig, dict(_MHA, head_dim=0), ValueError, r"head_dim=0 must be a positive int"),
        (MHAConfig, dict(_MHA, num_pages=1), ValueError, r"num_pages=1 must be >= 2"),
        (MHAConfig, dict(_MHA, dtype="int8"), ValueError, r"dtype='int8' must be one of bfloat16"),
        (MHAConfig, dict(_MHA, kv_cache_dtype="fp4"), ValueError, r"kv_cache_dtype='fp4' must be one of"),
        (MHAConfig, dict(_MHA, spec_num_tokens=0), ValueError, r"spec_num_tokens=0 must be a positive int"),
        (MHAConfig, dict(_MHA, kernel_backend="cuda"), ValueError, r"kernel_backend='cuda' must be one of"),
        (MHAConfig, dict(_MHA, batch_buckets=(4, 0)), ValueError, r"batch_buckets=\(4, 0\) must be a non-empty"),
        (MHAConfig, dict(_MHA, batch_invariant="no"), TypeError, r"batch_invariant='no' must be a bool"),
        (MLAConfig, dict(_MLA, kv_lora_rank=0), ValueError, r"kv_lora_rank=0 must be a positive int"),
        (MLAConfig, dict(_MLA, context_len=0), ValueError, r"context_len=0 must be a positive int"),
        (MLAConfig, dict(_MLA, scaling=-1.0), ValueError, r"scaling=-1\.0 must be finite and > 0"),
        (LayerSpec, dict(layer_id=-1, **_MHA), ValueError, r"layer_id=-1 must be an int >= 0"),
        (LayerSpec, dict(layer_id=0, **{**_MHA, "num_kv_heads": 3}), ValueError, r"num_q_heads=4 must be divisible"),
        (LayerSpec, dict(layer_id=0, **_MHA, v_head_dim=0), ValueError, r"v_head_dim=0 must be a positive int"),
        (LayerSpec, dict(layer_id=0, **_MHA, sliding_window_size=-2), ValueError, r"sliding_window_size=-2 must be"),
        (LayerSpec, dict(layer_id=0, **_MHA, logit_cap=-1.0), ValueError, r"logit_cap=-1\.0 must be a finite"),
        (LayerSpec, dict(layer_id=0, **_MHA, k_scale=0.0), ValueError, r"k_scale=0\.0 must be finite and > 0"),
        (LayerSpec, dict(layer_id=0, **_MHA, non_causal="yes"), TypeError, r"non_causal='yes' must be a bool"),
    ],
)
def test_configs_and_layer_specs_refuse_bad_fields(cls, kw, err, match):
    with pytest.raises(err, match=match):
        cls(**kw)


def test_configs_stay_hashable_and_caches_check_stacked():
    """A config is a static ``jit`` argument: buckets given as a list and scales given as
    scalar arrays made it unhashable (and unequal to the same config with a tuple); they
    are stored as a tuple and Python floats. ``create(stacked=...)`` took any truthy value."""
    cfg = MHAConfig(**_MHA, batch_buckets=[1, 2, 4])
    assert cfg == MHAConfig(**_MHA, batch_buckets=(1, 2, 4)) and hash(cfg) == hash(
        MHAConfig(**_MHA, batch_buckets=(1, 2, 4))
    )
    layer = LayerSpec(0, **_MHA, k_scale=jnp.float32(0.5), v_scale=np.float32(2.0))
    assert (layer.k_scale, layer.v_scale) == (0.5, 2.0) and hash(layer) == hash(
        LayerSpec(0, **_MHA, k_scale=0.5, v_scale=2.0)
    )
    assert hash(MLAConfig(**dict(_MLA, scaling=jnp.float32(0.25)))) == hash(MLAConfig(**dict(_MLA, scaling=0.25)))
    with pytest.raises(TypeError, match="stacked='no' must be a bool"):
        PagedKVCache.create(num_layers=1, num_pages=2, page_size=4, num_kv_heads=1, head_dim=4, stacked="no")
    with pytest.raises(TypeError, match="stacked=0.0 must be a bool"):
        MLAKVCache.create(num_layers=1, num_pages=2, page_size=4, kv_lora_rank=8, rope_dim=2, stacked=0.0)


def test_configs_normalise_dtype_aliases_and_bucket_order():
    """``dtype="bf16"`` and ``dtype="bfloat16"`` (or ``jnp.bfloat16``) are one config, and so
    are buckets in any order or repeated: they were unequal configs (two jit keys, two
    compiles), and ``init_cuda_graph_state`` kept unsorted buckets as given."""
    for alias in ("bf16", jnp.bfloat16, jnp.dtype("bfloat16")):
        cfg = MHAConfig(**_MHA, dtype=alias, kv_cache_dtype=alias)
        assert cfg == MHAConfig(**_MHA) and hash(cfg) == hash(MHAConfig(**_MHA)) and cfg.dtype == "bfloat16"
    assert MLAConfig(**dict(_MLA, kv_cache_dtype="fp8")).kv_cache_dtype == "float8_e4m3fn"
    cfg = MHAConfig(**_MHA, batch_buckets=(8, 2, 4, 2))
    assert cfg.batch_buckets == (2, 4, 8) and cfg == MHAConfig(**_MHA, batch_buckets=(2, 4, 8))
    be = MHABackend(cfg)
    assert be.init_cuda_graph_state(4) == (2, 4) and be.batch_buckets == (2, 4, 8)


def test_mla_backend_refuses_layer_options_it_does_not_take():
    """A layer's logit cap, sliding window or ``non_causal`` was ignored by the MLA backend
    (its outputs bit-equal to a plain layer's): refused by name on every attention path."""
    rng = np.random.default_rng(4)
    cfg, be, layer, cache = _mla(rng)
    r2p = np.zeros((1, cfg.max_num_pages), np.int32)
    r2p[0, :2] = [3, 5]
    dec = be.init_forward_metadata(1, np.arange(1), [6], r2p)
    q = _x(rng, dec.num_tokens, 4, 80)
    for kw in (dict(logit_cap=1.0), dict(sliding_window_size=0), dict(non_causal=True)):
        bad = dataclasses.replace(layer, **kw)
        with pytest.raises(ValueError, match=f"layer.{next(iter(kw))}=.*the MLA backend takes no"):
            be.forward_decode(q, None, None, bad, cache, dec, save_kv_cache=False)
    be.forward_decode(q, None, None, layer, cache, dec, save_kv_cache=False)


def test_llama_4_scaling_refuses_inf_and_multiplies_in_f32():
    """``apply_llama_4_scaling``: an infinite per-token scale is refused by name like NaN
    and non-positive ones (it would turn the query into inf / NaN), and the product is
    taken in f32 and rounded once to the query's dtype: a bf16 query times 1.003 (which
    bf16 itself rounds to 1.0) changes, exactly as ``(q.astype(f32) * s).astype(bf16)``."""
    q = jnp.asarray(np.random.default_rng(3).standard_normal((4, 2, 8)) * 30, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"llama_4_scaling\[1\]=inf must be finite and > 0"):
        apply_llama_4_scaling(q, np.array([1, np.inf, 1, 1], np.float32))
    s = np.array([1.003, 0.997, 1.003, 1.0], np.float32)
    want = (q.astype(jnp.float32) * s.reshape(-1, 1, 1)).astype(jnp.bfloat16)
    got = apply_llama_4_scaling(q, s)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(got, np.float32), np.asarray(q, np.float32))
