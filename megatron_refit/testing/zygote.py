"""Processes that run ``python -m MODULE ARGS`` forked from one that imported torch once, for
tests that start many short processes as a launcher would and then signal, stop or kill them
(``tests/mp/test_shutdown.py``: 20 processes, each of which spent 3-4 CPU-s importing torch on 2
cores, most of its life).

The zygote is ``python -c`` :data:`_SERVER`: it imports the modules it is given, then forks one
child per request, single-threaded (no thread to lose in a fork). A child sends its standard
output and error to the files the request names, takes the request's environment, and runs the
module as ``__main__`` with ``runpy``; whatever ends it then ends it as it ends ``python -m``: a
return or ``SystemExit`` through the interpreter's own finalization (``atexit``, thread joins,
the C++ destructors a fresh process would run), an uncaught ``KeyboardInterrupt`` by SIGINT, a
signal's default action. The zygote reaps its children and reports each exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SERVER = r"""
import importlib, json, os, runpy, select, signal, sys
for _m in sys.argv[1:]:
    importlib.import_module(_m)
print(json.dumps({"ready": True}), flush=True)
_child = None
while _child is None:
    _r, _, _ = select.select([sys.stdin], [], [], 0.05)
    while True:
        try:
            _pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if _pid == 0:
            break
        print(json.dumps({"exit": _pid, "code": os.waitstatus_to_exitcode(_status)}), flush=True)
    if not _r:
        continue
    _line = sys.stdin.readline()
    if not _line:
        break
    _req = json.loads(_line)
    sys.stdout.flush()
    sys.stderr.flush()
    _pid = os.fork()
    if _pid:
        print(json.dumps({"started": _pid, "id": _req["id"]}), flush=True)
        continue
    _child = _req
if _child is None:  # stdin closed: the zygote's work is done
    sys.exit(0)
for _fd, _path in ((1, _child["stdout"]), (2, _child["stderr"])):
    _f = os.open(_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(_f, _fd)
    os.close(_f)
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
os.environ.update(_child["env"])
sys.argv = [_child["module"], *_child["argv"]]
runpy.run_module(_child["module"], run_name="__main__", alter_sys=True)
"""


class Zygote:
    """One zygote process (``preload``: modules it imports once) and the children it forked."""

    def __init__(self, preload: list[str], env: dict[str, str], timeout_s: float = 60.0):
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, *preload], cwd=ROOT, env=env, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._cond = threading.Condition()
        self._started: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._ready = False
        self._next = 0
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._proc.poll() is not None, timeout_s):
                raise TimeoutError(f"the zygote did not import {preload} within {timeout_s} s")
        if not self._ready:
            raise RuntimeError(f"the zygote exited with {self._proc.returncode} importing {preload}")

    def _read(self) -> None:
        for line in self._proc.stdout:
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            with self._cond:
                if "ready" in msg:
                    self._ready = True
                elif "started" in msg:
                    self._started[msg["id"]] = msg["started"]
                elif "exit" in msg:
                    self._exits[msg["exit"]] = msg["code"]
                self._cond.notify_all()

    def start(self, module: str, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path,
              timeout_s: float = 10.0) -> Child:
        """Fork ``python -m module *argv``; its output goes to the two files."""
        with self._cond:
            ident, self._next = self._next, self._next + 1
            self._proc.stdin.write(json.dumps(dict(id=ident, module=module, argv=argv, env=env, stdout=str(stdout),
                                                   stderr=str(stderr))) + "\n")
            self._proc.stdin.flush()
            if not self._cond.wait_for(lambda: ident in self._started, timeout_s):
                raise TimeoutError(f"the zygote did not fork {module} {argv} within {timeout_s} s")
            return Child(self, self._started[ident])

    def exit_code(self, pid: int, timeout_s: float) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout_s)
            return self._exits.get(pid)

    def close(self) -> None:
        """Stop the zygote (its children are the caller's to end first)."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)


class Child:
    """A forked child, as much of ``subprocess.Popen`` as the tests use (:meth:`wait` raises
    ``TimeoutError``)."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid, 0)

    def wait(self, timeout: float | None = None) -> int:
        code = self.zygote.exit_code(self.pid, 1e9 if timeout is None else timeout)
        if code is None:
            raise TimeoutError(f"the zygote's child {self.pid} did not exit within {timeout} s")
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


def tail(path: Path, stop: threading.Event, on_line, poll_s: float = 0.05) -> None:
    """Call ``on_line`` with each line written to ``path`` until ``stop`` is set and the file
    has no more."""
    while not path.exists() and not stop.is_set():
        time.sleep(poll_s)
    if not path.exists():
        return
    with open(path) as f:
        pending = ""
        while True:
            chunk = f.readline()
            if chunk:
                pending += chunk
                if pending.endswith("\n"):
                    on_line(pending)
                    pending = ""
                continue
            if stop.is_set():
                return
            time.sleep(poll_s)
