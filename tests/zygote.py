"""subprocess.run for `python SCRIPT.py ARGS`, served by a forked child of a process that has
already imported torch, diffusers and transformers (tests/zygote_server.py): the same script in a
real process of its own, minus the ~7.6 s of imports a trainer run spends on CI's two cores.

    result = zygote.run([sys.executable, "crd.py", *args], cwd=ROOT, env=env, timeout=600)

Anything else goes to subprocess.run as it is: a command that is not a Python script, stdin input,
or output not captured as text. The variables read while Python and those libraries start
(threads, devices, the hub, PYTHONPATH) are the server's own: each set of them gets a server of its
own, started at its first call in a test process and ended with it (at most MOST_SERVERS). A server
that cannot start in an environment (one whose sitecustomize blocks a library, say) leaves that
environment to fresh interpreters.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SERVER = Path(__file__).with_name("zygote_server.py")
# variables read when torch, diffusers or transformers import (or when Python starts): each set of
# them gets a server of its own
READ_AT_IMPORT = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA",
                  "NVIDIA", "HF_", "HUGGINGFACE", "TRANSFORMERS", "DIFFUSERS", "TOKENIZERS", "LD_",
                  "TRITON")
MOST_SERVERS = 3  # each holds the libraries (~1 GiB): further environments get fresh interpreters


def read_at_import(env: dict) -> frozenset:
    """The variables of env that the libraries or Python read as they start."""
    return frozenset((k, v) for k, v in env.items() if k.startswith(READ_AT_IMPORT))


class Server:
    def __init__(self, env: dict):
        self.process = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)
        self.failed = False  # it exited before its first reply: it cannot start in env
        atexit.register(self.close)

    def reply(self, timeout_s=None) -> dict | None:
        """The server's next line; None past timeout_s; {} once it has exited."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else None
        return None if line is None else json.loads(line) if line else {}

    def close(self):
        try:
            self.process.stdin.close()
        except BrokenPipeError:  # it exited with a request unread
            pass
        self.process.wait()


_servers = {}  # read_at_import(env): the server started with those variables


def run(cmd, *, cwd=None, env=None, timeout=None, check=False, capture_output=False, text=False,
        **kwargs):
    """subprocess.run(cmd, ...), with Python scripts run by the server where it can."""
    env = dict(os.environ if env is None else env)
    argv = [str(part) for part in cmd]
    script = len(argv) > 1 and argv[0] == sys.executable and argv[1].endswith(".py")
    if not (script and capture_output and text and not kwargs):
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, check=check,
                              capture_output=capture_output, text=text, **kwargs)
    key = read_at_import(env)
    if key not in _servers and len(_servers) < MOST_SERVERS or (
            key in _servers and _servers[key].process.poll() is not None
            and not _servers[key].failed):
        _servers[key] = Server(env)
    if key not in _servers or _servers[key].failed:
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, check=check,
                              capture_output=True, text=True)
    server = _servers[key]
    with tempfile.TemporaryDirectory() as outputs:
        out, err = Path(outputs) / "stdout", Path(outputs) / "stderr"
        request = {"argv": argv[1:], "cwd": str(cwd or os.getcwd()), "env": env,
                   "stdout": str(out), "stderr": str(err)}
        try:
            server.process.stdin.write(json.dumps(request) + "\n")
            server.process.stdin.flush()
        except BrokenPipeError:  # it has already exited: reply() says so
            pass
        started = server.reply()
        if not started:
            server.failed = True
            return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, check=check,
                                  capture_output=True, text=True)
        pid = started["pid"]
        ended = server.reply(timeout)
        if ended is None:
            os.kill(pid, signal.SIGKILL)
            server.reply()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out.read_text(errors="replace"),
                                            stderr=err.read_text(errors="replace"))
        result = subprocess.CompletedProcess(cmd, ended["returncode"], out.read_text(),
                                             err.read_text())
    if check:
        result.check_returncode()
    return result
