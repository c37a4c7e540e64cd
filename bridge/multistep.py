"""``TorchMLAMultiStepDraftBackend``: SGLang's ``TRTLLMMLAMultiStepDraftBackend`` for a
torch engine, over one latent pool.

An EAGLE drafter runs ``speculative_num_steps - 1`` decode forwards back to back; step
``i`` decodes the token at position ``seq_lens[b] - 1 + i`` and so sees
``seq_lens[b] + i`` keys. As upstream, ``attn_backends[i]`` (a
:class:`~jattn.bridge.TorchMLABackend` on the shared pool) serves step ``i`` with its
own plan; the plans of a loop are made at once by :meth:`init_forward_metadata`, after
the core's :class:`~jattn.multistep.MLAMultiStepDraftBackend` checked the loop (no two
draft tokens of any step write one slot; chain drafts, ``topk=1``, only).
"""

from __future__ import annotations

import numpy as np

from jattn.backends import MLAConfig
from jattn.metadata import ForwardMode
from jattn.multistep import MLAMultiStepDraftBackend

from .mla import TorchMLABackend
from .state import _host, _req_to_page

__all__ = ["TorchMLAMultiStepDraftBackend"]


class TorchMLAMultiStepDraftBackend:
    """EAGLE multi-step draft decoding over a torch MLA latent pool (SGLang's methods).

    ``bridge_kwargs`` (``device``, ``kv_writer``, ``sync``, ``kernels``) go to every
    step's :class:`~jattn.bridge.TorchMLABackend`.
    """

    def __init__(
        self,
        config: MLAConfig,
        token_to_kv_pool=None,
        topk: int = 1,
        speculative_num_steps: int = 2,
        **bridge_kwargs,
    ):
        self._core = MLAMultiStepDraftBackend(config, topk=topk, speculative_num_steps=speculative_num_steps)
        self.config = config
        self.topk = self._core.topk
        self.speculative_num_steps = self._core.speculative_num_steps
        self.num_steps = self._core.num_steps
        self.attn_backends = tuple(
            TorchMLABackend(config, token_to_kv_pool, **bridge_kwargs) for _ in range(self.num_steps)
        )

    def init_forward_metadata(self, bs: int, req_pool_indices, seq_lens, req_to_page=None, **kwargs) -> None:
        """Plans the draft loop: step ``i`` gets lengths ``seq_lens + i`` (padding rows,
        length 0, stay 0). ``seq_lens`` int[>= bs] counts each request's first draft
        token (SGLang's verified length + 1 on real rows; padding rows must be given 0, not
        1, or they write into the pages of their stale ``req_pool_indices`` rows);
        ``req_to_page`` (or ``req_to_token_pages``) rows must hold the pages of the last
        step's length."""
        self.init_forward_metadata_out_graph(bs, req_pool_indices, seq_lens, req_to_page, **kwargs)

    def init_forward_metadata_out_graph(
        self, bs: int, req_pool_indices, seq_lens, req_to_page=None, in_capture: bool = False, **kwargs
    ) -> None:
        """Every step's plan outside the captured graph, as :meth:`init_forward_metadata`
        (``in_capture``: ``bs`` must be a bucket, and the plans are kept as the bucket's
        capture plans)."""
        req_to_page = _req_to_page(req_to_page, kwargs)
        rpi, sl, r2p = _host(req_pool_indices), _host(seq_lens), _host(req_to_page)
        self._core.init_forward_metadata(bs, rpi, sl, r2p)  # checks seq_lens and the loop's slots
        sl = sl[: int(bs)].astype(np.int64)
        for i, be in enumerate(self.attn_backends):
            lens = np.where(sl > 0, sl + i, 0)
            be.init_forward_metadata_out_graph(bs, rpi, lens, r2p, ForwardMode.DECODE, in_capture=in_capture, **kwargs)

    def forward_decode(self, step: int, q, k, v, layer, forward_batch=None, save_kv_cache: bool = True, **kwargs):
        """Step ``step`` of the loop: ``attn_backends[step].forward_decode(...)`` (the
        keywords pass through: ``q_rope``, ``k_rope``, ``cos_sin_cache``, ...)."""
        if not 0 <= step < self.num_steps:
            raise ValueError(f"step={step} is not in [0, num_steps={self.num_steps})")
        return self.attn_backends[step].forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    # ---- CUDA-graph helpers: each step's backend holds its bucket's plan.

    def init_cuda_graph_state(self, max_bs: int, *args, **kwargs) -> tuple:
        """Chooses the batch buckets up to ``max_bs`` for every step."""
        buckets = self._core.init_cuda_graph_state(max_bs)
        for be in self.attn_backends:
            be.init_cuda_graph_state(max_bs)
        return buckets

    def init_forward_metadata_capture_cuda_graph(self, bs: int, *args, **kwargs) -> None:
        """An all-padding plan of bucket ``bs`` in every step's backend (compile with it);
        ``num_pages`` (the pool's page count) passes on to each, as in
        :meth:`jattn.bridge.TorchMLABackend.init_forward_metadata_capture_cuda_graph`."""
        for be in self.attn_backends:
            be.init_forward_metadata_capture_cuda_graph(
                bs, forward_mode=ForwardMode.DECODE, num_pages=kwargs.get("num_pages")
            )

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens, req_to_page=None, **kwargs):
        """New values into the bucket of ``bs`` for every step (no retrace)."""
        req_to_page = _req_to_page(req_to_page, kwargs)
        self.init_forward_metadata(bs, req_pool_indices, seq_lens, req_to_page, num_pages=kwargs.get("num_pages"))

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """0, as :meth:`jattn.bridge.TorchMLABackend.get_cuda_graph_seq_len_fill_value`."""
        return self._core.get_cuda_graph_seq_len_fill_value()
