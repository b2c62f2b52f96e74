"""stagesave for Hugging Face Accelerate (``pip install 'stagesave[accelerate]'``).

One line makes the user's unchanged ``accelerator.save_state()`` inside the training loop return
after one copy into host memory (outside training, with no optimizer step since the previous save
or load, it returns committed), ``accelerator.load_state()`` resume from the newest valid
checkpoint, and ``accelerator.end_training()`` commit what is pending and give stagesave's threads
and buffers back::

    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir="runs/x", automatic_checkpoint_naming=True, total_limit=3))
    stagesave.accelerate.enable(accelerator)

Folders hold exactly Accelerate 1.x's files, names and layout (a plain ``load_state`` reads
them); each torch and safetensors file carries its own stagesave proof inside it, and one of them
also proves the set of files (see docs/format.md); FSDP runs with a sharded state dict save their
DCP folders through ``stagesave.dcp``. ``local_tier=`` puts a local
directory in front of a URL ``destination=``. Without touching methods::

    ckpt = stagesave.accelerate.AcceleratorCheckpointer(accelerator)
    handle = ckpt.save_state()          # a SaveHandle
    ckpt.load_state()

Without code changes: ``accelerate launch ... -m stagesave.accelerate train.py ...``; options
come from ``STAGESAVE_ACCELERATE_*`` environment variables or the YAML file named by
``STAGESAVE_ACCELERATE_CONFIG`` (see docs/accelerate.md).
"""

from __future__ import annotations

try:
    import accelerate as _accelerate  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    from stagesave.errors import MissingExtraError

    raise MissingExtraError(
        "stagesave.accelerate needs Hugging Face Accelerate: pip install 'stagesave[accelerate]'"
    ) from _exc

from ._checkpointer import AcceleratorCheckpointer
from ._config import ENV_CONFIG, ENV_PREFIX, ENV_SWITCH, Options
from ._patch import disable, disable_globally, enable, enable_globally, enabled
from ._roots import STAGING_DIR
from ._support import SynchronousFallbackWarning

__all__ = [
    "ENV_CONFIG",
    "ENV_PREFIX",
    "ENV_SWITCH",
    "STAGING_DIR",
    "AcceleratorCheckpointer",
    "Options",
    "SynchronousFallbackWarning",
    "disable",
    "disable_globally",
    "enable",
    "enable_globally",
    "enabled",
]
