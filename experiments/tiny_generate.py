"""The README's interim main job: the whole inference path on CPU with a tiny random model.

Builds a randomly initialised Qwen2-architecture model with the real Qwen2.5 vocabulary,
renders AIME 2024 problems with the shipped tokenizer's chat template (Qwen2.5-Math prompt
style), runs one forward pass and the chunked log-prob path, greedily decodes with the embedded
engine, scores the (meaningless) responses with `math_reward`, and writes `summary.json`.
Replaced by the CPU RL job once the trainer lands.

    python -m experiments.tiny_generate --out-dir runs/tiny_generate
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax.numpy as jnp
import numpy as np

from bapo_jax.data.datasets import read_math_rows, shipped_set
from bapo_jax.data.prompts import build_messages, render_prompt
from bapo_jax.models import Qwen2Config, init_model
from bapo_jax.models.logprobs import model_token_logprobs
from bapo_jax.models.tokenizer import load_tokenizer
from bapo_jax.rewards import math_reward
from bapo_jax.rollout.embedded import EmbeddedEngine
from bapo_jax.rollout.types import SamplingParams

# Qwen2.5-0.5B's vocabulary and head layout at a width a CPU runs in seconds.
TINY = Qwen2Config.preset("qwen2.5-0.5b").replace(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="runs/tiny_generate")
    parser.add_argument("--problems", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()

    tokenizer = load_tokenizer()
    rows, _ = read_math_rows(shipped_set("aime2024").path("test"))
    rows = rows[: args.problems]
    prompts = [render_prompt(build_messages(r.problem), tokenizer, "qwen_math") for r in rows]
    model = init_model(TINY, seed=args.seed)
    print(f"model: {TINY.num_params() / 1e6:.1f}M params (random), {len(prompts)} AIME prompts")

    # Forward pass and the chunked log-prob path on the first prompt.
    ids = jnp.asarray([prompts[0]], jnp.int32)
    logits = model(ids)
    logp, entropy = model_token_logprobs(model, ids, None, jnp.roll(ids, -1, axis=1))
    print(f"forward: logits {logits.shape}, mean token entropy {float(entropy.mean()):.3f}")

    engine = EmbeddedEngine(model, eos_token_ids=[tokenizer.eos_id], pad_token_id=tokenizer.pad_id)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    rollout = engine.generate(prompts, n=1, sampling=sampling, seed=args.seed, greedy=True)
    responses = [tokenizer.decode(s.token_ids) for s in rollout.samples]
    scores = [math_reward(text, row.answer) for text, row in zip(responses, rows, strict=True)]
    for row, text, score in zip(rows, responses, scores, strict=True):
        print(f"  {row.id}: reward {score:.0f}  {text[:60]!r}")

    os.makedirs(args.out_dir, exist_ok=True)
    summary = {
        "model_params": TINY.num_params(),
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "response_tokens": [len(s.token_ids) for s in rollout.samples],
        "mean_logprob_first_prompt": float(np.mean(np.asarray(logp[0, :-1]))),
        "accuracy": float(np.mean(scores)),
        "wall_time_s": time.perf_counter() - start,
    }
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {os.path.join(args.out_dir, 'summary.json')} in {summary['wall_time_s']:.1f}s")


if __name__ == "__main__":
    main()
