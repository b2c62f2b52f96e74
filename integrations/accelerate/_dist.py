"""Coordination between processes through the job's key-value store, never its process group.

A stagesave folder is committed whole by one writer, so the small per-process pieces (RNG
states) travel to the writer, the choice of checkpoint to resume from travels from rank 0 to
everyone, and a few points wait for every process. All of it happens on the training thread,
inside ``save_state`` and ``load_state``, through the store ``torch.distributed`` was initialized
with (the ``TCPStore`` of ``torchrun``/``accelerate launch``): ``set``/``get``/``add`` of small
pickled values under keys of stagesave's own.

Why not object collectives (``gather_object``, ``broadcast_object_list``, ``barrier``) on the
training's process group, as before: they hand tensors created in Python to gloo's worker
threads, and a worker that drops the last reference to such a tensor must take the GIL to free
its Python object, while holding the process group's work mutex. When the process group is
destroyed (freeing the DDP model at the end of a script) its destructor takes that mutex and
joins the workers *with the GIL held*: if a worker is still releasing a collective's tensors then,
both wait forever (the hang ``examples/accelerate_finetune.py`` used to dodge with ``os._exit``).
Store operations involve no tensor, no worker thread of the process group, and no collective, so
stagesave adds nothing to the group's teardown. (DESIGN.md: coordination goes through files or a
key-value store.)

Every process must make the same calls in the same order, as with collectives: keys are numbered
by a per-process sequence that advances only for distributed calls. Each key is deleted by the
last process that needs it, so nothing accumulates in the store over a long run.
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import torch

__all__ = ["barrier", "broadcast_from_main", "distributed", "gather_to_writers"]

#: Namespace of stagesave's keys in the job's store.
KEY_PREFIX = "stagesave/accelerate"

_sequence = itertools.count()


def distributed(num_processes: int) -> bool:
    """Whether Accelerate runs ``num_processes`` > 1 over an initialized default process group.

    Accelerate's own view decides: a process it treats as alone (``num_processes == 1``) is
    alone for stagesave too, whatever torch.distributed holds.
    """
    return (
        num_processes > 1
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    )


def _store() -> Any:
    """The store of the default process group (a ``PrefixStore`` over the job's TCPStore)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _next_key(what: str) -> str:
    return f"{KEY_PREFIX}/{next(_sequence)}/{what}"


def _rank() -> int:
    return int(torch.distributed.get_rank())


def gather_to_writers(obj: Any, rank: int, num_processes: int, everywhere: bool) -> dict[int, Any]:
    """Every process's ``obj`` keyed by rank: on rank 0 only, or on all when ``everywhere``.

    Processes that receive nothing get ``{}``.
    """
    if not distributed(num_processes):
        return {rank: obj}
    store, key = _store(), _next_key("gather")
    store.set(f"{key}/{rank}", pickle.dumps((rank, obj)))
    if not everywhere and rank != 0:
        return {}
    keys = [f"{key}/{r}" for r in range(num_processes)]
    out = dict(pickle.loads(store.get(k)) for k in keys)  # written by this job's processes
    readers = num_processes if everywhere else 1
    if store.add(f"{key}/read", 1) == readers:  # the last reader removes the keys
        for k in (*keys, f"{key}/read"):
            store.delete_key(k)
    return out


def broadcast_from_main(obj: Any, num_processes: int) -> Any:
    """Rank 0's ``obj`` on every process."""
    if not distributed(num_processes):
        return obj
    store, key = _store(), _next_key("broadcast")
    if _rank() == 0:
        store.set(key, pickle.dumps(obj))
        return obj
    received = pickle.loads(store.get(key))  # written by this job's rank 0
    if store.add(f"{key}/read", 1) == num_processes - 1:
        store.delete_key(key)
        store.delete_key(f"{key}/read")
    return received


def barrier(num_processes: int) -> None:
    """Wait for every process (no-op in a single process)."""
    if not distributed(num_processes):
        return
    store, key = _store(), _next_key("barrier")
    keys = [f"{key}/{r}" for r in range(num_processes)]
    store.set(keys[_rank()], b"1")
    store.wait(keys)
    if store.add(f"{key}/left", 1) == num_processes:  # everyone has passed the wait
        for k in (*keys, f"{key}/left"):
            store.delete_key(k)
