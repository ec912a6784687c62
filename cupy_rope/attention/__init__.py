"""Fused varlen (cu_seqlens) vision attention with 2D RoPE (Qwen-VL vision tower): backward and forward.

Modules, by what each owns: :mod:`.api` (public functions, validation), :mod:`.flash` (varlen attention alone),
:mod:`.varlen` (sequence facts), :mod:`.hopper` (the sm_90a kernels' launches), :mod:`.plan` (tuning decisions),
:mod:`.kernels` (the kernel contract and launches), :mod:`.schedule` (the launch sequence), :mod:`.streams` (the
second stream), :mod:`.graphs` (recorded replay), :mod:`.profile` (phase timing).
docs/design.md describes how they work together.
"""
from .api import vision_attention_backward, vision_attention_forward
from .flash import varlen_attention_backward, varlen_attention_forward
from .graphs import GraphMemory, VisionAttentionBackward
from .plan import Plan, make_plan
from .profile import profile_split

__all__ = ["vision_attention_backward", "vision_attention_forward", "varlen_attention_forward",
           "varlen_attention_backward", "VisionAttentionBackward", "GraphMemory",
           "Plan", "make_plan", "profile_split"]
