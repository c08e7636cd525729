"""AsyncEngine's threading contract: the engine is built on the thread that steps it."""

from __future__ import annotations

import threading

import pytest

from kvpilot.server.api.async_engine import AsyncEngine


class _IdleEngine:
    def __init__(self):
        self.built_on = threading.current_thread()

    def has_unfinished_requests(self) -> bool:
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
