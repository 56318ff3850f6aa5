#!/usr/bin/env bash
# The checks a CUDA machine is for, in one run: the gpu tests, bench_gpu.py,
# bench_serve.py --scaling over the machine's cores (one model instance per
# server core), and (step "instances") the MLP with one process instance per
# server core and bench_instances.py at 1 and 4 instances; step
# "connections" repeats the identity model's binary curve with 512
# connections instead of 256 (with 256, four instances' full batches of 64
# hold every request in flight). Each step is bounded in time and writes its
# log under $OUT (default: a new temporary directory); a failing step does
# not stop the next. About 9 minutes on 16 cores.
#
#   bash benches/gpu_check.sh                   # with ferrobatch installed
#   WHEELS=dist bash benches/gpu_check.sh       # installs dist/*.whl first (--no-deps, into $SITE;
#                                               # nvidia-ml-py's wheel there too for the GPU metrics)
#   STEPS=tests,bench bash benches/gpu_check.sh
#
# The scaling steps need wrk, h2load and taskset on PATH. Only the test modules
# that hold gpu tests are collected: they import nothing beyond ferrobatch's
# test dependencies (pytest-asyncio, hypothesis, tritonclient).
set -u
PY=${PY:-python3}
OUT=${OUT:-$(mktemp -d -t gpu-check-XXXXXX)}
STEPS=${STEPS:-tests,bench,scaling,instances,connections}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [[ -n ${WHEELS:-} ]]; then
  SITE=${SITE:-/tmp/ferrobatch-site}
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
$PY -c "import torch, ferrobatch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else '-', 'ferrobatch', ferrobatch.__version__)" \
  2>&1 | tee "$OUT/info.log"
if [[ $STEPS == *tests* ]]; then
  timeout "${TESTS_S:-240}" $PY -m pytest -p no:cacheprovider -m gpu -rA --timeout 150 \
    tests/test_cuda.py tests/test_isolation.py tests/test_weights.py tests/test_ragged.py tests/test_host_metrics.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if [[ $STEPS == *bench* ]]; then
  timeout "${BENCH_S:-150}" $PY benches/python/bench_gpu.py --json "$OUT/gpu.json" 2>&1 | tee "$OUT/bench_gpu.log"
fi
if [[ $STEPS == *scaling* ]]; then
  timeout "${SCALING_S:-300}" $PY benches/python/bench_serve.py --scaling --models identity,mlp \
    --protocols binary,grpc,json --callers 256 --instances "${INSTANCES:-cores}" --runs 1 --seconds 3 --warmup 1 \
    --out "$OUT/serve" 2>&1 | tee "$OUT/scaling.log"
fi
if [[ $STEPS == *instances* ]]; then
  timeout "${INSTANCES_S:-200}" $PY benches/python/bench_serve.py --scaling --models mlp --protocols binary \
    --callers 256 --instances cores --instance-kind process --runs 1 --seconds 3 --warmup 1 \
    --out "$OUT/serve-processes" 2>&1 | tee "$OUT/scaling-processes.log"
  timeout "${INSTANCES_S:-200}" $PY benches/python/bench_instances.py --instances 1,4 --runs 1 --seconds 3 \
    2>&1 | tee "$OUT/instances.log"
fi
if [[ $STEPS == *connections* ]]; then
  timeout "${CONNECTIONS_S:-90}" $PY benches/python/bench_serve.py --scaling --models identity --protocols binary \
    --callers 512 --instances cores --runs 1 --seconds 3 --warmup 1 \
    --out "$OUT/serve-512" 2>&1 | tee "$OUT/scaling-512.log"
fi
echo "logs and results: $OUT"
