"""What an :class:`~jattn.models.engine.Engine` serves, built from its config: the model
(a tensor-parallel copy on a mesh, its projections fused where that is the choice), the
attention backend, and a fresh KV cache."""

from __future__ import annotations

import warnings

import jax

from jattn.models.requests import EngineConfig

__all__ = ["check_context", "check_kernel_backend", "serving_model", "serving_ops", "trained_context", "new_kv_cache"]


def trained_context(model) -> int | None:
    """The model's ``max_position_embeddings`` (None where its config has none)."""
    trained = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return trained if isinstance(trained, int) else None


def serving_ops(model) -> tuple[str, ...]:
    """The attention ops the model's serving loop calls (``jattn.dispatch``)."""
    from jattn.dispatch import MHA_OPS, MLA_OPS
    from jattn.models.deepseek import Deepseek

    return MLA_OPS if isinstance(model, Deepseek) else MHA_OPS


def check_context(model, c: EngineConfig) -> None:
    """Warns when ``c.max_context`` exceeds the model's ``max_position_embeddings``:
    positions past it are outside what the model was trained on."""
    trained = trained_context(model)
    if trained is not None and c.max_context > trained:
        warnings.warn(
            f"EngineConfig.max_context={c.max_context} exceeds the model's max_position_embeddings={trained}: "
            "positions past it are outside what the model was trained on",
            stacklevel=3,
        )


def check_kernel_backend(model, c: EngineConfig) -> None:
    """Refuses ``c.kernel_backend`` when it names a backend that cannot serve one of the
    attention ops the model's serving loop calls on this device (the mosaic kernels
    without a Hopper GPU or the interpreter, the Triton ones without jax-triton), which
    would otherwise fail every request at its first step."""
    if c.kernel_backend in (None, "xla"):
        return
    from jattn.dispatch import op_backend

    for op in serving_ops(model):
        reason = op_backend(op, c.kernel_backend)[1]
        if reason:
            raise ValueError(
                f"EngineConfig.kernel_backend={c.kernel_backend!r} cannot serve {op} here: {reason}. "
                "None (auto) runs each call on a backend that serves it"
            )


def serving_model(model, c: EngineConfig, backend=None):
    """``(model, backend, fused)`` for config ``c``: on a mesh, the sharded model and
    backend (``models.parallel.for_engine``; a backend given too is refused); the q/k/v
    and gate/up projections fused in place when ``c.fuse_projections`` asks for it (None:
    on a GPU unless tensor-parallel; True with a tensor-parallel mesh is refused); without
    a backend, the model's default one for ``c.kernel_backend``; its layers stacked in
    place (``CausalLM.stack_layers``) when ``c.scan_layers``. A ``c.kernel_backend`` this
    device cannot run is refused first (:func:`check_kernel_backend`)."""
    check_kernel_backend(model, c)
    if c.mesh is not None:
        from jattn.models.parallel import for_engine

        if backend is not None:
            raise ValueError("EngineConfig.mesh: the engine builds the sharded backend; pass backend=None")
        model, backend = for_engine(model, c.mesh, c.mesh_axis, page_size=c.page_size, kernel_backend=c.kernel_backend)
    tensor_parallel = c.mesh is not None and not hasattr(backend, "data_parallel_size")
    if c.fuse_projections and tensor_parallel:
        raise ValueError(
            "EngineConfig.fuse_projections: a tensor-parallel model keeps q/k/v and gate/up separate "
            "(their column sharding is per projection)"
        )
    fuse = c.fuse_projections
    if fuse is None:  # auto: where it was measured faster (GPU), never tensor-parallel
        fuse = jax.default_backend() == "gpu" and not tensor_parallel
    if fuse:
        from jattn.models.layers import fuse_projections

        fuse_projections(model)
    if c.scan_layers:
        model.stack_layers()
    if backend is None:
        from jattn.models.deepseek import Deepseek, default_mla_backend
        from jattn.models.llama import default_mha_backend

        default = default_mla_backend if isinstance(model, Deepseek) else default_mha_backend
        backend = default(model.config, c.page_size, c.kernel_backend)
    return model, backend, fuse


def new_kv_cache(model, backend, c: EngineConfig):
    """An empty KV cache of ``c.num_pages`` pages for ``model`` (sharded as ``backend``
    serves it on a mesh), in ``c.kv_cache_dtype`` or the model's dtype."""
    dtype = c.kv_cache_dtype or model.config.dtype
    if c.mesh is not None:
        from jattn.models.parallel import make_cache

        return make_cache(model, backend, num_pages=c.num_pages, page_size=c.page_size, dtype=dtype)
    return model.make_cache(num_pages=c.num_pages, page_size=c.page_size, dtype=dtype, stacked=model.layers_stacked)
