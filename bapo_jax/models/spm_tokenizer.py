"""A SentencePiece tokenizer trained in process on task text (the CPU arithmetic job).

    tokenizer = SentencePieceTokenizer.train(texts, vocab_size=64)
    ids = tokenizer.encode("12+7=19", add_bos=True)
    tokenizer.save("run/spm.model"); SentencePieceTokenizer.load("run/spm.model")

Training feeds the texts (read into a list once: task corpora are small, and bad items must
raise before the C++ trainer starts) through `SentencePieceTrainer.train(sentence_iterator=...,
model_writer=BytesIO)`: the model proto stays in memory, no file is touched unless `save` is
called. The model is exact on task text:

- normalization is the identity and whitespace is kept as written (no NFKC, no collapsing of
  spaces, no dummy "▁" prefix), so `decode(encode(text)) == text` for any text whose characters
  were seen in training, and `encode(a) + encode(b)` decodes to `a + b`;
- every digit is its own piece (`split_digits`), so numbers are spelled digit by digit;
- ids 0..3 are pad, unk, bos, eos (control pieces `<pad>`, `<unk>`, `<s>`, `</s>`).

Method names match `bapo_jax.models.tokenizer.Tokenizer` where they overlap (`encode`,
`encode_batch`, `decode`, `eos_id`, `pad_id`, `bos_id`, `vocab_size`, `token_to_id`,
`id_to_token`), so the RL loop can use either.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence

import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MODEL_TYPES = ("bpe", "unigram", "char")


class SentencePieceTokenizer:
    """Encode/decode with a SentencePiece model held in memory.

    Attributes:
      model_proto: the serialized model (what `save` writes).
      eos_id / pad_id / bos_id / unk_id: control ids; `eos_token`, `pad_token`, `bos_token` are
        their piece strings.
    """

    def __init__(self, model_proto: bytes):
        if not isinstance(model_proto, bytes | bytearray) or not model_proto:
            raise ValueError(
                f"model_proto must be non-empty bytes, got {type(model_proto).__name__}"
            )
        self.model_proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        self.pad_id = self._sp.pad_id()
        self.unk_id = self._sp.unk_id()
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()
        for name in ("pad_id", "bos_id", "eos_id"):
            if getattr(self, name) < 0:
                raise ValueError(f"the SentencePiece model must define {name}, got -1")
        self.pad_token = self._sp.id_to_piece(self.pad_id)
        self.bos_token = self._sp.id_to_piece(self.bos_id)
        self.eos_token = self._sp.id_to_piece(self.eos_id)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        *,
        vocab_size: int,
        model_type: str = "bpe",
        user_defined_symbols: Sequence[str] = (),
        byte_fallback: bool = False,
    ) -> SentencePieceTokenizer:
        """Train on `texts` (any iterable of str) in memory.

        vocab_size is an upper bound: a corpus with fewer distinct pieces gives a smaller
        vocabulary (`hard_vocab_limit=False`). `user_defined_symbols` are always single pieces;
        `byte_fallback` adds 256 byte pieces so unseen characters round-trip instead of
        becoming `<unk>`. Deterministic: the same texts and settings give the same model.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 8:
            raise ValueError(f"vocab_size must be an int >= 8, got {vocab_size!r}")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
        if isinstance(texts, str):
            raise ValueError("texts must be an iterable of str, got a single str")
        corpus = [text for text in texts if _checked_text(text)]
        if not corpus:
            raise ValueError("texts must hold at least one non-empty str, got none")
        writer = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus),
            model_writer=writer,
            vocab_size=vocab_size,
            model_type=model_type,
            hard_vocab_limit=False,
            character_coverage=1.0,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            split_digits=True,
            byte_fallback=byte_fallback,
            user_defined_symbols=list(user_defined_symbols),
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            num_threads=1,
            minloglevel=2,
        )
        return cls(writer.getvalue())

    @classmethod
    def load(cls, path: str | os.PathLike) -> SentencePieceTokenizer:
        """Read a model written by `save` (or any SentencePiece `.model` with pad/bos/eos)."""
        with open(path, "rb") as f:
            return cls(f.read())

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "wb") as f:
            f.write(self.model_proto)

    # ---- vocabulary ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of pieces, control pieces included (ids are 0..vocab_size-1)."""
        return self._sp.get_piece_size()

    def token_to_id(self, token: str) -> int | None:
        """Id of a piece, None if it is not in the vocabulary."""
        token_id = self._sp.piece_to_id(token)
        unknown = token_id == self.unk_id and token != self._sp.id_to_piece(token_id)
        return None if unknown else token_id

    def id_to_token(self, token_id: int) -> str | None:
        return self._sp.id_to_piece(int(token_id)) if 0 <= token_id < self.vocab_size else None

    def is_special(self, token_id: int) -> bool:
        """Control pieces (pad, bos, eos) and `<unk>`."""
        return bool(self._sp.is_control(int(token_id)) or self._sp.is_unknown(int(token_id)))

    # ---- text <-> ids --------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`; bos/eos only when asked (the default adds nothing)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self._sp.encode(text, add_bos=add_bos, add_eos=add_eos)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if isinstance(texts, str) or not all(isinstance(text, str) for text in texts):
            raise ValueError("texts must be a sequence of str")
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Control pieces are written as their piece (`</s>`) unless
        `skip_special_tokens`; `<unk>` decodes to U+2047 (SentencePiece's choice)."""
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id must be in [0, {self.vocab_size}), got {i}")
        pieces: list[str] = []
        run: list[int] = []
        for i in ids:
            if self._sp.is_control(i):
                pieces.append(self._sp.decode(run))
                run = []
                if not skip_special_tokens:
                    pieces.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        pieces.append(self._sp.decode(run))
        return "".join(pieces)


def _checked_text(text: str) -> bool:
    """True for a non-empty str, False for ""; anything else is an error."""
    if not isinstance(text, str):
        raise ValueError(f"texts must hold str, got {type(text).__name__}")
    return bool(text)
