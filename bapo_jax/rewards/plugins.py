"""Reward plug-ins: `rewards.fn = "package.module:function"`, loaded by spec.

A plug-in is a function of one response:

    def my_reward(response: str, answer: str, metadata: Mapping[str, Any]) -> float: ...

response: the decoded model response (the whole text, not an extracted answer); answer: the
prompt's gold answer as a string; metadata: the prompt example's JSON metadata (an empty
dict when the data has none). It returns a finite number (any real: 1.0 / 0.0, partial
credit, penalties) or a mapping with a numeric "score" key.

verl's reward functions are accepted as they are: a function whose parameters include
`data_source`, `solution_str` and `ground_truth` is called with keywords
`compute_score(data_source=metadata["data_source"], solution_str=response,
ground_truth=answer, extra_info=metadata["extra_info"])` (`extra_info` only if it takes it;
missing metadata keys give None), and may return a float or a dict with a "score" key.

Plug-ins run inside the reward worker processes (`bapo_jax.rewards.worker`), under the same
time limits as math-verify checks; `call_plugin` turns whatever a plug-in does into a score
and a status: an exception -> 0.0 / "plugin_error", a NaN or infinite result -> 0.0 /
"non_finite", anything else that is not a number -> 0.0 / "bad_return". `load_plugin` checks a
spec up front (module importable, attribute present and callable, a usable signature) and
raises `PluginError` naming `rewards.fn` and the value.

The built-in rewards are named, not loaded: "math_verify" (the default, `rewards.checker`) and
"exact_match" (`exact_match` below).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from bapo_jax.rewards.boxed import extract_last_boxed

MATH_VERIFY = "math_verify"
EXACT_MATCH = "exact_match"
BUILTIN_REWARDS = (MATH_VERIFY, EXACT_MATCH)

# Statuses of a plug-in call besides "ok" (and the worker's "soft_timeout").
PLUGIN_ERROR = "plugin_error"
NON_FINITE = "non_finite"
BAD_RETURN = "bad_return"

_VERL_PARAMS = ("data_source", "solution_str", "ground_truth")
_SPEC = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_WHITESPACE = re.compile(r"\s+")
_FLOAT32_MAX = 3.4028234663852886e38  # rewards are float32: a larger magnitude is +-inf there


class PluginError(ValueError):
    """A `rewards.fn` value that cannot be used; the message names the key and the value."""


def _fail(spec: str, message: str) -> PluginError:
    return PluginError(f"rewards.fn={spec!r}: {message}")


def check_spec(spec: Any) -> None:
    """The form of `spec` only (nothing is imported): a built-in name or "module:function"."""
    if not isinstance(spec, str):
        raise PluginError(f"rewards.fn must be a str, got {type(spec).__name__} {spec!r}")
    if spec not in BUILTIN_REWARDS and not _SPEC.fullmatch(spec):
        raise _fail(
            spec,
            f"not a shipped reward ({', '.join(BUILTIN_REWARDS)}) nor a plug-in "
            "'package.module:function'",
        )


@dataclasses.dataclass(frozen=True)
class Plugin:
    """A loaded plug-in. spec: "module:function" as configured; fn: the callable; style:
    "native" = fn(response, answer, metadata), "verl" = verl's compute_score keywords;
    extra_info: whether a verl function takes `extra_info` (or **kwargs)."""

    spec: str
    fn: Callable[..., Any]
    style: Literal["native", "verl"]
    extra_info: bool = False

    def __call__(self, response: str, answer: str, metadata: Mapping[str, Any]) -> Any:
        """The plug-in's raw return value (no checks: see `call_plugin`)."""
        if self.style == "native":
            return self.fn(response, answer, metadata)
        kwargs = {
            "data_source": metadata.get("data_source"),
            "solution_str": response,
            "ground_truth": answer,
        }
        if self.extra_info:
            kwargs["extra_info"] = metadata.get("extra_info")
        return self.fn(**kwargs)


def load_plugin(spec: str) -> Plugin:
    """Import `spec` ("package.module:function", the attribute may be dotted) and check it.

    Raises PluginError (naming rewards.fn and `spec`) when the module does not import, the
    attribute is missing or not callable, or its signature is neither a plug-in's
    (response, answer, metadata) nor verl's (data_source, solution_str, ground_truth, ...).
    """
    check_spec(spec)
    if spec in BUILTIN_REWARDS:
        raise _fail(spec, "a shipped reward, not a plug-in to load")
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as error:  # ModuleNotFoundError, or the module's own import failing
        raise _fail(
            spec, f"cannot import module {module_name!r}: {type(error).__name__}: {error}"
        ) from error
    path = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise _fail(spec, f"{path!r} has no attribute {part!r}")
        obj, path = getattr(obj, part), f"{path}.{part}"
    if not callable(obj):
        raise _fail(spec, f"{path!r} is not callable: {type(obj).__name__} {obj!r}")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have none: trust the documented form
        return Plugin(spec, obj, "native")
    params = signature.parameters
    if all(name in params for name in _VERL_PARAMS):
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        extra_info = "extra_info" in params or takes_kwargs
        call = dict.fromkeys(_VERL_PARAMS, None) | ({"extra_info": None} if extra_info else {})
        try:
            signature.bind(**call)
        except TypeError as error:
            raise _fail(
                spec, f"verl-style signature {signature} cannot be called: {error}"
            ) from None
        return Plugin(spec, obj, "verl", extra_info)
    try:
        signature.bind("response", "answer", {})
    except TypeError:
        raise _fail(
            spec,
            f"signature {signature} takes neither (response, answer, metadata) nor verl's "
            "(data_source, solution_str, ground_truth, extra_info=None)",
        ) from None
    return Plugin(spec, obj, "native")


def plugin_root(spec: str) -> str | None:
    """The directory the plug-in's top-level package was imported from (for the workers'
    PYTHONPATH), or None when it has no file (a namespace package, a built-in module)."""
    module_name = spec.partition(":")[0]
    module = importlib.import_module(module_name)
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = Path(file).resolve()
    depth = module_name.count(".") + (1 if path.name == "__init__.py" else 0)
    return str(path.parents[depth])


def as_score(value: Any) -> tuple[float, str]:
    """(score, status) of a plug-in's return value: a finite real -> (it, "ok"); a mapping's
    "score" the same way; NaN, +-inf or beyond float32's range -> (0.0, "non_finite");
    anything else -> (0.0, "bad_return")."""
    if isinstance(value, Mapping):
        if "score" not in value:
            return 0.0, BAD_RETURN
        value = value["score"]
    if not isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        return 0.0, BAD_RETURN
    try:
        score = float(value)
    except (TypeError, ValueError, OverflowError):
        return 0.0, BAD_RETURN
    if not math.isfinite(score) or abs(score) > _FLOAT32_MAX:
        return 0.0, NON_FINITE
    return score, "ok"


def call_plugin(
    plugin: Plugin, response: str, answer: str, metadata: Mapping[str, Any]
) -> tuple[float, str]:
    """(score, status) of one plug-in call; every failure scores 0.0 (module doc). The
    caller bounds the time (the worker's soft timeout raises a BaseException through here)."""
    try:
        value = plugin(response, answer, metadata)
    except (Exception, SystemExit):
        return 0.0, PLUGIN_ERROR
    return as_score(value)


def normalize_whitespace(text: str) -> str:
    """`text` stripped, every run of whitespace one space."""
    return _WHITESPACE.sub(" ", text).strip()


def exact_match(response: str, answer: str | int) -> float:
    """1.0 if the response's answer equals `answer` after whitespace normalisation, else 0.0.

    The response's answer is the content of its last complete `\\boxed{}`; a response without
    one is its own answer (the whole stripped text), so a task whose prompt asks for the bare
    answer works as well. Case and every other character count: "Paris" != "paris".
    """
    boxed = extract_last_boxed(response)
    pred = response if boxed is None else boxed
    return 1.0 if normalize_whitespace(pred) == normalize_whitespace(str(answer)) else 0.0


def metadata_dicts(
    metadata: Sequence[Mapping[str, Any] | None] | None, size: int
) -> list[dict[str, Any]]:
    """One JSON-able dict per response (None -> {}); ValueError naming the bad entry."""
    if metadata is None:
        return [{} for _ in range(size)]
    if isinstance(metadata, (str, Mapping)) or len(metadata) != size:
        raise ValueError(f"metadata must be a sequence of {size} mappings, one per response")
    out = []
    for index, meta in enumerate(metadata):
        if meta is None:
            meta = {}
        if not isinstance(meta, Mapping):
            raise ValueError(f"metadata[{index}] must be a mapping, got {type(meta).__name__}")
        try:
            out.append(json.loads(json.dumps(dict(meta), default=_json_default)))
        except (TypeError, ValueError) as error:
            raise ValueError(f"metadata[{index}] is not JSON-able: {error}") from None
    return out


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8")
    raise TypeError(f"{type(value).__name__} {value!r} is not JSON-able")
