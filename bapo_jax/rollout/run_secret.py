"""A run's secret: the one key its servers' bearer token and its sync manifests' HMAC derive from
(docs/rollout.md, "Authentication").

A run that launches vLLM servers creates one (`new_secret_file`: 32 random bytes, hex, in a
file only its owner can read) and gives the servers its path in their environment
(``BAPO_RUN_SECRET_FILE``), never on a command line, which every local user can read in
``/proc``. From the secret, each as HMAC-SHA256(secret, purpose):

    bearer_token(secret)   what every HTTP route of the servers requires (`server_auth`)
    manifest_key(secret)   the HMAC-SHA256 key of each sync version's manifest (`manifest_auth`)

so the token, which travels in every request's headers, gives nobody the manifest key; the
secret itself is never sent and never written into the sync directory.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

__all__ = [
    "SECRET_FILE_ENV",
    "auth_headers",
    "bearer_token",
    "manifest_key",
    "new_secret_file",
    "read_secret",
    "secret_from_env",
    "token_from_env",
]

SECRET_FILE_ENV = "BAPO_RUN_SECRET_FILE"
SECRET_NAME = "run_secret"


def new_secret_file(directory: str | os.PathLike) -> str:
    """A fresh secret in ``directory/run_secret`` (created owner-only, replaced atomically);
    returns its path."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(os.fspath(directory), SECRET_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.replace(tmp, path)
    return path


def read_secret(path: str | os.PathLike) -> bytes:
    """The secret in ``path``; refused (ValueError naming the file) if others than its owner
    may read it, or if it holds fewer than 16 bytes of text."""
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"secret file {os.fspath(path)!r} is readable by others (mode {stat.filemode(mode)}); "
            "chmod 600 it"
        )
    with open(path, encoding="ascii") as f:
        text = f.read().strip()
    if len(text) < 16:
        raise ValueError(
            f"secret file {os.fspath(path)!r} holds {len(text)} characters, want >= 16"
        )
    return text.encode("ascii")


def secret_from_env() -> bytes | None:
    """The secret of the file ``$BAPO_RUN_SECRET_FILE`` names (None: the variable is unset)."""
    path = os.environ.get(SECRET_FILE_ENV)
    return read_secret(path) if path else None


def token_from_env() -> str | None:
    """The bearer token of ``$BAPO_RUN_SECRET_FILE``'s secret (None: the variable is unset)."""
    secret = secret_from_env()
    return None if secret is None else bearer_token(secret)


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, purpose, hashlib.sha256).digest()


def bearer_token(secret: bytes) -> str:
    """The token every route of the run's servers requires (``Authorization: Bearer ...``)."""
    return _derive(secret, b"bapo-jax bearer token").hex()


def auth_headers(token: str | None) -> dict[str, str]:
    """The HTTP headers a request to the run's servers carries (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def manifest_key(secret: bytes) -> bytes:
    """The HMAC-SHA256 key of the run's sync manifests."""
    return _derive(secret, b"bapo-jax sync manifest")


def main(argv: list[str] | None = None) -> int:
    """``python -m bapo_jax.rollout.run_secret new DIR`` (prints the new secret file's path) or
    ``... token FILE`` (prints the bearer token of FILE's secret, e.g. for curl)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bapo_jax.rollout.run_secret")
    ap.add_argument("command", choices=("new", "token"))
    ap.add_argument("path", help="new: the directory of the secret file; token: the file")
    args = ap.parse_args(argv)
    if args.command == "new":
        print(new_secret_file(args.path))
    else:
        print(bearer_token(read_secret(args.path)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
