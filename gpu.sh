#!/usr/bin/env bash
# scratch: device runs (not committed)
export PYTHONUNBUFFERED=1
stage=$1
cd "$(dirname "$0")"
log() { echo "=== $(date +%T) $*"; }
if [ "$stage" = smoke ] || [ "$stage" = all ]; then
  log smoke
  nvidia-smi --query-gpu=name,memory.used --format=csv
  python3 -c "import torch, sys; print(torch.__version__, sys.version)"
  timeout 120 python3 decode.py --device cuda --method ar --max-new-tokens 64 --check 2>&1 | tail -4
  timeout 120 python3 decode.py --device cuda --method hidden_transfer --max-new-tokens 64 --check 2>&1 | tail -4
  timeout 120 python3 decode.py --device cuda --method propd --max-new-tokens 64 --check 2>&1 | tail -4
fi
if [ "$stage" = tests ] || [ "$stage" = all ]; then
  log tests
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest --device cuda -n 8 -q -p no:cacheprovider --durations=25 2>&1 | tee $OUT/tests.log | tail -60
fi
if [ "$stage" = quickbench ] || [ "$stage" = all ]; then
  log quickbench
  for dt in float32 bfloat16; do
    timeout 200 python3 decode.py --bench --device cuda --dtype $dt --mode exact --limit ${LIMIT:-6} \
      --methods ar,lookahead,medusa,propd,bita,hidden_transfer 2>&1 | grep -v "^\[bench\] prompt" | tee -a $OUT/quickbench.log
  done
fi
log done
