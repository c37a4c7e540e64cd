"""How the models reach jattn: metadata for cache-free ragged prefill, and dispatch helpers.

A model's forward gets ``(kv_cache, metadata)``:

* ``kv_cache is None`` and ``metadata`` a :class:`RaggedMetadata`: plain ragged causal
  attention over the given tokens (no cache): full-sequence logits, parity tests.
* ``metadata`` a ``jattn.metadata.ExtendMetadata``: prefill / extend through the paged cache.
* ``metadata`` a ``jattn.metadata.DecodeMetadata``: decode through the paged cache.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jattn.ops import mha_prefill
from jattn.plan_inputs import _as_int_array, _check_nonnegative


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedMetadata:
    """Cache-free ragged batch: request ``b`` owns tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``."""

    cu_seqlens_q: jax.Array  # i32[bs + 1]
    max_seqlen_q: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def from_lengths(cls, lengths) -> "RaggedMetadata":
        """The metadata of requests of ``lengths`` tokens (a 1-D int sequence, each >= 0)."""
        lengths = _as_int_array(lengths, "lengths", 1)
        _check_nonnegative(lengths, "lengths")
        cu = np.concatenate([[0], np.cumsum(lengths)])
        if cu[-1] > np.iinfo(np.int32).max:
            raise ValueError(f"lengths add up to {cu[-1]} tokens, past int32")
        return cls(cu_seqlens_q=cu.astype(np.int32), max_seqlen_q=int(lengths.max(initial=1)))

    @staticmethod
    def positions(lengths) -> np.ndarray:
        """Absolute positions i32[sum(lengths)] of a cache-free ragged batch."""
        return np.concatenate([np.arange(n, dtype=np.int32) for n in lengths] or [np.zeros(0, np.int32)])


def is_decode(metadata) -> bool:
    """A decode-mode plan (``metadata.forward_mode.is_decode()``); cache-free ragged
    metadata is not."""
    mode = getattr(metadata, "forward_mode", None)
    return mode is not None and mode.is_decode()


def ragged_prefill(q, k, v, metadata: RaggedMetadata, *, softmax_scale=None, window_left: int = -1):
    """Causal ragged attention without a cache (``jattn.mha_prefill``, auto backend).

    q [T, Hq, Dqk], k [T, Hkv, Dqk], v [T, Hkv, Dv]; ``softmax_scale`` defaults to
    ``1/sqrt(Dqk)``; ``window_left`` as in ``jattn.mha_prefill`` (-1: no window).
    Returns [T, Hq, Dv] in q's dtype.
    """
    return mha_prefill(
        q,
        k,
        v,
        metadata.cu_seqlens_q,
        max_seqlen_q=metadata.max_seqlen_q,
        softmax_scale=softmax_scale,
        window_left=window_left,
    )
