import pytest


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


@pytest.fixture
def rng():
    import numpy as np
    return np.random.default_rng()
