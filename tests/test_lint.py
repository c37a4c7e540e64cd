"""The linter and formatter configured in pyproject.toml ([tool.ruff]) pass on the repository."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff(args):
    res = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"ruff {' '.join(args)} failed:\n{res.stdout[-4000:]}{res.stderr[-2000:]}"
