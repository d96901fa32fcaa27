"""`rollout.cpu_priority` (rl/run/cpu_priority.py): an async worker's serve thread, and the
threads it starts, at SCHED_IDLE while it serves; every other thread untouched; back after."""

from __future__ import annotations

import os
import threading

import pytest

from rl.config.runfile import load_config
from rl.run.cpu_priority import idle_supported, idle_thread, wants_idle

linux_only = pytest.mark.skipif(not idle_supported(), reason="SCHED_IDLE is Linux's")


@pytest.mark.parametrize(
    ("setting", "mode", "device", "idle"),
    [
        ("auto", "async", "cpu", True),
        ("auto", "async", "cuda", False),
        ("auto", "sync", "cpu", False),
        ("idle", "async", "cuda", True),
        ("idle", "sync", "cpu", False),
        ("normal", "async", "cpu", False),
    ],
)
def test_which_runs_serve_at_idle_priority(setting, mode, device, idle):
    assert wants_idle(setting, mode, device) is idle


def test_the_setting_defaults_to_auto_and_refuses_other_values():
    cfg = load_config("configs/quickstart.yaml")
    assert cfg.rollout.cpu_priority == "auto"
    with pytest.raises(Exception, match="cpu_priority"):
        load_config("configs/quickstart.yaml", ["rollout.cpu_priority=lowest"])


@linux_only
def test_the_serve_thread_and_its_children_run_idle_and_nothing_else_does():
    seen = {}

    def child():
        seen["child"] = os.sched_getscheduler(0)

    def serve():
        with idle_thread(True) as idle:
            seen["idle"] = idle
            seen["serve"] = os.sched_getscheduler(0)
            seen["main, meanwhile"] = os.sched_getscheduler(main)
            worker = threading.Thread(target=child)
            worker.start()
            worker.join()
        seen["serve, after"] = os.sched_getscheduler(0)

    main = threading.get_native_id()
    before = os.sched_getscheduler(0)
    thread = threading.Thread(target=serve)
    thread.start()
    thread.join()
    assert seen == {
        "idle": True,
        "serve": os.SCHED_IDLE,
        "main, meanwhile": before,
        "child": os.SCHED_IDLE,
        "serve, after": before,
    }


def test_off_changes_nothing():
    before = os.sched_getscheduler(0) if idle_supported() else None
    with idle_thread(False) as idle:
        assert idle is False
        if before is not None:
            assert os.sched_getscheduler(0) == before
