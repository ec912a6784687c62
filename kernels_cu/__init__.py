"""CUDA sources of cupy_rope (``*.cu`` / ``*.cuh``), compiled at run time by NVRTC."""
