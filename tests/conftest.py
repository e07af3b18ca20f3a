import os
import zlib

import pytest

# Random inputs are drawn from a generator seeded per test (its node id), so a failure comes back
# on every run of that test; PTXATTN_TEST_SEED shifts every seed, to draw other inputs.
BASE_SEED = int(os.environ.get("PTXATTN_TEST_SEED", "0"))


def _gpu_present() -> bool:
    try:
        import cupy
        return cupy.is_available()
    except Exception:
        return False


GPU_PRESENT = _gpu_present()


def pytest_collection_modifyitems(config, items):
    if GPU_PRESENT:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible to CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    return f"rng fixture: seeds crc32(test id) + PTXATTN_TEST_SEED={BASE_SEED}"


@pytest.fixture
def rng(request):
    import numpy as np
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()) + BASE_SEED)


# The model coverage table (tests/model_coverage.py): each model test's outcome, its parameters
# carried from the worker that ran it (pytest-xdist) in the report's user_properties.
def pytest_addoption(parser):
    parser.addoption("--model-coverage", metavar="FILE",
                     help="write the model coverage table of tests/test_transformers.py's GPU "
                          "model tests to FILE (markdown)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    callspec = getattr(item, "callspec", None)
    if callspec is not None and item.module.__name__ == "test_transformers":
        params = {name: str(value) for name, value in callspec.params.items()}
        report.user_properties.append(("model_coverage", (item.originalname, params)))


_recorder = None  # the model coverage Recorder, with --model-coverage


def pytest_configure(config):
    global _recorder
    if config.getoption("--model-coverage"):
        from model_coverage import Recorder
        _recorder = Recorder()


def pytest_runtest_logreport(report):
    if _recorder is None or (report.when != "call" and not (report.failed or report.skipped)):
        return
    for key, value in report.user_properties:
        if key == "model_coverage":
            test, params = value
            crash = getattr(report.longrepr, "reprcrash", None)
            _recorder.add(test, params, report.outcome, crash.message if crash is not None else "")


def pytest_unconfigure(config):
    path = config.getoption("--model-coverage")
    if not path or _recorder is None or hasattr(config, "workerinput"):
        return
    name = "a machine without a GPU"
    if GPU_PRESENT:
        import cupy
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    with open(path, "w") as f:
        f.write(_recorder.table(name))
