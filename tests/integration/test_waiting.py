"""The waiting helpers the integration tests share (tests/support/waiting.py, tests/support/gate.py)
against small child processes: each wait returns on the event it waits for and fails, saying
what it waited for, when that can no longer happen; none sleeps."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.gate import Gate
from tests.support.waiting import wait_for_log_text


def python(code: str) -> list[str]:
    return [sys.executable, "-u", "-c", textwrap.dedent(code)]


def test_a_line_is_found_as_it_comes_and_the_exit_code_read(launch_streamed):
    lines = launch_streamed(python("import signal; print('started learner (pid 7)'); signal.pause()"))
    # The process waits for a signal after its line: the wait cannot have been met by its end.
    assert lines.wait_for(r"^started learner \(pid (\d+)\)", timeout_s=60)[1] == "7"
    assert lines.proc.poll() is None
    lines.proc.kill()
    assert lines.wait_exit(timeout_s=60) == -9
    assert [m[0] for m in lines.matches(r"^\w+")] == ["started"]


def test_a_line_that_never_comes_fails_when_the_output_ends(launch_streamed):
    lines = launch_streamed(python("print('step 1/3'); raise SystemExit(3)"))
    with pytest.raises(AssertionError, match=r"the output ended before the second step:\nstep 1/3"):
        lines.wait_for(r"^step 2/", timeout_s=60, what="the second step")
    assert lines.wait_exit(timeout_s=60) == 3


def test_a_line_that_does_not_come_in_time_fails_at_the_deadline(launch_streamed):
    lines = launch_streamed(python("import signal; signal.pause()"))
    with pytest.raises(AssertionError, match="timed out after 0.2 s waiting for 'never'"):
        lines.wait_for("never", timeout_s=0.2)


def test_the_gate_holds_every_waiter_until_opened_and_lets_later_ones_through(tmp_path):
    gate = Gate(tmp_path / "gate")
    waiter = python(
        f"""
        from tests.support.gate import wait_until_open
        print("waiting", flush=True)
        wait_until_open({str(gate.path)!r})
        print("through")
        """
    )
    held = [subprocess.Popen(waiter, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for proc in held:
            assert proc.stdout.readline() == "waiting\n"
        # Shut: nobody gets through. A bounded look for something that must not happen (it can
        # miss a slow leak, never fail a working gate); nothing waits on it.
        with pytest.raises(subprocess.TimeoutExpired):
            held[0].wait(timeout=0.5)
        gate.open()
        for proc in held:
            assert proc.communicate(timeout=60)[0] == "through\n" and proc.returncode == 0
        later = subprocess.run(waiter, capture_output=True, text=True, timeout=60)
        assert later.stdout == "waiting\nthrough\n"
    finally:
        gate.close()
        for proc in held:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_log_text_is_found_on_the_write_that_brings_it(tmp_path, launch_streamed):
    log = tmp_path / "learner.log"
    log.write_text("1000 rejected so far\n")
    launcher = launch_streamed(python("import signal; signal.pause()"))  # alive until killed
    with pytest.raises(AssertionError, match="timed out after 0.2 s waiting for '2000 rejected so far'"):
        wait_for_log_text(log, "2000 rejected so far", timeout_s=0.2, lines=launcher)
    with open(log, "a") as f:
        f.write("2000 rejected so far\n")
    wait_for_log_text(log, "2000 rejected so far", timeout_s=60, lines=launcher)
    launcher.proc.kill()
    launcher.wait_exit(timeout_s=60)
    with pytest.raises(AssertionError, match="the launcher exited before"):
        wait_for_log_text(log, "3000 rejected so far", timeout_s=60, lines=launcher)
