"""Library pages only startup used are dropped from the engine core and the server process
(memory.page_out_libraries), and what runs afterwards still works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from slotserve.memory import PAGE_OUT_ENV, library_resident_bytes, page_out_libraries
from tests.helpers import REPO, serve_process

# Which libtorch pages stay resident depends on every process that maps them, pytest's own
# included (collecting the whole suite imports torch): scripts/test.sh runs this file alone.
pytestmark = pytest.mark.serial

MIB = 2**20

# Imports torch, runs a few operators, pages out, runs them again: torch's import-time code
# leaves tens of MB of libtorch resident that the operators never read again.
_CHILD = """
import json, torch
from slotserve.memory import library_resident_bytes, page_out_libraries

def work():
    a = torch.arange(64 * 640, dtype=torch.float32).reshape(64, 640) / 1e4
    return float(torch.nn.functional.rms_norm(a @ a.T, (64,)).softmax(-1).sum())

first = work()
before = library_resident_bytes()
dropped = page_out_libraries()
after = library_resident_bytes()
again = work()
print(json.dumps({"before": before, "dropped": dropped, "after": after,
                  "after_work": library_resident_bytes(), "same": first == again}))
"""


def _child(env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), **env})
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _supported() -> bool:
    return sys.platform == "linux" and tuple(int(x) for x in os.uname().release.split(".")[:2]
                                             if x.isdigit()) >= (5, 4)


@pytest.mark.skipif(not _supported(), reason="MADV_PAGEOUT needs Linux 5.4+")
def test_page_out_drops_library_pages_and_operators_still_run() -> None:
    r = _child({})
    assert r["same"]
    assert r["before"] > 40 * MIB  # torch's import leaves this much of its libraries resident
    assert r["dropped"] > r["before"] / 2
    assert r["after"] < r["before"] / 2
    # What the operators need comes back; most of what the import touched does not.
    assert r["after_work"] < r["before"] / 2


def test_page_out_can_be_turned_off() -> None:
    r = _child({PAGE_OUT_ENV: "0"})
    assert r["dropped"] == 0 and r["same"]
    assert r["after"] > r["before"] * 0.9


def test_library_resident_bytes_reads_other_processes() -> None:
    assert library_resident_bytes(os.getpid()) == library_resident_bytes() > 0
    assert library_resident_bytes(2**22 + 7) == 0  # no such process: nothing, no error
    os.environ[PAGE_OUT_ENV] = "0"
    try:
        assert page_out_libraries() == 0
    finally:
        del os.environ[PAGE_OUT_ENV]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@pytest.mark.skipif(not _supported(), reason="MADV_PAGEOUT needs Linux 5.4+")
def test_served_engine_core_keeps_little_of_libtorch() -> None:
    with serve_process("--max-num-seqs", "2") as (proc, base):
        r = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"prompt": "To be, or not", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        cores = [c for c in _children(proc.pid) if library_resident_bytes(c, "libtorch_cpu.so") > 0]
        assert len(cores) == 1, "one engine core child with torch"
        # Without the page-out, importing torch alone leaves 70-125 MB of it resident.
        assert library_resident_bytes(cores[0], "libtorch_cpu.so") < 40 * MIB
        assert library_resident_bytes(proc.pid, "libtorch_cpu.so") == 0  # the front has no torch
