"""`TrainState` (step, params, optimizer state) and its shardings, derived from the model's
one declaration of logical axes.

Every parameter is an `nnx.Param` carrying its logical axes in the `out_sharding` metadata.
optax builds its moments with `tree.map` over the params, so the Adam `mu`/`nu` trees carry
the same `Param` nodes and metadata: one walk over the whole state maps each `Param` to
`NamedSharding(mesh, rules(axes))` and everything else (step counters) to replicated. Sharded
init, restore and the train step's in/out shardings all come from `state_shardings`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Int

from bapo_jax.models.config import ModelOptions, Qwen2Config
from bapo_jax.models.lora import LoRAParam
from bapo_jax.models.qwen2 import Qwen2ForCausalLM
from bapo_jax.sharding import rules as rules_lib


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """step: optimizer updates applied so far; params: `nnx.State` of the model's Params;
    opt_state: the optax state (mirrors params)."""

    step: Int[Array, ""]
    params: nnx.State
    opt_state: optax.OptState


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state_like, mesh: Mesh):
    """NamedShardings for any tree of Params (params, optimizer state, a TrainState, abstract or
    concrete): Params by their declared logical axes, other leaves replicated."""

    def leaf(x):
        if _is_variable(x):
            axes = tuple(x.get_metadata("out_sharding"))
            return NamedSharding(mesh, rules_lib.logical_to_spec(axes))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(leaf, state_like, is_leaf=_is_variable)


def split_model(model: Qwen2ForCausalLM) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params); the model must hold nothing but Params (and LoRA adapters)."""
    graphdef, params, rest = nnx.split(model, nnx.Any(nnx.Param, LoRAParam), ...)
    if jax.tree.leaves(rest):
        raise ValueError(f"the model holds non-Param state, unsupported here: {rest}")
    return graphdef, params


def split_trainable(params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
    """(what trains, what stays frozen): with LoRA adapters (`models.lora.LoRAParam`) the
    adapters train and the base Params are frozen; without, every Param trains (None)."""
    if not any(isinstance(v, LoRAParam) for v in jax.tree.leaves(params, is_leaf=_is_variable)):
        return params, None
    return nnx.split_state(params, LoRAParam, ...)


def merge_trainable(trainable: nnx.State, frozen: nnx.State | None) -> nnx.State:
    """The whole params from `split_trainable`'s parts."""
    return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def _build_state(params: nnx.State, optimizer: optax.GradientTransformation) -> TrainState:
    """Step 0; the optimizer's state covers what trains only (`split_trainable`)."""
    trainable, _ = split_trainable(params)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(trainable))


def init_train_state(
    config: Qwen2Config,
    optimizer: optax.GradientTransformation,
    *,
    options: ModelOptions | None = None,
    seed: int = 0,
    mesh: Mesh | None = None,
) -> tuple[nnx.GraphDef, TrainState]:
    """A fresh randomly initialised state; with `mesh`, every array is created in its shard
    (no device ever holds a full copy)."""

    def build() -> TrainState:
        model = Qwen2ForCausalLM(config, options, rngs=nnx.Rngs(params=seed))
        return _build_state(split_model(model)[1], optimizer)

    graphdef, abstract = abstract_train_state(config, optimizer, options=options)
    shardings = None if mesh is None else state_shardings(abstract, mesh)
    return graphdef, jax.jit(build, out_shardings=shardings)()


def train_state_from_model(
    model: Qwen2ForCausalLM,
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh | None = None,
) -> tuple[nnx.GraphDef, TrainState]:
    """Wraps a built or loaded model (e.g. `load_pretrained(..., mesh=mesh)`) in a TrainState;
    the optimizer state is created directly in the params' shardings."""
    graphdef, params = split_model(model)
    build = lambda p: _build_state(p, optimizer)
    shardings = None if mesh is None else state_shardings(jax.eval_shape(build, params), mesh)
    return graphdef, jax.jit(build, out_shardings=shardings)(params)


def abstract_train_state(
    config: Qwen2Config,
    optimizer: optax.GradientTransformation,
    *,
    options: ModelOptions | None = None,
) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, TrainState of ShapeDtypeStructs): nothing allocated (memory plans, restore
    targets)."""
    model = nnx.eval_shape(lambda: Qwen2ForCausalLM(config, options, rngs=nnx.Rngs(0)))
    graphdef, params = split_model(model)
    return graphdef, jax.eval_shape(lambda p: _build_state(p, optimizer), params)
