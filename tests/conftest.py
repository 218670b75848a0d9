"""Suite-wide settings: hypothesis never fails a test for being slow (CI is a loaded 2-core host;
speed is measured by `kvplane bench`, not by tests); the processes tests start (SGLang servers,
tools) run torch on one OpenMP thread unless the environment says otherwise.

Why one thread: on this 2-core host a tiny-model SGLang server with torch's default two OpenMP
threads slows 50-100x as soon as anything else wants a core (OpenMP's spinning workers fight the
other process): the paced-stream e2e test measured 95-180 ms a token beside a ``nice -n 19`` CPU
loop instead of ~1.8 ms, and failed 2 of 5 runs; with ``OMP_NUM_THREADS=1`` it stayed at
1.75-1.84 ms a token and passed 3 of 3 beside the same loop. The tiny models gain nothing from a
second thread, nor do the suite's own in-process tensors (this process reads it too when it
imports torch after this file).
"""

import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("OMP_NUM_THREADS", "1")

settings.register_profile(
    "kvplane", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("kvplane")
