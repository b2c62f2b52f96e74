"""The on-disk format, defined once (internal): names, the proof (its data model, the checks of
its untrusted fields, its parsers; ``manifest`` re-exports them), checksums, the torch zip
container and signatures. See ``docs/format.md``.
"""
