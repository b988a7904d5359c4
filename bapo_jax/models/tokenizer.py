"""The Qwen2.5 byte-level BPE tokenizer and its chat template, without transformers.

The backend is a `tokenizers.Tokenizer` (Rust). From `vocab.json` + `merges.txt` it is built the
way Qwen2 defines it:

    NFC normalizer
    -> Split(Qwen2 regex, isolated) -> ByteLevel(no prefix space, no regex)   (pre-tokenizer)
    -> BPE(no unk, no dropout)
    -> ByteLevel decoder
    + the added tokens of tokenizer_config.json (ids 151643..151664 for Qwen2.5)

A directory holding `tokenizer.json` is loaded from that file instead. The chat template is
rendered with jinja2 in a sandbox with the globals and filters transformers gives templates
(`raise_exception`, `strftime_now`, a non-escaping `tojson`, `trim_blocks`, `lstrip_blocks`,
loop controls), so the rendered text matches `AutoTokenizer.apply_chat_template`.

eos differs between Qwen2.5 base models (`<|endoftext|>`) and instruct models (`<|im_end|>`,
the value in the shipped tokenizer_config.json); pass `eos_token` to choose.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers

SHIPPED_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "qwen2.5-tokenizer"

ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
BASE_MODEL_EOS = ENDOFTEXT_TOKEN  # Qwen2.5 / Qwen2.5-Math base models
INSTRUCT_MODEL_EOS = IM_END_TOKEN  # Qwen2.5-*-Instruct

# Qwen2's pre-tokenizer split pattern (contractions, letter runs with one leading non-letter,
# single digits, punctuation runs, newline runs, and whitespace).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

Message = Mapping[str, Any]


def _token_content(value: str | Mapping[str, Any] | None) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token entry must be a string or {{'content': ...}}, got {value!r}")


def set_qwen2_pipeline(backend: tokenizers.Tokenizer) -> None:
    """Qwen2's text pipeline on a byte-level BPE `backend`: NFC, the pre-tokenizer split
    pattern, byte-level bytes to characters (and back when decoding)."""
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                tokenizers.Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()


def build_qwen2_backend(
    vocab_file: str | Path, merges_file: str | Path, added_tokens: Mapping[int, Mapping[str, Any]]
) -> tokenizers.Tokenizer:
    """A Qwen2 byte-level BPE `tokenizers.Tokenizer` from vocab/merges plus added tokens.

    `added_tokens` maps id -> the `added_tokens_decoder` entry of tokenizer_config.json
    (`content`, `special`, `lstrip`, `rstrip`, `single_word`, `normalized`). The ids must
    continue the vocabulary without gaps, since `tokenizers` appends added tokens in order.
    """
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE.from_file(str(vocab_file), str(merges_file))
    )
    set_qwen2_pipeline(backend)
    for token_id in sorted(added_tokens):
        entry = added_tokens[token_id]
        expected = backend.get_vocab_size(with_added_tokens=True)
        if token_id != expected:
            raise ValueError(
                f"added token ids must continue the vocabulary: token {entry.get('content')!r} "
                f"has id {token_id}, expected {expected}"
            )
        special = bool(entry.get("special", False))
        token = tokenizers.AddedToken(
            entry["content"],
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", not special)),
            special=special,
        )
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        if backend.token_to_id(entry["content"]) != token_id:
            raise ValueError(f"added token {entry['content']!r} did not get id {token_id}")
    return backend


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandboxed jinja2 environment configured like transformers'."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _plain_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Copies of the messages as plain dicts, without None-valued keys (as transformers does)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    plain = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"messages[{index}] must be a dict with a 'role', got {message!r}")
        plain.append({key: value for key, value in message.items() if value is not None})
    return plain


class Tokenizer:
    """Encode/decode text and render chat prompts for Qwen2-family models.

    Attributes:
      backend: the `tokenizers.Tokenizer` doing the work.
      eos_token / eos_id: end of sequence (generation stops here; base vs instruct differ).
      pad_token / pad_id: padding token (`<|endoftext|>` for Qwen2.5).
      bos_token / bos_id: None for Qwen2.5 (no BOS is ever added).
      chat_template: jinja source, or None if the directory had none.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token: str,
        pad_token: str,
        bos_token: str | None = None,
        chat_template: str | None = None,
        additional_special_tokens: Sequence[str] = (),
    ):
        self.backend = backend
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.bos_token = bos_token
        self.eos_id = self._required_id("eos_token", eos_token)
        self.pad_id = self._required_id("pad_token", pad_token)
        self.bos_id = None if bos_token is None else self._required_id("bos_token", bos_token)
        self.additional_special_tokens = tuple(additional_special_tokens)
        self.chat_template = chat_template
        self._compiled_template = (
            None if chat_template is None else compile_chat_template(chat_template)
        )

    def _required_id(self, field: str, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field} must be a token of the vocabulary, got {token!r}")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (151665 for Qwen2.5; the model's
        embedding has more rows, e.g. 151936)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens a chat template may read (what transformers 5 passes)."""
        named = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
        }
        return {key: value for key, value in named.items() if value is not None}

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) map to
        their ids; nothing is added around the text (Qwen has no BOS)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` for many texts, in parallel in the Rust backend."""
        if isinstance(texts, str) or not all(isinstance(text, str) for text in texts):
            raise ValueError("texts must be a sequence of str")
        return [enc.ids for enc in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 byte runs become U+FFFD (errors='replace')."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat template rendered to text (see `apply_chat_template`)."""
        if self._compiled_template is None:
            raise ValueError("chat_template is None: this tokenizer directory has no chat template")
        context = {**self.special_tokens_map, **template_kwargs}
        return self._compiled_template.render(
            messages=_plain_messages(messages),
            tools=None if tools is None else [dict(tool) for tool in tools],
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template.

        With `add_generation_prompt` the prompt ends with `<|im_start|>assistant\\n`. Returns
        token ids (encoded without adding special tokens, the template writes them) or, with
        `tokenize=False`, the text.
        """
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )
        return self.encode(text) if tokenize else text


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _read_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json's `chat_template` (transformers 5)."""
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    # A list of named templates: [{"name": "default", "template": ...}, ...].
    named = {entry["name"]: entry["template"] for entry in template}
    if "default" not in named:
        raise ValueError(f"chat_template list has no 'default' entry, got names {sorted(named)}")
    return named["default"]


# Without tokenizer.json, the Qwen2 backend is built from these (the config: added tokens).
VOCAB_MERGES_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def missing_tokenizer_files(path: str | Path) -> tuple[str, ...]:
    """What `load_tokenizer(path)` needs that the directory lacks (() = nothing): the
    tokenizer (`tokenizer.json`, or `vocab.json` + `merges.txt`) and `tokenizer_config.json`
    (eos, pad, added tokens). Checked before any compute by the run build
    (`run.build.build_tokenizer`), which names the key of the directory."""
    directory = Path(path)
    if not directory.is_dir():
        return (f"the directory {str(directory)!r}",)
    has_json = (directory / "tokenizer.json").is_file()
    wanted = ("tokenizer_config.json",) if has_json else VOCAB_MERGES_FILES
    missing = [f for f in wanted if not (directory / f).is_file()]
    if {"vocab.json", "merges.txt"} <= set(missing):  # neither form of the tokenizer
        missing = ["tokenizer.json (or vocab.json + merges.txt)", *missing[2:]]
    return tuple(missing)


def load_tokenizer(
    path: str | Path | None = None,
    *,
    eos_token: str | None = None,
    pad_token: str | None = None,
) -> Tokenizer:
    """Load a Qwen2-family tokenizer directory (the shipped Qwen2.5 files by default).

    Args:
      path: a directory with `tokenizer.json`, or with `vocab.json` + `merges.txt` +
        `tokenizer_config.json` (an HF model directory works). None = the shipped files.
      eos_token: override tokenizer_config.json's eos (use `BASE_MODEL_EOS` for base models).
      pad_token: override tokenizer_config.json's pad token.
    """
    directory = SHIPPED_TOKENIZER_DIR if path is None else Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer path must be a directory, got {str(directory)!r}")
    config_file = directory / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    tokenizer_json = directory / "tokenizer.json"
    if tokenizer_json.is_file():
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    else:
        missing = [f for f in VOCAB_MERGES_FILES if not (directory / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{directory} has no tokenizer.json, so it needs {', '.join(VOCAB_MERGES_FILES)}; "
                f"missing {', '.join(missing)}"
            )
        added = {int(k): v for k, v in config.get("added_tokens_decoder", {}).items()}
        backend = build_qwen2_backend(directory / "vocab.json", directory / "merges.txt", added)
    eos = eos_token if eos_token is not None else _token_content(config.get("eos_token"))
    pad = pad_token if pad_token is not None else _token_content(config.get("pad_token"))
    if eos is None:
        raise ValueError(f"eos_token is not set in {config_file} and was not given")
    return Tokenizer(
        backend,
        eos_token=eos,
        pad_token=pad if pad is not None else eos,
        bos_token=_token_content(config.get("bos_token")),
        chat_template=_read_chat_template(directory, config),
        additional_special_tokens=[
            _token_content(t) for t in config.get("additional_special_tokens", [])
        ],
    )
