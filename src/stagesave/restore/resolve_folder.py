"""One folder's status: committed when every file its proof names is there, as named.

A folder is committed when every file its carrier's proof names (format 2), or its
``checkpoint.stagesave.json`` names (format 1), is there with the size and version the proof
pins. Other files in the folder (a tokenizer, logs, a model the user saved beside) are not part
of the checkpoint: they are kept, reported in :attr:`CheckpointInfo.beside`, and never read as
part of it. Its files are listed without following symbolic links, down to
:data:`MAX_FOLDER_DEPTH` levels.
"""

from __future__ import annotations

from ..errors import ManifestError
from ..ondisk.manifest import FileEntry, Manifest
from ..ondisk.names import DIR_MANIFEST, MAX_FOLDER_DEPTH
from ..stores.base import ObjectInfo, Store
from .info import CheckpointInfo, join, replaced, reread
from .proof import FileProof, peek, read_proof
from .resolve_file import read_sidecar

__all__ = [
    "MAX_FOLDER_DEPTH", "FolderEntry", "carries", "claimed_folder", "claims_a_folder",
    "enclosing_folder",
    "folder_entries", "list_tree", "resolve_dir",
]


def list_tree(store: Store, directory: str, depth: int = 0) -> list[ObjectInfo]:
    """Every file under ``directory`` (sub-folders included, symbolic links never followed)."""
    out = list(store.list(directory))
    if depth < MAX_FOLDER_DEPTH:
        for leaf in store.list_dirs(directory):
            out += list_tree(store, join(directory, leaf), depth + 1)
    return out


def resolve_dir(
    store: Store, directory: str, listing: list[ObjectInfo] | None = None,
) -> CheckpointInfo:
    """Status of a folder checkpoint (committed when every file its proof names is there).

    ``listing``: every file under the folder (:func:`list_tree`), when the caller has it.
    """
    try:
        return _resolve_dir(store, directory, listing)
    except OSError as exc:
        if not replaced(exc):
            raise
        # replaced meanwhile: list again
        return reread(lambda: _resolve_dir(store, directory, None))


def _resolve_dir(
    store: Store, directory: str, listing: list[ObjectInfo] | None,
) -> CheckpointInfo:
    path = store.describe(directory)
    prefix = len(directory) + 1 if directory else 0
    listed = listing if listing is not None else list_tree(store, directory)
    files = {f.name[prefix:]: f for f in listed}
    if DIR_MANIFEST in files:
        return _dir_format1(store, directory, path, files)
    carrier = _find_carrier(store, directory, files)
    if isinstance(carrier, str):  # e.g. ``ckpt/sub`` of a folder checkpoint ``ckpt``
        above = store.describe(carrier).rstrip("/")
        problem = f"not a checkpoint of its own: its files belong to the folder checkpoint {above}/"
        return CheckpointInfo(
            path, directory, "unverified", 0.0, sum(f.size for f in files.values()), is_dir=True,
            problems=[problem],
        )
    if carrier is None:
        return CheckpointInfo(
            path, directory, "unverified", max((f.mtime for f in files.values()), default=0.0),
            sum(f.size for f in files.values()), is_dir=True,
            problems=["no stagesave proof in any of its files: completeness cannot be proven"],
        )
    leaf, got = carrier
    total = sum(f.size for f in files.values())
    if got.manifest is None or got.manifest.folder is None:
        return CheckpointInfo(
            path, directory, "corrupt", 0.0, total, is_dir=True,
            problems=got.problems or [f"{path}: {leaf} does not prove the folder"],
            problems_from_manifest=True, format=2,
        )
    m = got.manifest
    folder = m.folder
    assert folder is not None
    problems = _folder_problems(store, directory, files, m)
    status = "corrupt" if problems else "committed"
    beside = _beside(files, folder.names(), folder.nested)
    total -= sum(files[b].size for b in beside)
    return CheckpointInfo(path, directory, status, m.created_ns / 1e9, total, m, None, problems,
                          is_dir=True, problems_from_manifest=True, seq=m.seq, format=2,
                          beside=beside)


def _beside(files: dict[str, ObjectInfo], names: set[str], nested: list[str]) -> list[str]:
    """The files of a folder that are not part of its checkpoint (relative names, sorted)."""
    return sorted(
        n for n in files
        if n not in names and not any(n.startswith(p + "/") for p in nested)
    )


def carries(store: Store, name: str, token: str | None) -> bool:
    """Whether the file ``name`` is the carrier of the folder checkpoint ``token`` names (any
    folder checkpoint: ``None``)."""
    leaf = name.rpartition("/")[2]
    try:
        with store.open(name) as reader:
            s = peek(reader).summary
            if s is not None:
                return s.folder is not None and token in (None, s.folder) and s.carrier == leaf
            if not leaf.endswith(".safetensors"):
                return False
            m = read_proof(reader, leaf, index=False).manifest  # its proof is in its header
    except OSError:
        return False
    f = m.folder if m is not None else None
    return f is not None and token in (None, f.token) and f.carrier == leaf


def claims_a_folder(store: Store, name: str) -> bool:
    """Whether the file ``name``'s proof says it belongs to a folder checkpoint (as a member or
    as its carrier); one read of its tail (or of its header, for a safetensors file)."""
    leaf = name.rpartition("/")[2]
    try:
        with store.open(name) as reader:
            p = peek(reader)
            if p.summary is not None:
                return p.summary.folder is not None
            if p.format != 0 or not leaf.endswith(".safetensors"):
                return False
            m = read_proof(reader, leaf, index=False).manifest  # its proof is in its header
    except OSError:
        return False
    return m is not None and m.folder is not None


def claimed_folder(store: Store, directory: str) -> tuple[str, str] | None:
    """``(token, carrier)`` of the folder checkpoint the files directly in ``directory`` say
    they belong to, when none of them is its carrier (a sub-folder of a folder checkpoint, or
    a folder that lost its carrier); else ``None``."""
    for info in store.list(directory):
        leaf = info.name.rpartition("/")[2]
        try:
            with store.open(info.name) as reader:
                s = peek(reader).summary
                if s is None and leaf.endswith(".safetensors"):
                    m = read_proof(reader, leaf, index=False).manifest
                    f = m.folder if m is not None else None
                    if f is not None and f.carrier != leaf:
                        return f.token, f.carrier
                elif s is not None and s.folder is not None and s.carrier != leaf:
                    return s.folder, s.carrier or ""
        except OSError:
            continue
    return None


def enclosing_folder(store: Store, name: str, token: str, carrier: str) -> str | None:
    """The folder checkpoint above ``name`` (a file or folder) whose carrier is ``carrier``
    with the folder token ``token`` (a member's proof names both, not the member's own path in
    the folder); ``None`` when there is none within :data:`MAX_FOLDER_DEPTH` levels of
    ``store``."""
    parts = name.split("/")
    for up in range(1, min(len(parts), MAX_FOLDER_DEPTH + 1) + 1):
        folder = "/".join(parts[:-up])
        if carries(store, join(folder, carrier), token):
            return folder
    return None


def _find_carrier(
    store: Store, directory: str, files: dict[str, ObjectInfo],
) -> tuple[str, FileProof] | str | None:
    """The carrier of a format-2 folder: the file whose summary (or header) says it carries the
    folder. A member's claim about who the carrier is counts only if no file claims it itself;
    if every claim names the carrier of a folder checkpoint above ``directory`` (a sub-folder of
    one), that folder's name."""
    named: list[str] = []
    tokens: dict[str, str] = {}
    safetensors: list[str] = []
    for leaf in sorted(files):
        try:
            with store.open(join(directory, leaf)) as reader:
                p = peek(reader)
                if p.format == 2 and p.summary is not None and p.summary.folder is not None:
                    if p.summary.carrier == leaf:
                        return leaf, read_proof(reader, leaf)
                    # deeper files may belong to a folder checkpoint inside this one
                    if "/" not in leaf:
                        named.append(p.summary.carrier or "")
                        tokens[p.summary.carrier or ""] = p.summary.folder
                elif p.format == 0 and leaf.endswith(".safetensors"):
                    safetensors.append(leaf)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue
        except OSError as exc:
            if replaced(exc):
                raise  # replaced while read: the caller reads the folder again
            where = store.describe(join(directory, leaf))
            return leaf, FileProof(None, None, [f"{where}: {exc.strerror or exc}"], 2)
    for leaf in safetensors:  # no footer: the proof is in the header
        try:
            with store.open(join(directory, leaf)) as reader:
                got = read_proof(reader, leaf)
        except OSError:
            continue
        if got.manifest is not None and got.manifest.folder is not None:
            if got.manifest.folder.carrier == leaf:
                return leaf, got
            if "/" not in leaf:
                named.append(got.manifest.folder.carrier)
                tokens[got.manifest.folder.carrier] = got.manifest.folder.token
    if named:
        carrier = max(set(named), key=named.count)
        if directory and carrier in tokens:
            above = enclosing_folder(store, directory, tokens[carrier], carrier)
            if above is not None:
                return above
        problem = f"{store.describe(directory)}: its carrier {carrier} is missing or damaged"
        return carrier, FileProof(None, None, [problem], 2)
    return None


def _folder_problems(
    store: Store, directory: str, files: dict[str, ObjectInfo], m: Manifest,
) -> list[str]:
    folder = m.folder
    assert folder is not None
    path = store.describe(directory).rstrip("/")  # (the root: no "//" below)
    problems = []
    inside = {n: [f for f in files if f.startswith(n + "/")] for n in folder.nested}
    own = {n: f for n, f in files.items() if not any(n.startswith(p + "/") for p in folder.nested)}
    expected = folder.names()
    for missing in sorted(expected - set(own)):
        problems.append(f"{path}/{missing} is missing")
    for name, found in inside.items():
        if not found:
            problems.append(f"{path}/{name} (a folder checkpoint of its own) is missing")
    for member in folder.members:
        got = own.get(member.name)
        if got is None:
            continue
        if got.size != member.size:
            problems.append(f"{path}/{member.name} is {got.size} bytes, its folder's proof "
                            f"says {member.size}")
            continue
        try:
            with store.open(join(directory, member.name)) as reader:  # the version: one small read
                s = peek(reader).summary
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            problems.append(f"{path}/{member.name} is missing")  # removed since the listing
            continue
        if s is not None and (s.folder != folder.token or s.proof_crc != member.proof_crc):
            problems.append(f"{path}/{member.name} belongs to another save than its folder")
    for entry in folder.listed:
        got = own.get(entry.name)
        if got is not None and got.size != entry.size:
            problems.append(f"{path}/{entry.name} is {got.size} bytes, its folder's proof "
                            f"says {entry.size}")
    return problems


#: One file of a folder and what proves it: ``(name, own manifest, listed entry)``.
FolderEntry = tuple[str, Manifest | None, FileEntry | None]


def folder_entries(store: Store, info: CheckpointInfo) -> tuple[list[FolderEntry], list[str]]:
    """Every file of a committed folder with what proves it: ``(name, own manifest, listed
    entry)``.

    Members are read (their proofs must carry the folder's token and the CRC the carrier pins).
    """
    m = info.manifest
    assert m is not None
    if m.folder is None:  # format 1: the folder manifest lists every file
        return [(e.name, Manifest([e], m.created_ns, schema=1), None) for e in m.files], []
    folder = m.folder
    out: list[FolderEntry] = [(folder.carrier, m, None)]
    problems: list[str] = []
    for member in folder.members:
        name = join(info.name, member.name)
        try:
            with store.open(name) as reader:
                got = read_proof(reader, member.name)
        except OSError as exc:
            problems.append(f"{store.describe(name)}: {exc.strerror or exc}")
            continue
        mm = got.manifest
        if mm is None:
            problems += got.problems or [f"{store.describe(name)} has no stagesave proof"]
            continue
        if mm.folder is None or mm.folder.token != folder.token:
            problems.append(f"{store.describe(name)} belongs to another save than its folder")
            continue
        if got.proof_crc != member.proof_crc:
            problems.append(f"{store.describe(name)} is not the version its folder's proof names")
            continue
        out.append((member.name, mm, None))
    out += [(e.name, None, e) for e in folder.listed]
    return out, problems


def _dir_format1(
    store: Store, directory: str, path: str, files: dict[str, ObjectInfo],
) -> CheckpointInfo:
    mname = join(directory, DIR_MANIFEST)
    try:
        manifest = read_sidecar(store, mname)
    except FileNotFoundError:
        return CheckpointInfo(path, directory, "unverified", 0.0, 0, is_dir=True,
                              problems=["no stagesave manifest: completeness cannot be proven"])
    except (ManifestError, OSError) as exc:
        return CheckpointInfo(path, directory, "corrupt", 0.0, 0, is_dir=True,
                              problems=[str(exc)], format=1)
    problems = []
    total = 0
    for entry in manifest.files:
        fname = join(directory, entry.name)
        try:
            with store.open(fname) as reader:
                total += reader.size
                sid = entry.serialization_id
                if reader.size != entry.size:
                    problems.append(f"{store.describe(fname)} is {reader.size} bytes, manifest "
                                    f"says {entry.size}")
                elif (sid and entry.id_offset is not None
                      and reader.read(entry.id_offset, len(sid)) != sid.encode()):
                    problems.append(f"{store.describe(fname)} does not carry the id its "
                                    f"manifest names")
        except (FileNotFoundError, IsADirectoryError):
            problems.append(f"{store.describe(fname)} is missing")
        except OSError as exc:
            problems.append(f"{store.describe(fname)}: {exc.strerror or exc}")
    status = "corrupt" if problems else "committed"
    return CheckpointInfo(path, directory, status, manifest.created_ns / 1e9, total, manifest,
                          mname, problems, is_dir=True, format=1, problems_from_manifest=True)

