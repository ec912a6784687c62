"""The precision modes of the attention kernels, named once.

The CUDA sources never write a mode as an integer: every attention compile gets the preprocessor defines of
:func:`compile_defines` (``-DMODE_FP32=0`` ...), generated from this enum, so the values the Python side passes
around and the template arguments the kernels are instantiated with come from one table. ``kernels_cu/
attention/config.cuh`` refuses to compile without them.
"""
from __future__ import annotations

import enum


class Precision(enum.IntEnum):
    """How the attention products are computed: fp32 exact FFMA, tf32 or bf16 tensor cores (fp32 accumulate)."""

    FP32 = 0
    TF32 = 1
    BF16 = 2

    @classmethod
    def parse(cls, value: "Precision | str") -> "Precision":
        """A :class:`Precision` from itself or its label (``"fp32"``, ``"tf32"``, ``"bf16"``, lower case)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            p = _BY_LABEL.get(value)
            if p is None:
                raise ValueError(f"precision must be one of {PRECISIONS}, got {value!r}")
            return p
        raise TypeError(f"precision must be a Precision or one of {PRECISIONS}, got {type(value).__name__}")

    @property
    def label(self) -> str:
        """The lower-case name used in kernel names (``attn_fwd_dq_tf32``) and on the command line."""
        return self.name.lower()


PRECISIONS = tuple(p.label for p in Precision)
_BY_LABEL = {p.label: p for p in Precision}


def compile_defines() -> tuple[str, ...]:
    """NVRTC options defining ``MODE_<NAME>`` for every mode, in enum order."""
    return tuple(f"-DMODE_{p.name}={int(p)}" for p in Precision)
