"""jattn.bridge: use jattn as the attention backend of a PyTorch serving engine.

* :func:`to_jax` / :func:`to_torch`: checked zero-copy DLPack conversions.
* :class:`TorchKVPool` / :class:`TorchMLAKVPool`: reference torch KV pools in the
  layout of tokenspeed's and SGLang's pools; :class:`TorchAttentionLayer`: the
  ``layer`` protocol.
* :class:`TorchMHABackend` (tokenspeed's ``MHAAttnBackend`` methods) and
  :class:`TorchMLABackend` (SGLang's ``TRTLLMMLABackend`` methods): torch tensors in
  and out, the work in jattn's core backends under ``jax.jit``, the KV pool viewed
  (never copied) and written in place; :class:`TorchMLAMultiStepDraftBackend`
  (SGLang's ``TRTLLMMLAMultiStepDraftBackend``): one of those per EAGLE draft step.

* ``triton_native.mha_decode`` / ``mla_decode``: jattn's Triton paged decode and MLA
  absorbed decode launched natively on torch tensors (no JAX in the call; capturable
  in a torch CUDA graph). ``kernels="triton_native"`` of both torch backends runs
  their layer calls this way (``native``).

Modules: ``call`` (staging, views, jit cache, fences, per-layer plans), ``mha`` and
``mla`` (the adapters), ``multistep``, ``pool``, ``convert``, ``streams``, ``triton_native``, ``native``.
"""

try:
    import torch  # noqa: F401
except ImportError as e:
    raise ImportError(
        'jattn.bridge needs PyTorch: pip install -e ".[torch]" in the jattn checkout; on a CPU-only machine: '
        "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    ) from e

from jattn.metadata import ForwardMode

from .convert import SUPPORTED_DTYPES, BridgeError, check_shareable, to_jax, to_torch
from .mha import TorchMHABackend
from .mla import TorchMLABackend
from .multistep import TorchMLAMultiStepDraftBackend
from .pool import AttentionLayer, TorchAttentionLayer, TorchKVPool, TorchMLAKVPool, layer_spec
from .streams import StreamSync

#: MLA draft-extend mode (per-request query lengths vary): ``ForwardMode.DRAFT_EXTEND``.
DRAFT_EXTEND = ForwardMode.DRAFT_EXTEND

__all__ = [
    "AttentionLayer",
    "BridgeError",
    "DRAFT_EXTEND",
    "SUPPORTED_DTYPES",
    "StreamSync",
    "TorchAttentionLayer",
    "TorchKVPool",
    "TorchMHABackend",
    "TorchMLABackend",
    "TorchMLAKVPool",
    "TorchMLAMultiStepDraftBackend",
    "check_shareable",
    "layer_spec",
    "to_jax",
    "to_torch",
]
