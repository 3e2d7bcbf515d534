import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, max_examples=25,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=400,
                          suppress_health_check=[HealthCheck.too_slow])
# CUDA: fewer examples per property (each random model captures its own CUDA graphs), the same properties
settings.register_profile("cuda", deadline=None, max_examples=8,
                          suppress_health_check=[HealthCheck.too_slow])


def pytest_addoption(parser):
    parser.addoption("--device", default=os.environ.get("NANOSPEC_TEST_DEVICE", "cpu"),
                     help="device for model tests: cpu or cuda (or set NANOSPEC_TEST_DEVICE)")


def pytest_configure(config):
    default = "cuda" if config.getoption("--device") == "cuda" else "default"
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", default))


@pytest.fixture(scope="session")
def device(request):
    dev = request.config.getoption("--device")
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda given but no CUDA device is available")
    return dev
