#!/bin/bash
# usage: run_server.sh NAME PORT [extra args...]  -> starts server in own process group, pid in /tmp/lora81/NAME.pid
NAME=$1; PORT=$2; shift 2
cd /work/main
PYTHONPATH=/work/main/tests/sglang/lora_shim OMP_NUM_THREADS=1 setsid .venv/bin/python -m sglang.launch_server --model-path /tmp/lora81/model \
  --device cpu --attention-backend torch_native --disable-cuda-graph --skip-server-warmup \
  --max-total-tokens 4096 --mem-fraction-static 0.05 --random-seed 0 --sleep-on-idle \
  --port $PORT --enable-lora --lora-backend torch_native \
  --lora-paths A=/tmp/lora81/loraA B=/tmp/lora81/loraB --max-loras-per-batch 3 \
  "$@" > /tmp/lora81/$NAME.log 2>&1 &
echo $! > /tmp/lora81/$NAME.pid
echo started pid $(cat /tmp/lora81/$NAME.pid)
