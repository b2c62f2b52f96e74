"""Signed checkpoints: a secret key makes every proof keyed.

A checkpoint's proof already covers every byte of it (the chunk digests, the digests of the
zip's central directory and tensor index, a folder's members). Anyone who can write the
directory can rewrite the file *and* its proof, though: the digests are not secret. With a key,
each proof carries ``signature``: an HMAC-SHA256 of the proof under the key. Without the key a
changed proof cannot be signed again, and with a cryptographic checksum (``blake3`` or
``sha256``, chosen automatically while a key is set) no byte of the file can change under it.

Keys come from the environment, never from beside the checkpoint:

- ``STAGESAVE_SIGNING_KEY``: one key, hex (at least 32 bytes: 64 hex digits);
- ``STAGESAVE_SIGNING_KEY_FILE``: a file of keys, one per line in hex; the first signs, every
  one verifies (key rotation: put the new key first, keep the old ones below while their
  checkpoints are in use);
- ``STAGESAVE_REQUIRE_SIGNED=1``: refuse checkpoints that are not signed by one of the keys.

:func:`configure` sets the same in the process (it wins over the environment).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from dataclasses import dataclass
from typing import Any

from ..errors import ManifestError
from .checksum import CRYPTOGRAPHIC
from .model import dumps

__all__ = ["ENV_KEY", "ENV_KEY_FILE", "ENV_REQUIRE", "Keys", "check_doc", "configure", "current",
           "key_id", "sign_doc"]

ENV_KEY = "STAGESAVE_SIGNING_KEY"
ENV_KEY_FILE = "STAGESAVE_SIGNING_KEY_FILE"
ENV_REQUIRE = "STAGESAVE_REQUIRE_SIGNED"
#: The only signature algorithm.
ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 32
_KEY_ID_HEX = 16
_DOMAIN = b"stagesave proof signature v1\0"


@dataclass(frozen=True)
class Keys:
    """The keys of this process: ``keys[0]`` signs, every one verifies."""

    keys: tuple[bytes, ...]
    require: bool

    @property
    def signing(self) -> bytes | None:
        return self.keys[0] if self.keys else None

    def by_id(self) -> dict[str, bytes]:
        return {key_id(k): k for k in self.keys}


def key_id(key: bytes) -> str:
    """A public name of ``key`` (a hash of it), written beside each signature."""
    return hashlib.sha256(b"stagesave key id\0" + key).hexdigest()[:_KEY_ID_HEX]


def _parse_key(text: str, source: str) -> bytes:
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(
            f"{source}: a signing key is written in hex (e.g. `openssl rand -hex 32`)"
        ) from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{source}: a signing key needs at least {MIN_KEY_BYTES} bytes "
                         f"({2 * MIN_KEY_BYTES} hex digits), got {len(key)}")
    return key


def _from_environment() -> Keys | None:
    keys: list[bytes] = []
    if os.environ.get(ENV_KEY):
        keys.append(_parse_key(os.environ[ENV_KEY], ENV_KEY))
    path = os.environ.get(ENV_KEY_FILE)
    if path:
        try:
            with open(path, encoding="ascii") as f:
                lines = [line for line in f.read().splitlines()
                         if line.strip() and not line.lstrip().startswith("#")]
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{ENV_KEY_FILE}: cannot read the key file {path}: {exc}") from None
        if not lines:
            raise ValueError(f"{ENV_KEY_FILE}: the key file {path} holds no key")
        keys += [_parse_key(line, f"{ENV_KEY_FILE} {path} line {i}")
                 for i, line in enumerate(lines, 1)]
    require = os.environ.get(ENV_REQUIRE, "").strip().lower() in ("1", "true", "yes", "on")
    if require and not keys:
        raise ValueError(f"{ENV_REQUIRE} is set but no key is: set {ENV_KEY} or {ENV_KEY_FILE}")
    if not keys:
        return None
    return Keys(tuple(keys), require)


_lock = threading.Lock()
_configured: Keys | None = None
_is_configured = False
_cache: tuple[tuple[str | None, ...], Keys | None] | None = None


def configure(keys: list[bytes] | tuple[bytes, ...] | None, *, require: bool = False) -> None:
    """Set this process's signing keys (``keys[0]`` signs, all verify), or ``None`` to go back to
    the environment. ``require``: refuse checkpoints not signed by one of them.

    Raises:
        ValueError: a key is shorter than 32 bytes, or ``require`` without a key.
    """
    global _configured, _is_configured
    if keys is None:
        with _lock:
            _configured, _is_configured = None, False
        return
    keys = tuple(bytes(k) for k in keys)
    for k in keys:
        if len(k) < MIN_KEY_BYTES:
            raise ValueError(f"a signing key needs at least {MIN_KEY_BYTES} bytes, got {len(k)}")
    if require and not keys:
        raise ValueError("require=True needs at least one key")
    with _lock:
        _configured, _is_configured = (Keys(keys, require) if keys else None), True


def current() -> Keys | None:
    """The keys in force: those of :func:`configure`, else the environment's (``None``: unsigned).

    Raises:
        ValueError: the environment names a bad key or key file.
    """
    global _cache
    with _lock:
        if _is_configured:
            return _configured
        env: tuple[str | None, ...] = (os.environ.get(ENV_KEY), os.environ.get(ENV_KEY_FILE),
                                       os.environ.get(ENV_REQUIRE))
    if env[1]:  # a key file changed in place is read again: rotation needs no restart
        try:
            st = os.stat(env[1])
            env += (str(st.st_mtime_ns), str(st.st_size), str(st.st_ino))
        except OSError:
            pass  # reading it raises the clear error
    with _lock:
        if _cache is not None and _cache[0] == env:
            return _cache[1]
    keys = _from_environment()
    with _lock:
        _cache = (env, keys)
    return keys


def _mac(key: bytes, payload: bytes) -> str:
    return hmac.new(key, _DOMAIN + payload, hashlib.sha256).hexdigest()


def _payload(doc: dict[str, Any]) -> bytes:
    return dumps({k: v for k, v in doc.items() if k != "signature"})


def sign_doc(doc: dict[str, Any], keys: Keys | None) -> dict[str, Any]:
    """``doc`` with its ``signature`` (last), or ``doc`` unchanged without a signing key."""
    if keys is None or keys.signing is None:
        return doc
    if doc.get("algorithm") not in CRYPTOGRAPHIC:
        raise ValueError(f"cannot sign a proof over {doc.get('algorithm')!r} checksums: they are "
                         "not cryptographic (use checksum='blake3' or 'sha256')")
    key = keys.signing
    signed = {k: v for k, v in doc.items() if k != "signature"}
    mac = _mac(key, _payload(doc))
    signed["signature"] = {"algorithm": ALGORITHM, "key": key_id(key), "mac": mac}
    return signed


def check_doc(doc: dict[str, Any], where: str, keys: Keys | None, *, cryptographic: bool) -> bool:
    """Check ``doc``'s signature against ``keys``. Returns whether it is signed by one of them.

    Without keys a signature is not checked (and an unsigned proof is fine). With keys, a
    signature must be by one of them and match; an unsigned proof is refused when they require
    signatures (without that, anyone can strip a signature: only ``require`` stops an attacker).

    Raises:
        ManifestError: a bad, foreign or missing (when required) signature.
    """
    sig = doc.get("signature")
    if keys is None:
        return False
    if sig is None:
        if keys.require:
            raise ManifestError(f"{where}: not signed, and signatures are required ({ENV_REQUIRE})")
        return False
    if (not isinstance(sig, dict) or set(sig) != {"algorithm", "key", "mac"}
            or sig["algorithm"] != ALGORITHM
            or not isinstance(sig["key"], str) or not isinstance(sig["mac"], str)):
        raise ManifestError(f"{where}: malformed signature")
    key = keys.by_id().get(sig["key"])
    if key is None:
        raise ManifestError(f"{where}: signed with a key this process does not hold "
                            f"(key id {sig['key'][:16]!r}); "
                            f"list every key still in use in {ENV_KEY_FILE}")
    if not hmac.compare_digest(_mac(key, _payload(doc)), sig["mac"]):
        raise ManifestError(f"{where}: the signature does not match the proof: changed, or signed "
                            "again without the key")
    if not cryptographic:
        raise ManifestError(f"{where}: signed, but its checksums are not cryptographic; a "
                            "signature over them proves nothing")
    return True
