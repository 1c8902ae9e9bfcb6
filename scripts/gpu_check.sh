#!/usr/bin/env bash
# `make gpu-check`: the first thing to run on a GPU machine. From a bare machine with torch (2.4 or later) and no
# network, it runs within 9 minutes on one H100/H200, each step within its own time budget:
#   setup     the wheels `make gpu-wheels` carried (.whl/), installed into a private folder where the machine lacks
#             them (never torch); alignflow importable from this checkout (scripts/gpu_check_setup.py)
#   tests     pytest --device cuda over the device tests (the Makefile's DEVICE_TESTS)
#   engine    benchmarks/engine_throughput.py, bf16, batch 1/8/64, the ~110M model and the Llama-3.2-1B shape:
#             native (CUDA graphs, the engine's default), native fused (its fused Triton step), native loop (the
#             sampler and bookkeeping in the graph), native fused loop (both) and hf, each as a share of the HBM
#             roofline at the bandwidth a device-to-device copy reaches in the same run
#   pipeline  configs/gpu-small.yaml: SFT -> reward -> engine -> PPO -> evaluate, then GRPO, every stage on the GPU
#             (scripts/gpu_check_pipeline.py): the stage table, the held-out gold gain, each stage's devices
#   rl        a GRPO iteration of alignflow beside TRL's GRPOTrainer on the same GPU and model, and their ratio
#             (scripts/gpu_check_rl.py; "not run" without trl)
#   fusions   benchmarks/decode_fusions.py, the Llama-3.2-1B shape, bf16, batch 1/64: the CUDA-graph decode step
#             with one more fused Triton op per row, what each bought in ms per step and % of the HBM roofline
# Every step writes its log and one JSON line of figures (figures.jsonl) under the output folder ($OUT if set, else
# ./gpu-check-out); the end is one summary table. Exits 1 if a step failed or ran past its budget.
#
#   scripts/gpu_check.sh [--device cuda|cpu] [--out DIR] [--workdir DIR] [--tests "PATHS"] [--steps a,b,...]
#                        [--wheels DIR]       # default .whl/
#   scripts/gpu_check.sh --download-wheels      # on a networked machine (make gpu-wheels): .whl/, at most 60 MiB
#
# --device cpu runs the same steps at tiny sizes (tiny models, a few iterations, a short test selection): it is
# how `make test` keeps this script working between GPU runs (tests/test_gpu_check.py). PYTHON picks the
# interpreter (default python3: on a GPU image, the one with torch).
set -uo pipefail  # no -e: a failed step is recorded and the next one runs

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
DEVICE=cuda
OUT_DIR=${OUT:-$PWD/gpu-check-out}
WORK=""
TESTS=""
STEPS=setup,tests,engine,pipeline,rl,fusions
CONFIG=$REPO/configs/gpu-small.yaml
WHEELS=$REPO/.whl
WHEELS_LIMIT_MIB=60
DEEPSPEED_SPEC=deepspeed==0.19.8  # an sdist on PyPI: --download-wheels builds its (pure Python) wheel
GPU_PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}
# When DEVICE_TESTS is not in the Makefile (make print-device-tests): the device-agnostic test folders.
DEFAULT_DEVICE_TESTS="tests/kernels tests/stages/common/generation tests/stages/common/training tests/stages/dpo/test_dpo_losses.py
tests/stages/ppo/test_losses.py"
CPU_TESTS="tests/stages/ppo/test_losses.py"

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

download_wheels() {
    mkdir -p "$WHEELS"
    rm -f "$WHEELS"/*.whl  # one version of each package: two would both be offered to the install
    local platforms=() tag
    for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 \
               manylinux_2_5 manylinux1; do
        platforms+=(--platform "${tag}_x86_64")
    done
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$GPU_PYTHON_VERSION" \
        --implementation cp "${platforms[@]}" -d "$WHEELS" -r "$REPO/scripts/gpu_check_wheels.txt" || return 1
    "$PYTHON" -m pip wheel --quiet --no-deps -w "$WHEELS" "$DEEPSPEED_SPEC" || return 1
    "$PYTHON" - "$WHEELS" "$WHEELS_LIMIT_MIB" <<'EOF'
import sys
from pathlib import Path

wheels, limit = sorted(Path(sys.argv[1]).glob("*.whl")), float(sys.argv[2])
total = sum(w.stat().st_size for w in wheels) / 2**20
for w in wheels:
    print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
print(f"{len(wheels)} wheels, {total:.1f} MiB in {sys.argv[1]} (limit {limit:.0f} MiB)")
if total > limit:
    sys.exit(f"error: the wheels take {total:.1f} MiB, over the {limit:.0f} MiB limit: drop some from "
             "scripts/gpu_check_wheels.txt")
EOF
}

while [ $# -gt 0 ]; do
    case $1 in
        --device) DEVICE=$2; shift 2 ;;
        --out) OUT_DIR=$2; shift 2 ;;
        --workdir) WORK=$2; shift 2 ;;
        --tests) TESTS=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --wheels) WHEELS=$2; shift 2 ;;
        --download-wheels) download_wheels; exit $? ;;
        -h|--help) usage; exit 0 ;;
        *) echo "error: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
case $DEVICE in cuda|cpu) ;; *) echo "error: --device $DEVICE: cuda or cpu" >&2; exit 2 ;; esac

mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
[ -n "$WORK" ] || WORK=$(mktemp -d "${TMPDIR:-/tmp}/alignflow-gpu-check.XXXXXX")
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
FIGURES=$OUT_DIR/figures.jsonl
: > "$FIGURES"

# Budgets in seconds. cuda: 30 + 120 + 110 + 150 + 70 + 60 = 540 s = 9 min on one H100/H200, the start-up of
# every process, Triton's compiles, the 1B checkpoint and DeepSpeed's first fused-Adam build included (estimates
# until a GPU run times them); fusions last, as the figures it adds matter least.
# A step past its budget gets SIGINT (pytest still writes its report), then SIGKILL 15 s later. cpu: the tiny sizes
# on a shared 2-core box, with room for a loaded one.
# The engine rows: the engine's default path, the CUDA graph's variants (fused step, in-graph loop, both), the eager
# torch step on CPU (no C++ loop), and hf. `native eager` (no graphs) was measured on the first GPU run: 7-10x hf.
ENGINES="native,native fused,native loop,native fused loop,native step,hf"
if [ "$DEVICE" = cuda ]; then
    declare -A BUDGET=([setup]=30 [tests]=120 [engine]=110 [pipeline]=150 [rl]=70 [fusions]=60)
    # shellcheck disable=SC2054  # the commas are the benchmark's list syntax
    ENGINE_ARGS=(--models llama-100m,llama-1b --dtypes bfloat16 --batch-sizes 1,8,64 --new-tokens 64 --repeats 2
                 --threads 4)
    SIZES=()
    RL_ARGS=(--iterations 8)
    # shellcheck disable=SC2054  # the commas are the benchmark's list syntax
    FUSIONS_ARGS=(--model llama-1b --dtype bfloat16 --batch-sizes 1,64 --new-tokens 64 --repeats 2)
    unset TRITON_INTERPRET  # the kernels run compiled (tests/kernels/conftest.py refuses the interpreter on cuda)
else
    declare -A BUDGET=([setup]=60 [tests]=120 [engine]=120 [pipeline]=300 [rl]=200 [fusions]=120)
    # shellcheck disable=SC2054  # the commas are the benchmark's list syntax
    ENGINE_ARGS=(--models tiny --dtypes float32 --batch-sizes 1,8 --new-tokens 8 --repeats 1 --threads 1)
    # configs/gpu-small.yaml shrunk to tests/conftest.py's small_config sizes, a couple of iterations of each loop.
    SIZES=()
    for kv in model.tiny.hidden_size=32 model.tiny.intermediate_size=64 model.tiny.num_hidden_layers=1 \
              model.tiny.num_attention_heads=2 model.tiny.num_key_value_heads=1 model.tiny.vocab_size=320 \
              model.tiny.max_position_embeddings=128 data.demo.n_sft=64 data.demo.n_preferences=64 \
              data.demo.n_prompts=16 data.demo.n_eval_prompts=8 sft.epochs=1 sft.batch_size=16 sft.micro_batch_size=16 \
              reward.epochs=1 reward.batch_size=16 reward.micro_batch_size=16 ppo.iterations=2 ppo.checkpoint_every=2 \
              ppo.prompts_per_iteration=8 ppo.minibatch_size=8 ppo.max_new_tokens=8 ppo.actor_lr=5e-4 \
              evaluate.n_prompts=8 evaluate.max_new_tokens=8 engine.dtype=float32 engine.max_batch_size=16; do
        SIZES+=(--set "$kv")
    done
    RL_ARGS=(--iterations 2 --policy sft)  # the pipeline step's SFT and engine: one stage process, not two
    # The static step uncaptured, the kernels in Triton's interpreter: the step's mechanics, not its speed.
    # shellcheck disable=SC2054  # the commas are the benchmark's list syntax
    FUSIONS_ARGS=(--model tiny --dtype float32 --batch-sizes 1,2 --new-tokens 2 --repeats 1)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
export PYTHONUNBUFFERED=1

device_tests() {
    # The Makefile's DEVICE_TESTS (kept by whoever adds device tests), read through make itself.
    local tests=""
    if command -v make >/dev/null; then
        # shellcheck disable=SC2016  # $(DEVICE_TESTS) is make's, not the shell's
        tests=$(make -s -C "$REPO" print-device-tests 2>/dev/null) \
            || tests=$(printf 'gpu-check-print:\n\t@echo $(DEVICE_TESTS)\n' \
                       | make -s -C "$REPO" -f Makefile -f - gpu-check-print 2>/dev/null) || tests=""
    fi
    echo "${tests:-$DEFAULT_DEVICE_TESTS}"
}

record() {  # record STEP RC SECONDS [RESULT] [NOTE]
    "$PYTHON" "$REPO/scripts/gpu_check_steps.py" record "$1" --rc "$2" --seconds "$3" --budget "${BUDGET[$1]}" \
        --figures "$FIGURES" --log "$OUT_DIR/$1.log" ${4:+--result "$4"} ${5:+--note "$5"}
}

# run_step STEP RESULT STDOUT -- COMMAND...: COMMAND within the step's budget, its output in the step's log
# (stdout in STDOUT instead when that is not '-'), then its JSON line; the log's tail on the console if it failed.
run_step() {
    local step=$1 result=$2 stdout=$3 log=$OUT_DIR/$1.log rc started ended
    shift 4
    echo "== $step (budget ${BUDGET[$step]} s): $*" | tee "$log"
    started=$(date +%s.%N)
    if [ "$stdout" = - ]; then
        timeout -s INT --kill-after=15 "${BUDGET[$step]}" "$@" >>"$log" 2>&1
    else
        timeout -s INT --kill-after=15 "${BUDGET[$step]}" "$@" >"$stdout" 2>>"$log"
    fi
    rc=$?
    ended=$(date +%s.%N)
    record "$step" "$rc" "$(awk -v a="$started" -v b="$ended" 'BEGIN {print b - a}')" "$result" "${NOTE:-}" \
        | tee -a "$log"
    if [ "$rc" -ne 0 ]; then
        echo "-- last lines of $log:"
        tail -n 25 "$log" | sed 's/^/   /'
    fi
    return "$rc"
}

wanted() { [[ ",$STEPS," == *",$1,"* ]]; }

echo "gpu-check on $DEVICE: output $OUT_DIR, work $WORK, python $PYTHON"
setup_ok=1
if wanted setup; then
    run_step setup "$WORK/setup.json" - -- "$PYTHON" "$REPO/scripts/gpu_check_setup.py" --target "$WORK/site" \
        --wheels "$WHEELS" --device "$DEVICE" --result "$WORK/setup.json" || setup_ok=0
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$WORK/site/bin:$PATH"  # the carried ninja's executable: DeepSpeed and torch build their ops with it
fi

# One code version for every stage of every step (outputs are found again by a digest that includes it): on a
# checkout that changes meanwhile, the RL step still finds the pipeline step's outputs.
if [ -z "${ALIGNFLOW_CODE_VERSION:-}" ] && [ "$setup_ok" = 1 ]; then
    ALIGNFLOW_CODE_VERSION=$("$PYTHON" -c 'from alignflow.manifest import code_version; print(code_version())') \
        && export ALIGNFLOW_CODE_VERSION
fi

for step in tests engine pipeline rl fusions; do
    wanted "$step" || continue
    if [ "$setup_ok" = 0 ]; then
        echo '{"status": "not run", "summary": "setup failed", "figures": {}}' > "$WORK/$step-skipped.json"
        record "$step" 0 0 "$WORK/$step-skipped.json"
        continue
    fi
    case $step in
        tests)
            [ -n "$TESTS" ] || { [ "$DEVICE" = cuda ] && TESTS=$(device_tests) || TESTS=$CPU_TESTS; }
            device_option=()
            NOTE=""
            if grep -q '"--device"' "$REPO/tests/conftest.py"; then
                device_option=(--device "$DEVICE")
            else
                NOTE="the suite has no --device option yet: the tests chose their own device"
            fi
            # shellcheck disable=SC2086  # TESTS is a list of paths
            (cd "$REPO" && run_step tests "$WORK/junit.xml" - -- "$PYTHON" -m pytest -p no:cacheprovider -q -rfE \
                "${device_option[@]}" --junitxml "$WORK/junit.xml" $TESTS)
            NOTE=""
            ;;
        engine)
            run_step engine "$WORK/engine.json" "$WORK/engine.json" -- "$PYTHON" \
                "$REPO/benchmarks/engine_throughput.py" --device "$DEVICE" "${ENGINE_ARGS[@]}" --engines "$ENGINES" \
                --no-compile --no-refit --json
            ;;
        pipeline)
            run_step pipeline "$WORK/pipeline.json" - -- "$PYTHON" "$REPO/scripts/gpu_check_pipeline.py" \
                --config "$CONFIG" --device "$DEVICE" --workdir "$WORK/runs" --result "$WORK/pipeline.json" \
                "${SIZES[@]}"
            ;;
        rl)
            run_step rl "$WORK/rl.json" - -- "$PYTHON" "$REPO/scripts/gpu_check_rl.py" --config "$CONFIG" \
                --device "$DEVICE" --workdir "$WORK/runs" --result "$WORK/rl.json" "${RL_ARGS[@]}" "${SIZES[@]}"
            ;;
        fusions)
            interpret=()
            [ "$DEVICE" = cuda ] || interpret=(env TRITON_INTERPRET=1)
            run_step fusions "$WORK/fusions.json" "$WORK/fusions.json" -- "${interpret[@]}" "$PYTHON" \
                "$REPO/benchmarks/decode_fusions.py" --device "$DEVICE" "${FUSIONS_ARGS[@]}" --json
            ;;
    esac
done

total_budget=0
for step in "${!BUDGET[@]}"; do wanted "$step" && total_budget=$((total_budget + BUDGET[$step])); done
"$PYTHON" "$REPO/scripts/gpu_check_steps.py" summary --figures "$FIGURES" --device "$DEVICE" \
    --budget "$total_budget" | tee "$OUT_DIR/summary.txt"
exit "${PIPESTATUS[0]}"
