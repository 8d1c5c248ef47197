"""A process that has imported the trainers' libraries and forks a child for each script it is asked
to run (tests/zygote.py): the child then runs the script as `python SCRIPT ARGS` would, in the cwd
and environment asked, its stdout and stderr in the files named, without importing torch,
diffusers and transformers again (about 7.6 s of a tiny run's 14 s on two CPU cores).

Requests are JSON lines on stdin; for each, a line {"pid": N} once the child runs and a line
{"returncode": R} once it has ended (R: subprocess.run's returncode).
"""

import atexit
import builtins
import json
import os
import sys
import threading
import types

# what the trainers, evaluate.py and their modules import, and nothing else (a library's import may
# set warning filters or loggers: those are the ones a fresh `python crd.py` has too)
import numpy  # noqa: F401
import peft  # noqa: F401
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
import tyro  # noqa: F401
from diffusers import StableDiffusion3Pipeline  # noqa: F401
from PIL import Image  # noqa: F401
from torch.utils.tensorboard import SummaryWriter  # noqa: F401
from transformers import CLIPTextModelWithProjection, T5EncoderModel  # noqa: F401


def exit_code(code) -> int:
    """The exit status of SystemExit(code), as the interpreter gives it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_script(request: dict) -> int:
    """In the forked child: the script as __main__, then the interpreter's own shutdown steps."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdin = open(0, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script, *args = request["argv"]
    sys.argv = [script, *args]
    path = os.path.abspath(script)
    sys.path[0] = os.path.dirname(path)
    try:
        # as the interpreter runs a script: a __main__ of its own, sys.argv left as the script sets
        # it (runpy.run_path would put back argv[0] before an error's hook reads it)
        with open(path, "rb") as source:
            program = compile(source.read(), path, "exec")
        main = types.ModuleType("__main__")
        main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins)
        sys.modules["__main__"] = main
        exec(program, main.__dict__)
        code = 0
    except SystemExit as stop:
        code = exit_code(stop.code)
    except BaseException as error:
        trace = error.__traceback__
        while trace and trace.tb_frame.f_code.co_filename != path:
            trace = trace.tb_next  # this file's frame, which `python SCRIPT` has not
        error.__traceback__ = trace or error.__traceback__
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
    threading._shutdown()  # as the interpreter does at exit: wait for non-daemon threads
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main():
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = run_script(request)
            finally:
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
