"""Where checkpoints live: one small interface (``base``) and its backends (internal).

``posix`` is the one seam through which every mutating filesystem call of the product passes
(the power-loss recorder of the tests sees them all); ``local``, ``fsspec``, ``s3`` and
``tiered`` are the stores; ``targets`` maps a user's path or URL to a store.
"""
