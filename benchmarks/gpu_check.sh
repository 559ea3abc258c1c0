#!/usr/bin/env bash
# One prepared run for a scarce GPU session: versions, GPU tests, op benchmark, model benchmark.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh            # from the repository root
#
# Everything is logged to $OUT/log.txt; CSVs and the JUnit report go to $OUT/. Each
# section runs under `timeout`, capped so the whole script ends within $BUDGET seconds
# (default 450); a failing or timed-out section is reported and the next one runs.
# Without CUDA the same sections run on CPU at CPU sizes (a check of the script).
# Carried wheels in .whl/ (liger-kernel, cut-cross-entropy) are installed to /tmp/site.
set -uo pipefail

OUT=${OUT:-/tmp/chunkce_gpu_check}
BUDGET=${BUDGET:-450}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1

# The package is not installed there: import it from the checkout. Importing
# compile_pass registers the "chunkce" backend (compile_pass/__init__.py), so the
# missing entry point does not matter.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=99 TOKENIZERS_PARALLELISM=false

section() { echo; echo "=== $1  [$(date +%T), ${SECONDS}s of ${BUDGET}s]"; }

# capped CAP CMD...: run CMD under timeout min(CAP, time left); skip it when too little is left.
capped() {
    local cap=$1; shift
    local left=$((BUDGET - SECONDS - 5))
    local limit=$((cap < left ? cap : left))
    if ((limit < 30)); then echo "--- skipped: ${left}s left"; return 0; fi
    echo "--- timeout ${limit}s: $*"
    timeout -k 10 "$limit" "$@"
    local rc=$?
    ((rc == 124 || rc == 137)) && echo "--- TIMED OUT after ${limit}s" || echo "--- rc=$rc"
    return 0
}

section "versions"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null \
    || echo "no nvidia-smi"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH \
        || echo "wheel install failed; liger / cce will be skipped"
fi
"$PY" - <<'EOF'
import importlib, platform
import torch, torch.nn.functional as F
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for name in ("triton", "transformers", "liger_kernel", "cut_cross_entropy", "tabulate"):
    try:
        print(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:
        print(f"{name} missing ({type(e).__name__}: {e})")
print("F.linear_cross_entropy:", hasattr(F, "linear_cross_entropy"),
      "| nn.LinearCrossEntropyOptions:", hasattr(torch.nn, "LinearCrossEntropyOptions"))
print("aten.addmm overloads:", torch.ops.aten.addmm.overloads())
acc = getattr(torch, "accelerator", None)
print("torch.accelerator:", [n for n in ("empty_cache", "memory_allocated", "max_memory_allocated",
                                         "reset_peak_memory_stats", "synchronize") if hasattr(acc, n)])
import compile_pass
print("chunkce backend registered:", "chunkce" in torch._dynamo.list_backends(exclude_tags=()))
EOF
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    DEVICE=cuda
    OP_ARGS=(--shapes llama3-8b gemma-2b-like --tokens 8192 16384 --dtype bf16 --warmup 2 --reps 5)
    MODEL_ARGS=(--configs gpu-1b --steps 5 --backends eager chunkce inductor)
    SWEEP_ARGS=(--tokens 8192 --chunk-size auto 256 1024 2048 4096 --warmup 2 --reps 5)
    PROFILE_ARGS=(--shape llama3-8b --tokens 8192 --chunk-size auto 2048)
    SCALING_ARGS=(--shape llama3-8b --dtype bf16 --tokens 4096 8192 16384 32768 --mem-cap-gib 100 --max-call-s 20
                  --impls unfused-compiled torch-lce-compiled chunkce chunkce-compiled chunkce-gif liger cce
                  floor-recompute)
else
    DEVICE=cpu
    echo "no CUDA: running the CPU fallback sizes"
    OP_ARGS=(--shapes cpu-tiny --tokens 2048 --dtype fp32 --impls unfused-eager chunkce liger cce)
    MODEL_ARGS=(--configs cpu-small --steps 2 --warmup 1 --backends eager chunkce)
    SWEEP_ARGS=(--tokens 2048 --chunk-size auto 256)
    PROFILE_ARGS=(--shape cpu-tiny --tokens 2048 --chunk-size 256)
    SCALING_ARGS=(--shape cpu-tiny --tokens 512 1024 --impls unfused-compiled chunkce floor-recompute)
fi

section "tests: tests/integration/test_gpu.py tests/op/test_op.py"
capped 150 "$PY" -m pytest tests/integration/test_gpu.py tests/op/test_op.py -q -x -rs -p no:cacheprovider \
    --durations=12 --junitxml="$OUT/junit.xml"

section "op benchmark: every provider (benchmarks/impls.py), full mode, HF-style fp32 logits, speed + memory + error"
capped 150 "$PY" -m benchmarks.bench_op --device "$DEVICE" "${OP_ARGS[@]}" --modes full \
    --logits-dtype fp32 --csv "$OUT/op.csv"

section "model benchmark: Llama train step, eager / inductor / chunkce, fresh process each"
capped 170 "$PY" -m benchmarks.bench_model --device "$DEVICE" "${MODEL_ARGS[@]}" --isolate \
    --csv "$OUT/model.csv"

section "extra, if time is left: chunkce's chunk size against speed and memory (full mode)"
capped 80 "$PY" -m benchmarks.bench_op --device "$DEVICE" "${OP_ARGS[@]:0:2}" "${SWEEP_ARGS[@]}" \
    --impls chunkce --modes full --runs speed memory --logits-dtype fp32 --csv "$OUT/op_chunk_sweep.csv"

section "extra, if time is left: memory and time against tokens, every provider on one plot"
capped 120 "$PY" -m benchmarks.scaling --device "$DEVICE" "${SCALING_ARGS[@]}" --logits-dtype fp32 \
    --csv "$OUT/scaling.csv" --plot "$OUT/scaling.png"

section "extra, if time is left: where the op's time goes (torch.profiler)"
capped 60 "$PY" -m benchmarks.profile_op --device "$DEVICE" "${PROFILE_ARGS[@]}" --logits-dtype fp32

section "extra, if time is left: op benchmark with logits in bf16 (no upcast), forward + backward"
capped 90 "$PY" -m benchmarks.bench_op --device "$DEVICE" "${OP_ARGS[@]:0:2}" --tokens 8192 \
    --modes forward backward --runs speed memory --csv "$OUT/op_same_logits.csv"

section "done"
ls -la "$OUT"
sleep 1  # let tee flush log.txt before the files are collected
