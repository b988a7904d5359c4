"""Weight sync to a real vLLM server: Orbax (this project's path) vs HF safetensors (baseline),
and both against a plain numpy write/read of the same bytes.

    python -m benchmarks.weight_sync [--model qwen2.5-0.5b|100m] [--reps 3] [--warmup 3]
                                     [--vllm-python PATH] [--default-malloc]

Default model: the Qwen2.5-0.5B shape (``Qwen2Config.preset("qwen2.5-0.5b")``, 494M
parameters, head_dim 64, tied head), random weights, served by one vLLM server in fp32 on
CPU; ``100m``: the ~100M-parameter untied Qwen2 of earlier runs. Every sync is bf16 on disk,
all files in one temp directory (one disk). Each repetition syncs a new version both ways:

    orbax:       write_orbax (HF layout + bf16 cast, Orbax OCDBT checkpoint without fsync,
                 XXH3 of its files, manifest) -> load_checkpoint: pause, worker checks the
                 manifest, file hashes beside the Orbax restore as numpy, HF tensors, vLLM
                 in-place reload, version tag, prefix-cache reset, resume (not staged:
                 everything in the update)
    safetensors: save_pretrained (HF safetensors, this benchmark's baseline only: runs sync
                 Orbax) -> pause, vLLM's own ``reload_weights(weights_path)`` over
                 ``/collective_rpc`` (reads and loads the files), prefix-cache reset, resume

and a plain baseline of the same bf16 arrays (no server): ``np.save`` of each into its own
file + fsync, then ``np.load`` of every file (page cache warm: the files were just written).
``--warmup`` untimed rounds (3) warm every path (jit, imports, page cache) and let the
worker's heap settle: it holds the restored arrays while vLLM frees and re-allocates its
fp32 model, and until it has grown to hold both, each reload faults in fresh pages (measured
at 0.5B: 266k, 63k and 97k minor faults in the first three Orbax reloads, 11 from the fourth;
a training run syncs hundreds of times). The warm-up rounds' reload times are printed too.
This process runs with the trainer's allocator setting (``bapo_jax.malloc``, as ``run.cli``
gives a run; the servers get it from ``serve``); ``--default-malloc`` keeps glibc's defaults.

Prints, as medians over the repetitions: write and load seconds and GB/s of the Orbax path
(load = the worker's wall time from the request to checked host arrays: manifest checks, the
file hash check and the Orbax restore, which run side by side; apart from vLLM) beside the
plain baseline's; vLLM's own in-place reload (in the worker, the arrays already in memory);
the client-side wall time of each update; and the ratio orbax / safetensors of write +
update. The Orbax write does not fsync (``weight_sync._no_fsync_handlers``; neither does
``save_pretrained``), the plain baseline does. A one-token generation after every load checks
that the server still serves. Numbers from this benchmark are in docs/rollout.md.
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


def plain_round(arrays: dict[str, np.ndarray], directory: str) -> tuple[float, float]:
    """Seconds to ``np.save`` every array into its own file and fsync it, then to ``np.load``
    all of them back (the files are in the page cache: they were just written)."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    files = {k: os.path.join(directory, k.replace("/", ".") + ".npy") for k in arrays}
    t0 = time.perf_counter()
    for k, a in arrays.items():
        with open(files[k], "wb") as f:
            np.save(f, a)
            f.flush()
            os.fsync(f.fileno())
    t1 = time.perf_counter()
    back = {k: np.load(f) for k, f in files.items()}
    t2 = time.perf_counter()
    if any(back[k].shape != a.shape for k, a in arrays.items()):
        raise RuntimeError("plain baseline: np.load returned other shapes than were saved")
    return t1 - t0, t2 - t1


def safetensors_round(url: str, model, directory: str) -> tuple[float, float, float]:
    """The baseline sync: ``save_pretrained`` (bf16) into ``directory``, then pause the server,
    vLLM's own in-place ``reload_weights`` of the directory, prefix-cache reset, resume.
    Returns (write, update, reload) seconds, all measured here (the reload: its RPC)."""
    shutil.rmtree(directory, ignore_errors=True)
    t0 = time.perf_counter()
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
    t3 = time.perf_counter()
    post("/reset_prefix_cache")
    post("/resume")
    return t1 - t0, time.perf_counter() - t1, t3 - t2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first (see doc)")
    ap.add_argument(
        "--vllm-python", default=None, help="default $BAPO_VLLM_PYTHON, else .venv-vllm"
    )
    ap.add_argument("--workdir", default=None, help="default: a temp dir (removed at the end)")
    ap.add_argument(
        "--default-malloc", action="store_true", help="keep glibc's malloc defaults (see doc)"
    )
    args = ap.parse_args()
    if args.reps < 1:
        raise SystemExit(f"--reps must be >= 1, got {args.reps}")
    if args.warmup < 1:
        raise SystemExit(f"--warmup must be >= 1, got {args.warmup}")
    if not args.default_malloc:  # the trainer's allocator, as a run has it (bapo_jax.malloc)
        ensure_environment(1, "benchmarks.weight_sync", sys.argv[1:])
    config = MODELS[args.model]

    root = args.workdir or tempfile.mkdtemp(prefix="bapo-sync-bench-")
    from flax import nnx

    model = init_model(config, seed=0)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    host_bf16 = {
        k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16))
        for k, v in ws.flatten_params(params).items()
    }
    nbytes = sum(a.nbytes for a in host_bf16.values())
    print(
        f"model: {args.model}, {config.num_params() / 1e6:.1f}M parameters, head_dim "
        f"{config.head_dim}, tied head {config.tie_word_embeddings}; synced as bf16: "
        f"{nbytes / 1e9:.3f} GB; {os.cpu_count()} CPUs; files under {root}; malloc: "
        + ("glibc defaults" if args.default_malloc else f"GLIBC_TUNABLES={MALLOC_TUNABLES}"),
        flush=True,
    )
    hf0 = os.path.join(root, "hf0")
    save_pretrained(model, hf0, dtype=jnp.bfloat16)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    spec = serve.ServerSpec(
        model=hf0,
        port=port,
        dtype="float32",
        max_model_len=256,
        python=args.vllm_python,
        enforce_eager=True,
    )
    procs = serve.launch(spec, 1, log_dir=os.path.join(root, "logs"))
    sync = os.path.join(root, "sync")
    keys = ("write", "update", "cast", "save", "checksum", "load_w", "verify_w", "read_w")
    keys += ("reload_w",)
    times: dict[str, dict[str, list[float]]] = {"orbax": {k: [] for k in keys}}
    times["st"] = {k: [] for k in ("write", "update", "reload_w")}
    plain: dict[str, list[float]] = {"write": [], "load": []}
    try:
        serve.wait_healthy([url], procs, timeout_s=900)
        eng = VLLMEngine(
            VLLMClientConfig((url,), model=hf0, rpc_timeout_s=900, request_timeout_s=300),
            expected_config=config,
        )
        version = 0
        probe = SamplingParams(max_tokens=1, temperature=1.0)
        warm: dict[str, list[float]] = {"orbax": [], "safetensors": []}  # worker reloads
        for rep in range(args.warmup + args.reps):  # the first args.warmup rounds: untimed
            w, r = plain_round(host_bf16, os.path.join(root, "plain"))
            version += 1
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
            if rep < args.warmup:
                warm["orbax"].append(reply["load_s"])
                warm["safetensors"].append(st_reload)
                continue
            t = times["orbax"]
            t["write"].append(t1 - t0)
            for k in ("cast", "save", "checksum"):
                t[k].append(split[k + "_s"])
            t["update"].append(t2 - t1)
            t["load_w"].append(reply["restore_s"])
            t["verify_w"].append(reply["verify_s"])
            t["read_w"].append(reply["read_s"])
            t["reload_w"].append(reply["load_s"])
            for k, v in (("write", st_write), ("update", st_update), ("reload_w", st_reload)):
                times["st"][k].append(v)
            plain["write"].append(w)
            plain["load"].append(r)
        eng.close()
    finally:
        serve.stop(procs)
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    for fmt, seconds in warm.items():
        listed = ", ".join(f"{x:.2f}" for x in seconds)
        print(f"warm-up rounds, vLLM reload (worker), {fmt}: {listed} s")
    report(times, plain, nbytes, args.reps)


def report(times, plain, nbytes: int, reps: int) -> None:
    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    pw, pl = statistics.median(plain["write"]), statistics.median(plain["load"])
    o, st = med["orbax"], med["st"]
    o_load = o["load_w"]  # the worker's wall time before touching the model

    def gbs(seconds: float) -> float:
        return nbytes / 1e9 / seconds

    print(f"\nmedian of {reps} rounds, {nbytes / 1e9:.3f} GB of bf16 per sync")
    print("  bandwidth                        seconds    GB/s   vs plain")
    rows = [
        ("plain np.save + fsync", pw, None),
        ("plain np.load (warm cache)", pl, None),
        ("orbax write (write_orbax)", o["write"], pw),
        ("  of which HF layout + bf16 cast", o["cast"], None),
        ("  of which Orbax save", o["save"], None),
        ("  of which file hashes", o["checksum"], None),
        ("orbax load (check + restore)", o_load, pl),
        ("  file hash check (overlaps)", o["verify_w"], None),
        ("  Orbax restore (overlaps)", o["read_w"], None),
    ]
    for name, seconds, plain_s in rows:
        vs = f"{plain_s / seconds:8.2f}x" if plain_s else ""
        print(f"  {name:<30} {seconds:9.2f} {gbs(seconds):7.2f} {vs}")
    print(f"  vLLM in-place reload (worker)  {o['reload_w']:9.2f}   (arrays already in memory)")
    print("  sync (seconds)                   write  update   total  | worker reload")
    for name, d in (("orbax", o), ("safetensors", st)):
        total = d["write"] + d["update"]
        print(
            f"  {name:<30} {d['write']:7.2f} {d['update']:7.2f} {total:7.2f}  | "
            f"{d['reload_w']:7.2f}{'  (reads the files too)' if name == 'safetensors' else ''}"
        )
    ratio = (o["write"] + o["update"]) / (st["write"] + st["update"])
    print(
        f"ratio orbax / safetensors: write {o['write'] / st['write']:.2f}, update "
        f"{o['update'] / st['update']:.2f}, write + update {ratio:.2f}"
    )


if __name__ == "__main__":
    main()
