"""Tests that test_signals.py runs in a pytest of its own and stops there with SIGTERM.

Not named ``test_*``: the suite does not collect it. ``SIGTERM_PROBE_READY`` names the file
that tells the parent when the test that waits for the signal is running.
"""
import os
import signal
import sys
import time
from pathlib import Path

import pytest


def _wait_for_the_signal():
    Path(os.environ["SIGTERM_PROBE_READY"]).write_text(str(os.getpid()))
    time.sleep(60)


def _install_rays_handler():
    """What ``ray.init`` installs, and ``ray.shutdown`` leaves in place (the real one costs a Ray start)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))


@pytest.fixture
def ray_started():
    _install_rays_handler()


def test_ray_starts_in_a_fixture(ray_started):
    pass


def test_ray_starts_in_this_test():
    _install_rays_handler()
    _wait_for_the_signal()


def test_the_signal_lands_in_a_later_test():
    _wait_for_the_signal()


def test_no_test_runs_after_the_signal():
    Path(os.environ["SIGTERM_PROBE_READY"]).with_name("ran-after").touch()
    time.sleep(60)
