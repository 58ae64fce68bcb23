"""The demo's speed figures: medians over the run's logged windows, not its last window."""

import math

from mlflow.tracking import MlflowClient

from megaroute.demo import _run_median


def test_speed_is_the_median_of_the_logged_windows_after_the_first(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.create_run(client.create_experiment("demo")).info.run_id
    # logged out of step order; step 10's window holds the start-up steps and is left out
    for step, value in ((20, 200.0), (10, 10.0), (40, 250.0), (30, 300.0)):
        client.log_metric(run, "perf/tokens_per_s", value, step=step)
    client.log_metric(run, "perf/mfu", 0.5, step=10)
    assert _run_median(client, run, "perf/tokens_per_s") == 250.0  # median of 200, 300, 250
    assert _run_median(client, run, "perf/mfu") == 0.5  # one window: that one
    assert math.isnan(_run_median(client, run, "perf/missing"))
