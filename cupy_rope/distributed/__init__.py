"""Data parallelism for the vision attention backward over several GPUs (NCCL through ``cupyx.distributed``).

* :func:`shard_sequences`: split a varlen batch into per-rank contiguous runs of whole sequences with
  balanced modelled cost (pure NumPy; the same answer on every rank).
* :func:`init` / :func:`shutdown`: join / leave the NCCL process group (one GPU per process).
* :class:`DataParallelBackward`: the backward on this rank's shard, weight and bias gradients summed over
  ranks with all-reduces that overlap the rest of the backward.
* ``python -m cupy_rope.distributed --nproc N {run SCRIPT,bench,selfcheck}``: the launcher.

Nothing here imports CuPy at import time; docs/distributed.md is the guide.
"""
from .data_parallel import DEFAULT_BUCKET_BYTES, OUTPUTS, REDUCED, DataParallelBackward, plan_buckets
from .group import INSTALL_HINT, DistributedError, NCCLUnavailableError, ProcessGroup, current, init, shutdown
from .shard import Shard, sequence_costs, shard_sequences

__all__ = ["Shard", "shard_sequences", "sequence_costs", "init", "shutdown", "current", "ProcessGroup",
           "DataParallelBackward", "DistributedError", "NCCLUnavailableError", "INSTALL_HINT", "OUTPUTS",
           "REDUCED", "plan_buckets", "DEFAULT_BUCKET_BYTES"]
