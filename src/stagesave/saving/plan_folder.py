"""Planning a folder checkpoint: every file laid out, room reserved for the proofs.

A safetensors file carries its proof in its header, so its room is reserved when it is planned:
for its own proof, and, when it will be the folder's carrier (no torch file in the folder), for
the list of every file of the folder.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..formats import Raw, Safetensors, plan_file
from ..ondisk.checksum import DIGEST_HEX_LEN
from ..ondisk.names import ALIGNMENT
from .fastplan import plan
from .plan import FileImage
from .steady import PlanCache
from .walk import walk
from .write import proof_room

__all__ = ["folder_bound", "folder_bounds", "plan_folder"]


def plan_folder(
    files: dict[str, Any],
    metadata: dict[str, Any],
    *,
    algorithm: str,
    chunk_bytes: int,
    plans: PlanCache | None = None,
) -> list[tuple[str, FileImage]]:
    """Plan every file of a folder; a safetensors file gets room for its proof (and, if it
    will be the carrier, for the folder's list of files). ``plans``: reuse the plans of earlier
    folders' files of the same names (:meth:`.steady.PlanCache.of`)."""
    if plans is not None and plans.prepare is not None:  # the first folder: make its buffer
        plans.prepare(lambda: folder_bounds(files), only_when_empty=True)
    plain = {n: c for n, c in files.items() if not isinstance(c, Safetensors)}
    planned = {
        n: plan_file(c, plan_torch=plans.of(n).plan if plans is not None else plan)[1]
        for n, c in plain.items()
    }
    st_carrier = not any(im.kind in ("torch", "dcp", "dcp-metadata") for im in planned.values())
    for n, content in files.items():
        if n in planned:
            continue
        # the carrier is the first safetensors file in the folder's order (_commit.choose_carrier)
        carrier = st_carrier and n == next(
            k for k, c in files.items() if isinstance(c, Safetensors)
        )
        folder = (
            folder_bound(files, planned, algorithm, chunk_bytes)
            if carrier
            else {"token": "f" * 32, "carrier": "x" * 255}
        )

        def room(
            size: int,
            storages: list[list[object]],
            folder: dict[str, Any] = folder,
            carrier: bool = carrier,
        ) -> int:
            return proof_room(
                size,
                storages,
                algorithm=algorithm,
                chunk_bytes=chunk_bytes,
                metadata=metadata if carrier else {},
                folder=folder,
            )

        planned[n] = plan_file(content, proof_room=room)[1]
    return [(n, planned[n]) for n in files]


def folder_bounds(files: dict[str, Any]) -> tuple[int, int] | None:
    """Bounds of the staging bytes of a folder of ``files`` before they are planned (each file
    on its own aligned slice; see :meth:`.Walked.image_bounds`); ``None`` when a file's
    content is not one this can bound."""
    least = most = 0
    for content in files.values():
        if isinstance(content, Raw):
            low = high = len(content.data)
        elif isinstance(content, Safetensors):
            sizes = [t.nbytes for t in content.tensors.values()]
            low, high = sum(sizes), sum(sizes) + 512 * len(sizes) + (1 << 20)
        else:
            try:
                low, high = walk(content).image_bounds()
            except Exception:  # noqa: BLE001 - the plan names what cannot be saved
                return None
        least += low
        most += (high + 2 * ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    return least, most


def folder_bound(
    files: Iterable[str],
    planned: dict[str, FileImage],
    algorithm: str,
    chunk_bytes: int,
) -> dict[str, Any]:
    """A folder section at least as long as the real one will be (to size a reservation)."""
    hex_len = DIGEST_HEX_LEN[algorithm]
    members = [[n, 1 << 50, 0xFFFFFFFF] for n in files]
    listed = [
        {
            "name": n,
            "size": 1 << 50,
            "algorithm": algorithm,
            "chunk_bytes": chunk_bytes,
            "chunks": ["f" * hex_len] * ((im.size + chunk_bytes - 1) // chunk_bytes + 1),
            "kind": "raw",
            "serialization_id": None,
            "id_offset": None,
            "storages": [],
        }
        for n, im in planned.items()
        if im.kind == "raw"
    ]
    return {"token": "f" * 32, "carrier": "x" * 255, "members": members, "listed": listed}
