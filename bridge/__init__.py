"""jattn.bridge: use jattn as the attention backend of a PyTorch serving engine.

* :func:`to_jax` / :func:`to_torch`: checked zero-copy DLPack conversions.
* :class:`TorchKVPool` / :class:`TorchMLAKVPool`: reference torch KV pools in the
  seeds' layout; :class:`TorchAttentionLayer`: the ``layer`` protocol.
* :class:`TorchMHABackend` / :class:`TorchMLABackend`: the seeds' backend methods,
  torch tensors in and out, the work in jattn's jitted JAX functions, the KV pool
  viewed (never copied) and written in place.
"""

from .backends import DRAFT_EXTEND, TorchMHABackend, TorchMLABackend
from .convert import BridgeError, SUPPORTED_DTYPES, check_shareable, to_jax, to_torch
from .pool import AttentionLayer, TorchAttentionLayer, TorchKVPool, TorchMLAKVPool, layer_spec
from .streams import StreamSync

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
    "check_shareable",
    "layer_spec",
    "to_jax",
    "to_torch",
]
