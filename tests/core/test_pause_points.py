"""trainyard.core.pause_points: a process paused at a named step, then signalled there.

Each case runs a small script as its own process and signals it at its announced pause:
a handler that raises ends it there, one that returns lets the work go on, SIGTERM's
default action ends it, removing the file lets it go on, and other steps never pause.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from trainyard.core.pause_points import PAUSE_AT, PAUSE_FILE, pause_point

from conftest import pause_env, wait_paused

SCRIPT = """
import signal, sys
from trainyard.core.pause_points import pause_point
if sys.argv[1] == "flag":  # a handler that returns, as Lightning's SIGTERM handler does
    def flag(signum, frame):
        print("handled; mine still installed:", signal.getsignal(signum) is flag, flush=True)
    signal.signal(signal.SIGTERM, flag)
elif sys.argv[1] == "default":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
pause_point("other")
print("at step", flush=True)
pause_point("step")
print("past the first arrival", flush=True)
pause_point("step")
print("went on", flush=True)
"""


def paused(tmp_path: Path, at: str, mode: str = "") -> tuple[subprocess.Popen, Path]:
    announce = tmp_path / f"{mode or 'plain'}.paused"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode],
        env=pause_env(at, announce),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert wait_paused(announce, proc, lambda: proc.communicate()[1], 120) == proc.pid
    return proc, announce


def test_ctrl_c_at_the_named_arrival_raises_there(tmp_path):
    proc, _ = paused(tmp_path, "step:2")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert out == "at step\npast the first arrival\n" and "KeyboardInterrupt" in err


def test_a_handler_that_returns_ends_the_pause_and_the_work_goes_on(tmp_path):
    proc, _ = paused(tmp_path, "step", "flag")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.splitlines() == [
        "at step",
        "handled; mine still installed: True",  # the pause's own wrapper was out of the way
        "past the first arrival",
        "went on",  # the second arrival does not pause again
    ]


def test_sigterm_default_action_ends_the_process(tmp_path):
    proc, _ = paused(tmp_path, "step", "default")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM


def test_removing_the_file_lets_it_go_on(tmp_path):
    proc, announce = paused(tmp_path, "step")
    announce.unlink()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.endswith("went on\n"), err


def test_off_the_main_thread_it_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv(PAUSE_AT, "threaded")
    monkeypatch.setenv(PAUSE_FILE, str(tmp_path / "never"))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            pause_point("threaded")
        except RuntimeError as err:
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert "off the main thread" in str(errors[0])


def test_without_the_variable_nothing_pauses(monkeypatch):
    monkeypatch.delenv(PAUSE_AT, raising=False)
    pause_point("step")  # returns at once


@pytest.mark.parametrize("at", ["other:2", "ste", "step:3"])
def test_other_steps_and_arrivals_never_pause(tmp_path, at):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, ""],
        env=pause_env(at, tmp_path / "never"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.endswith("went on\n"), proc.stderr
    assert not (tmp_path / "never").exists()
