"""In-situ call timer (kvplane session 42 probe): wraps a few methods of a running SGLang scheduler
and accumulates calls, wall and thread-CPU seconds; SIGUSR2 writes them to $KVPROF_DIR/<pid>.json.
Loaded through PYTHONPATH (sitecustomize), so the server runs unmodified otherwise."""
import os

_d = os.environ.get("KVPROF_DIR")
if _d:
    import functools
    import json
    import signal
    import sys
    import threading
    import time
    ACC = {}
    TARGETS = {  # module -> (class, method): the KV write each server makes per layer
        "sglang.srt.mem_cache.memory_pool": [("MHATokenToKVPool", "set_kv_buffer")],
        "sglang_ext.layered_attention": [("_LayeredKV", "set_kv_buffer")],
    }
    def wrap(cls, name):
        f = cls.__dict__[name]
        key = f"{cls.__name__}.{name}"
        @functools.wraps(f)
        def w(*a, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return f(*a, **k)
            finally:
                e = ACC.setdefault(key, [0, 0.0, 0.0])
                e[0] += 1
                e[1] += time.perf_counter() - t
                e[2] += time.thread_time() - c
        setattr(cls, name, w)
    def patcher():
        done = set()
        while len(done) < len(TARGETS):
            for mod, items in TARGETS.items():
                m = sys.modules.get(mod)
                if mod in done or m is None or not all(hasattr(m, c) for c, _ in items):
                    continue
                for c, n in items:
                    wrap(getattr(m, c), n)
                done.add(mod)
            time.sleep(0.05)
    threading.Thread(target=patcher, daemon=True).start()
    def _dump(*_):
        with open(os.path.join(_d, f"{os.getpid()}.json"), "w") as fh:
            json.dump(ACC, fh)
    signal.signal(signal.SIGUSR2, _dump)
