"""The CPU arithmetic job, from nothing: task -> tokenizer -> supervised warm start -> BAPO RL.

    1. data:       1-2 operation problems (plus a few 3-operation ones) for the warm start,
                   3-operation problems for RL, and >= 500 held-out 3-operation problems; the
                   splits are disjoint by construction (`tasks.arithmetic`).
    2. tokenizer:  SentencePiece trained in process on the warm-start texts.
    3. warm start: a tiny Qwen2 learns the scratchpad format on mostly shorter problems, so it
                   is good at the format and mediocre at 3-operation problems.
    4. RL:         the `Trainer` (embedded engine, GRPO advantages, BAPO) on 3-operation
                   prompts with the exact-answer reward.
    5. control:    the warm start continued by supervised training for as many tokens as RL
                   trained on, so "RL helped" is measured against "more of the same helped".

Accuracy is greedy, on the held-out problems, before and after.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bapo_jax.data.pipeline import PipelineConfig, prompt_iterator
from bapo_jax.models import Qwen2Config
from bapo_jax.models.spm_tokenizer import SentencePieceTokenizer
from bapo_jax.rollout.embedded import EmbeddedEngine
from bapo_jax.rollout.types import SamplingParams
from bapo_jax.tasks import arithmetic as arith
from bapo_jax.train import optim
from bapo_jax.train import sft as sft_lib
from bapo_jax.train.config import TrainerConfig
from bapo_jax.train.loop import Trainer
from bapo_jax.train.state import TrainState, init_train_state
from bapo_jax.train.sync import EmbeddedPublisher


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """max_operand: operands in [0, max_operand]; n_basic / n_target_sft: 1-2 / 3-operation
    warm-start problems; n_eval: held-out problems; vocab_size: SentencePiece pieces (upper
    bound); seed: data, tokenizer and model init."""

    max_operand: int = 9
    n_basic: int = 1500
    n_target_sft: int = 256
    n_eval: int = 500
    vocab_size: int = 48
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The job's Qwen2: `layers` blocks of width `hidden`, MLP width 4 x hidden, tied head."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2

    def qwen2_config(self, vocab_size: int, **token_ids: int) -> Qwen2Config:
        """The model config for a tokenizer of `vocab_size` (token_ids: bos/eos/pad_token_id)."""
        return Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=self.hidden,
            intermediate_size=4 * self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=256,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            max_window_layers=self.layers,
            **token_ids,
        )


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start: steps x batch rows of `length` tokens, AdamW at `learning_rate`."""

    steps: int = 600
    batch_size: int = 64
    length: int = 32
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01


@dataclasses.dataclass
class Task:
    tokenizer: SentencePieceTokenizer
    warm_start: arith.ArithmeticSource
    rl: arith.ArithmeticSource
    held_out: arith.ArithmeticSource
    model_config: Qwen2Config


def build_task(config: TaskConfig, shape: ModelShape, rl_prompts: int) -> Task:
    basic = arith.ArithmeticConfig(min_ops=1, max_ops=2, max_operand=config.max_operand)
    target = arith.ArithmeticConfig(min_ops=3, max_ops=3, max_operand=config.max_operand)
    warm = arith.generate_problems(basic, "sft", config.n_basic, config.seed)
    warm += arith.generate_problems(target, "sft", config.n_target_sft, config.seed + 1)
    rl = arith.generate_problems(target, "rl", rl_prompts, config.seed)
    held_out = arith.generate_problems(target, "eval", config.n_eval, config.seed)
    tok = SentencePieceTokenizer.train(arith.tokenizer_corpus(warm), vocab_size=config.vocab_size)
    model_config = shape.qwen2_config(
        tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id
    )
    return Task(
        tok,
        arith.ArithmeticSource(warm, tok),
        arith.ArithmeticSource(rl, tok),
        arith.ArithmeticSource(held_out, tok),
        model_config,
    )


class WarmStart:
    """Supervised training on the warm-start problems; `run(state, steps)` continues it (the
    equal-compute control reuses the same batch stream)."""

    def __init__(self, task: Task, config: WarmStartConfig, seed: int):
        self.task, self.config = task, config
        source = task.warm_start
        self.prompts = [source[i].prompt_ids for i in range(len(source))]
        self.targets = [source.target_ids(i) for i in range(len(source))]
        self.optimizer = optim.make_optimizer(
            optim.OptimizerConfig(
                learning_rate=config.learning_rate,
                warmup_steps=config.warmup_steps,
                weight_decay=config.weight_decay,
            )
        )
        self.graphdef, self.initial = init_train_state(task.model_config, self.optimizer, seed=seed)
        self.step_fn = sft_lib.make_sft_step(self.graphdef, self.optimizer)
        self.batches = sft_lib.epoch_batches(len(self.prompts), config.batch_size, seed)

    def run(self, state: TrainState, steps: int) -> tuple[TrainState, float]:
        loss = float("nan")
        for _ in range(steps):
            idx = next(self.batches)
            batch = sft_lib.make_sft_batch(
                [self.prompts[i] for i in idx],
                [self.targets[i] for i in idx],
                pad_id=self.task.tokenizer.pad_id,
                length=self.config.length,
            )
            state, metrics = self.step_fn(state, batch)
            loss = metrics["loss"]
        return state, float(loss)

    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.config.length


def engine_for(task: Task, graphdef, params) -> EmbeddedEngine:
    model = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))
    tok = task.tokenizer
    return EmbeddedEngine(
        model, eos_token_ids=[tok.eos_id], pad_token_id=tok.pad_id, length_bucket=8
    )


def greedy_accuracy(engine, task: Task, max_tokens: int) -> float:
    """Share of held-out problems whose greedy response boxes the exact answer."""
    source = task.held_out
    prompts = [source[i].prompt_ids for i in range(len(source))]
    rollout = engine.generate(
        prompts, 1, SamplingParams(max_tokens=max_tokens, temperature=1.0), seed=0, greedy=True
    )
    texts = [task.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in rollout.samples]
    return float(np.mean(reward_fn(texts, [source[i].answer for i in range(len(source))])))


def reward_fn(texts: Sequence[str], answers: Sequence[str]) -> np.ndarray:
    return np.asarray([arith.arithmetic_reward(t, a) for t, a in zip(texts, answers, strict=True)])


def run_rl(
    task: Task, graphdef, warm_params, trainer_config: TrainerConfig, out_dir: str
) -> dict[str, Any]:
    """BAPO (or the configured loss) from the warm start; evaluates every `eval_every`."""
    r = trainer_config.rollout
    model = nnx.merge(graphdef, jax.tree.map(jnp.copy, warm_params))
    engine = engine_for(task, graphdef, warm_params)
    prompts = prompt_iterator(task.rl, PipelineConfig(batch_size=r.prompts_per_step, seed=r.seed))
    trainer = Trainer(
        trainer_config,
        model=model,
        engine=engine,
        publisher=EmbeddedPublisher(),
        prompts=prompts,
        reward_fn=reward_fn,
        decode=lambda ids: task.tokenizer.decode(ids, skip_special_tokens=True),
        pad_id=task.tokenizer.pad_id,
        out_dir=out_dir,
        eval_fn=lambda params, version: {
            "accuracy": greedy_accuracy(engine, task, r.max_response_tokens)
        },
    )
    return trainer.run()


def read_rows(out_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def bounds_summary(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """How far BAPO's searched bounds moved from their starts over the run."""
    c_low = [r["c_low"] for r in rows if "c_low" in r]
    c_high = [r["c_high"] for r in rows if "c_high" in r]
    if not c_low:
        return {}
    return {
        "c_low_min": min(c_low),
        "c_low_max": max(c_low),
        "c_high_min": min(c_high),
        "c_high_max": max(c_high),
    }


def run_job(
    task_config: TaskConfig,
    shape: ModelShape,
    warm_config: WarmStartConfig,
    trainer_config: TrainerConfig,
    out_dir: str,
    *,
    control: bool = True,
) -> dict[str, Any]:
    """The whole job (module doc); writes and returns summary.json's content."""
    start = time.perf_counter()
    phases: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        phases[name] = round(now - since, 1)
        print(f"[{now - start:6.1f}s] {name} done in {phases[name]}s", flush=True)
        return now

    r = trainer_config.rollout
    t = time.perf_counter()
    task = build_task(task_config, shape, trainer_config.steps * r.prompts_per_step)
    task.tokenizer.save(os.path.join(out_dir, "tokenizer.model"))
    t = lap("data_and_tokenizer", t)
    warm = WarmStart(task, warm_config, task_config.seed)
    warm_state, warm_loss = warm.run(warm.initial, warm_config.steps)
    t = lap("warm_start", t)
    before = greedy_accuracy(
        engine_for(task, warm.graphdef, warm_state.params), task, r.max_response_tokens
    )
    t = lap("eval_before", t)
    print(f"warm start: loss {warm_loss:.4f}, held-out accuracy {before:.3f}", flush=True)
    rl_summary = run_rl(task, warm.graphdef, warm_state.params, trainer_config, out_dir)
    t = lap("rl", t)
    rows = read_rows(out_dir)
    after = rows[-1]["eval/accuracy"]
    summary: dict[str, Any] = {
        "accuracy_before": before,
        "accuracy_after": after,
        "improvement_points": round(100 * (after - before), 1),
        "rl_steps": trainer_config.steps,
        "optimizer_steps": rows[-1]["optimizer_step"],
        "warm_start_steps": warm_config.steps,
        "warm_start_loss": warm_loss,
        "held_out_problems": len(task.held_out),
        "bapo_bounds": bounds_summary(rows),
        "accuracy_during_rl": {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r},
    }
    if control:
        # Equal compute: RL's updates pushed steps x epochs x rows x (P + L) token positions
        # through forward and backward (generation not counted, in the control's favour).
        a = trainer_config.algorithm
        rows_per_batch = r.prompts_per_step * r.samples_per_prompt
        positions = (
            trainer_config.steps
            * a.epochs
            * rows_per_batch
            * (r.max_prompt_tokens + r.max_response_tokens)
        )
        steps = math.ceil(positions / warm.tokens_per_step())
        control_state, _ = warm.run(warm_state, steps)
        engine = engine_for(task, warm.graphdef, control_state.params)
        summary["control"] = {
            "what": "supervised continuation of the warm start, RL's token positions",
            "steps": steps,
            "accuracy": greedy_accuracy(engine, task, r.max_response_tokens),
        }
        t = lap("control", t)
    summary["phases_s"] = phases
    summary["wall_time_s"] = round(time.perf_counter() - start, 1)
    summary["rl_wall_time_s"] = rl_summary["wall_time_s"]
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return summary
