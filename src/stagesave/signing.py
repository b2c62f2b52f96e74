"""Signed checkpoints (optional): a secret key makes every proof keyed.

See :mod:`stagesave.ondisk.signing` and ``docs/user-guide.md`` (Signed checkpoints) for the threat
model. Keys come from ``STAGESAVE_SIGNING_KEY`` / ``STAGESAVE_SIGNING_KEY_FILE`` (hex, at
least 32 bytes), ``STAGESAVE_REQUIRE_SIGNED=1`` refuses unsigned checkpoints, or from
:func:`configure` in the process.
"""

from .ondisk.signing import (
    ENV_KEY,
    ENV_KEY_FILE,
    ENV_REQUIRE,
    MIN_KEY_BYTES,
    configure,
    current,
    key_id,
)

__all__ = [
    "ENV_KEY", "ENV_KEY_FILE", "ENV_REQUIRE", "MIN_KEY_BYTES", "configure", "current", "key_id",
]
