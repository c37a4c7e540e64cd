"""The import rule, read from the source (AST) so that a violation fails CI.

* Library modules (everything in ``jattn/`` and ``pallas_kernels/`` except the tools below)
  import neither ``jattn.bridge`` nor ``jattn.models`` nor ``torch``, nor the tools.
* ``models/`` (except its demo) imports no ``torch`` and not ``jattn.bridge``.
* Tools may import anything: ``jattn/bench/``, ``jattn/demo.py``, ``jattn/__main__.py``,
  ``models/demo.py``, ``examples/``, ``scripts/``. ``bridge/`` is the torch side.

Every import counts, also one inside a function, a relative one, ``from jattn import bridge``
and ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# repository folder -> import name (pyproject's package-dir)
PACKAGES = {
    "jattn": "jattn",
    "pallas_kernels": "jattn.pallas_kernels",
    "bridge": "jattn.bridge",
    "models": "jattn.models",
}
TOOLS = ("jattn/bench/", "jattn/demo.py", "jattn/__main__.py", "models/demo.py")
TOOL_NAMES = ("jattn.bench", "jattn.demo", "jattn.__main__", "jattn.models.demo")
LIBRARY_FORBIDS = ("jattn.bridge", "jattn.models", "torch") + TOOL_NAMES
MODELS_FORBIDS = ("torch", "jattn.bridge") + TOOL_NAMES


def module_name(rel: str) -> str:
    """``"models/engine.py"`` -> ``"jattn.models.engine"``."""
    parts = rel[: -len(".py")].split("/")
    name = ".".join([PACKAGES[parts[0]], *parts[1:]])
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def forbidden_for(rel: str) -> tuple[str, ...]:
    """The imports the rule forbids in the file at ``rel`` (repository-relative)."""
    if rel.startswith(TOOLS) or rel.startswith(("bridge/", "examples/", "scripts/", "tests/")):
        return ()
    if rel.startswith("models/"):
        return MODELS_FORBIDS
    if rel.startswith(("jattn/", "pallas_kernels/")):
        return LIBRARY_FORBIDS
    raise AssertionError(f"{rel}: not placed in the import rule (library, models or tool?)")


def imports(source: str, module: str, is_package: bool = False):
    """``(line, imported module name)`` for every import in ``source``, wherever it is."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if fname not in ("import_module", "__import__"):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.append((node.lineno, arg.value))
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                out.append((node.lineno, str(arg.values[0].value).rstrip(".")))  # f"pkg.{x}"
    return out


def violations(source: str, rel: str, forbids=None) -> list[str]:
    """``"rel:line imports X (forbidden: Y)"`` for each forbidden import in ``source``."""
    forbids = forbidden_for(rel) if forbids is None else forbids
    name = module_name(rel)
    first = {}  # (line, forbidden) -> the shortest name imported there
    for line, imp in imports(source, name, rel.endswith("__init__.py")):
        for f in forbids:
            if (imp == f or imp.startswith(f + ".")) and len(imp) < len(first.get((line, f), imp + ".")):
                first[(line, f)] = imp
    return [f"{rel}:{line} imports {imp} (forbidden here: {f})" for (line, f), imp in sorted(first.items())]


def _files():
    files = []
    for folder in PACKAGES:
        files += sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*.py"))
    return files


def test_library_and_models_import_rule():
    files = _files()
    assert "jattn/ops.py" in files and "pallas_kernels/mosaic_decode.py" in files
    found = []
    for rel in files:
        found += violations((ROOT / rel).read_text(), rel)
    assert not found, (
        "imports that break the rule (library: no bridge/models/torch/tools; models: "
        "no torch/bridge):\n" + "\n".join(found)
    )


def test_the_checker_finds_violations():
    """The checker itself: each way of importing is caught, with its line."""
    bad = textwrap.dedent("""\
        import numpy as np
        import torch.nn
        from jattn import ops, bridge
        def f():
            from jattn.models.engine import Engine
            return Engine
        class C:
            def g(self):
                import importlib
                return importlib.import_module("torch")
        from . import bridge as b2
        from .models import llama
        x = __import__(f"jattn.bench.{np.__name__}")
        """)
    found = violations(bad, "jattn/new_module.py")
    assert found == [
        "jattn/new_module.py:2 imports torch.nn (forbidden here: torch)",
        "jattn/new_module.py:3 imports jattn.bridge (forbidden here: jattn.bridge)",
        "jattn/new_module.py:5 imports jattn.models.engine (forbidden here: jattn.models)",
        "jattn/new_module.py:10 imports torch (forbidden here: torch)",
        "jattn/new_module.py:11 imports jattn.bridge (forbidden here: jattn.bridge)",
        "jattn/new_module.py:12 imports jattn.models (forbidden here: jattn.models)",
        "jattn/new_module.py:13 imports jattn.bench (forbidden here: jattn.bench)",
    ], found
    # relative imports resolve against the file's package (pallas_kernels -> jattn.pallas_kernels)
    assert violations("from .. import models\n", "pallas_kernels/k.py") == [
        "pallas_kernels/k.py:1 imports jattn.models (forbidden here: jattn.models)"
    ]
    assert violations("from ..bridge import pool\n", "models/x.py") == [
        "models/x.py:1 imports jattn.bridge (forbidden here: jattn.bridge)"
    ]
    # what the rule allows
    assert violations("import torchvision_like\nfrom jattn import ops\nimport jax\n", "jattn/ops.py") == []
    assert violations("import torch\nfrom jattn.models import engine\n", "jattn/bench/x.py") == []
    assert violations("import torch\n", "models/demo.py") == []
    assert violations("from jattn.models import engine\n", "models/x.py") == []
    with pytest.raises(AssertionError, match="not placed"):
        forbidden_for("somewhere/else.py")


_RUNTIME = """
import importlib, json, sys
lib, models = json.loads(sys.argv[1])
for m in lib:
    importlib.import_module(m)
after_lib = sorted(m for m in sys.modules if m == "torch" or m.startswith(("jattn.bridge", "jattn.models")))
for stmt in models:
    try:
        exec(stmt, {})
    except ImportError:  # an optional dependency that is not installed
        pass
print(json.dumps([after_lib, "torch" in sys.modules]))
"""


def test_importing_the_library_and_models_pulls_no_torch():
    """At run time too: importing every library module loads no bridge, models or torch, and
    importing the models modules plus every third-party import they make (also the lazy ones,
    e.g. ``gguf``, ``tokenizers``) loads no torch (``from transformers import AutoTokenizer``
    would)."""
    files = _files()
    lib = [module_name(f) for f in files if forbidden_for(f) == LIBRARY_FORBIDS]
    stmts = []
    for rel in files:
        if forbidden_for(rel) != MODELS_FORBIDS:
            continue
        stmts.append(f"import {module_name(rel)}")
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.Import) and not node.names[0].name.startswith("jattn"):
                stmts += [f"import {a.name}" for a in node.names]
            elif (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and node.module != "__future__"
                and not node.module.startswith("jattn")
            ):
                stmts.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
    res = subprocess.run(
        [sys.executable, "-c", _RUNTIME, json.dumps([lib, sorted(set(stmts))])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    after_lib, torch_after_models = json.loads(res.stdout.strip().splitlines()[-1])
    assert after_lib == [], f"importing the library loaded {after_lib}"
    assert not torch_after_models, f"importing models (and its imports {sorted(set(stmts))}) loaded torch"
