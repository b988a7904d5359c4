"""Colocation (`engine.colocate`): vLLM servers on the trainer's own GPUs, each GPU's memory
split between them. The launch commands are asserted from `serve.build_command` (no process:
a CUDA-only layout cannot run here); the memory shares, the refusals before compute and the
cost model's colocated layouts are checked directly."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from bapo_jax.models.config import Qwen2Config
from bapo_jax.overrides import apply_overrides
from bapo_jax.rollout import serve
from bapo_jax.run import build, layouts, preflight
from bapo_jax.run import estimate as est
from bapo_jax.run.cli import build_parser, resolve
from bapo_jax.run.config import RunConfigError, validate_run
from bapo_jax.sharding.memory_plan import FIT_FRACTION
from experiments import aime_7b

MODEL = Qwen2Config.preset("r1-distill-qwen-7b")


def _colocated(tmp_path, *extra: str):
    """aime_7b colocated on its node's 8 GPUs, as docs/pod.md writes it on the command line."""
    hf = tmp_path / "R1-Distill-Qwen-7B"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(json.dumps(MODEL.to_hf_dict()))
    args = build_parser("aime_7b").parse_intermixed_args(
        [
            "--model-dir", str(hf), "--vllm-python", sys.executable,
            "--mesh", "data=1,fsdp=8,tensor=1", "--trainer-devices", "8",
            "--server-devices", "0,1;2,3;4,5;6,7", "--gpu-memory-utilization", "0.4",
            "engine.colocate=true", "trainer.offpolicy.staleness=0",
            "trainer.algorithm.micro_batches=128",  # one row per device of an update's 1,024
            *extra,
        ]
    )  # fmt: skip
    return resolve(aime_7b.CONFIG, args)


def test_colocated_servers_launch_on_the_trainers_gpus_with_their_memory_share(tmp_path):
    config = _colocated(tmp_path)
    assert validate_run(config, check_servers=False).num_hidden_layers == 28
    spec = build.server_spec(config)
    for i, gpus in enumerate(("0,1", "2,3", "4,5", "6,7")):
        argv, env = serve.build_command(spec, i)
        assert env["CUDA_VISIBLE_DEVICES"] == gpus
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    # the trainer's JAX pool and plan budget: the plan's 85% less the servers' 40%
    assert preflight.trainer_memory_share(config) == pytest.approx(FIT_FRACTION - 0.4)
    environ: dict[str, str] = {}
    assert preflight.set_memory_fraction(environ, preflight.trainer_memory_share(config)) == (
        pytest.approx(0.45)
    )
    assert environ == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"}
    assert preflight.trainer_memory_share(aime_7b.SEPARATE) == FIT_FRACTION  # not colocated


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"staleness": 1},
            "engine.colocate: colocated servers and trainer take turns on the same GPUs: needs "
            "trainer.offpolicy.staleness=0 and inflight=false, got staleness=1, inflight=False",
        ),
        (
            {"trainer_devices": (0, 1, 2, 3)},
            "engine.server.devices: server 2's GPUs [4, 5] are not the trainer's "
            "(trainer_devices=(0, 1, 2, 3)); colocated servers run on the trainer's GPUs "
            "(engine.colocate)",
        ),
        (
            {"share": 0.9},
            "engine.server.gpu_memory_utilization: 0.9 leaves the colocated trainer nothing of "
            "the memory plan's 0.85 of each GPU; give the servers less (the trainer's step must "
            "fit the rest)",
        ),
    ],
)
def test_colocation_that_cannot_work_is_refused_before_compute(tmp_path, change, message):
    config = _colocated(tmp_path)
    if "staleness" in change:
        config = apply_overrides(config, [f"trainer.offpolicy.staleness={change['staleness']}"])
    if "trainer_devices" in change:
        config = dataclasses.replace(
            config, trainer_devices=change["trainer_devices"], mesh="data=1,fsdp=4,tensor=1"
        )
    if "share" in change:
        server = dataclasses.replace(config.engine.server, gpu_memory_utilization=change["share"])
        config = dataclasses.replace(
            config, engine=dataclasses.replace(config.engine, server=server)
        )
    with pytest.raises(RunConfigError) as error:
        validate_run(config, check_servers=False)
    assert str(error.value) == message


def test_colocation_needs_launched_servers_gpus_and_their_share(tmp_path):
    config = _colocated(tmp_path)
    # the embedded engine runs in the trainer's process: the flag places vLLM servers only
    embedded = dataclasses.replace(config.engine, kind="embedded")
    assert embedded.colocate and not embedded.colocated
    assert preflight.trainer_memory_share(dataclasses.replace(config, engine=embedded)) == (
        FIT_FRACTION
    )
    with pytest.raises(RunConfigError, match=r"^colocate: places launched vLLM servers"):
        dataclasses.replace(
            config.engine, server=dataclasses.replace(config.engine.server, devices=())
        )
    no_share = dataclasses.replace(config.engine.server, gpu_memory_utilization=None)
    with pytest.raises(RunConfigError) as error:
        dataclasses.replace(config.engine, server=no_share)
    assert str(error.value).startswith(
        "server.gpu_memory_utilization: colocated servers need their share"
    )
    # and the separate layout still refuses the trainer's GPUs, naming the colocation switch
    separate = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, colocate=False)
    )
    with pytest.raises(RunConfigError, match=r"colocate them \(engine.colocate=true\)"):
        validate_run(separate, check_servers=False)


def test_the_cost_model_reads_a_colocated_run(tmp_path):
    config = _colocated(tmp_path)
    layout = est.layout_of(config)
    assert layout == est.Layout(8, 4, 2, 0, colocated=True, server_share=0.4)
    assert layout.label == "colocated on 8: 4 x 2 vLLM at 40% of memory"
    assert est.layout_of(config, separate=True).colocated is False
    found = est.estimate(config, MODEL, layout, est.Rates(), "h100")
    p = found.phases
    assert p["sync_write"] > 0 and p["sync_stage"] > 0  # the Orbax sync stays
    turns = sum(p.values())  # generation, then training: nothing hides
    assert found.iteration_s == pytest.approx(turns) and found.hidden_s == pytest.approx(0)
    # the KV room comes from the servers' share of two H100s, less the bf16 weights
    k = est.gpu_kernels(config, MODEL, layout, est.Rates(), "h100")
    kv = est.kv_bytes_per_token(MODEL)
    mean = config.trainer.rollout.max_response_tokens * est.Rates().mean_response_share
    ctx = config.trainer.rollout.max_prompt_tokens + mean / 2
    assert k.kv_capacity == int((2 * 80e9 * 0.4 - 2 * MODEL.num_params()) // (kv * ctx))
    # two GPUs per server: two all-reduces per layer and decoding step
    one = est.gpu_kernels(
        config, MODEL, dataclasses.replace(layout, server_gpus=1), est.Rates(), "h100"
    )
    weights = 2 * MODEL.num_params()
    assert k.decode_step_s - weights / (2 * 3.35e12 * 0.6) == pytest.approx(2 * 28 * 20e-6)
    assert one.decode_step_s == pytest.approx(weights / (3.35e12 * 0.6))


def test_the_ranking_holds_colocated_layouts_within_the_trainers_budget():
    peaks = {4: (51.0e9, ""), 8: (40.0e9, "")}

    def peak(config):
        return peaks.get(config.mesh_config().num_devices, (None, "mesh: does not divide"))

    ranked = layouts.rank(aime_7b.CONFIG, MODEL, est.Rates(), "h100", 1, peak=peak)
    ours = [c for c in ranked if c.layout.colocated and not c.layout.reference]
    assert {(c.layout.server_gpus, c.layout.server_share) for c in ours} == {
        (g, u) for g in (1, 2, 4, 8) for u in layouts.SERVER_SHARES
    }
    # 40 GB fits the trainer's 85% - 30% of 80 GB (44 GB), not 45% (36 GB) or 35% (28 GB)
    assert {c.layout.server_share for c in ours if c.estimate is not None} == {0.3}
    refused = next(c for c in ours if c.layout.server_share == 0.4)
    assert refused.refusal == "trainer peak 40.0 GB > budget 36.0 GB (45%)"
    config = layouts.candidate_config(aime_7b.CONFIG, refused.layout)
    e = config.engine
    assert e.colocate and e.launch_servers == 8 // refused.layout.server_gpus
    assert config.trainer_devices == 8 and e.server.gpu_memory_utilization == 0.4
    assert est.layout_of(config) == refused.layout
    assert sum(c.layout.reference for c in ranked) == 1


def test_aime_32b_colocates_one_server_per_node_given_by_url(tmp_path):
    """The 32B default: four nodes, the trainer on all 32 GPUs, one TP-8 server started by
    hand on each node at a 0.3 share (given by URL: the run cannot see its share, the config
    states it); the trainer's budget is the plan's 85% less 30%."""
    from experiments import aime_32b

    hf = tmp_path / "R1-Distill-Qwen-32B"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(Qwen2Config.preset("r1-distill-qwen-32b").to_hf_dict())
    )
    urls = [a for i in range(4) for a in ("--vllm-url", f"http://node-{i}:8000")]
    args = build_parser("aime_32b").parse_intermixed_args(["--model-dir", str(hf), *urls])
    config = resolve(aime_32b.CONFIG, args)
    e = config.engine
    assert e.colocate and e.launch_servers == 0 and len(e.vllm_urls) == 4
    assert (e.server.tensor_parallel_size, e.server.gpu_memory_utilization) == (8, 0.3)
    assert config.mesh_config().num_devices == 32
    assert validate_run(config, check_servers=False).num_attention_heads == 40
    assert preflight.trainer_memory_share(config) == pytest.approx(FIT_FRACTION - 0.3)
    assert est.layout_of(config) == est.Layout(32, 4, 8, 0, colocated=True, server_share=0.3)
    # a share that leaves the trainer nothing is refused for given servers too
    greedy = apply_overrides(config, ["engine.server.gpu_memory_utilization=0.9"])
    with pytest.raises(RunConfigError, match=r"^engine.server.gpu_memory_utilization: 0.9 leaves"):
        validate_run(greedy, check_servers=False)


def test_a_tensor_parallel_size_vllm_refuses_is_refused_before_compute(tmp_path):
    """TP 8 for the 7B (28 query heads): refused while the config is validated, as vLLM would
    refuse it at start; the ranking lists it as not fitting."""
    config = _colocated(tmp_path, "--server-devices", "0,1,2,3,4,5,6,7")
    with pytest.raises(RunConfigError) as error:
        validate_run(config, check_servers=False)
    assert str(error.value) == (
        "engine.server.tensor_parallel_size must be a size dividing the model's 28 query heads "
        "and dividing (or a multiple of) its 4 KV heads, got 8"
    )
    peak = lambda config: (30.0e9, "")
    ranked = layouts.rank(aime_7b.CONFIG, MODEL, est.Rates(), "h100", 1, peak=peak)
    tp8 = [c for c in ranked if c.layout.server_gpus == 8 and not c.layout.reference]
    assert tp8 and all(c.estimate is None for c in tp8)
    within_budget = [c for c in tp8 if c.layout.server_share in (0.3, 0.4)]  # 30 GB <= 36 GB
    assert within_budget and all(
        c.refusal.startswith("vLLM refuses it: tensor_parallel_size") for c in within_budget
    )
