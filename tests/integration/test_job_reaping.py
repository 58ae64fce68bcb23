"""The integration tests' Job harness ends what it launched, also when a test never reaches wait()."""

import gc
import os
import shutil
import time

from .conftest import Job


def test_a_job_dropped_by_its_test_is_killed_with_its_process_group(tmp_path):
    job = Job([shutil.which("sh"), "-c", f"{shutil.which('sleep')} 300 & wait"], {}, tmp_path / "job.log")
    launcher = job.proc
    group = launcher.pid
    del job
    gc.collect()  # the Job's finalizer (also run at interpreter exit, e.g. after SIGTERM -> KeyboardInterrupt)
    assert launcher.poll() is not None
    for _ in range(50):  # the group's other member (the sleep) goes too, not only the launcher
        try:
            os.killpg(group, 0)  # signal 0: only asks whether the group has a member
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process group {group} still has members")
