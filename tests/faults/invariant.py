"""Invariant I, checked on a real directory after a fault.

After any fault, ``latest(root)`` returns the newest checkpoint whose commit completed, it
verifies bit for bit against its manifest, and nothing uncommitted is ever returned or loaded.

A :class:`Version` is one save's outcome as the test knows it: the exact bytes of its file(s),
the state it was saved from, and the indices in the operation log of its publishing rename and of
the directory fsync that completed its commit.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

import stagesave
from stagesave.formats import Safetensors
from stagesave.ondisk.names import parse_aside_name

__all__ = ["Version", "check_invariant", "read_version_files", "same_state"]


@dataclass(eq=False)
class Version:
    """One saved checkpoint: ``files`` maps "" (a single file) or each file of a folder to bytes."""

    name: str
    order: int
    files: dict[str, bytes]
    state: Any
    is_dir: bool = False
    publish: int = -1
    commit: int = -1
    notes: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"<{self.name} #{self.order}>"


def read_version_files(root: str, name: str, is_dir: bool) -> dict[str, bytes]:
    """The bytes a checkpoint has on disk now, in :class:`Version` form."""
    path = os.path.join(root, name)
    if not is_dir:
        with open(path, "rb") as f:
            return {"": f.read()}
    out = {}
    for leaf in sorted(os.listdir(path)):
        if leaf.endswith(".stagesave.json"):
            continue
        with open(os.path.join(path, leaf), "rb") as f:
            out[leaf] = f.read()
    return out


def _on_disk(root: str, v: Version, name: str | None = None) -> bool:
    """Whether ``name`` (default: ``v``'s own name) in ``root`` holds exactly ``v``'s bytes."""
    path = os.path.join(root, v.name if name is None else name)
    try:
        if not v.is_dir:
            with open(path, "rb") as f:
                return f.read() == v.files[""]
        for leaf, data in v.files.items():
            with open(os.path.join(path, leaf), "rb") as f:
                if f.read() != data:
                    return False
        return True
    except OSError:
        return False


def same_state(a: Any, b: Any) -> bool:
    """Bitwise equality of the small states these tests save (dicts of tensors and ints)."""
    if isinstance(a, Safetensors):
        a = dict(a.tensors)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_raw(a), _raw(b)))
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    return type(a) is type(b) and a == b


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _identify(root: str, name: str, versions: list[Version]) -> Version | None:
    """The newest of ``versions`` whose bytes ``name`` in ``root`` holds.

    A folder a crash left aside during a replacement (``.<name>.<pid>-<hex>.stagesave-aside``)
    is offered where it lies while its final name is missing: it is identified as a version of
    that final name (see :func:`_aside_problem` for when offering it is itself a violation).
    """
    aside = parse_aside_name(name)
    as_name = aside[0] if aside is not None else name
    for v in sorted(versions, key=lambda v: -v.order):
        if v.name == as_name and _on_disk(root, v, name):
            return v
    return None


def _aside_problem(root: str, name: str) -> str | None:
    """An aside folder may be offered only as the only copy: never beside its final name."""
    aside = parse_aside_name(name)
    if aside is not None and os.path.lexists(os.path.join(root, aside[0])):
        return f"{name} is offered although {aside[0]} is in place"
    return None


def _load_matches(
    ck: stagesave.Checkpointer, info: stagesave.CheckpointInfo, v: Version
) -> str | None:
    """Load what ``info`` names (verifying) and compare with ``v.state``; a problem or None."""
    try:
        if not v.is_dir:
            loaded = ck.load(info.path)
            return (
                None if same_state(v.state, loaded) else f"{info.name} loads other values than {v}"
            )
        from safetensors.torch import load_file

        for leaf, content in v.state.items():
            p = os.path.join(info.path, leaf)
            loaded = load_file(p) if isinstance(content, Safetensors) else ck.load(p)
            if not same_state(content, loaded):
                return f"{info.name}/{leaf} loads other values than {v}"
    except Exception as exc:  # noqa: BLE001 - any failure to load the chosen checkpoint is a violation
        return f"loading {info.name} ({v}) failed: {type(exc).__name__}: {exc}"
    return None


def check_invariant(root: str, versions: list[Version], k: int, mode: str) -> list[str]:
    """Violations of invariant I in ``root`` after a power loss following operation ``k``.

    Args:
        root: The checkpoint root after the fault.
        versions: Every checkpoint saved into it (earlier ones first), with their log indices.
        k: Index of the last operation that happened (-1: none of the logged ones).
        mode: ``durable``: every unsynced directory entry was lost, so ``latest`` must be exactly
            the newest version whose commit fsync happened; ``eager``: every directory entry
            survived, so it must be the newest published one; ``random``: anything in between.
    """
    published = [v for v in versions if v.publish <= k]
    committed = [v for v in versions if v.commit <= k]
    floor = max(committed, key=lambda v: v.order, default=None)
    top = max(published, key=lambda v: v.order, default=None)
    problems: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with stagesave.Checkpointer(root) as ck:
            info = ck.latest(verify=True)
            got = _identify(root, info.name, published) if info is not None else None
            offered_aside = _aside_problem(root, info.name) if info is not None else None
            if offered_aside:
                problems.append(f"latest(): {offered_aside}")
            if info is not None and got is None:
                unpublished = _identify(root, info.name, versions)
                what = (
                    f"the uncommitted {unpublished}" if unpublished else "bytes of no saved version"
                )
                problems.append(f"latest() is {info.name} holding {what}")
            elif mode == "durable" and got is not floor:
                problems.append(f"latest() is {got} but the newest committed checkpoint is {floor}")
            elif mode == "eager" and got is not top:
                problems.append(f"latest() is {got} but the newest published checkpoint is {top}")
            elif floor is not None and (got is None or got.order < floor.order):
                problems.append(f"latest() is {got}, older than the committed {floor}")
            if info is not None and got is not None:
                if info.status != "verified":
                    problems.append(f"latest() {info.name} has status {info.status}, not verified")
                bad = _load_matches(ck, info, got)
                if bad:
                    problems.append(bad)
            for other in ck.list():
                if other.valid and _identify(root, other.name, published) is None:
                    problems.append(
                        f"list() offers {other.name} ({other.status}) holding no published version"
                    )
                if other.valid and _aside_problem(root, other.name):
                    problems.append(f"list(): {_aside_problem(root, other.name)}")
    return problems
