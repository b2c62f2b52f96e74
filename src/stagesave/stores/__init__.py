"""Where checkpoints live: one small interface (``base``) and its backends (internal).

``posix`` is the one seam through which every mutating filesystem call of the product passes
(the power-loss recorder of the tests sees them all); ``local`` (its writes in ``local_write``),
``fsspec``, ``s3`` (its multipart engine in ``s3_upload``, every request in ``s3_requests``) and
``tiered`` (reads routed by ``tier_route``; its uploads are ``saving/upload``) are the stores;
``targets`` maps a user's path or URL to a store.
"""
