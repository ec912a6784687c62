#!/usr/bin/env bash
# Why are the attention kernels as slow as they are? Warp stall reasons, pipe utilisation and shared-memory
# traffic of the attention kernels (Nsight Compute, clocks left alone) for one backward of T tokens in N
# sequences at one precision, with optional plan overrides (see ncu_case.py).
# Usage: dev/ncu_stalls.sh T N PRECISION [FIELD=VALUE ...]
set -euo pipefail
t=${1:?T} n=${2:?N} prec=${3:?precision}
shift 3
here=$(dirname "${BASH_SOURCE[0]}")
metrics="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
metrics+=",gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active"
metrics+=",sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
metrics+=",sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"
metrics+=",sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active"
metrics+=",l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum"
metrics+=",smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active"
metrics+=",l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed"
# the first call's attention kernels: forward (fwd_dq or fwd_stats) and dK/dV (dkdv or dkdv_dqp)
ncu --clock-control none --kernel-name regex:'attn_(fwd|dkdv)' --launch-count 2 --metrics "$metrics" --csv \
  python3 "$here/ncu_case.py" "$t" "$n" "$prec" "$@" 2>/dev/null | python3 -c '
import csv, sys
rows = [r for r in csv.reader(l for l in sys.stdin if l.startswith("\""))]
head, rows = rows[0], rows[1:]
k, m, v = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
for r in rows:
    name = r[m].replace("smsp__average_warps_issue_stalled_", "stall_").replace("_per_issue_active.ratio", "")
    try:
        val = float(r[v].replace(",", ""))
    except ValueError:
        continue
    if name.startswith("stall_") and val < 0.05:
        continue
    print(f"{r[k][:22]:22s} {name:70s} {val:14.3f}")
'
