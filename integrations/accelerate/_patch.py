"""What ``enable()`` changes on an Accelerator, and how it is undone.

Instance attributes are set on the one ``Accelerator`` passed in, shadowing the class's methods
for that object only: ``save_state`` and ``load_state`` (stagesave's), ``end_training``,
``free_memory`` and ``clear`` (give stagesave's threads and buffers back, after flushing pending
saves, then run Accelerate's own), plus ``_stagesave`` holding the
:class:`AcceleratorCheckpointer`. ``disable()`` deletes them all (the class methods show through
again) and waits for pending saves. The ``Accelerator`` class is
patched only by :func:`enable_globally`, used by ``python -m stagesave.accelerate`` (so that
``accelerate launch -m stagesave.accelerate train.py`` needs no code change); it wraps
``Accelerator.__init__`` to call :func:`enable` on every new instance, and
:func:`disable_globally` restores the original ``__init__``.
"""

from __future__ import annotations

import functools
from typing import Any

from ._checkpointer import AcceleratorCheckpointer
from ._config import resolve_options

__all__ = ["disable", "disable_globally", "enable", "enable_globally", "enabled"]

_ATTR = "_stagesave"
_ORIGINAL_INIT = "_stagesave_original_init"
#: Accelerate's methods that end a run or drop its objects: stagesave releases first.
_RELEASING = ("end_training", "free_memory", "clear")
_INSTALLED = ("save_state", "load_state", *_RELEASING)


def enabled(accelerator: Any) -> AcceleratorCheckpointer | None:
    """The checkpointer :func:`enable` installed on ``accelerator``, or ``None``."""
    found = vars(accelerator).get(_ATTR)
    return found if isinstance(found, AcceleratorCheckpointer) else None


def enable(accelerator: Any, **options: Any) -> AcceleratorCheckpointer:
    """Make ``accelerator.save_state()`` asynchronous and ``load_state()`` verified.

    After this call the unchanged ``accelerator.save_state(...)`` made inside a training loop
    (an optimizer of this Accelerator stepped since the previous save or load) returns once the
    state is staged in host memory and writes Accelerate's usual folder in the background; one
    made outside training returns once the folder is committed. ``accelerator.load_state()``
    resumes from the newest valid checkpoint. ``end_training()``, ``free_memory()`` and
    ``clear()`` first flush pending saves and give back stagesave's threads and buffers. Options
    (``destination=``, ``max_pending=``, ``checksum=``, ``verify_on_load=``, ``io_threads=``,
    ``direct_io=``, ``storage_options=``, ``device_staging=``, ``sync_outside_training=``,
    ``telemetry_jsonl=``) override ``STAGESAVE_ACCELERATE_*`` environment variables and the
    ``STAGESAVE_ACCELERATE_CONFIG`` side file. Calling it again returns the installed checkpointer;
    called again with other options before anything was saved or loaded through it (an
    Accelerator enabled by ``python -m stagesave.accelerate``, then by the script), it installs a
    checkpointer with the new options instead.

    Under FSDP, DeepSpeed, Megatron-LM and XLA, and when ``STAGESAVE_ACCELERATE=0``, nothing is
    patched: Accelerate's synchronous methods stay (with one warning, except when switched off).

    Raises:
        TypeError: an unknown option.
        ValueError: an unusable option value (the message names where it came from); other
            options than those of the checkpointer already installed, which has saved or loaded.
    """
    existing = enabled(accelerator)
    if existing is not None:
        if not options or existing.options == resolve_options(options):
            return existing
        if existing.used:
            raise ValueError(
                "stagesave.accelerate.enable() was already called on this Accelerator with other "
                "options, and it has saved or loaded since; call stagesave.accelerate.disable(accelerator) first"
            )
        disable(accelerator)  # nothing went through it yet: the options given here win
    checkpointer = AcceleratorCheckpointer(accelerator, **options)
    if checkpointer.asynchronous:
        cls = type(accelerator)
        accelerator.save_state = _installed(cls.save_state, checkpointer._installed_save_state)
        accelerator.load_state = _installed(cls.load_state, checkpointer._installed_load_state)
        for name in _RELEASING:
            original = getattr(cls, name, None)
            if original is not None:
                setattr(accelerator, name, _installed(original, functools.partial(
                    checkpointer._released_then, name), owner=checkpointer))
    setattr(accelerator, _ATTR, checkpointer)
    return checkpointer


def _installed(original: Any, method: Any, owner: Any = None) -> Any:
    """A function with the original's name and docstring that calls ``method``.

    It refers to the checkpointer (``owner``, or the one ``method`` is bound to), which refers to
    the Accelerator only weakly: installing it creates no reference cycle through the Accelerator.
    """

    @functools.wraps(original)
    def installed(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    installed.__stagesave__ = owner if owner is not None else method.__self__  # type: ignore[attr-defined]
    return installed


def disable(accelerator: Any, timeout: float | None = None) -> None:
    """Give ``accelerator`` back Accelerate's own methods, then finish pending saves and give
    back stagesave's threads and buffers.

    Raises:
        TimeoutError: saves still running after ``timeout`` seconds (they were not committed).
        CheckpointError: a background save failed.
    """
    checkpointer = enabled(accelerator)
    if checkpointer is None:
        return
    attrs = vars(accelerator)
    for name in _INSTALLED:
        owner = getattr(attrs.get(name), "__stagesave__", None)
        if owner is not None and owner is checkpointer:
            del attrs[name]
    del attrs[_ATTR]
    checkpointer._training.stop()
    checkpointer.close(timeout)


def enable_globally(**options: Any) -> None:
    """Call :func:`enable` on every ``Accelerator`` constructed from now on in this process."""
    from accelerate.accelerator import Accelerator

    if _ORIGINAL_INIT in vars(Accelerator):
        return
    original = Accelerator.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        enable(self, **options)

    setattr(Accelerator, _ORIGINAL_INIT, original)
    Accelerator.__init__ = __init__


def disable_globally() -> None:
    """Undo :func:`enable_globally` (Accelerators already enabled stay enabled)."""
    from accelerate.accelerator import Accelerator

    original = vars(Accelerator).get(_ORIGINAL_INIT)
    if original is not None:
        Accelerator.__init__ = original
        delattr(Accelerator, _ORIGINAL_INIT)
