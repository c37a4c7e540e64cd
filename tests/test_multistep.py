"""The EAGLE multi-step draft backend (jattn.MLAMultiStepDraftBackend): each step's
plan and output equal the single-step MLABackend's, the whole loop is one jit that does
not retrace for new lengths of a bucket, and the CUDA-graph capture / replay flow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import DUMMY_PAGE, ForwardMode, LayerSpec, MLABackend, MLAConfig, MLAKVCache, MLAMultiStepDraftBackend

BIG_R, R, H, PS, PAGES = 24, 6, 3, 4, 40


def _cfg():
    return MLAConfig(
        num_heads=H,
        kv_lora_rank=BIG_R,
        qk_nope_head_dim=10,
        qk_rope_head_dim=R,
        v_head_dim=8,
        page_size=PS,
        context_len=48,
        num_pages=PAGES,
        kv_cache_dtype="float32",
        kernel_backend="xla",
        batch_buckets=(2, 4),
    )


def _table(rng, n_req, width, total=12):
    """A request-to-page table of ``total`` columns, the first ``width`` of each row
    distinct permuted pages."""
    r2p = np.zeros((n_req, total), np.int32)
    r2p[:, :width] = rng.permutation(np.arange(1, PAGES))[: n_req * width].reshape(n_req, width)
    return r2p


def _loop(ms, layer, num_steps):
    """The draft loop: every step planned from the loop's plan and run, inside one jit."""

    def run(cache, md, q, c_kv, k_pe):
        outs = []
        for i, step_md in enumerate(ms.plan_steps(md)):
            o, cache = ms.attn_backends[i].forward_decode(q[i], c_kv[i], None, layer, cache, step_md, k_rope=k_pe[i])
            outs.append(o)
        return jnp.stack(outs), cache

    return run


def test_each_step_equals_the_single_step_backend():
    rng = np.random.default_rng(0)
    cfg, layer = _cfg(), LayerSpec(0, H, 1, BIG_R + R)
    ms = MLAMultiStepDraftBackend(cfg, topk=1, speculative_num_steps=4)
    assert ms.num_steps == 3 and len(ms.attn_backends) == 3
    single = MLABackend(cfg)
    r2p = _table(rng, 3, 7)
    lens = np.array([9, 0, 14])  # row 1 is padding (the fill value)
    md = ms.init_forward_metadata(3, np.arange(3), lens, r2p)
    cache = MLAKVCache(kv=(jnp.asarray(rng.standard_normal((PAGES, PS, BIG_R + R)), jnp.float32),), kv_lora_rank=BIG_R)
    t = md.batch_size
    q = jnp.asarray(rng.standard_normal((3, t, H, BIG_R + R)), jnp.float32)
    c_kv = jnp.asarray(rng.standard_normal((3, t, BIG_R)), jnp.float32)
    k_pe = jnp.asarray(rng.standard_normal((3, t, R)), jnp.float32)
    outs, final = jax.jit(_loop(ms, layer, 3))(cache, md, q, c_kv, k_pe)
    ref_cache = cache
    for i in range(3):
        host = single.init_forward_metadata(3, np.arange(3), np.where(lens > 0, lens + i, 0), r2p)
        dev = md.step(i)
        for f in ("cache_seqlens", "positions", "out_cache_loc", "num_reqs"):
            np.testing.assert_array_equal(np.asarray(getattr(dev, f)), np.asarray(getattr(host, f)), err_msg=f)
        assert (dev.max_seqlen_q, dev.forward_mode, dev.num_pages) == (1, ForwardMode.DECODE, host.num_pages)
        want, ref_cache = single.forward_decode(q[i], c_kv[i], None, layer, ref_cache, host, k_rope=k_pe[i])
        np.testing.assert_array_equal(np.asarray(outs[i]), np.asarray(want))
        assert (np.asarray(outs[i]).reshape(t, -1)[1] == 0).all()  # the padding row
    np.testing.assert_array_equal(np.asarray(final.kv[0]), np.asarray(ref_cache.kv[0]))


def test_loop_in_one_jit_does_not_retrace_and_cuda_graph_flow():
    rng = np.random.default_rng(1)
    cfg, layer = _cfg(), LayerSpec(0, H, 1, BIG_R + R)
    ms = MLAMultiStepDraftBackend(cfg, speculative_num_steps=3)
    assert ms.init_cuda_graph_state(4) == (2, 4)
    assert ms.get_cuda_graph_seq_len_fill_value() == 0
    traces = []
    body = _loop(ms, layer, 2)

    @jax.jit
    def run(cache, md, q, c_kv, k_pe):
        traces.append(1)
        return body(cache, md, q, c_kv, k_pe)

    cache = MLAKVCache.create(num_layers=1, num_pages=PAGES, page_size=PS, kv_lora_rank=BIG_R, rope_dim=R)
    args = lambda: (  # noqa: E731
        jnp.asarray(rng.standard_normal((2, 4, H, BIG_R + R)), jnp.float32),
        jnp.asarray(rng.standard_normal((2, 4, BIG_R)), jnp.float32),
        jnp.asarray(rng.standard_normal((2, 4, R)), jnp.float32),
    )
    cap = ms.init_forward_metadata_capture_cuda_graph(4)
    out, after = run(cache, cap, *args())
    assert (np.asarray(out) == 0).all()
    changed = np.flatnonzero(np.asarray(after.kv[0] != cache.kv[0]).any(axis=(1, 2)))
    assert set(changed.tolist()) <= {DUMMY_PAGE}
    for bs, lens in ((3, [5, 30, 1]), (4, [2, 0, 11, 33]), (3, [8, 8, 8])):
        r2p = _table(rng, bs, 9)
        md = ms.init_forward_metadata_replay_cuda_graph(bs, np.arange(bs), np.array(lens), r2p)
        out, _ = run(cache, md, *args())
        assert np.isfinite(np.asarray(out)).all()
        # SGLang's out-of-graph planning gives the same plan
        og = ms.init_forward_metadata_out_graph(bs, np.arange(bs), np.array(lens), r2p)
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), og, md))
        run(cache, og, *args())
    assert len(traces) == 1
    with pytest.raises(ValueError, match=r"in_capture: bs=3 is not one of the buckets"):
        ms.init_forward_metadata_out_graph(3, np.arange(3), np.array([5, 30, 1]), r2p, in_capture=True)


def test_multistep_errors_name_the_argument():
    cfg = _cfg()
    with pytest.raises(NotImplementedError, match="topk=2"):
        MLAMultiStepDraftBackend(cfg, topk=2)
    with pytest.raises(ValueError, match="speculative_num_steps=0"):
        MLAMultiStepDraftBackend(cfg, speculative_num_steps=0)
    ms = MLAMultiStepDraftBackend(cfg, speculative_num_steps=3)
    r2p = np.zeros((2, cfg.max_num_pages), np.int32)
    r2p[0, :2], r2p[1, :2] = [5, 6], [5, 7]  # request 1's draft tokens would write request 0's page
    with pytest.raises(ValueError, match="out_cache_loc: new tokens"):
        ms.init_forward_metadata(2, np.arange(2), np.array([2, 2]), r2p)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=-1"):
        ms.init_forward_metadata(2, np.arange(2), np.array([2, -1]), r2p)
    r2p[1, :2] = [8, 9]
    md = ms.init_forward_metadata(2, np.arange(2), np.array([4, 4]), r2p)
    with pytest.raises(ValueError, match=r"step 2 is not in \[0, num_steps=2\)"):
        md.step(2)
    # the last step's length needs its page: 4 + 1 = 5 tokens of page 4 need 2 pages
    r2p[0, 1] = 0
    with pytest.raises(ValueError, match="dummy page"):
        ms.init_forward_metadata(2, np.arange(2), np.array([4, 4]), r2p)
    assert jattn.MultiStepMetadata is type(md)


def test_multistep_refuses_truncated_inputs_steps_past_the_plan_and_names_slot_clashes():
    """Fractional lengths and batch sizes were truncated, a concrete jax step past the
    plan gave lengths whose pages were never planned, and a slot written by two draft
    tokens was named by their index in a flattened (request, step) list."""
    ms = MLAMultiStepDraftBackend(_cfg(), speculative_num_steps=3)
    r2p = _table(np.random.default_rng(3), 2, 4)
    with pytest.raises(TypeError, match="seq_lens must hold integers, got dtype float64"):
        ms.init_forward_metadata(2, np.arange(2), np.array([5.7, 3.2]), r2p)
    with pytest.raises(ValueError, match=r"bs=2.7 must be an int >= 0"):
        ms.init_forward_metadata(2.7, np.arange(3), np.array([5, 3, 4]), r2p)
    with pytest.raises(ValueError, match=r"seq_lens must have at least bs=3 entries"):
        ms.init_forward_metadata(3, np.arange(3), np.array([5, 3]), r2p)
    md = ms.init_forward_metadata(np.int64(2), np.arange(2), np.array([5, 3]), r2p)
    for bad in (jnp.int32(2), jnp.int32(-1), 1.0, True, np.array([0, 1])):
        with pytest.raises(ValueError, match=r"step .* is not in \[0, num_steps=2\)"):
            md.step(bad)
    np.testing.assert_array_equal(md.step(jnp.int32(1)).cache_seqlens[:2], [6, 4])
    traced = jax.jit(lambda m, i: m.step(i).cache_seqlens)(md, 1)
    np.testing.assert_array_equal(traced[:2], [6, 4])
    with pytest.raises(ValueError, match=r"step=1.0 is not in \[0, num_steps=2\)"):
        ms.forward_decode(1.0, None, None, None, None, None, md)
    # request 0 (length 2) writes positions 1, 2 and request 1 (length 3) positions 2, 3 of
    # page 5: request 0's step-1 token and request 1's step-0 token clash. The last step's
    # plan already refuses it: request 0's last token lands on a slot request 1 holds (a
    # clash of two steps' tokens always leaves one request's last write in the other's
    # tokens, so the per-step check below it is a second line)
    r2p[0, :2], r2p[1, :2] = [5, 6], [5, 7]
    with pytest.raises(
        ValueError,
        match=r"out_cache_loc: request 0's new token at position 2 writes page 5, offset 2, which request 1 holds",
    ):
        ms.init_forward_metadata(2, np.arange(2), np.array([2, 3]), r2p)


def test_an_earlier_draft_step_writing_into_another_requests_prefix_is_refused():
    """Only the last step's writes were checked against the other requests' pages: request
    0 (length 4, pages 5 and 6) writes position 3 (page 5, offset 3) at step 0 and position
    4 (page 6) at step 1, and request 1 (length 5) holds all of page 5 as its prefix, so
    step 0 overwrote request 1's token 3 while the last step's plan was clean. Errors
    from planning the last step name that step's lengths as such."""
    ms = MLAMultiStepDraftBackend(_cfg(), speculative_num_steps=3)
    r2p = np.zeros((2, 12), np.int32)
    r2p[0, :2], r2p[1, :2] = [5, 6], [5, 7]
    MLABackend(_cfg()).init_forward_metadata(2, np.arange(2), np.array([5, 6]), r2p)  # the last step alone: clean
    with pytest.raises(
        ValueError, match=r"request 0's new token at position 3 writes page 5, offset 3, which request 1"
    ):
        ms.init_forward_metadata(2, np.arange(2), np.array([4, 5]), r2p)
    r2p[0, :2] = [8, 6]  # request 0 on its own pages: accepted, both steps' slots as planned
    md = ms.init_forward_metadata(2, np.arange(2), np.array([4, 5]), r2p)
    assert [int(md.step(i).out_cache_loc[0]) for i in range(2)] == [8 * PS + 3, 6 * PS + 0]
    with pytest.raises(ValueError, match=r"the draft loop's last step \(seq_lens \+ 1; .*seq_lens\[0\]=49"):
        ms.init_forward_metadata(2, np.arange(2), np.array([48, 5]), r2p)
    # only the last step's length reaches the dummy page left in request 0's row
    r2p[0, 1] = 0
    with pytest.raises(
        ValueError,
        match=r"the draft loop's last step \(seq_lens \+ 1; .*req_to_page\[0, 1\] is the reserved dummy page 0 "
        r"\(padded rows write there\), but seq_lens\[0\]=5 uses 2 pages",
    ):
        ms.init_forward_metadata(2, np.arange(2), np.array([4, 5]), r2p)
    r2p[0, 1] = 6
    # an error that is not about the lengths reads as the single-step planner gives it
    with pytest.raises(ValueError, match=r"^req_pool_indices\[1\]=7 out of range"):
        ms.init_forward_metadata(2, np.array([0, 7]), np.array([4, 5]), r2p)
