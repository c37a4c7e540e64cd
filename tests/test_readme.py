"""The README's Python snippets run as written (the two set-up commands are what CI runs)."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_snippets_run():
    blocks = _blocks()
    assert len(blocks) >= 4
    env = {}
    exec(blocks[0], env)  # the ops
    assert env["out"].shape == (2, 8, 64) and np.isfinite(np.asarray(env["out"], np.float32)).all()
    exec(blocks[1], {})  # the Flax model + engine
    # the jitted serving step: fill in the host inputs the snippet leaves to the engine
    step_env = dict(env, bs=2, req_pool_indices=np.array([0, 1]), seq_lens=np.array([9, 3]),
                    req_to_page=np.array([[1, 0], [2, 0]]))
    import jax.numpy as jnp

    step_env.update(q=jnp.ones((2, 8, 64), jnp.bfloat16), k=jnp.ones((2, 2, 64), jnp.bfloat16),
                    v=jnp.ones((2, 2, 64), jnp.bfloat16))
    exec(blocks[2], step_env)
    assert step_env["out"].shape == (2, 8 * 64)
    torch_env = {}
    exec(blocks[3], torch_env)  # from PyTorch
    assert tuple(torch_env["out"].shape) == (2, 8 * 64)


def test_readme_has_the_two_setup_commands():
    text = README.read_text()
    cmds = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert any("python -m jattn demo" in c for c in cmds)
    ci = (README.parent / ".ci" / "run").read_text()
    test_cmd = [c.strip() for c in cmds if "pytest" in c][0]
    # .ci/run runs README's test command (after its own venv set-up)
    assert test_cmd.split("&& pip install torch", 1)[1] in ci
