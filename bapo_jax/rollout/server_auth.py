"""A bearer token on every route of a vLLM server: ``--middleware`` of the servers `serve`
launches with a run secret (`run_secret`; docs/rollout.md, "Authentication").

vLLM's own ``--api-key`` guards only some paths: ``/collective_rpc``, which runs worker
methods, and the other dev endpoints stay open. This pure ASGI middleware guards every HTTP and
WebSocket route instead (only CORS preflights, ``OPTIONS``, pass), comparing SHA-256 digests in
constant time. It reads the secret file ``$BAPO_RUN_SECRET_FILE`` names when the server starts
and refuses to start without one. Standard library only: it runs inside the vLLM environment.
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
_UNAUTHORIZED_HEADERS = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]

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
        start = {"type": "http.response.start", "status": 401, "headers": _UNAUTHORIZED_HEADERS}
        await send(start)
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
