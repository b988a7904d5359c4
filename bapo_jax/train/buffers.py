"""The trainer's off-policy bookkeeping: responses in flight, finished groups, replay, prompts.

A `Group` is one prompt with its G responses. A `Response` grows over generation rounds: under
partial rollouts a round may stop it at the per-round budget, and a later round (possibly a
newer policy) continues it from its tokens so far. Each token keeps the behaviour log-prob and
the policy version reported by the engine that sampled it, so the loss ratio of every token is
taken against the policy that actually produced it.

Everything here is plain host data and serialises to (JSON metadata, flat numpy arrays) for
the run checkpoint (`to_state` / `from_state`), so a resumed run continues with exactly the
queued batches, half-finished responses, replay contents and prompt leftovers of the saved one.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from bapo_jax.data.pipeline import PromptExample

# Response's per-token arrays and their dtypes (also the checkpoint's array names).
_FIELDS = {
    "token_ids": np.int32,
    "logprobs": np.float32,
    "versions": np.int64,
    "scheduled_versions": np.int64,
    "trainer_logprobs": np.float32,
}
# Filled in for checkpoints written before a field existed.
_MISSING = {"scheduled_versions": -1, "trainer_logprobs": np.nan}


@dataclasses.dataclass
class Response:
    """Per-token arrays that grow together; finish_reason None = still in flight.

    logprobs: the engine's behaviour log-probs; versions: the policy version the engine reports
    for each token; scheduled_versions: the version the trainer had published when it asked
    for the token (they differ only if a sync did not take); trainer_logprobs: the trainer's
    teacher-forced log-prob of the token under the scheduled version's params (NaN: not
    computed; `logging.logprob_agreement`).
    """

    token_ids: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32
    versions: np.ndarray  # [T] int64
    scheduled_versions: np.ndarray  # [T] int64
    trainer_logprobs: np.ndarray  # [T] float32
    finish_reason: str | None = None

    @classmethod
    def empty(cls) -> Response:
        return cls(*(np.zeros(0, dtype) for dtype in _FIELDS.values()))

    def extend(
        self,
        token_ids,
        logprobs,
        versions,
        finish_reason: str | None,
        *,
        scheduled_version: int = -1,
        trainer_logprobs=None,
    ) -> None:
        n = len(token_ids)
        if trainer_logprobs is None:
            trainer_logprobs = np.full(n, np.nan, np.float32)
        new = {
            "token_ids": token_ids,
            "logprobs": logprobs,
            "versions": versions,
            "scheduled_versions": np.full(n, scheduled_version),
            "trainer_logprobs": trainer_logprobs,
        }
        for name, dtype in _FIELDS.items():
            value = np.asarray(new[name], dtype)
            if value.shape != (n,):
                raise ValueError(f"Response.extend: {name} has shape {value.shape}, want ({n},)")
            setattr(self, name, np.concatenate([getattr(self, name), value]))
        self.finish_reason = finish_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class Group:
    """One prompt and its G responses.

    uid: creation order over the run; batch: the rollout batch whose generation drew the prompt;
    rewards [G] once every response finished; advantages [G] once computed (kept for replay);
    metadata: the prompt's JSON-able metadata, passed to the reward function with `answer`.
    """

    uid: int
    batch: int
    prompt_ids: tuple[int, ...]
    answer: str
    prompt_id: str
    responses: list[Response]
    rewards: np.ndarray | None = None
    advantages: np.ndarray | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.responses)

    @property
    def has_signal(self) -> bool:
        """False when all G rewards are equal (GRPO advantages are all zero)."""
        return self.rewards is not None and bool(np.ptp(self.rewards) > 0)


def new_group(uid: int, batch: int, prompt: PromptExample, group_size: int) -> Group:
    if prompt.prompt_ids is None:
        raise ValueError(
            f"prompt {prompt.id!r} has no prompt_ids (build the source with a tokenizer)"
        )
    return Group(
        uid=uid,
        batch=batch,
        prompt_ids=tuple(prompt.prompt_ids),
        answer=str(prompt.answer),
        prompt_id=str(prompt.id),
        responses=[Response.empty() for _ in range(group_size)],
        metadata=dict(prompt.metadata),
    )


# ---- serialisation ------------------------------------------------------------------------------


def groups_to_state(groups: Sequence[Group], prefix: str) -> tuple[list[dict], dict[str, Any]]:
    """(JSON metadata per group, flat arrays `<prefix>/...`) of a list of groups."""
    meta, prompts, parts = [], [], {f: [] for f in _FIELDS}
    for g in groups:
        meta.append(
            {
                "uid": g.uid,
                "batch": g.batch,
                "answer": g.answer,
                "prompt_id": g.prompt_id,
                "prompt_len": len(g.prompt_ids),
                "lengths": [len(r.token_ids) for r in g.responses],
                "finish": [r.finish_reason for r in g.responses],
                "rewards": None if g.rewards is None else [float(x) for x in g.rewards],
                "advantages": None if g.advantages is None else [float(x) for x in g.advantages],
                "metadata": g.metadata,
            }
        )
        prompts.append(np.asarray(g.prompt_ids, np.int32))
        for r in g.responses:
            for f in _FIELDS:
                parts[f].append(getattr(r, f))
    arrays = {f"{prefix}/prompts": _concat(prompts, np.int32)}
    for f, dtype in _FIELDS.items():
        arrays[f"{prefix}/{f}"] = _concat(parts[f], dtype)
    return meta, arrays


def groups_from_state(meta: Sequence[dict], arrays: dict[str, Any], prefix: str) -> list[Group]:
    prompts = np.asarray(arrays[f"{prefix}/prompts"])
    total = sum(sum(m["lengths"]) for m in meta)
    flat = {
        f: np.asarray(arrays[f"{prefix}/{f}"])
        if f"{prefix}/{f}" in arrays
        else np.full(total, _MISSING[f], dtype)
        for f, dtype in _FIELDS.items()
    }
    p_at, r_at, groups = 0, 0, []
    for m in meta:
        prompt = tuple(int(x) for x in prompts[p_at : p_at + m["prompt_len"]])
        p_at += m["prompt_len"]
        responses = []
        for length, finish in zip(m["lengths"], m["finish"], strict=True):
            parts = {f: flat[f][r_at : r_at + length].copy() for f in _FIELDS}
            responses.append(Response(**parts, finish_reason=finish))
            r_at += length
        groups.append(
            Group(
                uid=m["uid"],
                batch=m["batch"],
                prompt_ids=prompt,
                answer=m["answer"],
                prompt_id=m["prompt_id"],
                responses=responses,
                rewards=None if m["rewards"] is None else np.asarray(m["rewards"], np.float32),
                advantages=(
                    None if m["advantages"] is None else np.asarray(m["advantages"], np.float32)
                ),
                metadata=dict(m.get("metadata") or {}),  # none in checkpoints before metadata
            )
        )
    return groups


def _concat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


# ---- replay -------------------------------------------------------------------------------------
class ReplayBuffer:
    """A bounded FIFO of trained groups (with their behaviour log-probs and advantages); each
    batch mixes in `sample(R, rng)` of them, drawn uniformly without replacement."""

    def __init__(self, capacity: int):
        self.groups: collections.deque[Group] = collections.deque(maxlen=capacity)

    def add(self, groups: Sequence[Group]) -> None:
        self.groups.extend(groups)

    def sample(self, count: int, rng: np.random.Generator) -> list[Group]:
        """`count` groups, or none while the buffer holds fewer (the batch keeps its shape)."""
        if count == 0 or len(self.groups) < count:
            return []
        picks = rng.choice(len(self.groups), size=count, replace=False)
        return [self.groups[int(i)] for i in sorted(picks)]

    def to_state(self) -> tuple[list[dict], dict[str, Any]]:
        return groups_to_state(list(self.groups), "replay")

    def load_state(self, meta: Sequence[dict], arrays: dict[str, Any]) -> None:
        self.groups.clear()
        self.groups.extend(groups_from_state(meta, arrays, "replay"))


# ---- prompts ------------------------------------------------------------------------------------
class PromptStream:
    """One prompt at a time out of an iterator of prompt batches (`data.pipeline`), keeping the
    unused rest of the current batch; `get_state` = the iterator's state + that rest."""

    def __init__(self, iterator: Iterator[Sequence[PromptExample]]):
        self._iterator = iterator
        self._pending: collections.deque[PromptExample] = collections.deque()

    def next(self) -> PromptExample:
        while not self._pending:
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise RuntimeError("the prompt iterator ran out of prompts") from None
            self._pending.extend(batch)
        return self._pending.popleft()

    def get_state(self) -> dict[str, Any]:
        return {
            "iterator": self._iterator.get_state(),
            "pending": [_prompt_to_json(p) for p in self._pending],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._iterator.set_state(state["iterator"])
        self._pending = collections.deque(_prompt_from_json(p) for p in state["pending"])


def _prompt_to_json(p: PromptExample) -> dict[str, Any]:
    out = dataclasses.asdict(p)
    out["messages"] = [dict(m) for m in p.messages]
    out["prompt_ids"] = None if p.prompt_ids is None else list(p.prompt_ids)
    return out


def _prompt_from_json(d: dict[str, Any]) -> PromptExample:
    ids = d["prompt_ids"]
    return PromptExample(
        index=d["index"],
        id=d["id"],
        problem=d["problem"],
        answer=d["answer"],
        messages=tuple(dict(m) for m in d["messages"]),
        prompt_ids=None if ids is None else tuple(ids),
        metadata=dict(d.get("metadata") or {}),  # none in checkpoints before metadata
    )
