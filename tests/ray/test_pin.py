"""A replica binds its engine core to cores of its own, chosen by its rank on the node (no
cluster: a real child process stands in for the engine core)."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from slotserve.ray.server import pin_engine  # noqa: E402


def test_each_rank_gets_its_own_cores_and_nothing_is_pinned_past_them() -> None:
    cores = sorted(os.sched_getaffinity(0))
    proc = subprocess.Popen(["sleep", "30"])
    try:
        core = SimpleNamespace(pid=proc.pid)
        for rank in range(len(cores)):
            assert pin_engine(core, SimpleNamespace(local_rank=rank), 1) == [cores[rank]]
            assert os.sched_getaffinity(proc.pid) == {cores[rank]}
        os.sched_setaffinity(proc.pid, cores)
        # A rank whose cores are not there, no rank (an older Ray), no process: left alone.
        assert pin_engine(core, SimpleNamespace(local_rank=len(cores)), 1) == []
        assert pin_engine(core, SimpleNamespace(local_rank=0), len(cores) + 1) == []
        assert pin_engine(core, None, 1) == []
        assert pin_engine(SimpleNamespace(), SimpleNamespace(local_rank=0), 1) == []
        assert os.sched_getaffinity(proc.pid) == set(cores)
    finally:
        proc.kill()
        proc.wait()
