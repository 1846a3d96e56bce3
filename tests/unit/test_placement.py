"""CPU placement (`learner.cpus`, `generators.cpus`): checked against the CPUs this machine offers
before any process starts, and applied to every thread of a child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from asyncrl.config_load import load_config
from asyncrl.runtime import available_cpus, check_cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")


def test_an_unavailable_cpu_is_refused_with_what_is_available():
    missing = max(available_cpus()) + 1
    with pytest.raises(ValueError) as exc:
        check_cpus(load_config(overrides=[f"generators.cpus=[{missing}]"]))
    text = str(exc.value)
    assert f"generators.cpus = [{missing}]" in text and f"CPU {missing} is not available" in text
    assert f"available: {', '.join(map(str, sorted(available_cpus())))}" in text
    check_cpus(load_config(overrides=[f"learner.cpus=[{min(available_cpus())}]"]))  # available: fine


def test_pinning_covers_threads_started_before_and_after():
    cpu = min(available_cpus())
    script = f"""
import os, threading
from asyncrl.runtime import pin_process
stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()
pin_process([{cpu}])
late = threading.Thread(target=stop.wait); late.start()
def allowed(tid):
    status = open(f"/proc/self/task/{{tid}}/status").read()
    return status.split("Cpus_allowed_list:")[1].split()[0]
print(sorted({{allowed(t) for t in os.listdir("/proc/self/task")}}), len(os.listdir("/proc/self/task")))
stop.set()
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    lists, threads = out.stdout.split(" ")
    assert lists.strip() == f"['{cpu}']" and int(threads) >= 3  # main, early and late: all on `cpu`
