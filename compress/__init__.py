"""BitDelta export (``deltafleet.compress.run``) and the artifact reader the server imports.

See ``deltafleet.compress.bitdelta`` and docs/artifact.md (the format, version 1).
"""
from deltafleet.compress.bitdelta import (
    Artifact,
    ArtifactError,
    FingerprintMismatchError,
    compress,
    export_hf,
    fingerprint,
    load_artifact,
    materialize,
)

__all__ = [
    "Artifact",
    "ArtifactError",
    "FingerprintMismatchError",
    "compress",
    "export_hf",
    "fingerprint",
    "load_artifact",
    "materialize",
]
