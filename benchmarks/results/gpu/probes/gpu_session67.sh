#!/usr/bin/env bash
# Session 67's device call: gpu-check, then the fetch kernel's tests on CUDA (not gpu-marked: they
# run on CUDA wherever it is, under the interpreter on CPU).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-300} tools/gpu_host_check.sh --tests-timeout 150
rc=$?
PYTHONPATH="/tmp/site:." timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fetch_pages.py 2>&1 \
    | tail -3 | tee "${OUT:-/tmp}/fetch-kernel-tests.log"
exit $rc
