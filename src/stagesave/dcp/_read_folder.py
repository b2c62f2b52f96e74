"""Opening a DCP folder for a verified load: its proof, the version of each file, ``.metadata``.

The folder's proof must say the save committed: ``.metadata`` carries it (format 2: a trailer
naming every rank file by size and the CRC of its proof; ``resolve_dir``/``folder_entries`` find
and check it), or ``checkpoint.stagesave.json`` does (format 1, still read). ``.metadata`` is
checked against its chunk digests and unpickled with an allow-list (``_metadata``), and every
item it places must lie inside the proven bytes of a data file of the folder. Each rank file is
then opened once: the version whose proof the folder pins (small folders pin every file when
the folder is opened, so that a save replacing the folder meanwhile cannot take the bytes away).
A folder that changes while it is being opened is opened again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointNotFoundError, IntegrityError, ManifestError
from ..ondisk.manifest import FileEntry
from ..restore.info import CheckpointInfo
from ..restore.proof import peek
from ..restore.resolve_folder import folder_entries, resolve_dir
from ..stores.base import Reader, Store, check_name
from ._format import METADATA_FILE
from ._metadata import StorageInfo, load_metadata
from ._read_items import read_window

__all__ = ["PIN_AT_OPEN_MAX", "FolderReplaced", "OpenedFolder", "Pin", "open_file", "open_folder"]

#: Times the folder is resolved again when its files changed while it was being opened.
_OPEN_ATTEMPTS = 3
#: Folders of at most this many rank files have every file opened (pinned) when the folder is
#: opened, so that a save replacing the folder before DCP reads it cannot take the bytes away;
#: larger ones open each file when it is read (a descriptor per file would be too many).
PIN_AT_OPEN_MAX = 256


@dataclass(frozen=True)
class Pin:
    """What a format-2 file's summary must say: the save's token and (members) its proof's CRC."""

    token: str
    proof_crc: int | None


@dataclass
class OpenedFolder:
    store: Store
    name: str
    where: str
    info: CheckpointInfo | None
    #: What proves each file (its chunk digests of the bytes before its proof); empty unverified.
    entries: dict[str, FileEntry]
    metadata: Metadata
    #: Format 2: the version of each file the folder's proof names.
    pins: dict[str, Pin] = field(default_factory=dict)
    #: Data files opened with the folder (their pinned version), until they are read.
    readers: dict[str, Reader] = field(default_factory=dict)

    def __post_init__(self) -> None:
        weakref.finalize(self, _close_all, self.readers)

    def close(self) -> None:
        _close_all(self.readers)


def _close_all(readers: dict[str, Reader]) -> None:
    while readers:
        readers.popitem()[1].close()


class FolderReplaced(Exception):
    """A file is not the version the folder's proof names (the folder was replaced meanwhile)."""


def open_folder(
    store: Store, name: str, *, verify: bool, trusted: bool, listed: frozenset[str] | None = None,
) -> OpenedFolder:
    """Resolve the folder, check its proof and read ``.metadata`` (again, while it changes).

    Raises:
        CheckpointNotFoundError: no folder or no ``.metadata`` there.
        IntegrityError: not committed by stagesave (with ``verify``), corrupt, or replaced on
            every attempt.
        UnsafeCheckpointError: ``.metadata`` needs a class off the allow-list.
    """
    for attempt in range(_OPEN_ATTEMPTS):
        try:
            return _open_once(store, name, verify, trusted, listed)
        except FolderReplaced as exc:
            if attempt == _OPEN_ATTEMPTS - 1:
                raise IntegrityError(
                    f"checkpoint {store.describe(name)} kept changing while it was being opened "
                    f"({exc}); another process is replacing it: load it again once that save "
                    "committed"
                ) from exc
    raise AssertionError("unreachable")


def _open_once(
    store: Store, name: str, verify: bool, trusted: bool, listed: frozenset[str] | None,
) -> OpenedFolder:
    where = store.describe(name)
    info: CheckpointInfo | None = None
    entries: dict[str, FileEntry] = {}
    pins: dict[str, Pin] = {}
    if verify:
        info = resolve_dir(store, name)
        if info.status == "unverified":
            if not store.list(name) and not store.list_dirs(name):
                raise CheckpointNotFoundError(f"no checkpoint at {where}")
            raise IntegrityError(
                f"checkpoint {where} has no stagesave proof, so it cannot be proven complete "
                "(a save that never committed, or a folder written by another DCP writer). "
                "Use stagesave.latest() to find the newest committed one, or pass verify=False "
                "to read it as a plain DCP folder."
            )
        if info.status != "committed" or info.manifest is None:
            raise FolderReplaced if _changed(store, name, info) else IntegrityError(
                f"checkpoint {where} is corrupt: {'; '.join(info.problems)}")
        entries, pins = _proven_files(store, name, info)
        if METADATA_FILE not in entries:
            raise ManifestError(f"checkpoint {where} is not a DCP checkpoint: its proof names "
                                f"no {METADATA_FILE}")
    mname = f"{name}/{METADATA_FILE}"
    try:
        reader = store.open(mname)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        raise CheckpointNotFoundError(
            f"no DCP checkpoint at {where}: {METADATA_FILE} is missing"
        ) from exc
    with reader:
        check_pin(reader, pins.get(METADATA_FILE))
        entry = entries.get(METADATA_FILE)
        data = read_window(reader, 0, entry.end if entry is not None else reader.size, entry, None)
    metadata = load_metadata(bytes(data), reader.where, trusted=trusted)
    _check_storage_data(metadata, entries if verify else None, where,
                        None if verify else listed)
    opened = OpenedFolder(store, name, where, info, entries, metadata, pins)
    members = [f for f in pins if f != METADATA_FILE]
    if len(members) <= PIN_AT_OPEN_MAX:
        try:
            for fname in members:
                opened.readers[fname] = open_file(opened, fname, replaced=FolderReplaced)
        except BaseException:
            opened.close()
            raise
    return opened


def _changed(store: Store, name: str, info: CheckpointInfo) -> bool:
    """Whether a folder found corrupt is now another save (replaced while it was resolved)."""
    again = resolve_dir(store, name)
    token = _token(info)
    new = _token(again)
    return again.status == "committed" or (new is not None and new != token)


def _token(info: CheckpointInfo) -> str | None:
    folder = info.manifest.folder if info.manifest is not None else None
    return folder.token if folder else None


def _proven_files(
    store: Store, name: str, info: CheckpointInfo,
) -> tuple[dict[str, FileEntry], dict[str, Pin]]:
    """Every file of a committed folder with the entry that proves it (and, format 2, the
    version its summary must show)."""
    manifest = info.manifest
    assert manifest is not None
    folder = manifest.folder
    if folder is None:  # format 1: checkpoint.stagesave.json lists every file with its digests
        return {e.name: e for e in manifest.files}, {}
    found, problems = folder_entries(store, info)
    if problems:
        if resolve_dir(store, name).manifest != manifest:
            raise FolderReplaced(problems[0])
        raise IntegrityError(
            f"checkpoint {store.describe(name)} is corrupt: {'; '.join(problems)}")
    entries: dict[str, FileEntry] = {}
    for fname, own, listed in found:
        if own is not None:
            entries[fname] = own.files[0]
        elif listed is not None:
            entries[fname] = listed
    pins = {m.name: Pin(folder.token, m.proof_crc) for m in folder.members}
    pins[folder.carrier] = Pin(folder.token, None)
    return entries, pins


def check_pin(reader: Reader, pin: Pin | None) -> None:
    """Raise ``FolderReplaced`` unless ``reader``'s file is the version the folder's proof names."""
    if pin is None:
        return
    summary = peek(reader).summary
    if summary is None or summary.folder != pin.token or (
            pin.proof_crc is not None and summary.proof_crc != pin.proof_crc):
        raise FolderReplaced(f"{reader.where} is not the version its folder's proof names")


def _check_storage_data(
    metadata: Metadata, entries: dict[str, FileEntry] | None, where: str,
    listed: frozenset[str] | None = None,
) -> None:
    """Untrusted offsets: every item must lie inside a file this checkpoint committed
    (``entries``: the proven files, ``None`` when not verifying; ``listed``: then the names its
    proof lists, when known)."""
    for index, sinfo in metadata.storage_data.items():
        if not isinstance(sinfo, StorageInfo):
            raise ManifestError(f"checkpoint {where}: storage data of {index.fqn} is a "
                                f"{type(sinfo).__name__}")
        try:
            check_name(sinfo.relative_path)
        except (ValueError, TypeError) as exc:
            raise ManifestError(f"checkpoint {where}: {index.fqn} points outside the folder "
                                f"({sinfo.relative_path!r})") from exc
        if (not isinstance(sinfo.offset, int) or not isinstance(sinfo.length, int)
                or sinfo.offset < 0 or sinfo.length < 0):
            raise ManifestError(f"checkpoint {where}: {index.fqn} has an invalid byte range")
        if listed is not None and (sinfo.relative_path not in listed
                                   or sinfo.relative_path == METADATA_FILE):
            raise IntegrityError(
                f"checkpoint {where} is corrupt: {index.fqn} is stored in "
                f"{sinfo.relative_path}, which its proof does not list as a data file")
        if entries is not None:
            entry = entries.get(sinfo.relative_path)
            if entry is None or sinfo.relative_path == METADATA_FILE:
                raise IntegrityError(
                    f"checkpoint {where} is corrupt: {index.fqn} is stored in "
                    f"{sinfo.relative_path}, which its proof does not list as a data file")
            if sinfo.offset + sinfo.length > entry.end:
                raise IntegrityError(
                    f"checkpoint {where} is corrupt: {index.fqn} lies outside the proven bytes "
                    f"of {sinfo.relative_path} ({sinfo.offset}+{sinfo.length} > {entry.end})")


def open_file(opened: OpenedFolder, rel: str, replaced: type[Exception] | None = None) -> Reader:
    """One version of a data file: the one the folder's proof names (format 2).

    Raises:
        IntegrityError: it is missing, or was replaced since the folder was opened.
        replaced: instead, when it was replaced (while the folder is being opened: try again).
    """
    name = f"{opened.name}/{rel}"
    try:
        reader = opened.store.open(name)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        if replaced is not None:
            raise replaced(f"{opened.where}/{rel} is missing") from exc
        raise IntegrityError(f"checkpoint {opened.where} is corrupt: {rel} is missing") from exc
    try:
        check_pin(reader, opened.pins.get(rel))
    except FolderReplaced as exc:
        reader.close()
        if replaced is not None:
            raise
        raise IntegrityError(
            f"checkpoint {opened.where} was replaced while it was being loaded ({exc}); "
            "load it again"
        ) from exc
    return reader
