"""Tokenizer files of an HF export: copied from a Qwen2.5-style directory, or converted from a
SentencePiece model (the CPU arithmetic job's `SentencePieceTokenizer`).

transformers 5 loads the tokenizer of every `model_type: qwen2` directory as `Qwen2Tokenizer`,
whatever tokenizer_config.json names: it keeps tokenizer.json's vocabulary, merges and added
tokens but runs them through Qwen2's own pipeline (NFC, the Qwen2 split regex, byte-level BPE
without unk, byte-level decoder). So a SentencePiece model is converted INTO that pipeline, and
`bapo_jax.models.tokenizer.load_tokenizer` (which runs tokenizer.json as written) and
`AutoTokenizer.from_pretrained` give the same ids:

    vocabulary   each piece at its SentencePiece id, spelled in the byte-level alphabet ("▁" is
                 a space, so "▁ab" is "Ġab"); control pieces (<pad>, <unk>, <s>, </s>) are
                 special added tokens; user-defined symbols plain added tokens
    merges       (a, b) for every split of a piece into two pieces, ranked by the piece's score
                 (SentencePiece merges the adjacent pair whose union scores highest)

This equals SentencePiece on text that (1) only has characters that are pieces themselves
(single bytes, e.g. ASCII, as every SentencePiece model trained on the text has) and (2) is never
segmented by SentencePiece across a boundary of the Qwen2 split (letter runs with one leading
non-letter, single digits, punctuation runs, whitespace). Arithmetic task text is digits,
operators, "=", ".", "\\boxed{}" -- and `write_spm_files` refuses to write a tokenizer that
differs from SentencePiece on any text it is given to check (the job gives it all its texts).
Control pieces written in the text ("</s>") are their special token here; SentencePiece spells
them out (task text never holds one); <unk> is never produced (byte-level BPE has no unk).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import models

from bapo_jax.models.spm_tokenizer import SentencePieceTokenizer

__all__ = [
    "HF_TOKENIZER_FILES",
    "SPM_FILE",
    "check_same_encoding",
    "copy_tokenizer_files",
    "spm_to_tokenizers",
    "write_spm_files",
]

# Every file of an HF tokenizer a directory may hold (copied as they are by an export).
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
SPM_FILE = "tokenizer.model"  # the SentencePiece model, kept beside its conversion

# sentencepiece_model.proto enums.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BPE, _CHAR = 2, 4


@functools.cache
def _byte_alphabet() -> tuple[str, ...]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer applies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


def _byte_level(text: str) -> str:
    alphabet = _byte_alphabet()
    return "".join(alphabet[b] for b in text.encode("utf-8"))


def _model_proto(proto: bytes):
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    return model


def _check_supported(model) -> None:
    """Refuse SentencePiece settings the conversion does not reproduce."""
    spec, norm = model.trainer_spec, model.normalizer_spec
    problems = []
    if spec.model_type not in (_BPE, _CHAR):
        problems.append(f"model_type {spec.model_type} (want bpe or char)")
    if norm.name != "identity" or norm.precompiled_charsmap:
        problems.append(f"normalization {norm.name!r} (want 'identity')")
    if norm.add_dummy_prefix:
        problems.append("add_dummy_prefix=true")
    if norm.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces=true")
    if spec.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix=true")
    if problems:
        raise ValueError(
            "cannot convert this SentencePiece model to an HF tokenizer: "
            + ", ".join(problems)
            + " (SentencePieceTokenizer.train never sets these)"
        )


def _vocabulary(model) -> dict[str, int]:
    """Byte-level spelling -> id of every piece (special pieces keep their text; a byte piece
    whose byte is a piece already, or a duplicate, keeps its SentencePiece text, unreachable)."""
    vocab: dict[str, int] = {}
    for i, p in enumerate(model.pieces):
        if p.type in (_NORMAL, _USER_DEFINED):
            token = _byte_level(p.piece.replace("\u2581", " "))
        elif p.type == _BYTE:
            token = _byte_alphabet()[int(p.piece[3:5], 16)]  # "<0x41>"
        else:
            token = p.piece
        if token in vocab:
            token = p.piece
        if token in vocab:
            raise ValueError(f"pieces {vocab[token]} and {i} are both spelled {token!r}")
        vocab[token] = i
    return vocab


def _merges(model, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """(a, b) for every split of a normal piece into two pieces; higher-scoring pieces first
    (ties: lower id first), the splits of one piece by the ids of their halves."""
    ranked = []
    for token, i in vocab.items():
        p = model.pieces[i]
        if p.type != _NORMAL or len(token) < 2:
            continue
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        splits = [(a, b) for a, b in splits if a in vocab and b in vocab]
        splits.sort(key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
        ranked += [(-p.score, i, ab) for ab in splits]
    ranked.sort(key=lambda entry: entry[:2])
    return [ab for _, _, ab in ranked]


def spm_to_tokenizers(tokenizer: SentencePieceTokenizer) -> tokenizers.Tokenizer:
    """`tokenizer` as a Qwen2-pipeline `tokenizers.Tokenizer` (module doc)."""
    from bapo_jax.models.tokenizer import set_qwen2_pipeline

    model = _model_proto(tokenizer.model_proto)
    _check_supported(model)
    vocab = _vocabulary(model)
    merges = _merges(model, vocab) if model.trainer_spec.model_type == _BPE else []
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    set_qwen2_pipeline(backend)
    special = [p.piece for p in model.pieces if p.type in (_CONTROL, _UNKNOWN)]
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in special]
    )
    user = [p.piece for p in model.pieces if p.type == _USER_DEFINED]
    if user:
        backend.add_tokens(
            [tokenizers.AddedToken(t, special=False, normalized=False) for t in user]
        )
    for token, i in vocab.items():
        if backend.token_to_id(token) != i:
            raise ValueError(f"piece {token!r} got id {backend.token_to_id(token)}, not {i}")
    return backend


def check_same_encoding(
    tokenizer: SentencePieceTokenizer, backend: tokenizers.Tokenizer, texts: Iterable[str]
) -> int:
    """Raise ValueError on the first text whose ids (without special tokens) or decoded text
    (with and without them) differ between the two; returns the number of texts checked."""
    count = 0
    for text in texts:
        ids = tokenizer.encode(text)
        got = backend.encode(text, add_special_tokens=False).ids
        if got != ids:
            raise ValueError(f"the HF tokenizer encodes {text!r} to {got}, SentencePiece to {ids}")
        for skip in (False, True):
            want = tokenizer.decode(ids, skip_special_tokens=skip)
            have = backend.decode(ids, skip_special_tokens=skip)
            if have != want:
                raise ValueError(
                    f"the HF tokenizer decodes {ids} (skip_special_tokens={skip}) to {have!r}, "
                    f"SentencePiece to {want!r}"
                )
        count += 1
    return count


def write_spm_files(
    tokenizer: SentencePieceTokenizer,
    directory: str | os.PathLike,
    *,
    model_max_length: int | None = None,
    check_texts: Iterable[str] = (),
) -> tuple[str, ...]:
    """Write `tokenizer` as an HF fast tokenizer into `directory`: tokenizer.json,
    tokenizer_config.json (bos/eos/pad, no bos/eos added by `encode`) and the SentencePiece
    model itself (tokenizer.model). `check_texts` (e.g. the task's texts) must encode and decode
    identically, else nothing is written. Returns the file names written."""
    backend = spm_to_tokenizers(tokenizer)
    check_same_encoding(tokenizer, backend, check_texts)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.id_to_token(tokenizer.unk_id),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    _atomic_write(directory / "tokenizer.json", backend.to_str(pretty=True).encode("utf-8"))
    _atomic_write(
        directory / "tokenizer_config.json",
        (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"),
    )
    _atomic_write(directory / SPM_FILE, tokenizer.model_proto)
    return ("tokenizer.json", "tokenizer_config.json", SPM_FILE)


def copy_tokenizer_files(
    source: str | os.PathLike, directory: str | os.PathLike
) -> tuple[str, ...]:
    """Copy the HF tokenizer files `source` holds (`HF_TOKENIZER_FILES`, plus tokenizer.model)
    into `directory`; returns their names. Nothing else of `source` (weights, config.json)."""
    source, directory = Path(source), Path(directory)
    names = tuple(n for n in (*HF_TOKENIZER_FILES, SPM_FILE) if (source / n).is_file())
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(source / name, directory / name)
    return names


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
