"""Signed sync manifests: an HMAC-SHA256 that only the run's own writer can produce
(docs/rollout.md, "Who may write and what a server reads").

The file table (`sync_checks.FILES_SCHEME`) catches damaged files, not forged ones. With the
run's manifest key (`run_secret.manifest_key`; never written into the sync directory) the
writer adds to the manifest

    "hmac": HMAC-SHA256(key, HMAC_SCHEME + "\\n" + canonical JSON of every other field), hex

where the canonical JSON is ``json.dumps(fields, sort_keys=True, separators=(",", ":"),
ensure_ascii=True)`` of the manifest without its ``hmac`` field, exactly the dict the reader
then trusts (the one ``json.load`` gave it: JSON round-trips these values exactly), so a byte
changed anywhere in what the reader uses breaks it. A reader given the key (`verify_manifest`)
refuses a manifest without a valid HMAC (constant-time compare); a reader without one accepts
unsigned manifests. Standard library only: the worker imports it inside the vLLM server.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "HMAC_FIELD",
    "HMAC_SCHEME",
    "check_key",
    "manifest_hmac",
    "sign_manifest",
    "verify_manifest",
]

HMAC_FIELD = "hmac"
HMAC_SCHEME = "bapo-manifest-hmac-sha256-v1"
_MIN_KEY_BYTES = 16


def check_key(key: Any) -> bytes:
    """``key``, once it is a usable manifest key (ValueError otherwise, not showing it)."""
    if not isinstance(key, bytes) or len(key) < _MIN_KEY_BYTES:
        raise ValueError(
            f"manifest_key must be bytes of length >= {_MIN_KEY_BYTES} "
            f"(run_secret.manifest_key), got {type(key).__name__}"
        )
    return key


def _signed_bytes(manifest: Mapping[str, Any]) -> bytes:
    fields = {k: v for k, v in manifest.items() if k != HMAC_FIELD}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{HMAC_SCHEME}\n{text}".encode("ascii")


def manifest_hmac(manifest: Mapping[str, Any], key: bytes) -> str:
    """The hex HMAC-SHA256 of ``manifest`` (all fields but ``hmac``) under ``key``."""
    return hmac.new(check_key(key), _signed_bytes(manifest), hashlib.sha256).hexdigest()


def sign_manifest(manifest: Mapping[str, Any], key: bytes | None) -> dict[str, Any]:
    """``manifest`` with its ``hmac`` field (None: unsigned, as it is)."""
    if key is None:
        return dict(manifest)
    return {**manifest, HMAC_FIELD: manifest_hmac(manifest, key)}


def verify_manifest(
    path: str | os.PathLike, manifest: Mapping[str, Any], key: bytes | None
) -> None:
    """Refuse (ValueError naming the version dir) a manifest whose ``hmac`` is missing or is not
    the one ``key`` gives; no key: nothing to check."""
    if key is None:
        return
    got, path = manifest.get(HMAC_FIELD), os.fspath(path)
    if not isinstance(got, str):
        raise ValueError(
            f"{path}: manifest has no {HMAC_FIELD!r} (unsigned), and this reader holds the run's "
            "manifest key: refused like a damaged version (forged, or written without "
            "manifest_key)"
        )
    want = manifest_hmac(manifest, key)
    if not (got.isascii() and hmac.compare_digest(got.encode("ascii"), want.encode("ascii"))):
        raise ValueError(
            f"{path}: manifest HMAC mismatch (not signed with this run's manifest key: forged, "
            "altered, or written by another run)"
        )
