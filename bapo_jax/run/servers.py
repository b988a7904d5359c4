"""What a run needs of its vLLM servers, checked through their ``GET /v1/models`` before any
compute: that each serves the run's model name, with a context (``max_model_len``) that holds
the run's longest sequence (prompt cap + response cap).

vLLM lists every served model as ``{"id": <served name>, "max_model_len": <tokens>, "root":
<model path>, ...}`` under ``"data"``. Servers given by URL (``engine.vllm_urls``) are checked
by `validate_run` before the build; servers a run launches (``engine.launch_servers``), once
they answer ``/health``, before the first request. Each refusal names the key at fault.

`run.config.validate_run` uses it (given servers, GPUs shared with the trainer), and
`run.build` (launched servers); it imports nothing the config does not.
"""

from __future__ import annotations

from typing import Any

from bapo_jax.rollout.run_secret import auth_headers
from bapo_jax.run.config import RunConfig, RunConfigError

MODELS_PATH = "/v1/models"


def max_model_len(config: RunConfig) -> int:
    """Tokens a server must hold: the prompt cap + the longer of the response and eval caps."""
    r = config.trainer.rollout
    eval_tokens = config.eval.max_tokens if config.trainer.eval_every else 0
    return r.max_prompt_tokens + max(r.max_response_tokens, eval_tokens)


def max_model_len_terms(config: RunConfig) -> str:
    """How `max_model_len(config)` comes about, by key (for error messages)."""
    r = config.trainer.rollout
    response = f"trainer.rollout.max_response_tokens {r.max_response_tokens}"
    if config.trainer.eval_every:
        response = f"max({response}, eval.max_tokens {config.eval.max_tokens})"
    return f"trainer.rollout.max_prompt_tokens {r.max_prompt_tokens} + {response}"


def served_model_name(config: RunConfig) -> str | None:
    """The model name requests carry to servers the run launches: engine.server.served_model_name,
    else model.hf_dir (vLLM's own default: the --model path)."""
    return config.engine.server.served_model_name or config.model.hf_dir


def check_devices(config: RunConfig) -> None:
    """Refuses launched servers on GPUs the trainer uses (`trainer_devices`: the first N, or
    ids; the same indexing as engine.server.devices): JAX and vLLM each reserve most of a
    GPU's memory, so they share one only when colocated (`engine.colocate`), and then every
    server GPU must be the trainer's (`validate_run` checks the two memory shares).
    Checks nothing without server GPUs; with them, trainer_devices None (every local device)
    is refused unless colocated."""
    from bapo_jax.rollout.serve import parse_devices

    spec, e = config.trainer_devices, config.engine
    if not e.server.devices or not e.launch_servers:
        return
    if spec is None:
        if e.colocated:  # every local GPU is the trainer's
            return
        raise RunConfigError(
            f"trainer_devices: None (every local GPU) leaves none for the servers launched on "
            f"engine.server.devices={e.server.devices!r}; set trainer_devices (--trainer-devices) "
            "to the trainer's share, or run the servers elsewhere (--vllm-url)"
        )
    trainer = set(range(spec)) if isinstance(spec, int) else set(spec)
    for i, text in enumerate(e.server.devices):
        gpus = set(parse_devices(text))
        if e.colocated and not gpus <= trainer:
            raise RunConfigError(
                f"engine.server.devices: server {i}'s GPUs {sorted(gpus - trainer)} are not the "
                f"trainer's (trainer_devices={spec!r}); colocated servers run on the trainer's "
                "GPUs (engine.colocate)"
            )
        shared = sorted(trainer & gpus)
        if shared and not e.colocated:
            raise RunConfigError(
                f"engine.server.devices: server {i}'s GPUs {shared} are the trainer's too "
                f"(trainer_devices={spec!r}); give the servers other GPUs, or colocate them "
                "(engine.colocate=true)"
            )


def list_models(
    url: str, key: str, *, token: str | None = None, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """The model cards of ``url``'s ``/v1/models`` (asked with the bearer ``token``, if any);
    a server that does not answer with a list of cards each having an ``id`` is refused under
    ``key``."""
    import requests

    where = url.rstrip("/") + MODELS_PATH
    headers = auth_headers(token)
    try:
        reply = requests.get(where, headers=headers, timeout=(5.0, timeout_s))
        reply.raise_for_status()
        cards = reply.json()["data"]
        if not isinstance(cards, list) or not all(
            isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards
        ):
            raise TypeError(f"'data' is not a list of model cards with an 'id': {cards!r}")
    except (requests.RequestException, ValueError, KeyError, TypeError) as error:
        raise RunConfigError(f"{key}: {url} does not answer GET {MODELS_PATH} ({error})") from None
    return cards


def server_token(config: RunConfig) -> str | None:
    """The bearer token of servers given by URL: engine.server.secret_file's, else
    $BAPO_RUN_SECRET_FILE's (None: no secret, no token)."""
    from bapo_jax.rollout import run_secret

    path = config.engine.server.secret_file
    if path is None:
        return run_secret.token_from_env()
    return run_secret.bearer_token(run_secret.read_secret(path))


def check_server(
    config: RunConfig, url: str, *, launched: bool = False, token: str | None = None
) -> str:
    """Refuses server ``url`` unless it serves the run's model with a context of at least
    `max_model_len(config)` tokens; returns the served name requests must carry.

    The name: engine.server.served_model_name if set; for a launched server, model.hf_dir otherwise;
    for a given server, the one model it lists otherwise. ``launched``: the run started the
    server (errors name engine.launch_servers instead of engine.vllm_urls). ``token``: the
    servers' bearer token (None: `server_token(config)`'s)."""
    key = "engine.launch_servers" if launched else "engine.vllm_urls"
    cards = list_models(url, key, token=token or server_token(config))
    names = [c["id"] for c in cards]
    wanted = served_model_name(config) if launched else config.engine.server.served_model_name
    if wanted is not None and wanted not in names:
        raise RunConfigError(
            f"engine.server.served_model_name: {url} does not serve {wanted!r} (it serves "
            f"{names}); set engine.server.served_model_name to the server's --served-model-name"
        )
    if wanted is None:
        if len(names) != 1:
            raise RunConfigError(
                f"engine.server.served_model_name: {url} serves {names}; name the one to use"
            )
        wanted = names[0]
    card = next(c for c in cards if c["id"] == wanted)
    have, need = card.get("max_model_len"), max_model_len(config)
    if isinstance(have, bool) or not isinstance(have, int):
        raise RunConfigError(
            f"{key}: {url}{MODELS_PATH} lists no max_model_len for {wanted!r} (got {have!r}), "
            f"so it cannot be checked to hold the run's {need} tokens"
        )
    if have < need:
        raise RunConfigError(
            f"{key}: {url} serves {wanted!r} with max_model_len {have}, fewer than the "
            f"{need} tokens the run needs ({max_model_len_terms(config)}); start it with "
            f"--max-model-len {need} or lower those caps"
        )
    return wanted
