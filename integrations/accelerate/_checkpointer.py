"""``AcceleratorCheckpointer``: Accelerate's ``save_state``/``load_state`` through stagesave.

``save_state`` gathers exactly what Accelerate would write (``_layout.py``), hands it to
``Checkpointer.save_dir`` and returns once it is staged in host memory when it sits inside a
training loop (``_training.py``), once committed otherwise; the folder appears only
when every file, each with its proof inside, is durable (it holds exactly Accelerate's files:
one of them, the carrier, also proves the set of files and records the save's
``{"accelerate": {...}}`` metadata). Under FSDP (``SHARDED_STATE_DICT``) every rank
stages its shards through ``stagesave.dcp`` (``_fsdp.py``) and the folder is published once
every part committed (``_assemble.py``). ``load_state`` picks the checkpoint (the newest *valid*
one under automatic naming), proves it against the proofs its files carry, and then lets Accelerate's own
``load_state`` read it, so restoring stays Accelerate's code, hooks and ``map_location`` rules
included (FSDP's DCP folders are read through ``stagesave.dcp``'s reader).

Runs that Accelerate saves through other machinery (DeepSpeed, Megatron-LM, XLA, FSDP with
other state dict types) keep Accelerate's synchronous methods, announced by one
:class:`SynchronousFallbackWarning`.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import time
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagesave import Checkpointer, CheckpointInfo, SaveHandle, SaveTelemetry, TieredStore
from stagesave.stores import posix as fsops

from . import _dist, _fsdp, _remote
from ._assemble import Assembly, discard, first_error, keep_newest, publish, write_ack
from ._config import Options, is_switched_off, resolve_options
from ._hooks import run_save_hooks
from ._layout import METADATA_KEY, collect_rng_state, state_files
from ._resources import Resources
from ._restore import LoadPlan, discard_copy, parts_problems, plan_explicit, plan_newest
from ._roots import AutoRoot
from ._training import TrainingSignal
from ._trust import guarded

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AcceleratorCheckpointer", "SynchronousFallbackWarning"]

logger = logging.getLogger("stagesave.accelerate")

#: Accelerate's automatic naming: ``<project_dir>/checkpoints/checkpoint_<iteration>``.
CHECKPOINTS_DIR = "checkpoints"
FOLDER_PREFIX = "checkpoint_"
#: Marker in the names of work folders (as the core's temporaries, so ``stagesave gc`` knows them).
_TMP = ".stagesave-tmp"
#: The file ``telemetry_jsonl=True`` appends to, in ``project_dir`` (what ``stagesave report`` reads).
TELEMETRY_FILE = "stagesave-telemetry.jsonl"

#: What Accelerate needs from an ``Accelerator`` for the asynchronous path.
_REQUIRED_ATTRS = (
    "_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects",
    "_save_model_state_pre_hook", "project_configuration", "scaler", "step", "get_state_dict",
)


class SynchronousFallbackWarning(UserWarning):
    """Issued once when an Accelerator keeps Accelerate's own synchronous save_state/load_state."""


def _fallback_reason(accelerator: Any, options: Options) -> str | None:
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    missing = [a for a in _REQUIRED_ATTRS if not hasattr(accelerator, a)]
    if missing:
        from importlib.metadata import version

        return (
            f"this Accelerate version ({version('accelerate')}) lacks {', '.join(missing)}, "
            "which stagesave reads to reproduce save_state's layout"
        )
    if kind == DistributedType.FSDP:
        reason = _fsdp.unsupported_reason(accelerator)
        if reason is None and (options.local_tier or (options.destination and _remote.is_url(options.destination))):
            reason = ("FSDP checkpoints are assembled from their DCP parts by renames in a local folder; "
                      "URL destinations and local_tier are not supported with FSDP")
        return reason
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        return (
            f"{kind.value} runs save model and optimizer shards through {kind.value}'s own "
            "functions, which stagesave does not stage"
        )
    if kind == DistributedType.XLA:
        return "XLA runs need xm.mark_step() and XLA-side saving, which stagesave does not do"
    return None


def _telemetry_target(accelerator: Any, options: Options) -> bool | str:
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
                f"telemetry_jsonl=True writes <project_dir>/{TELEMETRY_FILE}, and this Accelerator has no "
                "project_dir: pass ProjectConfiguration(project_dir=...) or a file path as telemetry_jsonl"
            )
        return os.path.join(os.fspath(project_dir), TELEMETRY_FILE)
    return os.fspath(wanted)


def _check_options(options: Options) -> None:
    """Raises ValueError for option combinations that cannot work."""
    if options.local_tier is None:
        if options.keep_local is not None:
            raise ValueError("keep_local applies to local_tier, which is not set")
        return
    if options.destination is None:
        raise ValueError("local_tier is a fast tier in front of destination=, which is not set")
    if _remote.is_url(options.local_tier):
        raise ValueError(f"local_tier must be a local directory, got {options.local_tier}")
    if _remote.normalize(options.local_tier) == _remote.normalize(options.destination):
        raise ValueError("local_tier and destination are the same folder")


class AcceleratorCheckpointer:
    """Asynchronous ``save_state``/``load_state`` for one ``Accelerator``, without patching it.

    Call :meth:`save_state` and :meth:`load_state` where you would call the Accelerator's.
    :func:`stagesave.accelerate.enable` builds one of these and installs its methods on the
    Accelerator instead.

    Args:
        accelerator: A constructed ``accelerate.Accelerator``.
        options: Ready-made :class:`~stagesave.accelerate.Options`; when omitted they come from
            ``overrides``, the ``STAGESAVE_ACCELERATE_*`` environment and the side file.
        **overrides: Individual options (``destination=``, ``max_pending=``, ...).

    Raises:
        TypeError: an unknown option was passed.
        ValueError: an option (argument, environment variable, side file) is unusable.
    """

    def __init__(self, accelerator: Any, *, options: Options | None = None, **overrides: Any) -> None:
        # Held weakly: the Accelerator holds this object (``enable()``), never the reverse, so
        # dropping the Accelerator frees it and the finalizers below give the threads back.
        self._accelerator_ref = weakref.ref(accelerator)
        self.options = options if options is not None else resolve_options(overrides)
        _check_options(self.options)
        # The class's methods: the real ones even when the instance is patched.
        self._cls = type(accelerator)
        self._res = Resources()
        self._telemetry = _telemetry_target(accelerator, self.options)
        self.last_handle: SaveHandle | None = None
        self._used = False
        self.synchronous_reason: str | None = None
        if is_switched_off():
            self.synchronous_reason = "switched off by STAGESAVE_ACCELERATE"
            logger.info("stagesave.accelerate is switched off by STAGESAVE_ACCELERATE; using Accelerate's save_state")
        else:
            reason = _fallback_reason(accelerator, self.options)
            if reason is not None:
                self.synchronous_reason = reason
                warnings.warn(
                    f"stagesave.accelerate: {reason}; save_state and load_state stay Accelerate's own "
                    "synchronous methods for this Accelerator (no checkpoint is written asynchronously).",
                    SynchronousFallbackWarning,
                    stacklevel=3,
                )
        from accelerate.utils import DistributedType

        self._fsdp = self.asynchronous and accelerator.distributed_type == DistributedType.FSDP
        self._training = TrainingSignal(accelerator)
        for owner in (accelerator, self):  # whichever goes first gives the threads and buffers back
            weakref.finalize(owner, self._res.close_quietly).atexit = False  # exit: the core's hook

    # ------------------------------------------------------------------ properties
    @property
    def accelerator(self) -> Any:
        """The Accelerator this checkpointer serves.

        Raises:
            ReferenceError: it was garbage collected (this checkpointer has nothing left to save).
        """
        acc = self._accelerator_ref()
        if acc is None:
            raise ReferenceError("the Accelerator of this AcceleratorCheckpointer was garbage collected")
        return acc

    def _accelerate_save(self, *args: Any, **kwargs: Any) -> Any:
        return self._cls.save_state(self.accelerator, *args, **kwargs)

    def _accelerate_load(self, *args: Any, **kwargs: Any) -> Any:
        return self._cls.load_state(self.accelerator, *args, **kwargs)

    @property
    def used(self) -> bool:
        """Whether a save or load went through this checkpointer."""
        return self._used

    @property
    def asynchronous(self) -> bool:
        """Whether saves go through stagesave (False: Accelerate's synchronous methods)."""
        return self.synchronous_reason is None

    @property
    def checkpoints_root(self) -> str:
        """Where automatic naming puts ``checkpoint_<N>`` folders (path or URL; the remote tier's
        URL when ``local_tier`` is set).

        Raises:
            ValueError: neither ``destination`` nor the Accelerator's ``project_dir`` is set.
        """
        if self.options.destination is not None:
            return _remote.normalize(self.options.destination)
        project_dir = self.accelerator.project_dir
        if project_dir is None:
            raise ValueError(
                "automatic checkpoint naming needs ProjectConfiguration(project_dir=...) or the "
                "stagesave option destination="
            )
        return _remote.normalize(os.path.join(project_dir, CHECKPOINTS_DIR))

    @property
    def _auto(self) -> AutoRoot:
        tier = self.options.local_tier
        return AutoRoot(self.checkpoints_root, _remote.normalize(tier) if tier is not None else None)

    @property
    def tiered_store(self) -> TieredStore | None:
        """The :class:`stagesave.TieredStore` behind automatic naming with ``local_tier``
        (``None`` before the first use or without a local tier)."""
        return self._res.tiered

    def _writes(self) -> bool:
        acc = self.accelerator
        if acc.project_configuration.save_on_each_node:
            return bool(acc.is_local_main_process)
        return bool(acc.is_main_process)

    def _checkpointer(self, kind: str = "plain") -> Checkpointer:
        """The Checkpointer for ``"auto"`` (automatic naming, with retention and the tiered
        root), ``"plain"`` (explicit folders) or ``"fsdp"`` (parts of FSDP checkpoints)."""
        ckpt = self._res.checkpointers.get(kind)
        if ckpt is None:
            o = self.options
            root: TieredStore | None = None
            keep = None
            if kind == "auto":
                keep = self.accelerator.project_configuration.total_limit
                if o.local_tier is not None:
                    root = self._res.tiered = TieredStore(
                        o.local_tier, self.checkpoints_root, storage_options=dict(o.storage_options),
                        keep_local=o.keep_local,
                    )
            ckpt = Checkpointer(
                root, max_pending=o.max_pending, checksum=o.checksum, keep_last=keep, io_threads=o.io_threads,
                direct_io=o.direct_io, storage_options=dict(o.storage_options),
                device_staging=o.device_staging, telemetry_jsonl=self._telemetry,
            )
            if isinstance(self._telemetry, str):
                fsops.makedirs(os.path.dirname(os.path.abspath(self._telemetry)), exist_ok=True)
            self._res.checkpointers[kind] = ckpt
        return ckpt

    # ------------------------------------------------------------------ saving
    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> SaveHandle | None:
        """Stage everything ``Accelerator.save_state`` saves and write it in the background.

        Same arguments as ``Accelerator.save_state``; ``output_dir`` may be an fsspec URL.
        Inside a training loop (an optimizer of this Accelerator stepped since the previous
        ``save_state``/``load_state``) it returns once the state is staged; otherwise (and
        unless ``sync_outside_training=False``) it returns only once this process's part is
        committed, and raises a failure of the save there. Returns the save's handle (its ``path`` is the folder; ``result()`` waits for
        its commit), or ``None`` on processes that write no folder and when Accelerate's
        synchronous method ran instead.

        Raises:
            ValueError: no ``output_dir`` without automatic naming; the automatic folder already
                holds a valid checkpoint (as Accelerate refuses too); an FSDP save to a URL or
                over an existing folder.
            CheckpointError: an earlier background save failed; the target cannot be written;
                a save outside training failed to commit.
            UnsupportedObjectError: a state holds something stagesave cannot save.
        """
        if not self.asynchronous:
            self._accelerate_save(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)
            return None
        _, handle = self._save(output_dir, safe_serialization)
        return handle

    def _save(self, output_dir: Any, safe_serialization: bool) -> tuple[str, SaveHandle | None]:
        """Stage the save; wait for its commit unless it sits inside a training loop."""
        in_training = self._training.consume()
        self._used = True
        acc = self.accelerator
        config = acc.project_configuration
        automatic = bool(config.automatic_checkpoint_naming)
        iteration = int(config.iteration)
        if automatic:
            target = self._auto.name(f"{FOLDER_PREFIX}{iteration}")
        elif output_dir is None:
            raise ValueError(
                "save_state needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)"
            )
        else:
            target = _remote.normalize(output_dir)
        if self._fsdp:
            handle = self._save_fsdp(target, automatic, iteration, safe_serialization)
        else:
            handle = self._save_replicated(target, automatic, iteration, safe_serialization)
        config.iteration = iteration + 1
        if not in_training and self.options.sync_outside_training:
            self.wait()  # nothing to overlap it with: return committed (and raise its failure here)
        return target, handle

    def _metadata(self, iteration: int, automatic: bool, safe_serialization: bool, **extra: Any) -> dict[str, Any]:
        acc = self.accelerator
        return {
            METADATA_KEY: {
                "iteration": iteration,
                "step": int(acc.step),
                "num_processes": int(acc.num_processes),
                "safe_serialization": bool(safe_serialization),
                "automatic_checkpoint_naming": automatic,
                **extra,
            }
        }

    def _rng_states(self) -> dict[int, Any]:
        acc = self.accelerator
        return _dist.gather_to_writers(
            collect_rng_state(int(acc.step)), int(acc.process_index), int(acc.num_processes),
            bool(acc.project_configuration.save_on_each_node),
        )

    def _save_replicated(self, target: str, automatic: bool, iteration: int, safe: bool) -> SaveHandle | None:
        """Every file comes from the writing process; the others contribute their RNG state."""
        acc = self.accelerator
        weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
        with run_save_hooks(acc, weights, _remote.leaf(target)) as hook_files:
            rng_states = self._rng_states()
            if not self._writes():
                return None
            ckpt = self._checkpointer("auto" if automatic else "plain")
            if automatic:
                self._refuse_existing(ckpt, target, iteration)
            elif not _remote.is_url(target):
                fsops.makedirs(os.path.dirname(target), exist_ok=True)
            files = {**hook_files, **state_files(acc, weights, safe, rng_states)}
            # assembled under a dot-name beside the target, renamed into place by the commit
            handle = ckpt.save_dir(files, target, metadata=self._metadata(iteration, automatic, safe))
        self.last_handle = handle
        return handle

    def _save_fsdp(self, target: str, automatic: bool, iteration: int, safe: bool) -> SaveHandle | None:
        """Every rank stages its shards (DCP parts); the main process the other files.

        Rank 0 checks the target and names the work folder first and tells everyone, so that
        a refused save raises on every rank before any collective of ``dcp.save``.
        """
        acc = self.accelerator
        world, rank = int(acc.num_processes), int(acc.process_index)
        t0 = time.perf_counter()
        leaf = _remote.leaf(target)
        decision: tuple[tuple[str, bool] | None, BaseException | None] = (None, None)
        if rank == 0:
            try:
                decision = (self._fsdp_work_folder(target, automatic, iteration), None)
            except Exception as exc:  # noqa: BLE001 - every process raises the same error below
                decision = (None, exc)
        plan, error = _dist.broadcast_from_main(decision, world)
        if error is not None:
            raise error
        assert plan is not None
        work, replace_invalid = plan
        ckpt = self._checkpointer("fsdp")
        writer = self._res.writer
        if writer is None:
            from stagesave.dcp import StagedStorageWriter  # only FSDP runs need torch's DCP

            writer = self._res.writer = StagedStorageWriter(checkpointer=ckpt)
        parts = _fsdp.part_names(acc)
        folder = f"{work}/folder/{leaf}"
        timeout = writer.commit_timeout
        handles: list[SaveHandle] = []
        try:
            handles = _fsdp.save_parts(acc, writer, f"{work}/parts")
            with run_save_hooks(acc, [], leaf) as hook_files:
                rng_states = self._rng_states()
                if rank == 0:
                    files = {**hook_files, **state_files(acc, [], safe, rng_states, optimizers=False)}
                    meta = self._metadata(iteration, automatic, safe, fsdp={
                        "parts": parts, "state_dict_type": "SHARDED_STATE_DICT",
                        "fsdp_version": int(acc.state.fsdp_plugin.fsdp_version)})
                    handles.append(ckpt.save_dir(files, folder, metadata=meta, nested=parts))
        except BaseException as failure:
            # Nothing will be published; the work folder goes once every rank is done with it.
            if rank == 0:
                ckpt.run_after(functools.partial(discard, work, world, timeout), description=f"discarding {work}")
            else:
                ckpt.run_after(functools.partial(write_ack, work, rank, failure), description=f"acknowledging {work}")
            raise
        if rank != 0:
            ckpt.run_after(lambda: write_ack(work, rank, first_error(handles)), description=f"acknowledging {work}")
            return None
        assembly = Assembly(work, folder, [(f"{work}/parts/{p}", p) for p in parts], handles, target,
                            replace_invalid, world, timeout)
        # retention's numbers are read here: the writer thread never touches the Accelerator
        keep, root = (acc.project_configuration.total_limit, self._auto.root) if automatic else (None, "")
        handle = ckpt.run_after(lambda: publish(assembly, lambda: keep_newest(root, keep)), description=target)
        handle.telemetry.blocking_s = time.perf_counter() - t0
        handle.telemetry.bytes = sum(h.telemetry.bytes for h in handles)
        self.last_handle = handle
        return handle

    def _fsdp_work_folder(self, target: str, automatic: bool, iteration: int) -> tuple[str, bool]:
        """On rank 0: refuse what cannot be saved, create the work folder; ``(work, replace_invalid)``.

        Raises:
            ValueError: a URL target; a valid checkpoint or a plain folder at an automatic
                target; any existing folder at an explicit target.
        """
        if _remote.is_url(target):
            raise ValueError(f"FSDP checkpoints through stagesave need a local folder, got {target}")
        replace_invalid = False
        if automatic:
            replace_invalid = self._refuse_existing(self._checkpointer("fsdp"), target, iteration)
        elif os.path.lexists(target):
            raise ValueError(
                f"{target} already exists: stagesave publishes an FSDP checkpoint by renaming it into "
                "place and does not replace existing folders; remove it or save to a new folder"
            )
        # beside the target (the core's temporary name for it), so publishing is one rename
        base = os.path.dirname(target)
        fsops.makedirs(base, exist_ok=True)
        work = os.path.join(base, f".{_remote.leaf(target)}.{os.getpid()}-{secrets.token_hex(4)}{_TMP}")
        for sub in ("parts", "folder", "acks"):
            fsops.makedirs(os.path.join(work, sub))
        return work, replace_invalid

    def _refuse_existing(self, ckpt: Checkpointer, target: str, iteration: int) -> bool:
        """Accelerate's rule for automatic names, with torn folders replaced instead of fatal.

        Returns whether an invalid checkpoint is there (to be replaced). A folder whose files
        carry no stagesave proof may be Accelerate's own (local); at a URL only a crashed
        stagesave save leaves one (its carrier, the object written last, never came).

        Raises:
            ValueError: a valid checkpoint, or a plain local folder stagesave cannot prove, is
                already at ``target``.
        """
        local = self._auto.local_folder(_remote.leaf(target))
        if local is not None and not os.path.lexists(local):
            return False
        try:
            info = ckpt.verify(target)
        except FileNotFoundError:
            return False
        if info.valid and info.manifest is not None and local is not None:
            problems = parts_problems(ckpt, local, info, verify=True)  # an FSDP folder's DCP parts
            if problems:
                info.status, info.problems = "corrupt", problems
        refuse = (
            f"Checkpoint directory {local or target} ({iteration}) already exists. Please manually override "
            "`self.save_iteration` with what iteration to start with."
        )
        if info.valid and info.manifest is not None:
            raise ValueError(refuse)
        if info.status == "unverified" and local is not None:
            raise ValueError(f"{refuse} (It has no stagesave proof, so stagesave does not replace it.)")
        problem = "; ".join(info.problems) or "incomplete"
        warnings.warn(f"stagesave: replacing the invalid checkpoint {local or target} ({problem})", stacklevel=6)
        return True

    # ------------------------------------------------------------------ loading
    def load_state(
        self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> str | None:
        """Restore from ``input_dir``, or under automatic naming from the newest valid checkpoint.

        Waits for this process's pending saves first. The checkpoint is proven against the
        proofs its files carry (every byte when ``verify_on_load``; a file they do not list
        makes it corrupt) and then read by Accelerate's own ``load_state``, which may read only
        the files the proof lists and unpickles them with stagesave's safe unpickler (the full
        one with the ``trusted`` option). Under automatic naming ``ProjectConfiguration.iteration`` continues after
        the loaded checkpoint. Returns the folder loaded (``None`` on the synchronous path).

        Raises:
            ValueError: ``input_dir`` does not exist, or no ``input_dir`` without automatic naming.
            CheckpointNotFoundError: automatic naming found no checkpoint at all.
            IntegrityError: the named checkpoint is corrupt (automatic naming skips such ones),
                or holds a file its proof does not list.
            UnsafeCheckpointError: a file needs a class that is not allow-listed (the state read
                before it is already restored).
            CheckpointError: a pending background save failed.
        """
        if not self.asynchronous:
            with guarded(os.fspath(input_dir or ""), None, self.options.trusted):
                self._accelerate_load(input_dir, load_kwargs, **load_model_func_kwargs)
            return None
        self._training.consume()  # a save after a load (and no step) has nothing to overlap
        self._used = True
        acc = self.accelerator
        world = int(acc.num_processes)
        self.wait()
        _dist.barrier(world)  # every writer's saves are committed before anyone chooses
        chosen: tuple[LoadPlan | None, BaseException | None] = (None, None)
        if int(acc.process_index) == 0:
            try:
                chosen = (self._plan(input_dir), None)
            except Exception as exc:  # noqa: BLE001 - every process raises the same error below
                chosen = (None, exc)
        received: tuple[LoadPlan | None, BaseException | None] = _dist.broadcast_from_main(chosen, world)
        plan, error = received
        if error is not None:
            raise error
        assert plan is not None
        local, own_copy = plan.local, None
        if plan.remote:
            if os.path.isdir(local):  # rank 0's copy, on this host
                own_copy = local if int(acc.process_index) == 0 else None
            else:  # another host: fetch this host's own copy
                local = own_copy = _remote.download_folder(plan.folder, self.options.storage_options)
        try:
            with guarded(local, plan.names, self.options.trusted):
                if self._fsdp:
                    self._load_fsdp(local, load_kwargs, **load_model_func_kwargs)
                else:
                    self._accelerate_load(local, load_kwargs, **load_model_func_kwargs)
            _dist.barrier(world)  # nobody removes a copy another process still reads
        finally:
            if own_copy is not None:
                discard_copy(own_copy)
        config = acc.project_configuration
        if plan.iteration is not None and (config.automatic_checkpoint_naming or plan.from_proof):
            config.iteration = plan.iteration + 1
        return plan.folder

    def _load_fsdp(self, local: str, load_kwargs: dict[str, Any] | None, **kwargs: Any) -> None:
        """The DCP parts through stagesave's reader, the rest through Accelerate's ``load_state``.

        Accelerate's own method is called with no models and optimizers registered for its
        duration (exactly what it loads through ``load_fsdp_model``/``load_fsdp_optimizer``);
        under FSDP its hooks receive an empty model list either way.
        """
        acc = self.accelerator
        _fsdp.load_parts(acc, local)
        models, optimizers = acc._models, acc._optimizers
        acc._models, acc._optimizers = [], []
        try:
            self._accelerate_load(local, load_kwargs, **kwargs)
        finally:
            acc._models, acc._optimizers = models, optimizers

    def _plan(self, input_dir: str | os.PathLike[str] | None) -> LoadPlan:
        options = self.options
        storage = dict(options.storage_options)
        if input_dir is not None:
            return plan_explicit(self._checkpointer(), input_dir, options.verify_on_load, storage)
        if not self.accelerator.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        auto = self._auto
        return plan_newest(self._checkpointer("auto"), auto.list_arg, options.verify_on_load, storage,
                           lambda info: auto.folder_of(info, self._tier_of(info)), auto.plain_root)

    def _tier_of(self, info: CheckpointInfo) -> str | None:
        """The tier the tiered store reads a listed folder from (``None`` without a local tier).

        Asked with the name of the file that proves the folder (format 2: its carrier; format 1:
        its ``checkpoint.stagesave.json``): ``CheckpointInfo.tier`` reads ``"local"`` for every
        folder directly in a tiered root (the store routes folders by a file inside them).
        """
        tiered = self._res.tiered
        if tiered is None:
            return None
        m = info.manifest
        name = f"{info.name}/{m.folder.carrier}" if m is not None and m.folder is not None else info.manifest_name
        return str(tiered.tier_of(name or info.name))

    # ------------------------------------------------------------------ finding, waiting
    def latest(self) -> CheckpointInfo | None:
        """The newest valid checkpoint folder under automatic naming (``None`` if none).

        With ``local_tier``, its ``tier`` says which copy a resume reads (``"local"``/``"remote"``).
        """
        root = self._auto.list_arg
        ckpt = self._checkpointer("auto")
        # Warns about torn or invalid folders (proofs only, no byte read); repairs nothing: a
        # folder left aside by a crash is listed where it lies.
        ckpt.latest(root, verify=False)
        found = next((c for c in ckpt.list(root) if c.is_dir and c.valid), None)
        if found is not None and self._res.tiered is not None:
            found.tier = self._tier_of(found)
        return found

    def pending(self) -> int:
        """Saves of this process not committed (or, under FSDP, not published) yet."""
        return self._res.pending()

    def wait(self, timeout: float | None = None) -> None:
        """Block until this process's saves are committed (and FSDP checkpoints published).

        Uploads to the remote tier keep running; :meth:`wait_uploads` waits for those.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointError: a background save failed.
        """
        for ckpt in list(self._res.checkpointers.values()):
            ckpt.wait(timeout)

    def wait_uploads(self, timeout: float | None = None) -> list[SaveTelemetry]:
        """With ``local_tier``: wait until every committed checkpoint was uploaded (or failed).

        Returns the upload records since the last call (``error`` set on failed uploads, which
        are retried after the next save). Without a local tier there is nothing to wait for.

        Raises:
            TimeoutError: uploads still running after ``timeout`` seconds.
        """
        self.wait(timeout)
        tiered = self._res.tiered
        return tiered.wait_uploads(timeout) if tiered is not None else []

    def close(self, timeout: float | None = None) -> None:
        """Finish pending saves (and uploads), end the threads and free the staging buffers.

        Safe to call more than once; a later save or load creates them again. ``enable()`` calls
        it from ``end_training()``, ``free_memory()``/``clear()`` and ``disable()``; a garbage
        collected Accelerator (or checkpointer) is released the same way.

        Raises:
            TimeoutError: saves still running after ``timeout`` seconds (not committed).
            CheckpointError: a background save failed.
        """
        self._res.close(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ installed methods
    def _installed_save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> Path | str:
        """``Accelerator.save_state`` replacement: returns the folder, like Accelerate."""
        if not self.asynchronous:
            result: Path | str = self._accelerate_save(
                output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs
            )
            return result
        target, _ = self._save(output_dir, safe_serialization)
        acc = self.accelerator
        if output_dir is not None and not acc.project_configuration.automatic_checkpoint_naming:
            return target if _remote.is_url(target) else Path(os.fspath(output_dir))  # as given, like Accelerate
        local = self._auto.local_folder(_remote.leaf(target))
        if local is None:
            return target
        if self.options.destination is None:
            return Path(os.path.join(acc.project_dir, CHECKPOINTS_DIR, _remote.leaf(target)))
        return Path(local)

    def _installed_load_state(
        self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> None:
        """``Accelerator.load_state`` replacement (returns ``None``, like Accelerate)."""
        self.load_state(input_dir, load_kwargs, **load_model_func_kwargs)

    def _released_then(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``end_training``/``free_memory``/``clear`` replacement: pending saves are committed and
        stagesave's threads and buffers given back first (``end_training`` then destroys the
        process group, which a flush must not outlive), then Accelerate's own method runs. A
        failed save is raised after Accelerate's method ran, so the run still ends normally."""
        failure: BaseException | None = None
        try:
            self.close()
        except BaseException as exc:  # noqa: BLE001 - raised below, once Accelerate's method ran
            failure = exc
        result = getattr(self._cls, name)(self.accelerator, *args, **kwargs)
        if failure is not None:
            raise failure
        return result
