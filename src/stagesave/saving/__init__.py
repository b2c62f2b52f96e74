"""The path of a save, one module per step in the order they run (internal).

``plan`` lays the file out (``fastplan``/``ziplayout`` without ``torch.save``,
``plan_safetensors`` for safetensors), ``buffers`` owns staging memory, ``stage`` and
``stage_device`` copy the state into it, ``write`` streams the image to a store, ``commit``
publishes it atomically and retires old checkpoints, and ``pipeline`` runs those steps in the
background. The public API is :mod:`stagesave`.
"""
