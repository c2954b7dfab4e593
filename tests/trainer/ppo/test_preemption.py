"""SIGTERM/SIGINT handling of the driver (first signal: stop after the step; second: abandon it) and the
reaper that kills a driver's leftover processes when the driver is SIGKILLed."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hybridflow.trainer.ppo.preemption import StopRequest, TrainingPreempted
from hybridflow.utils.process_reaper import SCAN_INTERVAL_S


def test_first_signal_asks_to_stop_the_second_abandons(capsys):
    previous = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between bytecodes of the main thread
        assert stop.requested and stop.signum == signal.SIGTERM
        with pytest.raises(TrainingPreempted) as info:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert info.value.abandoned and info.value.exit_code == 130
        stop.shield()  # cleaning up: further signals are only noted
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is previous
    assert "finishing the current step" in capsys.readouterr().err


def test_the_stop_message_says_what_is_kept():
    stop = TrainingPreempted(signal.SIGTERM, step=3, checkpoint="/ckpt/global_step_3", abandoned=False)
    assert stop.exit_code == 143
    assert str(stop) == (
        "SIGTERM: stopped after step 3; the checkpoint a resume finds is /ckpt/global_step_3; rerun with "
        "trainer.resume_mode=auto to continue"
    )


def test_the_reaper_kills_what_a_killed_driver_left_behind(tmp_path):
    """The "driver" starts a reaper and a grandchild that escapes into its own session (as Ray's agents
    outlive a dead raylet); SIGKILL the driver: the grandchild is gone within a second or two."""
    driver = textwrap.dedent(
        """
        import subprocess, sys, time
        from hybridflow.utils.process_reaper import Reaper
        Reaper().start()
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        child = subprocess.Popen(sleeper, start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    time.sleep(SCAN_INTERVAL_S + 0.5)  # a reaper scan after the grandchild started (the first may precede it)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)
    assert time.monotonic() < deadline


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_closing_the_reaper_kills_only_orphans_never_a_child_the_driver_owns():
    """After ``ray.shutdown()`` the driver lives on (a notebook): its own children stay; a grandchild
    whose parent died (as Ray's agents outlive the raylet) is killed."""
    driver = textwrap.dedent(
        """
        import subprocess, sys, time
        from hybridflow.utils.process_reaper import Reaper
        reaper = Reaper().start()
        owned = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        spawn_orphan = (
            "import subprocess, sys, time;"
            "argv = [sys.executable, '-c', 'import time; time.sleep(600)'];"
            "c = subprocess.Popen(argv, start_new_session=True);"
            "print(c.pid, flush=True); time.sleep(2.5)"  # outlive one reaper scan, then leave c behind
        )
        parent = subprocess.Popen([sys.executable, "-c", spawn_orphan], stdout=subprocess.PIPE, text=True)
        orphan = int(parent.stdout.readline())
        parent.wait()
        reaper.close()
        print(orphan, int(owned.poll() is None), flush=True)
        owned.kill()
        """
    )
    out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=60)
    orphan, owned_alive = map(int, out.stdout.split())
    assert not _alive(orphan), out.stderr
    assert owned_alive == 1, out.stderr


def test_a_driver_that_started_to_exit_owns_nothing():
    """The reaper wakes when a killed driver's pipe closes, which happens before the kernel re-parents
    the driver's children: from then on the driver counts as gone (PF_EXITING), not as their owner."""
    from hybridflow.utils.process_reaper import exiting_or_gone

    assert not exiting_or_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not exiting_or_gone(child.pid) and time.monotonic() < deadline:  # a zombie until waited for
        time.sleep(0.05)
    assert exiting_or_gone(child.pid)
    child.wait()
    assert exiting_or_gone(child.pid)  # gone
