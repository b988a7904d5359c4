"""The trainer's configuration: one frozen tree, every field validated where it is born.

    TrainerConfig
      rollout:   RolloutConfig    B prompts x G samples per rollout batch, sampling settings
      algorithm: AlgorithmConfig  loss (+ its config), advantages, E = epochs x mini_batches,
                                  micro-batches, dynamic sampling, overlong filtering
      offpolicy: OffPolicyConfig  staleness k, partial-rollout budget, replay
      optimizer: OptimizerConfig
      checkpoint / logging

Command-line overrides (`key.sub=value`) go through `bapo_jax.overrides`; arithmetic that
spans sections (rows per mini-batch, replay rows, micro-batch divisibility) is checked in
`TrainerConfig.__post_init__`, so an impossible run fails before any compute, naming the key.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from bapo_jax.algorithms import losses, registry
from bapo_jax.algorithms.advantages import AdvantageConfig
from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.algorithms.cispo import CISPOConfig
from bapo_jax.algorithms.gspo import GSPOConfig
from bapo_jax.algorithms.kl_cov import KLCovConfig
from bapo_jax.algorithms.losses import ClipHigherConfig, PPOClipConfig
from bapo_jax.checks import check_choice, check_dir_mode, check_field, check_int, is_int
from bapo_jax.train.optim import OptimizerConfig

RatioBase = Literal["behavior", "recomputed"]
Minibatch = Literal["groups", "rows"]
GapPolicy = Literal["mask", "drop", "wait"]
WandbMode = Literal["offline", "online"]


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """prompts_per_step:    B, prompt groups per rollout batch (the paper's 256).
    samples_per_prompt:     G, responses per prompt (the paper's 16).
    max_prompt_tokens:      prompts are left-padded to this (longer ones are refused).
    max_response_tokens:    L, the response length cap (a response hitting it is "overlong").
    temperature / top_p / top_k: sampling settings (training wants top_p 1, top_k 0).
    seed:                   base seed of the rollout RNG; round r of batch j uses a seed derived
                            from (seed, j, r), so a run is reproducible and resumable.
    """

    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    max_prompt_tokens: int = 256
    max_response_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        check_int("prompts_per_step", self.prompts_per_step, 1)
        check_int("samples_per_prompt", self.samples_per_prompt, 2)
        check_int("max_prompt_tokens", self.max_prompt_tokens, 1)
        check_int("max_response_tokens", self.max_response_tokens, 1)
        check_field(self.temperature > 0, "temperature", "> 0", self.temperature)
        check_field(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        check_int("top_k", self.top_k, 0)
        check_int("seed", self.seed, 0)

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """loss:               "bapo" (paper), "ppo_clip", "clip_higher", "gspo" (sequence
                           ratios), "cispo" (clipped IS weights) or "kl_cov" (a KL penalty
                           on the tokens of highest log-prob / advantage covariance); its
                           config is the section of the same name.
    ratio_base:            "behavior" (r = pi_theta / pi_behaviour, paper) or "recomputed"
                           (r = pi_theta / pi_old with IS weights from w = pi_old /
                           pi_behaviour: truncated min(w, is_cap), or masked outside is_band
                           per token or per sequence, the loss section's is_mode; the
                           rollout/trainer mismatch is logged).
    epochs x mini_batches: E, optimizer updates per rollout batch (the paper's staleness E):
                           each epoch shuffles the batch and cuts it into `mini_batches`.
    minibatch:             what the shuffle moves: "groups" (default, as verl cuts them) keeps
                           each prompt's G responses in one mini-batch, so GRPO's per-group
                           zero sum of advantages holds in every update; "rows" shuffles single
                           responses, so an update mixes responses of many groups and its sum
                           of advantages is zero only on average (docs/algorithms.md).
    micro_batches:         gradient accumulation inside one update: M micro-batches of
                           rows_per_update / M rows of prompt + response cap tokens each (the
                           token budget per micro-batch, `TrainerConfig.micro_batch_tokens`).
    packing:               pack each update's sequences into those rows (first-fit-decreasing,
                           `train.packing`), so a micro-batch holds as many sequences as fit
                           its token budget and fewer micro-batches run (at most M; the step
                           skips the empty ones, one compiled program); False = one padded
                           sequence per row. The log-prob passes pack the same way.
    dynamic_sampling:      drop groups whose G rewards are all equal and refill the batch with
                           new prompts (DAPO), drawing at most `dynamic_sampling_max_extra`
                           x B extra prompts per batch; a batch still short at the cap is
                           trained with the missing groups masked out (the metrics say which).
    overlong_filter:       responses that hit max_response_tokens get no loss (DAPO).
    reference_hf_dir:      pi_ref of the KL penalty beta * KL(pi_theta || pi_ref) (beta = the
                           loss section's kl_coef): None = a frozen copy of the initial policy,
                           else an HF checkpoint directory of the policy's architecture. Only
                           read, checked and held when kl_coef > 0 (`train.reference`).
    """

    loss: str = "bapo"
    bapo: BAPOConfig = dataclasses.field(default_factory=BAPOConfig)
    ppo_clip: PPOClipConfig = dataclasses.field(default_factory=PPOClipConfig)
    clip_higher: ClipHigherConfig = dataclasses.field(default_factory=ClipHigherConfig)
    gspo: GSPOConfig = dataclasses.field(default_factory=GSPOConfig)
    cispo: CISPOConfig = dataclasses.field(default_factory=CISPOConfig)
    kl_cov: KLCovConfig = dataclasses.field(default_factory=KLCovConfig)
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    ratio_base: RatioBase = "behavior"
    epochs: int = 1
    mini_batches: int = 1
    minibatch: Minibatch = "groups"
    micro_batches: int = 1
    packing: bool = True
    dynamic_sampling: bool = False
    dynamic_sampling_max_extra: float = 2.0
    overlong_filter: bool = False
    reference_hf_dir: str | None = None

    def __post_init__(self):
        registry.get_loss(self.loss)
        check_field(hasattr(self, self.loss), "loss", "a loss with a config section", self.loss)
        for key in ("epochs", "mini_batches", "micro_batches"):
            check_int(key, getattr(self, key), 1)
        check_field(isinstance(self.packing, bool), "packing", "True or False", self.packing)
        check_choice("ratio_base", self.ratio_base, RatioBase)
        check_choice("minibatch", self.minibatch, Minibatch)
        is_mode = self.loss_config.is_mode
        check_field(
            is_mode == "truncate" or self.ratio_base == "recomputed",
            f"{self.loss}.is_mode",
            'used with ratio_base="recomputed" (the weights are pi_old / pi_behaviour; with '
            '"behavior" there is no pi_old)',
            is_mode,
        )
        check_field(
            self.dynamic_sampling_max_extra >= 0,
            "dynamic_sampling_max_extra",
            ">= 0",
            self.dynamic_sampling_max_extra,
        )
        check_field(
            self.reference_hf_dir is None
            or (isinstance(self.reference_hf_dir, str) and self.reference_hf_dir != ""),
            "reference_hf_dir",
            "None or a directory path",
            self.reference_hf_dir,
        )

    @property
    def kl_coef(self) -> float:
        """beta of the KL penalty: the active loss's `kl_coef` (a reference is held iff > 0)."""
        return self.loss_config.kl_coef

    @property
    def loss_config(self) -> losses.LossTerms:
        return getattr(self, self.loss)

    @property
    def updates_per_batch(self) -> int:
        return self.epochs * self.mini_batches


@dataclasses.dataclass(frozen=True)
class OffPolicyConfig:
    """staleness:       k; rollout batch i is generated by policy version max(0, i - k)
                        (version v = the weights after v rollout batches were trained on).
                        Generation of batch i + k overlaps the update on batch i.
    partial_budget:     tokens per response per generation round; None = no partial
                        rollouts. Responses unfinished after a round keep their tokens,
                        behaviour log-probs and versions and are continued in a later round,
                        possibly by a newer policy.
    partial_pool:       prompt groups in flight under partial rollout (>= B; default 2 B).
    replay_ratio:       share of each update's rows drawn from the replay buffer of earlier
                        batches (0 disables); rows are added as R groups per batch with
                        R / (B + R) = replay_ratio, so R = replay_ratio B / (1 - replay_ratio)
                        must be a whole number.
    replay_capacity:    groups the replay buffer holds (oldest evicted first).
    inflight:           weight updates in flight (vLLM engines): version i + 1 is loaded
                        while batches i + 1 .. i + k still generate (running requests freeze,
                        their KV is recomputed with the new weights, each token keeps the
                        version that sampled it), instead of draining the producer first.
                        No iteration waits for the longest response; a token is still at most
                        k versions old; the run is no longer reproducible token for token
                        (where a switch lands in a response depends on timing).
    max_version_gap:    G: trained tokens sampled more than G versions before the one being
                        trained are handled by `gap_policy` (None: all are trained as they are;
                        `train.staleness`): "mask" takes those tokens out of the loss, "drop"
                        their whole responses, "wait" submits batches at most G versions ahead
                        (effective staleness min(k, G)) and masks what is older still (a partial
                        rollout's early tokens, replayed groups).
    """

    staleness: int = 0
    partial_budget: int | None = None
    partial_pool: int | None = None
    replay_ratio: float = 0.0
    replay_capacity: int = 64
    inflight: bool = False
    max_version_gap: int | None = None
    gap_policy: GapPolicy = "mask"

    def __post_init__(self):
        check_int("staleness", self.staleness, 0)
        for key, low in (("partial_budget", 1), ("partial_pool", 1), ("max_version_gap", 0)):
            value = getattr(self, key)
            check_field(value is None or is_int(value, low), key, f"None or an int >= {low}", value)
        check_field(0 <= self.replay_ratio < 1, "replay_ratio", "in [0, 1)", self.replay_ratio)
        check_int("replay_capacity", self.replay_capacity, 1)
        check_field(isinstance(self.inflight, bool), "inflight", "a bool", self.inflight)
        check_choice("gap_policy", self.gap_policy, GapPolicy)
        check_field(
            self.max_version_gap is None
            or self.gap_policy == "wait"
            or self.inflight
            or self.max_version_gap >= self.staleness,
            "max_version_gap",
            f">= staleness ({self.staleness}) with gap_policy {self.gap_policy!r}: every token "
            "of a batch generated k versions back would leave the loss (gap_policy 'wait' "
            "lowers the staleness to the gap instead)",
            self.max_version_gap,
        )
        check_field(
            self.max_version_gap is not None or self.gap_policy == "mask",
            "gap_policy",
            "'mask' (the default) unless max_version_gap is set: a policy for tokens past the "
            "gap needs the gap",
            self.gap_policy,
        )

    def replay_groups(self, prompts_per_step: int) -> int:
        """R, the replayed groups mixed into each batch."""
        if self.replay_ratio == 0:
            return 0
        exact = self.replay_ratio * prompts_per_step / (1 - self.replay_ratio)
        groups = round(exact)
        check_field(
            abs(exact - groups) < 1e-6 and groups >= 1,
            "offpolicy.replay_ratio",
            f"such that replay_ratio * B / (1 - replay_ratio) is a whole number >= 1 "
            f"(B = rollout.prompts_per_step = {prompts_per_step}, e.g. 0.5 or "
            f"{1 / (prompts_per_step + 1):.4g})",
            self.replay_ratio,
        )
        return groups


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """directory: None = <out_dir>/checkpoints; every: iterations between saves (0 = only at the
    end); keep: checkpoints kept on disk; dir_mode: the permissions (octal digits, "700":
    owner-only) of the directory when the run creates it."""

    directory: str | None = None
    every: int = 10
    keep: int = 3
    async_save: bool = True
    dir_mode: str = "700"

    def __post_init__(self):
        check_int("every", self.every, 0)
        check_int("keep", self.keep, 1)
        check_dir_mode("dir_mode", self.dir_mode)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """JSONL is always written; tensorboard / plots / progress can be switched off;
    plot_every: iterations between PNG refreshes; peak_flops_per_device: for MFU (None: not
    logged); logprob_agreement: teacher-force every sampled token under the params of the
    version that sampled it and log |engine - trainer| log-prob (`train.behaviour`; costs a
    copy of the params and a forward pass per generated row); gradient_by_sign_every: 0 (off)
    or n: every n-th update splits its gradient by the sign of the tokens' advantages and logs
    ||g_+||, ||g_-|| and the negatives' share (`train.step.StepConfig`; one more backward
    pass on those updates).
    wandb: also log to Weights & Biases (`pip install -e '.[wandb]'`; `train.tracking`): the
    TensorBoard scalars, the run config and the plots, under <out_dir>/wandb/, one run
    continued across resumes. wandb_mode "offline" (no network; `wandb sync` later) or
    "online"; wandb_project / wandb_entity (None: your default) / wandb_run_name (None: W&B
    picks); wandb_system_metrics: wandb-core's CPU/GPU sampling and console capture (off: a
    quiet CPU run)."""

    tensorboard: bool = True
    plots: bool = True
    progress: bool = True
    plot_every: int = 5
    peak_flops_per_device: float | None = None
    logprob_agreement: bool = False
    gradient_by_sign_every: int = 0
    wandb: bool = False
    wandb_project: str = "bapo-jax"
    wandb_entity: str | None = None
    wandb_mode: WandbMode = "offline"
    wandb_run_name: str | None = None
    wandb_system_metrics: bool = False

    def __post_init__(self):
        check_int("plot_every", self.plot_every, 1)
        check_int("gradient_by_sign_every", self.gradient_by_sign_every, 0)
        for key in ("logprob_agreement", "wandb", "wandb_system_metrics"):
            check_field(isinstance(getattr(self, key), bool), key, "a bool", getattr(self, key))
        check_choice("wandb_mode", self.wandb_mode, WandbMode)
        check_field(
            isinstance(self.wandb_project, str) and self.wandb_project.strip() != "",
            "wandb_project",
            "a non-empty string",
            self.wandb_project,
        )
        for key in ("wandb_entity", "wandb_run_name"):
            value = getattr(self, key)
            check_field(value is None or (isinstance(value, str) and value.strip() != ""), key,
                   "None or a non-empty string", value)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """The whole RL loop: `steps` rollout batches, each followed by E updates and a sync;
    eval_every: iterations between evaluations (0 = none; the last iteration always evaluates
    when > 0); eval_at_start: also evaluate the starting weights before the first iteration
    (a fresh run only; the summary's `eval_at_start`)."""

    steps: int = 10
    eval_every: int = 0
    eval_at_start: bool = False
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    offpolicy: OffPolicyConfig = dataclasses.field(default_factory=OffPolicyConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def __post_init__(self):
        check_int("steps", self.steps, 1)
        check_int("eval_every", self.eval_every, 0)
        r, a, o = self.rollout, self.algorithm, self.offpolicy
        rows = self.rows_per_batch
        check_field(
            rows % a.mini_batches == 0,
            "algorithm.mini_batches",
            f"a divisor of the {rows} rows per rollout batch",
            a.mini_batches,
        )
        groups = self.groups_per_batch
        check_field(
            a.minibatch == "rows" or groups % a.mini_batches == 0,
            "algorithm.mini_batches",
            f'a divisor of the {groups} groups per rollout batch (minibatch="groups" keeps '
            'whole groups in an update; or minibatch="rows")',
            a.mini_batches,
        )
        per_update = rows // a.mini_batches
        check_field(
            per_update % a.micro_batches == 0,
            "algorithm.micro_batches",
            f"a divisor of the {per_update} rows per update",
            a.micro_batches,
        )
        if o.partial_pool is not None:
            check_field(
                o.partial_pool >= r.prompts_per_step,
                "offpolicy.partial_pool",
                f">= rollout.prompts_per_step = {r.prompts_per_step}",
                o.partial_pool,
            )
        if o.partial_budget is not None:
            check_field(
                o.partial_budget < r.max_response_tokens,
                "offpolicy.partial_budget",
                f"< rollout.max_response_tokens = {r.max_response_tokens} (else no response "
                "is ever cut)",
                o.partial_budget,
            )

    @property
    def groups_per_batch(self) -> int:
        """Groups one rollout batch trains on: B + R replayed groups."""
        r = self.rollout
        return r.prompts_per_step + self.offpolicy.replay_groups(r.prompts_per_step)

    @property
    def rows_per_batch(self) -> int:
        """Rows one rollout batch trains on: (B + R replayed groups) x G."""
        return self.groups_per_batch * self.rollout.samples_per_prompt

    @property
    def rows_per_micro_batch(self) -> int:
        a = self.algorithm
        return self.rows_per_batch // a.mini_batches // a.micro_batches

    @property
    def row_length(self) -> int:
        """Tokens per trained row: prompt cap + response cap."""
        return self.rollout.max_prompt_tokens + self.rollout.max_response_tokens

    @property
    def micro_batch_tokens(self) -> int:
        """The token budget of one micro-batch: rows_per_micro_batch x row_length."""
        return self.rows_per_micro_batch * self.row_length

    @property
    def pool_groups(self) -> int:
        """Prompt groups in flight: B without partial rollouts, `partial_pool` (2 B) with."""
        if self.offpolicy.partial_budget is None:
            return self.rollout.prompts_per_step
        return self.offpolicy.partial_pool or 2 * self.rollout.prompts_per_step

    @property
    def round_budget(self) -> int:
        return self.offpolicy.partial_budget or self.rollout.max_response_tokens
