"""The one rollout interface every engine implements (vLLM over HTTP, the embedded JAX sampler).

An engine turns a batch of prompts (token ids) into ``n`` sampled continuations per prompt and
reports, for every sampled token y_t, the behaviour log-probability under the policy that
sampled it,

    logp_t = log softmax(z_t / tau)[y_t]        (z_t: logits, tau: temperature; after top-p/k
                                                  filtering when those are active),

the finish reason of each sample and the policy version that produced each token. The trainer
never sees where tokens come from: only ``Rollout``s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, Protocol, TypedDict, runtime_checkable

import numpy as np

from bapo_jax.checks import check_finite, check_int, choices

__all__ = [
    "FINISH_REASONS",
    "Rollout",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
    "SyncTimings",
    "WeightUpdater",
    "check_update_args",
    "validate_prompts",
]

FinishReason = Literal["stop", "length"]
# "stop": EOS or a stop token; "length": max_tokens reached. (A vLLM reply that comes back
# "abort", from a server someone else paused, is requested again: it never becomes a Sample.)
FINISH_REASONS: tuple[str, ...] = choices(FinishReason)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Every sampling setting, explicit (no server-side default is ever relied on).

    max_tokens:     new tokens per sample, >= 1 (vLLM's own default would be 16).
    temperature:    tau > 0; the log-probs are those of softmax(z / tau).
    top_p:          nucleus mass in (0, 1]; 1 disables.
    top_k:          keep the k most likely tokens; 0 disables.
    min_p:          drop tokens below min_p * p_max; 0 disables.
    stop_token_ids: extra ids that end a sample (besides EOS unless ``ignore_eos``); the stop
                    token itself is part of the returned ids.
    ignore_eos:     keep sampling through EOS.
    min_tokens:     EOS/stop tokens are masked until this many tokens were sampled.
    repetition_penalty / presence_penalty / frequency_penalty: 1 / 0 / 0 disable (RL wants them
                    disabled: they make the behaviour policy differ from the trained one).
    """

    max_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        check_int("SamplingParams.max_tokens", self.max_tokens, 1)
        check_int("SamplingParams.top_k", self.top_k, 0)
        check_int("SamplingParams.min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}"
            )
        check_finite("SamplingParams.temperature", self.temperature)
        if not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        check_finite("SamplingParams.top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        check_finite("SamplingParams.min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        check_finite("SamplingParams.repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        check_finite("SamplingParams.presence_penalty", self.presence_penalty)
        check_finite("SamplingParams.frequency_penalty", self.frequency_penalty)
        for i in self.stop_token_ids:
            check_int("SamplingParams.stop_token_ids[*]", i, 0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")

    def to_vllm(self) -> dict[str, Any]:
        """vLLM's sampling fields (all of them explicit: its own max_tokens default is 16)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "stop_token_ids": list(self.stop_token_ids),
            "stop": [],
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sampled continuation of one prompt.

    token_ids: the exact sampled ids [T] (int32), stop token included.
    logprobs:  behaviour log-prob of each sampled id [T] (float32).
    versions:  policy version that sampled each token [T] (int64); a response that an
               in-flight update froze carries two; -1 = a label the engine could not read.
    """

    prompt_index: int
    sample_index: int
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str

    def __post_init__(self) -> None:
        t = len(self.token_ids)
        if self.logprobs.shape != (t,) or self.versions.shape != (t,):
            raise ValueError(
                f"Sample: token_ids {self.token_ids.shape}, logprobs {self.logprobs.shape} and "
                f"versions {self.versions.shape} must all be [{t}]"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Sample.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )


@dataclasses.dataclass(frozen=True)
class Rollout:
    """All samples of one ``generate`` call, prompt-major: ``samples[p * n + j]`` is sample j
    of prompt p."""

    prompt_ids: tuple[tuple[int, ...], ...]
    n: int
    samples: tuple[Sample, ...]

    def __post_init__(self) -> None:
        if len(self.samples) != len(self.prompt_ids) * self.n:
            raise ValueError(
                f"Rollout: {len(self.samples)} samples for {len(self.prompt_ids)} prompts "
                f"x n={self.n}"
            )
        for k, s in enumerate(self.samples):
            if (s.prompt_index, s.sample_index) != divmod(k, self.n):
                raise ValueError(
                    f"Rollout.samples[{k}] is ({s.prompt_index}, {s.sample_index}), expected "
                    f"{divmod(k, self.n)}"
                )

    def padded(self, pad_id: int) -> dict[str, np.ndarray]:
        """Right-padded arrays of the responses: ids/logprobs/versions [B, T] and mask [B, T]
        (B = prompts * n, T = longest response)."""
        b = len(self.samples)
        t = max((len(s.token_ids) for s in self.samples), default=0)
        ids = np.full((b, t), pad_id, np.int32)  # [B, T]
        logp = np.zeros((b, t), np.float32)  # [B, T]
        ver = np.full((b, t), -1, np.int64)  # [B, T]
        mask = np.zeros((b, t), bool)  # [B, T]
        for i, s in enumerate(self.samples):
            k = len(s.token_ids)
            ids[i, :k], logp[i, :k], ver[i, :k], mask[i, :k] = (
                s.token_ids,
                s.logprobs,
                s.versions,
                True,
            )
        return {"token_ids": ids, "logprobs": logp, "versions": ver, "mask": mask}


def validate_prompts(prompt_ids: Sequence[Sequence[int]], n: int) -> tuple[tuple[int, ...], ...]:
    """Check the generate() arguments common to every engine; return the prompts as tuples."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if isinstance(prompt_ids, str | bytes) or not isinstance(prompt_ids, Sequence):
        raise ValueError(f"prompt_ids must be a list of token-id lists, got {type(prompt_ids)}")
    out = []
    for p, prompt in enumerate(prompt_ids):
        ids = tuple(int(i) for i in prompt)
        if not ids:
            raise ValueError(f"prompt_ids[{p}] is empty")
        if min(ids) < 0:
            raise ValueError(f"prompt_ids[{p}] has a negative token id {min(ids)}")
        out.append(ids)
    return tuple(out)


class SyncTimings(TypedDict):
    """What one weight update cost (seconds). write_s: the checkpoint write (0 in process);
    load_s: the engine's load (vLLM: the slowest server's restore + load, measured in its
    worker); write_hidden_s / load_hidden_s: the parts of them done while generation still ran
    (before `finish_update`'s `generating_until`); attempts: writes of the version;
    server_version: the lowest version the engine's servers report having loaded."""

    write_s: float
    load_s: float
    write_hidden_s: float
    load_hidden_s: float
    attempts: int
    server_version: int


def check_update_args(version: int, step: int) -> None:
    check_int("version", version, 0)
    check_int("step", step, 0)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer asks of any rollout engine: samples, the version it samples from, and
    what its servers report (none in process)."""

    @property
    def policy_version(self) -> int:
        """Version of the weights the engine samples from now."""
        ...

    @property
    def restarted(self) -> Sequence[str]:
        """Servers the engine restarted during the run, in order (none in process)."""
        ...

    def server_versions(self) -> dict[str, dict[str, Any]]:
        """What every server reports of its weights ({} in process)."""
        ...

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        sampling: SamplingParams,
        seed: int,
        *,
        greedy: bool = False,
    ) -> Rollout:
        """``n`` samples per prompt; same seed and weights -> same samples. ``greedy``: argmax
        decoding, for evaluation (its log-probs are the engine's own and never trained on)."""
        ...


class WeightUpdater(Protocol):
    """What takes the trainer's weights to the engine: the in-process engine itself, or the
    vLLM servers' `orbax_sync.OrbaxSync`. A weight update has two halves so that its slow part
    can overlap generation: `begin_update` starts it (vLLM: writes the Orbax checkpoint and has
    the servers stage it) and must not change what the engine samples from; `finish_update`
    switches the engine. `update_weights` is both at once."""

    def begin_update(self, version: int, params: Any, *, step: int) -> Any:
        """Start making ``params`` (the trainer's ``TrainState.params``; read before
        ``finish_update`` returns) policy ``version``; returns the handle ``finish_update``
        takes. ``step``: the optimizer step, recorded with the weights."""
        ...

    def finish_update(self, handle: Any, generating_until: float | None = None) -> SyncTimings:
        """Switch to the version ``handle`` carries. generating_until: when the generation that
        overlapped the update ended (``time.perf_counter``; None: now), for the hidden shares."""
        ...

    def update_weights(self, version: int, params: Any, *, step: int = 0) -> SyncTimings:
        """``finish_update(begin_update(...))``."""
        ...
