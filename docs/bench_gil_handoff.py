"""How long a call that releases the GIL waits to get it back while another thread runs Python.

The engine core runs vLLM's scheduler and our worker on one thread and takes requests in on
another (decoding them and hashing their blocks, in Python). Every call of the worker that
releases the GIL (a CUDA call through ctypes, a torch event record or stream wait) must take it
back, and while the other thread runs Python that can take up to the interpreter's switch
interval. This measures it without a GPU: a busy thread hashes pickled 16-token tuples as vLLM's
block hasher does, the main thread calls a trivial C function through ctypes (which releases
the GIL) N times, at each switch interval given.

    python docs/bench_gil_handoff.py [--calls 200] [--switch-ms 5,0.5]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import pickle
import sys
import threading
import time


def busy(stop: threading.Event) -> None:
    block = tuple(range(16))
    i = 0
    while not stop.is_set():
        hashlib.sha256(pickle.dumps((i, block))).digest()
        i += 1


def measure(calls: int, switch_s: float, competing: bool) -> list[float]:
    libc = ctypes.CDLL(None)
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    stop = threading.Event()
    t = threading.Thread(target=busy, args=(stop,), daemon=True)
    if competing:
        t.start()
        time.sleep(0.05)
    waits = []
    try:
        for _ in range(calls):
            a = time.perf_counter()
            libc.getpid()
            waits.append(time.perf_counter() - a)
    finally:
        stop.set()
        if competing:
            t.join()
        sys.setswitchinterval(old)
    return sorted(waits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--switch-ms", default="5,0.5")
    a = ap.parse_args()
    print(f"{'switch ms':>9} {'other thread':>12} {'median ms':>9} {'p90 ms':>7} {'max ms':>7} "
          f"{'sum ms':>7}")
    for ms in (float(x) for x in a.switch_ms.split(",")):
        for competing in (False, True):
            w = measure(a.calls, ms / 1000, competing)
            print(f"{ms:9.2f} {'busy' if competing else 'idle':>12} {w[len(w) // 2] * 1e3:9.3f} "
                  f"{w[int(len(w) * 0.9)] * 1e3:7.3f} {w[-1] * 1e3:7.3f} {sum(w) * 1e3:7.1f}")


if __name__ == "__main__":
    main()
