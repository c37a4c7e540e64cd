"""The models across devices: tensor-parallel Llama-family models, data-parallel MLA models.

* :func:`tensor_parallel` returns a copy of a Llama-family model whose weights are placed
  Megatron-style over one mesh axis: column-parallel ``q/k/v_proj`` and ``gate/up_proj``
  (output features split, so each device computes its own heads and its slice of the MLP),
  row-parallel ``o_proj`` and ``down_proj`` (input features split); everything else
  (embeddings, norms, the LM head) replicated. The forward is the unchanged model under
  ``jax.jit``: XLA's partitioner follows the weights' shardings and adds one all-reduce
  after each row-parallel projection (two per decoder block, attention and MLP, as in
  Megatron and SGLang), and the attention runs on each device's heads through
  :class:`jattn.sharding.TensorParallelMHABackend` (:func:`tensor_parallel_backend`).
  With fewer KV heads than devices the copy's ``k/v_proj`` columns are replicated per head
  (``config.num_kv_heads`` becomes the physical count), so each device computes the KV
  head its query heads read; the outputs are those of the original model.
* :func:`data_parallel` returns a copy of an MLA (DeepSeek) model with every weight
  replicated: tokens, requests and latent pools are split over the axis, each device
  serving its own requests (:class:`jattn.sharding.DataParallelMLABackend`); the MLP / MoE
  runs on each device's tokens.

Example (four devices, heads split four ways)::

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))
    tp_model = tensor_parallel(model, mesh)
    backend = tensor_parallel_backend(tp_model, mesh, page_size=16)
    cache = make_cache(tp_model, backend, num_pages=64, page_size=16)
    hidden, cache = jax.jit(lambda m, c, t, md: m(t, md.positions, c, md, backend=backend))(tp_model, cache, tokens, md)
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jattn.sharding import DataParallelMLABackend, TensorParallel, TensorParallelMHABackend, put

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _names(path) -> tuple:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(getattr(k, attr))
                break
    return tuple(out[:-1]) if out and out[-1] == "value" else tuple(out)  # a Variable's own leaf


def weight_spec(path: tuple, ndim: int, axis: str) -> P:
    """The partition spec of one weight of a tensor-parallel Llama-family model, from
    its path in the model state (e.g. ``('layers', 0, 'self_attn', 'q_proj', 'kernel')``)."""
    owner, leaf = (path[-2], path[-1]) if len(path) >= 2 else (None, None)
    if owner in COLUMN_PARALLEL:
        return P(None, axis) if leaf == "kernel" else P(axis) if leaf == "bias" else P()
    if owner in ROW_PARALLEL and leaf == "kernel":
        return P(axis, None)
    return P()


def _place(model, mesh: Mesh, spec_fn) -> None:
    state = nnx.state(model)
    placed = jax.tree_util.tree_map_with_path(lambda p, x: put(x, mesh, spec_fn(_names(p), np.ndim(x))), state)
    nnx.update(model, placed)


def _is_llama(model) -> bool:
    from jattn.models.llama import Llama

    return isinstance(model, Llama)


def _is_mla(model) -> bool:
    from jattn.models.deepseek import Deepseek

    return isinstance(model, Deepseek)


def tensor_parallel(model, mesh: Mesh, axis: str = "tp"):
    """A copy of the Llama-family ``model`` with tensor-parallel weights over ``axis`` of
    ``mesh`` (the module docstring says which weights split how). ``ValueError`` names the
    size and the rule it breaks: ``num_q_heads`` and ``intermediate_size`` divisible by the
    axis size, ``num_kv_heads`` divisible by it or dividing it. The copy's
    ``config.num_kv_heads`` is the physical KV head count (its caches hold that many)."""
    if not _is_llama(model):
        raise TypeError(f"tensor_parallel: model must be a Llama-family model, got {type(model).__name__}")
    if model.layers_stacked:
        raise ValueError("tensor_parallel: the model's layers are stacked (stack_layers): build it per layer")
    if any(
        getattr(n, "qkv_proj", None) is not None or getattr(n, "gate_up_proj", None) is not None
        for _, n in nnx.iter_graph(model)
    ):
        raise ValueError(
            "tensor_parallel: the model's projections are fused (fuse_projections); tensor parallelism "
            "shards q/k/v and gate/up separately: build the model unfused"
        )
    tp = TensorParallel(mesh, axis)
    cfg = model.config
    hp = tp.heads(cfg.num_q_heads, cfg.num_kv_heads)
    if cfg.intermediate_size % tp.size:
        raise ValueError(
            f"intermediate_size={cfg.intermediate_size} must be divisible by the size {tp.size} of mesh axis {axis!r}"
        )
    model = nnx.clone(model)
    if hp.kv_replicas > 1:
        d, r = cfg.head_dim, hp.kv_replicas
        for layer in model.layers:
            attn = layer.self_attn
            for proj in (attn.k_proj, attn.v_proj):
                w = np.asarray(proj.kernel[...])
                proj.kernel = nnx.Param(np.repeat(w.reshape(w.shape[0], -1, d), r, axis=1).reshape(w.shape[0], -1))
                if proj.bias is not None:
                    proj.bias = nnx.Param(np.repeat(np.asarray(proj.bias[...]).reshape(-1, d), r, axis=0).reshape(-1))
            attn.spec = dataclasses.replace(attn.spec, num_kv_heads=hp.physical_kv_heads)
        model.config = cfg.replace(num_kv_heads=hp.physical_kv_heads)
    _place(model, mesh, lambda path, ndim: weight_spec(path, ndim, axis))
    return model


def tensor_parallel_backend(model, mesh: Mesh, axis: str = "tp", *, page_size: int = 16, kernel_backend=None):
    """The MHA backend of ``model`` (a :func:`tensor_parallel` copy) run on split heads."""
    from jattn.models.llama import default_mha_backend

    return TensorParallelMHABackend(default_mha_backend(model.config, page_size, kernel_backend), mesh, axis)


def data_parallel(model, mesh: Mesh, axis: str = "dp"):
    """A copy of the MLA ``model`` with every weight replicated over ``mesh`` (checked:
    ``axis`` is one of its axes), for data-parallel serving."""
    if not _is_mla(model):
        raise TypeError(f"data_parallel: model must be an MLA (Deepseek) model, got {type(model).__name__}")
    DataParallelMLABackend(None, mesh, axis)  # checks the axis
    model = nnx.clone(model)
    _place(model, mesh, lambda path, ndim: P())
    return model


def data_parallel_backend(model, mesh: Mesh, axis: str = "dp", *, page_size: int = 64, kernel_backend=None):
    """The MLA backend of ``model`` run data-parallel: each device its own requests and pool."""
    from jattn.models.deepseek import default_mla_backend

    return DataParallelMLABackend(default_mla_backend(model.config, page_size, kernel_backend), mesh, axis)


def make_cache(model, backend, *, num_pages: int, page_size: int, dtype=None):
    """A zero KV cache for ``model`` served by ``backend``, placed for it: split by head
    for a :class:`TensorParallelMHABackend` (``num_pages`` pages), split by page for a
    :class:`DataParallelMLABackend` (``num_pages`` pages on every device)."""
    cfg = model.config
    dtype = dtype or cfg.dtype
    if isinstance(backend, TensorParallelMHABackend):
        return backend.tp.create_kv_cache(
            num_layers=cfg.num_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
        )
    if isinstance(backend, DataParallelMLABackend):
        return backend.create_kv_cache(
            num_layers=cfg.num_layers,
            num_pages_per_device=num_pages,
            page_size=page_size,
            kv_lora_rank=cfg.kv_lora_rank,
            rope_dim=cfg.qk_rope_head_dim,
            dtype=dtype,
        )
    raise TypeError(f"make_cache: backend must be a sharded backend, got {type(backend).__name__}")


def for_engine(model, mesh: Mesh, axis: str, *, page_size: int, kernel_backend=None):
    """``(model, backend)`` for an engine on ``mesh``: a Llama-family model's
    tensor-parallel copy and backend (heads split over ``axis``), or an MLA model's
    data-parallel copy and backend (requests and latent pools split over ``axis``; the
    engine places each request on a device)."""
    if getattr(model, "layers_stacked", False):
        raise ValueError("the model's layers are stacked (stack_layers): sharded serving takes per-layer models")
    if _is_mla(model):
        dp_model = data_parallel(model, mesh, axis)
        return dp_model, data_parallel_backend(dp_model, mesh, axis, page_size=page_size, kernel_backend=kernel_backend)
    tp_model = tensor_parallel(model, mesh, axis)
    return tp_model, tensor_parallel_backend(tp_model, mesh, axis, page_size=page_size, kernel_backend=kernel_backend)
