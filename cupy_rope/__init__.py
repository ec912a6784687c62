"""cupy_rope: fused CUDA kernels for CuPy, proven against float64 references.

* :func:`rope_2d_backward` / :func:`rope_2d_forward`: batched 2D RoPE position encoding (HunyuanImage-3).
* :func:`vision_attention_backward` / :func:`vision_attention_forward`: fused varlen (cu_seqlens) vision
  attention with 2D RoPE (Qwen-VL vision tower), all five gradients.
* :func:`varlen_attention_forward` / :func:`varlen_attention_backward`: varlen flash attention alone.
* :class:`VisionAttentionBackward`: a per-layer handle that replays the backward from a recorded CUDA graph;
  :class:`GraphMemory`: the allocator context for capturing calls into one's own graph.
* :mod:`cupy_rope.distributed`: data-parallel backward over NCCL.
* :mod:`cupy_rope.reference`: NumPy float64 definitions of both ops.
"""
from ._cublas import set_gemm_autotune
from .attention import (GraphMemory, VisionAttentionBackward, varlen_attention_backward, varlen_attention_forward,
                        vision_attention_backward, vision_attention_forward)
from .precision import PRECISIONS, Precision
from .rope import rope_2d_backward, rope_2d_forward

__version__ = "0.2.0"
__all__ = ["rope_2d_backward", "rope_2d_forward", "vision_attention_backward", "vision_attention_forward",
           "varlen_attention_forward", "varlen_attention_backward",
           "VisionAttentionBackward", "GraphMemory", "Precision", "PRECISIONS", "set_gemm_autotune"]
