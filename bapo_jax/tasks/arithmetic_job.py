"""The CPU arithmetic job, from nothing: task -> tokenizer -> supervised warm start -> BAPO RL.

    1. data:       1-2 operation problems (plus a few 3-operation ones) for the warm start,
                   3-operation problems for RL, and >= 500 held-out 3-operation problems; the
                   splits are disjoint by construction (`tasks.arithmetic`). With
                   `TaskConfig.kind="countdown"` the same job runs the search task of
                   `tasks.countdown` (`tasks.kinds`: problem sets, rewards, pass@k evaluation).
    2. tokenizer:  SentencePiece trained in process on the warm-start texts.
    3. warm start: a tiny Qwen2 learns the scratchpad format on mostly shorter problems, so it
                   is good at the format and mediocre at 3-operation problems. It is saved as
                   an HF checkpoint (with the tokenizer in HF form, + tokenizer.model) in
                   <out>/warm_start, reused by a rerun with the same settings (a resumed run).
                   With them, the run's <out>/model/ record (`export.record_policy`) names
                   the tokenizer `python -m bapo_jax.export --run <out>` exports.
    4. RL:         a run built by `run.build.build_trainer` like every other (GRPO advantages,
                   BAPO) from that checkpoint, on 3-operation prompts with the exact-answer
                   reward, with the run config's engine: the embedded sampler, or vLLM servers
                   that the run launches (or is given) and syncs through Orbax checkpoints.
    5. control:    the warm start continued by supervised training for as many tokens as RL
                   trained on, so "RL helped" is measured against "more of the same helped".

Accuracy is greedy, on the held-out problems: before (the warm start, embedded engine), during
and after RL (the run's engine, on the version it holds), and after RL with the embedded engine
on the trainer's params (for a vLLM run: the two engines agree).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bapo_jax.checks import check_choice, check_field, is_int
from bapo_jax.data.pipeline import PipelineConfig, prompt_iterator
from bapo_jax.models import Qwen2Config, save_pretrained
from bapo_jax.models.spm_tokenizer import SentencePieceTokenizer
from bapo_jax.models.tokenizer import missing_tokenizer_files
from bapo_jax.rollout.embedded import EmbeddedEngine
from bapo_jax.rollout.types import RolloutEngine
from bapo_jax.run import build
from bapo_jax.run.config import RunConfig, dump
from bapo_jax.tasks import arithmetic as arith
from bapo_jax.tasks import kinds
from bapo_jax.tasks.job_report import bounds_summary, loop_report, read_rows
from bapo_jax.train import optim
from bapo_jax.train import sft as sft_lib
from bapo_jax.train.state import TrainState, init_train_state


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """kind: "arithmetic" or "countdown" (`tasks.kinds`); size: the RL and held-out problems'
    size (arithmetic: operations; countdown: numbers), the warm start's basic ones are smaller;
    max_operand: operands (countdown: numbers) in [0 or 1, max_operand]; n_basic /
    n_target_sft: basic / full-size warm-start problems; n_eval: held-out problems; vocab_size:
    SentencePiece pieces (upper bound); seed: data, tokenizer and model init; eval_samples:
    sampled responses per held-out problem in each evaluation beside the greedy one (pass@k,
    distinct correct answers; 0 = greedy only)."""

    max_operand: int = 9
    n_basic: int = 1500
    n_target_sft: int = 256
    n_eval: int = 500
    vocab_size: int = 48
    seed: int = 0
    kind: kinds.TaskKind = "arithmetic"
    size: int = 3
    eval_samples: int = 0

    def __post_init__(self):
        check_choice("kind", self.kind, kinds.TaskKind)
        check_field(is_int(self.size, 2), "size", "an int >= 2", self.size)
        check_field(is_int(self.eval_samples, 0), "eval_samples", "an int >= 0", self.eval_samples)


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
    kind: str = "arithmetic"
    eval_samples: int = 0


def build_task(config: TaskConfig, shape: ModelShape, rl_prompts: int) -> Task:
    warm, rl, held_out = kinds.problem_sets(
        config.kind,
        size=config.size,
        max_number=config.max_operand,
        n_basic=config.n_basic,
        n_target=config.n_target_sft,
        n_eval=config.n_eval,
        rl_prompts=rl_prompts,
        seed=config.seed,
    )
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
        config.kind,
        config.eval_samples,
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


def engine_for(task: Task, graphdef, params, *, length_bucket: int = 8) -> EmbeddedEngine:
    model = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))
    tok = task.tokenizer
    return EmbeddedEngine(
        model, eos_token_ids=[tok.eos_id], pad_token_id=tok.pad_id, length_bucket=length_bucket
    )


def greedy_accuracy(engine: RolloutEngine, task: Task, max_tokens: int) -> float:
    """Share of held-out problems whose greedy response is correct (any engine)."""
    return evaluate(engine, task, max_tokens, samples=0)["accuracy"]


def evaluate(
    engine: RolloutEngine, task: Task, max_tokens: int, samples: int | None = None
) -> dict[str, float]:
    """Greedy held-out accuracy, and pass@k / distinct correct answers with the task's
    `eval_samples` (or `samples`) k > 0 (`tasks.kinds.evaluate`)."""
    tok = task.tokenizer
    return kinds.evaluate(
        engine,
        task.kind,
        task.held_out,
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        tok.eos_id,
        max_tokens,
        task.eval_samples if samples is None else samples,
    )


def reward_fn_of(task: Task) -> Callable[..., np.ndarray]:
    """The task's reward (`train.producer.RewardFn`; the metadata is not used)."""

    def reward_fn(
        texts: Sequence[str],
        answers: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> np.ndarray:
        return kinds.rewards(task.kind, texts, answers)

    return reward_fn


def arithmetic_task(task: Task, eval_max_tokens: int) -> build.TaskFactory:
    """The job's `RunTask`: the RL split's prompts, the exact-answer reward, greedy held-out
    accuracy through the run's engine."""

    def factory(config: RunConfig, arch: Qwen2Config, stack) -> build.RunTask:
        r = config.trainer.rollout
        tok = task.tokenizer
        prompts = prompt_iterator(
            task.rl, PipelineConfig(batch_size=r.prompts_per_step, seed=r.seed)
        )
        return build.RunTask(
            prompts=prompts,
            reward_fn=reward_fn_of(task),
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
            pad_id=tok.pad_id,
            stop_token_ids=(tok.eos_id,),
            evaluate=lambda engine, version: evaluate(engine, task, eval_max_tokens),
        )

    return factory


# ---- the warm start, kept on disk ------------------------------------------------------------
@dataclasses.dataclass
class Prepared:
    """The task and its warm start: `hf_dir` (HF checkpoint, fp32), its supervised loss and
    greedy held-out accuracy (embedded engine); `warm` / `state` when computed in this process
    (the control continues them), None when read back from disk."""

    task: Task
    hf_dir: str
    loss: float
    accuracy: float
    seed: int
    warm: WarmStart | None = None
    state: TrainState | None = None


def _fingerprint(task_config, shape, warm_config) -> dict[str, Any]:
    """What the warm start depends on (not the RL prompts: neither the tokenizer nor the model
    sees them)."""
    task = dataclasses.asdict(task_config)
    del task["eval_samples"]  # evaluation only
    for key in ("kind", "size"):  # added later: a default leaves older warm starts valid
        if task[key] == TaskConfig.__dataclass_fields__[key].default:
            del task[key]
    return {
        "task": task,
        "shape": dataclasses.asdict(shape),
        "warm_start": dataclasses.asdict(warm_config),
    }


def prepare(
    task_config: TaskConfig,
    shape: ModelShape,
    warm_config: WarmStartConfig,
    rl_prompts: int,
    directory: str,
    *,
    eval_max_tokens: int,
    lap=lambda name, since: time.perf_counter(),
) -> Prepared:
    """Task, tokenizer and warm start; written to `directory` (hf/: an HF checkpoint with the
    tokenizer in HF form, `write_hf_tokenizer`; tokenizer.model, warm_start.json) through a temp
    dir and a rename, and read back from it by a rerun with the same settings (anything else
    there is refused)."""
    fingerprint = _fingerprint(task_config, shape, warm_config)
    record = os.path.join(directory, "warm_start.json")
    if os.path.exists(record):
        with open(record, encoding="utf-8") as f:
            saved = json.load(f)
        if saved["settings"] != fingerprint:
            raise ValueError(
                f"{directory} holds a warm start for other settings ({saved['settings']}); "
                "use another --out-dir"
            )
        task = build_task(task_config, shape, rl_prompts)
        task.tokenizer = SentencePieceTokenizer.load(os.path.join(directory, "tokenizer.model"))
        hf_dir = os.path.join(directory, "hf")
        if missing_tokenizer_files(hf_dir):  # a warm start written before hf/ held them
            write_hf_tokenizer(task, hf_dir)
        return Prepared(task, hf_dir, saved["loss"], saved["accuracy"], task_config.seed)
    t = time.perf_counter()
    task = build_task(task_config, shape, rl_prompts)
    t = lap("data_and_tokenizer", t)
    warm = WarmStart(task, warm_config, task_config.seed)
    state, loss = warm.run(warm.initial, warm_config.steps)
    t = lap("warm_start", t)
    accuracy = greedy_accuracy(engine_for(task, warm.graphdef, state.params), task, eval_max_tokens)
    lap("eval_before", t)
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".warm_start.tmp-", dir=parent)
    try:
        save_pretrained(nnx.merge(warm.graphdef, state.params), os.path.join(tmp, "hf"))
        write_hf_tokenizer(task, os.path.join(tmp, "hf"))
        task.tokenizer.save(os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "warm_start.json"), "w", encoding="utf-8") as f:
            json.dump({"settings": fingerprint, "loss": loss, "accuracy": accuracy}, f, indent=2)
        shutil.rmtree(directory, ignore_errors=True)  # a half-written one never has the record
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    hf_dir = os.path.join(directory, "hf")
    return Prepared(task, hf_dir, loss, accuracy, task_config.seed, warm, state)


def write_hf_tokenizer(task: Task, hf_dir: str) -> None:
    """The task's SentencePiece tokenizer as HF tokenizer files in `hf_dir`
    (`export.tokenizer_files.write_spm_files`: transformers' AutoTokenizer and
    `models.tokenizer.load_tokenizer` read them), checked to give SentencePiece's ids on every
    prompt and target text of the task's splits; refused (nothing written) otherwise."""
    from bapo_jax.export.tokenizer_files import write_spm_files

    texts = [
        text
        for source in (task.warm_start, task.rl, task.held_out)
        for text in arith.tokenizer_corpus(source.problems)
    ]
    write_spm_files(
        task.tokenizer,
        hf_dir,
        model_max_length=task.model_config.max_position_embeddings,
        check_texts=texts,
    )


def run_rl(prepared: Prepared, config: RunConfig, out_dir: str, *, lap=None) -> dict[str, Any]:
    """RL from the warm start (`config.model.hf_dir`) through `build_trainer`; the trainer's
    summary, plus, when the engine is not the embedded one, `accuracy_after_embedded`: the
    embedded engine's greedy accuracy with the trainer's final params."""
    lap = lap or (lambda name, since: time.perf_counter())
    task, r = prepared.task, config.trainer.rollout
    os.makedirs(out_dir, exist_ok=True)
    dump(config, os.path.join(out_dir, "config.json"))
    t = time.perf_counter()
    factory = arithmetic_task(task, r.max_response_tokens)
    with build.build_trainer(config, out_dir, task=factory) as trainer:
        t = lap("build", t)
        summary = dict(trainer.run())
        t = lap("rl", t)
        if config.engine.kind != "embedded":
            engine = engine_for(
                task,
                trainer.graphdef,
                trainer.state.params,
                length_bucket=config.engine.length_bucket,
            )
            summary["accuracy_after_embedded"] = greedy_accuracy(
                engine, task, r.max_response_tokens
            )
            lap("eval_after_embedded", t)
    return summary


def run_job(
    task_config: TaskConfig,
    shape: ModelShape,
    warm_config: WarmStartConfig,
    config: RunConfig,
    out_dir: str,
    *,
    control: bool = True,
) -> dict[str, Any]:
    """The whole job (module doc): `config` is the run without its model directory (the warm
    start fills it in); writes and returns summary.json's content. Its summary is the accuracy
    after RL, measured by the loop's last evaluation: trainer.eval_every 0 is refused first."""
    if config.trainer.eval_every < 1:
        raise ValueError(
            "trainer.eval_every must be >= 1 for this job (its summary is the accuracy the "
            f"loop's evaluation of the last step measures), got {config.trainer.eval_every}"
        )
    start = time.perf_counter()
    phases: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        phases[name] = round(now - since, 1)
        print(f"[{now - start:6.1f}s] {name} done in {phases[name]}s", flush=True)
        return now

    trainer_config = config.trainer
    r = trainer_config.rollout
    prepared = prepare(
        task_config,
        shape,
        warm_config,
        trainer_config.steps * r.prompts_per_step,
        os.path.join(out_dir, "warm_start"),
        eval_max_tokens=r.max_response_tokens,
        lap=lap,
    )
    task = prepared.task
    print(
        f"warm start: loss {prepared.loss:.4f}, held-out accuracy {prepared.accuracy:.3f}",
        flush=True,
    )
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, hf_dir=prepared.hf_dir)
    )
    rl_summary = run_rl(prepared, config, out_dir, lap=lap)
    after_embedded = rl_summary.get("accuracy_after_embedded")
    rows = read_rows(out_dir)
    after = rows[-1]["eval/accuracy"]
    summary: dict[str, Any] = {
        "engine": config.engine.kind,
        "accuracy_before": prepared.accuracy,
        "accuracy_after": after,
        "improvement_points": round(100 * (after - prepared.accuracy), 1),
        "evaluated_by": {
            "accuracy_before": "embedded engine, warm-start params",
            "accuracy_after": f"{config.engine.kind} engine, the last synced version",
        },
        "rl_steps": trainer_config.steps,
        "resumed_from": rl_summary["resumed_from"],
        "engine_at_start": rl_summary["engine_at_start"],
        "engine_restarts": rl_summary["engine_restarts"],
        "optimizer_steps": rows[-1]["optimizer_step"],
        "warm_start_steps": warm_config.steps,
        "warm_start_loss": prepared.loss,
        "held_out_problems": len(task.held_out),
        "bapo_bounds": bounds_summary(rows),
        "accuracy_during_rl": {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r},
        **loop_report(rows),
    }
    if rl_summary["eval_at_start"]:
        summary["accuracy_at_start"] = rl_summary["eval_at_start"]["accuracy"]
        summary["evaluated_by"]["accuracy_at_start"] = f"{config.engine.kind} engine, version 0"
    if after_embedded is not None:
        summary["accuracy_after_embedded"] = after_embedded
        summary["evaluated_by"]["accuracy_after_embedded"] = "embedded engine, trainer params"
        summary["engines_differ_points"] = round(100 * abs(after - after_embedded), 1)
    if control:
        t = time.perf_counter()
        summary["control"] = _control(prepared, warm_config, trainer_config)
        lap("control", t)
    summary["phases_s"] = phases
    summary["wall_time_s"] = round(time.perf_counter() - start, 1)
    summary["rl_wall_time_s"] = rl_summary["wall_time_s"]
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return summary


def _control(prepared: Prepared, warm_config: WarmStartConfig, trainer_config) -> dict[str, Any]:
    """Equal compute: RL's updates pushed steps x epochs x rows x (P + L) token positions
    through forward and backward (generation not counted, in the control's favour); the warm
    start continues for as many. A warm start read back from disk is recomputed first (the
    control continues its optimizer state too; same seed, same run)."""
    task, r, a = prepared.task, trainer_config.rollout, trainer_config.algorithm
    warm, state = prepared.warm, prepared.state
    if warm is None:
        warm = WarmStart(task, warm_config, prepared.seed)
        state, _ = warm.run(warm.initial, warm_config.steps)
    positions = (
        trainer_config.steps * a.epochs * r.rows * (r.max_prompt_tokens + r.max_response_tokens)
    )
    steps = math.ceil(positions / warm.tokens_per_step())
    control_state, _ = warm.run(state, steps)
    engine = engine_for(task, warm.graphdef, control_state.params)
    return {
        "what": "supervised continuation of the warm start, RL's token positions",
        "steps": steps,
        "accuracy": greedy_accuracy(engine, task, r.max_response_tokens),
    }
