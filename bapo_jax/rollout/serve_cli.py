"""The command line of ``python -m bapo_jax.rollout.serve`` (see `serve`): servers started by
hand for a run that is given their URLs (``--vllm-url``).

``--max-model-len`` is required, never a silent default: it must hold the run's prompt cap +
response cap (e.g. 1,024 + 8,192 = 9,216 for ``experiments.aime_7b``), and the run checks it
through the servers' ``/v1/models`` before any compute.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence

from bapo_jax.rollout import serve

EXAMPLE = """example (the aime_7b layout: trainer on GPUs 0-3, four servers on GPUs 4-7):
  .venv-vllm/bin/python -m bapo_jax.rollout.serve --model /models/R1-Distill-Qwen-7B \\
      --num-servers 4 --devices "4;5;6;7" --tensor-parallel-size 1 --dtype bfloat16 \\
      --max-model-len 9216 --gpu-memory-utilization 0.9
then: python -m experiments.aime_7b --model-dir /models/R1-Distill-Qwen-7B \\
      --vllm-url http://127.0.0.1:8000 ... --vllm-url http://127.0.0.1:8003"""


def _split(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(";") if part) if text else ()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bapo_jax.rollout.serve",
        description="Start vLLM servers for RL: the flags RL needs (bapo_jax/rollout/serve.py), "
        "per-server GPUs or CPU cores, and each server's max length, which must hold the run's "
        "prompt + response caps.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="HF checkpoint directory (version 0)")
    ap.add_argument("--num-servers", type=int, default=1, help="servers to start (default 1)")
    ap.add_argument(
        "--port", type=int, default=8000, help="first port; server i listens on port + i"
    )
    ap.add_argument(
        "--host", default="127.0.0.1", help="bind address (the dev endpoints have no auth)"
    )
    ap.add_argument("--dtype", default="auto", help="vLLM --dtype (bfloat16 on GPUs)")
    ap.add_argument(
        "--max-model-len",
        type=int,
        required=True,
        help="required: tokens per sequence, at least the run's prompt + response caps "
        "(aime_7b: 1024 + 8192 = 9216); the run refuses a server with fewer",
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs per server (vLLM --tensor-parallel-size; default 1)",
    )
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="share of each GPU's memory vLLM takes (default: vLLM's, 0.9)",
    )
    ap.add_argument(
        "--python",
        "--vllm-python",
        default=None,
        help=f"the vLLM environment's interpreter (default ${serve.VLLM_PYTHON_ENV}, "
        "else .venv-vllm)",
    )
    ap.add_argument(
        "--served-model-name", default=None, help="the name requests use (default: --model)"
    )
    ap.add_argument(
        "--devices",
        default="",
        help='per-server GPU lists, e.g. "4,5;6,7" for 2 servers x TP 2 (each server\'s '
        "CUDA_VISIBLE_DEVICES; indices among this process's CUDA_VISIBLE_DEVICES if set)",
    )
    ap.add_argument(
        "--cpu-kvcache-gib", type=int, default=1, help="CPU builds: KV cache GiB per server"
    )
    ap.add_argument(
        "--cpu-cores", default="", help='CPU builds: per-server OpenMP cores, e.g. "0;1"'
    )
    ap.add_argument(
        "--enforce-eager", action="store_true", help="no graph capture (fast boot; CPU tests)"
    )
    ap.add_argument("--with-tokenizer", action="store_true", help="do not skip tokenizer init")
    ap.add_argument("--log-dir", default=None, help="server-i.log files and servers.json here")
    ap.add_argument("--boot-timeout", type=float, default=900.0, help="seconds to wait for /health")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="-- then extra vLLM flags")
    return ap


def spec_from_args(args: argparse.Namespace) -> serve.ServerSpec:
    return serve.ServerSpec(
        model=args.model, port=args.port, host=args.host, dtype=args.dtype,
        max_model_len=args.max_model_len, python=args.python,
        served_name=args.served_model_name, devices=_split(args.devices),
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kvcache_gib=args.cpu_kvcache_gib, cpu_cores=_split(args.cpu_cores),
        enforce_eager=args.enforce_eager, skip_tokenizer_init=not args.with_tokenizer,
        extra_args=tuple(a for a in args.extra if a != "--"),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        spec = spec_from_args(args)
    except ValueError as error:
        ap.error(str(error))
    if spec.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: dev endpoints exposed on {spec.host} without authentication", file=sys.stderr
        )

    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # also when started in the background
    group = serve.ServerGroup(
        spec, args.num_servers, log_dir=args.log_dir, boot_timeout_s=args.boot_timeout
    )
    try:
        group.wait_healthy()
        print("serving: " + " ".join(group.urls), flush=True)
        while all(p.poll() is None for p in group.procs):
            time.sleep(2.0)
        print("a vLLM server exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        group.stop()


if __name__ == "__main__":
    raise SystemExit(main())
