"""deltafleet: serve a family of fine-tuned LLM variants from one resident base and 1-bit BitDelta deltas.

One namespace over the checkout's job folders: ``deltafleet.train`` (train/: data, tokenizer,
Lightning fine-tuning, evaluation), ``deltafleet.compress`` (compress/: BitDelta export, scale
distillation, the artifact reader), ``deltafleet.kernels`` (kernels/: the 1-bit delta linear),
``deltafleet.serve`` (serve/: the engine and the OpenAI-compatible server), ``deltafleet.merge``
(merge/: task-vector merges, K-Merge), ``deltafleet.conf`` (conf/: the Hydra configs, shipped as
data). Shared plumbing lives here: ``deltafleet.atomic`` (atomic writes), ``deltafleet.checkpoint``
(the streaming safetensors reader), ``deltafleet.cli`` (the ``deltafleet`` command).
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("deltafleet")
except PackageNotFoundError:  # imported from a checkout that is not installed
    __version__ = "0+unknown"
