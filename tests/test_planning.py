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
