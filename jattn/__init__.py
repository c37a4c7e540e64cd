"""jattn: JAX-native attention backends for LLM serving.

Paged MHA/GQA and DeepSeek-MLA attention ops with backend dispatch (Pallas Mosaic GPU
kernels, Triton kernels through jax-triton, a plain-JAX reference for every op), metadata pytrees so a serving
step is one ``jax.jit``, paged KV caches, and backends with the upstream engines' flow.
Flax models live in ``jattn.models`` and the DLPack bridge for PyTorch engines in
``jattn.bridge`` (neither is imported here). What the ops compute is in
docs/SEMANTICS.md; a map of the code in docs/DESIGN.md.
"""

from jattn.backends import (
    ForwardMode,
    LayerSpec,
    MHABackend,
    MHAConfig,
    MLABackend,
    MLAConfig,
    get_backend,
    register_backend,
    registered_backends,
)
from jattn.cascade import cascade_decode
from jattn.kv_cache import MLAKVCache, PageAllocator, PagedKVCache, PagePoolExhausted
from jattn.metadata import (
    DUMMY_PAGE,
    DecodeMetadata,
    ExtendMetadata,
    PrefixChunk,
    plan_decode,
    plan_extend,
    plan_prefix_chunks,
)
from jattn.multistep import MLAMultiStepDraftBackend, MultiStepMetadata
from jattn.ops import (
    BACKENDS,
    attn_merge_state,
    mha_decode_with_kvcache,
    mha_extend_with_kvcache,
    mha_prefill,
    mla_decode_with_kvcache,
    set_kv_buffer,
    set_mla_kv_buffer,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "DUMMY_PAGE",
    "DecodeMetadata",
    "ExtendMetadata",
    "ForwardMode",
    "LayerSpec",
    "MHABackend",
    "MHAConfig",
    "MLABackend",
    "MLAConfig",
    "MLAKVCache",
    "MLAMultiStepDraftBackend",
    "MultiStepMetadata",
    "PageAllocator",
    "PagePoolExhausted",
    "PagedKVCache",
    "cascade_decode",
    "attn_merge_state",
    "get_backend",
    "mha_decode_with_kvcache",
    "mha_extend_with_kvcache",
    "mha_prefill",
    "mla_decode_with_kvcache",
    "plan_decode",
    "plan_extend",
    "plan_prefix_chunks",
    "PrefixChunk",
    "register_backend",
    "registered_backends",
    "set_kv_buffer",
    "set_mla_kv_buffer",
]
