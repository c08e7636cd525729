"""NIXL moves the K/V of prefill/decode handoffs: each rank registers its KV cache (the target's layers
and a drafter's, every block's region in each) with a NIXL agent (UCX backend), and a decode rank READs
its shard of the held blocks straight from the prefill rank of the same index into its own cache
blocks — on GPUs device to device (GPUDirect where the fabric has it), on CPUs host memory over TCP.
What to read (the agents' metadata, the regions' addresses, the held block ids) travels over the
authenticated transfer port of kv_transfer.py; UCX's data path itself carries no authentication (the
chart's network policy closes it to other pods).

The target side of a READ must progress its UCX worker: NIXL's own progress thread spins a core, so a
thread of ours polls instead (every PROGRESS_ACTIVE_S while the engine says blocks are held, every
PROGRESS_IDLE_S otherwise: ~3% of a core while active, nothing measurable idle).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref

import torch

from kvpilot.server.engine.step_message import NixlPeer

log = logging.getLogger("kvpilot.server.kv_transfer")
PROGRESS_ACTIVE_S = 0.001
PROGRESS_IDLE_S = 0.05


def _transports() -> None:
    """UCX over TCP on a CPU-only machine unless told otherwise (its shared-memory transports do not
    reach another pod; RDMA needs the hardware)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("UCX_TLS", "tcp")


class NixlCache:
    """This rank's KV cache regions registered with a NIXL agent of its own."""

    def __init__(self, regions: list[torch.Tensor], role: str, rank: int):
        """regions: the cache tensors, each (blocks, ...) with one block per row (the target's K and V of
        every layer, then a drafter's)."""
        _transports()
        from nixl_cu13 import nixl_agent, nixl_agent_config

        self.name = f"kvpilot-{role}-{rank}-{uuid.uuid4().hex[:12]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.regions = regions
        self.device = regions[0].device
        self.mem = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.dev_id = self.device.index or 0
        self.strides = [r[0].numel() * r.element_size() for r in regions]
        self.agent.register_memory(regions)
        self._known: set[str] = set()
        self._lock = threading.Lock()  # the agent is used from the engine's thread and the progress thread
        self.active = threading.Event()
        stop = threading.Event()
        thread = threading.Thread(target=_progress, args=(self.agent, self._lock, self.active, stop), name="kvpilot-nixl-progress", daemon=True)
        thread.start()
        # Stopped when the cache is dropped or closed, and at exit before the interpreter tears down (a thread
        # still inside the agent then aborted the process).
        self._stopped = weakref.finalize(self, _halt, stop, thread)

    def describe(self) -> NixlPeer:
        """What a peer needs to READ from this rank: the agent's name and metadata, each region's base
        address, bytes per block and device."""
        with self._lock:
            metadata = self.agent.get_agent_metadata()
        return NixlPeer(self.name, metadata, [[r.data_ptr(), s, self.dev_id] for r, s in zip(self.regions, self.strides)])

    def read(self, peer: NixlPeer, pairs: list[tuple[int, int]], timeout: float) -> str | None:
        """READ blocks from a peer rank into this one's cache: pairs of (local block, the peer's block),
        every region of each. None when done; else why not (a layout that differs, an error, a timeout).
        A read that can be neither finished nor cancelled stops the process: its bytes could still land
        in blocks that are someone else's by then."""
        regions = peer.regions
        if [r[1] for r in regions] != self.strides:
            return f"the peer's K/V regions ({len(regions)}, {[r[1] for r in regions][:2]}… bytes a block) are not this rank's"
        local = [(r.data_ptr() + lb * s, s, self.dev_id) for lb, _ in pairs for r, s in zip(self.regions, self.strides)]
        remote = [(base + rb * s, s, dev) for _, rb in pairs for base, s, dev in regions]
        with self._lock:
            if peer.agent not in self._known and peer.agent != self.name:  # (its own: a loopback read, kv_role both)
                self.agent.add_remote_agent(peer.metadata)
                self._known.add(peer.agent)
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.mem),
                                                self.agent.get_xfer_descs(remote, self.mem), peer.agent)
        try:
            with self._lock:
                state = self.agent.transfer(handle)
        except Exception as e:  # noqa: BLE001 - not posted: released below
            state, posting = "ERR", e
        else:
            posting = None
            state = self._wait(handle, state, timeout)
        why = (None if state == "DONE" else f"the transfer failed ({posting or 'the peer gone?'})" if state == "ERR"
               else f"no answer in {timeout:.1f} s")
        try:
            with self._lock:
                self.agent.release_xfer_handle(handle)  # (cancels one in progress)
        except Exception as e:  # noqa: BLE001 - not cancelled: it may still write into these blocks
            if self._wait(handle, state, max(timeout, 1.0)) == "PROC":
                from kvpilot.server.engine.termination import fatal

                fatal(f"a NIXL read from {peer.agent} could be neither finished nor cancelled ({type(e).__name__}: {e}): "
                      "the KV cache can no longer be trusted")
            return why  # (its handle is the agent's now: the peer's metadata stays while it may refer to it)
        if why is not None:
            self.forget(peer.agent)
        return why

    def _wait(self, handle, state: str, timeout: float) -> str:
        """The transfer's state once it is no longer in progress, or PROC after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0)  # (the peer's progress thread answers; ours polls)
            with self._lock:
                state = self.agent.check_xfer_state(handle)
        return state

    def forget(self, agent: str) -> None:
        """A peer whose read failed (gone, most likely): its metadata is dropped (agents are not piled up)."""
        with self._lock:
            if agent in self._known:
                self._known.discard(agent)
                try:
                    self.agent.remove_remote_agent(agent)
                except Exception:  # noqa: BLE001
                    pass

    def close(self) -> None:
        self._stopped()


def _progress(agent, lock: threading.Lock, active: threading.Event, stop: threading.Event) -> None:
    """Answer peers' READs: the UCX worker progressed from here (NIXL's progress thread would spin)."""
    while not stop.is_set():
        with lock:
            agent.get_new_notifs()
        stop.wait(PROGRESS_ACTIVE_S if active.is_set() else PROGRESS_IDLE_S)


def _halt(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread is not threading.current_thread():
        thread.join(5)
