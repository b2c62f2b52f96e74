"""Names and sizes of on-disk things, defined once."""

from __future__ import annotations

import re

#: Manifests sit beside the data file: ``<name>.<serialization_id>`` + this suffix.
MANIFEST_SUFFIX = ".stagesave.json"
#: Marker inside the names of files being written; only such files are ever cleaned up.
TMP_MARKER = ".stagesave-tmp"
#: The manifest of a directory checkpoint (several files committed together), inside it.
DIR_MANIFEST = "checkpoint" + MANIFEST_SUFFIX
#: Marker of a directory moved aside while a newer one of the same name is moved in.
ASIDE_MARKER = ".stagesave-aside"
#: Telemetry JSON lines, one per save, beside the checkpoints when enabled.
TELEMETRY_FILE = "stagesave-telemetry.jsonl"
#: Schema of the sidecar manifests of format 1 (read; written only by ``stagesave adopt``).
SCHEMA_VERSION = 1
#: Schema of the embedded proof (format 2) and of its summary.
SCHEMA_EMBEDDED = 2
#: Format 2: the zip records of a torch file that hold its tensor index and its proof (proof last),
#: relative to the archive's folder.
INDEX_RECORD = ".data/stagesave/index.json"
PROOF_RECORD = ".data/stagesave/proof.json"
#: Format 2: the ``__metadata__`` key of a safetensors header that holds the proof.
PROOF_KEY = "stagesave.proof"
#: Format tag inside every manifest.
FORMAT_TAG = "stagesave"
#: Alignment of storage records in the file image and of O_DIRECT transfers.
ALIGNMENT = 4096
#: Default size of a checksum chunk (also the unit of parallel writes).
DEFAULT_CHUNK_BYTES = 32 * 1024 * 1024
#: Largest manifest we agree to parse.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
#: Largest file size a manifest may declare (1 PiB): anything bigger is absurd.
MAX_FILE_BYTES = 1 << 50


def manifest_name(data_name: str, serialization_id: str) -> str:
    """The manifest's file name for a data file of that name and torch serialization id."""
    return f"{data_name}.{serialization_id}{MANIFEST_SUFFIX}"


def split_manifest_name(name: str) -> tuple[str, str] | None:
    """Inverse of :func:`manifest_name`: ``(data_name, serialization_id)`` or ``None``."""
    if not name.endswith(MANIFEST_SUFFIX):
        return None
    stem = name[: -len(MANIFEST_SUFFIX)]
    data_name, dot, sid = stem.rpartition(".")
    if not dot or not data_name or not sid.isalnum():
        return None
    return data_name, sid


def aside_name(leaf: str, token: str) -> str:
    """Where an existing directory checkpoint waits while its replacement is moved in.

    ``token`` is ``<pid>-<8 hex digits>``.
    """
    return f".{leaf}.{token}{ASIDE_MARKER}"


_ASIDE_RE = re.compile(
    r"^\.(?P<data>.+)\.(?P<pid>\d+)-(?P<token>[0-9a-f]{8})" + re.escape(ASIDE_MARKER) + r"$"
)


def parse_aside_name(leaf: str) -> tuple[str, int] | None:
    """``(original name, pid of the mover)`` of a folder named by :func:`aside_name`, else ``None``
    (a user's folder that only resembles one is never touched)."""
    m = _ASIDE_RE.match(leaf)
    return (m.group("data"), int(m.group("pid"))) if m else None


def is_temporary(name: str) -> bool:
    """Whether a file name is one of stagesave's own temporaries (the only thing gc removes)."""
    return TMP_MARKER in name


#: How deep a folder checkpoint's files may nest (hooks write e.g. ``tokenizer/vocab.txt``):
#: readers list this many levels of folders, and ``save_dir`` refuses a file deeper.
MAX_FOLDER_DEPTH = 8

#: Longest name (each part of a path) a checkpoint may have, in UTF-8 bytes: most filesystems
#: allow 255, and a temporary's name adds up to ~40 to the name it stands for.
MAX_NAME_BYTES = 200


def check_target_name(name: str) -> str:
    """Refuse a checkpoint name that the store cannot hold or that stagesave reserves.

    Raises:
        ValueError: a part is too long, or looks like a temporary, an aside folder or a
            format-1 manifest (stagesave would treat it as its own debris).
    """
    parts = name.split("/")
    for part in parts:
        if TMP_MARKER in part or ASIDE_MARKER in part:
            raise ValueError(
                f"invalid checkpoint name {name!r}: {TMP_MARKER!r} and {ASIDE_MARKER!r} are "
                "reserved for stagesave's temporaries; choose another name"
            )
        if len(part.encode()) > MAX_NAME_BYTES:
            raise ValueError(
                f"invalid checkpoint name {name!r}: {part[:40]!r}... is {len(part.encode())} "
                f"bytes, more than the {MAX_NAME_BYTES} stagesave allows (filesystems allow 255, "
                "and its temporaries add to the name); choose a shorter name"
            )
    leaf = parts[-1]
    if leaf == DIR_MANIFEST or split_manifest_name(leaf) is not None:
        raise ValueError(
            f"invalid checkpoint name {name!r}: it is named like a stagesave manifest "
            f"(*{MANIFEST_SUFFIX}); choose another name"
        )
    return name
