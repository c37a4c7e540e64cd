"""Shared pytest setup: GPU tests (marker ``gpu``) are skipped where JAX sees no GPU."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

from jattn.pallas_kernels.interpret import widen_cpu_pool  # noqa: E402

widen_cpu_pool()  # before JAX's CPU client exists: interpreted kernels must not starve its pool

jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    lower_only = os.environ.get("JATTN_LOWER_ONLY") == "1"  # test_gpu_compile lowers without one
    for item in items:
        if "gpu" in item.keywords and not (lower_only and item.module.__name__.endswith("test_gpu_compile")):
            item.add_marker(skip)


@pytest.fixture
def fresh_jit_caches():
    """For a test that stubs a function a jitted op calls: no trace made before reaches the
    stub's test, and no trace made with the stub outlives it (later tests of the same shapes
    would run the stub)."""
    jax.clear_caches()
    yield
    jax.clear_caches()
