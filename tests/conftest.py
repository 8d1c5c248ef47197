"""Shared fixtures: one tiny random SD3 (see rollout.TINY), built once per test session into a temporary directory."""

import os

import pytest
import torch

import rollout

# The suite runs on two workers (pytest.ini: -n 2), as many as CI's cores: each worker, and every trainer it starts,
# gets one torch thread, because two processes of two spinning OpenMP threads each on two cores slow each other
# several-fold.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Directory of the tiny SD3 pipeline (diffusers format); load it with `rollout.load_pipeline(str(dir))`.

    Its parent works as CRD_CACHE for subprocesses that run `--model tiny`, so they reuse this build.
    """
    path = tmp_path_factory.mktemp("models") / rollout.TINY_DIR_NAME
    rollout.load_pipeline(rollout.TINY, cache_dir=path)
    return path


@pytest.fixture(scope="session")
def tiny_pipe(tiny_model_dir):
    """The tiny pipeline, fp32 on CPU, shared by all tests: treat it as read-only (load your own to add adapters)."""
    return rollout.load_pipeline(str(tiny_model_dir))
