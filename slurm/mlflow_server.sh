#!/bin/bash
# An MLflow tracking server for a cluster's sweeps (SQLite is unsafe with concurrent writers on
# a shared filesystem; one server serializes them). Run it on a login/service node, or as a job:
#
#   slurm/mlflow_server.sh [DIR] [PORT]           # DIR default $HOME/mlflow, PORT default 5000
#   sbatch --time=7-0 slurm/mlflow_server.sh /shared/mlflow 5000
#
# The store (SQLite, written by this one process) and artifacts live in DIR; the URI to put in a
# sweep spec's overrides (tracking.uri=...) is printed and written to DIR/uri.
#SBATCH --job-name=mlflow-server
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=4
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

dir=${1:-$HOME/mlflow}
port=${2:-5000}
MLFLOW=${MLFLOW:-mlflow}
mkdir -p "$dir/artifacts"
host=$(hostname -f 2>/dev/null || hostname)
echo "http://$host:$port" > "$dir/uri"
echo "mlflow_server.sh: tracking.uri=http://$host:$port (store $dir/mlflow.db, artifacts $dir/artifacts)"
exec "$MLFLOW" server --backend-store-uri "sqlite:///$dir/mlflow.db" --artifacts-destination "$dir/artifacts" \
  --host 0.0.0.0 --port "$port" --workers "${MLFLOW_WORKERS:-4}"
