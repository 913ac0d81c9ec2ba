"""The engine core's child process: a fresh interpreter on one end of a socket pair.

Not multiprocessing's spawn: that re-imports the caller's main module in the child (for
`slotserve serve`, the CLI with FastAPI and uvicorn: ~18 MB the core never uses) and starts
multiprocessing's resource tracker, a third interpreter (~12 MB) that tracks nothing here. The
child gets the parent's `sys.path` first (so a plugin or test module the parent imports is
found as under spawn), then the pickled `(args, threads, log_level)`, and runs
`core_loop.run_engine_core_process` on the same connection. It dies with its parent (Linux:
PR_SET_PDEATHSIG), as a daemonic multiprocessing child would.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from slotserve.engine.args import EngineArgs


class EngineProcess:
    """The child and the parent's end of its connection (`conn`)."""

    def __init__(self, args: EngineArgs, threads: int | None, log_level: int) -> None:
        ours, theirs = socket.socketpair()
        code = f"from slotserve.engine.core_process import child_main; child_main({theirs.fileno()})"
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                        stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        # Readable once the child has exited, even if something inherited its end of the
        # socket (where pidfds exist: Linux 5.3+).
        self.sentinel: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self.sentinel = os.pidfd_open(self.process.pid)
        self.conn.send(list(sys.path))
        self.conn.send((args, threads, log_level))

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; negative: the signal that ended it (as multiprocessing)."""
        return self.process.poll()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def join(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def close(self) -> None:
        self.conn.close()
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


def child_main(fd: int) -> None:
    with contextlib.suppress(Exception):  # Linux: die with the parent, as a daemon child
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    conn = Connection(fd)
    sys.path[:] = conn.recv()
    payload: tuple[Any, ...] = conn.recv()
    from slotserve.engine.core_loop import run_engine_core_process

    run_engine_core_process(conn, *payload)
