"""TFDS dataset builders for the shipped math sets and for user `{problem, answer}` files.

Both write the array_record format, which tensorflow-datasets reads and writes without
TensorFlow (tfds 4.9.10 needs only its own dependencies, `array_record` among them), and
are read back through `tfds.data_source` (random access, what grain wants):

    prepare_shipped("math500", data_dir)                   # once
    source = tfds.data_source("bapo_math/math500", split="test", data_dir=data_dir)

    prepare_files("my_set", {"train": "rows.jsonl"}, data_dir, skip_malformed=True)
    source = tfds.data_source("bapo_math_files/my_set", split="train", data_dir=data_dir)

Rows keep their file order (`disable_shuffling`): shuffling is the grain pipeline's job,
seeded and resumable. Each example is {"id", "problem", "answer"}, all text (bytes in the
data source; `decode_example` gives a `MathRow`). A user set records a fingerprint of its
files; preparing the same name from different files is an error rather than stale data.
Skipped malformed rows are counted in `info.metadata["skipped_rows"]`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import tensorflow_datasets as tfds
from etils import epath

from bapo_jax.data.datasets import SHIPPED_SETS, MathRow, read_math_rows, shipped_set

VERSION = tfds.core.Version("1.0.0")
SHIPPED_BUILDER = "bapo_math"
FILES_BUILDER = "bapo_math_files"
_FILE_FORMAT = "array_record"


def _features() -> tfds.features.FeaturesDict:
    text = tfds.features.Text
    return tfds.features.FeaturesDict({"id": text(), "problem": text(), "answer": text()})


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
        yield index, {"id": row.id, "problem": row.problem, "answer": row.answer}


class BapoMath(_CodePathFix, tfds.core.GeneratorBasedBuilder):
    """The shipped sets, one builder config each: aime2024, aime2025, math500, math_l3to5,
    gsm8k. Counts are checked against the registry when a set is prepared."""

    VERSION = VERSION
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
    """A user set: `data_files` maps split -> .jsonl/.parquet path."""

    data_files: Mapping[str, str] = dataclasses.field(default_factory=dict)
    skip_malformed: bool = False

    def fingerprint(self) -> str:
        digest = hashlib.sha256(f"skip_malformed={self.skip_malformed}".encode())
        for split in sorted(self.data_files):
            digest.update(split.encode())
            with Path(self.data_files[split]).open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        return digest.hexdigest()


class BapoMathFiles(_CodePathFix, tfds.core.GeneratorBasedBuilder):
    """User JSONL/Parquet files of `{problem, answer}` rows; pass a `MathFilesConfig` to
    prepare. Reading a prepared set back needs only its name (from the data_dir)."""

    VERSION = VERSION

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
        for split, path in config.data_files.items():
            rows, report = read_math_rows(path, skip_malformed=config.skip_malformed)
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
    data_files: Mapping[str, str | Path],
    data_dir: str | Path,
    *,
    skip_malformed: bool = False,
) -> tfds.core.DatasetBuilder:
    """Write user files (split -> path) as the set `bapo_math_files/<name>` under `data_dir`.

    Raises ValueError if `name` was already prepared there from different files or flags.
    """
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"name must be letters, digits, '_' or '-', got {name!r}")
    if not data_files:
        raise ValueError("data_files must map at least one split to a file, got none")
    for split, path in data_files.items():
        if not Path(path).is_file():
            raise FileNotFoundError(f"data_files[{split!r}] not found: {str(path)!r}")
    config = MathFilesConfig(
        name=name,
        version=VERSION,
        data_files={split: str(path) for split, path in data_files.items()},
        skip_malformed=skip_malformed,
    )
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
    """A data-source example (text features come back as bytes) as a MathRow."""

    def text(value: bytes | str) -> str:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    return MathRow(
        id=text(example["id"]), problem=text(example["problem"]), answer=text(example["answer"])
    )
