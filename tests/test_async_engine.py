"""AsyncEngine's threading contract: the engine is built on the thread that steps it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvpilot.server.api.async_engine import AsyncEngine


class _IdleEngine:
    def __init__(self):
        self.built_on = threading.current_thread()

    def needs_step(self) -> bool:
        return False


@pytest.mark.timeout(30)
def test_engine_is_built_on_its_own_thread_and_stepped_there():
    # torch must run on one thread only: a second OpenMP team makes libgomp stop spinning (see launch()).
    ae = AsyncEngine.launch(_IdleEngine)
    try:
        assert ae.engine.built_on is ae._thread and ae.engine.built_on is not threading.main_thread()
        assert ae.alive
    finally:
        ae.stop()
    assert not ae._thread.is_alive()


@pytest.mark.timeout(30)
def test_a_load_failure_is_raised_by_launch():
    def broken():
        raise FileNotFoundError("no such model: nowhere.gguf")

    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        AsyncEngine.launch(broken)


class _StuckEngine:
    """Its step hangs until released, as a step that never returns would (a hung kernel or collective)."""

    def __init__(self):
        self.requests: list[str] = []
        self.release = threading.Event()
        self.scheduler = SimpleNamespace(waiting=[])

    def needs_step(self) -> bool:
        return bool(self.requests)

    def add_admitted(self, admission, request_id, arrival_time=None) -> None:
        self.requests.append(request_id)

    def step_or_fail_open(self):
        self.release.wait(30)
        self.requests.clear()
        return []


@pytest.mark.timeout(60)
def test_a_hung_step_is_stalled_only_while_requests_are_open():
    """The one-process engine's half of issue #75's hung-engine probe: /health reads stalled_seconds()."""
    import asyncio
    import time

    from kvpilot.server.api.async_engine import Job
    from kvpilot.server.engine.limits import Admission
    from kvpilot.server.engine.sampling_params import SamplingParams

    ae = AsyncEngine.launch(_StuckEngine)
    try:
        time.sleep(1.2)
        assert ae.stalled_seconds() == 0.0  # idle
        async def submit():  # on an event loop, as the server does
            ae.submit([Job("r1", Admission([1, 2], SamplingParams(max_tokens=1), 1, None, None))])

        asyncio.run(submit())
        time.sleep(1.5)
        assert ae.stalled_seconds() >= 1.0
        ae.engine.release.set()
        time.sleep(1.0)
        ae.release(["r1"])
        assert ae.stalled_seconds() == 0.0
    finally:
        ae.engine.release.set()
        ae.stop()
