"""Options of the Accelerate adapter, and where they come from without code changes.

Accelerate's own YAML config rejects keys it does not know, so stagesave cannot live there.
It follows Accelerate's other convention instead: ``accelerate launch`` hands its environment
to every process unchanged, and plugins read ``PREFIX_*`` variables when they are built (as
``FSDP_*`` and ``ACCELERATE_*`` are). ``enable()`` reads ``STAGESAVE_ACCELERATE_*`` variables and,
when ``STAGESAVE_ACCELERATE_CONFIG`` names one, a small YAML side file with the same keys.
Precedence: arguments passed in code, then environment variables, then the side file, then the
defaults below. ``STAGESAVE_ACCELERATE=0`` switches the adapter off whatever the code says.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from stagesave.ondisk.checksum import DEFAULT_ALGORITHM
from stagesave.ondisk.names import TELEMETRY_FILE
from stagesave.stores import urls

__all__ = [
    "ENV_CONFIG",
    "ENV_PREFIX",
    "ENV_SWITCH",
    "Options",
    "check_options",
    "is_switched_off",
    "resolve_options",
    "telemetry_target",
]

#: ``0``/``false``/``off`` disables the adapter (``enable()`` leaves Accelerate untouched).
ENV_SWITCH = "STAGESAVE_ACCELERATE"
#: Path of a YAML (or JSON) file holding any of the :class:`Options` keys.
ENV_CONFIG = "STAGESAVE_ACCELERATE_CONFIG"
#: Prefix of one variable per option: ``STAGESAVE_ACCELERATE_MAX_PENDING=1`` etc.
ENV_PREFIX = "STAGESAVE_ACCELERATE_"

_FALSE = {"0", "false", "off", "no"}
_TRUE = {"1", "true", "on", "yes"}


@dataclass(frozen=True)
class Options:
    """How the adapter checkpoints.

    Attributes:
        destination: Folder that holds ``checkpoint_<N>`` folders under automatic checkpoint
            naming, instead of ``<project_dir>/checkpoints``: a local path or an fsspec URL
            (``s3://bucket/run``). ``None`` keeps Accelerate's folder.
        max_pending: Saves in flight at once (each holds one host staging buffer); a further
            ``save_state`` waits for the oldest to finish instead of allocating more memory.
        checksum: Chunk checksum algorithm recorded in each file's proof: ``"crc32"`` (the
            core's default; its chunk CRCs also give the zip records' CRC-32s), or ``"xxh3_128"``,
            ``"xxh3_64"``, ``"blake3"``, ``"sha256"``.
        verify_on_load: Read every byte of a checkpoint against its proof before loading it;
            under automatic naming a corrupt one is skipped for the previous valid one.
        io_threads: Threads writing one save's chunks in parallel.
        direct_io: Write local files with ``O_DIRECT`` where the filesystem allows it.
        storage_options: fsspec options for URL destinations (endpoint, region, credentials).
        local_tier: A local directory used as a fast tier in front of a URL ``destination``
            (automatic naming only): each checkpoint commits there first (durable in seconds)
            and is uploaded to ``destination`` in the background; ``load_state()`` restores
            from the local copy when it is valid and from the remote one otherwise.
        keep_local: With ``local_tier``: committed checkpoints kept on the local tier (``None``:
            as many as ``total_limit`` keeps). One not uploaded yet is never removed there.
        device_staging: Stage a GPU model's checkpoint in GPU memory (device-to-device copies)
            and write it from there, with GPUDirect Storage when kvikio is installed; costs one
            GPU buffer of the checkpoint's size per save in flight. Local destinations only.
        writer: ``"process"``: a writer agent process writes and commits each save and
            finishes every save handed to it if training dies; ``"thread"``: this process's
            threads; ``None``: ``$STAGESAVE_WRITER``, else ``"process"`` (``"thread"`` with
            ``device_staging``).
        sync_outside_training: A ``save_state`` with no optimizer step of this Accelerator since
            the previous ``save_state``/``load_state`` (nothing to overlap it with: before
            training, after it, between evaluations) returns only once it is committed, and
            raises its failure there. ``False``: every save returns after staging.
        telemetry_jsonl: Append each save's telemetry as one JSON line (what ``stagesave
            report`` reads): ``True`` for ``<project_dir>/stagesave-telemetry.jsonl``, or a file
            path; ``False`` records nothing.
        trusted: Unpickle the checkpoint's files (``custom_checkpoint_<i>.pkl``, optimizer,
            scheduler, RNG states, ...) with the full pickle machinery, which can run code
            from the file. ``False`` (the default): stagesave's safe unpickler, with the
            classes :func:`stagesave.allow_globals` added. Only the files the checkpoint's
            proof lists are read either way.
        prepare_buffer: Make the staging buffer of the first ``save_state`` ahead, once the
            Accelerator's optimizers stepped (on a thread, sized by the models', optimizers'
            and registered modules' state), so that the first save only copies like the later
            ones.
            ``None`` (``auto``): when training runs on an accelerator (a CPU-only run would
            lend the cores making it to nothing else but training). Costs the buffer's memory
            from that step on instead of from the first save.
    """

    destination: str | None = None
    max_pending: int = 2
    checksum: str = DEFAULT_ALGORITHM
    verify_on_load: bool = True
    io_threads: int = 4
    direct_io: bool = True
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    local_tier: str | None = None
    keep_local: int | None = None
    device_staging: bool = False
    writer: str | None = None
    sync_outside_training: bool = True
    telemetry_jsonl: bool | str = False
    trusted: bool = False
    prepare_buffer: bool | None = None


_NAMES = {f.name for f in fields(Options)}


def is_switched_off(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``STAGESAVE_ACCELERATE`` turns the adapter off in this environment.

    Raises:
        ValueError: the variable holds something other than a yes/no word.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_SWITCH)
    if raw is None or raw.strip() == "":
        return False
    word = raw.strip().lower()
    if word in _FALSE:
        return True
    if word in _TRUE:
        return False
    raise ValueError(f"{ENV_SWITCH}={raw!r} is not understood: use 1 (on, the default) or 0 (off)")


def _coerce(key: str, value: Any, where: str) -> Any:
    """Convert a value from the environment or a side file to the option's type."""
    if key in ("keep_local", "writer", "prepare_buffer") and value in (None, ""):
        return None
    if key == "prepare_buffer" and str(value).strip().lower() == "auto":
        return None
    if key == "writer":
        if value not in ("thread", "process"):
            raise ValueError(f"{where}: writer must be 'thread' or 'process', got {value!r}")
        return value
    if key in ("max_pending", "io_threads", "keep_local"):
        try:
            number = int(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {key} must be an integer, got {value!r}") from exc
        if number < 1:
            raise ValueError(f"{where}: {key} must be >= 1, got {number}")
        return number
    if key in ("verify_on_load", "direct_io", "device_staging", "sync_outside_training", "trusted",
               "prepare_buffer"):
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    if key == "telemetry_jsonl":
        if isinstance(value, bool):
            return value
        text = "" if value is None else str(value).strip()
        if text.lower() in _TRUE or text.lower() in _FALSE or text == "":
            return text.lower() in _TRUE
        return os.path.expanduser(text)  # a file path
    if key == "storage_options":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: storage_options must be a JSON object: {exc}") from exc
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{where}: storage_options must be a mapping, got {type(value).__name__}"
            )
        return dict(value)
    if key in ("destination", "local_tier"):
        return None if value in (None, "") else os.path.expanduser(str(value))
    return str(value)


def _from_file(path: str) -> dict[str, Any]:
    """Options from the side file (YAML; JSON is valid YAML).

    Raises:
        FileNotFoundError: the file named by ``STAGESAVE_ACCELERATE_CONFIG`` does not exist.
        ValueError: it is not a mapping or holds an unknown key.
    """
    import yaml  # a dependency of accelerate

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{ENV_CONFIG} names {path}, which does not exist") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{ENV_CONFIG} file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if isinstance(data, Mapping) and set(data) == {"stagesave"}:
        data = data["stagesave"] or {}
    if not isinstance(data, Mapping):
        # A malformed file is a bad value like any other: ValueError, as documented.
        raise ValueError(  # noqa: TRY004, RUF100
            f"{ENV_CONFIG} file {path} must hold a mapping of options"
        )
    unknown = sorted(set(data) - _NAMES)
    if unknown:
        raise ValueError(
            f"{ENV_CONFIG} file {path} has unknown keys {unknown}; known keys: {sorted(_NAMES)}"
        )
    return {k: _coerce(k, v, f"{ENV_CONFIG} file {path}") for k, v in data.items()}


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _NAMES:
        var = ENV_PREFIX + name.upper()
        if var in env:
            out[name] = _coerce(name, env[var], var)
    return out


def resolve_options(
    overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Options:
    """Defaults, then the side file, then environment variables, then ``overrides``.

    Raises:
        TypeError: ``overrides`` holds a name that is not an option.
        ValueError: a value cannot be used (the message names the variable or file).
        FileNotFoundError: ``STAGESAVE_ACCELERATE_CONFIG`` names a missing file.
    """
    env = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    path = env.get(ENV_CONFIG)
    if path:
        merged.update(_from_file(path))
    merged.update(_from_env(env))
    for key, value in (overrides or {}).items():
        if key not in _NAMES:
            raise TypeError(f"unknown stagesave.accelerate option {key!r}; known: {sorted(_NAMES)}")
        merged[key] = _coerce(key, value, f"argument {key}")
    return replace(Options(), **merged)


def check_options(options: Options) -> None:
    """Raises ValueError for option combinations that cannot work."""
    if options.local_tier is None:
        if options.keep_local is not None:
            raise ValueError("keep_local applies to local_tier, which is not set")
        return
    if options.destination is None:
        raise ValueError("local_tier is a fast tier in front of destination=, which is not set")
    if urls.is_url(options.local_tier):
        raise ValueError(f"local_tier must be a local directory, got {options.local_tier}")
    if urls.normalize(options.local_tier) == urls.normalize(options.destination):
        raise ValueError("local_tier and destination are the same folder")


def telemetry_target(accelerator: Any, options: Options) -> bool | str:
    """Where the telemetry JSON lines go: a file path, or ``False``.

    Raises:
        ValueError: ``telemetry_jsonl=True`` for an Accelerator without ``project_dir``.
    """
    wanted = options.telemetry_jsonl
    if wanted is False or wanted == "":
        return False
    if wanted is True:
        project_dir = getattr(accelerator, "project_dir", None)
        if project_dir is None:
            raise ValueError(
                f"telemetry_jsonl=True writes <project_dir>/{TELEMETRY_FILE}, and this "
                "Accelerator has no project_dir: pass ProjectConfiguration(project_dir=...) or a "
                "file path as telemetry_jsonl"
            )
        return os.path.join(os.fspath(project_dir), TELEMETRY_FILE)
    return os.fspath(wanted)
