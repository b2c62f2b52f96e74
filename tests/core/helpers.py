"""Assertions shared by the core tests: deep, bitwise equality of loaded states."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Same structure, same types, bitwise-equal tensors and arrays."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert a.stride() == b.stride(), f"{path}: stride {a.stride()} != {b.stride()}"
        assert a.device == b.device, f"{path}: device {a.device} != {b.device}"
        if a.numel():
            av = torch.empty(a.shape, dtype=a.dtype).copy_(a.detach()).reshape(-1).view(torch.uint8)
            bv = torch.empty(b.shape, dtype=b.dtype).copy_(b.detach()).reshape(-1).view(torch.uint8)
            assert torch.equal(av, bv), f"{path}: tensor bytes differ"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: numpy dtype/shape differ"
        assert a.tobytes() == b.tobytes(), f"{path}: numpy bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length differs"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, float) and a != a:
        assert b != b, f"{path}: NaN expected"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def format1_checkpoint(path: Any, state: Any, *, chunk_bytes: int = 4096, algorithm: str = "xxh3_128") -> Any:
    """A checkpoint in format 1, as stagesave 0.1 wrote it: a torch file and a sidecar manifest
    ``<name>.<serialization_id>.stagesave.json`` naming its size, id and chunk digests."""
    import os
    import time
    import zipfile

    from stagesave._checksum import digest
    from stagesave._manifest import FileEntry, Manifest
    from stagesave._names import manifest_name

    torch.save(state, path)
    data = open(path, "rb").read()
    with zipfile.ZipFile(path) as z:
        [rec] = [i for i in z.infolist() if i.filename.endswith(".data/serialization_id")]
        sid = z.read(rec).decode()
    id_offset = data.index(sid.encode())
    chunks = tuple(digest(algorithm, data[lo : lo + chunk_bytes]) for lo in range(0, len(data), chunk_bytes))
    entry = FileEntry(os.path.basename(path), len(data), algorithm, chunk_bytes, chunks, "torch", sid, id_offset)
    sidecar = os.path.join(os.path.dirname(path), manifest_name(os.path.basename(path), sid))
    with open(sidecar, "wb") as f:
        f.write(Manifest([entry], time.time_ns(), metadata={"format": 1}).to_json())
    return sidecar


def rewrite_proof(path: Any, mutate: Any) -> None:
    """Rewrite a format-2 torch file's proof with ``mutate(doc)`` and rebuild its tail, summary and
    CRCs so that everything but the proof's content is consistent: what an attacker with write
    access (and no key) can produce. ``mutate`` may return bytes to use as the proof verbatim."""
    import json

    from stagesave._checksum import crc32
    from stagesave._manifest import Summary, parse_summary
    from stagesave._proofread import zip_tail_parts
    from stagesave._zipfmt import read_footer

    data = open(path, "rb").read()
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
    summary = Summary(s.kind, s.seq, s.created_ns, s.proof_offset, len(new), crc32(new), s.folder, s.carrier).to_bytes()
    tail = parts.rebuild(new, summary)

    with open(path, "wb") as f:
        f.write(data[:covered] + tail)
