"""pytest plugin: ``stagesave.accelerate.enable()`` on every ``Accelerator`` of a test session.

Loaded into Accelerate's own test suite (not stagesave's) by ``scripts/upstream-tests.sh``::

    cd <accelerate checkout>
    PYTHONPATH=<repo>/tests/upstream python -m pytest -p accelerate_enabled tests/...

It calls ``stagesave.accelerate.enable_globally()`` once at configure time, which wraps
``Accelerator.__init__`` so that every Accelerator constructed afterwards gets ``enable()``,
the same path ``accelerate launch -m stagesave.accelerate train.py`` takes.

Environment:
    STAGESAVE_UPSTREAM_ACCELERATE_OPTIONS: JSON object of keyword arguments for ``enable()``.
    STAGESAVE_UPSTREAM_SYNC: ``1`` to wait for the checkpointer (``AcceleratorCheckpointer.wait()``)
        after every ``save_state``: a diagnostic run that tells failures caused by asynchrony
        from the others.

The terminal summary says how many Accelerators were constructed, how many were enabled with
the asynchronous ``save_state``/``load_state`` installed (``enable()`` leaves Accelerate's own
methods under FSDP/DeepSpeed/..., or when ``STAGESAVE_ACCELERATE=0``), and how ``stagesave-*``
threads alive after each test evolved (after how many tests there were more than before, the most,
the count after the last test).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from typing import Any

import pytest

_STATS = {"constructed": 0, "enabled": 0, "asynchronous": 0,
          "tests_adding_threads": 0, "threads_now": 0, "max_threads_after_test": 0}
_SYNC = os.environ.get("STAGESAVE_UPSTREAM_SYNC", "") not in ("", "0")


def _install() -> None:
    import stagesave.accelerate as sa
    from accelerate import Accelerator

    options = json.loads(os.environ.get("STAGESAVE_UPSTREAM_ACCELERATE_OPTIONS") or "{}")
    sa.enable_globally(**options)
    if getattr(Accelerator, "_stagesave_upstream_counted", False):
        return
    patched = Accelerator.__init__

    @functools.wraps(patched)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _STATS["constructed"] += 1
        patched(self, *args, **kwargs)
        if sa.enabled(self) is not None:
            _STATS["enabled"] += 1
            if "save_state" in vars(self):
                _STATS["asynchronous"] += 1
                if _SYNC:
                    _wait_after_save(self, sa.enabled(self))

    Accelerator.__init__ = __init__  # type: ignore[method-assign]
    Accelerator._stagesave_upstream_counted = True  # type: ignore[attr-defined]


def _wait_after_save(accelerator: Any, checkpointer: Any) -> None:
    installed = accelerator.save_state

    @functools.wraps(installed)
    def save_state(*args: Any, **kwargs: Any) -> Any:
        out = installed(*args, **kwargs)
        checkpointer.wait()
        return out

    accelerator.save_state = save_state


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
    import stagesave

    sync = ", every save_state waited for" if _SYNC else ""
    return (f"accelerate_enabled: stagesave.accelerate.enable_globally() (stagesave from "
            f"{os.path.dirname(stagesave.__file__)}){sync}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    s = _STATS
    terminalreporter.write_line(
        f"accelerate_enabled{'[sync]' if _SYNC else ''}: {s['constructed']} Accelerators "
        f"constructed, {s['enabled']} enabled, "
        f"{s['asynchronous']} with stagesave's save_state/load_state; live stagesave threads: "
        f"more after {s['tests_adding_threads']} tests, at most {s['max_threads_after_test']}, "
        f"{s['threads_now']} after the last"
    )
