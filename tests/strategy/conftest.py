"""The strategy tests' reference: the test model's losses over 3 steps on one device (fp32). Every
other run (tests.support.training.run_strategy) is compared with them at rtol 1e-5."""

import pytest

from tests.support.training import run_strategy


@pytest.fixture(scope="session")
def reference_run():
    return run_strategy("1,1,1,1", shared_init=True)  # one device: create_train_state's own state


@pytest.fixture(scope="session")
def reference(reference_run):
    return reference_run["losses"]
