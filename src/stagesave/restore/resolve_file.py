"""One file's status: its proof read and checked, its data not.

A file is *committed* when it exists under its final name and carries a valid proof (format 2:
inside the file; format 1: a sidecar ``<name>.<serialization_id>.stagesave.json`` naming its size
and id); *unverified* when it has none (a plain torch file: loadable, not provable); *corrupt*
when its proof is broken.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ManifestError
from ..ondisk.manifest import Manifest, parse_manifest
from ..ondisk.names import DIR_MANIFEST, MAX_MANIFEST_BYTES, split_manifest_name
from ..stores.base import ObjectInfo, Reader, Store
from .info import CheckpointInfo, reread
from .proof import FileProof, peek, read_proof

__all__ = ["from_proof", "is_sidecar_of", "read_sidecar", "resolve", "resolve_reader"]


def read_sidecar(store: Store, name: str) -> Manifest:
    """The format-1 manifest ``name``, parsed (refused above :data:`MAX_MANIFEST_BYTES`)."""
    info = store.info(name)
    if info.size > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"invalid manifest {store.describe(name)}: {info.size} bytes exceeds the limit"
        )
    return parse_manifest(store.read_range(name, 0, info.size), store.describe(name))


def is_sidecar_of(store: Store, manifest: str, data_leaf: str) -> bool:
    """Whether ``manifest`` parses as a format-1 stagesave manifest that describes ``data_leaf``
    (only then may stagesave remove it: a user's file merely named like one is left alone)."""
    try:
        return data_leaf in {f.name for f in read_sidecar(store, manifest).files}
    except (OSError, ManifestError):
        return False


def _sidecars(store: Store, name: str, listing: Iterable[ObjectInfo] | None = None) -> list[str]:
    """Format-1 manifests in ``name``'s directory that belong to a file called ``name``."""
    directory, _, base = name.rpartition("/")
    out = []
    for info in listing if listing is not None else store.list(directory):
        parsed = split_manifest_name(info.name.rpartition("/")[2])
        if parsed is not None and parsed[0] == base:
            out.append(info.name)
    return out


def resolve(store: Store, name: str) -> CheckpointInfo:
    """Status of the file ``name`` (its proof read and checked, its data not).

    Raises:
        FileNotFoundError: the file does not exist. IsADirectoryError: it is a folder.
    """
    return reread(lambda: _resolve(store, name))


def _resolve(store: Store, name: str) -> CheckpointInfo:
    target = store.canonical(name)
    with store.open(target) as reader:
        ci = resolve_reader(store, target, reader)
    if target != name:  # a link inside the root (Lightning's save_last="link"): judged its target
        ci.path, ci.name, ci.judged = store.describe(name), name, target
    return ci


def resolve_reader(
    store: Store, name: str, reader: Reader, sidecars: list[str] | None = None, *,
    index: bool = True,
) -> CheckpointInfo:
    """:func:`resolve` through an open reader (the version that will be loaded or verified);
    ``index=False``: a format-2 torch file's large tensor index is left for the caller to parse
    (``manifest.pending_index``, see :func:`.proof.read_proof`)."""
    path = store.describe(name)
    base = name.rpartition("/")[2]
    got = read_proof(reader, base, index=index)
    if got.format == 2:
        return from_proof(store, name, path, reader, got)
    candidates = _sidecars(store, name) if sidecars is None else sidecars
    if candidates:
        return _format1(store, name, path, reader, candidates)
    directory = name.rpartition("/")[0]
    if base != DIR_MANIFEST:  # a file of a format-1 folder: its folder manifest proves it
        dir_manifest = f"{directory}/{DIR_MANIFEST}" if directory else DIR_MANIFEST
        try:
            store.info(dir_manifest)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            pass
        else:
            return _format1(store, name, path, reader, [dir_manifest])
    p = peek(reader)
    if p.problem:
        return CheckpointInfo(
            path, name, "corrupt", reader.mtime, reader.size, problems=[p.problem]
        )
    return CheckpointInfo(path, name, "unverified", reader.mtime, reader.size)


def from_proof(
    store: Store, name: str, path: str, reader: Reader, got: FileProof,
) -> CheckpointInfo:
    """The status of a format-2 file from its proof (``got``: as :func:`read_proof` read it)."""
    if got.manifest is None:
        return CheckpointInfo(path, name, "corrupt", reader.mtime, reader.size,
                              problems=got.problems, problems_from_manifest=True, format=2)
    m = got.manifest
    # A file of a folder proves itself: loading it alone needs no more (its folder may be being
    # replaced meanwhile, which never mixes this file's bytes with another's). What makes the
    # folder one checkpoint is checked where the folder is used as one (resolve_dir, verify).
    return CheckpointInfo(path, name, "committed", m.created_ns / 1e9, reader.size, m, None,
                          seq=m.seq, format=2)


def _format1(
    store: Store, name: str, path: str, reader: Reader, candidates: list[str],
) -> CheckpointInfo:
    problems: list[str] = []
    parsed: list[tuple[Manifest, str]] = []
    for mname in candidates:
        try:
            parsed.append((read_sidecar(store, mname), mname))
        except (ManifestError, OSError) as exc:
            problems.append(str(exc))
    parsed.sort(key=lambda m: m[0].created_ns, reverse=True)
    base = name.rpartition("/")[2]
    for manifest, mname in parsed:
        try:
            entry = manifest.file(base)
        except KeyError:
            problems.append(f"{store.describe(mname)} does not describe {base}")
            continue
        if entry.size != reader.size:
            problems.append(f"{path} is {reader.size} bytes but its manifest says {entry.size} "
                            f"(truncated or replaced)")
            continue
        sid = entry.serialization_id
        if (sid is not None and entry.id_offset is not None
                and reader.read(entry.id_offset, len(sid)) != sid.encode()):
            problems.append(f"{path} does not carry the serialization id its manifest names")
            continue
        one = Manifest([entry], manifest.created_ns, manifest.tensors, manifest.metadata,
                       manifest.telemetry, 1)
        return CheckpointInfo(path, name, "committed", manifest.created_ns / 1e9, reader.size,
                              one, mname, format=1)
    if not problems:
        problems.append(f"no manifest matches {path}")
    return CheckpointInfo(path, name, "corrupt", reader.mtime, reader.size, problems=problems,
                          problems_from_manifest=True, format=1)

