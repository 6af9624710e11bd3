#!/usr/bin/env bash
# The CUDA tests and the GPU benchmarks in one run, for a machine with a CUDA GPU and torch,
# triton and pytest-xdist installed (the project is installed from this checkout, editable,
# without its dependencies: nothing is downloaded).
# Run from the repository root:  OUT=gpu_out bash scripts/gpu_checks.sh
# Every step has its own time limit (seconds; SIGINT) so that one that hangs does not take
# the rest;
# each step's output goes to $OUT/all.log, the benchmarks' JSON beside it.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export FEWBIT_CACHE_DIR=${FEWBIT_CACHE_DIR:-/tmp/fewbit-gpu-cache}
LOG="$OUT/all.log"
START=$(date +%s)

step() {
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    echo "=== $name (limit ${limit} s): $*" | tee -a "$LOG"
    timeout -s INT -k 10 "$limit" "$@" >> "$LOG" 2>&1
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
# numba's CPU kernels (the CPU side of the CUDA-against-CPU tests) compiled once, before the
# workers start: twelve workers compiling them at once took over 60 s each on an H100 machine
step numba 240 python3 -c "import torch, fewbit.ops, fewbit.quant as q; fewbit.ops.load_cpu_kernels(); \
q.quantize(torch.randn(4096), 4).dequantize()"
# pytest-timeout ends a stuck test; the step's own limit is a last resort (an interrupted
# xdist run prints no summary)
step tests "${LIMIT_TESTS:-600}" python3 -m pytest -q -p no:cacheprovider -n 12 -k "cuda or triton" \
    --timeout 150 -rfE --tb=short --ignore=tests/test_notebooks.py tests
step bench_eager "${LIMIT_EAGER:-110}" python3 scripts/bench_activations.py --device cuda \
    --activations gelu silu --dtypes float32 bfloat16 float16 --sizes 16 20 24 26 28 --mode all \
    --repeat 10 --no-compile --json "$OUT/bench_eager.json"
step profile_host 60 python3 scripts/profile_host.py --device cuda --activation gelu --mode full --calls 300
step bench_model "${LIMIT_MODEL:-70}" python3 scripts/bench_model.py --device cuda --dtype bfloat16 \
    --width 2048 --layers 8 --tokens 16384 --json "$OUT/bench_model.json"
step train_lm "${LIMIT_TRAIN:-60}" python3 scripts/train_lm.py --device cuda \
    --variants vanilla fewbit3 fewbit3+quant2 --seeds 0 --steps 600 --eval-every 100 --out "$OUT/train"
step bench_compile "${LIMIT_COMPILE:-80}" python3 scripts/bench_activations.py --device cuda \
    --activations gelu --dtypes float32 bfloat16 --sizes 26 --mode all --repeat 10 --no-host \
    --json "$OUT/bench_compile.json"
step bench_quant "${LIMIT_QUANT:-45}" python3 scripts/bench_quant.py --device cuda \
    --sizes 16777216 67108864 --models gpt2 --gpt2-layers 4 --gpt2-embd 768 --gpt2-heads 12 \
    --seq 512 --batch 8 --vocab 8192
echo "=== total $(( $(date +%s) - START )) s" | tee -a "$LOG"
grep -E "^(FAILED|ERROR)|passed|failed" "$LOG" | tail -n 40
