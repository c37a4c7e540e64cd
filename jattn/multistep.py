"""The multi-step draft backend of EAGLE speculative decoding for DeepSeek MLA (SGLang's
``TRTLLMMLAMultiStepDraftBackend``), made functional.

An EAGLE drafter runs ``speculative_num_steps - 1`` decode forwards of its draft model
back to back, one new draft token per request each: step ``i`` decodes the token at
position ``seq_lens[b] - 1 + i``, so it sees ``seq_lens[b] + i`` keys. Upstream keeps
one backend (and one set of metadata buffers) per step and refills each before the
draft loop. Here the host plans **once** per draft loop: a
:class:`MultiStepMetadata` holds the plan of the last step (its page table has the
pages of every step) and the first step's lengths; :meth:`MultiStepMetadata.step`
derives step ``i``'s :class:`~jattn.metadata.DecodeMetadata` on the device (no host
work, jittable), so the whole draft loop (every step's plan and attention) is one
``jax.jit`` and new lengths in the same batch bucket never retrace.

Only chain drafts (``topk=1``) are built: a tree draft (``topk > 1``) gives each branch
its own draft tokens, which needs per-branch page-table rows that a request's
``req_to_page`` row does not have.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jattn.backends import MLABackend, MLAConfig
from jattn.checks import _concrete, _is_int
from jattn.metadata import DecodeMetadata, ForwardMode, _slots
from jattn.plan_inputs import _as_int_array, _check_nonnegative, _check_unique_slots, _check_writes
from jattn.planning import check_capture_bucket

__all__ = ["MLAMultiStepDraftBackend", "MultiStepMetadata"]


@dataclasses.dataclass(frozen=True)
class MultiStepMetadata:
    """The plan of a whole draft loop: ``num_steps`` decode steps of one token per request.

    ``base`` is the plan of the last step (lengths ``seq_lens + num_steps - 1``; its page
    table holds every step's pages); ``seq_lens`` i32[bs] are the first step's lengths
    (the new token included; 0 for a padding row). ``num_steps`` is static.
    """

    base: DecodeMetadata
    seq_lens: jax.Array  # i32[bs], step 0's lengths
    num_steps: int = 1

    @property
    def batch_size(self) -> int:
        return self.base.batch_size

    def step(self, i) -> DecodeMetadata:
        """The plan of step ``i`` (a Python int in ``[0, num_steps)``, or traced): lengths
        ``seq_lens + i`` (padding rows stay 0), positions and write slots re-derived from
        the page table. Jittable; its lengths, positions and write slots equal those of
        planning step ``i``'s lengths on the host, and its page table keeps the pages of the
        later steps past each row's length (columns no kernel reads)."""
        v = _concrete(i)  # a concrete jax scalar too: a step past the plan reads pages it never planned
        if v is not None and not (v.shape == () and np.issubdtype(v.dtype, np.integer) and 0 <= v < self.num_steps):
            raise ValueError(f"step {v.item() if v.size == 1 else i!r} is not in [0, num_steps={self.num_steps})")
        lens = jnp.asarray(self.seq_lens, jnp.int32)
        return self.base.with_seq_lens(jnp.where(lens > 0, lens + jnp.asarray(i, jnp.int32), 0))

    def steps(self) -> tuple:
        """Every step's plan (jittable)."""
        return tuple(self.step(i) for i in range(self.num_steps))


jax.tree_util.register_dataclass(MultiStepMetadata, data_fields=["base", "seq_lens"], meta_fields=["num_steps"])


class MLAMultiStepDraftBackend:
    """EAGLE multi-step draft decoding over the MLA latent cache.

    ``attn_backends[i]`` serves step ``i`` (``speculative_num_steps - 1`` of them, as
    upstream; they are :class:`~jattn.backends.MLABackend` instances of one config, so
    they differ only in the plan they are given). ``forward_decode(i, ...)`` runs step
    ``i`` with ``metadata.step(i)``.
    """

    def __init__(self, config: MLAConfig, topk: int = 1, speculative_num_steps: int = 2):
        if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk < 1:
            raise ValueError(f"topk={topk!r} must be a positive int")
        if topk != 1:
            raise NotImplementedError(
                f"topk={topk}: tree drafts (topk > 1) are not supported, only chain drafts (topk=1): each "
                "branch's draft tokens would need page-table rows of their own"
            )
        if isinstance(speculative_num_steps, bool) or not isinstance(speculative_num_steps, (int, np.integer)):
            raise ValueError(f"speculative_num_steps={speculative_num_steps!r} must be an int >= 1")
        if speculative_num_steps < 1:
            raise ValueError(f"speculative_num_steps={speculative_num_steps} must be >= 1")
        self.config = config
        self.topk = int(topk)
        self.speculative_num_steps = int(speculative_num_steps)
        self.num_steps = self.speculative_num_steps - 1  # draft-model forwards per loop
        self.attn_backends = tuple(MLABackend(config) for _ in range(self.num_steps))
        self._planner = MLABackend(config)

    @property
    def batch_buckets(self) -> tuple:
        return self._planner.batch_buckets

    def init_forward_metadata(
        self, bs: int, req_pool_indices, seq_lens, req_to_page, num_pages: int | None = None
    ) -> MultiStepMetadata:
        """Plans a draft loop on the host (numpy in).

        Args:
          bs: requests; the first ``bs`` entries of the per-request inputs count.
          req_pool_indices: int[>= bs] rows of ``req_to_page``.
          seq_lens: int[>= bs], each request's length at step 0, its first draft token
            included (0: a padding row). Step ``i`` has ``seq_lens + i``.
          req_to_page: int[pool, max_pages]: a request's row must hold the pages of its
            last step's length ``seq_lens + num_steps - 1``.
          num_pages: as in :meth:`jattn.MLABackend.init_forward_metadata`.
        """
        if not _is_int(bs) or bs < 0:  # int() would truncate 2.7
            raise ValueError(f"bs={bs!r} must be an int >= 0")
        bs = int(bs)
        sl = _as_int_array(seq_lens, "seq_lens", 1)  # refuses fractional lengths, which astype truncated
        if sl.shape[0] < bs:
            raise ValueError(f"seq_lens must have at least bs={bs} entries, got shape {sl.shape}")
        sl = sl[:bs]
        _check_nonnegative(sl, "seq_lens")
        extra = max(self.num_steps - 1, 0)
        last = np.where(sl > 0, sl + extra, 0)
        try:
            base = self._planner.init_forward_metadata(
                bs, req_pool_indices, last, req_to_page, ForwardMode.DECODE, num_pages=num_pages
            )
        except ValueError as e:  # its lengths are the last step's, not the caller's seq_lens
            if not any(w in str(e) for w in ("seq_lens", "page_table", "out_cache_loc", "slot", "position")):
                raise  # not about the lengths (the batch, its bucket, req_pool_indices): as it is
            raise ValueError(
                f"the draft loop's last step (seq_lens + {extra}; page_table: req_to_page's rows): {e}"
            ) from None
        lens = np.zeros(base.batch_size, np.int32)
        lens[:bs] = sl
        self._check_slots(base, lens)
        return MultiStepMetadata(base=base, seq_lens=lens, num_steps=self.num_steps)

    def _check_slots(self, base: DecodeMetadata, lens: np.ndarray) -> None:
        """No two draft tokens of the loop (any request, any step) write one slot, and none
        writes a slot that another request holds at that step (its prefix, read-only); the
        messages name the requests (and the steps)."""
        rows = np.flatnonzero(lens > 0)
        if not rows.size or not self.num_steps:
            return
        r = np.repeat(rows, self.num_steps)
        step = np.tile(np.arange(self.num_steps), rows.size)
        loc = _slots(np.asarray(base.page_table), r, lens[r] - 1 + step, base.page_size)

        def tokens(i, j):
            return f"the draft tokens of request {r[i]} at step {step[i]} and of request {r[j]} at step {step[j]}"

        _check_unique_slots(loc, base.page_size, tokens)
        # The base plan checked the last step's writes only. All of them at once: request b
        # writes positions [lens - 1, lens - 1 + num_steps), the last num_steps of its last
        # step's length; what another request holds at any step is within its last length,
        # and its own draft slots there are the clashes checked above.
        last = np.where(lens > 0, lens + self.num_steps - 1, 0)
        table = np.asarray(base.page_table)
        _check_writes(table, last, np.full_like(last, self.num_steps), base.page_size, lens > 0)

    def step_metadata(self, metadata: MultiStepMetadata, i) -> DecodeMetadata:
        """Step ``i``'s plan (jittable): ``metadata.step(i)``."""
        return metadata.step(i)

    def plan_steps(self, metadata: MultiStepMetadata) -> tuple:
        """Every step's plan (jittable): ``metadata.steps()``."""
        return metadata.steps()

    def forward_decode(self, step: int, q, k, v, layer, kv_cache, metadata: MultiStepMetadata, **kwargs):
        """Step ``step`` of the draft loop: :meth:`jattn.MLABackend.forward_decode` of
        ``attn_backends[step]`` with ``metadata.step(step)`` (the keywords pass through:
        ``save_kv_cache``, ``q_rope``, ``k_rope``, ``cos_sin_cache``, ...). Returns
        ``(latent out [bs, H * R], kv_cache)``."""
        if not _is_int(step) or not 0 <= step < self.num_steps:
            raise ValueError(f"step={step!r} is not in [0, num_steps={self.num_steps})")
        return self.attn_backends[step].forward_decode(q, k, v, layer, kv_cache, metadata.step(step), **kwargs)

    def init_forward_metadata_out_graph(
        self, bs: int, req_pool_indices, seq_lens, req_to_page, in_capture: bool = False, num_pages: int | None = None
    ) -> MultiStepMetadata:
        """SGLang's planning outside the captured graph: the loop's plan, as
        :meth:`init_forward_metadata`; ``in_capture`` checks that ``bs`` is a bucket."""
        if in_capture:
            check_capture_bucket(bs, self._planner.graph_buckets)
        return self.init_forward_metadata(bs, req_pool_indices, seq_lens, req_to_page, num_pages=num_pages)

    # ---- CUDA-graph analogue: one placeholder per bucket, refilled per loop.

    def init_cuda_graph_state(self, max_bs: int, *args, **kwargs) -> tuple:
        """Chooses the batch buckets up to ``max_bs`` for every step."""
        for be in (self._planner, *self.attn_backends):
            buckets = be.init_cuda_graph_state(max_bs)
        return buckets

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_pages: int | None = None, **kwargs):
        """An all-padding draft-loop plan of bucket ``bs`` (every step's plan of it is a
        placeholder to compile with: lengths 0, writes to the dummy page)."""
        base = self._planner.init_forward_metadata_capture_cuda_graph(bs, ForwardMode.DECODE, num_pages=num_pages)
        return MultiStepMetadata(base=base, seq_lens=np.zeros(bs, np.int32), num_steps=self.num_steps)

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices, seq_lens, req_to_page, num_pages: int | None = None, **kwargs
    ) -> MultiStepMetadata:
        """New values into the smallest bucket holding ``bs``: a jitted loop compiled on
        the captured plan of that bucket runs again without retracing."""
        return self.init_forward_metadata(bs, req_pool_indices, seq_lens, req_to_page, num_pages=num_pages)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """As :meth:`jattn.MLABackend.get_cuda_graph_seq_len_fill_value`: 0."""
        return self._planner.get_cuda_graph_seq_len_fill_value()
