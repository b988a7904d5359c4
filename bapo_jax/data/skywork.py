"""SkyWork-OR1-RL-Data, the paper's training set, as a JSONL file the own-data path reads.

    hf download Skywork/Skywork-OR1-RL-Data --repo-type dataset --include 'data/math-*' \\
        --local-dir data/skywork
    python -m bapo_jax.data.skywork data/skywork/data/math-*.parquet --out data/skywork_math.jsonl
    python -m experiments.aime_7b --model-dir /models/DeepSeek-R1-Distill-Qwen-7B \\
        data.train=data/skywork_math.jsonl data.messages_key=prompt

The data set (Hugging Face `Skywork/Skywork-OR1-RL-Data`, its `math` split, Parquet) is in
verl's RL layout. The fields this converter relies on, per record:

    prompt        [{"role": "user", "content": "..."}]: the chat prompt verl gives the policy
    reward_model  {"ground_truth": '["8"]', ...}: the accepted answers, a JSON list as text
    extra_info    {"index": 17, "model_difficulty": {...}}: the row's index (its id here)
    ability       "math" (the code split has test cases, not answers)
    data_source   kept when present

Why a conversion: a run compares each response with one gold answer (`rewards`), and the
data set's ground truth is text holding a list. Each output line is

    {"id": "skywork-or1-math-<index>", "prompt": <as given>, "problem": <the user turn's text>,
     "answer": <the first accepted answer>, "answers": <every accepted answer>,
     "ability": "math", "data_source": ..., "extra_info": <as given>}

so `data.messages_key=prompt` trains on the data set's own prompts, as verl does (without it,
the run builds the prompt from `problem` and the prompt style's instruction, docs/data.md).
A record without `prompt` (a non-empty list of {role, content} messages, the last the
user's), `reward_model.ground_truth` (a JSON list of non-empty answers, or one answer as
plain text) or `extra_info.index` (an integer), or whose `ability` is not "math", is refused,
naming its file, row and field; `--skip-bad` leaves such records out and counts them. Every
output row is read back by the own-data reader (`files.parse_row`) before it is written.
Nothing is downloaded here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from bapo_jax.data.datasets import MalformedRowError
from bapo_jax.data.files import DataFileSpec, parse_row

DATASET = "Skywork/Skywork-OR1-RL-Data"
ID_PREFIX = "skywork-or1-math-"
# How a run reads the converted file (the `data.*` keys of the documented command).
SPEC = DataFileSpec("converted.jsonl", messages_key="prompt")


def _field(record: Mapping[str, Any], dotted: str) -> Any:
    node: Any = record
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or node.get(part) is None:
            raise ValueError(f"missing field {dotted!r}")
        node = node[part]
    return node


def _answer_text(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(
            f"field 'reward_model.ground_truth': an answer must be text or a number, got "
            f"{type(value).__name__} {value!r:.80}"
        )
    return (value if isinstance(value, str) else repr(value)).strip()


def accepted_answers(ground_truth: Any) -> list[str]:
    """The accepted answers of `reward_model.ground_truth`: a JSON list as text ('["8"]', the
    data set's form), a list, or one answer as plain text ('\\\\frac{1}{2}')."""
    value = ground_truth
    if isinstance(ground_truth, str):
        try:
            decoded = json.loads(ground_truth)
        except json.JSONDecodeError:
            decoded = None
        value = decoded if isinstance(decoded, list) else ground_truth
    if hasattr(value, "tolist"):  # numpy arrays (pandas-read Parquet)
        value = value.tolist()
    answers = [_answer_text(v) for v in value] if isinstance(value, list) else [_answer_text(value)]
    if not answers or not all(answers):
        raise ValueError(
            f"field 'reward_model.ground_truth' must hold non-empty answers, got "
            f"{ground_truth!r:.80}"
        )
    return answers


def convert_record(record: Any) -> dict[str, Any]:
    """One data set record as a row of the converted file (module doc), or ValueError naming
    the field at fault."""
    if not isinstance(record, Mapping):
        raise ValueError(f"expected an object, got {type(record).__name__}")
    ability = record.get("ability")
    if ability is not None and ability != "math":
        raise ValueError(f"field 'ability' is {ability!r}: only math records have answers")
    prompt = _field(record, "prompt")
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    answers = accepted_answers(_field(record, "reward_model.ground_truth"))
    index = _field(record, "extra_info.index")
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"field 'extra_info.index' must be an integer, got {index!r:.80}")
    row: dict[str, Any] = {"id": f"{ID_PREFIX}{index}", "prompt": prompt}
    row["answer"], row["answers"] = answers[0], answers
    row["ability"] = "math"
    for key in ("data_source", "extra_info"):
        if record.get(key) is not None:
            row[key] = record[key]
    # The run's reader on the row (the prompt's messages and roles, the answer): a row it would
    # refuse is refused here, naming the field.
    parsed = parse_row(row, SPEC, default_id=row["id"])
    row["problem"] = parsed.problem
    return row


@dataclasses.dataclass
class ConvertReport:
    """rows: written; skipped: (where, reason) of refused records (`skip_bad`);
    several_answers: rows whose ground truth lists more than one accepted answer (the run
    scores against the first; all are in the row's `answers`)."""

    rows: int = 0
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    several_answers: int = 0


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """("file:row N" or "file:line", record or the ValueError of a bad JSON line)."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        n = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for record in batch.to_pylist():
                n += 1
                yield f"{path}:row {n}", record
        return
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield f"{path}:{n}", json.loads(line)
                except json.JSONDecodeError as error:
                    yield f"{path}:{n}", ValueError(f"bad JSON: {error}")


def convert_files(
    inputs: Sequence[str | os.PathLike], out: str | os.PathLike, *, skip_bad: bool = False
) -> ConvertReport:
    """Convert the data set's Parquet (or JSONL) files into the JSONL file `out`, in input
    order; MalformedRowError "file:row N: reason" at the first refused record unless
    `skip_bad`. `out` is written whole or not at all."""
    out = Path(out)
    if out.suffix.lower() != ".jsonl":
        raise ValueError(f"--out must be a .jsonl file (what data.train reads), got {str(out)!r}")
    missing = [str(p) for p in inputs if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"input files not found: {missing}")
    report = ConvertReport()
    partial = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with partial.open("w", encoding="utf-8") as f:
            for path in inputs:
                for where, record in _records(Path(path)):
                    try:
                        if isinstance(record, ValueError):
                            raise record
                        row = convert_record(record)
                    except ValueError as error:
                        if not skip_bad:
                            raise MalformedRowError(f"{where}: {error}") from None
                        report.skipped.append((where, str(error)))
                        continue
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    report.rows += 1
                    report.several_answers += len(row["answers"]) > 1
        if report.rows == 0:
            raise MalformedRowError(f"no record converted ({len(report.skipped)} refused)")
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=f"Convert {DATASET}'s math split (Parquet) into the JSONL a run reads with "
        "data.train=OUT data.messages_key=prompt"
    )
    ap.add_argument("inputs", nargs="+", help="the data set's math Parquet files (or JSONL)")
    ap.add_argument("--out", required=True, help="the JSONL file to write")
    ap.add_argument(
        "--skip-bad", action="store_true", help="leave refused records out (counted) not stop"
    )
    args = ap.parse_args(argv)
    try:
        report = convert_files(args.inputs, args.out, skip_bad=args.skip_bad)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        f"{args.out}: {report.rows} rows ({report.several_answers} with more than one accepted "
        f"answer: scored against the first), {len(report.skipped)} records refused"
    )
    for where, reason in report.skipped[:5]:
        print(f"  refused {where}: {reason}")
    print(f"train on it: data.train={args.out} data.messages_key=prompt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
