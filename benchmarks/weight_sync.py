"""Weight sync to a real vLLM server: Orbax (this project's path) vs HF safetensors (baseline).

    python -m benchmarks.weight_sync [--reps 3] [--vllm-python PATH]

A ~100M-parameter Qwen2 (head_dim 64, untied) is served by one vLLM server (fp32 on CPU).
Each repetition syncs a new version both ways, bf16 on disk:

    orbax:       write_orbax (params-only Orbax checkpoint + manifest + digest)
                 -> update_weights: pause, Orbax restore on the worker, digest check, HF
                 mapping, in-place reload, version tag, prefix-cache reset, resume
    safetensors: write_safetensors (save_pretrained + manifest)
                 -> update_weights: same protocol, vLLM's reload_weights(weights_path)

Prints the median write, load (client-side wall time of update_weights) and total seconds of
each, the worker's own restore/load split, and the ratio orbax / safetensors (< 1: Orbax
faster). A one-token generation after every load checks the server still serves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time

import jax.numpy as jnp

from bapo_jax.models import Qwen2Config, init_model, save_pretrained
from bapo_jax.rollout import serve
from bapo_jax.rollout import weight_sync as ws
from bapo_jax.rollout.types import SamplingParams
from bapo_jax.rollout.vllm_client import VLLMClientConfig, VLLMEngine

# ~100M parameters: 2 x 32000 x 768 embeddings/head + 8 layers of ~6.3M (head_dim 768/12 = 64).
BENCH_CONFIG = Qwen2Config(
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
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--vllm-python", default=None, help="default $BAPO_VLLM_PYTHON, else .venv-vllm"
    )
    ap.add_argument("--workdir", default=None, help="default: a temp dir (removed at the end)")
    args = ap.parse_args()

    root = args.workdir or tempfile.mkdtemp(prefix="bapo-sync-bench-")
    from flax import nnx

    model = init_model(BENCH_CONFIG, seed=0)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    print(
        f"model: {BENCH_CONFIG.num_params() / 1e6:.1f}M parameters, head_dim "
        f"{BENCH_CONFIG.head_dim}, synced as bf16"
    )
    hf0 = os.path.join(root, "hf0")
    save_pretrained(model, hf0)
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
    times: dict[str, dict[str, list[float]]] = {
        m: {"write": [], "load": [], "restore_w": [], "load_w": []}
        for m in ("orbax", "safetensors")
    }
    try:
        serve.wait_healthy([url], procs, timeout_s=900)
        engines = {
            fmt: VLLMEngine(
                VLLMClientConfig(
                    (url,), model=hf0, sync_format=fmt, rpc_timeout_s=900, request_timeout_s=300
                ),
                expected_config=BENCH_CONFIG,
            )
            for fmt in ("orbax", "safetensors")
        }
        version = 0
        probe = SamplingParams(max_tokens=1, temperature=1.0)
        for _ in range(args.reps):
            for fmt, eng in engines.items():
                version += 1
                t0 = time.perf_counter()
                if fmt == "orbax":
                    path = ws.write_orbax(
                        params,
                        sync,
                        version=version,
                        step=version,
                        config=BENCH_CONFIG,
                        dtype=jnp.bfloat16,
                        keep=2,
                    )
                else:
                    path = ws.write_safetensors(
                        model, sync, version=version, step=version, dtype=jnp.bfloat16, keep=2
                    )
                t1 = time.perf_counter()
                eng.update_weights(version, path)
                t2 = time.perf_counter()
                eng.generate([[5, 6, 7]], 1, probe, seed=0)
                reply = eng.last_update[url]
                times[fmt]["write"].append(t1 - t0)
                times[fmt]["load"].append(t2 - t1)
                times[fmt]["restore_w"].append(reply.get("restore_s", float("nan")))
                times[fmt]["load_w"].append(reply.get("load_s", float("nan")))
        for eng in engines.values():
            eng.close()
    finally:
        serve.stop(procs)
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)

    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    print(
        f"median of {args.reps} syncs (seconds)     write    load   total  "
        "| worker: validate+restore  reload"
    )
    for m in ("orbax", "safetensors"):
        d = med[m]
        print(
            f"  {m:<32} {d['write']:7.2f} {d['load']:7.2f} {d['write'] + d['load']:7.2f}  "
            f"| {d['restore_w']:24.2f} {d['load_w']:7.2f}"
        )
    total = {m: med[m]["write"] + med[m]["load"] for m in med}
    ratio = {k: med["orbax"][k] / med["safetensors"][k] for k in ("write", "load")}
    print(
        f"ratio orbax / safetensors (baseline): write {ratio['write']:.2f}, "
        f"load {ratio['load']:.2f}, total {total['orbax'] / total['safetensors']:.2f}"
    )


if __name__ == "__main__":
    main()
