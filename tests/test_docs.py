"""The Python examples in docs/ run as written and check what they claim."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
BLOCKS = [
    (path.name, i, block)
    for path in sorted(DOCS.glob("*.md"))
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S))
]


def test_docs_have_examples():
    assert any(name == "SEMANTICS.md" for name, _, _ in BLOCKS)


@pytest.mark.parametrize("name,i,block", BLOCKS, ids=[f"{n}-{i}" for n, i, _ in BLOCKS])
def test_docs_example_runs(name, i, block):
    exec(compile(block, f"docs/{name} example {i}", "exec"), {})
