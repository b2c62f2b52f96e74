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
import os
from pathlib import Path
from typing import Any

from stagesave.stores import urls

from ._checkpointer import AcceleratorCheckpointer
from ._config import resolve_options
from ._roots import CHECKPOINTS_DIR

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
                "options, and it has saved or loaded since; call "
                "stagesave.accelerate.disable(accelerator) first"
            )
        disable(accelerator)  # nothing went through it yet: the options given here win
    checkpointer = AcceleratorCheckpointer(accelerator, **options)
    if checkpointer.asynchronous:
        cls = type(accelerator)
        for name, method in (("save_state", _save_state), ("load_state", _load_state)):
            setattr(accelerator, name, _installed(
                getattr(cls, name), functools.partial(method, checkpointer), checkpointer))
        for name in _RELEASING:
            original = getattr(cls, name, None)
            if original is not None:
                setattr(accelerator, name, _installed(
                    original, functools.partial(_released_then, checkpointer, name), checkpointer))
    setattr(accelerator, _ATTR, checkpointer)
    return checkpointer


def _installed(original: Any, method: Any, owner: AcceleratorCheckpointer) -> Any:
    """A function with the original's name and docstring that calls ``method``.

    It refers to the checkpointer ``owner``, which refers to the Accelerator only weakly:
    installing it creates no reference cycle through the Accelerator.
    """

    @functools.wraps(original)
    def installed(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    installed.__stagesave__ = owner  # type: ignore[attr-defined]
    return installed


def _save_state(
    checkpointer: AcceleratorCheckpointer, output_dir: str | os.PathLike[str] | None = None,
    safe_serialization: bool = True, **save_model_func_kwargs: Any,
) -> Path | str:
    """``Accelerator.save_state`` replacement: returns the folder, like Accelerate."""
    cp = checkpointer
    if not cp.asynchronous:
        result: Path | str = cp._accelerate_save(
            output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs
        )
        return result
    target, _ = cp._save(output_dir, safe_serialization)
    acc = cp.accelerator
    if output_dir is not None and not acc.project_configuration.automatic_checkpoint_naming:
        # as given, like Accelerate
        return target if urls.is_url(target) else Path(os.fspath(output_dir))
    local = cp._auto.local_folder(urls.leaf(target))
    if local is None:
        return target
    if cp.options.destination is None:
        return Path(os.path.join(acc.project_dir, CHECKPOINTS_DIR, urls.leaf(target)))
    return Path(local)


def _load_state(
    checkpointer: AcceleratorCheckpointer, input_dir: str | os.PathLike[str] | None = None,
    load_kwargs: dict[str, Any] | None = None, **load_model_func_kwargs: Any,
) -> None:
    """``Accelerator.load_state`` replacement (returns ``None``, like Accelerate)."""
    checkpointer.load_state(input_dir, load_kwargs, **load_model_func_kwargs)


def _released_then(
    checkpointer: AcceleratorCheckpointer, name: str, *args: Any, **kwargs: Any
) -> Any:
    """``end_training``/``free_memory``/``clear`` replacement: pending saves are committed and
    stagesave's threads and buffers given back first (``end_training`` then destroys the
    process group, which a flush must not outlive), then Accelerate's own method runs. A
    failed save is raised after Accelerate's method ran, so the run still ends normally."""
    failure: BaseException | None = None
    try:
        checkpointer.close()
    except BaseException as exc:  # noqa: BLE001, RUF100 - raised once Accelerate's ran
        failure = exc
    result = getattr(checkpointer._cls, name)(checkpointer.accelerator, *args, **kwargs)
    if failure is not None:
        raise failure
    return result


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
