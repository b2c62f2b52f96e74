"""A check, in compiled code, that many tensors still have the facts a template recorded.

A steady save (:mod:`.steady`) must know that every tensor of the state has the type, dtype,
device, ``requires_grad``, shape and strides its template was planned with. Read in Python
that costs ~2 µs per tensor on this project's VM (``Tensor.shape`` alone ~1.3 µs: it builds a
``torch.Size`` through torch's Python bindings), 0.2 s per save of 100,000 tensors. torch's own
compiler checks exactly these facts of its inputs before it reuses compiled code, in C++:
``torch._C._dynamo.guards.TensorGuards``, built from example tensors (capturing each one's
Python type, dispatch keys, dtype, device, ``requires_grad``, sizes and strides, and holding
no reference to it) and asked ``check(*tensors)``: ~0.2 µs per tensor here.

That class is torch's, not a public API, so it is used only where it proves itself: once per
process it must tell a small state apart from each kind of change (a shape, a stride, a dtype,
``requires_grad``, a parameter for a tensor, a sparse, meta, negative or conjugate tensor in a
plain one's place, another object where one object stood twice) and accept the state
unchanged, also inside ``torch.inference_mode``; if it cannot be imported or built, or fails
that test, :func:`build` gives ``None`` and the caller compares the facts in Python as before.
Its answer "the same" is taken as proof; its answer "different" is not (the caller then
compares in Python). It is built and asked with gradients enabled and with the thread's
dispatch keys set aside (those of inference mode, autocast or a dispatch mode would otherwise
count as a difference: a save under such a mode would compare in Python), so that a save
inside or outside a mode is checked alike and ``requires_grad`` is compared as it is.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["Guard", "build", "checkable", "usable"]

_strided = torch.strided
_lock = threading.Lock()
_usable: bool | None = None  # the once-per-process test's answer


def _force_keys() -> Any:
    """torch's guard that sets the thread's dispatch keys for a while (``None``: not in this
    torch), and the empty set of keys."""
    try:
        return torch._C._ForceDispatchKeyGuard, torch._C.DispatchKeySet(
            torch._C.DispatchKey.Undefined)
    except Exception:  # noqa: BLE001 - a torch without it: modes make the check say "different"
        return None


_FORCE = _force_keys()


@contextlib.contextmanager
def _as_everywhere() -> Iterator[None]:
    """Gradients on and no thread-local dispatch keys (those of ``torch.inference_mode``,
    autocast, a dispatch mode): the check is built and asked in the same conditions, whatever
    mode the caller saves in. Nothing runs inside but torch's reading of tensor facts."""
    with torch.enable_grad():
        if _FORCE is None:
            yield
        else:
            force, empty = _FORCE
            with force(empty, empty):
                yield


class Guard:
    """A check of tensors against the facts they had when it was built.

    torch's check takes each tensor object once (given one object twice it says "different"),
    so it is built on the first place of each object; the other places must hold the same
    object as before (``repeats``: ``(place, its first place)``).
    """

    __slots__ = ("_check", "count", "firsts", "repeats")

    def __init__(self, check: Any, count: int, firsts: list[int] | None,
                 repeats: list[tuple[int, int]]) -> None:
        self._check = check
        self.count = count
        self.firsts = firsts  # None: every place holds its own object
        self.repeats = repeats

    def same(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` (as many as it was built from, in the same order) have the same
        Python type, dtype, device, ``requires_grad``, shape and strides, and the same object
        where it had one object twice; ``False`` also where it cannot tell.

        Every one of ``tensors`` must be :func:`checkable` (the caller's walk checks it):
        torch's check reads every tensor's strides, which a nested or sparse tensor does not
        have, and that error aborts the process (torch 2.13) instead of raising.
        """
        if len(tensors) != self.count:
            return False
        if any(tensors[a] is not tensors[b] for a, b in self.repeats):
            return False
        firsts = self.firsts
        some = tensors if firsts is None else [tensors[i] for i in firsts]
        try:
            with _as_everywhere():
                return bool(self._check(*some))
        except Exception:  # noqa: BLE001 - torch's private check: "cannot tell" is "not proven"
            return False


def _make(tensors: Sequence[torch.Tensor]) -> Guard | None:
    seen: dict[int, int] = {}
    repeats = [(j, i) for j, i in ((j, seen.setdefault(id(t), j)) for j, t in enumerate(tensors))
               if i != j]
    firsts = None if not repeats else [j for j, t in enumerate(tensors) if seen[id(t)] == j]
    some = tensors if firsts is None else [tensors[i] for i in firsts]
    try:
        from torch._C._dynamo.guards import TensorGuards  # private to torch: optional here

        with _as_everywhere():
            guards = TensorGuards(*some, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        guard = Guard(guards.check, len(tensors), firsts, repeats)
    except Exception:  # noqa: BLE001 - missing or changed in this torch: Python compares
        return None
    return guard if guard.same(tensors) else None


def _self_test() -> bool:
    """Whether torch's check tells each kind of change apart from the same state (its tensors
    made on the CPU with explicit dtypes: whatever the process's default device and dtype)."""
    try:
        return _tells_changes_apart()
    except Exception:  # noqa: BLE001 - any surprise in a torch of another version: Python
        return False


def _tells_changes_apart() -> bool:
    f32, cpu = torch.float32, "cpu"
    base = torch.arange(12, dtype=f32, device=cpu)
    square = torch.zeros(2, 2, dtype=f32, device=cpu)
    ones = torch.ones(3, dtype=f32, device=cpu)
    state = [base.view(3, 4), base[2:6], square, torch.nn.Parameter(ones)]
    guard = _make(state)
    if guard is None:
        return False
    changes = [
        [state[0].view(4, 3), *state[1:]],  # shape
        [state[0].t(), *state[1:]],  # strides (and shape)
        [state[0], base[2:10:2], *state[2:]],  # strides only
        [*state[:2], square.to(torch.float64), state[3]],  # dtype
        [*state[:2], square.clone().requires_grad_(), state[3]],  # requires_grad
        [*state[:3], state[3].detach()],  # a parameter became a tensor
        [*state[:3], torch.nn.Parameter(ones.clone(), requires_grad=False)],  # its flag
        [state[0], state[1], torch.zeros(4, dtype=f32, device=cpu), state[3]],  # dimensions
        # what a sharded save's rank file must not copy as it is (:mod:`..dcp._rank_guard`)
        [*state[:2], square.to_sparse(), state[3]],  # another layout (the check is not built
        # on one: it would read its strides)
        [*state[:2], torch.zeros(2, 2, dtype=f32, device="meta"), state[3]],  # no data
        [*state[:2], square._neg_view(), state[3]],  # a negative view
    ]
    complex_ = torch.zeros(2, dtype=torch.complex64, device=cpu)
    conj = _make([complex_])  # a conjugate view: same dtype, shape and strides
    twice = _make([square, ones, square])  # one object in two places
    with torch.inference_mode():
        in_a_mode = guard.same(state)  # the thread's modes do not count
    return (guard.same(state) and not any(guard.same(c) for c in changes)
            and conj is not None and not conj.same([complex_.conj()])
            and twice is not None and twice.same([square, ones, square])
            and not twice.same([square, ones, square.clone()]) and in_a_mode)


def usable() -> bool:
    """Whether torch's check is used in this process (tested once)."""
    global _usable
    with _lock:
        if _usable is None:
            _usable = _self_test()
        return _usable


def checkable(t: torch.Tensor) -> bool:
    """Whether torch's check may be given ``t``: a strided tensor that is not nested (it reads
    every tensor's strides, and where a tensor has none the error aborts the process)."""
    return t.layout is _strided and not t.is_nested


def build(tensors: Sequence[torch.Tensor]) -> Guard | None:
    """A guard of ``tensors``' facts as they are now; ``None`` where torch's check is not
    usable (the caller compares in Python) or a tensor is not :func:`checkable`."""
    if not usable() or not all([checkable(t) for t in tensors]):  # noqa: C419 - faster
        return None
    return _make(tensors)
