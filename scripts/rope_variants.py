"""Development aid: the two vectorised RoPE backward kernels (2 and 8 elements per thread) on the 16
workloads, next to a device copy of the same bytes, plus the host cost of a launch."""
import cupy
import numpy as np

import cupy_rope as cr
from cupy_rope import rope
from cupy_rope._bench import Timer, copy_us, empty_kernel_us
from cupy_rope._kernels import launcher
from cupy_rope.bench_rope import _inputs
from cupy_rope.workloads import ROPE_CASES

timer = Timer()
rng = cupy.random.default_rng(0)
print(f"empty kernel {empty_kernel_us(timer):.2f} us")
for b, s in ROPE_CASES:
    gc, gs, th = _inputs(b, s, rng)
    out = cupy.empty(th.shape, np.float32)
    res = {}
    for name, thr in (("vec2", 1 << 62), ("vec8", -1)):
        rope.VEC2_MAX_ELEMENTS = thr
        res[name] = timer.gpu_us(lambda: cr.rope_2d_backward(gc, gs, th, out=out), reps=100)
    res["copy"] = copy_us(timer, 6 * th.size, reps=50)
    print(f"{b:3d} x {s:5d}  n={th.size:9d}  " + "  ".join(f"{k} {v:7.2f}" for k, v in res.items()), flush=True)


def host(fn):
    return timer.host_us(fn, n=3000, loops=3)


rope.VEC2_MAX_ELEMENTS = 1 << 23  # the default again
from cupy_backends.cuda.api import driver  # noqa: E402

st = cupy.cuda.get_current_stream().ptr
ek = launcher("util", "empty_kernel", "")
gc, gs, th = _inputs(2, 256, rng)
out = cupy.empty(th.shape, np.float32)
for i in range(2):
    print("host us: driver empty %.2f  launcher empty %.2f  rope out= %.2f  rope alloc %.2f" % (
        host(lambda: driver.launchKernel(ek._ptr, 1, 1, 1, 32, 1, 1, 0, st, ek._params_addr, 0)),
        host(lambda: ek((1, 1, 1), (32, 1, 1), (), st)),
        host(lambda: cr.rope_2d_backward(gc, gs, th, out=out)),
        host(lambda: cr.rope_2d_backward(gc, gs, th))), flush=True)
