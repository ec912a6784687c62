"""Objects made once per key and kept: compiled modules, kernel launchers, cuBLAS handles and GEMM plans, the
attention backward's private streams."""
from __future__ import annotations

import threading

_lock = threading.RLock()  # re-entrant: a make() may itself call once() (a launcher compiles its module)


def once(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` the first time (under one lock, so two threads never make the same
    object twice); lookups after that take no lock."""
    value = cache.get(key)
    if value is None:
        with _lock:
            value = cache.get(key)
            if value is None:
                value = cache[key] = make()
    return value
