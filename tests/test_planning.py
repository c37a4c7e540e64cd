"""``jattn.planning`` (the backends' ``init_forward_metadata`` and CUDA-graph trio): bad
arguments get an error naming the argument and the rule it broke; nothing is truncated."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jattn import ForwardMode, MHABackend, MHAConfig
from jattn.planning import check_capture_bucket


def _backend():
    return MHABackend(MHAConfig(num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, context_len=32, num_pages=20))


R2P = np.arange(1, 17).reshape(2, 8)


@pytest.mark.parametrize("bs", [1.7, 2.0, True, "2"])
def test_bs_must_be_an_int(bs):
    """A fractional bs was truncated (1.7 planned one request), True planned one, '2' two."""
    be = _backend()
    with pytest.raises(ValueError, match=re.escape(f"bs={bs!r} must be an int >= 0")):
        be.init_forward_metadata(bs, [0, 1], [5, 6], R2P)
    with pytest.raises(ValueError, match=re.escape(f"bs={bs!r} must be an int >= 0")):
        be.init_forward_metadata_out_graph(bs, [0, 1], [5, 6], R2P, in_capture=True)
    with pytest.raises(ValueError, match=re.escape(f"bs={bs!r} must be an int >= 0")):
        check_capture_bucket(bs, (1, 2, 4))
    with pytest.raises(ValueError, match=re.escape(f"bs={bs!r} must be an int >= 0")):
        be.init_forward_metadata_capture_cuda_graph(bs)
    md = be.init_forward_metadata(np.int64(1), [0, 1], [5, 6], R2P)  # numpy integers are fine
    assert int(md.num_reqs) == 1


def test_per_request_inputs_are_named():
    be = _backend()
    with pytest.raises(ValueError, match=re.escape("req_pool_indices is required (None given)")):
        be.init_forward_metadata(1, None, [5], R2P)  # was an IndexError on a 0-d array
    with pytest.raises(ValueError, match=re.escape("req_to_page is required (None given)")):
        be.init_forward_metadata(1, [0], [5], None)
    with pytest.raises(ValueError, match=re.escape("seq_lens must be 1-D, got shape ()")):
        be.init_forward_metadata(1, [0], np.int32(5), R2P)  # was "len() of unsized object"
    with pytest.raises(ValueError, match=re.escape("bs=2 must be in [0, 1] (the entries of extend_prefix_lens)")):
        be.init_forward_metadata(  # was "lengths inconsistent", which named no length
            2, [0, 1], [5, 6], R2P, ForwardMode.EXTEND, extend_seq_lens=[2, 2], extend_prefix_lens=[3]
        )
    with pytest.raises(ValueError, match=re.escape("extend_seq_lens is required for ForwardMode.EXTEND")):
        be.init_forward_metadata(1, [0], [5], R2P, ForwardMode.EXTEND)
    md = be.init_forward_metadata(  # entries past bs are not read
        1, [0, 1], [5, 6], R2P, ForwardMode.EXTEND, extend_seq_lens=[2, 9], extend_prefix_lens=[3, 99]
    )
    assert md.cache_seqlens[0] == 5 and int(md.num_reqs) == 1


@pytest.mark.parametrize("max_bs", [0, -1, 2.5, True])
def test_cuda_graph_max_bs_must_be_a_positive_int(max_bs):
    """A non-positive or fractional max_bs made buckets such as (0,), (-1,) or (1, 2, 2.5)."""
    be = _backend()
    with pytest.raises(ValueError, match=re.escape(f"max_bs={max_bs!r} must be a positive int")):
        be.init_cuda_graph_state(max_bs)
    assert be.init_cuda_graph_state(np.int32(3)) == (1, 2, 3)


@pytest.mark.parametrize("config_buckets", ["default", None])
def test_batches_above_the_captured_max_bs_still_plan(config_buckets):
    """After ``init_cuda_graph_state(max_bs)`` a batch larger than ``max_bs`` (a prefill, or a
    decode batch upstream runs outside its graphs) plans to the config's next bucket (powers
    of two without one); it was refused as past the largest bucket. Captures stay within
    the chosen buckets."""
    kw = {} if config_buckets == "default" else dict(batch_buckets=None)
    be = MHABackend(
        MHAConfig(num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, context_len=32, num_pages=40, **kw)
    )
    assert be.init_cuda_graph_state(4) == (1, 2, 4)
    r2p = np.arange(1, 37).reshape(6, 6)
    lens = np.array([5, 6, 7, 3, 9, 2])
    md = be.init_forward_metadata(6, np.arange(6), lens, r2p, ForwardMode.DECODE)
    assert md.batch_size == 8 and int(md.num_reqs) == 6
    md = be.init_forward_metadata(6, np.arange(6), lens, r2p, ForwardMode.EXTEND, extend_seq_lens=np.ones(6, int))
    assert int(md.num_reqs) == 6
    assert be.init_forward_metadata(3, np.arange(3), lens[:3], r2p, ForwardMode.DECODE).batch_size == 4
    assert be.graph_buckets == (1, 2, 4)
    with pytest.raises(ValueError, match=re.escape("bs=8 is not one of the buckets (1, 2, 4)")):
        be.init_forward_metadata_capture_cuda_graph(8)
    with pytest.raises(ValueError, match=re.escape("in_capture: bs=8 is not one of the buckets (1, 2, 4)")):
        be.init_forward_metadata_out_graph(8, np.arange(6), lens, r2p, in_capture=True)


def test_plans_refuse_writes_into_pages_another_request_holds():
    """A new token whose slot another request holds (a shared page written into) would
    change that request's K/V silently: every planner refuses it, ``with_seq_lens`` on
    host lengths too, while pages shared read-only stay fine."""
    import jattn

    pt = np.array([[3, 4], [3, 0]])  # request 1's page 3 is request 0's first page
    msg = r"request 1's new token at position 2 writes page 3, offset 2, which request 0 holds as its token 2"
    with pytest.raises(ValueError, match=msg):
        jattn.plan_decode([6, 3], page_size=4, page_table=pt, num_pages=8)
    with pytest.raises(ValueError, match=msg):
        jattn.plan_extend([6, 3], [1, 1], page_size=4, page_table=pt, num_pages=8)
    shared = np.array([[3, 4], [3, 5]])  # page 3 read by both, each writing its own page
    md = jattn.plan_decode([6, 7], page_size=4, page_table=shared, num_pages=8)
    jattn.plan_extend([6, 7], [2, 3], page_size=4, page_table=shared, num_pages=8)
    with pytest.raises(ValueError, match=r"new tokens of requests 0 and 1 would both write slot 15"):
        md.with_seq_lens(np.array([4, 4]))
    with pytest.raises(ValueError, match=r"request 1's new token at position 2 writes page 3, offset 2"):
        md.with_seq_lens(np.array([6, 3]))
    np.testing.assert_array_equal(md.with_seq_lens(np.array([5, 6])).cache_seqlens[:2], [5, 6])
    # host lengths fewer than the plan's requests would empty the rest silently
    with pytest.raises(ValueError, match=r"seq_lens has 1 lengths for the plan's num_reqs=2 requests"):
        md.with_seq_lens(np.array([6]))
    with pytest.raises(ValueError, match="page_table must be a rectangular 2-D int array"):
        jattn.plan_decode([6, 3], page_size=4, page_table=[[3, 4], [5]], num_pages=8)
    # the rule is per slot: writing past the tokens another request holds in a page is fine
    jattn.plan_extend([2, 4], [0, 2], page_size=4, page_table=np.array([[3], [3]]), num_pages=8)
    with pytest.raises(ValueError, match="which request 0 holds as its token 2"):
        jattn.plan_extend([3, 4], [0, 2], page_size=4, page_table=np.array([[3], [3]]), num_pages=8)


def test_plans_refuse_a_row_that_repeats_a_page_it_writes():
    """A request whose row holds one page twice would write its new token over its own
    earlier token; a repeated page past the row's used columns is never read."""
    import jattn

    msg = (
        r"page_table: request 0's row holds page 5 at columns 0 and 1; its new token at position 4 would "
        r"overwrite its own token 0"
    )
    with pytest.raises(ValueError, match=msg):
        jattn.plan_decode([5], page_size=4, page_table=np.array([[5, 5]]), num_pages=8)
    with pytest.raises(ValueError, match=r"request 0's row holds page 5 at columns 0 and 1"):
        jattn.plan_extend([6], [3], page_size=4, page_table=np.array([[5, 5]]), num_pages=8)
    jattn.plan_decode([4], page_size=4, page_table=np.array([[5, 5]]), num_pages=8)  # column 1 unused


def test_draft_block_padding_row_holds_no_pages():
    """A DRAFT_BLOCK plan keeps each request's whole row of pages (its block may grow on
    the device), but a row given with length 0 is padding: it keeps none, so the block
    fill cannot make it write into the pages of the request its stale pool index names."""
    cfg = MHAConfig(
        num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, context_len=16, num_pages=32,
        kv_cache_dtype="float32", kernel_backend="xla", spec_num_tokens=3, batch_buckets=(4,),
    )  # fmt: skip
    be = MHABackend(cfg)
    r2p = np.array([[1, 2, 3, 0], [5, 6, 0, 0], [9, 10, 0, 0]])
    md = be.init_forward_metadata(4, [0, 1, 2, 0], [11, 5, 6, 0], r2p, ForwardMode.DRAFT_BLOCK)
    np.testing.assert_array_equal(md.page_table[0], [1, 2, 3, 0])
    np.testing.assert_array_equal(md.page_table[3], [0, 0, 0, 0])
    import jax.numpy as jnp

    filled = be.fill_block_decode_seq_lens(md, 4, jnp.array([12, 8, 9, 0]))
    slots = np.asarray(filled.out_cache_loc).reshape(4, 3)
    assert (slots[3] // 4 == 0).all() and (slots[0] // 4 == 3).all()  # padding: the dummy page only
    # a page id past the pool in a DRAFT_BLOCK row is dropped, not kept for the block to grow into
    md2 = be.init_forward_metadata(1, [0], [5], np.array([[5, 6, 40, 0]]), ForwardMode.DRAFT_BLOCK)
    np.testing.assert_array_equal(md2.page_table[0], [5, 6, 0, 0])  # 40 >= num_pages=32


def test_ragged_metadata_refuses_bad_lengths():
    """A negative length made cu_seqlens_q go back (under jit the rows after it came out
    wrong, eagerly the error named cu_seqlens_q); fractional and 2-D lengths were cast."""
    from jattn.models.attention import RaggedMetadata

    md = RaggedMetadata.from_lengths([3, 0, 4])
    assert md.cu_seqlens_q.tolist() == [0, 3, 3, 7] and md.max_seqlen_q == 4
    assert RaggedMetadata.from_lengths([]).cu_seqlens_q.tolist() == [0]
    with pytest.raises(ValueError, match=re.escape("lengths[1]=-1 is negative")):
        RaggedMetadata.from_lengths([3, -1, 4])
    with pytest.raises(TypeError, match="lengths must hold integers"):
        RaggedMetadata.from_lengths([3, 1.5])
    with pytest.raises(ValueError, match=re.escape("lengths must be 1-D")):
        RaggedMetadata.from_lengths([[3, 1]])
    with pytest.raises(ValueError, match="past int32"):
        RaggedMetadata.from_lengths([2**31 - 1, 1])
