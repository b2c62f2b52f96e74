"""pytest plugin: stagesave's ``StagedCheckpointIO`` as the default CheckpointIO of every Trainer.

Loaded into Lightning's own test suite (not stagesave's) by ``scripts/upstream-tests.sh``::

    PYTHONPATH=<repo>/tests/upstream python -m pytest -p lightning_default_io tests_pytorch/...

Lightning creates its default IO lazily in ``Strategy.checkpoint_io`` (``TorchCheckpointIO()``
when no CheckpointIO plugin was given, or as the base of a ``_WrappingCheckpointIO`` such as
``AsyncCheckpointIO`` given without one). This plugin replaces that property on
``lightning.pytorch.strategies.Strategy`` so that the lazily created default is a
``StagedCheckpointIO`` instead; a CheckpointIO that a test passes explicitly is left alone,
exactly as Lightning leaves it alone.

Environment:
    STAGESAVE_UPSTREAM_IO: ``staged`` (default) or ``torch`` (the control: ``TorchCheckpointIO``
        created through the same patched property, to show the patch alone breaks nothing).
    STAGESAVE_UPSTREAM_IO_OPTIONS: JSON object of keyword arguments for ``StagedCheckpointIO``.
    STAGESAVE_UPSTREAM_SYNC: ``1`` to wait (``StagedCheckpointIO.wait()``) after every save and
        removal: a diagnostic run that tells failures caused by asynchrony (a pending save or
        removal not visible yet) from the others.

At the end of the session the terminal summary says how many default IOs were created, how many
saves went through stagesave, and how ``stagesave-*`` threads alive after each test evolved (after
how many tests there were more than before, the most, the count after the last test).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import pytest

_STATS = {"created": 0, "saves": 0,
          "tests_adding_threads": 0, "threads_now": 0, "max_threads_after_test": 0}
_KIND = os.environ.get("STAGESAVE_UPSTREAM_IO", "staged").strip().lower()
_SYNC = os.environ.get("STAGESAVE_UPSTREAM_SYNC", "") not in ("", "0")


def _factory() -> Any:
    if _KIND == "torch":
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        return TorchCheckpointIO
    if _KIND != "staged":
        raise pytest.UsageError(f"STAGESAVE_UPSTREAM_IO must be 'staged' or 'torch', got {_KIND!r}")
    from stagesave.lightning import StagedCheckpointIO

    options = json.loads(os.environ.get("STAGESAVE_UPSTREAM_IO_OPTIONS") or "{}")
    original_save = StagedCheckpointIO.save_checkpoint
    original_remove = StagedCheckpointIO.remove_checkpoint
    if not getattr(original_save, "_upstream_counted", False):

        def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
            _STATS["saves"] += 1
            out = original_save(self, *args, **kwargs)
            if _SYNC:
                self.wait()
            return out

        def remove_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original_remove(self, *args, **kwargs)
            if _SYNC:
                self.wait()
            return out

        save_checkpoint._upstream_counted = True  # type: ignore[attr-defined]
        StagedCheckpointIO.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
        StagedCheckpointIO.remove_checkpoint = remove_checkpoint  # type: ignore[method-assign]
    return lambda: StagedCheckpointIO(**options)


def _install() -> None:
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
    from lightning.pytorch.strategies.strategy import Strategy

    if getattr(Strategy, "_stagesave_upstream_patched", False):
        return
    new_io = _factory()

    def _default() -> Any:
        _STATS["created"] += 1
        return new_io()

    def checkpoint_io(self: Any) -> Any:
        # Lightning's own property, with the default's class swapped (and the default made once
        # for a wrapper, not at every access: Lightning's setter ignores later ones anyway).
        if self._checkpoint_io is None:
            self._checkpoint_io = _default()
        elif (
            isinstance(self._checkpoint_io, _WrappingCheckpointIO)
            and not self._checkpoint_io._base_checkpoint_io_configured
        ):
            self._checkpoint_io.checkpoint_io = _default()
        return self._checkpoint_io

    def set_checkpoint_io(self: Any, io: Any) -> None:
        self._checkpoint_io = io

    Strategy.checkpoint_io = property(checkpoint_io, set_checkpoint_io)  # type: ignore[assignment]
    Strategy._stagesave_upstream_patched = True  # type: ignore[attr-defined]


def _stagesave_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("stagesave"))


def pytest_configure(config: pytest.Config) -> None:
    _install()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    n = _stagesave_threads()
    if n > _STATS["threads_now"]:
        _STATS["tests_adding_threads"] += 1
    _STATS["threads_now"] = n
    _STATS["max_threads_after_test"] = max(_STATS["max_threads_after_test"], n)


def pytest_report_header(config: pytest.Config) -> str:
    where = ""
    if _KIND == "staged":
        import stagesave

        where = f" (stagesave from {os.path.dirname(stagesave.__file__)})"
    sync = ", every save and removal waited for" if _SYNC and _KIND == "staged" else ""
    return f"lightning_default_io: default CheckpointIO = {_KIND}{where}{sync}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    s = _STATS
    terminalreporter.write_line(
        f"lightning_default_io[{_KIND}{'+sync' if _SYNC else ''}]: {s['created']} default IOs "
        f"created, {s['saves']} stagesave saves; live stagesave threads: more after "
        f"{s['tests_adding_threads']} tests, at most {s['max_threads_after_test']}, "
        f"{s['threads_now']} after the last"
    )
