#!/usr/bin/env bash
# `kvplane gpu-check` on a lent GPU host (README "GPU check"): run from the repository root with
# `.whl/` carried (`make gpu-wheels` fills it here). Installs the wheels the host lacks into
# /tmp/site, runs the check with a deadline under the host's command limit, and leaves the JSON,
# the Markdown and the log in $OUT (the device tool brings $OUT back).
#
#   tools/gpu_host_check.sh                 # --deadline-s 420 (a 480-600 s command limit)
#   DEADLINE_S=300 tools/gpu_host_check.sh --skip-tests
#
# Extra arguments go to gpu-check. Exit status: gpu-check's (3: the wheels did not install).
set -uo pipefail
out=${OUT:-/tmp/kvplane-gpu-check}
mkdir -p "$out"
shopt -s nullglob
wheels=("${WHEELS_DIR:-.whl}"/*.whl)
if ((${#wheels[@]})); then
    ${PYTHON:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${wheels[@]}" || { echo "gpu_host_check: wheel install failed" >&2; exit 3; }
fi
export PYTHONPATH="/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A host's `timeout` sends SIGTERM to the whole process group: this shell and tee ignore it (tee
# keeps the log's pipe open, the shell waits), gpu-check stops and writes its report.
trap '' TERM
${PYTHON:-python3} -m kvplane.cli gpu-check --deadline-s "${DEADLINE_S:-420}" --out-dir "$out" "$@" 2>&1 \
    | tee "$out/gpu-check.log"
exit "${PIPESTATUS[0]}"
