"""A bearer token on every route of a vLLM server: ``--middleware`` of the servers `serve`
launches with a run secret (`run_secret`).

vLLM 0.32's own ``--api-key`` guards only the paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` (``vllm/entrypoints/serve/middleware/authenticate.py``, ``GUARDED_PREFIX``): the dev
endpoints RL needs (``/pause``, ``/resume``, ``/collective_rpc``, ``/update_weight_version``,
``/reset_prefix_cache``, ...) stay open, and ``/collective_rpc`` runs worker methods. This pure
ASGI middleware guards every HTTP and WebSocket route instead (``/health`` and ``/metrics``
included; only CORS preflights, ``OPTIONS``, pass), comparing SHA-256 digests in constant time.
It reads the token from the secret file ``$BAPO_RUN_SECRET_FILE`` names when the server starts
and refuses to start without one, so a server launched to require a token never serves without.
Imports only the standard library: it runs inside the vLLM environment.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from bapo_jax.rollout.run_secret import SECRET_FILE_ENV, bearer_token, secret_from_env

__all__ = ["MIDDLEWARE", "BearerTokenMiddleware"]

MIDDLEWARE = "bapo_jax.rollout.server_auth.BearerTokenMiddleware"  # vLLM --middleware
_UNAUTHORIZED = b'{"error": "Unauthorized: this server requires the run\'s bearer token"}'

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class BearerTokenMiddleware:
    """Answers 401 (a WebSocket: close code 1008) to any request whose ``Authorization``
    header is not ``Bearer <run_secret.bearer_token(secret)>``."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        secret = secret_from_env()
        if secret is None:
            raise RuntimeError(f"{MIDDLEWARE} needs ${SECRET_FILE_ENV} (the run's secret file)")
        self.app = app
        self._digest = hashlib.sha256(bearer_token(secret).encode()).digest()

    def authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or ())
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(digest, self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        if self.authorized(scope):
            return await self.app(scope, receive, send)
        if kind == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
