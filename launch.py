"""torchrun for the trainers, ending as a shell command should: one line and the shell's exit code, no traceback.

    python launch.py --standalone --nproc-per-node 2 crd.py [trainer args...]     # torchrun's own arguments

This is torch.distributed.run itself (torchrun), with two of its exceptions turned into an exit status:
- a signal to torchrun (SIGTERM from a scheduler or `timeout`, Ctrl-C's SIGINT): torchrun forwards it to the ranks,
  which finish the iteration together and save (see distributed.GracefulStop); then exit 128 + signal, as a process
  ended by it, where torchrun raises SignalException and exits 1 with a traceback;
- a rank that failed (it printed its own error): exit with its exit code, where torchrun prints a ~40-line
  ChildFailedError report; a rank that stopped because a rank here or on another node got SIGTERM or SIGINT (exit
  143 or 130) is said to have stopped, not failed, and is not restarted under --max-restarts (a restart would wait
  the join timeout for the node that was stopped).
A --nproc-per-node torchrun cannot start (0, abc, gpu without GPUs) is one line before it starts, not its traceback;
so is a rendezvous that not every node joined in time (its join_timeout, at the start or at a restart), and a node
that found no rendezvous store to join (its host not started, or another address). While an agent waits for the
other nodes to join, where torchrun is silent, a line every quarter of the join timeout (at most every 30 s) says
how long it has waited. At a restart, a node of the last round whose agent is gone (it left
no heartbeat in the rendezvous) is waited for LOST_NODE_TIMEOUT seconds (30), not the join
timeout: then one line names it.
SIGUSR1 (a common Slurm pre-emption signal, `--signal=USR1@600`) stops the run as SIGTERM does: torchrun forwards
SIGTERM to the ranks, which save, and launch.py exits 143. With --max-restarts, launch.py gives each attempt's ranks a
store of their own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), so that a restart survives a killed rank 0.
torchrun kills ranks that are still running --shutdown-timeout seconds (default 30) after it forwarded a signal: give a
graceful stop the time of an iteration and a checkpoint (run.sh does).
At the end each node's agent waits for the others' (torch's exit barrier, 300 s): the ranks leave
together, so here it waits EXIT_BARRIER_TIMEOUT seconds (30), and an agent that never comes (killed,
or failed on its node) is one line. The agent that hosts the rendezvous store (is_host) then leaves
last, once every other agent has closed the rendezvous: its store ends with it, and torch let it go
first, so that another node's last store call failed (a warning, or C++ stack dumps).
"""

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from functools import partial

# the agent's own C++ warnings (a store socket's timeout at the exit barrier, a peer's store gone at
# the end): off before torch loads, and back to torch's default for the ranks it starts
AGENT_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL" not in os.environ
if AGENT_CPP_LOG_LEVEL:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"

import torch.distributed as dist  # noqa: E402
import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic_rendezvous  # noqa: E402
import torch.distributed.launcher.api as launcher_api  # noqa: E402
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID  # noqa: E402
from torch.distributed.elastic.agent.server.local_elastic_agent import (  # noqa: E402
    LocalElasticAgent)
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous.api import (  # noqa: E402
    RendezvousConnectionError, RendezvousTimeoutError)
from torch.distributed.elastic.rendezvous.utils import (  # noqa: E402
    _matches_machine_hostname, parse_rendezvous_endpoint)
from torch.distributed.elastic.utils import store as store_util  # noqa: E402
from torch.distributed.run import determine_local_world_size, main, parse_args  # noqa: E402

# a rank's exit code after the stop every rank agrees on when any rank gets SIGTERM or SIGINT (128 + signal)
AGREED_STOPS = (128 + signal.SIGTERM, 128 + signal.SIGINT)
STORE_HOST_WENT_AWAY = ("the node that hosts the rendezvous store (is_host=1, run.sh's NODE_RANK=0) "
                        "went away")
DEVICE_KINDS = ("auto", "cpu", "gpu", "xpu")  # torchrun's --nproc-per-node values for one worker per such device


def exit_status(code):
    """The shell's status of a child's exit code (a negative code: killed by that signal)."""
    return 128 - code if code < 0 else code


def check_nproc_per_node(value):
    """One line for a --nproc-per-node (or PET_NPROC_PER_NODE) that torchrun would fail on with a traceback."""
    def fail(reason):
        sys.exit(f"launch.py: error: --nproc-per-node {value}: {reason}")

    try:
        workers = determine_local_world_size(value)  # torchrun's own reading: a number, or a kind of device to count
    except ValueError as error:
        fail(str(error).rstrip(".") if value in DEVICE_KINDS  # gpu or xpu on a machine without them
             else f"not a number of processes, nor one of {', '.join(DEVICE_KINDS)}")
    if workers < 1:
        fail("must be at least 1")


def seconds_above_0(value, name):
    """value as a number of seconds above 0, or one line naming the setting."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        sys.exit(f"launch.py: error: {name}={value}: not a number of seconds above 0")
    return seconds


def exit_barrier_timeout():
    """EXIT_BARRIER_TIMEOUT's seconds (30 by default), or one line."""
    return seconds_above_0(os.environ.get("EXIT_BARRIER_TIMEOUT", "30"), "EXIT_BARRIER_TIMEOUT")


def lost_node_timeout():
    """LOST_NODE_TIMEOUT's seconds (30 by default), or one line."""
    return seconds_above_0(os.environ.get("LOST_NODE_TIMEOUT", "30"), "LOST_NODE_TIMEOUT")


def rdzv_settings(rdzv_conf):
    """torchrun's --rdzv-conf (key=value,...) as a dict."""
    return dict(pair.split("=", 1) for pair in rdzv_conf.split(",") if "=" in pair)


def hosts_rendezvous_store(args):
    """Whether this agent hosts the c10d rendezvous store, as torch decides: its is_host, else
    whether the endpoint names this machine (a second agent here, which then finds the port taken
    and joins as a client, waits at the end as the host does, and is woken with it)."""
    if args.rdzv_backend != "c10d":
        return False  # etcd's store outlives every agent; static is not used here
    is_host = rdzv_settings(args.rdzv_conf).get("is_host")
    if is_host is not None:
        return is_host.lower() in ("1", "true", "t", "yes", "y")  # torch's reading of the value
    try:
        host, _ = parse_rendezvous_endpoint(args.rdzv_endpoint, 29400)
    except ValueError:
        return False  # torchrun reports the endpoint itself, as before
    return _matches_machine_hostname(host)


def join_timeout(rdzv_conf):
    """The join timeout of torchrun's --rdzv-conf (key=value,...), 600 s where it names none."""
    value = rdzv_settings(rdzv_conf).get("join_timeout", "600")
    return seconds_above_0(value, "--rdzv-conf join_timeout")


@contextmanager
def lines_while_waiting(what, timeout_s, joined=lambda: ""):
    """A line to stderr every quarter of timeout_s (at most every 30 s) until the block ends, with
    joined(), who has joined so far, after it."""
    every_s = min(30.0, timeout_s / 4)
    began = time.monotonic()
    done = threading.Event()

    def say():
        while not done.wait(every_s):
            print(f"launch.py: {what}: {time.monotonic() - began:.0f} s of {timeout_s:g} s{joined()}",
                  file=sys.stderr, flush=True)

    thread = threading.Thread(target=say, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def rendezvous_state(handler):
    """The c10d rendezvous's state as this agent last read it (its round's participants, complete
    or not, and the nodes waiting for the next round); None where it cannot be read (another
    backend, a torch that keeps it elsewhere)."""
    return getattr(getattr(handler, "_state_holder", None), "state", None)


def lost_nodes(state, last_round, this):
    """The last round's nodes, other than this one, that left no heartbeat in the rendezvous and
    have not joined again: their agent is gone (torch drops a node's heartbeat once it is older
    than keep_alive_interval x keep_alive_max_attempt, 15 s by default; a live agent beats while
    its ranks restart)."""
    present = {*state.participants, *state.wait_list, *state.last_heartbeats}
    return [node for node in last_round if node != this and node not in present]


def node_names(nodes, this=None):
    """"host (pid N), ..." of rendezvous nodes (pid: the node's agent)."""
    return ", ".join(f"{node.addr} (pid {node.pid}{', this node' if node == this else ''})"
                     for node in nodes)


class NodeLost(Exception):
    """A node of the last round whose agent is gone was not back in LOST_NODE_TIMEOUT seconds."""


def nodes_joined(handler, last_round=()):
    """"; joined so far: host (pid N), ..." of the nodes in the round this agent waits in (this
    node among them, marked), and "; not back from the last round: ..." of the last round's
    nodes that have not joined again (at a restart: a node lost or stopped); "" where it cannot
    be read."""
    state = rendezvous_state(handler)
    if state is None:
        return ""
    # a complete round's nodes stay in it until each leaves (or is found dead): at a restart, the
    # nodes that joined wait for the next round
    nodes = list(state.wait_list if state.complete else state.participants)
    this = getattr(handler, "_this_node", None)
    missing = [node for node in last_round if node not in nodes]
    lost = lost_nodes(state, last_round, this)
    gone = f"; not back from the last round: {node_names(missing)}" if missing else ""
    dead = f" (no heartbeat: {node_names(lost)})" if lost else ""
    return f"; joined so far: {node_names(nodes, this) or 'none'}{gone}{dead}"


class TrainerAgent(LocalElasticAgent):
    """torchrun's agent, except that ranks that ended in the stop they all agreed on (a signal to a
    rank, here or on another node) are not restarted: the run was asked to stop, and a restart
    would wait its join timeout for the node that was stopped; and that it says how long it has
    waited for the other nodes to join the rendezvous."""

    joined = False  # this node has met the others once: a store that stops answering went away
    lost_store = False  # the rendezvous could not be closed: its store's host had gone

    def __init__(self, *args, waiting_line, join_timeout_s, lost_node_timeout_s, hosts_store,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting_line, self.join_timeout_s = waiting_line, join_timeout_s
        self.lost_node_timeout_s = lost_node_timeout_s
        self.hosts_store, self.met_at_exit = hosts_store, False
        self.last_round = []  # the last rendezvous round's nodes: a restart names those missing
        # torchrun's launcher shuts the rendezvous down after run() returns: this agent's last
        # use of the store, after which the host may take it away
        handler = self._worker_group.spec.rdzv_handler
        handler.shutdown = partial(self._close_rendezvous, handler.shutdown)

    def _rendezvous(self, worker_group):
        handler = worker_group.spec.rdzv_handler
        last_round = self.last_round
        with lines_while_waiting(self.waiting_line, self.join_timeout_s,
                                 lambda: nodes_joined(handler, last_round)), \
                self._stop_waiting_for_lost_nodes(handler, last_round):
            super()._rendezvous(worker_group)
        TrainerAgent.joined = True
        state = rendezvous_state(handler)
        self.last_round = list(state.participants) if state else []

    @contextmanager
    def _stop_waiting_for_lost_nodes(self, handler, last_round):
        """While this agent waits in the rendezvous: NodeLost once a node of the last round whose
        agent is gone has not joined again LOST_NODE_TIMEOUT seconds after the wait began (it does
        not come back by itself); the join timeout still bounds a wait for nodes alive elsewhere."""
        executor = getattr(handler, "_op_executor", None)
        if executor is None or not last_round:
            yield  # the first round, or a rendezvous backend without torch's state: join timeout
            return
        began = time.monotonic()
        run = executor.run

        def run_watched(state_handler, deadline, *rest):
            def step(ctx, deadline):
                lost = lost_nodes(ctx.state, last_round, ctx.node)
                if lost and time.monotonic() - began > self.lost_node_timeout_s:
                    raise NodeLost(node_names(lost))
                return state_handler(ctx, deadline)
            return run(step, deadline, *rest)

        executor.run = run_watched
        try:
            yield
        finally:
            del executor.run  # the class's own again

    def _exit_barrier(self):
        """torch's exit barrier, where an agent that never came is one line, not a traceback."""
        self._in_exit_barrier = True  # torch's health check counts the agent alive meanwhile
        try:
            store_util.barrier(self._store, self._worker_group.group_world_size,
                               _TERMINAL_STATE_SYNC_ID, self._exit_barrier_timeout)
            self.met_at_exit = True
        except dist.DistError as error:
            self._say_peer_lost(error, "during the exit barrier", "did not finish")
        finally:
            self._in_exit_barrier = False

    def _close_rendezvous(self, shutdown):
        """The rendezvous's shutdown; after an exit barrier every agent came to, each agent then
        counts itself out, and the host of the store waits until all have (EXIT_BARRIER_TIMEOUT)."""
        logger = dynamic_rendezvous.logger
        logger.disabled = True  # its warning that the store's host has gone: launch.py says it
        try:
            closed = shutdown()
        finally:
            logger.disabled = False
        TrainerAgent.lost_store = not closed
        nodes = self._worker_group.group_world_size
        if not closed or not self.met_at_exit or nodes < 2:
            return closed
        left, everyone_left = "launch.py/left", "launch.py/everyone_left"
        try:
            with store_util.store_timeout(self._store, self._exit_barrier_timeout):
                if self._store.add(left, 1) == nodes:
                    self._store.set(everyone_left, "")
                if self.hosts_store:
                    self._store.wait([everyone_left])
        except dist.DistError as error:
            self._say_peer_lost(error, "before this node closed the rendezvous",
                                "did not close the rendezvous after the exit barrier")
        return closed

    def _say_peer_lost(self, error, when, what_it_did_not):
        """One line for a store call at the end that failed: the store's host gone (a network
        error) or, where it timed out, another node's agent that never came."""
        if isinstance(error, dist.DistNetworkError):
            print(f"launch.py: {STORE_HOST_WENT_AWAY} {when}: its agent was killed; this node's "
                  "ranks ended", file=sys.stderr, flush=True)
        else:
            print(f"launch.py: another node's agent {what_it_did_not} in "
                  f"{self._exit_barrier_timeout:g} s (EXIT_BARRIER_TIMEOUT): it was killed or its "
                  "ranks failed; this node's ranks ended", file=sys.stderr, flush=True)

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and all(failure.exitcode in AGREED_STOPS
                                      for failure in result.failures.values()):
            self._remaining_restarts = 0
        return result


def stop_on_usr1(signum, frame):
    """SIGUSR1: torchrun's way of stopping on SIGTERM (it forwards SIGTERM to the ranks)."""
    stop_on_usr1.received = True
    raise SignalException(f"Process {os.getpid()} got signal: SIGUSR1", sigval=signal.SIGTERM)


stop_on_usr1.received = False


if __name__ == "__main__":
    if AGENT_CPP_LOG_LEVEL:
        del os.environ["TORCH_CPP_LOG_LEVEL"]  # this process read it when torch loaded
    torchrun_args = parse_args(sys.argv[1:])  # torchrun's parser: every spelling of a flag
    check_nproc_per_node(torchrun_args.nproc_per_node)
    if torchrun_args.max_restarts > 0:
        # in the agent's store, which outlives an attempt, a restarted rank can read the dead rank
        # 0's gloo/NCCL address before the new rank 0 writes its own (pytorch/pytorch#135712)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    signal.signal(signal.SIGUSR1, stop_on_usr1)  # torchrun handles TERM, INT, HUP and QUIT only
    # the ranks leave together (a barrier before they exit), so every node's agent reaches the
    # exit barrier within seconds of the others: the class torchrun's launcher builds agents of
    barrier_s, lost_s = exit_barrier_timeout(), lost_node_timeout()
    waiting = (f"waiting for every one of the {torchrun_args.nnodes} nodes to join the rendezvous at "
               f"{torchrun_args.rdzv_endpoint} (its join timeout: --rdzv-conf join_timeout, run.sh's JOIN_TIMEOUT)")
    launcher_api.LocalElasticAgent = partial(TrainerAgent, exit_barrier_timeout=barrier_s, waiting_line=waiting,
                                             join_timeout_s=join_timeout(torchrun_args.rdzv_conf),
                                             lost_node_timeout_s=lost_s,
                                             hosts_store=hosts_rendezvous_store(torchrun_args))
    try:
        main()
    except SignalException as stop:
        name = "SIGUSR1 (handled as SIGTERM)" if stop_on_usr1.received else stop.sigval.name
        print(f"launch.py: stopped by {name}, which torchrun forwarded to the ranks (they save at the end of their "
              "iteration)", file=sys.stderr, flush=True)
        sys.exit(128 + stop.sigval)
    except RendezvousConnectionError:
        if TrainerAgent.joined:
            print(f"launch.py: error: {STORE_HOST_WENT_AWAY} during the run: its agent was killed "
                  "or its machine lost; this node's ranks were stopped. Start every node again: "
                  "--resume-from latest continues from the last checkpoint", file=sys.stderr,
                  flush=True)
            sys.exit(1)
        print(f"launch.py: error: no rendezvous store answered at {torchrun_args.rdzv_endpoint} in its read timeout "
              "(--rdzv-conf read_timeout, 60 s by default): the node that hosts it (is_host=1, run.sh's NODE_RANK=0) "
              "is not running there; start it, or check the address (run.sh's MASTER_ADDR and MASTER_PORT)",
              file=sys.stderr, flush=True)
        sys.exit(1)
    except NodeLost as lost:
        print(f"launch.py: error: {lost} of the last rendezvous round was lost: its agent left no "
              f"heartbeat and it did not join again in {lost_s:g} s (LOST_NODE_TIMEOUT); a lost "
              "node does not come back by itself: start every node again, and --resume-from "
              "latest continues the run", file=sys.stderr, flush=True)
        sys.exit(1)
    except RendezvousTimeoutError:
        print(f"launch.py: error: not every one of the {torchrun_args.nnodes} nodes joined the rendezvous at "
              f"{torchrun_args.rdzv_endpoint} in its join timeout (--rdzv-conf join_timeout, run.sh's JOIN_TIMEOUT): a "
              "node that stopped or was lost does not come back by itself; start every node again, and "
              "--resume-from latest continues the run", file=sys.stderr, flush=True)
        sys.exit(1)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        code = exit_status(failure.exitcode)
        if failure.exitcode in AGREED_STOPS:  # the trainers' exit after a signal to any rank: a stop, not a failure
            name = signal.Signals(failure.exitcode - 128).name
            print(f"launch.py: stopped by {name} to a rank of the run, here or on another node (exit code {code}): "
                  "every rank stopped after the same iteration, which rank 0 saved", file=sys.stderr, flush=True)
            sys.exit(code)
        how = f"killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0 else f"exit code {code}"
        print(f"launch.py: rank {rank} of {error.name} failed ({how}); its error is printed "
              "above. Once it is fixed, --resume-from latest (on every node) continues from the "
              "run's latest checkpoint", file=sys.stderr, flush=True)
        sys.exit(code)
    else:
        if TrainerAgent.lost_store:
            print(f"launch.py: {STORE_HOST_WENT_AWAY} before this node closed the rendezvous; "
                  "this node's ranks had ended", file=sys.stderr, flush=True)
