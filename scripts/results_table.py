"""Render the README's measured tables from the committed bench/results/*.json (python scripts/results_table.py)."""
import json
import math
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "bench", "results")


def load(name):
    path = os.path.join(ROOT, name)
    return json.load(open(path)) if os.path.exists(path) else None


def rope_table(d):
    peers = list(d["cases"][0]["peers_us"])
    out = [f"Device {d['device']}; copy rate {d['ceilings']['copy_TBps']:.2f} TB/s and empty-kernel launch "
           f"{d['ceilings']['empty_kernel_gpu_us']:.2f} µs, both measured in the same run.", "",
           "| batch × seq × 128 | GPU µs | host µs | floor µs | copy of same bytes µs | TB/s | % of copy rate | "
           + " | ".join(f"{p} µs (×)" for p in peers) + " | max rel. error |",
           "|---|---|---|---|---|---|---|" + "---|" * len(peers) + "---|"]
    for c in d["cases"]:
        b, s, _ = c["shape"]
        ps = " | ".join(f"{c['peers_us'][p]:.1f} ({c['peers_us'][p] / c['gpu_us']:.1f}×)" for p in peers)
        out.append(f"| {b} × {s} | {c['gpu_us']:.2f} | {c['host_us']:.1f} | {c['floor_us']:.2f} | "
                   f"{c['copy_same_bytes_us']:.2f} | {c['achieved_TBps']:.2f} | {100 * c['fraction_of_copy_rate']:.0f}% | {ps} | {c['max_rel_error']:.1e} |")
    geo = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    pm = " | ".join(f"{sum(c['peers_us'][p] for c in d['cases']) / len(d['cases']):.1f}" for p in peers)
    out.append(f"| **mean** | **{d['mean_gpu_us']:.2f}** | | | | | | {pm} | |")
    out.append(f"| **geomean** | **{d['geomean_gpu_us']:.2f}** | | | | | | "
               + " | ".join(f"{geo([c['peers_us'][p] for c in d['cases']]):.1f}" for p in peers) + " | |")
    out += ["", f"Geometric mean of GPU time / floor: {d['geomean_gpu_over_floor']:.3f}; of GPU time / a device "
            f"copy of the same bytes (timed the same way): {d['geomean_gpu_over_copy_same_bytes']:.3f}."]
    return "\n".join(out)


def attn_table(d):
    peers = list(d["cases"][0]["peers_us"])
    out = [f"Precision `{d['precision']}`; GEMM ceiling {d['ceilings']['gemm_TFLOPs']:.0f} TFLOP/s (8192³ through the "
           f"same cuBLAS path, the faster of two operand layouts) and copy rate {d['ceilings']['copy_TBps']:.2f} TB/s measured in the same run. "
           "cuBLAS and kernel times are the phases of a directly issued call run on one stream (events between "
           "phases); the timed call overlaps some of them on two streams (tf32, bf16: up to 4096 tokens; fp32: at "
           "every size).", "",
           "| T | seqs | GPU µs | TFLOP/s | floor µs | % of roofline | cuBLAS µs | our kernels µs | peak extra MB | "
           "graph replay | " + " | ".join(f"{p} µs (×)" for p in peers) + " | max rel. error |",
           "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(peers) + "---|"]
    for c in d["cases"]:
        t, n = c["shape"]
        ps = " | ".join(f"{c['peers_us'][p]:.0f} ({c['peers_us'][p] / c['gpu_us']:.1f}×)" for p in peers)
        out.append(f"| {t} | {n} | {c['gpu_us']:.0f} | {c['TFLOPs']:.0f} | {c['floor_us']:.0f} | "
                   f"{100 * c['fraction_of_roofline']:.0f}% | {c['cublas_us']:.0f} | {c['kernels_us']:.0f} | "
                   f"{c['peak_extra_MB']:.0f} | {'yes' if c.get('graph_replay') else 'no'} | "
                   f"{ps}{' | ' if peers else ''}{c['max_rel_error']:.1e} |")
    n = len(d["cases"])
    pm = " | ".join(f"{sum(c['peers_us'][p] for c in d['cases']) / n:.0f}" for p in peers)
    floor = sum(c["floor_us"] for c in d["cases"]) / n
    out.append(f"| **mean** | | **{d['mean_gpu_us']:.0f}** | | {floor:.0f} | | | | | | {pm}{' | ' if peers else ''} |")
    return "\n".join(out)


def errors_table(ds):
    outs = ("grad_hidden_states", "grad_qkv_weight", "grad_qkv_bias", "grad_proj_weight", "grad_proj_bias")
    lines = ["| precision | bound | " + " | ".join(f"`{o}`" for o in outs) + " |", "|---|---|" + "---|" * len(outs)]
    bounds = {"fp32": "1e-5", "tf32": "5e-3", "bf16": "2e-2"}
    for d in ds:
        worst = {o: max(c["rel_errors"][o] for c in d["cases"]) for o in outs}
        lines.append(f"| `{d['precision']}` | {bounds[d['precision']]} | "
                     + " | ".join(f"{worst[o]:.1e}" for o in outs) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    r = load("rope_2d_backward.json")
    if r:
        print("### rope_2d_backward\n\n" + rope_table(r) + "\n")
    ds = [d for d in (load(f"vision_attention_backward_{p}.json") for p in ("tf32", "bf16", "fp32")) if d]
    for d in ds:
        print(f"### vision_attention_backward, {d['precision']}\n\n" + attn_table(d) + "\n")
    if ds:
        print("### Worst relative error per output over the 16 workloads\n\n" + errors_table(ds))
    sys.exit(0)
