"""torchrun for the trainers, ending as a shell command should: one line and the shell's exit code, no traceback.

    python launch.py --standalone --nproc-per-node 2 crd.py [trainer args...]     # torchrun's own arguments

This is torch.distributed.run itself (torchrun), with two of its exceptions turned into an exit status:
- a signal to torchrun (SIGTERM from a scheduler or `timeout`, Ctrl-C's SIGINT): torchrun forwards it to the ranks,
  which finish the iteration together and save (see checkpoint.GracefulStop); then exit 128 + signal, as a process
  ended by it, where torchrun raises SignalException and exits 1 with a traceback;
- a rank that failed (it printed its own error): exit with its exit code, where torchrun prints a ~40-line
  ChildFailedError report.
torchrun kills ranks that are still running --shutdown-timeout seconds (default 30) after it forwarded a signal: give a
graceful stop the time of an iteration and a checkpoint (run.sh does).
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main


def exit_status(code):
    """The shell's status of a child's exit code (a negative code: killed by that signal)."""
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    try:
        main()
    except SignalException as stop:
        print(f"launch.py: stopped by {stop.sigval.name}, which torchrun forwarded to the ranks (they save at the end "
              "of their iteration)", file=sys.stderr, flush=True)
        sys.exit(128 + stop.sigval)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        code = exit_status(failure.exitcode)
        how = f"killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0 else f"exit code {code}"
        print(f"launch.py: rank {rank} of {error.name} failed ({how}); its error is printed above", file=sys.stderr,
              flush=True)
        sys.exit(code)
