"""Tensor and pipeline parallelism: the model split over ranks that are processes (torch.distributed:
gloo on CPU, NCCL on CUDA when there is a GPU per rank): pipeline_parallel_size stages of consecutive
layers, each stage's layers split over tensor_parallel_size ranks (its all-reduces within the stage's
process group); ranks = TP × PP, rank = stage × TP + its place in the stage.

Rank 0 is the engine: scheduler, block manager, tokenizer, HTTP server, sampling. It starts ranks
1…N−1 (`Workers`), each a Worker (engine/worker.py) that loads its shard of the weights, allocates
the KV cache of its heads and then runs every step from the Step message rank 0 sends
(engine/step_message.py: what the scheduler decided, as bytes over a gloo `Channel`; each rank's
worker builds its own tensors from it and its WorkerBatch, as rank 0's worker does). With async scheduling rank 0 also broadcasts the
sampled tokens of the step in flight (a device tensor collective), which the placeholders take.
Projections are split Megatron-style: q/k/v and gate/up by output rows (heads, FFN columns), o and
down by input columns with one all-reduce each; the embedding and the LM head by vocabulary rows.
Stages hand the residual stream of the step's tokens on to the rank of the same place in the next
stage (a point-to-point send); the last stage's first rank sends rank 0 the logits, which it samples.

Failure is loud, never a hang: a rank that dies makes rank 0 log it, write it to the container's
termination message and exit non-zero (Kubernetes restarts the pod); a rank that fails while
loading says which rank and why.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import traceback
from collections import deque
from datetime import timedelta
from pathlib import Path
from typing import Any

from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.step_message import Describe, DescribePeers, Message, NixlPeer, Stop, decode, encode
from kvpilot.server.engine.termination import fatal
from kvpilot.server.models.sharding import PipelineStage, TensorParallel

COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("KVPILOT_TP_TIMEOUT_SECONDS", "300")))

log = logging.getLogger(__name__)

def backend(device_type: str, ranks_here: int) -> str:
    """ranks_here: the ranks on this machine (a group's pod holds its share)."""
    import torch

    if device_type == "cuda" and torch.cuda.device_count() >= ranks_here:
        return "nccl"
    return "gloo"  # CPU, or several ranks sharing one GPU (NCCL needs a device per rank)


class GroupJoinTimeout(RuntimeError):
    """Ranks of a group of pods did not join in time (the message names them and their pods)."""


GROUP_KEYS = "kvpilot/"  # the group's keys in its rendezvous store: joined/<rank>, heartbeat/<pod>, ready
HEARTBEAT_S = 1.0        # a group's pods tick their heartbeat this often
HEARTBEAT_MISSED_S = 10.0  # the leader stops the group when a pod's heartbeat is this old


def join(rank: int, world_size: int, rendezvous: str | tuple[str, int], device_type: str, ranks_here: int,
         join_timeout: float = 300.0, pod_of=None):
    """Join the ranks' process group. rendezvous: a file:// init method (one pod: every rank a process of
    it), or (host, port): a group of pods, whose leader's rank 0 hosts a TCP store there; every rank says
    it joined, and rank 0 waits for all of them (join_timeout), naming the ranks (pod_of(rank): their pod)
    that did not. The group's store (None for one pod)."""
    import torch.distributed as dist

    if isinstance(rendezvous, str):
        dist.init_process_group(backend(device_type, ranks_here), init_method=rendezvous, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
        return None
    import time

    host, port = rendezvous
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=join_timeout), wait_for_workers=False)
    store.set(f"{GROUP_KEYS}joined/{rank}", "1")
    if rank == 0:
        deadline = time.monotonic() + join_timeout
        keys = [f"{GROUP_KEYS}joined/{r}" for r in range(world_size)]
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if not store.check([keys[r]])]
                where = f" (pods {sorted({pod_of(r) for r in missing})})" if pod_of else ""
                raise GroupJoinTimeout(f"ranks {missing} of {world_size}{where} did not join the group at port {port} within "
                                   f"{join_timeout:g} s (group_join_timeout): is every pod of the group running `kvpilot serve-worker` "
                                   "with this pod as its group_leader?")
            time.sleep(0.2)
    dist.init_process_group(backend(device_type, ranks_here), store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    return store


def join_stages(rank: int, config: EngineConfig, num_layers: int, device_type: str) -> tuple[TensorParallel | None, PipelineStage | None]:
    """After joining the process group and making the Channel: this rank's place (tensor-parallel
    position, pipeline stage; None where there is one). With stages, every stage's group is made here
    (new_group is collective: every rank makes every group, in the same order)."""
    import torch.distributed as dist

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if pp == 1:
        return TensorParallel(rank, tp), None
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), backend=backend(device_type, tp * pp)) for s in range(pp)] if tp > 1 else []
    stage = PipelineStage.of(rank, tp, pp, num_layers, config.pipeline_layer_partition)
    return (TensorParallel(rank % tp, tp, groups[stage.index]) if tp > 1 else None), stage


class Channel:
    """Messages from rank 0 to every rank as bytes: a length, then the payload, sent to each rank
    point-to-point over a gloo group of its own (CPU tensors whatever the device's backend). Every rank
    makes it right after joining the process group (new_group is collective).

    Rank 0 does not wait for a message to be taken (a gloo send completes only once its receiver
    asks for it): with pipeline stages it goes on to its next steps while later stages still run
    earlier ones, which take their messages in order. Up to `in_flight` messages may be untaken (a
    step per stage: the last stage takes a step's message once it is done with the one S - 1 before);
    beyond, the oldest is waited for."""

    TAG = 1

    def __init__(self, in_flight: int = 1):
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo")
        self.in_flight = in_flight
        self._sending: deque[list] = deque()  # per message not known to be taken: its sends, with their tensors

    def send(self, message: Message) -> None:
        import torch
        import torch.distributed as dist

        while len(self._sending) >= self.in_flight:
            for work, _ in self._sending.popleft():
                work.wait()
        data = encode(message)
        size, payload = torch.tensor([len(data)], dtype=torch.long), torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._sending.append([(work, t) for rank in range(1, dist.get_world_size(self.group))
                              for work, t in ((dist.isend(size, rank, group=self.group, tag=self.TAG), size),
                                              (dist.isend(payload, rank, group=self.group, tag=self.TAG), payload))])

    def receive(self) -> Message:
        import torch
        import torch.distributed as dist

        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, 0, group=self.group, tag=self.TAG)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, 0, group=self.group, tag=self.TAG)
        return decode(data.numpy().tobytes())

    def say(self, go: bool) -> None:
        """Rank 0: whether the ranks go on into the next collective part of a step (a host tensor: no
        wait on the device)."""
        import torch
        import torch.distributed as dist

        dist.broadcast(torch.tensor([int(go)]), src=0, group=self.group)

    def heard(self) -> bool:
        """Ranks 1…N−1: what rank 0 said (say)."""
        import torch
        import torch.distributed as dist

        flag = torch.empty(1, dtype=torch.long)
        dist.broadcast(flag, src=0, group=self.group)
        return bool(flag.item())

    def agree(self, failed) -> set:
        """Every rank: what failed on any rank (the KV connector's loads: their keys)."""
        import torch.distributed as dist

        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, list(failed), group=self.group)
        return {key for keys in every for key in keys}


class Workers:
    """Rank 0's handle on ranks 1…N−1: starts them, joins the process group with them, sends each step."""

    def __init__(self, config: EngineConfig, model_path: Path, device_type: str, num_layers: int, split_draft: Path | None = None):
        """split_draft: the draft model's file when it is split over the ranks (each loads its shard).
        Rank 0's place: self.tp, self.stage."""
        import torch.distributed as dist

        if dist.is_initialized():  # torch.distributed has one default group per process
            raise RuntimeError("a tensor-parallel engine is already running in this process: close it first (LLM.engine.close())")
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.stages = config.pipeline_parallel_size
        self.pods, self.ranks_per_pod = config.group_size, self.world_size // config.group_size
        self._closing = False
        self._store_dir = tempfile.mkdtemp(prefix="kvpilot-tp-")  # the rendezvous file; removed at close
        # One pod: a file beside every rank. A group: the TCP store rank 0 hosts on group_port (this pod's ranks reach it locally).
        rendezvous = f"file://{Path(self._store_dir) / 'store'}" if self.pods == 1 else ("127.0.0.1", config.group_port)
        ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of rank 0's threads or torch state
        self._errors = ctx.SimpleQueue()
        self.procs = [ctx.Process(target=worker_main, name=f"kvpilot-tp-rank{rank}", daemon=True,
                                  args=(rank, self.world_size, rendezvous, config.model_dump(), str(model_path), device_type, self._errors,
                                        str(split_draft) if split_draft else None))
                      for rank in range(1, self.ranks_per_pod)]
        for p in self.procs:
            p.start()
        import atexit

        atexit.register(self.close)  # before the interpreter's exit stops the ranks (the watchdog must know it is expected)
        threading.Thread(target=self._watch, name="kvpilot-tp-watchdog", daemon=True).start()
        try:
            self._store = join(0, self.world_size, rendezvous, device_type, self.ranks_per_pod, config.group_join_timeout,
                               lambda rank: rank // self.ranks_per_pod)
            self.channel = Channel(in_flight=config.pipeline_parallel_size)
            self.tp, self.stage = join_stages(0, config, num_layers, device_type)
        except BaseException as e:
            self._closing = True
            for p in self.procs:
                p.kill()
            shutil.rmtree(self._store_dir, ignore_errors=True)
            if isinstance(e, GroupJoinTimeout):  # the server stops with the cause, as when a rank dies
                fatal(str(e))
            raise
        if self._store is not None:
            self._store.set(f"{GROUP_KEYS}ready", "1")  # the group's other pods answer ready from now on
            threading.Thread(target=self._watch_pods, name="kvpilot-group-watchdog", daemon=True).start()

    def _watch_pods(self) -> None:
        """A group's leader: every other pod's heartbeat must tick; a pod silent for HEARTBEAT_MISSED_S (its
        process gone, its machine down or cut off) stops the server with its cause, as a dead local rank does."""
        import time

        seen = {pod: (-1, time.monotonic()) for pod in range(1, self.pods)}
        while not self._closing:
            time.sleep(HEARTBEAT_S)
            for pod, (count, since) in seen.items():
                try:
                    now = self._store.add(f"{GROUP_KEYS}heartbeat/{pod}", 0)
                except Exception:  # noqa: BLE001 - the store is this process's own: only closing ends it
                    return
                if now != count:
                    seen[pod] = (now, time.monotonic())
                elif time.monotonic() - since > HEARTBEAT_MISSED_S and not self._closing:
                    first = pod * self.ranks_per_pod
                    fatal(f"group pod {pod} of {self.pods} (ranks {first}-{first + self.ranks_per_pod - 1}) stopped answering: "
                          f"no heartbeat for {time.monotonic() - since:.0f} s")

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        ready = wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        dead = next(p for p in self.procs if p.sentinel in ready)
        dead.join(5)  # its pipe closes just before it can be reaped
        cause = self._errors.get() if not self._errors.empty() else f"exit code {dead.exitcode}"
        rank = self.procs.index(dead) + 1
        if self.stages > 1:
            tp = self.world_size // self.stages
            fatal(f"pipeline stage {rank // tp} of {self.stages} (rank {rank} of {self.world_size}) stopped: {cause}")
        fatal(f"tensor-parallel rank {rank} of {self.world_size} stopped: {cause}")

    def send(self, message: Message) -> None:
        self.channel.send(message)

    def broadcast_tokens(self, tokens) -> None:
        """Token ids (or counts) from rank 0's device to every rank's: the step in flight's sampled tokens
        and accepted counts, the step's proposed tokens."""
        import torch.distributed as dist

        dist.broadcast(tokens.contiguous(), src=0)

    def say(self, go: bool) -> None:
        """With a split draft model: before each collective part of a step (each draft step, then the
        target's), whether rank 0's own work before it went well; False: every rank drops the step
        (rank 0's engine then re-runs its requests one by one)."""
        self.channel.say(go)

    def agree(self, failed) -> set:
        """After a KVWork with loads: the keys of those that failed on any rank (every rank drops them)."""
        return self.channel.agree(failed)

    def peers(self) -> list[NixlPeer]:
        """Ranks 1…N−1's NIXL agents (a prefill engine hands them to decode engines)."""
        import torch.distributed as dist

        self.send(DescribePeers())
        out: list[Any] = [None] * self.world_size
        dist.gather_object(None, out, dst=0)
        return out[1:]

    def describe(self, own: dict) -> list[dict]:
        """Every rank's description of what it holds (rank 0's first; not on the step path)."""
        import torch.distributed as dist

        self.send(Describe())
        out: list[Any] = [None] * self.world_size
        dist.gather_object(own, out, dst=0)
        return out

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        import atexit

        atexit.unregister(self.close)
        try:
            self.send(Stop())
        except Exception:  # noqa: BLE001 - ranks already gone: nothing to tell
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._store_dir, ignore_errors=True)


def worker_main(rank: int, world_size: int, rendezvous: str | tuple[str, int], config: dict, model_path: str, device_type: str, errors,
                split_draft: str | None = None) -> None:
    """Ranks 1…N−1 (of this pod: a group's others run on theirs): load this rank's shard, then run steps
    until rank 0 says stop."""
    engine_config = EngineConfig(**config)
    from kvpilot.server.threads import configure_threads

    configure_threads(engine_config.num_threads)
    try:
        from kvpilot.server.engine.kv_scales import kv_calibration_ids
        from kvpilot.server.engine.worker import Worker
        from kvpilot.server.loading import open_model

        join(rank, world_size, rendezvous, device_type, world_size // engine_config.group_size, engine_config.group_join_timeout)
        channel = Channel()
        weights, tokenizer = open_model(Path(model_path), engine_config.load_format, engine_config.seed)
        tp, stage = join_stages(rank, engine_config, weights.config.num_layers, device_type)
        drafter = None
        if split_draft:  # this rank's shard of the draft model (rank 0 checked and resolved it; a whole one is rank 0's alone)
            from kvpilot.server.engine.drafters import DraftModel

            draft, _ = open_model(Path(split_draft))
            drafter = lambda worker: DraftModel(worker, draft, split=True)  # noqa: E731
        worker = Worker(engine_config, weights, show_progress=False, tp=tp, stage=stage,
                        kv_calibration_ids=kv_calibration_ids(engine_config, tokenizer), drafter=drafter)
        del weights
    except BaseException as e:
        errors.put(f"failed at start-up: {type(e).__name__}: {e}")
        traceback.print_exc()
        sys.exit(1)
    try:
        worker.serve(channel)
    except BaseException as e:  # rank 0 went away (connection closed) or a step failed here
        errors.put(f"failed in a step: {type(e).__name__}: {e}")
        sys.exit(1)


def serve_group_pod(config: EngineConfig, host: str, port: int) -> int:
    """`kvpilot serve-worker`: a pod of a group other than its leader. It starts its share of the ranks
    (group_rank's, in rank order), which meet the leader's at group_leader:group_port and then run every
    step rank 0 sends; it ticks its heartbeat in the group's store (the leader stops the group when it
    goes silent) and serves /health (200 while its ranks live and the leader answers) and /ready (200
    once the whole group joined) on host:port. It ends with its first rank: 0 when the leader stopped
    the group, else non-zero with the cause (the container's termination message), as the leader does."""
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from multiprocessing.connection import wait

    import torch.distributed as dist

    from kvpilot.server.engine.worker import resolve_device
    from kvpilot.server.model_files import engine_model_path

    world = config.tensor_parallel_size * config.pipeline_parallel_size
    per_pod = world // config.group_size
    first = config.group_rank * per_pod
    model_path = engine_model_path(config)
    device_type = resolve_device(config).type
    rendezvous = (config.group_leader, config.group_port)
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker_main, name=f"kvpilot-rank{rank}", daemon=True,
                         args=(rank, world, rendezvous, config.model_dump(), str(model_path), device_type, errors))
             for rank in range(first, first + per_pod)]
    for p in procs:
        p.start()

    def stop(message: str) -> None:
        for p in procs:  # (a fatal exit does not end daemon processes: a container's end would, a test's would not)
            p.kill()
        fatal(message)

    try:
        store = dist.TCPStore(config.group_leader, config.group_port, world, is_master=False,
                              timeout=timedelta(seconds=config.group_join_timeout))
    except Exception as e:  # noqa: BLE001 - (its ranks, daemons, end with this process)
        stop(f"group pod {config.group_rank}: could not reach the group's leader at {config.group_leader}:{config.group_port} within "
              f"{config.group_join_timeout:g} s (group_join_timeout): {type(e).__name__}: {e}")
    state = {"leader": True}

    def heartbeat() -> None:
        while True:
            try:
                store.add(f"{GROUP_KEYS}heartbeat/{config.group_rank}", 1)
            except Exception as e:  # noqa: BLE001 - the leader's store is gone: so is the group
                state["leader"] = False
                deadline = time.monotonic() + 5  # a leader that stopped the group told the ranks first: they end cleanly
                while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if all(p.exitcode == 0 for p in procs):
                    return
                stop(f"group pod {config.group_rank}: the group's leader at {config.group_leader}:{config.group_port} went away "
                      f"({type(e).__name__}: {e})")
            time.sleep(HEARTBEAT_S)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            alive = all(p.is_alive() for p in procs) and state["leader"]
            if self.path == "/health":
                ok = alive
            elif self.path == "/ready":
                ok = alive and store.check([f"{GROUP_KEYS}ready"])
            else:
                self.send_error(404)
                return
            body = b"ok" if ok else b"not ready"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # probes every few seconds: not logged
            pass

    server = ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=heartbeat, name="kvpilot-group-heartbeat", daemon=True).start()
    threading.Thread(target=server.serve_forever, name="kvpilot-group-health", daemon=True).start()
    log.info("group pod %d of %d: ranks %d-%d, leader %s:%d, health on %s:%d", config.group_rank, config.group_size, first,
             first + per_pod - 1, config.group_leader, config.group_port, host, server.server_address[1])
    ready = wait([p.sentinel for p in procs])
    dead = next(p for p in procs if p.sentinel in ready)
    dead.join(5)
    if dead.exitcode == 0:  # rank 0 said stop: the others follow
        for p in procs:
            p.join(10)
        server.shutdown()
        return 0
    cause = errors.get() if not errors.empty() else f"exit code {dead.exitcode}"
    stop(f"group pod {config.group_rank}: rank {first + procs.index(dead)} of {world} stopped: {cause}")
    return 70
