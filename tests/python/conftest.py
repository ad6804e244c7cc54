import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from daemon import Daemon  # noqa: E402


@pytest.fixture
def daemon():
    with Daemon() as d:
        yield d
