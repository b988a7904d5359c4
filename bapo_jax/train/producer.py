"""Rollout production: prompts -> responses (in rounds) -> rewards -> advantages -> one batch.

`RolloutProducer.produce(engine, j)` returns rollout batch j: exactly B finished prompt groups.
It keeps a pool of groups in flight and runs generation rounds over every unfinished response:

    round:  each unfinished response continues from prompt + its tokens so far, for at most
            `round_budget` new tokens (the partial-rollout budget, or the full response cap L
            without partial rollouts), sampled by whatever policy the engine holds now;
    finish: a response ends on a stop token or at L tokens; a group whose G responses all ended
            is scored (reward_fn(texts, answers, metadata): each response with its prompt's
            answer and metadata), gets its GRPO advantages and joins the ready queue;
    batch:  the first B ready groups (by creation order).

Without partial rollouts the pool is exactly B groups and one round finishes them all. With
them the pool holds `partial_pool` groups; responses cut by the budget stay in the pool and
are continued by a newer policy when a later batch is produced, so one response can mix
policy versions (each token keeps its own behaviour log-prob and version).

Every round records, per token, the version the trainer had published when it asked (the
engine's `policy_version`; the engine reports its own per token) and, with a `teacher`, the
trainer's teacher-forced log-prob of the token under the params of the version the engine
reported for it, so the run can report how far the engine's behaviour log-probs are from the
trainer's (`assemble`).

Dynamic sampling (DAPO): a finished group whose rewards are all equal carries no gradient
signal; it is dropped and a new prompt takes its place. At most `dynamic_sampling_max_extra`
x B groups are dropped per batch; after that no new prompts are drawn, and a batch still
short when the pool runs dry is completed with dropped groups whose loss is masked out
(`ProducedBatch.active`), reported as status "capped" instead of "filled".
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from bapo_jax.algorithms import advantages as advantages_lib
from bapo_jax.rollout.types import Rollout, RolloutEngine, SamplingParams
from bapo_jax.train import multihost
from bapo_jax.train.buffers import (
    Group,
    PromptStream,
    groups_from_state,
    groups_to_state,
    new_group,
)
from bapo_jax.train.config import TrainerConfig

# (responses, their prompts' answers, their prompts' metadata) -> float rewards [B]. A reward
# function with a `take_metrics() -> dict` method (`rewards.RewardFunction`) also reports what
# it counted (reward/timeouts, reward/plugin_errors, ...) in the metrics of each batch.
RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[Mapping[str, Any]]], np.ndarray]
Decode = Callable[[Sequence[int]], str]
# (version, contexts, new tokens) -> the trainer's log-prob of each new token after its context
# (prompt + the response's earlier tokens) under that version's params, one array per row.
Teacher = Callable[[int, Sequence[Sequence[int]], Sequence[np.ndarray]], list[np.ndarray]]


@dataclasses.dataclass
class ProducedBatch:
    """Rollout batch `index`: B finished groups; active[g] False = a dynamic-sampling filler
    (trained with zero loss); metrics of its production; generation_spans: the (start, end)
    `time.perf_counter` of each engine call, to measure how much of the generation the update
    hid (not checkpointed)."""

    index: int
    groups: list[Group]
    active: list[bool]
    metrics: dict[str, float]
    generation_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)


def _started(group: Group) -> bool:
    """Whether any response of the group has tokens (or ended): it is continued row by row."""
    return any(len(r.token_ids) or r.finished for r in group.responses)


def derive_seed(*parts: int) -> int:
    """A 31-bit seed that is a pure function of the parts (run seed, batch, round, call)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0] >> 1)


class RolloutProducer:
    """Owns the groups in flight and the ready queue; its state goes into the run checkpoint."""

    def __init__(
        self,
        config: TrainerConfig,
        prompts: PromptStream,
        reward_fn: RewardFn,
        decode: Decode,
        *,
        stop_token_ids: Sequence[int] = (),
        teacher: Teacher | None = None,
        score_on_primary: bool = False,
    ):
        """stop_token_ids: ids that end a response, sent with every request (an engine that
        knows no tokenizer, e.g. vLLM with token ids only, stops on nothing else).
        score_on_primary: a multi-process run where every process produces (in-process engine):
        process 0 alone calls reward_fn and broadcasts the rewards (`train.multihost`)."""
        self.config = config
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.decode = decode
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.teacher = teacher
        self.score_on_primary = score_on_primary
        self.pool: list[Group] = []  # groups with responses in flight, by uid
        self.ready: collections.deque[Group] = collections.deque()
        self.next_uid = 0

    # ---- production ---------------------------------------------------------------------------
    def produce(self, engine: RolloutEngine, index: int) -> ProducedBatch:
        cfg, b = self.config, self.config.rollout.prompts_per_step
        algo = cfg.algorithm
        cap = int(algo.dynamic_sampling_max_extra * b) if algo.dynamic_sampling else 0
        out: list[Group] = []
        dropped: list[Group] = []
        stats = collections.Counter()
        t_reward = 0.0
        spans: list[tuple[float, float]] = []
        round_index = 0
        while True:
            while self.ready and len(out) < b:
                out.append(self.ready.popleft())
            if len(out) == b:
                status = "filled"
                break
            if not (algo.dynamic_sampling and dropped and len(dropped) >= cap):
                while len(self.pool) < cfg.pool_groups:
                    self.pool.append(
                        new_group(
                            self.next_uid,
                            index,
                            self.prompts.next(),
                            cfg.rollout.samples_per_prompt,
                        )
                    )
                    self.next_uid += 1
                    stats["prompts_drawn"] += 1
            if not self.pool:
                status = "capped"
                break
            self._round(engine, index, round_index, stats, spans)
            round_index += 1
            done = [g for g in self.pool if g.finished]
            self.pool = [g for g in self.pool if not g.finished]
            start = time.perf_counter()
            self._score(done)
            t_reward += time.perf_counter() - start
            for g in done:
                if algo.dynamic_sampling and not g.has_signal:
                    dropped.append(g)
                else:
                    self.ready.append(g)
        active = [True] * len(out)
        fillers = dropped[: b - len(out)]
        out += fillers
        active += [False] * len(fillers)
        if len(out) < b:  # only reachable with an exhausted pool and nothing dropped
            raise RuntimeError(f"rollout batch {index}: {len(out)} groups, need {b}")
        t_gen = sum(end - start for start, end in spans)
        metrics = {
            "rollout/rounds": round_index,
            "rollout/prompts_drawn": stats["prompts_drawn"],
            "rollout/generated_tokens": stats["tokens"],
            "rollout/in_flight_groups": len(self.pool),
            "time/generate": t_gen,
            "time/reward": t_reward,
            "time/teacher_logprobs": stats["teacher_s"],
        }
        take_metrics = getattr(self.reward_fn, "take_metrics", None)
        if take_metrics is not None:  # over the responses scored while producing this batch
            metrics.update(take_metrics())
        if algo.dynamic_sampling:
            metrics["dynamic_sampling/dropped_groups"] = len(dropped)
            metrics["dynamic_sampling/filler_groups"] = len(fillers)
            metrics["dynamic_sampling/capped"] = int(status == "capped")
        return ProducedBatch(
            index=index, groups=out, active=active, metrics=metrics, generation_spans=spans
        )

    def _round(
        self,
        engine: RolloutEngine,
        index: int,
        round_index: int,
        stats: collections.Counter,
        spans: list[tuple[float, float]],
    ) -> None:
        """One generation round over every unfinished response in the pool: per token budget,
        one call for the groups that have not started (one prompt, n = G samples: the engine
        shares the prefill) and one for the responses being continued (n = 1 each)."""
        cfg = self.config.rollout
        budget = self.config.round_budget
        by_limit: dict[int, list[tuple[Group, int]]] = collections.defaultdict(list)
        for g in self.pool:
            for k, r in enumerate(g.responses):
                if not r.finished:
                    by_limit[min(budget, cfg.max_response_tokens - len(r.token_ids))].append((g, k))
        calls = []  # (limit, n, prompts, the (group, response) of each sample, prompt-major)
        for limit, rows in sorted(by_limit.items()):
            groups = {g.uid: g for g, _ in rows}  # in pool order
            fresh = [g for g in groups.values() if not _started(g)]
            if fresh:
                samples = [(g, k) for g in fresh for k in range(len(g.responses))]
                calls.append(
                    (limit, len(fresh[0].responses), [g.prompt_ids for g in fresh], samples)
                )
            rest = [(g, k) for g, k in rows if _started(g)]
            if rest:
                prompts = [g.prompt_ids + tuple(g.responses[k].token_ids.tolist()) for g, k in rest]
                calls.append((limit, 1, prompts, rest))
        for call, (limit, n, prompts, rows) in enumerate(calls):
            sampling = SamplingParams(
                max_tokens=limit,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                stop_token_ids=self.stop_token_ids,
            )
            scheduled = engine.policy_version
            start = time.perf_counter()
            rollout = engine.generate(
                [list(p) for p in prompts],
                n,
                sampling,
                derive_seed(cfg.seed, index, round_index, call),
            )
            spans.append((start, time.perf_counter()))
            teacher = [None] * len(rows)
            if self.teacher is not None:
                start = time.perf_counter()
                contexts = [prompts[s.prompt_index] for s in rollout.samples]
                teacher = self._teacher(rollout, contexts)
                stats["teacher_s"] += time.perf_counter() - start
            for (g, k), s, lp in zip(rows, rollout.samples, teacher, strict=True):
                r = g.responses[k]
                length = len(r.token_ids) + len(s.token_ids)
                ended = s.finish_reason == "stop" or length >= cfg.max_response_tokens
                r.extend(
                    s.token_ids,
                    s.logprobs,
                    s.versions,
                    s.finish_reason if ended else None,
                    scheduled_version=scheduled,
                    trainer_logprobs=lp,
                )
                stats["tokens"] += len(s.token_ids)

    def _teacher(self, rollout: Rollout, contexts: list[tuple[int, ...]]) -> list[np.ndarray]:
        """The trainer's log-prob of every sampled token under the version the engine reported
        for it (in flight, a response's tail may come from a later version; -1: NaN). Each
        version scores only the rows it sampled tokens of: a version switch mid-call costs
        the few rows that straddle it, not a second pass over the call."""
        samples = rollout.samples
        out = [np.full(len(s.token_ids), np.nan, np.float32) for s in samples]
        versions = np.unique(np.concatenate([s.versions for s in samples] or [[]]))  # sorted
        for version in (int(v) for v in versions if v >= 0):
            rows = [i for i, s in enumerate(samples) if (s.versions == version).any()]
            logps = self.teacher(
                version, [contexts[i] for i in rows], [samples[i].token_ids for i in rows]
            )
            for i, lp in zip(rows, logps, strict=True):
                sel = samples[i].versions == version
                out[i][sel] = lp[sel]
        return out

    def _score(self, groups: Sequence[Group]) -> None:
        """Rewards of the finished groups (one reward_fn call) and their advantages."""
        if not groups:
            return
        g_size = self.config.rollout.samples_per_prompt

        def score() -> np.ndarray:
            texts = [self.decode(r.token_ids.tolist()) for g in groups for r in g.responses]
            answers = [g.answer for g in groups for _ in g.responses]
            metadata = [g.metadata for g in groups for _ in g.responses]
            return np.asarray(self.reward_fn(texts, answers, metadata), np.float32)

        if self.score_on_primary:
            rewards = multihost.primary_rewards(score, (len(groups), g_size))
        else:
            rewards = score().reshape(len(groups), g_size)
        adv = advantages_lib.compute_advantages(
            rewards.reshape(-1), g_size, self.config.algorithm.advantage
        )
        adv = np.asarray(adv, np.float32).reshape(len(groups), g_size)
        for g, rew, a in zip(groups, rewards, adv, strict=True):
            g.rewards, g.advantages = rew, a

    # ---- checkpoint state ---------------------------------------------------------------------
    def get_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        pool_meta, pool_arrays = groups_to_state(self.pool, "pool")
        ready_meta, ready_arrays = groups_to_state(list(self.ready), "ready")
        host = {
            "next_uid": self.next_uid,
            "pool": pool_meta,
            "ready": ready_meta,
            "prompts": self.prompts.get_state(),
        }
        return host, {**pool_arrays, **ready_arrays}

    def set_state(self, host: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.next_uid = host["next_uid"]
        self.pool = groups_from_state(host["pool"], arrays, "pool")
        self.ready = collections.deque(groups_from_state(host["ready"], arrays, "ready"))
        self.prompts.set_state(host["prompts"])
