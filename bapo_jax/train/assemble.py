"""Finished groups -> the padded, token-aligned arrays of a `TrainBatch`, plus batch metrics.

Row layout (T = P + L, fixed for the run so the train step compiles once):

    [ pad ... pad | prompt tokens ][ response tokens | pad ... pad ]
      0 ....................... P-1  P ......................... P+L-1

Every per-token array is aligned with `input_ids` (see `train.batch`): the response token at
column P + t carries its own behaviour log-prob and the policy version that sampled it, and
its loss_mask is 1 unless the row is inactive (a dynamic-sampling filler, a replay slot not
yet filled) or the response was cut at L with overlong filtering on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from bapo_jax.train.buffers import Group


@dataclasses.dataclass(frozen=True)
class RowArrays:
    """Host arrays of N rows: everything a `TrainBatch` needs, plus per-token versions [N, T]
    (-1 outside responses; reported by the engine, and scheduled by the trainer), the
    trainer's teacher-forced log-probs of the sampled tokens, and per-row bookkeeping."""

    input_ids: np.ndarray  # [N, T] int32
    attention_mask: np.ndarray  # [N, T] int32
    loss_mask: np.ndarray  # [N, T] float32
    advantages: np.ndarray  # [N, T] float32
    behavior_logp: np.ndarray  # [N, T] float32
    versions: np.ndarray  # [N, T] int64
    scheduled_versions: np.ndarray  # [N, T] int64, -1 outside responses
    trainer_logp: np.ndarray  # [N, T] float32, NaN where not computed
    rewards: np.ndarray  # [N] float32
    response_lengths: np.ndarray  # [N] int32
    overlong: np.ndarray  # [N] bool
    replayed: np.ndarray  # [N] bool
    active: np.ndarray  # [N] bool

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def take(self, rows: np.ndarray) -> RowArrays:
        return RowArrays(*(getattr(self, f.name)[rows] for f in dataclasses.fields(self)))


def build_rows(
    groups: Sequence[Group],
    active: Sequence[bool],
    replayed: Sequence[bool],
    *,
    max_prompt_tokens: int,
    max_response_tokens: int,
    pad_id: int,
    overlong_filter: bool,
) -> RowArrays:
    """One row per response of every group (group-major)."""
    p, length = max_prompt_tokens, max_response_tokens
    n = sum(len(g.responses) for g in groups)
    ids = np.full((n, p + length), pad_id, np.int32)  # [N, T]
    attn = np.zeros((n, p + length), np.int32)  # [N, T]
    loss = np.zeros((n, p + length), np.float32)  # [N, T]
    adv = np.zeros((n, p + length), np.float32)  # [N, T]
    logp = np.zeros((n, p + length), np.float32)  # [N, T]
    ver = np.full((n, p + length), -1, np.int64)  # [N, T]
    sched = np.full((n, p + length), -1, np.int64)  # [N, T]
    teacher = np.full((n, p + length), np.nan, np.float32)  # [N, T]
    rewards, lengths = np.zeros(n, np.float32), np.zeros(n, np.int32)
    overlong, row_replayed, row_active = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
    row = 0
    for g, is_active, is_replay in zip(groups, active, replayed, strict=True):
        if len(g.prompt_ids) > p:
            raise ValueError(
                f"prompt {g.prompt_id!r} has {len(g.prompt_ids)} tokens > "
                f"rollout.max_prompt_tokens={p}"
            )
        if g.advantages is None or g.rewards is None:
            raise ValueError(f"group {g.uid} is not scored yet")
        for k, r in enumerate(g.responses):
            t = len(r.token_ids)
            if t > length:
                raise ValueError(f"group {g.uid} response {k} has {t} tokens > {length}")
            ids[row, p - len(g.prompt_ids) : p] = g.prompt_ids
            ids[row, p : p + t] = r.token_ids
            attn[row, p - len(g.prompt_ids) : p + t] = 1
            cut = r.finish_reason != "stop" and t >= length
            trained = is_active and not (overlong_filter and cut)
            loss[row, p : p + t] = float(trained)
            adv[row, p : p + t] = g.advantages[k]
            logp[row, p : p + t] = r.logprobs
            ver[row, p : p + t] = r.versions
            sched[row, p : p + t] = r.scheduled_versions
            teacher[row, p : p + t] = r.trainer_logprobs
            rewards[row], lengths[row], overlong[row] = g.rewards[k], t, cut
            row_replayed[row], row_active[row] = is_replay, is_active
            row += 1
    return RowArrays(
        ids,
        attn,
        loss,
        adv,
        logp,
        ver,
        sched,
        teacher,
        rewards,
        lengths,
        overlong,
        row_replayed,
        row_active,
    )


def batch_metrics(rows: RowArrays, version: int) -> dict[str, float]:
    """What the trained data looked like: rewards, lengths, staleness, version mixing, replay.

    staleness of a token = (policy version being trained) - (version that sampled it), over the
    trained tokens; a response "mixes versions" when its tokens come from > 1 policy version.

    Over the trained tokens too: version_mismatch/share, the share whose engine-reported version
    is older than the one the trainer scheduled (a sync that did not take, or a tag the engine
    could not give: -1; a later one is an in-flight update's); agreement/*, |engine behaviour
    log-prob - trainer log-prob under the engine-reported version's params|: mean, max and the
    tokens it covers (the tokens whose trainer log-prob was computed).
    """
    fresh = rows.active & ~rows.replayed
    trained = rows.loss_mask > 0  # [N, T]
    stale = (version - rows.versions)[trained]
    mixed = [
        len(np.unique(rows.versions[i][rows.versions[i] >= 0])) > 1 for i in range(rows.num_rows)
    ]
    out = {
        "reward/mean": _mean(rows.rewards[fresh]),
        "accuracy": _mean(rows.rewards[fresh] > 0.5),
        "response_length/mean": _mean(rows.response_lengths[fresh]),
        "response_length/max": float(rows.response_lengths.max(initial=0)),
        "overlong_frac": _mean(rows.overlong[fresh]),
        "staleness/mean": _mean(stale),
        "staleness/max": float(stale.max(initial=0)),
        "mixed_version_frac": _mean(np.asarray(mixed)[rows.active]),
        "replay/share": _mean(rows.replayed & rows.active),
        "trained_tokens": float(trained.sum()),
    }
    mismatch = (rows.versions < rows.scheduled_versions)[trained & (rows.scheduled_versions >= 0)]
    out["version_mismatch/share"] = _mean(mismatch)
    out["version_mismatch/tokens"] = float(mismatch.sum())
    checked = trained & np.isfinite(rows.trainer_logp)
    out.update(logprob_gap(rows.behavior_logp, rows.trainer_logp, checked, "agreement"))
    return out


def logprob_gap(
    behavior: np.ndarray, trainer: np.ndarray, mask: np.ndarray, prefix: str
) -> dict[str, float]:
    """|engine behaviour log-prob - trainer log-prob| over the tokens of `mask` (all [N, T]):
    `<prefix>/mean_abs`, `<prefix>/max_abs` and `<prefix>/tokens`; {} when none is masked in.
    The one agreement measure: the teacher's check (`agreement/*`) and the recomputed pi_old's
    (`mismatch/*`, `ratio_base="recomputed"`)."""
    if not mask.any():
        return {}
    gap = np.abs(behavior - trainer)[mask].astype(np.float64)
    return {
        f"{prefix}/mean_abs": float(gap.mean()),
        f"{prefix}/max_abs": float(gap.max()),
        f"{prefix}/tokens": float(mask.sum()),
    }


def _mean(x) -> float:
    x = np.asarray(x, np.float64)
    return float(x.mean()) if x.size else 0.0
