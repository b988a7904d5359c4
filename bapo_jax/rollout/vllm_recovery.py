"""Bringing a vLLM server back to the last good weights: reload, else restart, else retire.

``VLLMEngine`` (``vllm_client``) calls ``ServerRecovery`` when a server's weights are in doubt:
a weight load that failed part-way (the worker is poisoned: never serve from it), or a server
found paused with no update running (e.g. left so by a crashed trainer). The ladder:

1. reload the last good version (``LastGood``: its checkpoint, or with none known, only check
   that the boot weights are intact), then resume the server;
2. if that fails and a ``RestartHook`` is set (e.g. ``serve.ServerGroup.restart``): take the
   server out of rotation, restart its process, pause it, load the last good version (or tag its
   boot weights with it), resume it and put it back in rotation;
3. otherwise, or if the restart fails: retire the server (out of rotation for good).

``ServerRecovery.load`` is one server's part of a weight update (pause, load, tag, resume),
which enters the ladder when the load fails part-way.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from bapo_jax.rollout.vllm_http import (
    RolloutRequestError,
    Server,
    ServerUnavailableError,
    WeightSyncError,
)

__all__ = ["LastGood", "RestartHook", "ServerRecovery"]

# Stops server ``url`` and boots it again with its boot weights; returns once it is healthy,
# raises otherwise. ``serve.ServerGroup.restart`` is one.
RestartHook = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class LastGood:
    """The last good version: its checkpoint (None: the servers' boot weights) and number."""

    checkpoint: str | None
    version: int


class ServerRecovery:
    """The repair ladder of the module doc, for the servers of one ``VLLMEngine``.

    idle: the engine's condition (its lock guards the servers' rotation flags; waiters are
      notified when a restart ends).
    restart: the hook that restarts a server's process (None: a server that cannot be repaired
      by a reload is retired).
    """

    def __init__(self, idle: threading.Condition, restart: RestartHook | None = None):
        self._idle = idle
        self._restart_hook = restart
        self.restarted: list[str] = []  # servers restarted, in order

    @property
    def can_restart(self) -> bool:
        return self._restart_hook is not None

    def load(
        self, server: Server, version: int, checkpoint: str, good: LastGood
    ) -> tuple[dict | None, str | None, bool]:
        """One server's weight load: pause, load ``checkpoint``, tag and resume. Returns (the
        worker's reply, or None if none came; None or the error; whether the server must be
        restarted). On error the server is back on ``good`` and resumed, or out of rotation
        (restart pending, or retired)."""
        try:
            server.pause()
            reply = server.load(checkpoint, version)
        except (RolloutRequestError, ServerUnavailableError) as e:
            return None, *self.repair(server, f"{e}", good)  # the load may have half-happened
        if not reply.get("ok"):
            err = f"load refused at stage {reply.get('stage')}: {reply.get('error')}"
            if reply.get("stage") != "validate":
                return reply, *self.repair(server, err, good)
            try:  # refused before loading: the old weights are intact
                server.finish(server.version)
            except (RolloutRequestError, ServerUnavailableError) as e:
                return reply, *self.repair(server, f"{err}; then {e}", good)
            return reply, err, False
        try:
            server.finish(version)
        except (RolloutRequestError, ServerUnavailableError) as e:
            return reply, f"loaded version {version} but could not resume: {e}", False
        return reply, None, False

    def repair(self, server: Server, err: str, good: LastGood) -> tuple[str, bool]:
        """Never serve from a half-loaded model: reload the last good version, then resume. If
        that fails: mark the server for a restart (when a hook is set; it leaves rotation until
        ``restart``) or leave it paused and out of rotation. ``err``: what went wrong first.
        Returns (the error to report, whether the server must be restarted)."""
        try:
            self.restore(server, good)
        except (RolloutRequestError, ServerUnavailableError, WeightSyncError) as e2:
            if self._restart_hook is not None:
                with self._idle:
                    server.restarting = True
                return f"{err}; reloading version {good.version} failed ({e2})", True
            server.retired = f"failed load and failed recovery ({e2})"
            return f"{err}; recovery failed, server out of rotation: {e2}", False
        return f"{err} (server restored to version {good.version})", False

    def bring_back(self, server: Server, good: LastGood) -> bool:
        """A server that answers again after it stopped answering (`vllm_liveness`): reload
        ``good`` unless it holds it (an update skipped it meanwhile), then tag and resume.
        Returns whether it may rejoin the rotation (False: try again at its next answer)."""
        try:
            if server.worker_state().get("poisoned") or server.version != good.version:
                server.pause()
                self.restore(server, good)
            elif server.is_paused():
                server.finish(good.version)
            return True
        except (RolloutRequestError, ServerUnavailableError, WeightSyncError):
            return False

    def restore(self, server: Server, good: LastGood, *, booted: bool = False) -> None:
        """Load the last good checkpoint, then tag, reset and resume (`Server.finish`). With no
        checkpoint known the boot weights are the last good version: a freshly ``booted``
        server's are tagged with it, another's only checked to be intact."""
        result = {"ok": True}
        if good.checkpoint is not None:
            result = server.load(good.checkpoint, good.version)
        elif booted:
            result = server.rpc("bapo_set_version", {"version": good.version})
        elif server.worker_state().get("poisoned"):
            raise WeightSyncError(f"{server.url} is poisoned and no last good checkpoint is known")
        if not result.get("ok"):
            raise WeightSyncError(
                f"{server.url}: loading version {good.version} failed at stage "
                f"{result.get('stage')}: {result.get('error')}"
            )
        server.finish(good.version)

    def restart(self, server: Server, good: LastGood) -> tuple[bool, str]:
        """Restart ``server`` with the hook and bring it back on ``good``, tagged, resumed and
        in rotation; on any failure it is retired. Returns (ok, what happened)."""
        with self._idle:
            server.restarting = True
        try:
            self._restart_hook(server.url)
            server.reconnect()
            server.adapter = None  # a fresh process holds no LoRA adapter
            server.pause()  # hold anyone else's requests until the weights are right
            self.restore(server, good, booted=True)
        except Exception as e:  # the hook may raise anything; the server must not serve
            server.retired = f"restart failed ({type(e).__name__}: {e})"
            return False, f"restart failed, server out of rotation: {type(e).__name__}: {e}"
        finally:
            with self._idle:
                server.restarting = False
                server.down_until = 0.0
                self._idle.notify_all()
        self.restarted.append(server.url)
        return True, f"server restarted and restored to version {good.version}"

    def resume_paused(self, server: Server, good: LastGood) -> bool:
        """Resume a server in rotation found paused: at once if its worker holds ``good``,
        else through the ladder (`repair`: reload ``good``; then restart, or retire). Returns
        whether it serves again. A server that does not answer is left as it is: the caller's
        request retries go elsewhere, and its next timeout asks again. The caller holds
        ``server.recovering``."""
        try:
            if not server.in_rotation or not server.is_paused():
                return False
            state = server.worker_state()
            if not state.get("poisoned") and state.get("version") in (None, good.version):
                server.finish(good.version)
                return True
        except (RolloutRequestError, ServerUnavailableError):
            return False  # not answering (or not resumed): nothing more to do from here
        _, must_restart = self.repair(server, "found paused on other weights", good)
        if must_restart:
            return self.restart(server, good)[0]
        return server.retired is None
