"""Several nodes, simulated on one host, and runs that continue by themselves: run.sh's torchrun
launch with NNODES > 1 (c10d rendezvous on 127.0.0.1), a SIGTERM to one node, a rank killed under
MAX_RESTARTS, and `--resume-from latest` (run_dirs.resolve_latest).

Each "node" is one `bash run.sh crd` (torchrun's agent, one CPU rank, gloo) on the tiny model. What
this cannot show is a real network between hosts: every process here talks over the loopback.
"""

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import checkpoint
import crd
import run_dirs
from settings import with_settings
from test_distributed import DIST_ENV, ROOT, TIMEOUT, TINY_RUN, adapters
from test_hardening import lora_transformer, saved_run  # noqa: F401 (a fixture, used by name)
from test_run_sh import fake_tools, free_port

ITERATIONS = 3  # the uninterrupted runs; the interrupted ones stop or lose a rank before the last


def run_env(tmp_path, tiny_model_dir, out):
    """run.sh's environment for tiny CPU runs in `out`: this host as it is (--device cpu on a host
    without GPUs: NUM_GPUS_ACTOR_ROLLOUT CPU ranks), no reward server (the runs score brightness),
    run `run` continued by --resume-from latest."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(PYTHON=sys.executable, CRD_CACHE=str(tiny_model_dir.parent), OUTPUT_DIR=str(out),
               NUM_GPUS_REWARD="0", OMP_NUM_THREADS="1", RUN_NAME="run", STOP_TIMEOUT="60")
    return env


def start(env, log, *extra, **overrides):
    """`bash run.sh crd` (which execs torchrun's agent) in a session of its own, its output in
    log.out and log.err (files: two nodes' pipes would fill while one is read): the process."""
    cmd = ["bash", "run.sh", "crd", *TINY_RUN, "--prompts-per-rank", "1", *map(str, extra)]
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, env={**env, **overrides}, stdout=out, stderr=err,
                                start_new_session=True)


def two_nodes(env, log, *extra, **overrides):
    """Two agents, as NODE_RANK 0 and 1 of NNODES=2, meeting at 127.0.0.1 on a free port."""
    port = str(free_port())
    return [start(env, f"{log}{rank}", *extra, NNODES="2", NODE_RANK=str(rank), MASTER_PORT=port,
                  **overrides) for rank in (0, 1)]


def finish(processes, log_names):
    """Wait for every process (each killed with its session at the timeout): [(exit status, stdout,
    stderr)]."""
    deadline = time.time() + TIMEOUT
    results = []
    for process, log in zip(processes, log_names):
        try:
            process.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for other in processes:
                os.killpg(other.pid, signal.SIGKILL)
            raise AssertionError(f"{log}: timed out after {TIMEOUT} s:\n"
                                 f"{open(f'{log}.err').read()[-3000:]}") from None
        results.append((process.returncode, open(f"{log}.out").read(), open(f"{log}.err").read()))
    return results


def succeed(processes, log_names):
    results = finish(processes, log_names)
    for (code, _, err), log in zip(results, log_names):
        assert code == 0, f"{log} failed ({code}):\n{err[-3000:]}"
    return results


def wait_for(path_glob, run_dir, what):
    deadline = time.time() + TIMEOUT
    while not list(run_dir.glob(path_glob)):
        assert time.time() < deadline, f"no {what} in {run_dir} after {TIMEOUT} s"
        time.sleep(0.05)


def training_scalars(run_dir):
    """{tag: {step: value}} of every scalar but the timings (perf/)."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {s.step: s.value for s in events.Scalars(tag)} for tag in events.Tags()["scalars"]
            if not tag.startswith("perf/")}


def assert_same_training(run_dir, expected_dir):
    """Bitwise the same adapters after the last iteration, and the same logged values."""
    ours, theirs = adapters(run_dir, ITERATIONS), adapters(expected_dir, ITERATIONS)
    assert ours.keys() == theirs.keys()
    assert [key for key in ours if not torch.equal(ours[key], theirs[key])] == []
    logged, expected = training_scalars(run_dir), training_scalars(expected_dir)
    assert logged == expected and max(logged["losses/loss"]) == ITERATIONS


@pytest.fixture(scope="session")
def one_node(tiny_model_dir, tmp_path_factory):
    """The uninterrupted run: one node of 2 ranks, ITERATIONS iterations. Run once a session: the
    xdist workers share it through a lock (a module fixture would run on every worker)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    shared = tmp_path_factory.getbasetemp().parent if worker else tmp_path_factory.mktemp("one")
    base = shared / "multinode_one_node"
    with open(shared / "multinode_one_node.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "runs" / "run" / "summary.json").is_file():
            shutil.rmtree(base, ignore_errors=True)  # a failed attempt's
            base.mkdir()
            env = run_env(base, tiny_model_dir, base / "runs")
            succeed([start(env, base / "node", "--num-iterations", ITERATIONS,
                           NUM_GPUS_ACTOR_ROLLOUT="2")], [base / "node"])
    return base / "runs" / "run"


# A sitecustomize.py for one node: its agent closes the rendezvous CLOSE_LATE_S (1) s late, as on a
# loaded host. torch is patched as it loads, not imported here (launch.py sets its C++ log level first).
LATE_CLOSE = """
import importlib.abc, importlib.machinery, os, sys, time

class LateClose(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.distributed.elastic.rendezvous.dynamic_rendezvous":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            handler = module.DynamicRendezvousHandler
            shutdown = handler.shutdown
            late_s = float(os.environ.get("CLOSE_LATE_S", "1"))
            handler.shutdown = lambda self: time.sleep(late_s) or shutdown(self)

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, LateClose())
"""
# what a clean finish must not print: a traceback, torch's C++ warnings and their stack dumps,
# and torch's own log lines (a rendezvous that failed to close)
DUMPS = re.compile(r"Traceback|^\[W|Exception raised from|^frame #|terminate called|c10::|"
                   r"^[WE]\d{4} |failed to shutdown", re.M)


def test_two_nodes_train_bitwise_like_one_node_of_two_ranks(one_node, tiny_model_dir, tmp_path):
    """Also a start of --resume-from latest (run.sh passes it with RUN_NAME) on a new directory,
    and a clean finish that prints no traceback, C++ stack dump or torch warning on either node,
    torch's C++ warnings on. Node 1's agent closes the rendezvous 1 s late: torch let the host's
    agent leave at once, its store with it, and node 1 then warned (with C++ stack dumps) in every
    finish so delayed, and in some without the delay."""
    env = run_env(tmp_path, tiny_model_dir, tmp_path / "runs")
    logs = [tmp_path / "node0", tmp_path / "node1"]
    (tmp_path / "late").mkdir()
    (tmp_path / "late" / "sitecustomize.py").write_text(LATE_CLOSE)
    late = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "late"),
                                                        env.get("PYTHONPATH")]))}
    port = str(free_port())
    nodes = [start(env, logs[rank], "--num-iterations", ITERATIONS, NNODES="2", NODE_RANK=str(rank),
                   MASTER_PORT=port, TORCH_CPP_LOG_LEVEL="WARNING", **(late if rank else {}))
             for rank in (0, 1)]
    results = succeed(nodes, logs)
    for _, out, err in results:
        assert not DUMPS.search(out + err), (out + err)[-3000:]
    commands = [line for _, out, _ in results for line in out.splitlines() if line.startswith("+ ")]
    for rank, command in enumerate(commands):
        assert "launch.py --nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:" in command
        assert f"--rdzv-id run --rdzv-conf is_host={int(rank == 0)},join_timeout=600 " in command
        assert " --run-name run --resume-from latest " in command
    run = tmp_path / "runs" / "run"
    assert "--resume-from latest: no checkpoint in" in results[0][1] + results[1][1]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    assert_same_training(run, one_node)


def test_sigterm_to_one_node_stops_both_and_one_node_resumes_bitwise(one_node, tiny_model_dir,
                                                                       tmp_path):
    """SIGTERM to node 0's agent alone (which hosts the rendezvous): it forwards the signal to its
    rank, and the agreed stop (an all-reduce) stops node 1's rank after the same iteration, which
    rank 0 saves. One node of 2 ranks then continues from it, bitwise."""
    env = run_env(tmp_path, tiny_model_dir, tmp_path / "runs")
    run = tmp_path / "runs" / "run"
    nodes = two_nodes(env, tmp_path / "node", "--num-iterations", 1000, "--save-every", 1000)
    wait_for("events.*", run, "TensorBoard events")  # the first iteration starts
    os.kill(nodes[0].pid, signal.SIGTERM)
    (code0, _, err0), (code1, _, err1) = finish(nodes, [tmp_path / "node0", tmp_path / "node1"])
    assert code0 == code1 == 143, (err0[-3000:], err1[-3000:])  # node 1's rank: the agreed SIGTERM
    assert "Traceback" not in err0 + err1, (err0[-3000:], err1[-3000:])
    assert "launch.py: stopped by SIGTERM, which torchrun forwarded to the ranks" in err0
    assert err1.strip().splitlines()[-1] == (
        "launch.py: stopped by SIGTERM to a rank of the run, here or on another node (exit code 143): "
        "every rank stopped after the same iteration, which rank 0 saved")
    (saved,) = run.glob("*global_step_*")  # one, complete (no temporary directory left)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped_by"] == "SIGTERM"
    assert summary["iterations"] == int(saved.name.split("_")[-1]) < ITERATIONS
    # rank 0, on either node, names the one rank the signal reached (node 0's) and its host
    said = re.findall(r"^crd\.py: SIGTERM reached rank ([01]) on (.+): every rank stopped after iteration "
                      rf"{summary['iterations']}; --resume-from latest continues$", err0 + err1, re.M)
    assert len(said) == 1 and said[0][1] == socket.gethostname(), (err0[-3000:], err1[-3000:])
    resumed = succeed([start(env, tmp_path / "resume", "--num-iterations", ITERATIONS,
                             NUM_GPUS_ACTOR_ROLLOUT="2")], [tmp_path / "resume"])
    assert f"--resume-from latest: {saved}\n" in resumed[0][1]
    assert_same_training(run, one_node)


def test_a_rank_killed_restarts_the_run_from_its_latest_checkpoint(one_node, tiny_model_dir,
                                                                   tmp_path):
    """kill -9 of rank 0 (the run lock's holder) once a checkpoint exists, two nodes under
    MAX_RESTARTS=1: both agents restart their ranks, the new rank 0 takes the lock over and the run
    continues from its latest checkpoint to the uninterrupted run's adapters."""
    env = run_env(tmp_path, tiny_model_dir, tmp_path / "runs")
    run = tmp_path / "runs" / "run"
    nodes = two_nodes(env, tmp_path / "node", "--num-iterations", ITERATIONS, MAX_RESTARTS="1")
    wait_for("global_step_1", run, "first checkpoint")
    killed = int((run / "run.lock").read_text())
    os.kill(killed, signal.SIGKILL)
    results = succeed(nodes, [tmp_path / "node0", tmp_path / "node1"])
    assert all(" --max-restarts 1 --nproc-per-node 1 " in out for _, out, _ in results)
    assert int((run / "run.lock").read_text()) != killed
    starts = json.loads((run / f"global_step_{ITERATIONS}" / "trainer_state.json").read_text())
    assert len(starts["start_iterations"]) == 2 and starts["start_iterations"][0] == 1  # 2 starts
    resumed_at = starts["start_iterations"][1] - 1
    printed = results[0][1] + results[1][1]
    assert f"--resume-from latest: {run / f'global_step_{resumed_at}'}\n" in printed
    assert_same_training(run, one_node)


def join_timeout_line(port):
    return (f"launch.py: error: not every one of the 2 nodes joined the rendezvous at 127.0.0.1:{port} in its join "
            "timeout (--rdzv-conf join_timeout, run.sh's JOIN_TIMEOUT): a node that stopped or was lost does not "
            "come back by itself; start every node again, and --resume-from latest continues the run")


def test_a_node_whose_peer_never_comes_stops_after_join_timeout_in_one_line(tiny_model_dir, tmp_path):
    """The host node started alone (NNODES=2): it waits JOIN_TIMEOUT (here 5 s), not torchrun's 600 s, says
    every quarter of it how long it has waited (torchrun said nothing), and ends in one line naming the
    rendezvous, where torchrun printed a traceback."""
    env = run_env(tmp_path, tiny_model_dir, tmp_path / "runs")
    port = str(free_port())
    began = time.time()
    node = start(env, tmp_path / "node0", NNODES="2", NODE_RANK="0", MASTER_PORT=port, JOIN_TIMEOUT="5")
    ((code, _, err),) = finish([node], [tmp_path / "node0"])
    assert code == 1 and "Traceback" not in err, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-1] == join_timeout_line(port)
    waiting = [line for line in lines if line.startswith("launch.py: waiting for every one of the 2 nodes to join "
                                                         f"the rendezvous at 127.0.0.1:{port} (its join timeout")]
    assert len(waiting) >= 2 and ": 1 s of 5 s; joined so far: " in waiting[0], lines
    joined = waiting[-1].split("; joined so far: ")[1]  # this node alone: the missing one is the other
    assert re.fullmatch(r"\S+ \(pid \d+, this node\)", joined), lines
    assert time.time() - began < 60


def descendants(pid):
    """The processes started by pid, by their children, and so on (Linux's /proc)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [grand for child in map(int, children) for grand in (child, *descendants(child))]


def test_a_lost_node_under_max_restarts_stops_the_host_in_seconds_naming_it(
        one_node, tiny_model_dir, tmp_path):
    """Node 1 lost mid-run (its agent and ranks killed) under MAX_RESTARTS=1: node 0's rank stops in
    one line (its collective failed: a peer gone), saying what it kept; its agent restarts it and
    waits for node 1, naming it, by host and agent pid, as not back from the last round. Once node
    1's heartbeat has lapsed (15 s, torch's keep-alive) and LOST_NODE_TIMEOUT (here 1 s) has passed,
    one line names it as lost, well within JOIN_TIMEOUT (600 s, the default). One node of 2 ranks
    then continues, bitwise."""
    env = run_env(tmp_path, tiny_model_dir, tmp_path / "runs")
    port = str(free_port())
    nodes = [start(env, tmp_path / f"node{rank}", "--num-iterations", 1000, "--save-every", 1000,
                   NNODES="2", NODE_RANK=str(rank), MASTER_PORT=port, MAX_RESTARTS="1",
                   JOIN_TIMEOUT="600", LOST_NODE_TIMEOUT="1") for rank in (0, 1)]
    wait_for("events.*", tmp_path / "runs" / "run", "TensorBoard events")
    for pid in [nodes[1].pid, *descendants(nodes[1].pid)]:  # the ranks start sessions of their own
        os.kill(pid, signal.SIGKILL)
    lost = time.time()
    (code0, _, err0), _ = finish(nodes, [tmp_path / "node0", tmp_path / "node1"])
    assert code0 == 1 and "Traceback" not in err0, err0[-3000:]
    assert time.time() - lost < 60, err0[-3000:]
    lines = err0.strip().splitlines()
    assert re.fullmatch(
        r"launch\.py: error: \S+ \(pid (\d+)\) of the last rendezvous round was lost: its agent "
        r"left no heartbeat and it did not join again in 1 s \(LOST_NODE_TIMEOUT\); a lost node "
        r"does not come back by itself: start every node again, and --resume-from latest "
        r"continues the run", lines[-1]), lines[-1]
    assert lines[-1].split("(pid ")[1].split(")")[0] == str(nodes[1].pid)
    (stopped,) = [line for line in lines
                  if line.startswith("crd.py: error: a collective of the ranks failed")]
    assert re.search(r": Connection closed by peer \S+: once every node runs again, --resume-from "
                     r"latest continues; (no checkpoint was saved|the latest checkpoint is \S+)$",
                     stopped), stopped
    resumed = succeed([start(env, tmp_path / "resume", "--num-iterations", ITERATIONS,
                             NUM_GPUS_ACTOR_ROLLOUT="2")], [tmp_path / "resume"])
    assert "--resume-from latest: " in resumed[0][1]
    assert_same_training(tmp_path / "runs" / "run", one_node)


def test_the_host_waiting_for_nodes_names_those_not_back_and_those_lost():
    """launch.nodes_joined on a rendezvous state as torch keeps it: the nodes waiting for the next
    round (this one marked), the last round's nodes not back, and of them those with no
    heartbeat."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    import launch

    this, alive, gone = (rdzv._NodeDesc(f"host{i}", 100 + i, 0) for i in range(3))
    state = rdzv._RendezvousState()
    state.complete = True
    state.wait_list = {this}
    state.last_heartbeats = {this: None, alive: None}

    class Handler:
        _this_node = this
        _state_holder = type("Holder", (), {"state": state})()

    assert launch.nodes_joined(Handler(), [this, alive, gone]) == (
        "; joined so far: host0 (pid 100, this node); not back from the last round: "
        "host1 (pid 101), host2 (pid 102) (no heartbeat: host2 (pid 102))")
    assert launch.lost_nodes(state, [this, alive, gone], this) == [gone]
    state.wait_list = {this, gone}  # it came back
    assert launch.lost_nodes(state, [this, alive, gone], this) == []


def test_a_node_that_finds_no_rendezvous_store_stops_in_one_line(tiny_model_dir, tmp_path):
    """launch.py as docs/multi-node.md's per-node command, node 1 started with no host at the
    endpoint (read_timeout 3 s here, torch's 60 s by default): one line that says to start the host
    or check the address, where torchrun printed a traceback."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    cmd = [sys.executable, "launch.py", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "run", "--rdzv-conf", "is_host=0,read_timeout=3",
           "--nproc-per-node", "1", "crd.py", *TINY_RUN]
    result = subprocess.run(cmd, cwd=ROOT, env={**env, "CRD_CACHE": str(tiny_model_dir.parent)},
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"launch.py: error: no rendezvous store answered at 127.0.0.1:{port} in its read timeout (--rdzv-conf "
        "read_timeout, 60 s by default): the node that hosts it (is_host=1, run.sh's NODE_RANK=0) is not running "
        "there; start it, or check the address (run.sh's MASTER_ADDR and MASTER_PORT)")


def test_a_node_whose_peer_s_agent_was_killed_ends_after_the_exit_barrier_in_one_line(
        one_node, tiny_model_dir, tmp_path):
    """kill -9 of node 1's agent: nothing stops its rank, so the run ends as planned; node 0's agent
    then waits EXIT_BARRIER_TIMEOUT (3 s here) for node 1's, not torch's 300 s, and says so in one
    line: exit 0, no traceback, none of the agent's C++ socket warnings. What the run saved is the
    uninterrupted run's, bitwise."""
    env = run_env(tmp_path, tiny_model_dir, tmp_path / "runs")
    run = tmp_path / "runs" / "run"
    nodes = two_nodes(env, tmp_path / "node", "--num-iterations", ITERATIONS,
                      EXIT_BARRIER_TIMEOUT="3")
    wait_for("events.*", run, "TensorBoard events")
    os.kill(nodes[1].pid, signal.SIGKILL)
    killed = time.time()
    (code0, _, err0), (code1, _, _) = finish(nodes, [tmp_path / "node0", tmp_path / "node1"])
    assert code0 == 0 and code1 == -signal.SIGKILL, err0[-3000:]
    assert time.time() - killed < 120
    assert "Traceback" not in err0 and "[W" not in err0, err0[-3000:]
    assert err0.strip().splitlines()[-1] == (
        "launch.py: another node's agent did not finish in 3 s (EXIT_BARRIER_TIMEOUT): it was "
        "killed or its ranks failed; this node's ranks ended")
    assert json.loads((run / "summary.json").read_text())["completed"]
    assert_same_training(run, one_node)


def test_a_node_whose_rendezvous_host_was_killed_mid_run_says_so_in_one_line(one_node, tiny_model_dir,
                                                                             tmp_path):
    """kill -9 of node 0's agent, which hosts the rendezvous store, mid-run: node 1 stops at once and
    says that the host went away during the run and how to continue, not that no host was ever
    there (torch raises the same error for both), and prints no traceback or torch warning about
    the rendezvous it could not close. Once node 0's orphaned rank is gone too (its machine lost),
    one node of 2 ranks continues what is left, bitwise."""
    env = run_env(tmp_path, tiny_model_dir, tmp_path / "runs")
    run = tmp_path / "runs" / "run"
    nodes = two_nodes(env, tmp_path / "node", "--num-iterations", 1000, "--save-every", 1000)
    wait_for("events.*", run, "TensorBoard events")
    ranks0 = descendants(nodes[0].pid)  # in sessions of their own: kill -9 of the agent leaves them
    os.kill(nodes[0].pid, signal.SIGKILL)
    killed = time.time()
    (code0, _, _), (code1, _, err1) = finish(nodes, [tmp_path / "node0", tmp_path / "node1"])
    assert code0 == -signal.SIGKILL and code1 == 1, err1[-3000:]
    assert time.time() - killed < 60
    assert "Traceback" not in err1 and "failed to shutdown" not in err1, err1[-3000:]
    assert err1.strip().splitlines()[-1] == (
        "launch.py: error: the node that hosts the rendezvous store (is_host=1, run.sh's NODE_RANK=0) "
        "went away during the run: its agent was killed or its machine lost; this node's ranks were "
        "stopped. Start every node again: --resume-from latest continues from the last checkpoint")
    for pid in ranks0:  # node 0's orphaned rank, if it has not failed yet: its machine is lost
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    resumed = succeed([start(env, tmp_path / "resume", "--num-iterations", ITERATIONS,
                             NUM_GPUS_ACTOR_ROLLOUT="2")], [tmp_path / "resume"])
    assert "--resume-from latest: " in resumed[0][1]
    assert_same_training(run, one_node)


def test_a_clean_finish_whose_rendezvous_host_went_away_before_this_node_closed_says_so(
        tiny_model_dir, tmp_path):
    """Node 1's agent closes the rendezvous 8 s late, and node 0's agent, which hosts the store and
    waits for it after the exit barrier, is killed meanwhile: node 1's ranks had finished the run,
    so it exits 0 with one line saying that the host went away before it closed the rendezvous,
    with no traceback or torch warning."""
    env = run_env(tmp_path, tiny_model_dir, tmp_path / "runs")
    run = tmp_path / "runs" / "run"
    (tmp_path / "late").mkdir()
    (tmp_path / "late" / "sitecustomize.py").write_text(LATE_CLOSE)
    late = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "late"),
                                                        env.get("PYTHONPATH")])),
            "CLOSE_LATE_S": "8"}
    port = str(free_port())
    nodes = [start(env, tmp_path / f"node{rank}", "--num-iterations", 1, NNODES="2",
                   NODE_RANK=str(rank), MASTER_PORT=port, **(late if rank else {}))
             for rank in (0, 1)]
    wait_for("summary.json", run, "summary.json")
    deadline = time.time() + 60
    while descendants(nodes[0].pid) and time.time() < deadline:  # node 0's rank exits
        time.sleep(0.05)
    time.sleep(1)  # both agents pass the exit barrier; node 1's then sleeps before it closes
    os.kill(nodes[0].pid, signal.SIGKILL)
    (code0, _, _), (code1, _, err1) = finish(nodes, [tmp_path / "node0", tmp_path / "node1"])
    assert code0 == -signal.SIGKILL and code1 == 0, err1[-3000:]
    assert not DUMPS.search(err1), err1[-3000:]
    assert err1.strip().splitlines()[-1] == (
        "launch.py: the node that hosts the rendezvous store (is_host=1, run.sh's NODE_RANK=0) went "
        "away before this node closed the rendezvous; this node's ranks had ended")
    assert json.loads((run / "summary.json").read_text())["completed"]


def test_a_stopped_node_under_max_restarts_stops_the_other_at_once(tiny_model_dir, tmp_path):
    """SIGTERM to node 1 under MAX_RESTARTS=1: both ranks stop after the same iteration, which rank 0
    saves; node 0's agent does not restart its rank (a restart would wait JOIN_TIMEOUT, 300 s here,
    for node 1) but ends at once in the stop's one line; the checkpoint and summary.json stand (a
    resume from such a stop: test_sigterm_to_one_node_stops_both_and_one_node_resumes_bitwise)."""
    env = run_env(tmp_path, tiny_model_dir, tmp_path / "runs")
    run = tmp_path / "runs" / "run"
    port = str(free_port())
    nodes = [start(env, tmp_path / f"node{rank}", "--num-iterations", 1000, "--save-every", 1000, NNODES="2",
                   NODE_RANK=str(rank), MASTER_PORT=port, MAX_RESTARTS="1", JOIN_TIMEOUT="300")
             for rank in (0, 1)]
    wait_for("events.*", run, "TensorBoard events")
    os.kill(nodes[1].pid, signal.SIGTERM)
    stopped = time.time()
    (code0, _, err0), (code1, _, err1) = finish(nodes, [tmp_path / "node0", tmp_path / "node1"])
    assert code1 == code0 == 143, (err0[-3000:], err1[-3000:])
    assert time.time() - stopped < 60
    assert "Traceback" not in err0 + err1
    assert err0.strip().splitlines()[-1] == (
        "launch.py: stopped by SIGTERM to a rank of the run, here or on another node (exit code 143): "
        "every rank stopped after the same iteration, which rank 0 saved")
    (saved,) = run.glob("*global_step_*")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and saved.name == f"global_step_{summary['iterations']}"


def nodes_with_other_settings(env, log, node1_flags, *extra):
    """Two nodes whose commands differ in node1_flags, given to node 1 alone: [(exit status,
    stdout, stderr)] of each and the seconds until both had exited."""
    port = str(free_port())
    started = time.monotonic()
    nodes = [start(env, f"{log}{rank}", *extra, *flags, NNODES="2", NODE_RANK=str(rank),
                   MASTER_PORT=port) for rank, flags in enumerate(([], node1_flags))]
    results = finish(nodes, [f"{log}0", f"{log}1"])
    return results, time.monotonic() - started


def assert_one_line_naming(results, flag, values):
    """Every node exits non-zero with one line naming the flag and both values (which node holds
    rank 0 is the rendezvous's choice), and no traceback."""
    first, second = values
    named = [f"{flag} {a} on rank 0, {b} on rank 1" for a, b in ((first, second), (second, first))]
    for code, _, err in results:
        assert code != 0 and "Traceback" not in err, err[-3000:]
        (line,) = [line for line in err.splitlines() if flag in line]
        assert line.startswith("crd.py: error: settings differ between ranks: "), line
        assert any(f" {pair}" in line for pair in named), line


@pytest.mark.parametrize("flag, values", [("--learning-rate", ("0.003", "0.0003")),
                                          ("--group-size", ("4", "6"))])
def test_nodes_started_with_other_settings_stop_at_once_naming_the_flag(flag, values,
                                                                        tiny_model_dir, tmp_path):
    """Before the check, another --learning-rate on one node trained silently (both exited 0) and
    another --group-size failed an iteration in with gloo's collective mismatch, which names no
    flag (NCCL may hang there). Now both stop before the run directory is written."""
    env = run_env(tmp_path, tiny_model_dir, tmp_path / "runs")
    results, seconds = nodes_with_other_settings(env, tmp_path / "node", [flag, values[1]],
                                                 "--num-iterations", ITERATIONS)
    assert_one_line_naming(results, flag, values)
    assert seconds < 120 and not (tmp_path / "runs" / "run").exists()  # a failed start leaves none


def test_a_resume_with_other_settings_on_one_node_stops_at_once(tiny_model_dir, tmp_path):
    """--num-iterations may change on resume (checkpoint.SAFE_TO_CHANGE_ON_RESUME), but not from
    one node to another: one rank would stop while the other waits in its next collective. The
    run stopped after iteration 1 is left as it was, every file of it (a resume of a stopped run
    continues bitwise: test_sigterm_to_one_node_stops_both_and_one_node_resumes_bitwise)."""
    env = run_env(tmp_path, tiny_model_dir, tmp_path / "runs")
    run = tmp_path / "runs" / "run"
    succeed([start(env, tmp_path / "first", "--num-iterations", 1, NUM_GPUS_ACTOR_ROLLOUT="2")],
            [tmp_path / "first"])
    held = {str(p.relative_to(run)): p.stat().st_mtime_ns for p in run.rglob("*")
            if p.name != "run.lock"}  # each start takes the lock
    results, seconds = nodes_with_other_settings(env, tmp_path / "node", ["--num-iterations", 5],
                                                 "--num-iterations", 4)
    assert_one_line_naming(results, "--num-iterations", ("4", "5"))
    assert seconds < 120 and {str(p.relative_to(run)): p.stat().st_mtime_ns for p in run.rglob("*")
                              if p.name != "run.lock"} == held


def latest(args, **changes):
    """prepare_run with --resume-from latest (the main process of one): (run directory, lock)."""
    return run_dirs.prepare_run(with_settings(args, resume_from="latest", **changes), "crd",
                                  1, True)


def test_latest_without_a_checkpoint_starts_a_new_run(tmp_path, capsys):
    args = with_settings(crd.Args(), output_dir=str(tmp_path), run_name="run", resume_from="latest")
    run_dir, lock = run_dirs.prepare_run(args, "crd", 1, True)
    lock.close()
    assert args.output.resume_from == "" and run_dir == tmp_path / "run"
    new_run = f"--resume-from latest: no checkpoint in {run_dir}: a new run"
    assert capsys.readouterr().out == f"{new_run}\n"
    # what a start killed before its first checkpoint leaves: replaced, or no restart could start
    (run_dir / "events.out.tfevents.1.host.1.0").write_text("")
    (run_dir / ".global_step_1.x7rq2m").mkdir()
    run_dir, lock = latest(args)
    lock.close()
    assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"]
    assert capsys.readouterr().out == (f"{new_run}, replacing events.out.tfevents.1.host.1.0 "
                                       "(left by starts that saved none)\n")


def test_latest_refuses_what_it_cannot_continue_in_one_line(tmp_path):
    with pytest.raises(checkpoint.RunError) as error:
        latest(with_settings(crd.Args(), output_dir=str(tmp_path)))
    assert str(error.value) == ("--resume-from latest needs --run-name: without one, every "
                                "start names a new run directory (after its start time), never "
                                "one with a checkpoint")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"iterations": 12}))
    with pytest.raises(checkpoint.RunError) as error:
        latest(with_settings(crd.Args(), output_dir=str(tmp_path), run_name="run"))
    assert str(error.value) == (f"--resume-from latest: {tmp_path / 'run'} holds a run of 12 "
                                "iterations (summary.json) but no complete checkpoint; resume "
                                "from a checkpoint path, or remove it or choose another --run-name")


def test_latest_takes_the_newest_complete_checkpoint(lora_transformer, tmp_path,  # noqa: F811
                                                     capsys):
    """Not the newest directory, whatever a kill left: a global_step_N half-removed by --keep-last,
    a save's temporary directory (removed when the run takes its directory). The settings check of a
    resume applies to the checkpoint found."""
    first, args = saved_run(lora_transformer, tmp_path)
    run_dir = first.parent
    transformer, optimizer = lora_transformer
    state = json.loads((first / "trainer_state.json").read_text())
    for iteration in (2, 3):
        checkpoint.save_checkpoint(run_dir, iteration, transformer, optimizer,
                                   {**state, "iteration": iteration}, keep_last=0)
    (run_dir / "global_step_3" / "optimizer.pt").unlink()
    (run_dir / ".global_step_4.x7rq2m").mkdir()
    shutil.copy(first / "trainer_state.json", run_dir / ".global_step_4.x7rq2m")
    capsys.readouterr()
    resolved = with_settings(args, resume_from="latest", dry_run=False)
    found_in, lock = run_dirs.prepare_run(resolved, "crd", 1, True)
    assert found_in == run_dir
    assert resolved.output.resume_from == str(run_dir / "global_step_2")
    assert not (run_dir / ".global_step_4.x7rq2m").exists()
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"--resume-from latest: skipping global_step_3 of {run_dir}: incomplete (no optimizer.pt)",
        f"--resume-from latest: {run_dir / 'global_step_2'}"]
    differ = f"settings that define the run differ from the checkpoint's: seed {args.seed} -> 1"
    with pytest.raises(checkpoint.RunError, match=differ):
        latest(args, seed=1)  # a dry run: the lock above is still held
    lock.close()


def test_a_rank_that_found_another_latest_checkpoint_stops(monkeypatch):
    """A node whose view of the shared run directory lags would otherwise train other adapters.
    Rank 1 of 2 here, rank 0's broadcast standing in (every run of several ranks above calls the
    real one, and passes)."""
    monkeypatch.setattr(checkpoint.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(checkpoint.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(checkpoint.dist, "broadcast", lambda tensor, src: tensor.fill_(1))
    checkpoint.check_same_start(1, crd.Args(), "cpu", 2)  # rank 0's iteration: it starts
    with pytest.raises(checkpoint.RunError) as error:
        checkpoint.check_same_start(2, with_settings(crd.Args(), resume_from="x/global_step_2"),
                                    "cpu", 2)
    assert str(error.value) == ("rank 1 starts at iteration 2 (x/global_step_2), rank 0 at "
                                "iteration 1: every node must see the same run directory, on "
                                "storage they share")


# Stand-ins for Slurm on one host: srun runs its command once per node (SLURM_NODEID 0, 1, ...)
# and exits with the highest status; scontrol knows two host names and records a requeue. The
# trainer's interpreter prints what it was given and exits $STAND_IN_EXIT (143: a SIGTERM stop).
SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
status=0
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
  SLURM_NODEID=$node "$@" > "$SRUN_LOG.$node" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do
  wait "$pid" || { code=$?; (( code > status )) && status=$code; }
done
exit $status
"""
SCONTROL = """#!/bin/bash
case $1 in
  show) printf 'node-a\\nnode-b\\n' ;;
  requeue) echo "requeue $2" >> "$SRUN_LOG.scontrol" ;;
esac
"""
PYTHON = """#!/bin/bash
echo "python $*"
exit "$STAND_IN_EXIT"
"""


@pytest.mark.parametrize("completed", [False, True])
def test_the_sbatch_script_starts_a_node_each_and_requeues_an_unfinished_run(completed, tmp_path):
    env = fake_tools(tmp_path)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("python", PYTHON)):
        (tmp_path / "bin" / name).write_text(text)
        (tmp_path / "bin" / name).chmod(0o755)
    if completed:  # the run had done its last iteration when the signal came
        (tmp_path / "runs" / "crd-1234").mkdir(parents=True)
        (tmp_path / "runs" / "crd-1234" / "summary.json").write_text('{\n "completed": true\n}')
    env.update(PYTHON=str(tmp_path / "bin" / "python"), STAND_IN_EXIT="143", NUM_GPUS_REWARD="0",
               SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_ID="1234",
               SLURM_SUBMIT_DIR=str(ROOT), SRUN_LOG=str(tmp_path / "srun"),
               OUTPUT_DIR=str(tmp_path / "runs"))
    sbatch = ROOT / "examples" / "slurm" / "crd.sbatch"  # sbatch runs it from elsewhere: a copy
    result = subprocess.run(["bash", sbatch, "--learning-rate", "1e-4"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 143, result.stderr
    for node in (0, 1):
        printed = (tmp_path / f"srun.{node}").read_text()
        assert ("launch.py --nnodes 2 --rdzv-backend c10d --rdzv-endpoint node-a:21234 "
                f"--rdzv-id crd-1234 --rdzv-conf is_host={int(node == 0)},join_timeout=120 --max-restarts 3 "
                "--nproc-per-node 1 crd.py ") in printed
        assert printed.rstrip().endswith("--run-name crd-1234 --resume-from latest "
                                         "--learning-rate 1e-4")
    requeued = tmp_path / "srun.scontrol"
    expected = "" if completed else "requeue 1234\n"
    assert (requeued.read_text() if requeued.exists() else "") == expected
