#!/bin/bash
# Multi-node pretraining under Slurm: one process per GPU via srun, checkpoint on stop, requeue before the time limit.
#
#   sbatch -N 4 --gpus-per-node=8 slurm/pretrain.sh [--gpu a100|v100|cpu] --config configs/mod_1b.yaml [key=value ...]
#
# Submit from the repository root (or set MEGAROUTE_REPO); PYTHON picks the interpreter.
# Rendezvous: MASTER_ADDR is the first node of the allocation, MASTER_PORT derives from the job
# id (stable across requeues, distinct between jobs sharing a node). --gpu a100 trains in bf16,
# v100 (no bf16) in fp16 with loss scaling; an explicit train.precision=... override wins.
# Logs: <run_dir>/logs/<job>-r<restart>-rank<N>.log, one file per rank.
# Time limit: --signal=B:USR1@300 signals this shell; the trap forwards it to every rank; training
# checkpoints and exits 75; we `scontrol requeue`; the requeued job resumes from the checkpoint
# (checkpoint.resume=auto). SIGTERM (scancel, preemption, `scontrol requeue`) also makes the ranks
# checkpoint and exit 75, but we never requeue after it: Slurm decides (cancelled stays cancelled,
# a requeue by Slurm or preemption with PreemptMode=REQUEUE resumes). The ranks have KillWait
# seconds between SIGTERM and SIGKILL to checkpoint.
#SBATCH --job-name=megaroute
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

REPO=${MEGAROUTE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
PYTHON=${PYTHON:-python}
EXIT_REQUEUE=75
cd "$REPO"

gpu=a100
if [[ ${1:-} == --gpu ]]; then gpu=${2:?--gpu needs a value}; shift 2; fi
case $gpu in
  a100) precision=bf16 ;;
  v100) precision=fp16 ;;
  cpu) precision=fp32; export DS_ACCELERATOR=cpu ;;
  *) echo "pretrain.sh: error: --gpu must be a100, v100 or cpu, got '$gpu'" >&2; exit 2 ;;
esac
args=("$@")
[[ " ${args[*]} " == *" train.precision="* ]] || args+=("train.precision=$precision")

# Resolving the config here validates it before any node starts a rank (exit 2 = bad config).
run_dir=$("$PYTHON" -m megaroute.cli config show --get run_dir "${args[@]}")
log_dir=$run_dir/logs
mkdir -p "$log_dir"

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
# The node's address as Slurm knows it (a hostname on most clusters, an IP on some).
addr=$(scontrol show node "${nodes[0]}" -o | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
export MASTER_ADDR=${addr:-${nodes[0]}}
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export PYTHONUNBUFFERED=1
restart=${SLURM_RESTART_COUNT:-0}
echo "pretrain.sh: job $SLURM_JOB_ID restart $restart on ${#nodes[@]} node(s) ${SLURM_JOB_NODELIST}," \
     "master $MASTER_ADDR:$MASTER_PORT, --gpu $gpu, logs in $log_dir"

terminated=0  # set on SIGTERM: the job is being ended (or requeued) by Slurm, so never requeue it ourselves
forward() {
  echo "pretrain.sh: got SIG$1, forwarding to the ranks (checkpoint, then exit $EXIT_REQUEUE)"
  # scancel without --batch signals the job's steps, i.e. every rank on every node, not this shell.
  # Bounded: while Slurm requeues the job, scancel retries for a minute, and the trap would block us.
  timeout 10 scancel --quiet --signal="$1" "$SLURM_JOB_ID" || kill -s "$1" "$srun_pid" 2>/dev/null || true
}
trap 'forward USR1' USR1
trap 'terminated=1; forward TERM' TERM

# Backgrounded + wait: bash runs traps only between commands, and `wait` returns early on one.
# Exit 75 counts as "bad" to Slurm, so no --kill-on-bad-exit: rank 0 may still be closing its
# MLflow run when the others leave. --wait bounds how long a crashed rank's peers may linger.
srun --kill-on-bad-exit=0 --wait="${MEGAROUTE_RANK_EXIT_WAIT:-120}" --output="$log_dir/%j-r$restart-rank%t.log" \
  "$PYTHON" -u launcher/pretrain.py "${args[@]}" &
srun_pid=$!
while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid" || true; done
rc=0
wait "$srun_pid" || rc=$?

if [[ $rc == "$EXIT_REQUEUE" && $terminated == 1 ]]; then
  echo "pretrain.sh: checkpointed after SIGTERM; not requeueing (a cancel ends the job, a requeue by Slurm resumes it)"
  exit "$rc"
fi
if [[ $rc == "$EXIT_REQUEUE" ]]; then  # USR1 (time limit ahead) or train.exit_interval
  echo "pretrain.sh: checkpointed after a stop signal; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
echo "pretrain.sh: training exited with $rc"
exit "$rc"
