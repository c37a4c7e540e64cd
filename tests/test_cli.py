"""``python -m jattn`` as a newcomer meets it: one-line answers, never a traceback (CPU, fast)."""

from __future__ import annotations

import pathlib
import runpy
import sys
import types

import pytest

import jattn.demo
import jattn.dispatch
import jattn.ops
from jattn.__main__ import main
from jattn.pallas_kernels.interpret import gpu_interpret, interpreter_available


def _lines(text):
    return [l for l in text.splitlines() if l.strip()]


def test_info_says_what_each_op_runs_here(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for label in (
        "mha decode",
        "mha extend",
        "mha prefill",
        "mla decode",
        "merge state",
        "kv write (mha)",
        "kv write (mla)",
    ):
        row = next(l for l in out.splitlines() if l.strip().startswith(label))
        assert row.split()[len(label.split())] == "xla", row  # the CPU runs every op on xla
    assert "mosaic / triton kernel: needs a GPU" in out  # the attention ops have both
    assert "triton kernel: needs a GPU" in out.split("merge state")[1].splitlines()[0]
    assert "triton (Triton kernels through jax-triton, Ampere and newer)" in out


def test_op_backend_follows_the_dispatch(monkeypatch):
    assert jattn.ops.op_backend("mha_decode") == ("xla", None)  # auto on the CPU
    assert jattn.ops.op_backend("mha_extend", "xla") == ("xla", None)
    # named on the CPU: the interpreter runs it, outside it the call would raise (op_backend
    # said "mosaic" there too)
    for op in ("mla_decode", "mha_prefill"):
        name, why = jattn.ops.op_backend(op, "mosaic")
        assert name == "xla" and "no GPU" in why, (op, why)
        if interpreter_available():
            with gpu_interpret():
                assert jattn.ops.op_backend(op, "mosaic") == ("mosaic", None)
    monkeypatch.setattr(jattn.dispatch, "device_kind", lambda: "hopper")
    assert jattn.ops.op_backend("mha_decode") == ("mosaic", None)
    monkeypatch.setattr(jattn.dispatch, "device_kind", lambda: "ampere")
    name, why = jattn.ops.op_backend("mha_decode", "mosaic")
    assert name == "xla" and "Hopper" in why
    with pytest.raises(ValueError, match="must be one of"):
        jattn.ops.op_backend("mha_decod")


def test_named_backend_without_a_kernel_for_the_op_is_refused():
    """A backend asked for by name that has no kernel for an op (``mosaic`` for the KV
    writes) is never replaced by XLA silently: ``op_backend`` reports why, and the op
    raises NotImplementedError naming it; auto still runs such ops on XLA."""
    import jax.numpy as jnp

    assert jattn.ops.op_backend("set_kv_buffer", "mosaic") == (
        "xla",
        "set_kv_buffer: no mosaic kernel is built for this op yet",
    )
    kc = jnp.zeros((4, 4, 2, 8), jnp.float32)
    loc = jnp.array([4, 5], jnp.int32)
    kv = jnp.ones((2, 2, 8), jnp.float32)
    with pytest.raises(NotImplementedError, match="set_kv_buffer: no mosaic kernel is built"):
        jattn.set_kv_buffer(kc, kc, loc, kv, kv, backend="mosaic")
    jattn.set_kv_buffer(kc, kc, loc, kv, kv)  # auto: XLA


def test_device_kind_reads_the_compute_capability(monkeypatch):
    """``dispatch.device_kind``: sm90 and later are Hopper (the Mosaic kernels' target,
    first in auto's order), sm80-89 Ampere (Triton only), older GPUs neither; the cached
    function is called through ``__wrapped__`` with JAX's backend and device faked."""
    import types

    import jax

    kind = jattn.dispatch.device_kind.__wrapped__
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for cc, want in (("9.0", "hopper"), ("10.0", "hopper"), ("8.9", "ampere"), ("8.0", "ampere"), ("7.5", "gpu")):
        monkeypatch.setattr(jax, "devices", lambda cc=cc: [types.SimpleNamespace(compute_capability=cc)])
        assert kind() == want, (cc, kind())


def test_auto_follows_the_measured_order(monkeypatch):
    """Auto's table: on Hopper Mosaic for MHA and MLA decode (an FP8 latent cache on
    Triton, where jax-triton runs), XLA for the KV write and the merge; Ampere has the
    Triton kernels only."""
    from jattn.pallas_kernels import triton_glue

    monkeypatch.setattr(triton_glue, "available", lambda: True)
    monkeypatch.setattr(jattn.dispatch, "device_kind", lambda: "hopper")
    got = {op: jattn.ops.op_backend(op)[0] for op in jattn.ops.OPS}
    assert got == {
        "mha_decode": "mosaic",
        "mha_extend": "mosaic",
        "mha_prefill": "mosaic",
        "mla_decode": "mosaic",
        "attn_merge_state": "xla",
        "set_kv_buffer": "xla",
        "set_mla_kv_buffer": "xla",
    }
    monkeypatch.setattr(jattn.dispatch, "device_kind", lambda: "ampere")
    got = {op: jattn.ops.op_backend(op)[0] for op in jattn.ops.OPS}
    assert [op for op, b in got.items() if b == "triton"] == ["mha_decode", "mha_extend", "mha_prefill", "mla_decode"]
    monkeypatch.setattr(triton_glue, "available", lambda: False)  # no jax-triton: XLA
    assert jattn.ops.op_backend("mha_decode") == ("xla", None)


def test_named_backend_is_a_preference(monkeypatch):
    """--backend NAME: the ops NAME serves here run on it, the others on xla, said in one line."""
    assert jattn.demo.backend_choices() == ("auto", "mosaic", "triton", "xla")
    assert jattn.demo.choose_backend("auto") == (None, None)
    assert jattn.demo.choose_backend("xla") == ("xla", None)
    backend, note = jattn.demo.choose_backend("mosaic")  # on this CPU
    assert backend is None and "every op runs on xla" in note and "\n" not in note
    for target in (jattn.dispatch, jattn.demo):
        monkeypatch.setattr(target, "device_kind", lambda: "hopper")
    # every MHA op has a mosaic kernel: the loop runs on mosaic, nothing to announce
    assert jattn.demo.choose_backend("mosaic", jattn.dispatch.MHA_OPS) == ("mosaic", None)
    # and so has every MLA op (absorbed decode, the 192/128 prefill)
    assert jattn.demo.choose_backend("mosaic", jattn.dispatch.MLA_OPS) == ("mosaic", None)
    for target in (jattn.dispatch, jattn.demo):
        monkeypatch.setattr(target, "device_kind", lambda: "ampere")
    backend, note = jattn.demo.choose_backend("mosaic", jattn.dispatch.MHA_OPS)
    assert backend is None and note == (
        "--backend mosaic: mha_decode, mha_extend, mha_prefill on xla (the mosaic backend needs a Hopper (sm90+) GPU)"
    )
    backend, note = jattn.demo.choose_backend("mosaic", jattn.dispatch.MLA_OPS)
    assert backend is None and note.startswith("--backend mosaic: mla_decode, mha_prefill on xla (")


def test_demo_help_mentions_synthetic(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0 and "--synthetic" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["demo", "--synthetic", "--help"])
    assert e.value.code == 0 and "--requests" in capsys.readouterr().out


def test_cli_refuses_an_unknown_backend_and_bench(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--backend", "pallas"])
    assert e.value.code == 2 and "invalid choice: 'pallas'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "nope"])
    assert e.value.code == 2 and "decode, prefill, mla, cascade, kvwrite, bridge, serving" in capsys.readouterr().err
    assert main(["bench", "--help"]) == 0
    assert "{decode,prefill,mla,cascade,kvwrite,bridge,serving}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "option, message",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be an integer >= 1"),
        (["--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0 (0 is greedy)"),
        (["--temperature", "nan"], "--temperature nan: must be a finite number >= 0"),
        (["--temperature", "1e39"], "--temperature 1e+39: must be a finite number >= 0 (0 is greedy) and <= 3.403e+38"),
        (["--top-p", "2"], "--top-p 2.0: must be a number in (0, 1]"),
        (["--top-k", "-1"], "--top-k -1: must be an integer >= 0 (0: all tokens)"),
        (["--min-p", "nan"], "--min-p nan: must be a number in [0, 1]"),
        (["--page-size", "0"], "--page-size 0: must be an integer >= 1"),
        (["--max-context", "1"], "--max-context 1: must be an integer >= 2"),
    ],
)
@pytest.mark.parametrize("cmd", ["demo", "generate"])
def test_generate_refuses_bad_options_before_loading(cmd, option, message, monkeypatch, capsys):
    """Out-of-range options stop with the option's name and rule (status 2) before any
    model loads; a ZeroDivisionError or a later per-request error with status 0 before."""
    import jattn.models.demo as models_demo

    monkeypatch.setattr(models_demo, "load_model", lambda args: pytest.fail("the model must not load"))
    with pytest.raises(SystemExit) as e:
        main([cmd, "--prompt", "hi", *option])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_generate_names_the_model_source_it_cannot_load(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    for args, source in (
        (["--gguf", str(bad)], f"--gguf {bad}"),
        (["--gguf", str(tmp_path / "missing.gguf")], f"--gguf {tmp_path / 'missing.gguf'}"),
        (["--hf", str(tmp_path)], f"--hf {tmp_path}"),  # no config.json
    ):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--prompt", "hi", *args])
        assert str(e.value.code).startswith(f"error: could not load the model ({source}): ")
    for args, message in (
        (["--gguf", str(bad), "--hf", str(tmp_path)], "argument --hf: not allowed with argument --gguf"),
        (["--model", "tiny", "--gguf", str(bad)], "--model tiny and --gguf: give one of them"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["generate", "--prompt", "hi", *args])
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, message",
    [
        (["--requests", "0"], "--requests 0: must be an integer from 1"),
        (["--requests", "-2"], "--requests -2: must be an integer from 1"),
        (
            ["--requests", "257"],
            "--requests 257: must be an integer from 1 (a check over no requests checks nothing) to 256",
        ),
        (["--seed", "-1"], "--seed -1: must be an integer >= 0"),
        (["--window", "-5"], "--window -5: must be an integer >= -1"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--requests=4", "--synth"], "unrecognized arguments: --synth"),  # no abbreviations
    ],
)
def test_synthetic_demo_refuses_bad_options(option, message, monkeypatch, capsys):
    monkeypatch.setattr(jattn.demo, "run", lambda **kw: pytest.fail("the loop must not run"))
    with pytest.raises(SystemExit) as e:
        main(["demo", "--synthetic", *option])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_synthetic_demo_with_mosaic_on_cpu(capsys):
    assert main(["demo", "--synthetic", "--backend", "mosaic", "--requests", "2"]) == 0
    cap = capsys.readouterr()
    assert (
        _lines(cap.err)
        == [
            "--backend mosaic: its kernels need a GPU (on this CPU they run only under the interpreter, "
            "for tests); every op runs on xla"
        ]
        and "PASSED" in cap.out
        and "kernel backend: auto: every op on xla here (--backend mosaic asked for: see the line above)" in cap.out
    )


def test_generate_with_mosaic_backend_runs_on_the_fallback(monkeypatch, capsys):
    """The 55-line traceback of old (prefill has no mosaic kernel) is one line now, and the
    engine gets a backend every op can run on (model and engine are stubbed: no compiles)."""
    import jattn.models.demo as models_demo

    seen = []

    class Engine:
        metrics = types.SimpleNamespace(
            generated_tokens=0, tokens_per_s=0.0, decode_tokens_per_s=0.0, median_decode_step_ms=0.0, compilations=0
        )

        def __init__(self, model, config):
            seen.append((config.kernel_backend, config.max_context))

        def generate(self, ids, params):
            return []

    monkeypatch.setattr(models_demo, "Engine", Engine)
    monkeypatch.setattr(models_demo, "load_model", lambda args: (object(), models_demo.ByteTokenizer(), "stub"))
    assert main(["generate", "--prompt", "hi", "--backend", "mosaic"]) == 0
    cap = capsys.readouterr()
    assert seen == [(None, 1024)]  # auto: xla everywhere on the CPU
    assert "Traceback" not in cap.err
    assert "step time only: n/a" in cap.out  # no step timed: no 0.0 tokens/s figures
    assert [l for l in cap.err.splitlines() if l.startswith("--backend")] == [
        "--backend mosaic: its kernels need a GPU (on this CPU they run only under the interpreter, "
        "for tests); every op runs on xla"
    ]
    assert "backend: auto (mha_decode xla, mha_extend xla, mha_prefill xla)" in cap.out
    # --max-context's default stops at a shorter model's max_position_embeddings (the tiny
    # model's 512 warned on every run), a value given is kept
    short = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=512))
    monkeypatch.setattr(models_demo, "load_model", lambda args: (short, models_demo.ByteTokenizer(), "stub"))
    assert (
        main(["generate", "--prompt", "hi"]) == 0 and main(["generate", "--prompt", "hi", "--max-context", "600"]) == 0
    )
    assert seen[1:] == [(None, 512), (None, 600)]


def test_bench_serving_refuses_on_cpu(capsys):
    assert main(["bench", "serving"]) == 1
    assert _lines(capsys.readouterr().out) == [
        "bench serving needs a GPU (jax default backend is cpu); nothing to do (--cpu runs it anyway)"
    ]


def test_bench_serving_options_have_help(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serving", "--help"])
    out = capsys.readouterr().out
    opts = out.split("options:", 1)[1]
    # every option line is followed (same line or next) by its help text
    for line in [l for l in opts.splitlines() if l.lstrip().startswith("--")]:
        text = line.strip().split("  ", 1)
        assert len(text) == 2 or opts.splitlines()[opts.splitlines().index(line) + 1].startswith(" " * 10), line


def test_bench_serving_long_context_rows_on_cpu(tmp_path, capsys):
    """``bench serving --long-context`` at tiny sizes: one row per prompt length, batch and
    backend (auto beside xla), prefill tok/s and TTFT reported, nothing recompiled in the
    timed runs, the rows of one prompt length sharing their extend program; xla rows over
    ``--xla-max-tokens`` are skipped with the reason; the GPU-time estimate comes first."""
    import json

    out = tmp_path / "rows.json"
    argv = ["bench", "serving", "--cpu", "--models", "tiny", "--long-context", "--prompt-lens", "64,128"]
    argv += ["--batch", "2,4", "--prefill-tokens", "128", "--xla-max-tokens", "256", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.index("estimate:") < text.index("tiny Llama: built")
    assert "prefill tokens (warm-ups included)" in text
    assert "bs=4 prompt=128 [backend xla]: skipped: xla: 4 x 128 = 512 prompt tokens > --xla-max-tokens 256" in text
    rows = json.loads(out.read_text())
    got = [(r["prompt_len"], r["batch"], r["backend"]) for r in rows]
    assert got == [
        (p, b, be) for p in (64, 128) for b in (2, 4) for be in ("auto", "xla") if (p, b, be) != (128, 4, "xla")
    ]
    for r in rows:
        assert r["gen_len"] == 16 and r["recompiles_in_timed_run"] == 0, r
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["ttft_ms_median"] > 0
    # batch 4 reuses the extend program of batch 2 (same pool and buckets): only its decode compiles
    assert [r["warmup_programs"] for r in rows if r["batch"] == 4] == [1, 1, 1]
    assert "| tiny Llama | 2 | 128 |" in text and "auto prefill tok/s | xla prefill tok/s" in text


def test_bench_serving_parallel_sample_rows_on_cpu(tmp_path, capsys):
    """``bench serving --samples 2 --cascade auto,off --overlap on --fuse-projections on``:
    the batch is prompts of two samples each, their prompt pages shared; decode steps are
    cascade plans only with cascade on; the engine runs with overlap scheduling on a fused
    copy of the model."""
    import json

    out = tmp_path / "rows.json"
    argv = ["bench", "serving", "--cpu", "--models", "tiny", "--batch", "4", "--samples", "2", "--cascade", "auto,off"]
    argv += ["--overlap", "on", "--fuse-projections", "on"]
    assert main(argv + ["--prompt-len", "40", "--gen-len", "6", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["samples"] for r in rows] == [2, 2] and all(r["recompiles_in_timed_run"] == 0 for r in rows)
    assert rows[0]["cascade_steps"] > 0 and rows[1]["cascade_steps"] == 0
    assert all(r["shared_prompt_tokens"] == 2 * 32 for r in rows)  # 2 prompts, 2 whole pages of 16 each
    assert all(r["overlap"] is True and r["fused_projections"] is True for r in rows)
    assert "[2 samples, cascade off] [overlap on] [fused on]" in capsys.readouterr().out
    capsys.readouterr()
    for bad in (["--cascade", "sometimes"], ["--overlap", "maybe"], ["--fuse-projections", "yes"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", "serving", "--cpu", "--models", "tiny"] + bad)
        assert e.value.code == 2 and bad[0] in capsys.readouterr().err  # argparse names the option


def test_bench_serving_gen_lens_rows_on_cpu(tmp_path, capsys):
    """``bench serving --gen-len 3,7``: a row per generated length (tagged), each
    generating that many tokens; a bad list is refused."""
    import json

    out = tmp_path / "rows.json"
    argv = ["bench", "serving", "--cpu", "--models", "tiny", "--batch", "2", "--prompt-len", "24"]
    assert main(argv + ["--gen-len", "3,7", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["gen_len"] for r in rows] == [3, 7] and all(r["recompiles_in_timed_run"] == 0 for r in rows)
    text = capsys.readouterr().out
    assert "prompt=24 [gen 3]" in text and "prompt=24 [gen 7]" in text
    with pytest.raises(SystemExit) as e:
        main(argv + ["--gen-len", "0"])
    assert e.value.code == 2 and "--gen-len" in capsys.readouterr().err
    # one generated token: no decode step, so no overall / decode ratio ("-", not a ZeroDivisionError)
    assert main(argv + ["--gen-len", "1"]) == 0
    table = capsys.readouterr().out.split("| --- |", 1)[1]
    assert "| - |" in table


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--batch", "x"], "--batch takes positive integers, comma-separated (got 'x')"),
        (["--batch", "-4"], "--batch takes positive integers, comma-separated (got '-4')"),
        (["--batch", "0"], "--batch takes positive integers"),
        (["--prompt-len", "0"], "--prompt-len takes positive integers, comma-separated (got '0')"),
        (["--prompt-lens", "8,x"], "--prompt-lens takes positive integers"),
        (["--page-size", "0"], "--page-size takes a positive integer (got 0)"),
        (["--prefill-tokens", "-1"], "--prefill-tokens takes a positive integer (got -1)"),
        (["--xla-max-tokens", "-1"], "--xla-max-tokens takes an integer >= 0 (got -1)"),
        (["--dtype", "foo"], "argument --dtype: invalid choice: 'foo'"),
    ],
)
def test_bench_serving_refuses_bad_values_by_option(bad, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serving", "--cpu", "--models", "tiny", *bad])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["decode", "prefill", "mla", "cascade", "kvwrite"])
def test_gpu_benches_exit_1_with_one_line_on_a_cpu(name, capsys):
    assert main(["bench", name]) == 1
    assert _lines(capsys.readouterr().out) == [f"bench {name} needs a GPU (jax default backend is cpu); nothing to do"]


def test_info_takes_no_options(capsys):
    assert main(["info", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m jattn info")
    with pytest.raises(SystemExit) as e:
        main(["info", "--bogus"])
    assert e.value.code == 2 and "info takes no options (got --bogus)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "--synth"])  # an abbreviation of no option: refused, not run as the model demo
    assert e.value.code == 2 and "unrecognized arguments: --synth" in capsys.readouterr().err


def test_bench_serving_estimate_of_the_long_context_rows():
    """The printed budget of the GPU run: Llama-3-8B, 4k and 16k prompts at batch 8 and 32,
    both backends except xla at 32 x 16k."""
    from jattn.bench import serving

    cfg = serving._config("llama3-8b")
    runs = [(bs, p, be) for p in (4096, 16384) for bs in (8, 32) for be in ("auto", "xla")]
    runs = [r for r in runs if r != (32, 16384, "xla")]
    est = serving.estimate(cfg, runs, 16, 16, 16384, light_warmup=True)
    # timed prompts plus one extend step's worth of warm-up prompts per row
    timed = 2 * (8 + 32) * 4096 + (8 + 32) * 16384 + 8 * 16384
    warm = 4 * 4096 * 4 + 16384 * 3
    assert est.prefill_tokens == timed + warm
    assert 10e15 < est.gemm_flops < 25e15 and est.programs == 11 and 100 < est.seconds < 1200


def test_without_torch_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    assert main(["bench", "bridge"]) == 1
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and "pip install torch --index-url https://download.pytorch.org/whl/cpu" in err[0]
    monkeypatch.setattr(sys, "argv", ["torch_bridge.py"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(
            str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "torch_bridge.py"), run_name="__main__"
        )
    assert "\n" not in str(e.value.code) and 'pip install -e ".[torch]"' in str(e.value.code)


def test_bench_bridge_host_part_runs_on_cpu(capsys):
    """The CPU part of ``bench bridge`` (host time of the torch bridge) still runs against the
    bridge as it is (it reads the bridge's call cache for one row)."""
    pytest.importorskip("torch")
    assert main(["bench", "bridge", "--reps", "3"]) == 0
    out = capsys.readouterr().out
    assert "host: forward_decode B1" in out and "host: bare jitted call on cached arguments" in out
    for bad in (["--reps", "0"], ["--host-seqlen", "0"], ["--calls", "-1"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", "bridge", *bad])
        assert e.value.code == 2 and bad[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    "script, argv",
    [("flax_generate.py", ["--tiny", "--max-new-tokens", "3"]), ("jit_serving_step.py", ["--requests", "3"])],
)
def test_jax_examples_run(script, argv, monkeypatch, capsys):
    """The examples run as written (they plan with the pool's num_pages, as the backends require)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / script
    monkeypatch.setattr(sys, "argv", [script, *argv])
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        assert e.code in (None, 0), e.code
    out = capsys.readouterr().out
    assert out.strip() and " 0.00 ms" not in out  # an overlapped step's time is not known at launch


def test_flax_generate_example_refuses_no_new_tokens(monkeypatch, capsys):
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "flax_generate.py"
    monkeypatch.setattr(sys, "argv", ["flax_generate.py", "--tiny", "--max-new-tokens", "0"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(path), run_name="__main__")
    assert e.value.code == 2 and "--max-new-tokens=0 must be an integer >= 1" in capsys.readouterr().err


def test_model_demo_notices_and_a_pool_too_big_for_memory(monkeypatch, capsys):
    """``--model tiny`` says it is the tiny random model (not that SmolLM2 is missing); a KV
    pool that does not fit names --max-context instead of a RESOURCE_EXHAUSTED traceback."""
    import jattn.models.demo as models_demo

    args = types.SimpleNamespace(dtype="float32", hf=None, gguf=None, model="tiny", seed=0)
    models_demo.load_model(args)
    err = capsys.readouterr().err
    assert "tiny RANDOM Llama" in err and "not installed" not in err

    class Engine:
        def __init__(self, model, config):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 128000002048 bytes.")

    monkeypatch.setattr(models_demo, "Engine", Engine)
    monkeypatch.setattr(models_demo, "load_model", lambda args: (object(), models_demo.ByteTokenizer(), "stub"))
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", "--max-context", "1000000000"])
    assert "--max-context 1000000000 for each of 1 prompts) does not fit in memory" in str(e.value.code)


@pytest.mark.slow
def test_synthetic_demo_sizes_its_pool_and_buckets_from_the_requests(capsys):
    """20 requests: more than the 16-row bucket and the 96-page pool of old held."""
    assert main(["demo", "--synthetic", "--requests", "20"]) == 0
    assert "PASSED" in capsys.readouterr().out
