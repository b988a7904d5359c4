"""The memory-plan CLI: JSON report consistent with its components, exit status = fit, refusals."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_jax.models import Qwen2Config
from bapo_jax.sharding import hlo_buffers, memory_plan, plan
from bapo_jax.sharding import mesh as mesh_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 300
REQUIRED = (
    "model",
    "mesh",
    "devices",
    "seq_len",
    "micro_batch",
    "peak_bytes_per_device",
    "device_memory_bytes",
    "fits",
    "argument_bytes",
    "output_bytes",
    "alias_bytes",
    "temp_bytes",
    "compile_seconds",
)


def run_cli(*args: str, cache_dir: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh process; runs share a JAX compilation cache (same program, compiled
    once: the memory analysis of a cached executable is the same)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return subprocess.run(
        [sys.executable, "-m", "bapo_jax.sharding.plan", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


# tiny (4 q / 2 kv heads) on data 1 x fsdp 2 x tensor 2: a 4-device simulated mesh.
TINY = ("--model", "tiny", "--mesh", "data=1,fsdp=2,tensor=2", "--seq-len", "64")
TINY_ARGS = (*TINY, "--micro-batch", "2", "--num-micro-batches", "2", "--json")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="module")
def tiny_report(cache_dir) -> dict:
    r = run_cli(*TINY_ARGS, cache_dir=cache_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_json_report_fields_and_consistency(tiny_report):
    out = tiny_report
    for key in REQUIRED:
        assert key in out, key
    assert out["model"] == "tiny" and out["devices"] == 4 and out["seq_len"] == 64
    assert out["mesh_shape"] == {"data": 1, "fsdp": 2, "tensor": 2}
    assert out["micro_batch"] == 2 and out["num_micro_batches"] == 2
    # B = micro-batch x (data x fsdp) x micro-batches.
    assert out["global_batch"] == 2 * 2 * 2
    assert out["peak_bytes_per_device"] == (
        out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    )
    assert out["device_memory_bytes"] == 80 * 10**9
    assert out["fits"] is (out["peak_bytes_per_device"] <= 0.85 * out["device_memory_bytes"])
    assert out["fits"] is True
    assert out["compile_seconds"] > 0 and out["temp_bytes"] > 0
    assert "estimate" in out["note"]
    # XLA's arguments are exactly the sharded state + batch counted from the shardings, and the
    # donated state is aliased whole by the new state (outputs = state + the metrics).
    assert out["argument_bytes"] == out["state_bytes"] + out["batch_bytes"]
    assert out["alias_bytes"] == out["state_bytes"] > 0
    assert out["state_bytes"] < out["output_bytes"] < out["state_bytes"] + 4096
    # Per-device state: fp32 params + two Adam moments, each sharded over at most 4 devices,
    # so between a quarter and all of 3 x 4 bytes per parameter.
    total = 3 * 4 * Qwen2Config.preset("tiny").num_params()
    assert total / 4 <= out["state_bytes"] <= total
    # The [B, T] batch: 5 int32/fp32 arrays, B split over fsdp 2.
    assert out["batch_bytes"] == 5 * 4 * (out["global_batch"] // 2) * 64


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_packed_plan_compiles_the_trainers_step_and_states_its_token_budget(cache_dir):
    """--packed: the batch carries segment ids and positions (7 [B, T] arrays); the token
    budget is one micro-batch over all devices; --scored-length: the head on 32 tokens a row."""
    r = run_cli(*TINY_ARGS, "--packed", "--scored-length", "32", cache_dir=cache_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["packed"] is True
    assert out["batch_bytes"] == 7 * 4 * (out["global_batch"] // 2) * 64
    assert out["token_budget"] == 2 * 2 * 64  # micro-batch 2 x (data x fsdp) 2 x 64 tokens
    # Packed rows are masked by their segment ids: jit drops the unused attention_mask.
    mask_bytes = 4 * (out["global_batch"] // 2) * 64
    assert out["argument_bytes"] == out["state_bytes"] + out["batch_bytes"] - mask_bytes


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_exit_status_is_the_fit_at_the_85_percent_line(tiny_report, cache_dir):
    """Device memory just under peak / 0.85: does not fit, exit 1; the text says so."""
    peak = tiny_report["peak_bytes_per_device"]
    memory_gb = math.floor(peak / memory_plan.FIT_FRACTION * 0.999) / 1e9
    r = run_cli(
        *TINY,
        "--micro-batch",
        "2",
        "--num-micro-batches",
        "2",
        f"--device-memory-gb={memory_gb}",
        cache_dir=cache_dir,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert "fits: NO" in r.stdout
    assert "estimate" in r.stdout
    assert f"({peak} bytes)" in r.stdout  # same compile, same peak


def _refused(capsys, *args: str) -> str:
    """Runs the CLI's main in this process on input it must refuse (exit 2 before any re-exec
    or compile); returns stderr."""
    with pytest.raises(SystemExit) as exit_info:
        plan.main(list(args))
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_tensor_axis_must_divide_heads(capsys):
    err = _refused(capsys, "--model", "tiny", "--mesh", "data=1,fsdp=1,tensor=3", "--json")
    assert "MeshConfig.tensor=3 does not divide the model's num_attention_heads=4" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (("--mesh", "nope"), "unknown mesh preset 'nope'"),
        (("--mesh", "fsdp=2,pipeline=2"), "unknown field 'pipeline'"),
        (("--mesh", "cpu1", "--seq-len", "1"), "seq_len must be an int >= 2, got 1"),
        (("--mesh", "cpu1", "--device-memory-gb", "0"), "--device-memory-gb must be > 0"),
        (
            ("--mesh", "cpu1", "--remat", "most"),
            "ModelOptions.remat must be one of ('none', 'full', 'dots_saveable', "
            "'dots_with_no_batch_dims_saveable'), got 'most'",
        ),
        (("--mesh", "cpu1", "--loss", "dpo"), "dpo"),
        (("--mesh", "cpu1", "--micro-batch", "0"), "micro_batch must be an int >= 1, got 0"),
    ],
)
def test_bad_input_is_refused_before_compiling(capsys, args, message):
    assert message in _refused(capsys, "--model", "tiny", *args)


def _fake_plan(threshold: int):
    """plan_at whose peak grows with the length and fits iff seq_len <= threshold."""
    calls = []
    memory = 10**9

    def plan_at(seq_len: int) -> memory_plan.MemoryPlan:
        calls.append(seq_len)
        budget = int(memory_plan.FIT_FRACTION * memory)
        peak = budget - threshold + seq_len  # <= budget exactly when seq_len <= threshold
        return memory_plan.MemoryPlan(
            seq_len=seq_len,
            micro_batch=1,
            num_micro_batches=1,
            global_batch=1,
            argument_bytes=0,
            output_bytes=0,
            alias_bytes=0,
            temp_bytes=peak,
            peak_bytes=peak,
            state_bytes=0,
            batch_bytes=0,
            device_memory_bytes=memory,
            lower_seconds=0.0,
            compile_seconds=0.0,
        )

    return plan_at, calls


@settings(max_examples=60, deadline=None)
@given(
    threshold=st.integers(1, 70_000),
    start=st.integers(1, 40_000),
    limit=st.integers(512, 65_536),
)
def test_find_max_seq_len_is_the_longest_fitting_multiple_of_512(threshold, start, limit):
    plan_at, calls = _fake_plan(threshold)
    found, probes = memory_plan.find_max_seq_len(plan_at, start, limit)
    expected = min(threshold, limit) // 512 * 512
    assert found == expected
    assert [p.seq_len for p in probes] == calls
    assert all(s % 512 == 0 and 512 <= s <= limit for s in calls)
    assert len(set(calls)) == len(calls)  # never compiles a length twice
    assert len(calls) <= 2 * math.ceil(math.log2(limit // 512 + 1)) + 2


def test_find_max_seq_len_rejects_a_limit_below_512():
    with pytest.raises(ValueError, match="limit must be >= 512, got 100"):
        memory_plan.find_max_seq_len(lambda s: None, 1024, 100)


def test_largest_buffers_finds_the_big_intermediate():
    def f(x, y):
        scores = jnp.einsum("td,sd->ts", x, y)  # [T, S]
        return jnp.sum(jnp.tanh(scores) @ y) + jnp.sum(jnp.exp(scores) * 2.0)

    x = jax.ShapeDtypeStruct((256, 16), jnp.float32)
    text = jax.jit(f).lower(x, x).compile().as_text()
    rows = hlo_buffers.largest_buffers(text, 3)
    assert len(rows) <= 3
    assert rows[0].shape == (256, 256) and rows[0].dtype == "f32"
    assert rows[0].bytes == 256 * 256 * 4
    assert [r.bytes for r in rows] == sorted((r.bytes for r in rows), reverse=True)


def test_parse_mesh_preset_and_explicit_shape():
    assert plan.parse_mesh is mesh_lib.parse_mesh  # one parser for the plan and the runs
    assert mesh_lib.parse_mesh("7b").shape == (1, 4, 1)
    assert mesh_lib.parse_mesh("32b").shape == (1, 4, 4)
    cfg = mesh_lib.parse_mesh("data=2,fsdp=8,tensor=2,memory_gb=40")
    assert cfg.shape == (2, 8, 2) and cfg.device_memory_bytes == 40 * 10**9
    assert mesh_lib.parse_mesh(" fsdp=4 ").shape == (1, 4, 1)  # missing axes are 1
    for spec, message in (
        ("fsdp=x", "mesh axis fsdp must be an int, got 'x'"),
        ("fsdp=2,fsdp=4", "fsdp given twice"),
        ("fsdp", "unknown mesh preset 'fsdp'"),
        ("fsdp=2,tensor", "'tensor' is not key=value"),
        ("", "mesh must be a preset name"),
    ):
        with pytest.raises(ValueError, match=message):
            mesh_lib.parse_mesh(spec)


def test_accelerator_sets_the_device_memory_and_an_unknown_one_is_refused(capsys):
    args = plan.build_parser().parse_args(["--model", "tiny", "--mesh", "fsdp=2"])
    for name, gb in (("h100", 80), ("h200", 141), ("a100-40gb", 40), ("tpu-v5e", 16)):
        args.accelerator = name
        _, mesh_config, _, _ = plan._resolve(args)
        assert mesh_config.device_memory_bytes == gb * 10**9
    args.device_memory_gb = 24.0  # the explicit size wins
    assert plan._resolve(args)[1].device_memory_bytes == 24 * 10**9
    err = _refused(capsys, "--model", "tiny", "--mesh", "cpu1", "--accelerator", "v100")
    assert "unknown accelerator 'v100'; known: ['a100-40gb'" in err


def test_cudnn_attention_is_planned_as_blockwise_off_gpu():
    assert memory_plan.planned_attention("cudnn", "cpu") == "blockwise"
    assert memory_plan.planned_attention("cudnn", "gpu") == "cudnn"
    assert memory_plan.planned_attention("plain", "cpu") == "plain"


def test_plan_memory_in_process_refuses_missing_devices():
    with pytest.raises(ValueError, match="mesh needs 16 devices, JAX has 8"):
        memory_plan.plan_memory(Qwen2Config.preset("tiny"), plan.parse_mesh("fsdp=16"), seq_len=16)


def test_a_lora_plan_holds_the_adapters_optimizer_state_only():
    """The plan compiles the LoRA step itself: AdamW's moments of the adapters alone, so its
    state is the base + adapters + 2 x adapters, well below full fine-tuning's 3 x base."""
    from bapo_jax.models import ModelOptions
    from bapo_jax.models.config import LoRAConfig

    config, mesh = Qwen2Config.preset("tiny"), plan.parse_mesh("cpu1")
    full = memory_plan.plan_memory(config, mesh, seq_len=16)
    lora = memory_plan.plan_memory(
        config, mesh, seq_len=16, options=ModelOptions(lora=LoRAConfig(rank=2))
    )
    assert lora.state_bytes < 0.5 * full.state_bytes
    assert lora.peak_bytes < full.peak_bytes
