"""`python -m bapo_jax.export`: a run checkpoint as an HF checkpoint (see `bapo_jax.export`).

    python -m bapo_jax.export --run runs/cpu_arithmetic --out exports/arith
    python -m bapo_jax.export --run runs/aime_7b --step 200 --out exports/aime7b-200 --dtype bf16

Reads only the policy params of the checkpoint (no optimizer state), on the host; writes
safetensors, config.json, generation_config.json and the run's tokenizer files into --out
(through a temp dir and a rename). Bad flags fail before anything is read, naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from bapo_jax.export import DTYPES, RunDirError, export_run


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bapo_jax.export",
        description="write a run's checkpoint as an HF checkpoint (transformers, vLLM)",
    )
    ap.add_argument("--run", required=True, help="run directory (config.json + checkpoints/)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--out", required=True, help="HF checkpoint directory to write")
    ap.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="weights' dtype (default: the checkpoint's, float32 for most runs)",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    """Export; returns (and prints as JSON) what was written."""
    args = build_parser().parse_args(argv)
    if args.step is not None and args.step < 0:
        raise RunDirError(f"--step must be >= 0, got {args.step}")
    result = export_run(args.run, args.out, args.step, dtype=args.dtype, overwrite=args.overwrite)
    summary = result._asdict()
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    try:
        main()
    except RunDirError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
