"""Why Mosaic GPU's layout inference finds no solution for a kernel build.

Runs pytest on the given arguments (typically cases of tests/test_gpu_compile.py) with the
solver's recursive search wrapped to remember the deepest point it reached (the fewest
unknowns left); after each failed test it prints those unknowns' ops and source lines and
the constraints still open there. JATTN_DIAG_FUEL sets the solver's fuel (default 20,000:
a failing build stops in seconds to a minute; Mosaic GPU's own default is 100,000).
Needs a GPU (the layout pass runs when the kernel is compiled).
Usage: python scripts/diag_layout.py tests/test_gpu_compile.py -k "decode and hkv1-hq1-d64"
"""

import os
import sys

import pytest
from jax.experimental.mosaic.gpu import layout_inference as li

state = {"best": None, "calls": 0}
_orig = li.find_assignments_for


def _describe(var):
    key = var.key
    try:
        op = key.operation
        name = op.OPERATION_NAME if hasattr(op, "OPERATION_NAME") else op.operation.name
        loc = str(op.location)
        return f"{name} {key.type.name}[{key.index}] {getattr(key, 'value', None) and key.value.type} @ {loc}"
    except Exception as e:  # noqa: BLE001
        return f"{var!r} ({e})"


def traced(unknowns, constraint_system, *, fuel, arch):
    state["calls"] += 1
    try:
        reduced = li.cs.reduce(constraint_system)
    except Exception:  # noqa: BLE001
        reduced = None
    if reduced is not None and not isinstance(reduced, li.cs.Unsatisfiable):
        remaining = [u for u in unknowns if u not in reduced.assignments]
        best = state["best"]
        if best is None or len(remaining) < len(best[0]):
            state["best"] = (remaining, list(reduced.constraints))
    return _orig(unknowns, constraint_system, fuel=fuel, arch=arch)


li.find_assignments_for = traced
li.infer_layout.__kwdefaults__["fuel"] = int(os.environ.get("JATTN_DIAG_FUEL", "20000"))


class _Report:
    """pytest plugin: the solver's deepest point after each failed test."""

    def pytest_runtest_setup(self, item):
        state["best"], state["calls"] = None, 0

    def pytest_runtest_logreport(self, report):
        if report.when != "call" or not report.failed or state["best"] is None:
            return
        remaining, constraints = state["best"]
        print(f"\n{report.nodeid}: solver calls {state['calls']}; deepest point: {len(remaining)} unknowns left")
        for v in remaining[:60]:
            print("  U", _describe(v))
        print(f"  {len(constraints)} open constraints:")
        for c in constraints[:80]:
            print("  C", str(c)[:400])


if __name__ == "__main__":
    sys.exit(pytest.main(["-m", "gpu", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[_Report()]))
