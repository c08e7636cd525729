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

def backend(device_type: str, world_size: int) -> str:
    import torch

    if device_type == "cuda" and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"  # CPU, or several ranks sharing one GPU (NCCL needs a device per rank)


def join_stages(rank: int, config: EngineConfig, num_layers: int, device_type: str) -> tuple[TensorParallel | None, PipelineStage | None]:
    """After joining the process group and making the Channel: this rank's place (tensor-parallel
    position, pipeline stage; None where there is one). With stages, every stage's group is made here
    (new_group is collective: every rank makes every group, in the same order)."""
    import torch.distributed as dist

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if pp == 1:
        return TensorParallel(rank, tp), None
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), backend=backend(device_type, tp * pp)) for s in range(pp)] if tp > 1 else []
    stage = PipelineStage.of(rank, tp, pp, num_layers)
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
        self._closing = False
        self._store_dir = tempfile.mkdtemp(prefix="kvpilot-tp-")  # the rendezvous file; removed at close
        init_method = f"file://{Path(self._store_dir) / 'store'}"
        ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of rank 0's threads or torch state
        self._errors = ctx.SimpleQueue()
        self.procs = [ctx.Process(target=worker_main, name=f"kvpilot-tp-rank{rank}", daemon=True,
                                  args=(rank, self.world_size, init_method, config.model_dump(), str(model_path), device_type, self._errors,
                                        str(split_draft) if split_draft else None))
                      for rank in range(1, self.world_size)]
        for p in self.procs:
            p.start()
        import atexit

        atexit.register(self.close)  # before the interpreter's exit stops the ranks (the watchdog must know it is expected)
        threading.Thread(target=self._watch, name="kvpilot-tp-watchdog", daemon=True).start()
        try:
            dist.init_process_group(backend(device_type, self.world_size), init_method=init_method, rank=0, world_size=self.world_size,
                                    timeout=COLLECTIVE_TIMEOUT)
            self.channel = Channel(in_flight=config.pipeline_parallel_size)
            self.tp, self.stage = join_stages(0, config, num_layers, device_type)
        except BaseException:
            self._closing = True
            for p in self.procs:
                p.kill()
            shutil.rmtree(self._store_dir, ignore_errors=True)
            raise

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


def worker_main(rank: int, world_size: int, init_method: str, config: dict, model_path: str, device_type: str, errors,
                split_draft: str | None = None) -> None:
    """Ranks 1…N−1: load this rank's shard, then run steps until rank 0 says stop."""
    engine_config = EngineConfig(**config)
    from kvpilot.server.threads import configure_threads

    configure_threads(engine_config.num_threads)
    try:
        import torch.distributed as dist

        from kvpilot.server.engine.kv_scales import kv_calibration_ids
        from kvpilot.server.engine.worker import Worker
        from kvpilot.server.loading import open_model

        dist.init_process_group(backend(device_type, world_size), init_method=init_method, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
        channel = Channel()
        weights, tokenizer = open_model(Path(model_path))
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
