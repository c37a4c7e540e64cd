"""The torch MLA bridge's per-call state and the SGLang fields it reads (CPU, the pool's
own writer): a layer's FP8 scale set after a first call reaches the attention as it
reaches the writer; ``forward_batch.out_cache_loc`` is where the latent is written; the
chunked prefix cache refuses a chunk plan that does not cover the batch."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jattn import ForwardMode, MLABackend, MLAConfig, MLAKVCache  # noqa: E402
from jattn.bridge import AttentionLayer, BridgeError, TorchMLABackend, TorchMLAKVPool  # noqa: E402
from jattn.bridge.pool import layer_spec  # noqa: E402

H, R, RP, PS, PAGES = 2, 16, 8, 4, 12
R2P = torch.tensor([[1, 2, 3, 0, 0, 0], [4, 5, 0, 0, 0, 0], [6, 7, 0, 0, 0, 0]], dtype=torch.int32)


def _config(kv="float32", **kw):
    d = dict(
        num_heads=H, kv_lora_rank=R, qk_nope_head_dim=8, qk_rope_head_dim=RP, v_head_dim=8, page_size=PS,
        context_len=24, num_pages=PAGES, dtype="float32", kv_cache_dtype=kv, spec_num_tokens=2, kernel_backend="xla",
    )  # fmt: skip
    d.update(kw)
    return MLAConfig(**d)


def _pool(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    p = TorchMLAKVPool(num_layers=1, num_pages=PAGES, page_size=PS, kv_lora_rank=R, qk_rope_head_dim=RP, dtype=dtype)
    p.kv_buffer[0].copy_(torch.randn(p.kv_buffer[0].shape, generator=g).to(dtype))
    return p


def _decode_inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, w, generator=g) for w in (H * R, H * RP, R, RP)]


def test_fp8_scale_set_after_the_first_call_reaches_the_attention():
    """An FP8 layer's ``k_scale`` set after a warm-up call (checkpoint scales loaded late):
    the attention reads with the new scale, as the pool's writer writes with it. Before, the
    spec cached at the first call kept the old scale: outputs off by 7 against the core."""
    c, p = _config(kv="float8_e4m3fn"), _pool(torch.float8_e4m3fn)
    layer = AttentionLayer(0, H, 1, R + RP, v_head_dim=R, k_scale=1.0)
    be = TorchMLABackend(c, p)
    lens = torch.tensor([11, 6])
    be.init_forward_metadata(2, 0, torch.tensor([0, 1]), lens, R2P, ForwardMode.DECODE)
    q, qr, ck, kp = _decode_inputs()
    be.forward_decode(q, ck, None, layer, None, save_kv_cache=False, q_rope=qr)  # warm-up at scale 1
    layer.k_scale = 0.25
    out = be.forward_decode(q, ck, None, layer, None, save_kv_cache=False, q_rope=qr).clone()
    fresh = TorchMLABackend(c, p)
    fresh.init_forward_metadata(2, 0, torch.tensor([0, 1]), lens, R2P, ForwardMode.DECODE)
    want = fresh.forward_decode(q, ck, None, layer, None, save_kv_cache=False, q_rope=qr)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # and against the core backend on the same pool
    core = MLABackend(c)
    md = core.init_forward_metadata(2, np.arange(2), lens.numpy(), R2P.numpy(), ForwardMode.DECODE)
    buf = p.kv_buffer[0].view(torch.uint8).numpy().view(jnp.float8_e4m3fn).reshape(-1, PS, R + RP)
    pad = lambda x, *s: jnp.pad(jnp.asarray(x.numpy()), ((0, md.num_tokens - 2), (0, 0))).reshape(md.num_tokens, *s)  # noqa: E731
    o, _ = core.forward_absorbed(
        pad(q, H, R), None, None, layer_spec(layer), MLAKVCache(kv=(jnp.asarray(buf),), kv_lora_rank=R), md,
        save_kv_cache=False, q_rope=pad(qr, H, RP),
    )  # fmt: skip
    np.testing.assert_allclose(out.numpy(), np.asarray(o)[:2].reshape(2, -1), rtol=1e-5, atol=1e-5)


def test_torch_writer_writes_at_forward_batch_out_cache_loc():
    """SGLang's MLA backend writes the latent at ``forward_batch.out_cache_loc``; so does
    the bridge's torch writer when no ``out_cache_loc`` keyword is given (it wrote the
    plan's slots before, silently). Slots other than the plan's are refused by name
    (the attention reads the plan's slots: it would read a stale one), before any write;
    the ``out_cache_loc`` keyword is checked the same way and wins over the batch's."""
    c, p = _config(), _pool()
    layer = AttentionLayer(0, H, 1, R + RP, v_head_dim=R)
    be = TorchMLABackend(c, p)
    lens = torch.tensor([11, 6])
    be.init_forward_metadata(2, 0, torch.tensor([0, 1]), lens, R2P, ForwardMode.DECODE)
    q, qr, ck, kp = _decode_inputs()
    buf = p.kv_buffer[0].view(-1, R + RP)
    plan = [3 * PS + 2, 5 * PS + 1]  # the plan's slots: token 11 of pages [1, 2, 3], token 6 of [4, 5]
    before = buf.clone()
    fb = types.SimpleNamespace(out_cache_loc=torch.tensor([40, 41]))
    with pytest.raises(
        BridgeError, match=rf"out_cache_loc\[0\]=40, but the installed plan puts new token 0 at slot {plan[0]}"
    ):
        be.forward_decode(q, ck, None, layer, fb, save_kv_cache=True, q_rope=qr, k_rope=kp)
    assert torch.equal(buf, before)  # nothing written
    fb = types.SimpleNamespace(out_cache_loc=torch.tensor(plan))
    be.forward_decode(q, ck, None, layer, fb, save_kv_cache=True, q_rope=qr, k_rope=kp)
    assert torch.equal(buf[plan, :R], ck) and torch.equal(buf[plan, R:], kp)
    bad = types.SimpleNamespace(out_cache_loc=torch.tensor([40, 41]))
    be.forward_decode(
        q, 2 * ck, None, layer, bad, save_kv_cache=True, q_rope=qr, k_rope=kp, out_cache_loc=torch.tensor(plan)
    )
    assert torch.equal(buf[plan, :R], 2 * ck)  # the keyword wins
    with pytest.raises(BridgeError, match=r"out_cache_loc\[1\]=41, .* \(1 of 2 differ\)"):
        be.forward_decode(
            q, ck, None, layer, fb, save_kv_cache=True, q_rope=qr, k_rope=kp, out_cache_loc=torch.tensor([plan[0], 41])
        )


def test_prefix_chunk_must_cover_the_batch():
    """A chunk plan (``prefix_chunk_cu_seq_lens``) of fewer requests than the batch left the
    last requests without their prefix chunk (o = 0, lse = -inf, merged away); it is refused
    by name, as are offsets past the chunk's K/V rows and a request longer than the chunk's
    ``prefix_chunk_max_seq_lens``."""
    c, p = _config(batch_buckets=(4,)), _pool()
    layer = AttentionLayer(0, H, H, 8 + RP, v_head_dim=8)
    be = TorchMLABackend(c, p)
    ext, pre = [3, 2, 2], [5, 1, 3]
    seq = torch.tensor([a + b for a, b in zip(ext, pre)])
    be.init_forward_metadata(
        3, 3, torch.arange(3), seq, R2P, ForwardMode.EXTEND,
        extend_seq_lens=torch.tensor(ext), extend_prefix_lens=torch.tensor(pre),
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(ext), H * (8 + RP), generator=g)
    kc, vc = torch.randn(9, H * (8 + RP), generator=g), torch.randn(9, H * 8, generator=g)

    def chunk(cu, mx):
        fb = types.SimpleNamespace(attn_attend_prefix_cache=True, prefix_chunk_idx=0)
        fb.prefix_chunk_cu_seq_lens, fb.prefix_chunk_max_seq_lens = [torch.tensor(cu, dtype=torch.int32)], [mx]
        return be.forward_extend(q, kc, vc, layer, fb, save_kv_cache=False)

    o, lse = chunk([0, 5, 6, 9], 5)  # every request: accepted
    assert torch.isfinite(lse).all()
    name = r"forward_batch\.prefix_chunk_cu_seq_lens\[0\]"
    with pytest.raises(BridgeError, match=name + r" has 2 requests: the plan has 3 \(4 with"):
        chunk([0, 5, 6], 5)
    with pytest.raises(BridgeError, match=name + r"=\[0, 5, 6, 12\] must rise from 0 to at most the chunk's 9"):
        chunk([0, 5, 6, 12], 6)
    # one key past the maximum: the chunk's keys are read up to it (rounded to a power of
    # two), so at 4 a 5-key request would silently lose its last key
    with pytest.raises(
        BridgeError, match=r"holds a request of 5 keys > forward_batch\.prefix_chunk_max_seq_lens\[0\]=4"
    ):
        chunk([0, 5, 6, 9], 4)


def test_calls_with_no_new_tokens_give_no_rows():
    """Every MLA call of a step with no new tokens (a batch of 0 requests, or requests with 0
    new tokens each) returns 0 rows, as the MHA calls do: the adapters' ``reshape(n, -1)``
    raised torch's "cannot reshape tensor of 0 elements ... ambiguous" instead (absorbed
    decode / verify / draft extend, with ``llama_4_scaling`` and the fused rope, the ragged
    prefill, the prefix chunk, ``merge_state``)."""
    c, p = _config(batch_buckets=(1, 2, 4)), _pool()
    absorbed = AttentionLayer(0, H, 1, R + RP, v_head_dim=R)
    be = TorchMLABackend(c, p)
    z = lambda *s: torch.zeros(*s)  # noqa: E731
    cs = torch.randn(32, RP)
    for mode, lens, ext in (
        (ForwardMode.DECODE, [], None),
        (ForwardMode.TARGET_VERIFY, [], None),
        (ForwardMode.DRAFT_EXTEND, [3, 5], [0, 0]),
        (ForwardMode.EXTEND, [3, 5], [0, 0]),  # absorbed inputs: the absorbed extend
    ):
        bs = len(lens)
        be.init_forward_metadata(
            bs, 0, torch.arange(bs), torch.tensor(lens, dtype=torch.int32), R2P, mode,
            extend_seq_lens=None if ext is None else torch.tensor(ext),
        )  # fmt: skip
        fwd = be.forward_decode if mode is ForwardMode.DECODE else be.forward_extend
        inputs = dict(q_rope=z(0, H * RP), k_rope=z(0, RP))
        for kw in (
            {},
            {"llama_4_scaling": z(0)},
            {"cos_sin_cache": cs},
            {"cos_sin_cache": cs, "llama_4_scaling": z(0)},
        ):
            out = fwd(z(0, H * R), z(0, R), None, absorbed, None, save_kv_cache=True, **inputs, **kw)
            assert out.shape == (0, H * R), (mode, kw)
    # the ragged prefill, with and without the LSE, and with split ropes
    prefill = AttentionLayer(0, H, H, 8 + RP, v_head_dim=8)
    be.init_forward_metadata(
        2, 2, torch.arange(2), torch.tensor([3, 5]), R2P, ForwardMode.EXTEND,
        extend_seq_lens=torch.tensor([0, 0]), extend_prefix_lens=torch.tensor([3, 5]),
    )  # fmt: skip
    qk, v0 = z(0, H * (8 + RP)), z(0, H * 8)
    o, lse = be.forward_extend(qk, qk, v0, prefill, None, False, return_lse=True)
    assert o.shape == (0, H * 8) and lse.shape == (0, H)
    o = be.forward_extend(v0, v0, v0, prefill, None, False, q_rope=z(0, H * RP), k_rope=z(0, RP))
    assert o.shape == (0, H * 8)
    # a prefix chunk of 4 + 2 keys attended by no new token
    fb = types.SimpleNamespace(attn_attend_prefix_cache=True, prefix_chunk_idx=0)
    fb.prefix_chunk_cu_seq_lens, fb.prefix_chunk_max_seq_lens = [torch.tensor([0, 4, 6], dtype=torch.int32)], [4]
    o, lse = be.forward_extend(qk, torch.randn(6, H * (8 + RP)), torch.randn(6, H * 8), prefill, fb, False)
    assert o.shape == (0, H * 8) and lse.shape == (0, H)
    o, lse = be.merge_state(o, lse, o, lse)
    assert o.shape == (0, H * 8) and lse.shape == (0, H)
