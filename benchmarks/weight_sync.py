"""Weight sync to a real vLLM server: Orbax (this project's path) vs HF safetensors (baseline),
and both against a plain numpy write/read of the same bytes.

    python -m benchmarks.weight_sync [--model qwen2.5-0.5b|100m] [--reps 5]
                                     [--vllm-python PATH] [--default-malloc] [--no-reserve]

Default model: the Qwen2.5-0.5B shape (``Qwen2Config.preset("qwen2.5-0.5b")``, 494M
parameters, head_dim 64, tied head), random weights, served by one vLLM server in fp32 on
CPU; ``100m``: the ~100M-parameter untied Qwen2 of earlier runs. Every sync is bf16 on disk,
all files in one temp directory (one disk). After the server is up, the worker reserves its
sync memory as a run's does (``OrbaxSync.reserve_memory``: ``--no-reserve`` skips it); then
every round is timed and printed, the first ones included (a run's first syncs are real
syncs). Each round syncs a new version both ways, from the same input (the model's fp32
params) and under the same durability rule (no side fsyncs what it writes: a version is read
once, from the page cache or a shared filesystem, and checked by its hashes):

    orbax:       write_orbax (HF layout + bf16 cast, uncompressed Orbax OCDBT checkpoint, XXH3
                 of its files, manifest) -> load_checkpoint: pause, worker checks the
                 manifest, one pass per file hashing it and copying its arrays out as
                 numpy (sync_read), HF tensors, vLLM in-place reload, tied head
                 re-pointed, version tag, prefix-cache reset, resume (not staged:
                 everything in the update)
    safetensors: save_pretrained (HF safetensors, this benchmark's baseline only: runs sync
                 Orbax) -> pause, vLLM's own ``reload_weights(weights_path)`` over
                 ``/collective_rpc`` (reads and loads the files), the tied head re-pointed as
                 above (vLLM's reload alone leaves it on the previous version), prefix-cache
                 reset, resume

and a plain baseline (no server): each param cast to bf16 on its device, copied to the host
and ``np.save``d into its own file; then ``np.load`` of every file (page cache warm: the files
were just written). Every write replaces a previous one of its own kind: the Orbax write
deletes the oldest version before it writes (``keep=2``), the safetensors and plain writes
delete their previous round's files first, and each side's write time includes that deletion
(the same file-system work on all three: 1 GB deleted, 1 GB written). This process runs with
the trainer's allocator setting (``bapo_jax.malloc``, as ``run.cli`` gives a run; the servers
get it from ``serve``); ``--default-malloc`` keeps glibc's defaults.

Prints every round, then medians: write and load seconds and GB/s of the Orbax path (load =
the worker's wall time from the request to checked host arrays: manifest checks, then one
pass per file that hashes it and copies its arrays out; apart from vLLM) beside the plain
baseline's; the client-side wall time of each update and the worker's vLLM reload on both
paths; the ratio orbax / safetensors of write + update; and the first round's vLLM reload over
the median. A one-token generation after every load checks that the server still serves.
Numbers from this benchmark are in docs/rollout.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import requests

from bapo_jax.malloc import MALLOC_TUNABLES
from bapo_jax.models import Qwen2Config, init_model, save_pretrained
from bapo_jax.rollout import serve
from bapo_jax.rollout import weight_sync as ws
from bapo_jax.rollout.types import SamplingParams
from bapo_jax.rollout.vllm_client import VLLMClientConfig, VLLMEngine
from bapo_jax.run.cli import ensure_environment

# ~100M parameters: 2 x 32000 x 768 embeddings/head + 8 layers of ~6.3M (head_dim 768/12 = 64).
MODELS = {
    "qwen2.5-0.5b": Qwen2Config.preset("qwen2.5-0.5b"),
    "100m": Qwen2Config(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        max_window_layers=8,
    ),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_round(params: dict[str, jax.Array], directory: str) -> tuple[float, float]:
    """The plain baseline from the same input as the Orbax path (the trainer's fp32 params):
    seconds to replace the previous round's files (deleted first, as `write_orbax` deletes the
    version it replaces before it writes: both sides do the same file-system work) by each
    param cast to bf16 on its device, copied to the host and ``np.save``d into its own file (no
    fsync, as the Orbax write); then to ``np.load`` all of them back (the files are in the page
    cache: they were just written)."""
    files = {k: os.path.join(directory, k.replace("/", ".") + ".npy") for k in params}
    t0 = time.perf_counter()
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    for k, a in params.items():
        with open(files[k], "wb") as f:
            np.save(f, np.asarray(a.astype(jnp.bfloat16)))
    t1 = time.perf_counter()
    back = {k: np.load(f) for k, f in files.items()}
    t2 = time.perf_counter()
    if any(back[k].shape != a.shape for k, a in params.items()):
        raise RuntimeError("plain baseline: np.load returned other shapes than were saved")
    return t1 - t0, t2 - t1


def safetensors_round(url: str, model, directory: str) -> tuple[float, float, float]:
    """The baseline sync: ``save_pretrained`` (bf16) into ``directory``, then pause the server,
    vLLM's own in-place ``reload_weights`` of the directory, the tied head re-pointed at the
    new embedding (the worker's ``_bapo_retie_head``, as the Orbax path does: vLLM's reload
    alone leaves a tied head on the previous version, measured), prefix-cache reset, resume.
    Returns (write, update, reload) seconds, all measured here (the reload: its RPCs; the
    write: deleting the previous round's files, as every side does, then saving)."""
    t0 = time.perf_counter()
    shutil.rmtree(directory, ignore_errors=True)
    save_pretrained(model, directory, dtype=jnp.bfloat16)
    t1 = time.perf_counter()

    def post(path: str, **kw) -> requests.Response:
        r = requests.post(url + path, timeout=900, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r

    post("/pause", params={"mode": "wait"})
    t2 = time.perf_counter()
    body = {"method": "reload_weights", "kwargs": {"weights_path": directory}}
    post("/collective_rpc", data=json.dumps(body), headers={"Content-Type": "application/json"})
    if model.config.tie_word_embeddings:  # else the head keeps the previous version's weights
        post("/collective_rpc", json={"method": "_bapo_retie_head"})
    t3 = time.perf_counter()
    post("/reset_prefix_cache")
    post("/resume")
    return t1 - t0, time.perf_counter() - t1, t3 - t2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    ap.add_argument("--reps", type=int, default=5, help="rounds, all timed and reported")
    ap.add_argument(
        "--vllm-python", default=None, help="default $BAPO_VLLM_PYTHON, else .venv-vllm"
    )
    ap.add_argument("--workdir", default=None, help="default: a temp dir (removed at the end)")
    ap.add_argument(
        "--default-malloc", action="store_true", help="keep glibc's malloc defaults (see doc)"
    )
    ap.add_argument(
        "--no-reserve", action="store_true", help="skip the workers' memory reservation"
    )
    args = ap.parse_args()
    if args.reps < 1:
        raise SystemExit(f"--reps must be >= 1, got {args.reps}")
    if not args.default_malloc:  # the trainer's allocator, as a run has it (bapo_jax.malloc)
        ensure_environment(1, "benchmarks.weight_sync", sys.argv[1:])
    config = MODELS[args.model]

    root = args.workdir or tempfile.mkdtemp(prefix="bapo-sync-bench-")
    from flax import nnx

    model = init_model(config, seed=0)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    flat = {k: jnp.asarray(v) for k, v in ws.flatten_params(params).items()}
    nbytes = ws.checkpoint_bytes(config, jnp.bfloat16)
    print(
        f"model: {args.model}, {config.num_params() / 1e6:.1f}M parameters, head_dim "
        f"{config.head_dim}, tied head {config.tie_word_embeddings}; synced as bf16: "
        f"{nbytes / 1e9:.3f} GB; {os.cpu_count()} CPUs; files under {root}; malloc: "
        + ("glibc defaults" if args.default_malloc else f"GLIBC_TUNABLES={MALLOC_TUNABLES}")
        + "; no write fsyncs",
        flush=True,
    )
    hf0 = os.path.join(root, "hf0")
    save_pretrained(model, hf0, dtype=jnp.bfloat16)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    settings = serve.ServerSettings(
        python=args.vllm_python, port=port, dtype="float32", enforce_eager=True
    )
    sync = os.path.join(root, "sync")
    spec = serve.ServerSpec(hf0, 256, settings, sync_root=sync)
    procs = serve.launch(spec, 1, log_dir=os.path.join(root, "logs"))
    rounds: list[dict[str, float]] = []
    try:
        serve.wait_healthy([url], procs, timeout_s=900)
        eng = VLLMEngine(
            VLLMClientConfig((url,), model=hf0, rpc_timeout_s=900, request_timeout_s=300),
            expected_config=config,
        )
        if not args.no_reserve:  # what a run does before its first sync (run.build)
            reply = eng.reserve_sync_memory(nbytes, nbytes // 2)[url]
            said = reply.get("why") or reply.get("error")
            print(
                "worker memory reservation (once, before the first sync): "
                + (said or f"{reply['reserved_bytes'] / 1e9:.2f} GB in {reply['seconds']:.2f} s"),
                flush=True,
            )
        probe = SamplingParams(max_tokens=1, temperature=1.0)
        for version in range(1, args.reps + 1):  # every round timed: a run's first syncs count
            plain_w, plain_l = plain_round(flat, os.path.join(root, "plain"))
            split = {"cast_s": 0.0, "save_s": 0.0, "checksum_s": 0.0}
            t0 = time.perf_counter()
            path = ws.write_orbax(
                params, sync, version=version, step=version, config=config, keep=2, timings=split
            )
            t1 = time.perf_counter()
            reply = eng.load_checkpoint(version, path)[url]
            t2 = time.perf_counter()
            eng.generate([[5, 6, 7]], 1, probe, seed=0)
            st_write, st_update, st_reload = safetensors_round(
                url, model, os.path.join(root, "safetensors")
            )
            eng.generate([[5, 6, 7]], 1, probe, seed=0)
            rounds.append(
                {
                    "plain_write": plain_w,
                    "plain_load": plain_l,
                    "write": t1 - t0,
                    "cast": split["cast_s"],
                    "save": split["save_s"],
                    "checksum": split["checksum_s"],
                    "update": t2 - t1,
                    "load_w": reply["restore_s"],
                    "verify_w": reply["verify_s"],
                    "read_w": reply["read_s"],
                    "reload_w": reply["load_s"],
                    "st_write": st_write,
                    "st_update": st_update,
                    "st_reload_w": st_reload,
                }
            )
            print_round(version, rounds[-1])
        eng.close()
    finally:
        serve.stop(procs)
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    report(rounds, nbytes)


def print_round(index: int, r: dict[str, float]) -> None:
    print(
        f"round {index}: orbax write {r['write']:.2f} load {r['load_w']:.2f} vLLM reload "
        f"{r['reload_w']:.2f} update {r['update']:.2f} | safetensors write {r['st_write']:.2f} "
        f"update {r['st_update']:.2f} (vLLM reload {r['st_reload_w']:.2f}) | plain write "
        f"{r['plain_write']:.2f} load {r['plain_load']:.2f} s",
        flush=True,
    )


def report(rounds: list[dict[str, float]], nbytes: int) -> None:
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}

    def gbs(seconds: float) -> float:
        return nbytes / 1e9 / seconds

    print(f"\nmedian of {len(rounds)} rounds (all timed), {nbytes / 1e9:.3f} GB of bf16 per sync")
    print("  bandwidth                        seconds    GB/s   vs plain")
    rows = [
        ("plain cast + np.save", med["plain_write"], None),
        ("plain np.load (warm cache)", med["plain_load"], None),
        ("orbax write (write_orbax)", med["write"], med["plain_write"]),
        ("  of which HF layout + bf16 cast", med["cast"], None),
        ("  of which Orbax save", med["save"], None),
        ("  of which file hashes", med["checksum"], None),
        ("orbax load (check + restore)", med["load_w"], med["plain_load"]),
        ("  of which read pass", med["read_w"], None),
        ("  of which hashing (in the pass)", med["verify_w"], None),
    ]
    for name, seconds, plain_s in rows:
        vs = f"{plain_s / seconds:8.2f}x" if plain_s else ""
        print(f"  {name:<30} {seconds:9.2f} {gbs(seconds):7.2f} {vs}")
    print("  sync (seconds)                   write  update   total  | worker reload")
    for name, prefix in (("orbax", ""), ("safetensors", "st_")):
        write, update = med[prefix + "write"], med[prefix + "update"]
        print(
            f"  {name:<30} {write:7.2f} {update:7.2f} {write + update:7.2f}  | "
            f"{med[prefix + 'reload_w']:7.2f}"
            + ("  (reads the files too)" if prefix else "  (arrays already in memory)")
        )
    ratio = (med["write"] + med["update"]) / (med["st_write"] + med["st_update"])
    first = rounds[0]["reload_w"] / med["reload_w"]
    print(
        f"ratio orbax / safetensors: write {med['write'] / med['st_write']:.2f}, update "
        f"{med['update'] / med['st_update']:.2f}, write + update {ratio:.2f}; first round's "
        f"vLLM reload / median: {first:.2f} (orbax), "
        f"{rounds[0]['st_reload_w'] / med['st_reload_w']:.2f} (safetensors)"
    )


if __name__ == "__main__":
    main()
