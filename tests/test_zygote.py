"""tests/zygote.py runs a script as `python SCRIPT` does: the same exit status, output, shutdown
steps and results, bitwise for a trainer run."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import load_file

import zygote
from test_trainers import ROOT, TINY_RUN

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "answer", os.environ.get("ANSWER"))
    here = os.path.dirname(os.path.abspath(__file__))
    print("path0", sys.path[0] == here, "file", __file__ == os.path.abspath(__file__))
    print("parent", os.getppid())
    print("to stderr", file=sys.stderr)
    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread ended"))).start()
    how = sys.argv[1]
    if how == "message":
        sys.exit("one line")
    if how == "raise":
        raise ValueError("bad value")
    if how == "sleep":
        time.sleep(60)
    sys.exit(int(how))
""")


@pytest.fixture(scope="module", autouse=True)
def servers_of_its_own():
    """This module's tests start with none of this process's servers, which earlier tests on this
    worker may have filled up to zygote.MOST_SERVERS, and end the servers they started."""
    servers = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zygote, "_servers", servers)
        yield servers
    for server in servers.values():
        server.close()


@pytest.mark.parametrize("how", ["0", "3", "message", "raise"])
def test_a_script_ends_as_under_a_fresh_interpreter(how, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "ANSWER": "42"}
    ran = [run([sys.executable, str(script), how], cwd=tmp_path, env=env, capture_output=True,
               text=True, timeout=60) for run in (zygote.run, subprocess.run)]
    served, fresh = ran
    assert served.returncode == fresh.returncode == (int(how) if how.isdigit() else 1)
    parents = [int(r.stdout.split("parent ")[1].split()[0]) for r in ran]
    assert parents[0] != os.getpid() and parents[1] == os.getpid()  # the server's child; ours
    assert served.stdout.replace(str(parents[0]), "P") == fresh.stdout.replace(str(parents[1]), "P")
    assert served.stderr.replace(str(script), "S") == fresh.stderr.replace(str(script), "S")
    assert "thread ended\natexit ran" in served.stdout and "to stderr" in served.stderr


def test_a_script_past_its_timeout_is_killed_and_an_import_time_variable_gets_its_own_server(
        tmp_path, monkeypatch, servers_of_its_own):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([sys.executable, str(script), "sleep"], cwd=tmp_path, capture_output=True,
                   text=True, timeout=2)
    monkeypatch.setattr(zygote, "MOST_SERVERS", len(servers_of_its_own) + 2)
    others = [n for n in ("1", "2", "3", "4") if n != os.environ.get("OMP_NUM_THREADS")][:3]
    parents = []
    for threads in others:  # torch reads OMP_NUM_THREADS as it imports
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        served = zygote.run([sys.executable, str(script), "0"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
        assert served.returncode == 0, served.stderr
        parents.append(int(served.stdout.split("parent ")[1].split()[0]))
    # a server each for the first two, then a fresh interpreter: MOST_SERVERS are running
    assert len(servers_of_its_own) == zygote.MOST_SERVERS
    assert len({*parents[:2], os.getpid()}) == 3 and parents[2] == os.getpid()


def test_a_trainer_run_by_the_server_is_the_fresh_interpreter_s_bitwise(tiny_model_dir, tmp_path):
    env = {**os.environ, "CRD_CACHE": str(tiny_model_dir.parent)}
    runs = {}
    for name, run in (("served", zygote.run), ("fresh", subprocess.run)):
        cmd = [sys.executable, "crd.py", *TINY_RUN, "--num-iterations", "1", "--eval-every", "1",
               "--output-dir", str(tmp_path / name), "--run-name", "run"]
        result = run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = (result.stdout.replace(name, "X"),
                      load_file(tmp_path / name / "run" / "global_step_1" / "adapters.safetensors"))
    (out, served), (expected_out, fresh) = runs["served"], runs["fresh"]
    assert served.keys() == fresh.keys() and all((served[k] == fresh[k]).all() for k in served)
    timed = re.compile(r' s\b|_s"|per_s|mem|GiB|actor rank', re.I)  # timings and memory vary
    assert [line for line in out.splitlines() if not timed.search(line)] == [
        line for line in expected_out.splitlines() if not timed.search(line)]


def test_an_environment_the_server_cannot_start_in_runs_fresh_interpreters(
        tmp_path, monkeypatch, servers_of_its_own):
    """A sitecustomize that blocks peft kills the server as it imports: the script runs in a fresh
    interpreter, as `python SCRIPT` would, and so does the next call in that environment."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "peft":
                    raise ModuleNotFoundError("No module named 'peft'", name=name)
        sys.meta_path.insert(0, Block())
    """))
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    monkeypatch.setattr(zygote, "MOST_SERVERS", len(servers_of_its_own) + 1)  # room for its server
    for _ in range(2):
        served = zygote.run([sys.executable, str(script), "3"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
        assert served.returncode == 3, served.stderr
        assert int(served.stdout.split("parent ")[1].split()[0]) == os.getpid()
    (server,) = [s for key, s in servers_of_its_own.items() if ("PYTHONPATH", str(tmp_path)) in key]
    assert server.failed
