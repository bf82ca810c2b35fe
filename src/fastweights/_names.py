"""Names that the command line offers before it imports torch, each defined here once for the
library and the command line alike: the training settings a resumed run may change, the widths
of token-id files, and FSDP's mixed-precision settings. Imports nothing."""

from __future__ import annotations

__all__ = ["FSDP_MIXED", "RESUMABLE", "TOKEN_DTYPES"]

# TrainConfig fields a resumed run may change (applied and recorded in run.json): when to stop,
# validate and save, checkpoint retention and the anomaly guard. None of them changes what a
# step computes, so a resumed run still reproduces the uninterrupted run's steps.
RESUMABLE = ("steps", "eval_every", "save_every", "keep_last", "patience", "anomaly_guard")

# The widths of the ids in .bin token files (raw little-endian, no header).
TOKEN_DTYPES = ("uint16", "uint32")

# FSDP's mixed-precision settings (``--fsdp-mixed``) -> the torch dtype of parameters in compute.
FSDP_MIXED = {"bf16": "bfloat16"}
