"""What the OCR proxy's runs use of the machine, and NVIDIA's MPS daemon that lets them share one
GPU at once.

    usage = Usage({"trainers": trainer_pids, "ocr": pool_pids})  # before the runs start
    usage.sample()                                        # every few seconds while they run
    usage.summary()         # GPU busy and memory, load, each group's CPU seconds and threads

    with mps_daemon(out / "mps") as env:                  # env for the trainers' processes
        ...

Many small trainers on one GPU: without MPS the GPU runs one process's kernels at a time (time
slicing), and a 15.5M-parameter model's kernels fill a few of its 132 multiprocessors; MPS runs
the kernels of all of them at once. Linux only (/proc); the GPU's figures come from nvidia-smi.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def gpu_busy_and_memory() -> tuple[float, float] | None:
    """(percent of the last sample period a kernel ran, MiB in use) of GPU 0; None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                          "--format=csv,noheader,nounits", "--id=0"],
                         capture_output=True, text=True, check=False).stdout.split(",")
    try:
        return float(out[0]), float(out[1])
    except (ValueError, IndexError):
        return None


def process_cpu_and_threads(pid: int) -> tuple[float, int]:
    """(CPU seconds, threads) of a live process; (0, 0) once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0
    return (int(fields[11]) + int(fields[12])) / TICKS, int(fields[17])


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of every core since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle and iowait
    return sum(values) - idle, sum(values)


class Usage:
    """Samples the GPU, the load and the CPU of named groups of processes ({group: callable that
    returns their pids}) while runs go on; summary() gives the medians and each group's CPU
    seconds, so that what bounds the runs can be read: a GPU near 100 % busy, an OCR pool whose
    CPU seconds fill its workers' time, or cores that the trainers' threads oversubscribe."""

    def __init__(self, groups: dict):
        self.groups = groups
        self.started = time.perf_counter()
        self.busy_ticks = machine_busy_ticks()
        self.gpu, self.memory, self.load, self.threads = [], [], [], {g: [] for g in groups}
        self.cpu_s = {group: {} for group in groups}  # {group: {pid: its latest CPU seconds}}
        # what the processes already alive had used: counted from now
        self.cpu_before = {pid: process_cpu_and_threads(pid)[0]
                           for pids in groups.values() for pid in pids()}

    def sample(self) -> None:
        gpu = gpu_busy_and_memory()
        if gpu:
            self.gpu.append(gpu[0])
            self.memory.append(gpu[1])
        self.load.append(os.getloadavg()[0])
        for group, pids in self.groups.items():
            threads = 0
            for pid in pids():
                cpu_s, count = process_cpu_and_threads(pid)
                if count:
                    self.cpu_s[group][pid] = cpu_s - self.cpu_before.get(pid, 0.0)
                threads += count
            self.threads[group].append(threads)

    def summary(self) -> dict:
        """Medians of the samples, and each group's CPU seconds as a share of the wall time."""
        self.sample()
        wall = time.perf_counter() - self.started
        busy, total = (now - then for now, then in zip(machine_busy_ticks(), self.busy_ticks))
        cores = os.cpu_count() or 1

        def median(values):
            return round(statistics.median(values), 2) if values else None

        gpu_mean = round(statistics.fmean(self.gpu), 1) if self.gpu else None
        summary = {"wall_s": round(wall, 1), "samples": len(self.load), "cores": cores,
                   "gpu_busy_percent_median": median(self.gpu),
                   "gpu_busy_percent_mean": gpu_mean,
                   "gpu_memory_mib_max": max(self.memory) if self.memory else None,
                   "load_median": median(self.load),
                   "machine_cpu_busy_percent": round(100 * busy / max(total, 1), 1)}
        for group, seconds in self.cpu_s.items():
            summary[f"{group}_cpu_s"] = round(sum(seconds.values()), 1)
            summary[f"{group}_cores_busy"] = round(sum(seconds.values()) / wall, 2)
            summary[f"{group}_threads_median"] = median(self.threads[group])
        return summary

    def line(self) -> str:
        """The latest sample in a few words, for a progress line."""
        gpu = f"GPU {self.gpu[-1]:.0f} % busy, " if self.gpu else ""
        return f"{gpu}load {self.load[-1]:.1f} on {os.cpu_count()} cores" if self.load else ""


@contextmanager
def mps_daemon(directory: Path):
    """NVIDIA's MPS control daemon for GPU 0 while the block runs; yields the environment its
    clients need (their CUDA work then runs side by side on the GPU). One line and exit 1 where
    it is not installed or does not start."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        sys.exit("run_benchmark.py: error: --mps: nvidia-cuda-mps-control is not on PATH (it ships "
                 "with NVIDIA's driver utilities)")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(directory / "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(directory / "log")}
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    started = subprocess.run([control, "-d"], env={**os.environ, **env}, capture_output=True,
                             text=True, check=False)
    if started.returncode:
        sys.exit(f"run_benchmark.py: error: --mps: the MPS daemon did not start "
                 f"({(started.stderr or started.stdout).strip() or started.returncode})")
    try:
        yield env
    finally:
        subprocess.run([control], input="quit\n", env={**os.environ, **env}, capture_output=True,
                       text=True, check=False)
        time.sleep(1)  # the daemon ends its server before a later CUDA process starts alone
