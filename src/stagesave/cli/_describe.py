"""What ``stagesave inspect`` shows, as one document: a checkpoint's files, each one's proof,
its tensors, metadata and telemetry, read from its proof (format 2: inside the file(s); format
1: the sidecar manifest) or, for a plain file, from its structure (no tensor data, with the safe
unpickler unless ``trusted``). ``--json`` prints it as it is; ``_inspect.py`` renders it.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from ..ondisk.manifest import FileEntry, Manifest
from ..ondisk.names import DIR_MANIFEST, INDEX_RECORD, PROOF_KEY, PROOF_RECORD
from ..restore.discovery import CheckpointInfo, folder_entries
from ..saving.write import TRAILER_KINDS
from ..stores.base import Store
from ._found import folder_files, step_of
from ._tensor_index import manifest_tensors, needs_unsafe_global, tensor_index
from ._verify import first_line

__all__ = ["describe"]


def _where_proof(e: FileEntry) -> str:
    if e.kind == "torch":
        return f"zip records {PROOF_RECORD} and {INDEX_RECORD}"
    if e.kind == "safetensors":
        return f"header __metadata__[{PROOF_KEY!r}]"
    if e.kind in TRAILER_KINDS:
        return "a trailer after the data"
    return "?"


def _file_doc(name: str, store_name: str, e: FileEntry, role: str, proof: str) -> dict[str, Any]:
    return {
        "name": name,
        "store_name": store_name,
        "kind": e.kind,
        "role": role,
        "size": e.size,
        "covered": e.end,
        "algorithm": e.algorithm,
        "chunk_bytes": e.chunk_bytes,
        "chunks": len(e.chunks),
        "first_digest": e.chunks[0] if e.chunks else None,
        "serialization_id": e.serialization_id,
        "storages": len(e.storages),
        "proof": proof,
    }


def _files(
    store: Store, ci: CheckpointInfo
) -> tuple[list[dict[str, Any]], dict[str, Manifest], list[str]]:
    """Every file of the checkpoint as shown, each one's own proof (format 2), and the problems
    found."""
    m = ci.manifest
    if m is not None and m.folder is not None and ci.is_dir:
        # a format-2 folder: the carrier names every file
        entries, problems = folder_entries(store, ci)
        docs, own_of = [], {}
        for fname, own, listed in entries:
            full = f"{ci.name}/{fname}"
            if own is not None:
                e = own.files[0]
                role = "carrier" if fname == m.folder.carrier else "member"
                docs.append(_file_doc(fname, full, e, role, f"in the file: {_where_proof(e)}"))
                own_of[fname] = own
            elif listed is not None:
                docs.append(
                    _file_doc(
                        fname,
                        full,
                        listed,
                        "listed",
                        f"checksums in the proof of {m.folder.carrier}",
                    )
                )
        return docs, own_of, problems
    if m is not None:
        if ci.format == 2:
            e = m.files[0]
            role = "file"
            if m.folder is not None:  # one file of a folder checkpoint, inspected alone
                role = "carrier" if e.name == m.folder.carrier else "member"
            return (
                [_file_doc(e.name, ci.name, e, role, f"in the file: {_where_proof(e)}")],
                {e.name: m},
                [],
            )
        proof = f"sidecar {ci.manifest_name}" if not ci.is_dir else f"{DIR_MANIFEST} in the folder"
        return (
            [
                _file_doc(e.name, f"{ci.name}/{e.name}" if ci.is_dir else ci.name, e, "file", proof)
                for e in m.files
            ],
            {},
            [],
        )
    infos = folder_files(store, ci.name) if ci.is_dir else [store.info(ci.name)]
    return (
        [
            {
                "name": f.name.rpartition("/")[2],
                "store_name": f.name,
                "kind": "safetensors" if f.name.endswith(".safetensors") else "torch",
                "role": "file",
                "size": f.size,
                "covered": None,
                "algorithm": None,
                "chunk_bytes": None,
                "chunks": 0,
                "first_digest": None,
                "serialization_id": None,
                "storages": 0,
                "proof": None,
            }
            for f in infos
        ],
        {},
        [],
    )


def _parsed_tensors(
    store: Store, f: dict[str, Any], trusted: bool, notes: list[str]
) -> list[dict[str, Any]]:
    """Tensors of a file without an index in its proof: its structure, parsed."""
    try:
        return tensor_index(store, f["store_name"], f["kind"], f["size"], trusted=trusted)
    except Exception as exc:  # noqa: BLE001, RUF100 - a damaged file must not stop the summary
        if needs_unsafe_global(exc):
            notes.append(f"{f['name']}: tensors not listed: it needs classes off the safe "
                         "allow-list (--trusted parses it with the full unpickler)")
        else:
            cause = exc.__cause__ if isinstance(exc, CheckpointError) and exc.__cause__ else exc
            notes.append(f"{f['name']}: cannot be parsed: {first_line(cause)}")
        return []


def describe(
    store: Store, ci: CheckpointInfo, *, trusted: bool = False, part_of: str | None = None,
) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain data (``part_of``: the folder checkpoint a file
    inspected alone belongs to)."""
    files, own_of, problems = _files(store, ci)
    problems = list(ci.problems) + [p for p in problems if p not in ci.problems]
    status = "corrupt" if problems and ci.status == "committed" else ci.status
    tensors: list[dict[str, Any]] = []
    notes: list[str] = []
    bad = 0
    m = ci.manifest
    if m is not None and not ci.is_dir and (m.tensors or files[0]["kind"] != "safetensors"):
        tensors, bad = manifest_tensors(m)
    elif ci.is_dir or status != "corrupt":
        for f in files:
            if f["kind"] == "raw":
                continue
            own = own_of.get(f["name"])
            found: list[dict[str, Any]] = []
            if own is not None and own.tensors:
                found, n_bad = manifest_tensors(own)
                bad += n_bad
            elif status != "corrupt":
                found = _parsed_tensors(store, f, trusted, notes)
            if len(files) > 1:
                found = [{**t, "name": f"{f['name']}:{t['name']}"} for t in found]
            tensors += found
    if bad:
        notes.append(f"{bad} entries of the tensor index are malformed and not shown")
    return {
        "path": ci.path,
        "status": status,
        "format": ci.format,
        "seq": ci.seq,
        "folder": ci.is_dir,
        "size": ci.size,
        "created": ci.created,
        "step": step_of(ci.name, m),
        "manifest": ci.manifest_name,
        "carrier": m.folder.carrier if m is not None and m.folder is not None else None,
        "part_of": part_of,
        "problems": problems,
        "files": files,
        "tensors": tensors,
        "tensor_bytes": sum(t["bytes"] for t in tensors if isinstance(t.get("bytes"), int)),
        "metadata": m.metadata if m is not None and isinstance(m.metadata, dict) else {},
        "telemetry": m.telemetry if m is not None and isinstance(m.telemetry, dict) else {},
        "notes": notes,
    }
