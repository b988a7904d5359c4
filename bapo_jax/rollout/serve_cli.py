"""The command line of ``python -m bapo_jax.rollout.serve`` (see `serve`): servers started by
hand for a run that is given their URLs (``--vllm-url``).

Its server flags are shortcuts for the fields of `serve.ServerSettings` (``--port 8001`` =
``port=8001``; any field also as ``field=value``), parsed and checked by the same machinery
as a run's ``engine.server`` section (`overrides`). ``--max-model-len`` is required,
never a silent default: it must hold the run's prompt cap + response cap (e.g. 1,024 + 8,192 =
9,216 for ``experiments.aime_7b``), and the run checks it through the servers' ``/v1/models``
before any compute. ``--sync-root`` is required too: the servers load versions only from
under it.

Every route requires the bearer token of the run's secret (`run_secret`): ``--secret-file``
(or ``$BAPO_RUN_SECRET_FILE``) names it, else a fresh one is written owner-only into
``--log-dir`` (a temp directory without one) and its path printed, to be given to the run
(``engine.server.secret_file``). A non-loopback ``--host`` without a given secret is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Sequence

from bapo_jax.overrides import add_flags, apply_overrides, flag_overrides
from bapo_jax.rollout import serve
from bapo_jax.rollout.run_secret import SECRET_FILE_ENV

EXAMPLE = """example (the aime_32b layout: on each of its four nodes, one server on all 8 GPUs,
colocated with the trainer at a 0.3 share):
  .venv-vllm/bin/python -m bapo_jax.rollout.serve --model /shared/models/R1-Distill-Qwen-32B \\
      --num-servers 1 --devices "0,1,2,3,4,5,6,7" --tensor-parallel-size 8 --dtype bfloat16 \\
      --max-model-len 9216 --gpu-memory-utilization 0.3 --host 0.0.0.0 \\
      --sync-root /shared/run/weight_sync --secret-file /shared/run/run_secret
then, on the four nodes: python -m experiments.aime_32b \\
      --model-dir /shared/models/R1-Distill-Qwen-32B \\
      --vllm-url http://node-0:8000 ... --vllm-url http://node-3:8000 \\
      engine.sync_dir=/shared/run/weight_sync engine.server.secret_file=/shared/run/run_secret"""

# --<field> for every setting but `args` (the flags after "--"); --vllm-python as a run spells it.
FLAGS = {
    "--" + f.name.replace("_", "-"): f.name
    for f in dataclasses.fields(serve.ServerSettings)
    if f.name != "args"
} | {"--vllm-python": "python"}


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
    ap.add_argument(
        "--max-model-len",
        type=int,
        required=True,
        help="required: tokens per sequence, at least the run's prompt + response caps "
        "(aime_7b: 1024 + 8192 = 9216); the run refuses a server with fewer",
    )
    ap.add_argument(
        "--sync-root",
        required=True,
        help="required: the run's weight-sync directory (engine.sync_dir, default "
        "<out-dir>/weight_sync); the servers load versions only from under it",
    )
    ap.add_argument("--num-servers", type=int, default=1, help="servers to start (default 1)")
    ap.add_argument("--log-dir", default=None, help="server-i.log files and servers.json here")
    ap.add_argument("--boot-timeout", type=float, default=900.0, help="seconds to wait for /health")
    add_flags(ap.add_argument_group("server settings (serve.ServerSettings)"), FLAGS,
              serve.ServerSettings)  # fmt: skip
    ap.add_argument("settings", nargs="*", help="field=value settings (serve.ServerSettings)")
    return ap


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, serve.ServerSpec]:
    """The parsed command line and its spec; the flags after "--" go to vLLM (`args`)."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = build_parser()
    args = ap.parse_args(argv[:cut])
    overrides = flag_overrides(args, FLAGS, serve.ServerSettings) + list(args.settings)
    if argv[cut + 1 :]:
        overrides.append("args=" + json.dumps(argv[cut + 1 :]))
    try:
        settings = apply_overrides(serve.ServerSettings(), overrides)
        secret_given = settings.secret_file or os.environ.get(SECRET_FILE_ENV)
        if not secret_given and settings.host not in serve.LOOPBACK:
            raise ValueError(
                f"--host {settings.host} without a secret: every route would be open to the "
                f"network; give --secret-file (or ${SECRET_FILE_ENV}), or bind to loopback"
            )
        spec = serve.ServerSpec(args.model, args.max_model_len, settings, args.sync_root)
        return args, spec
    except ValueError as error:
        ap.error(str(error))


def main(argv: Sequence[str] | None = None) -> int:
    args, spec = parse(sys.argv[1:] if argv is None else argv)
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT also when started in the background
        signal.signal(sig, signal.default_int_handler)  # raises KeyboardInterrupt
    group = serve.ServerGroup(
        spec, args.num_servers, log_dir=args.log_dir, boot_timeout_s=args.boot_timeout
    )
    try:
        group.wait_healthy()
        print("serving: " + " ".join(group.urls), flush=True)
        print(
            f"every route requires the bearer token of {group.secret_file}: give the run "
            f"engine.server.secret_file={group.secret_file}",
            flush=True,
        )
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
