"""Checkpoints as older versions and attackers make them: format-1 files with sidecars, and
format-2 files whose proof was rewritten with every CRC made consistent again."""

from __future__ import annotations

from typing import Any

import torch


def format1_checkpoint(
    path: Any, state: Any, *, chunk_bytes: int = 4096, algorithm: str = "xxh3_128",
) -> Any:
    """A checkpoint in format 1, as stagesave 0.1 wrote it: a torch file and a sidecar manifest
    ``<name>.<serialization_id>.stagesave.json`` naming its size, id and chunk digests."""
    import os
    import time
    import zipfile

    from stagesave.ondisk.checksum import digest
    from stagesave.ondisk.manifest import FileEntry, Manifest
    from stagesave.ondisk.names import manifest_name

    torch.save(state, path)
    with open(path, "rb") as f:
        data = f.read()
    with zipfile.ZipFile(path) as z:
        [rec] = [i for i in z.infolist() if i.filename.endswith(".data/serialization_id")]
        sid = z.read(rec).decode()
    id_offset = data.index(sid.encode())
    chunks = tuple(digest(algorithm, data[lo : lo + chunk_bytes])
                   for lo in range(0, len(data), chunk_bytes))
    entry = FileEntry(os.path.basename(path), len(data), algorithm, chunk_bytes, chunks, "torch",
                      sid, id_offset)
    sidecar = os.path.join(os.path.dirname(path), manifest_name(os.path.basename(path), sid))
    with open(sidecar, "wb") as f:
        f.write(Manifest([entry], time.time_ns(), metadata={"format": 1}).to_json())
    return sidecar


def flip_byte(path: Any, offset: int) -> None:
    """Corrupt one byte of a file in place (a real bit rot, not a mock)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def rewrite_proof(path: Any, mutate: Any) -> None:
    """Rewrite a format-2 torch file's proof with ``mutate(doc)`` and rebuild its tail, summary and
    CRCs so that everything but the proof's content is consistent: what an attacker with write
    access (and no key) can produce. ``mutate`` may return bytes to use as the proof verbatim."""
    import json

    from stagesave.ondisk.checksum import crc32
    from stagesave.ondisk.manifest import Summary, parse_summary
    from stagesave.ondisk.torchzip import read_footer
    from stagesave.restore.proof import zip_tail_parts

    with open(path, "rb") as f:
        data = f.read()
    raw = read_footer(data[-65536:], crc32)
    assert raw is not None, "not a format-2 file"
    s = parse_summary(raw, str(path))
    proof = data[s.proof_offset : s.proof_offset + s.proof_len]
    doc = json.loads(proof)
    covered = doc["covered"]
    parts = zip_tail_parts(data[covered:], covered, s.proof_offset, s.proof_len, len(raw))
    assert parts is not None
    out = mutate(doc)
    new = out if isinstance(out, bytes) else json.dumps(doc, separators=(",", ":")).encode()
    summary = Summary(s.kind, s.seq, s.created_ns, s.proof_offset, len(new), crc32(new), s.folder,
                      s.carrier).to_bytes()
    tail = parts.rebuild(new, summary)

    with open(path, "wb") as f:
        f.write(data[:covered] + tail)


def carrier_of(folder: Any) -> Any:
    """The file of a format-2 folder checkpoint that carries the folder's proof."""
    import os

    import stagesave

    info = stagesave.verify(folder)
    assert info.manifest is not None and info.manifest.folder is not None, info.problems
    return os.path.join(os.fspath(folder), info.manifest.folder.carrier)


def rewrite_pickle(path: Any, pkl: bytes, mutate: Any = None) -> None:
    """Replace a format-2 torch file's pickle with ``pkl`` (padded with zeros to the old one's
    size, which it must not exceed), optionally ``mutate(doc)`` its proof, and make every CRC,
    chunk digest and the zip tail consistent again: what an attacker without a key writes."""
    import json
    import struct

    from stagesave.ondisk.checksum import crc32, digest
    from stagesave.ondisk.manifest import Summary, parse_summary
    from stagesave.ondisk.torchzip import read_footer
    from stagesave.restore.proof import ZipTail, zip_tail_parts

    with open(path, "rb") as f:
        data = bytearray(f.read())
    raw = read_footer(bytes(data[-65536:]), crc32)
    assert raw is not None, "not a format-2 file"
    s = parse_summary(raw, str(path))
    doc = json.loads(data[s.proof_offset : s.proof_offset + s.proof_len])
    covered = doc["covered"]
    parts = zip_tail_parts(bytes(data[covered:]), covered, s.proof_offset, s.proof_len, len(raw))
    assert parts is not None
    cd = bytearray(parts.cd_prefix)
    name_len, extra_len = struct.unpack_from("<HH", data, 26)
    at = 30 + name_len + extra_len
    size = struct.unpack_from("<I", cd, 24)[0]  # data.pkl's, the first central entry
    assert len(pkl) <= size, f"a pickle of {len(pkl)} bytes does not fit in {size}"
    pkl += b"\0" * (size - len(pkl))
    data[at : at + size] = pkl
    crc = crc32(pkl)
    struct.pack_into("<I", data, at + size + 4, crc)  # its data descriptor
    struct.pack_into("<I", cd, 16, crc)  # its central entry
    if mutate is not None:
        mutate(doc)
    algorithm, step = doc["algorithm"], doc["chunk_bytes"]
    doc["chunks"] = [digest(algorithm, bytes(data[lo : min(covered, lo + step)]))
                     for lo in range(0, covered, step)]
    doc["zip"]["cd"] = digest(algorithm, bytes(cd))
    new = json.dumps(doc, separators=(",", ":")).encode()
    summary = Summary(s.kind, s.seq, s.created_ns, s.proof_offset, len(new), crc32(new), s.folder,
                      s.carrier).to_bytes()
    tail = ZipTail(parts.prefix, parts.index, bytes(cd), parts.zip64, parts.n_records,
                   covered).rebuild(new, summary)
    with open(path, "wb") as f:
        f.write(bytes(data[:covered]) + tail)
