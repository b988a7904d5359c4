"""`python -m bapo_jax.eval`: sample k responses per problem, score them, write the report.

    python -m bapo_jax.eval --benchmark aime2024 --k 16 --engine embedded \\
        --model-dir /models/Qwen2.5-Math-7B --max-tokens 8192 --out-dir runs/eval/aime24
    python -m bapo_jax.eval --benchmark aime2024 --k 16 --engine vllm \\
        --vllm-url http://127.0.0.1:8000 --vllm-url http://127.0.0.1:8001 \\
        --model-dir /models/Qwen2.5-Math-7B --out-dir runs/eval/aime24
    python -m bapo_jax.eval --benchmark aime2024 --tiny-random --limit 3 --k 2 \\
        --max-tokens 8 --out-dir /tmp/eval-smoke          # random weights: smoke test only
    python -m bapo_jax.eval --benchmark aime2024 --run runs/my_run --step 40 --k 4 \\
        --out-dir runs/eval/my_run-40                     # a run's checkpoint, embedded
    python -m bapo_jax.eval --benchmark aime2024 --run runs/my_run --engine vllm \\
        --launch-servers 2 --out-dir runs/eval/my_run     # exported to a temp dir, served here

Problems are rendered with the model's chat template (`--prompt-style`), sampled in chunks of
`--batch-size` prompts (k samples each; chunk i uses a seed derived from `--seed` and i, so the
same seed and batch size give the same report), decoded, and scored by `math_reward` in a
time-bounded worker pool. Writes `eval.json` + `eval.md` (and `samples.jsonl` with
`--save-responses`) into `--out-dir`; see `bapo_jax.eval.report` for the layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from bapo_jax.data.datasets import SHIPPED_SETS, MalformedRowError, MathRow
from bapo_jax.data.files import DataFileSpec, DataSpecError, prompt_messages, read_rows
from bapo_jax.data.prompts import PROMPT_STYLES, render_prompt
from bapo_jax.eval import model_source
from bapo_jax.eval.report import ProblemResult, build_report, write_report, write_samples
from bapo_jax.eval.usage import UsageError
from bapo_jax.rewards.boxed import extract_last_boxed
from bapo_jax.rewards.plugins import BUILTIN_REWARDS, MATH_VERIFY, PluginError, load_plugin
from bapo_jax.rewards.pool import RewardPool
from bapo_jax.rollout.types import RolloutEngine, SamplingParams

# Shipped sets with a test split; gsm8k means its test split.
BENCHMARKS = tuple(sorted(name for name, s in SHIPPED_SETS.items() if "test" in s.splits))
PAPER_TEMPERATURE = 0.6  # BAPO paper (and DeepSeek-R1 usage notes) evaluation temperature


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bapo_jax.eval", description="avg@k / pass@k / maj@k on a math benchmark"
    )
    ap.add_argument(
        "--benchmark",
        required=True,
        help=f"one of {', '.join(BENCHMARKS)} (test split), or a .jsonl/.parquet file of "
        "{problem, answer} rows (other layouts: the column flags below)",
    )
    files = ap.add_argument_group(
        "benchmark file columns",
        "how a --benchmark file is read (bapo_jax.data.files.DataFileSpec; dotted keys walk "
        "into nested fields). Shipped sets have their own layout: only --template and "
        "--on-bad-row apply to them.",
    )
    files.add_argument("--problem-key", default=None, help="the problem text (default problem)")
    files.add_argument(
        "--answer-key",
        default=None,
        help="the answer (default answer; verl: reward_model.ground_truth)",
    )
    files.add_argument("--id-key", default=None, help="the row id (default id; else <stem>-<line>)")
    files.add_argument(
        "--messages-key",
        default=None,
        help="a list of {role, content} used as the prompt (verl: prompt)",
    )
    files.add_argument(
        "--template",
        default=None,
        help="the user turn as a format string over the row's fields, e.g. "
        "'{question} Answer in \\boxed{{}}.' (JSON-quoted for escapes: '\"...\\n...\"')",
    )
    files.add_argument(
        "--on-bad-row",
        choices=("error", "skip"),
        default="error",
        help="error: stop at the first bad row; skip: leave bad rows out (counted in the report)",
    )
    ap.add_argument("--k", type=int, default=16, help="samples per problem")
    ap.add_argument("--engine", choices=("embedded", "vllm"), default="embedded")
    ap.add_argument("--model-dir", default=None, help="HF checkpoint directory")
    ap.add_argument(
        "--tiny-random",
        action="store_true",
        help="embedded engine only, no --model-dir: a tiny randomly initialised Qwen2 "
        "(smoke tests; scores ~0)",
    )
    ap.add_argument(
        "--tokenizer-dir",
        default=None,
        help="default: --model-dir, or the run's (shipped Qwen2.5 if tiny)",
    )
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--vllm-url", action="append", default=[], help="repeatable")
    ap.add_argument("--vllm-model", default=None, help="served model name (default --model-dir)")
    model_source.add_flags(ap)  # --run/--step, --launch-servers and the launched servers' flags
    ap.add_argument("--temperature", type=float, default=PAPER_TEMPERATURE)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=8192, help="new tokens per response")
    ap.add_argument("--prompt-style", choices=sorted(PROMPT_STYLES), default="qwen_math")
    ap.add_argument("--limit", type=int, default=None, help="evaluate the first N problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=None, help="prompts per generate call")
    ap.add_argument("--reward-workers", type=int, default=None)
    ap.add_argument("--reward-timeout", type=float, default=10.0, help="seconds per check")
    ap.add_argument(
        "--reward",
        default=MATH_VERIFY,
        help="what scores a response: math_verify (default), exact_match, or a plug-in "
        "package.module:function (docs/rewards.md); a response is correct when it scores > 0.5",
    )
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--save-responses", action="store_true", help="also write samples.jsonl")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def validate_args(args: argparse.Namespace) -> None:
    """Early, named errors for every bad value (before any model is loaded)."""
    _require(args.k >= 1, f"--k must be >= 1, got {args.k}")
    _require(args.max_tokens >= 1, f"--max-tokens must be >= 1, got {args.max_tokens}")
    _require(args.temperature > 0, f"--temperature must be > 0, got {args.temperature}")
    _require(0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}")
    _require(args.limit is None or args.limit >= 1, f"--limit must be >= 1, got {args.limit}")
    _require(
        args.batch_size is None or args.batch_size >= 1,
        f"--batch-size must be >= 1, got {args.batch_size}",
    )
    _require(
        args.reward_workers is None or args.reward_workers >= 1,
        f"--reward-workers must be >= 1, got {args.reward_workers}",
    )
    _require(args.reward_timeout > 0, f"--reward-timeout must be > 0, got {args.reward_timeout}")
    try:
        if args.reward not in BUILTIN_REWARDS:
            load_plugin(args.reward)
    except PluginError as error:
        raise UsageError(str(error).replace("rewards.fn=", "--reward ", 1)) from None
    model_source.validate(args)  # --model-dir / --run / --tiny-random, engine and servers
    if args.tokenizer_dir is not None:
        _require(
            Path(args.tokenizer_dir).is_dir(),
            f"--tokenizer-dir must be an existing directory, got {args.tokenizer_dir!r}",
        )


def resolve_benchmark(spec: str) -> tuple[str, Path]:
    """(name, data file) of a shipped benchmark name or a user file path."""
    if spec in SHIPPED_SETS:
        _require(spec in BENCHMARKS, f"--benchmark {spec!r} has no test split; use {BENCHMARKS}")
        return spec, SHIPPED_SETS[spec].path("test")
    path = Path(spec)
    if path.suffix.lower() in (".jsonl", ".json", ".parquet"):
        _require(path.is_file(), f"--benchmark file does not exist: {spec!r}")
        return path.stem, path
    raise UsageError(
        f"--benchmark must be one of {list(BENCHMARKS)} or a path to a .jsonl/.parquet file, "
        f"got {spec!r}"
    )


_KEY_FLAGS = ("problem_key", "answer_key", "id_key", "messages_key")


def benchmark_spec(args: argparse.Namespace, data_path: Path) -> DataFileSpec:
    """How `data_path` is read, from the column flags (a shipped benchmark: its own layout,
    with --template and --on-bad-row). UsageError names the flag at fault."""
    given = {key: getattr(args, key) for key in _KEY_FLAGS if getattr(args, key) is not None}
    if args.benchmark in SHIPPED_SETS and given:
        flag = "--" + next(iter(given)).replace("_", "-")
        raise UsageError(
            f"{flag} describes the columns of a --benchmark file; {args.benchmark!r} is a "
            "shipped set with its own layout"
        )
    template = args.template
    if template is not None and len(template) >= 2 and template[0] == template[-1] == '"':
        try:
            template = json.loads(template)
        except json.JSONDecodeError as error:
            raise UsageError(f"--template is not a JSON string: {error}") from None
    try:
        return DataFileSpec(str(data_path), template=template, on_bad_row=args.on_bad_row, **given)
    except DataSpecError as error:
        flag = "--" + error.field.replace("_", "-")
        raise UsageError(f"{flag}{str(error).removeprefix(error.field)}") from None


# ---- model, tokenizer, engine ----------------------------------------------------------------


def _eos_ids(tokenizer, model_dir: str | None, config_eos: Any) -> tuple[int, ...]:
    """Every id that ends a response: the tokenizer's eos, config.json's and
    generation_config.json's eos_token_id (instruct models list both <|im_end|> and
    <|endoftext|> there)."""
    ids = {int(tokenizer.eos_id)}
    for value in (config_eos, _generation_config_eos(model_dir)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(i) for i in value)
    return tuple(sorted(ids))


def _generation_config_eos(model_dir: str | None) -> Any:
    if model_dir is None:
        return None
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")


def tiny_random_model(vocab_size: int, eos_id: int, seed: int):
    """A 2-layer, 64-wide Qwen2 ("tiny-tied") with random weights, room for `vocab_size`
    token ids and the tokenizer's eos. For smoke tests only: its answers are noise."""
    from bapo_jax.models import Qwen2Config, init_model

    padded_vocab = -(-vocab_size // 128) * 128
    config = Qwen2Config.preset("tiny-tied").replace(
        vocab_size=padded_vocab,
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=eos_id,
    )
    return init_model(config, seed=seed)


class EngineSetup(NamedTuple):
    """engine; ids that end a response; what the model is; its context length (None: the
    server's business)."""

    engine: RolloutEngine
    stop_ids: tuple[int, ...]
    description: str
    max_context: int | None


def build_engine(args: argparse.Namespace, tokenizer) -> EngineSetup:
    """The engine and what the run needs to know about it, from the validated arguments."""
    if model_source.uses_model_source(args):  # a run's checkpoint, or servers launched here
        return EngineSetup(*model_source.build_engine(args, tokenizer))
    if args.engine == "vllm":
        from bapo_jax.rollout import run_secret
        from bapo_jax.rollout.vllm_client import VLLMClientConfig, VLLMEngine

        config_eos = None
        if args.model_dir is not None and (Path(args.model_dir) / "config.json").is_file():
            config_eos = json.loads((Path(args.model_dir) / "config.json").read_text()).get(
                "eos_token_id"
            )
        served = args.vllm_model or args.model_dir
        token = run_secret.token_from_env()  # servers started with the run's secret
        engine = VLLMEngine(VLLMClientConfig(urls=tuple(args.vllm_url), model=served, token=token))
        eos = _eos_ids(tokenizer, args.model_dir, config_eos)
        return EngineSetup(engine, eos, f"vllm:{served}", None)

    import jax.numpy as jnp

    from bapo_jax.models import Qwen2Config, load_pretrained
    from bapo_jax.rollout.embedded import EmbeddedEngine

    if args.tiny_random:
        model = tiny_random_model(tokenizer.vocab_size, tokenizer.eos_id, args.seed)
        description = f"tiny-random(seed={args.seed})"
    else:
        vocab_size = Qwen2Config.from_hf(args.model_dir).vocab_size  # checked before loading
        _require(
            tokenizer.vocab_size <= vocab_size,
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{vocab_size} (--tokenizer-dir / --model-dir mismatch)",
        )
        model = load_pretrained(args.model_dir, dtype=jnp.dtype(args.dtype))
        description = str(args.model_dir)
    model_dir = None if args.tiny_random else args.model_dir
    eos = _eos_ids(tokenizer, model_dir, model.config.eos_token_id)
    engine = EmbeddedEngine(model, eos_token_ids=eos, pad_token_id=tokenizer.pad_id)
    return EngineSetup(engine, eos, description, model.config.max_position_embeddings)


# ---- the run ---------------------------------------------------------------------------------


class Progress:
    """A progress bar over problems on stderr: tqdm when installed, else a plain line."""

    def __init__(self, total: int, enabled: bool = True, desc: str = "eval"):
        self.total, self.done, self.enabled, self.desc = total, 0, enabled, desc
        self._start = time.monotonic()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit="problem", file=sys.stderr)

    def update(self, count: int) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
        elif self.enabled:
            elapsed = time.monotonic() - self._start
            print(
                f"\r{self.desc}: {self.done}/{self.total} problems "
                f"({100 * self.done / max(self.total, 1):.0f}%) {elapsed:.1f}s",
                end="\n" if self.done >= self.total else "",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def chunk_seed(seed: int, chunk_index: int) -> int:
    """The sampling seed of chunk `chunk_index` (independent streams, in [0, 2^31))."""
    state = np.random.SeedSequence([seed & 0xFFFFFFFF, chunk_index]).generate_state(1)
    return int(state[0] & 0x7FFFFFFF)


def evaluate(
    engine: RolloutEngine,
    tokenizer,
    rows: Sequence[MathRow],
    *,
    k: int,
    sampling: SamplingParams,
    prompt_style: str,
    seed: int,
    batch_size: int,
    pool: RewardPool,
    progress: Progress | None = None,
    max_context: int | None = None,
    reward: str = MATH_VERIFY,
) -> list[ProblemResult]:
    """Sample `k` responses for each row (chunks of `batch_size` prompts), decode and score.

    A row's prompt is its own `messages` when it has them (a file's chat prompt or template),
    else `build_messages(problem, prompt_style)`; the chat template renders it. Responses are
    decoded without special tokens; the extracted answer is the last complete `\\boxed{}`
    (None without one); `pool` scores each response against the row's answer.
    With `max_context`, prompts that cannot hold `max_tokens` more tokens are counted in a
    warning on stderr (RoPE runs past the trained context, but the model was not trained there).
    """
    _require(k >= 1, f"k must be >= 1, got {k}")
    _require(batch_size >= 1, f"batch_size must be >= 1, got {batch_size}")
    prompts = [
        render_prompt(prompt_messages(r, prompt_style), tokenizer, prompt_style) for r in rows
    ]
    if max_context is not None:
        over = sum(len(p) + sampling.max_tokens > max_context for p in prompts)
        if over:
            print(
                f"warning: {over} of {len(prompts)} prompts + max_tokens={sampling.max_tokens} "
                f"exceed the model's max_position_embeddings={max_context}",
                file=sys.stderr,
            )
    results: list[ProblemResult] = []
    for chunk, start in enumerate(range(0, len(rows), batch_size)):
        chunk_rows = rows[start : start + batch_size]
        rollout = engine.generate(
            prompts[start : start + batch_size], k, sampling, chunk_seed(seed, chunk)
        )
        texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in rollout.samples]
        golds = [chunk_rows[s.prompt_index].answer for s in rollout.samples]
        metadata = [chunk_rows[s.prompt_index].metadata for s in rollout.samples]
        scores = pool.score_batch(texts, golds, metadata, reward=reward)  # [C * k]
        for p, row in enumerate(chunk_rows):
            picked = range(p * k, (p + 1) * k)
            results.append(
                ProblemResult(
                    problem_id=row.id,
                    gold=row.answer,
                    responses=tuple(texts[i] for i in picked),
                    answers=tuple(extract_last_boxed(texts[i]) for i in picked),
                    correct=tuple(float(scores[i] > 0.5) for i in picked),
                    scores=tuple(float(scores[i]) for i in picked),
                    lengths=tuple(len(rollout.samples[i].token_ids) for i in picked),
                    finish_reasons=tuple(rollout.samples[i].finish_reason for i in picked),
                )
            )
        if progress is not None:
            progress.update(len(chunk_rows))
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the evaluation; returns the report dict (also written to `--out-dir`)."""
    args = build_parser().parse_args(argv)
    validate_args(args)
    name, data_path = resolve_benchmark(args.benchmark)
    spec = benchmark_spec(args, data_path)
    rows, read_report = read_rows(spec)
    if read_report.num_skipped:
        n, reason = read_report.skipped[0]
        where = f"row {n}" if data_path.suffix.lower() == ".parquet" else f"line {n}"
        print(
            f"warning: skipped {read_report.num_skipped} bad rows of {data_path} (first, "
            f"{where}: {reason})",
            file=sys.stderr,
        )
    if args.limit is not None:
        rows = rows[: args.limit]

    from bapo_jax.models.tokenizer import load_tokenizer

    tokenizer_dir = model_source.tokenizer_dir(args)  # --tokenizer-dir, --model-dir, the run's
    tokenizer = load_tokenizer(tokenizer_dir)
    t0 = time.monotonic()
    engine, stop_ids, model_description, max_context = build_engine(args, tokenizer)
    load_s = time.monotonic() - t0
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        stop_token_ids=stop_ids,
    )
    batch_size = args.batch_size or (8 if args.engine == "embedded" else 64)
    config = {
        "benchmark": name,
        "data": str(data_path),
        "data_columns": spec.columns(),
        "skipped_rows": read_report.num_skipped,
        "num_problems": len(rows),
        "limit": args.limit,
        "engine": args.engine,
        "model": model_description,
        "tokenizer": str(tokenizer_dir) if tokenizer_dir else "shipped qwen2.5",
        "k": args.k,
        "sampling": dataclasses.asdict(sampling),
        "prompt_style": args.prompt_style,
        "seed": args.seed,
        "batch_size": batch_size,
        "reward": args.reward,
        "reward_timeout_s": args.reward_timeout,
    }
    progress = Progress(len(rows), enabled=not args.no_progress, desc=f"eval {name}")
    try:
        plugin = None if args.reward in BUILTIN_REWARDS else args.reward
        with RewardPool(args.reward_workers, plugin=plugin, timeout_s=args.reward_timeout) as pool:
            t0 = time.monotonic()
            results = evaluate(
                engine,
                tokenizer,
                rows,
                k=args.k,
                sampling=sampling,
                prompt_style=args.prompt_style,
                seed=args.seed,
                batch_size=batch_size,
                pool=pool,
                progress=progress,
                max_context=max_context,
                reward=args.reward,
            )
            run_s = time.monotonic() - t0
            rewards = dataclasses.asdict(pool.stats)
    finally:
        progress.close()
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    report = build_report(
        results,
        config,
        rewards=rewards,
        wall_s={"load": round(load_s, 3), "generate_and_score": round(run_s, 3)},
    )
    json_path, md_path = write_report(report, args.out_dir)
    if args.save_responses:
        write_samples(results, Path(args.out_dir) / "samples.jsonl")
    metrics = report["summary"]["metrics"]
    print(
        f"{name}: "
        + ", ".join(f"{key} {100 * value:.2f}" for key, value in metrics.items() if "@" in key)
        + f" -> {json_path}, {md_path}",
        file=sys.stderr,
    )
    return report


if __name__ == "__main__":
    try:
        main()
    except (UsageError, MalformedRowError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
