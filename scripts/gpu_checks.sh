#!/usr/bin/env bash
# The CUDA tests and the GPU benchmarks in one run, for a machine with a CUDA GPU and torch,
# triton and pytest-xdist installed (the project is installed from this checkout, editable,
# without its dependencies: nothing is downloaded).
# Run from the repository root:  OUT=gpu_out bash scripts/gpu_checks.sh
# Every step has its own time limit (seconds; SIGINT) so that one that hangs does not take
# the rest, and the whole run stops at TOTAL_LIMIT seconds (default 540: one call of a lent
# GPU machine, whose device time is short): a step gets what is left of it, and is skipped
# when under 15 s are left. The steps run in order of what is most needed (on an H100 the
# whole run took about 5 minutes). Each step's output goes to $OUT/all.log, the
# benchmarks' JSON beside it.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export FEWBIT_CACHE_DIR=${FEWBIT_CACHE_DIR:-/tmp/fewbit-gpu-cache}
LOG="$OUT/all.log"
START=$(date +%s)
TOTAL=${TOTAL_LIMIT:-540}

step() {
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    local left=$(( TOTAL - (t0 - START) - 5 ))
    if (( left < 15 )); then
        echo "=== $name skipped: ${left} s left of TOTAL_LIMIT=${TOTAL}" | tee -a "$LOG"
        return
    fi
    (( limit > left )) && limit=$left
    echo "=== $name (limit ${limit} s): $*" | tee -a "$LOG"
    timeout -s INT -k 5 "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $(( $(date +%s) - t0 )) s (t=$(( $(date +%s) - START )) s)" | tee -a "$LOG"
}

step env 20 bash -c 'nvidia-smi -L; python3 -c "import torch, triton, numba, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, numba.__version__, transformers.__version__, torch.cuda.get_device_name())"'
step install 40 python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -c "import fewbit.tables, fewbit.solver" 2>/dev/null || {
    echo "=== install failed: fewbit.tables / fewbit.solver linked into the checkout" | tee -a "$LOG"
    ln -sfn ../tables fewbit/tables; ln -sfn ../solver fewbit/solver
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
}
# the host time per eager call first (the figure most needed; seconds)
step profile_host 60 python3 scripts/profile_host.py --device cuda --activation gelu --mode full --calls 300
step profile_host_silu 40 python3 scripts/profile_host.py --device cuda --activation silu --mode forward --calls 300 --top 10
# numba's CPU kernels (the CPU side of the CUDA-against-CPU tests) compiled once, before the
# workers start: twelve workers compiling them at once took over 60 s each on an H100 machine
step numba 120 python3 -c "import torch, fewbit.ops, fewbit.quant as q; fewbit.ops.load_cpu_kernels(); \
q.quantize(torch.randn(4096), 4).dequantize()"
# pytest-timeout ends a stuck test; the step's own limit is a last resort (an interrupted
# xdist run prints no summary)
step tests "${LIMIT_TESTS:-240}" python3 -m pytest -q -p no:cacheprovider -n 12 -k "cuda or triton" \
    --timeout 100 -rfE --tb=short --ignore=tests/test_notebooks.py tests
step bench_eager "${LIMIT_EAGER:-90}" python3 scripts/bench_activations.py --device cuda \
    --activations gelu silu --dtypes float32 bfloat16 float16 --sizes 16 20 24 26 28 --mode all \
    --repeat 10 --no-compile --json "$OUT/bench_eager.json"
step bench_model "${LIMIT_MODEL:-60}" python3 scripts/bench_model.py --device cuda --dtype bfloat16 \
    --width 2048 --layers 8 --tokens 16384 --json "$OUT/bench_model.json"
step bench_compile "${LIMIT_COMPILE:-50}" python3 scripts/bench_activations.py --device cuda \
    --activations gelu --dtypes float32 bfloat16 --sizes 26 --mode all --repeat 10 --no-host \
    --json "$OUT/bench_compile.json"
# the traced Triton path under torch.compile (fewbit.ops._ops.TRITON_DEVICE_TYPES, off by
# default until this passes on a GPU): the compile tests with it turned on for CUDA
step traced_compile "${LIMIT_TRACED:-90}" python3 -c "import sys, pytest, fewbit.ops._ops as o; \
o.TRITON_DEVICE_TYPES.add('cuda'); sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-rfE', \
'--tb=short', '-k', 'compile and cuda', 'tests/ops/test_ops_pointwise.py', 'tests/ops/test_ops_nonfinite.py']))"
step bench_quant "${LIMIT_QUANT:-45}" python3 scripts/bench_quant.py --device cuda \
    --sizes 16777216 67108864 --models gpt2 --gpt2-layers 4 --gpt2-embd 768 --gpt2-heads 12 \
    --seq 512 --batch 8 --vocab 8192
step train_lm "${LIMIT_TRAIN:-60}" python3 scripts/train_lm.py --device cuda \
    --variants vanilla fewbit3 fewbit3+quant2 --seeds 0 --steps 600 --eval-every 100 --out "$OUT/train"
echo "=== total $(( $(date +%s) - START )) s" | tee -a "$LOG"
grep -E "^(FAILED|ERROR)|passed|failed" "$LOG" | tail -n 40
