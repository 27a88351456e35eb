"""Launch :mod:`trainmem.measure_dist.worker` under torchrun and collect one result per rank."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from trainmem.errors import DistributedRunError

__all__ = ["DistributedRunError", "run_torchrun", "run_torchrun_many", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, read from Linux's /proc (empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # the process ended while we read
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_tree(pid: int) -> None:
    """Kill torchrun and its workers. Killing torchrun's session is not enough: torch's elastic agent
    starts each worker in a session of its own (``start_new_session`` in
    torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py,
    ``SubprocessHandler._popen``), so a worker outlives a killed agent,
    keeps our stdout/stderr pipes open, and ``communicate`` waits for its store timeout."""
    workers = _descendants(pid)  # read before the agent dies: its orphans are re-parented to init
    for target in (pid, *workers):
        try:
            if target == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _tail(text: str, limit: int = 6000) -> str:
    """The first worker traceback (torchrun's own summary comes last and hides it) and the end."""
    if len(text) <= limit:
        return text
    start = text.find("Traceback")
    head = text[start:start + limit - 1500] + "\n...\n" if start >= 0 else "...\n"
    return head + text[-1500:]


def run_torchrun(nproc: int, scenario: dict, timeout: float = 120) -> list[dict]:
    """Run ``scenario`` on ``nproc`` local gloo ranks; return their results sorted by rank.

    Raises :class:`DistributedRunError` carrying the workers' stderr when any rank fails, when
    the run exceeds ``timeout`` seconds (the whole process group is killed), or when a rank
    writes no result."""
    return run_torchrun_many(nproc, [scenario], timeout)[0]


def run_torchrun_many(nproc: int, scenarios: list[dict], timeout: float = 300) -> list[list[dict]]:
    """Run several scenarios in one launch (one process group, run in order): for each
    scenario, its per-rank results sorted by rank. Errors as :func:`run_torchrun`."""
    what = f"{nproc} ranks, strategies {[s.get('strategy') for s in scenarios]}"
    with tempfile.TemporaryDirectory(prefix="trainmem-dist-") as tmp:
        payload = json.dumps({"scenarios": scenarios, "out_dir": tmp})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
               "-m", "trainmem.measure_dist.worker", payload]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a process we could not see still holds the pipes
                out, err = "", "(no stderr: the pipes stayed open after the kill)"
            raise DistributedRunError(f"torchrun ({what}) exceeded {timeout} s; stderr:\n{_tail(err)}") from None
        if proc.returncode != 0:
            raise DistributedRunError(f"torchrun ({what}) exited with {proc.returncode}; "
                                      f"stderr:\n{_tail(err)}\nstdout:\n{_tail(out, 2000)}")
        per_rank = []
        for rank in range(nproc):
            path = Path(tmp) / f"rank{rank}.json"
            if not path.exists():
                raise DistributedRunError(f"rank {rank} wrote no result ({what}); stderr:\n{_tail(err)}")
            per_rank.append(json.loads(path.read_text()))
    return [sorted((r[i] for r in per_rank), key=lambda x: x["rank"]) for i in range(len(scenarios))]
