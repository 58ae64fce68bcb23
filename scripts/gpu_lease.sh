#!/usr/bin/env bash
# One short GPU lease (15 minutes of device time in all) in the order of README "Next on a GPU", as
# two commands of at most 10 minutes each:
#   stage 1: the CUDA-graph checks, then MFU at 157m and 1b with CUDA graphs beside eager (bench.step)
#   stage 2: the rest of the CUDA suite, sampling speed, the dispatch kernels' GB/s
# Each check runs under its own time limit and logs to $LEASE_OUT/<check>.log, with one line per
# check in $LEASE_OUT/summary.txt, so a stage cut short still returns what finished.
#     scripts/gpu_lease.sh 1|2       PY=python3 (a CUDA torch), LEASE_OUT=$OUT (the device tool's) or gpu-out
#     device tool: run(command="scripts/gpu_lease.sh 1", timeout_s=600), then stage 2 (carry .whl/ if built)
#     LEASE_DRY_RUN=1 scripts/gpu_lease.sh 1    print the checks, run nothing
set -u
stage=${1:?usage: scripts/gpu_lease.sh 1|2}
PY=${PY:-python3}
LEASE_OUT=${LEASE_OUT:-${OUT:-gpu-out}}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" MEGAROUTE_REQUIRE_CUDA=1
GRAPH_K="reduce-overhead or cuda_graph or graph_mode"  # the CUDA-graph tests: stage 1 runs them, stage 2 the rest
GRAPHS=(--compile --compile-mode reduce-overhead --no-sample)

check() {  # check NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    if [ -n "${LEASE_DRY_RUN:-}" ]; then
        printf '%s (%s s):' "$name" "$limit"; printf ' %q' "$@"; echo  # shell-quoted, as run
        return
    fi
    timeout --kill-after=10 "$limit" "$@" > "$LEASE_OUT/$name.log" 2>&1
    rc=$?
    echo "$name: rc $rc$([ $rc -eq 124 ] && echo ' (time limit)'), $((SECONDS - start)) s" | tee -a "$LEASE_OUT/summary.txt"
}

[ -n "${LEASE_DRY_RUN:-}" ] || mkdir -p "$LEASE_OUT"
case $stage in
1)
    check env 30 bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'"
    check graph_tests 180 "$PY" -m pytest -m cuda -v -ra tests/cuda/test_model_cuda.py tests/cuda/test_bench_cuda.py \
        -k "$GRAPH_K"
    check mfu_157m 200 "$PY" -m megaroute.bench.step --device cuda --shape 157m --batch 16 --seq-len 1024 --steps 6 "${GRAPHS[@]}"
    # 1b at 16 x 1024: where compiled blocks reached 45.8% MFU on an H100 (8 x 1024 eager: 34%, recorded)
    check mfu_1b 160 "$PY" -m megaroute.bench.step --device cuda --shape 1b --batch 16 --seq-len 1024 --steps 4 "${GRAPHS[@]}"
    ;;
2)
    # An offline node's Python may lack DeepSpeed (the launcher tests): `make offline-wheels` here,
    # carry .whl/ with the command, and it is installed beside the tree (README, CUDA smoke suite).
    if [ -d .whl ] && ! "$PY" -c "import deepspeed" > /dev/null 2>&1; then
        check wheels 60 "$PY" -m pip install --no-index --no-deps --target /tmp/megaroute-wheels .whl/*.whl
        export PYTHONPATH="/tmp/megaroute-wheels:$PYTHONPATH" PATH="/tmp/megaroute-wheels/bin:$PATH"
    fi
    check suite 360 "$PY" -m pytest -m cuda -v -ra -n 8 tests/cuda tests/unit/kernels/test_kernels.py \
        -k "not ($GRAPH_K)"
    check sampling 100 "$PY" -m megaroute.bench.step --device cuda --shape 157m --batch 8 --steps 2 --warmup 1
    check kernels 100 "$PY" -m megaroute.kernels.bench --dtype bfloat16
    ;;
*)
    echo "scripts/gpu_lease.sh: stage must be 1 or 2, got '$stage'" >&2
    exit 2
    ;;
esac
