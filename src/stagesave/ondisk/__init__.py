"""The on-disk format, defined once (internal): names, the manifest, checksums, the torch zip
container and signatures. See ``docs/format.md``.
"""
