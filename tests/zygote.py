"""subprocess.run for `python SCRIPT.py ARGS`, served by a forked child of a process that has
already imported torch, diffusers and transformers (tests/zygote_server.py): the same script in a
real process of its own, minus the ~7.6 s of imports a trainer run spends on CI's two cores.

    result = zygote.run([sys.executable, "crd.py", *args], cwd=ROOT, env=env, timeout=600)

Anything else goes to subprocess.run as it is: a command that is not a Python script, stdin input,
output not captured as text, or an environment that differs from the server's in a variable read
while those libraries import (threads, devices, the hub, PYTHONPATH). The server starts on the first
call of each test process and ends with it.
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
# variables read when torch, diffusers or transformers import (or when Python starts): a command
# whose environment changes one of them runs in a fresh interpreter
READ_AT_IMPORT = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA",
                  "NVIDIA", "HF_", "HUGGINGFACE", "TRANSFORMERS", "DIFFUSERS", "TOKENIZERS", "LD_",
                  "TRITON")


class Server:
    def __init__(self):
        self.env = dict(os.environ)
        self.process = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=self.env)
        atexit.register(self.close)

    def serves(self, env: dict) -> bool:
        changed = {k for k in {*env, *self.env} if env.get(k) != self.env.get(k)}
        read_at_import = any(k.startswith(READ_AT_IMPORT) for k in changed)
        return self.process.poll() is None and not read_at_import

    def reply(self, timeout_s=None) -> dict | None:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        return json.loads(self.process.stdout.readline()) if ready else None

    def close(self):
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait()


_server = None


def run(cmd, *, cwd=None, env=None, timeout=None, check=False, capture_output=False, text=False,
        **kwargs):
    """subprocess.run(cmd, ...), with Python scripts run by the server where it can."""
    global _server
    env = dict(os.environ if env is None else env)
    argv = [str(part) for part in cmd]
    script = len(argv) > 1 and argv[0] == sys.executable and argv[1].endswith(".py")
    if not (script and capture_output and text and not kwargs):
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, check=check,
                              capture_output=capture_output, text=text, **kwargs)
    if _server is None or _server.process.poll() is not None:
        _server = Server()
    if not _server.serves(env):
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, check=check,
                              capture_output=True, text=True)
    with tempfile.TemporaryDirectory() as outputs:
        out, err = Path(outputs) / "stdout", Path(outputs) / "stderr"
        request = {"argv": argv[1:], "cwd": str(cwd or os.getcwd()), "env": env,
                   "stdout": str(out), "stderr": str(err)}
        _server.process.stdin.write(json.dumps(request) + "\n")
        _server.process.stdin.flush()
        pid = _server.reply()["pid"]
        ended = _server.reply(timeout)
        if ended is None:
            os.kill(pid, signal.SIGKILL)
            _server.reply()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out.read_text(errors="replace"),
                                            stderr=err.read_text(errors="replace"))
        result = subprocess.CompletedProcess(cmd, ended["returncode"], out.read_text(),
                                             err.read_text())
    if check:
        result.check_returncode()
    return result
