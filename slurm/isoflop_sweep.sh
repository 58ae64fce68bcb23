#!/bin/bash
# isoFLOP sweep as a Slurm array job: one task per point of a sweep spec.
#
#   sbatch slurm/isoflop_sweep.sh [SPEC] [key=value ...]      (SPEC default configs/sweeps/isoflop.yaml)
#
# Submitted like this, the job is the sweep's submitter: `megaroute sweep submit` plans the
# sweep (array size = number of points), opens the parent MLflow run, submits the array with the
# spec's `sbatch:` resources and an analysis job that runs after it (afterany): `megaroute sweep
# analyze --finish-parent` writes a new <runs_dir>/analysis/eval-<UTC time>/ and a new MLflow
# child run of the parent, then ends the parent run FINISHED (FAILED if the analysis fails), with
# tags counting the failed and missing points. Each array task then
# resolves its own point (`megaroute sweep point --index $SLURM_ARRAY_TASK_ID`) and becomes
# slurm/pretrain.sh for it, so preemption and requeue work per point. Submit from the
# repository root (or set MEGAROUTE_REPO); PYTHON picks the interpreter.
#SBATCH --job-name=isoflop
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
set -euo pipefail

REPO=${MEGAROUTE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
PYTHON=${PYTHON:-python}
cd "$REPO"
spec=configs/sweeps/isoflop.yaml
if [[ $# -gt 0 && $1 != *=* ]]; then spec=$1; shift; fi

if [[ -z ${SLURM_ARRAY_TASK_ID:-} ]]; then
  exec "$PYTHON" -m megaroute.cli sweep submit "$spec" "$@"
fi

point=$("$PYTHON" -m megaroute.cli sweep point "$spec" "$@" --index "$SLURM_ARRAY_TASK_ID" \
        ${SWEEP_PARENT_RUN_ID:+--parent-run "$SWEEP_PARENT_RUN_ID"})
echo "isoflop_sweep.sh: task $SLURM_ARRAY_TASK_ID of array $SLURM_ARRAY_JOB_ID: slurm/pretrain.sh $point"
eval "args=($point)"
# exec keeps this PID, so Slurm's --signal=B:USR1 reaches pretrain.sh's trap.
exec bash "$REPO/slurm/pretrain.sh" "${args[@]}"
