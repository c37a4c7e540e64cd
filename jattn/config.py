"""What a backend is built from and told per layer: :class:`MHAConfig`,
:class:`MLAConfig` and :class:`LayerSpec` (frozen, hashable: they are static under
``jax.jit``)."""

from __future__ import annotations

import dataclasses
import math

from jattn.metadata import DEFAULT_BATCH_BUCKETS


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What a backend needs to know of one attention layer (the ``layer`` object that
    tokenspeed and SGLang pass to their backends).

    ``sliding_window_size`` uses the kernels' ``window_left`` convention (the
    upstream backends' too): ``-1`` off, else the query sees ``window_left + 1`` keys including
    itself (Hugging Face ``sliding_window = w`` is ``w - 1`` here).
    """

    layer_id: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    sliding_window_size: int = -1
    logit_cap: float = 0.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    scaling: float | None = None
    non_causal: bool = False

    @property
    def head_dim_v(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


@dataclasses.dataclass(frozen=True)
class MHAConfig:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    context_len: int = 4096
    num_pages: int | None = None
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "bfloat16"
    spec_num_tokens: int = 1
    kernel_backend: str | None = None  # None = auto; "mosaic", "triton", "xla"
    batch_buckets: tuple = DEFAULT_BATCH_BUCKETS
    # Decode with batch-invariant bits (jattn.mha_decode_with_kvcache(batch_invariant=True));
    # cascade plans group requests by batch and are not covered.
    batch_invariant: bool = False

    @property
    def max_num_pages(self) -> int:
        return -(-self.context_len // self.page_size)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    page_size: int = 64
    context_len: int = 4096
    num_pages: int | None = None
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "bfloat16"
    scaling: float | None = None  # default 1/sqrt(qk_nope + qk_rope); times mscale^2 with YaRN
    spec_num_tokens: int = 1
    kernel_backend: str | None = None
    batch_buckets: tuple = DEFAULT_BATCH_BUCKETS

    @property
    def softmax_scale(self) -> float:
        if self.scaling is not None:
            return self.scaling
        return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def max_num_pages(self) -> int:
        return -(-self.context_len // self.page_size)
