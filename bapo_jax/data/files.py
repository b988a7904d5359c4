"""Researchers' own data files: which fields hold what (`DataFileSpec`), and a strict reader.

A data file is JSON Lines (`.jsonl` / `.json`, one object a line) or Parquet. A
`DataFileSpec` names, per row, where the problem, the answer, the id, an optional chat
prompt and the metadata are; `read_rows(spec)` turns each row into a `MathRow`:

    # verl's Parquet layout (prompt = chat messages, reward_model.ground_truth = answer)
    rows, report = read_rows(DataFileSpec.verl("train.parquet"))
    # JSONL with its own column names and a prompt template
    spec = DataFileSpec("mine.jsonl", problem_key="question", answer_key="solution",
                        template="{question}\\nAnswer in \\\\boxed{{}}.", on_bad_row="skip")
    rows, report = read_rows(spec)        # report.num_skipped: rows left out

Keys. A key is a field name; a dotted key walks into nested objects
("reward_model.ground_truth" is `row["reward_model"]["ground_truth"]`; a number picks a
list item: "prompt.0.content"). A field whose own name contains the dot wins over the walk.
A null value counts as missing.

The prompt a row asks, in order of precedence:
  1. `messages_key`: the row holds the chat messages (a list of {"role", "content"}, roles
     system / user / assistant, the last one the user's); used as they are.
  2. `template`: a Python format string over the row's top-level fields (plus `problem`,
     the text at `problem_key`) giving the user turn, e.g. "{question}\\nAnswer in
     \\\\boxed{{}}." (literal braces doubled; nested values as `{extra_info[split]}`).
  3. neither: `build_messages(problem, style)`, the problem plus the prompt style's boxed
     instruction (what shipped sets get).
In all cases the model's chat template renders the messages (`prompts.render_prompt`), and
the style's response prefix (r1_distill: "<think>\\n") is added as usual. With 1 or 2, the
row's `MathRow.messages` holds the messages and `problem` may be absent (it is then the
text of the last user turn, which logs and reports show).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import string
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from bapo_jax.data.datasets import MalformedRowError, MathRow, ReadReport
from bapo_jax.data.prompts import Message, PromptStyle, build_messages, prompt_style

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
# Metadata copied when present (verl's row fields) unless `metadata_keys` names others.
DEFAULT_METADATA_KEYS = ("data_source", "ability", "extra_info")
ROLES = ("system", "user", "assistant")
_MISSING = object()


class DataSpecError(ValueError):
    """A `DataFileSpec` field that cannot work; `field` names it (the message starts with it)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _check_key(field: str, key: Any, optional: bool = False) -> None:
    if key is None and optional:
        return
    if not isinstance(key, str) or not key or not all(key.split(".")):
        raise DataSpecError(field, f"a field name or dotted key like 'a.b', got {key!r}")


@functools.lru_cache(maxsize=64)
def template_fields(template: str) -> tuple[str, ...]:
    """The top-level row fields `template` uses ("{extra_info[split]}" -> "extra_info");
    DataSpecError("template", ...) when it is not a usable format string."""
    if not isinstance(template, str) or not template.strip():
        raise DataSpecError("template", f"a non-empty format string, got {template!r}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise DataSpecError(
            "template", f"{error} in {template!r} (write {{{{ and }}}} for literal braces)"
        ) from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        head = name.split(".", 1)[0].split("[", 1)[0]
        if not head or head.isdigit():
            raise DataSpecError(
                "template",
                f"{{{name}}} is a positional field; name a row field like {{question}}, and "
                f"write {{{{}}}} for literal braces (\\boxed{{{{}}}}), in {template!r}",
            )
        fields.append(head)
    if not fields:
        raise DataSpecError(
            "template", f"uses no row field, so every row would ask the same: {template!r}"
        )
    return tuple(dict.fromkeys(fields))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileColumns:
    """Where a data file's rows keep what a `MathRow` needs (keys: see the module doc); the
    fields `DataFileSpec` and the run config's data and eval sections share.

    problem_key: the problem text. Required unless the prompt comes from `messages_key` or
      `template` (then, when absent, the text of the user turn).
    answer_key: the gold answer, a string or an integer (33 -> "33"); verl:
      "reward_model.ground_truth".
    id_key: the row's id (string or integer); when absent (or id_key None) the id is
      "<file stem>-<line>" (Parquet: "<file stem>-<row number>").
    messages_key: None, or the chat prompt: a list of {"role", "content"} (verl: "prompt").
    template: None, or the user turn as a format string over the row's fields (module doc);
      excludes `messages_key`.
    metadata_keys: fields copied into `MathRow.metadata` under their key, for reward
      plug-ins; their values must be JSON-able. None: "data_source", "ability" and
      "extra_info" when present (verl's). A tuple: exactly those, each required.
    on_bad_row: "error": the first bad row raises `MalformedRowError` naming the file and
      line (Parquet: "row N") and the field at fault; "skip": bad rows are left out and
      listed in the `ReadReport` (a file with no good row is still an error).
    """

    problem_key: str = "problem"
    answer_key: str = "answer"
    id_key: str | None = "id"
    messages_key: str | None = None
    template: str | None = None
    metadata_keys: tuple[str, ...] | None = None
    on_bad_row: Literal["error", "skip"] = "error"


COLUMN_FIELDS = tuple(f.name for f in dataclasses.fields(FileColumns))


@dataclasses.dataclass(frozen=True)
class DataFileSpec(FileColumns):
    """A data file (`path`: the `.jsonl` / `.json` / `.parquet` file) and where its rows keep
    what a `MathRow` needs (`FileColumns`, keyword-only)."""

    path: str

    def __post_init__(self):
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise DataSpecError("path", f"a file path, got {self.path!r}")
        object.__setattr__(self, "path", os.fspath(self.path))
        if Path(self.path).suffix.lower() not in DATA_SUFFIXES:
            raise DataSpecError(
                "path", f"must end in .jsonl, .json or .parquet, got {str(self.path)!r}"
            )
        _check_key("problem_key", self.problem_key)
        _check_key("answer_key", self.answer_key)
        _check_key("id_key", self.id_key, optional=True)
        _check_key("messages_key", self.messages_key, optional=True)
        if self.template is not None:
            if not isinstance(self.template, str):
                raise DataSpecError("template", f"a format string, got {self.template!r}")
            template_fields(self.template)
            if self.messages_key is not None:
                raise DataSpecError(
                    "template",
                    f"the prompt comes from messages_key={self.messages_key!r} or from a "
                    "template, not both",
                )
        if self.metadata_keys is not None:
            if isinstance(self.metadata_keys, str):
                raise DataSpecError("metadata_keys", f"a list of keys, got {self.metadata_keys!r}")
            object.__setattr__(self, "metadata_keys", tuple(self.metadata_keys))
            for key in self.metadata_keys:
                _check_key("metadata_keys", key)
        if self.on_bad_row not in ("error", "skip"):
            raise DataSpecError("on_bad_row", f"'error' or 'skip', got {self.on_bad_row!r}")

    @classmethod
    def verl(cls, path: str | os.PathLike, **changes: Any) -> DataFileSpec:
        """verl's RL Parquet layout: `prompt` (chat messages), `reward_model.ground_truth`
        (answer), `data_source`, `ability`, `extra_info` (metadata); `changes` override."""
        fields = {"messages_key": "prompt", "answer_key": "reward_model.ground_truth"}
        return cls(path, **{**fields, **changes})

    def columns(self) -> dict[str, Any]:
        """Every field but `path` (JSON-able): what a prepared set's fingerprint records."""
        out = dataclasses.asdict(self)
        out.pop("path")
        if out["metadata_keys"] is not None:
            out["metadata_keys"] = list(out["metadata_keys"])
        return out


# ---- one row ---------------------------------------------------------------------------------


def _lookup(record: Mapping[str, Any], key: str) -> tuple[Any, str]:
    """(value, "") or (_MISSING, what is missing), following a dotted key."""
    if key in record:
        return (_MISSING, "") if record[key] is None else (record[key], "")
    node, walked = record, []
    for part in key.split("."):
        where = repr(".".join(walked)) if walked else "the row"
        if isinstance(node, Mapping):
            if part not in node:
                fields = ", ".join(map(str, node)) or "none"
                return _MISSING, f" ({where} has no {part!r}; its fields: {fields})"
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit():
            if int(part) >= len(node):
                return _MISSING, f" ({where} has {len(node)} items)"
            node = node[int(part)]
        else:
            return _MISSING, f" ({where} is a {type(node).__name__}, not an object)"
        if node is None:
            return _MISSING, ""
        walked.append(part)
    return node, ""


def _text_or_int(value: Any, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(
            f"field {key!r} must be a string or an integer, got {type(value).__name__} "
            f"{value!r:.80} (write non-integer numbers as strings)"
        )
    return str(value).strip()


def _messages(value: Any, key: str) -> tuple[Message, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            f"field {key!r} must be a non-empty list of {{role, content}} messages, got "
            f"{type(value).__name__} {value!r:.80}"
        )
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise ValueError(f"field {key!r}: message {i} is a {type(message).__name__}, not {{}}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(
                f"field {key!r}: message {i} role must be one of {ROLES}, got {role!r}"
            )
        if not isinstance(content, str) or (role == "user" and not content.strip()):
            raise ValueError(
                f"field {key!r}: message {i} content must be text, got {content!r:.80}"
            )
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] != "user":
        raise ValueError(
            f"field {key!r}: the last message must be the user's (the model answers it), "
            f"got role {messages[-1]['role']!r}"
        )
    return tuple(messages)


def _render(template: str, record: Mapping[str, Any], problem: Any) -> str:
    fields = dict(record)
    if problem is not _MISSING:
        fields["problem"] = problem
    for name in template_fields(template):
        if fields.get(name) is None:
            raise ValueError(f"template field {name!r} is missing or null in the row")
    try:
        text = template.format_map(fields)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as error:
        raise ValueError(f"template {template!r:.80} does not fit the row: {error!r}") from None
    if not text.strip():
        raise ValueError("template gives an empty prompt for the row")
    return text


def _json_value(value: Any, key: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        raise ValueError(
            f"metadata field {key!r} must be JSON-able, got {type(value).__name__} {value!r:.80}"
        ) from None


def parse_row(record: Any, spec: DataFileSpec, default_id: str) -> MathRow:
    """A MathRow from one decoded row, or ValueError saying which field is wrong (no file
    location: `read_rows` adds it)."""
    if not isinstance(record, Mapping):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    messages = None
    if spec.messages_key is not None:
        value, why = _lookup(record, spec.messages_key)
        if value is _MISSING:
            raise ValueError(f"missing field {spec.messages_key!r}{why}")
        messages = _messages(value, spec.messages_key)
    problem, why = _lookup(record, spec.problem_key)
    if spec.template is not None:
        messages = ({"role": "user", "content": _render(spec.template, record, problem)},)
    if problem is _MISSING:
        if messages is None:
            raise ValueError(f"missing field {spec.problem_key!r}{why}")
        problem = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(
            f"field {spec.problem_key!r} must be a non-empty string, got {problem!r:.80}"
        )
    answer, why = _lookup(record, spec.answer_key)
    if answer is _MISSING:
        raise ValueError(f"missing field {spec.answer_key!r}{why}")
    answer = _text_or_int(answer, spec.answer_key)
    if not answer:
        raise ValueError(f"field {spec.answer_key!r} is empty")
    row_id = default_id
    if spec.id_key is not None:
        value, _ = _lookup(record, spec.id_key)
        row_id = default_id if value is _MISSING else _text_or_int(value, spec.id_key)
    metadata = {}
    for key in spec.metadata_keys if spec.metadata_keys is not None else DEFAULT_METADATA_KEYS:
        value, why = _lookup(record, key)
        if value is _MISSING:
            if spec.metadata_keys is not None:
                raise ValueError(f"missing metadata field {key!r}{why}")
            continue
        metadata[key] = _json_value(value, key)
    return MathRow(id=row_id, problem=problem, answer=answer, messages=messages, metadata=metadata)


# ---- files -----------------------------------------------------------------------------------


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, record or the ValueError of a line that is not JSON) for each line."""
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline) are not rows
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as error:
                yield line_no, ValueError(f"bad JSON: {error}")


def _parquet_records(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            n += 1
            yield n, record


def read_rows(spec: DataFileSpec) -> tuple[list[MathRow], ReadReport]:
    """Read and validate every row of `spec.path` (see `DataFileSpec`).

    Returns (rows in file order, report: rows kept, skipped (line, reason) with
    on_bad_row="skip", `report.num_skipped`). Raises FileNotFoundError for a missing file,
    MalformedRowError "file:line: reason" ("file:row N: reason" for Parquet) for a bad row
    with on_bad_row="error", and for a file without one good row.
    """
    path = Path(spec.path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {str(path)!r}")
    if path.suffix.lower() == ".parquet":
        records, where = _parquet_records(path), "{path}:row {n}"
    else:
        records, where = _jsonl_records(path), "{path}:{n}"
    rows: list[MathRow] = []
    report = ReadReport(path=str(path))
    for n, record in records:
        try:
            if isinstance(record, ValueError):
                raise record
            rows.append(parse_row(record, spec, default_id=f"{path.stem}-{n}"))
        except ValueError as error:
            if spec.on_bad_row == "error":
                raise MalformedRowError(f"{where.format(path=path, n=n)}: {error}") from None
            report.skipped.append((n, str(error)))
    report.rows = len(rows)
    if not rows:
        first = ""
        if report.skipped:
            n, reason = report.skipped[0]
            first = f"; first, {where.format(path=path.name, n=n)}: {reason}"
        raise MalformedRowError(f"{path}: no valid rows ({report.num_skipped} malformed){first}")
    return rows, report


def prompt_messages(
    row: MathRow, style: PromptStyle | str, *, system_prompt: str | None = None
) -> list[Message]:
    """The chat messages a row asks: its own `messages` (a file's chat prompt or rendered
    template; `system_prompt`, if given, goes first when they have no system message), else
    `build_messages(row.problem, style, system_prompt=...)`."""
    if not row.messages:
        return build_messages(row.problem, style, system_prompt=system_prompt)
    messages = [dict(m) for m in row.messages]
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        if not prompt_style(style).allow_system_prompt:
            build_messages(row.problem, style, system_prompt=system_prompt)  # its clear error
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


# The `DataFileSpec` fields a config section or CLI sets for a file (all but `path`).


def spec_with_columns(
    path: str | os.PathLike, columns: Any, *, shipped: bool = False
) -> DataFileSpec:
    """A DataFileSpec of `path` with the `COLUMN_FIELDS` of `columns` (any object with those
    attributes: `run.config.DataSection`, `EvalSection`). `shipped`: a shipped set's file,
    read with its own layout; only `template` and `on_bad_row` apply."""
    names = ("template", "on_bad_row") if shipped else COLUMN_FIELDS
    return DataFileSpec(path, **{name: getattr(columns, name) for name in names})
