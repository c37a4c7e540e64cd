"""The planning half of the attention backends, shared by :class:`jattn.MHABackend`
and :class:`jattn.MLABackend`: ``init_forward_metadata`` and the CUDA-graph trio
(metadata pytrees for a step, bucket placeholders, in-bucket replays), and the check
that a plan fits the cache it is run on."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jattn.checks import _is_int
from jattn.config import MHAConfig, MLAConfig
from jattn.metadata import (
    DecodeMetadata,
    ExtendMetadata,
    ForwardMode,
    plan_decode,
    plan_extend,
)
from jattn.plan_inputs import _as_int_array, _positive_int


def _check_plan(metadata, kv_cache) -> None:
    """The plan fits the cache (checked at trace time, on static fields only): the same
    page size, and page ids range-checked against at most the cache's page count."""
    if metadata.page_size != kv_cache.page_size:
        raise ValueError(
            f"metadata.page_size={metadata.page_size} differs from the KV cache's page_size="
            f"{kv_cache.page_size}: the plan's slots would address the wrong tokens"
        )
    bound, have = metadata.num_pages, kv_cache.num_pages
    if bound is None:
        raise ValueError(
            f"metadata.num_pages is None: the plan's page_table ids were never range-checked, and the "
            f"KV cache has {have} pages; plan with num_pages={have} (config.num_pages, the num_pages "
            "argument of init_forward_metadata, or plan_decode / plan_extend(num_pages=...))"
        )
    if bound > have:
        raise ValueError(
            f"metadata.num_pages={bound} exceeds the KV cache's {have} pages: the plan's page_table "
            f"ids were checked against {bound} and may read or write past the pool (data-parallel: "
            "plan each device against its own pool's pages)"
        )


def _is_bucket(bs: int, buckets) -> bool:
    """``bs`` is one of ``buckets`` (None: the powers of two)."""
    return bs in buckets if buckets is not None else bs > 0 and bs & (bs - 1) == 0


def _buckets_text(buckets) -> str:
    return "the powers of two" if buckets is None else f"the buckets {tuple(buckets)}"


def check_capture_bucket(bs, buckets) -> None:
    """SGLang's ``in_capture`` rule: a plan made while a bucket compiles must be of that
    bucket, so ``bs`` must be one of ``buckets`` (None: a power of two)."""
    _check_bs(bs)
    if not _is_bucket(bs, buckets):
        raise ValueError(f"in_capture: bs={bs} is not one of {_buckets_text(buckets)}")


def _check_bs(bs) -> int:
    """``bs`` as an int: a Python or numpy integer, not a bool (``int()`` would truncate 2.7);
    its range is checked where it is used."""
    if not _is_int(bs):
        raise ValueError(f"bs={bs!r} must be an int >= 0")
    return int(bs)


class _PlanningMixin:
    """Planning shared by the MHA and MLA backends (host side, numpy in)."""

    config: MHAConfig | MLAConfig

    def q_len(self, mode: ForwardMode) -> int:
        """New tokens per request of a decode-mode step: 1 for ``DECODE``, else
        ``config.spec_num_tokens`` (target verify, DFLASH draft block)."""
        return 1 if ForwardMode.parse(mode) is ForwardMode.DECODE else self.config.spec_num_tokens

    def init_forward_metadata(
        self,
        bs: int,
        req_pool_indices,
        seq_lens,
        req_to_page,
        forward_mode: ForwardMode = ForwardMode.DECODE,
        extend_seq_lens=None,
        extend_prefix_lens=None,
        num_pages: int | None = None,
        **kwargs,
    ) -> DecodeMetadata | ExtendMetadata:
        """Plans one forward step; returns the metadata pytree every layer reuses.

        Args:
          bs: number of requests; the first ``bs`` entries of the per-request inputs count.
          req_pool_indices: int[>= bs] rows of ``req_to_page``.
          seq_lens: int[>= bs], tokens per request, the new ones included.
          req_to_page: int[pool, max_pages] page ids.
          forward_mode: a :class:`ForwardMode` (or its value, or another engine's enum
            member, as :meth:`ForwardMode.parse` reads it). Decode modes plan ``q_len(mode)`` tokens per
            request; ``EXTEND`` / ``DRAFT_EXTEND`` need ``extend_seq_lens`` int[>= bs].
          extend_prefix_lens: optional int[>= bs], checked against the lengths.
          num_pages: the KV cache's page count, the bound of the page ids when
            ``config.num_pages`` is None (see :meth:`page_bound`).
          kwargs: ``batch_buckets`` (overrides the backend's, e.g. one bucket for every
            device's plan of a data-parallel step); for extends the rest go to
            :func:`jattn.plan_extend` (token buckets); decode modes ignore the rest.
        """
        mode = ForwardMode.parse(forward_mode)
        cfg = self.config
        bs = _check_bs(bs)
        if mode.is_extend() and extend_seq_lens is None:
            raise ValueError(f"extend_seq_lens is required for {mode}")
        given = {"req_pool_indices": req_pool_indices, "seq_lens": seq_lens, "req_to_page": req_to_page}
        if mode.is_extend():
            given.update(extend_seq_lens=extend_seq_lens, extend_prefix_lens=extend_prefix_lens)
        for name, x in given.items():
            if x is None and name != "extend_prefix_lens":
                raise ValueError(f"{name} is required (None given)")
            if x is not None and name != "req_to_page" and not 0 <= bs <= len(_as_int_array(x, name, 1)):
                raise ValueError(f"bs={bs} must be in [0, {len(np.asarray(x))}] (the entries of {name})")
        common = dict(
            page_size=cfg.page_size,
            req_to_page=np.asarray(req_to_page),
            req_pool_indices=np.asarray(req_pool_indices)[:bs],
            batch_buckets=kwargs.pop("batch_buckets", self.batch_buckets),
            max_pages=cfg.max_num_pages,
            num_pages=self.page_bound(num_pages),
        )
        seq_lens = np.asarray(seq_lens)[:bs]
        if mode.is_extend():
            return plan_extend(
                seq_lens,
                np.asarray(extend_seq_lens)[:bs],
                extend_prefix_lens=None if extend_prefix_lens is None else np.asarray(extend_prefix_lens)[:bs],
                forward_mode=mode,
                **common,
                **kwargs,
            )
        return plan_decode(
            seq_lens,
            q_len=self.q_len(mode),
            is_causal=mode is not ForwardMode.DRAFT_BLOCK,
            forward_mode=mode,
            **common,
        )

    def page_bound(self, num_pages: int | None = None) -> int | None:
        """The pool size a plan's page ids are checked against: ``config.num_pages``, or
        else ``num_pages`` (the cache's page count, given by the caller). The plan records
        it as a static field, so it must be the same for every step of a jitted loop; the
        ``forward_*`` methods refuse a plan without one, or with more pages than the cache."""
        return self.config.num_pages if self.config.num_pages is not None else num_pages

    # ---- CUDA-graph analogue: buckets chosen once, compiled on first call, refilled after.

    @property
    def batch_buckets(self) -> tuple:
        """The batch buckets plans are padded to: the config's, or after
        :meth:`init_cuda_graph_state` the captured ones and then the config's above them
        (a larger batch runs outside the captured set, as upstream runs it eagerly)."""
        return getattr(self, "_batch_buckets", self.config.batch_buckets)

    @property
    def graph_buckets(self) -> tuple:
        """The buckets a capture may compile (``in_capture``, the capture plans): those
        :meth:`init_cuda_graph_state` chose, else :attr:`batch_buckets`."""
        return getattr(self, "_graph_buckets", self.batch_buckets)

    def init_cuda_graph_state(self, max_bs: int, **kwargs) -> tuple:
        """Chooses the captured batch buckets (the upstream captured batch sizes) up to
        ``max_bs`` and returns them; batches above ``max_bs`` still plan, to the config's
        buckets above it (powers of two where the config has none)."""
        max_bs = _positive_int(max_bs, "max_bs")
        base = self.config.batch_buckets or tuple(1 << i for i in range(max(max_bs, 1 << 20).bit_length() + 1))
        buckets = tuple(b for b in base if b < max_bs) + (max_bs,)
        self._graph_buckets = buckets
        self._batch_buckets = buckets + tuple(b for b in base if b > max_bs)
        return buckets

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, forward_mode: ForwardMode = ForwardMode.DECODE, num_pages: int | None = None, **kwargs
    ) -> DecodeMetadata:
        """A placeholder decode plan of bucket ``bs`` (all rows padding) to compile with;
        ``num_pages`` as in :meth:`init_forward_metadata` (the replays must agree)."""
        if not _is_bucket(_check_bs(bs), self.graph_buckets):
            raise ValueError(f"bs={bs} is not one of {_buckets_text(self.graph_buckets)}")
        mode = ForwardMode.parse(forward_mode)
        if not mode.is_decode():
            raise ValueError(f"CUDA-graph plans are decode plans; got {mode}")
        q_len = self.q_len(mode)
        # No requests: every row of the bucket is padding (length 0, writes to the dummy page).
        return plan_decode(
            np.zeros(0, np.int32),
            page_size=self.config.page_size,
            page_table=np.zeros((0, self.config.max_num_pages), np.int32),
            q_len=q_len,
            is_causal=mode is not ForwardMode.DRAFT_BLOCK,
            forward_mode=mode,
            batch_buckets=(bs,),
            max_pages=self.config.max_num_pages,
            num_pages=self.page_bound(num_pages),
        )

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices,
        seq_lens,
        req_to_page,
        forward_mode: ForwardMode = ForwardMode.DECODE,
        num_pages: int | None = None,
        **kwargs,
    ) -> DecodeMetadata:
        """A decode plan for the first ``bs`` requests, padded to the smallest bucket."""
        return self.init_forward_metadata(
            bs, req_pool_indices, seq_lens, req_to_page, forward_mode, num_pages=num_pages
        )

    def init_forward_metadata_out_graph(
        self,
        bs: int,
        req_pool_indices,
        seq_lens,
        req_to_page,
        forward_mode: ForwardMode = ForwardMode.DECODE,
        in_capture: bool = False,
        num_pages: int | None = None,
        **kwargs,
    ) -> DecodeMetadata | ExtendMetadata:
        """SGLang's planning outside the captured graph: the plan of the batch, every mode.

        Arguments as in :meth:`init_forward_metadata` (``extend_seq_lens`` and the rest
        in ``kwargs``). A jitted step takes the plan as an argument, so planning is
        always outside the compiled program; ``in_capture`` (the step that compiles the
        bucket) only checks that ``bs`` is one of :attr:`graph_buckets`, so that the plan
        has that bucket's shapes and later plans of the same bucket reuse the program.
        """
        if in_capture:
            check_capture_bucket(bs, self.graph_buckets)
        return self.init_forward_metadata(
            bs, req_pool_indices, seq_lens, req_to_page, forward_mode, num_pages=num_pages, **kwargs
        )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The length to give padding rows of a bucket: 0 (an empty row: output 0,
        its new K/V written to the dummy page, no page of its own needed)."""
        return 0

    def get_verify_buffers_to_fill_after_draft(self) -> list:
        """Buffers a target-verify plan needs filled after the draft step: none (the
        verify mask is causal by position, there is no custom mask), so ``[None, None]``."""
        return [None, None]

    def fill_block_decode_seq_lens(self, metadata: DecodeMetadata, bs, block_seq_lens) -> DecodeMetadata:
        """DFLASH draft block: the plan with each of the first ``bs`` requests' length set
        to its block-end length ``block_seq_lens`` i32[>= bs] (prefix + block), clamped
        to ``[spec_num_tokens, context_len]`` (a length of 0 or less keeps a padding row empty).
        Jittable (``bs`` may be traced): the drafter calls it inside its jitted step;
        write slots and positions are
        re-derived on the device from the plan's page table, which for a DRAFT_BLOCK
        plan keeps each request's whole ``req_to_page`` row (the block's pages must be
        there, as they must be in the upstream engine's table).
        """
        if metadata.forward_mode is not ForwardMode.DRAFT_BLOCK:
            raise ValueError(f"fill_block_decode_seq_lens needs a DRAFT_BLOCK plan, got {metadata.forward_mode}")
        lens = jnp.asarray(block_seq_lens, jnp.int32)[: metadata.batch_size]
        # a row of length 0 stays a padding row (empty output); the others hold a whole block
        lens = jnp.where(lens > 0, jnp.clip(lens, self.config.spec_num_tokens, self.config.context_len), 0)
        return metadata.with_seq_lens(lens, bs)

    def support_kv_cache_prewrite(self, forward_mode: ForwardMode | None = None) -> bool:
        """Whether the engine may write the new K/V before attention (decode modes: the
        new tokens are part of ``L`` and attention reads them from the cache)."""
        return forward_mode is not None and ForwardMode.parse(forward_mode).is_decode()
