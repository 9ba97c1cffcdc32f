"""Run `python cli.py ...` and `python -m <module> ...` commands as a user does, each in a fresh process, without paying
each time for the imports: torch, transformers, peft and lightning take about 20 of a short command's 30 seconds.

`Preloaded` starts this file as a server under the commands' environment. The server imports those libraries once
and forks one child per command; the child changes into the command's folder, points its standard streams at files,
sets `sys.argv` and `sys.path[0]` as the interpreter would, and runs the script or module as `__main__` (runpy), so
the command's own code, its `if __name__ == "__main__"` block, its atexit handlers and its exit status are a fresh
interpreter's. Only the libraries' import is shared, done under the same environment the command has.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

# what every command imports: the libraries, not the project's own modules, which each command runs afresh
LIBRARIES = ("torch", "transformers", "peft", "lightning", "lightning.pytorch.cli", "torchmetrics", "datasets")


class Preloaded:
    """A server process holding the imported libraries; `run` gives a finished command as `subprocess.run` would."""

    def __init__(self, env: dict[str, str], outputs: Path) -> None:
        """`env`: the commands' environment, the server's too; `outputs`: a folder for each command's stdout and
        stderr while it runs."""
        self.server = subprocess.Popen(
            [sys.executable, __file__], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.outputs = outputs

    def run(self, argv: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
        """Run `argv` (`[python, cli.py | -m module, *args]`) in `cwd`; killed after `timeout` seconds."""
        stdout, stderr = self.outputs / "stdout", self.outputs / "stderr"
        request = {"argv": argv[1:], "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr), "timeout": timeout}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        assert line, "the preloaded server died"
        return subprocess.CompletedProcess(argv, int(line), stdout.read_text(), stderr.read_text())

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


def run_as_main(request: dict) -> None:
    """In the forked child: become the command. Returns only by the command's own end (SystemExit or an exception,
    which the interpreter reports as it would)."""
    os.chdir(request["cwd"])
    for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # the requests' pipe stays the server's
    signal.alarm(request["timeout"])
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[0] = argv, os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


def serve() -> None:
    """Import the libraries, then fork a child per request line on stdin; answer each with its exit status."""
    for name in LIBRARIES:
        __import__(name)
    for line in sys.stdin:
        request = json.loads(line)
        if os.fork() == 0:
            run_as_main(request)
        _, status = os.wait()
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    serve()
