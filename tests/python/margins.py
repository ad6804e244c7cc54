"""Time margins of the Python tests, as tests/time_margin.h gives the C++ tests theirs: how long a
test waits before it takes a call for hung, a release for missed, or a wait for a wait on another,
longer timeout. A margin is a base in seconds chosen to hold on a 2-core machine at load 8 (every
core busy with something else), times HIQ_TEST_TIME_SCALE when that is set (a positive number,
e.g. 3 on a slower machine). A contract's own bound stays in the assertion's message."""

import os


def time_scale() -> float:
    """HIQ_TEST_TIME_SCALE, 1 when unset; ValueError when it is not a number in (0, 1000]."""
    raw = os.environ.get("HIQ_TEST_TIME_SCALE", "")
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1000:
        raise ValueError(f"HIQ_TEST_TIME_SCALE={raw}: want a positive number (at most 1000)")
    return value


def margin(seconds: float) -> float:
    """`seconds` times time_scale()."""
    return seconds * time_scale()
