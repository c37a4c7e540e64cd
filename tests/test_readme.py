"""The README as a newcomer uses it: every Python snippet runs exactly as written (each in a
fresh namespace, nothing filled in from outside), the two set-up commands are what CI runs,
and the files it names exist."""

import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def _run(i):
    env = {"__name__": "readme"}
    exec(compile(_blocks("python")[i], f"README.md python block {i}", "exec"), env)
    return env


def test_readme_has_the_snippets_this_test_checks():
    blocks = _blocks("python")
    assert len(blocks) == 4
    assert "mha_decode_with_kvcache" in blocks[0] and "Engine(" in blocks[1]
    assert "jax.jit" in blocks[2] and "TorchMHABackend" in blocks[3]


def test_snippet_ops():
    env = _run(0)
    assert env["out"].shape == (env["md"].num_tokens, 8, 64) == (2, 8, 64)
    assert np.isfinite(np.asarray(env["out"], np.float32)).all()


def test_snippet_flax_engine():
    env = _run(1)
    assert [r.status for r in env["reqs"]] == ["finished", "finished"]
    assert [len(r.output_tokens) for r in env["reqs"]] == [8, 8]


def test_snippet_jitted_step():
    env = _run(2)
    # the step's output is flat per token, [tokens, Hq * D], as the snippet says
    assert env["out"].shape == (env["md"].num_tokens, 8 * 64)
    assert np.isfinite(np.asarray(env["out"], np.float32)).all()


def test_snippet_torch_bridge():
    pytest.importorskip("torch")
    env = _run(3)
    assert tuple(env["out"].shape) == (2, 8 * 64)


def test_readme_has_the_two_setup_commands():
    cmds = [c.strip() for c in _blocks("bash")]
    setups = [c for c in cmds if c.startswith("python3 -m venv .venv && . .venv/bin/activate && ")]
    assert len(setups) == 2, setups
    demo, tests = sorted(setups, key=lambda c: "pytest" in c)
    assert demo.endswith("python -m jattn demo")
    # .ci/run makes the same venv, then runs README's test command as its last line
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert tests.split(". .venv/bin/activate && ", 1)[1] == ci[-1].strip()


def test_readme_names_files_that_exist():
    text = README.read_text()
    paths = set(re.findall(r"`((?:docs|examples|jattn|tests|bridge|models|pallas_kernels|scripts)/[\w./]+)`", text))
    assert "docs/SEMANTICS.md" in paths and "docs/PERF.md" in paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README names files that do not exist: {missing}"
