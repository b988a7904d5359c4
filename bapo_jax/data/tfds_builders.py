"""TFDS dataset builders for the shipped math sets and for user `{problem, answer}` files.

Both write the array_record format, which tensorflow-datasets reads and writes without
TensorFlow (tfds 4.9.10 needs only its own dependencies, `array_record` among them), and
are read back through `tfds.data_source` (random access, what grain wants):

    prepare_shipped("math500", data_dir)                   # once
    source = tfds.data_source("bapo_math/math500", split="test", data_dir=data_dir)

    prepare_files("my_set", {"train": "rows.jsonl"}, data_dir, skip_malformed=True)
    prepare_files("verl_set", {"train": DataFileSpec.verl("train.parquet")}, data_dir)
    source = tfds.data_source("bapo_math_files/my_set", split="train", data_dir=data_dir)

Rows keep their file order (`disable_shuffling`): shuffling is the grain pipeline's job,
seeded and resumable. Each example is {"id", "problem", "answer", "messages", "metadata"},
all text (bytes in the data source): messages is "" (none) or a JSON list of {role,
content}, metadata a JSON object; `decode_example` gives a `MathRow`. A user set records a
fingerprint of its files and column specs; preparing the same name from different files or
specs is an error rather than stale data. Skipped malformed rows are counted in
`info.metadata["skipped_rows"]`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import tensorflow_datasets as tfds
from etils import epath

from bapo_jax.data.datasets import SHIPPED_SETS, MathRow, read_math_rows, shipped_set
from bapo_jax.data.files import DataFileSpec, read_rows

VERSION = tfds.core.Version("1.1.0")
RELEASE_NOTES = {
    "1.0.0": "id, problem, answer.",
    "1.1.0": "messages (JSON chat prompt or empty) and metadata (JSON object) features.",
}
SHIPPED_BUILDER = "bapo_math"
FILES_BUILDER = "bapo_math_files"
_FILE_FORMAT = "array_record"


def _features() -> tfds.features.FeaturesDict:
    text = tfds.features.Text
    return tfds.features.FeaturesDict(
        {
            "id": text(),
            "problem": text(),
            "answer": text(),
            "messages": text(),
            "metadata": text(),
        }
    )


class _CodePathFix:
    """tfds 4.9.10's `DatasetBuilder.code_path` touches `importlib_resources`, a package it
    declares only for Python < 3.9, whenever the builder lives in an installed package; so
    on Python >= 3.9 preparing any packaged builder fails with ModuleNotFoundError. The
    path it wants is simply the file defining the class."""

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(inspect.getfile(cls))


def _examples(rows: list[MathRow]):
    for index, row in enumerate(rows):
        yield (
            index,
            {
                "id": row.id,
                "problem": row.problem,
                "answer": row.answer,
                "messages": "" if row.messages is None else json.dumps(list(row.messages)),
                "metadata": json.dumps(dict(row.metadata), sort_keys=True),
            },
        )


class BapoMath(_CodePathFix, tfds.core.GeneratorBasedBuilder):
    """The shipped sets, one builder config each: aime2024, aime2025, math500, math_l3to5,
    gsm8k. Counts are checked against the registry when a set is prepared."""

    VERSION = VERSION
    RELEASE_NOTES: ClassVar[dict[str, str]] = RELEASE_NOTES
    BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [
        tfds.core.BuilderConfig(name=s.name, description=s.description)
        for s in SHIPPED_SETS.values()
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Math problems with verifiable answers shipped with bapo-jax.",
            features=_features(),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        entry = shipped_set(self.builder_config.name)
        generators = {}
        for split in entry.splits:
            rows, _ = read_math_rows(entry.path(split))
            if len(rows) != entry.counts[split]:
                raise ValueError(
                    f"{entry.path(split)} must have {entry.counts[split]} rows, got {len(rows)}"
                )
            generators[split] = self._generate_examples(rows)
        return generators

    def _generate_examples(self, rows: list[MathRow]):
        return _examples(rows)


@dataclasses.dataclass(eq=False)
class MathFilesConfig(tfds.core.BuilderConfig):
    """A user set: `data_files` maps split -> the `DataFileSpec` of its file."""

    data_files: Mapping[str, DataFileSpec] = dataclasses.field(default_factory=dict)

    def fingerprint(self) -> str:
        """sha256 over each split (sorted): its name, its spec's columns (sorted JSON; not
        the path) and its file's bytes."""
        digest = hashlib.sha256()
        for split in sorted(self.data_files):
            spec = self.data_files[split]
            digest.update(split.encode())
            digest.update(json.dumps(spec.columns(), sort_keys=True).encode())
            with Path(spec.path).open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        return digest.hexdigest()


class BapoMathFiles(_CodePathFix, tfds.core.GeneratorBasedBuilder):
    """User JSONL/Parquet files (`DataFileSpec` columns); pass a `MathFilesConfig` to
    prepare. Reading a prepared set back needs only its name (from the data_dir)."""

    VERSION = VERSION
    RELEASE_NOTES: ClassVar[dict[str, str]] = RELEASE_NOTES

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="User math problems with verifiable answers.",
            features=_features(),
            disable_shuffling=True,
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager):
        config = self.builder_config
        if not isinstance(config, MathFilesConfig):
            raise ValueError(f"config must be a MathFilesConfig, got {type(config).__name__}")
        generators, skipped = {}, {}
        for split, spec in config.data_files.items():
            rows, report = read_rows(spec)
            generators[split] = self._generate_examples(rows)
            skipped[split] = report.num_skipped
        self.info.metadata["skipped_rows"] = skipped
        self.info.metadata["fingerprint"] = config.fingerprint()
        return generators

    def _generate_examples(self, rows: list[MathRow]):
        return _examples(rows)


def prepare_shipped(name: str, data_dir: str | Path) -> tfds.core.DatasetBuilder:
    """Write a shipped set (all its splits) as array_record under `data_dir`; idempotent."""
    shipped_set(name)  # a clear error for an unknown name
    builder = BapoMath(config=name, data_dir=str(data_dir), file_format=_FILE_FORMAT)
    builder.download_and_prepare()
    return builder


def prepare_files(
    name: str,
    data_files: Mapping[str, str | Path | DataFileSpec],
    data_dir: str | Path,
    *,
    skip_malformed: bool = False,
) -> tfds.core.DatasetBuilder:
    """Write user files as the set `bapo_math_files/<name>` under `data_dir`.

    data_files: split -> a path of `{problem, answer}` rows, or a `DataFileSpec` (its own
    columns and on_bad_row). skip_malformed: on_bad_row="skip" for the plain paths.
    Raises ValueError if `name` was already prepared there from different files or flags.
    """
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"name must be letters, digits, '_' or '-', got {name!r}")
    if not data_files:
        raise ValueError("data_files must map at least one split to a file, got none")
    specs = {}
    for split, entry in data_files.items():
        spec = entry
        if not isinstance(entry, DataFileSpec):
            spec = DataFileSpec(str(entry), on_bad_row="skip" if skip_malformed else "error")
        if not Path(spec.path).is_file():
            raise FileNotFoundError(f"data_files[{split!r}] not found: {spec.path!r}")
        specs[split] = spec
    config = MathFilesConfig(name=name, version=VERSION, data_files=specs)
    builder = BapoMathFiles(config=config, data_dir=str(data_dir), file_format=_FILE_FORMAT)
    if builder.is_prepared():
        stored = builder.info.metadata.get("fingerprint")
        if stored != config.fingerprint():
            raise ValueError(
                f"{FILES_BUILDER}/{name} in {data_dir} was prepared from other files or "
                f"flags; choose another name or delete {builder.data_dir}"
            )
    builder.download_and_prepare()
    return builder


def skipped_rows(builder: tfds.core.DatasetBuilder) -> dict[str, int]:
    """Malformed rows skipped per split when a user set was prepared (empty for shipped)."""
    return dict(builder.info.metadata.get("skipped_rows", {})) if builder.info.metadata else {}


def decode_example(example: Mapping[str, bytes | str]) -> MathRow:
    """A data-source example (text features come back as bytes) as a MathRow (sets prepared
    by version 1.0.0 have no messages/metadata: None and {})."""

    def text(value: bytes | str) -> str:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    messages = text(example.get("messages", b""))
    metadata = text(example.get("metadata", b""))
    return MathRow(
        id=text(example["id"]),
        problem=text(example["problem"]),
        answer=text(example["answer"]),
        messages=tuple(json.loads(messages)) if messages else None,
        metadata=json.loads(metadata) if metadata else {},
    )
