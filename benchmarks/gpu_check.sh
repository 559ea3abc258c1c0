#!/usr/bin/env bash
# One prepared run for a scarce GPU session (under 8 minutes on one H100 / H200), one report.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh            # from the repository root
#
# Sections, each under `timeout` capped so the whole script ends within $BUDGET seconds (default
# 420): versions (a torch below pyproject's range, said and run anyway), the carried peers, the GPU
# tests (pytest -m gpu), the dry run of calls per op (benchmarks.calls_per_op), the anchor shapes
# for chunkce (default and grads_in_forward) against QuACK, Liger, CCE, torch's chunked
# F.linear_cross_entropy and Inductor unfused with peak memory (benchmarks.bench_op), and the
# accelerator tile curve (benchmarks.tile_kernels curve). $OUT/report.md holds every section's
# command and output; $OUT/log.txt everything; CSVs and the JUnit report beside them. A failing or
# timed-out section is reported and the next one runs. Without CUDA the same sections run at CPU
# sizes (the script's check: tests/integration/test_gpu_check.py). Wheels carried in .whl/
# (liger-kernel, cut-cross-entropy; docs/benchmarks.md says why QuACK's are not) go to /tmp/site.
set -uo pipefail

OUT=${OUT:-/tmp/chunkce_gpu_check}
BUDGET=${BUDGET:-420}
PY=${PYTHON:-python3}
PIN=2.11  # pyproject's lowest torch
mkdir -p "$OUT"
REPORT="$OUT/report.md"
exec > >(tee -a "$OUT/log.txt") 2>&1

# The package is not installed there: import it from the checkout. Importing
# compile_pass registers the "chunkce" backend (compile_pass/__init__.py).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 KINETO_LOG_LEVEL=99 TOKENIZERS_PARALLELISM=false

# section TITLE CAP CMD...: CMD under timeout min(CAP, time left), its output into the log and,
# under "## TITLE" with the command and its status, into the report; skipped when too little is left.
section() {
    local title=$1 cap=$2; shift 2
    local left=$((BUDGET - SECONDS - 5))
    local limit=$((cap < left ? cap : left))
    echo; echo "=== $title  [$(date +%T), ${SECONDS}s of ${BUDGET}s]"
    { echo; echo "## $title"; echo; echo "\`$*\`"; echo; } >>"$REPORT"
    if ((limit < 20)); then
        echo "skipped: ${left}s left" | tee -a "$REPORT"; return 0
    fi
    local part="$OUT/.section.txt"
    timeout -k 10 "$limit" "$@" >"$part" 2>&1
    local rc=$?
    cat "$part"
    local status="rc=$rc"
    ((rc == 124 || rc == 137)) && status="TIMED OUT after ${limit}s"
    { echo '```'; cat "$part"; echo '```'; echo; echo "status: $status"; } >>"$REPORT"
    echo "--- $status"
    rm -f "$part"
}

echo "# chunkce GPU check ($(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))" >"$REPORT"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site \
        || echo "wheel install failed: the peers in .whl/ will be skipped"
fi

section "versions and peers" 60 "$PY" - "$PIN" <<'PYEOF'
import importlib, platform, sys
import torch, torch.nn.functional as F
pin = tuple(int(p) for p in sys.argv[1].split("."))
found = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
if found < pin:
    print(f"torch {torch.__version__} is below chunkce's range (torch>={sys.argv[1]}): running anyway; "
          "what fails on it is in the sections below")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
for name, module in (("triton", "triton"), ("liger-kernel", "liger_kernel"),
                     ("cut-cross-entropy", "cut_cross_entropy"), ("quack-kernels", "quack.linear_cross_entropy")):
    try:
        importlib.import_module(module)
        print(f"peer {name}: importable ({getattr(sys.modules[module.split('.')[0]], '__version__', '?')})")
    except Exception as e:
        print(f"peer {name}: SKIPPED, {type(e).__name__}: {e}"
              + ("; not carried: its nvidia-cutlass-dsl-libs-cu12 wheel is 87 MiB, over the 64 MiB a run carries"
                 if name == "quack-kernels" else ""))
print("F.linear_cross_entropy with LinearCrossEntropyOptions:",
      hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"))
import compile_pass
print("chunkce backend registered:", "chunkce" in torch._dynamo.list_backends(exclude_tags=()))
PYEOF

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    DEVICE=cuda
    ANCHORS=(--shapes llama3-8b --tokens 4096 8192 --dtype bf16)
    ANCHOR_248K=(--shapes h2048-v248k --tokens 16384 --dtype bf16)
    IMPLS=(--impls chunkce chunkce-gif quack liger cce torch-lce unfused-compiled)
    BENCH=(--warmup 2 --reps 5)
    CURVE=(--shapes large --budgets-mib 32 64 128 256 --floors 1024 2048 4096 --reps 5)
    DRY=(--device h100 --budgets-mib 64 128)
else
    DEVICE=cpu
    echo "no CUDA: running the CPU fallback sizes"
    ANCHORS=(--shapes cpu-tiny --tokens 512 --dtype fp32)
    ANCHOR_248K=(--shapes cpu-tiny --tokens 256 --dtype fp32)
    IMPLS=(--impls chunkce chunkce-gif quack liger cce unfused-eager)  # torch-lce: seconds a call on CPU
    BENCH=(--warmup 1 --reps 1)
    CURVE=(--shapes example-32k --budgets-mib 7 --floors 512 --reps 1)
    DRY=(--device h100)
fi

section "GPU tests (pytest -m gpu)" 150 "$PY" -m pytest -m gpu tests/integration/test_gpu.py \
    tests/integration/test_memory.py tests/op/test_autograd.py -q -rs -p no:cacheprovider \
    --durations=8 --junitxml="$OUT/junit.xml"

section "calls per op, dry run (benchmarks.calls_per_op)" 30 "$PY" -m benchmarks.calls_per_op "${DRY[@]}"

section "anchors: chunkce (default, grads_in_forward) against the peers, time and peak memory" 150 \
    "$PY" -m benchmarks.bench_op --device "$DEVICE" "${ANCHORS[@]}" "${IMPLS[@]}" "${BENCH[@]}" \
    --modes full --runs speed memory --csv "$OUT/anchors.csv"

section "anchor 16384 x 2048 x 248320 (CCE's)" 90 \
    "$PY" -m benchmarks.bench_op --device "$DEVICE" "${ANCHOR_248K[@]}" "${IMPLS[@]}" "${BENCH[@]}" \
    --modes full --runs speed memory --csv "$OUT/anchor_248k.csv"

section "accelerator tile curve (benchmarks.tile_kernels curve)" 90 \
    "$PY" -m benchmarks.tile_kernels curve --device "$DEVICE" "${CURVE[@]}"

echo; echo "report: $REPORT"
ls -la "$OUT"
sleep 1  # let tee flush log.txt before the files are collected
