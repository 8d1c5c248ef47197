"""Shared fixtures: one tiny random SD3 (see sd3.TINY), built once per test session into a temporary directory."""

import os

import pytest
import torch

import sd3

# The suite runs on three workers (pytest.ini: -n 3) on CI's two cores: each worker, and every trainer it starts,
# gets one torch thread, because processes of two spinning OpenMP threads each on two cores slow each other
# several-fold.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# compile inductor's kernels in-process: a subprocess pool only adds start-up on two busy cores
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"


def shares_a_module_fixture(item) -> bool:
    """Whether `item` uses a module- or session-scoped fixture of its own test module."""
    module, fixtures = item.nodeid.split("::")[0], item._fixtureinfo.name2fixturedefs
    defs = [fixtures[name][-1] for name in item.fixturenames if fixtures.get(name)]
    return any(d.scope in ("module", "session") and d.baseid == module for d in defs)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(items):
    """Schedule the tests for pytest.ini's workers (--dist loadgroup, in this order).

    A module fixture runs once on every worker that runs a test using it: the tests that share one
    of their module's (a trainer run, say) are one group, run on one worker. The groups and the
    tests marked long start first, so that short tests end the run and the workers end together.
    """
    for item in items:
        if shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    first = {item: any(item.iter_markers("long")) or any(item.iter_markers("xdist_group"))
             for item in items}
    items.sort(key=lambda item: not first[item])  # stable: each part keeps its order


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Directory of the tiny SD3 pipeline (diffusers format); load it with `sd3.load_pipeline(str(dir))`.

    Its parent works as CRD_CACHE for subprocesses that run `--model tiny`, so they reuse this build.
    """
    path = tmp_path_factory.mktemp("models") / sd3.TINY_DIR_NAME
    sd3.load_pipeline(sd3.TINY, cache_dir=path)
    return path


@pytest.fixture(scope="session")
def tiny_pipe(tiny_model_dir):
    """The tiny pipeline, fp32 on CPU, shared by all tests: treat it as read-only (load your own to add adapters)."""
    return sd3.load_pipeline(str(tiny_model_dir))
