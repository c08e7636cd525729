"""--scheduling-policy fcfs|priority and the request field `priority` (vLLM's semantics): the
scheduler's order and preemption choice, and the order real servers (both modes) finish queued
requests in; under fcfs a non-zero priority is a 400, as in vLLM."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kvpilot.server.engine.block_manager import BlockManager
from kvpilot.server.engine.limits import RequestLimits, RequestRejected
from kvpilot.server.engine.sampling_params import SamplingParams
from kvpilot.server.engine.scheduler import ScheduledBatch, Scheduler
from kvpilot.server.engine.sequence import Sequence, Status
from server_harness import SERVER_MODES, metrics, serve_for_tests

MODEL = "smollm2-135m"


def seq(seq_id: int, prompt_len: int, priority: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(100 * seq_id, 100 * seq_id + prompt_len)),
                    SamplingParams(max_tokens=64, ignore_eos=True, priority=priority))


def run(sched: Scheduler) -> ScheduledBatch:
    """One step as the engine runs it: every scheduled token computed, a token sampled where a
    sequence has caught up."""
    batch = sched.schedule()
    sched.update(batch)
    for s in batch.seqs:
        if s.num_computed_tokens == s.num_tokens:
            s.output_token_ids.append(7)
    return batch


# --- the scheduler --------------------------------------------------------------------------------

@pytest.mark.parametrize("policy, expected", [("fcfs", [0, 1, 2, 3, 4, 5]), ("priority", [4, 1, 3, 2, 5, 0])])
def test_waiting_order(policy, expected):
    """One slot: the order the waiting sequences run in is arrival (fcfs), else (priority, arrival)."""
    sched = Scheduler(BlockManager(64, 4), 1, 64, policy=policy)
    for i, priority in enumerate([3, 1, 2, 1, 0, 2]):
        sched.add(seq(i, 5, priority))
    admitted = []
    while sched.has_unfinished():
        batch = run(sched)
        for s in batch.seqs:
            if s.seq_id not in admitted:
                admitted.append(s.seq_id)
            sched.finish(s)  # one step each: the next waiting one goes next
    assert admitted == expected


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_picks_the_worst_priority(policy):
    """Blocks run out for the last running sequence (C). fcfs preempts the newest running one (C
    itself) and puts it at the front of the queue; priority preempts the one with the highest
    priority value (B), although this step had already scheduled it (its tokens are taken back),
    and queues it at its place by priority."""
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, 3, 64, policy=policy)
    a, b, c, d, e = seq(0, 4, 0), seq(1, 2, 5), seq(2, 4, 1), seq(3, 4, 3), seq(4, 4, 9)
    sched.add(a)
    sched.add(b)
    run(sched)                       # A and B prefill (a block each)
    sched.add(c)
    run(sched)                       # A's second block; C prefills: no block is left
    assert [s.seq_id for s in sched.running] == [0, 1, 2] and not bm.free
    sched.add(d)
    sched.add(e)                     # no slot: they wait
    batch = sched.schedule()         # C needs a second block
    if policy == "fcfs":
        assert batch.preempted == [c] and batch.seqs == [a, b] and batch.num_new_tokens == [1, 1]
        assert list(sched.waiting) == [c, d, e] and sched.running == [a, b]
        assert len(bm.free) == 1  # C's block: free for a later step
    else:
        assert batch.preempted == [b] and batch.seqs == [a, c] and batch.num_new_tokens == [1, 1]
        assert list(sched.waiting) == [d, b, e] and sched.running == [a, c]
        assert len(c.block_table) == 2 and not bm.free  # B's block went to C
    victim = batch.preempted[0]
    assert victim.status is Status.WAITING and victim.num_computed_tokens == 0 and not victim.block_table
    assert victim.num_preemptions == 1 and sched.num_preemptions == 1


def test_priority_preemption_keeps_every_request():
    """Under pressure with mixed priorities every sequence still finishes exactly once, with all its tokens."""
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, 4, 16, policy="priority")
    seqs = [Sequence(i, f"r{i}", 0, list(range(10 * i, 10 * i + 3)), SamplingParams(max_tokens=9, ignore_eos=True, priority=p))
            for i, p in enumerate([4, 0, 2, 0, -1, 3])]
    for s in seqs:
        sched.add(s)
    done = []
    for _ in range(500):
        batch = run(sched)
        for s in batch.seqs:
            if s.length_reached():
                sched.finish(s)
                done.append(s.seq_id)
        if not sched.has_unfinished():
            break
    assert sorted(done) == list(range(6)) and sched.num_preemptions > 0
    assert all(len(s.output_token_ids) == 9 for s in seqs) and bm.usage() == 0.0


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(BlockManager(4, 4), 1, 16, policy="lifo")


# --- admission ------------------------------------------------------------------------------------

def test_admission_under_each_policy():
    fcfs, prio = RequestLimits(64, 100), RequestLimits(64, 100, scheduling_policy="priority")
    assert fcfs.admit([1, 2], SamplingParams(priority=0)).params.priority == 0  # 0 is the default, taken by both
    with pytest.raises(RequestRejected, match="--scheduling-policy priority") as e:
        fcfs.admit([1, 2], SamplingParams(priority=-1))
    assert e.value.param == "priority"
    assert prio.admit([1, 2], SamplingParams(priority=-7)).params.priority == -7
    for bad in (True, 1.5, "1", 2**63):
        with pytest.raises(ValueError, match="priority"):
            SamplingParams(priority=bad)


# --- real servers ---------------------------------------------------------------------------------

FLAGS = ("--max-num-seqs", "1", "--max-waiting-requests", "8", "--kv-cache-memory", "64MiB", "--max-model-len", "512")


# The priority servers run in both modes; an fcfs one in the first only (each mode's API process admits
# with the configured policy, app.py's create_state: an fcfs refusal never reaches the engine core).
@pytest.fixture(scope="module", params=[("one-process", "fcfs"), *[(mode, "priority") for mode in SERVER_MODES]],
                ids=lambda p: f"{p[0]}-{p[1]}")
def policy_server(request, tmp_path_factory):
    mode, policy = request.param
    for server in serve_for_tests(tmp_path_factory, *FLAGS, "--scheduling-policy", policy, *SERVER_MODES[mode]):
        server.policy = policy
        yield server


def waiting(url: str) -> float:
    return metrics(url)["kvpilot:num_requests_waiting"]


def test_queued_requests_run_by_priority(policy_server):
    """One sequence slot, held by a streaming request while three more queue behind it: L1
    (completions, priority 3), L2 (chat, 5), H (completions, -1), in that order. Once the slot frees,
    the priority server finishes H, L1, L2; the fcfs one (priorities unset: it refuses them) L1, L2, H."""
    url, prio = policy_server.url, policy_server.policy == "priority"
    finished: list[str] = []
    errors: list[str] = []

    def send(name: str, path: str, body: dict, priority: int) -> None:
        body = {"model": MODEL, "max_tokens": 3, "ignore_eos": True, "temperature": 0, "stream": True, **body}
        if prio:
            body["priority"] = priority
        try:
            with httpx.stream("POST", url + path, json=body, timeout=120) as r:
                if r.status_code != 200:
                    errors.append(f"{name}: {r.status_code} {r.read().decode()}")
                    return
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            last = json.loads(lines[-2][6:])
            if lines[-1] != "data: [DONE]" or last["choices"][0]["finish_reason"] != "length":
                errors.append(f"{name}: did not finish whole: {lines[-3:]}")
            finished.append(name)
        except Exception as e:  # noqa: BLE001 - reported by the test's thread
            errors.append(f"{name}: {type(e).__name__}: {e}")

    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}) as hold:
        lines = hold.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it runs: the one slot is taken
        threads = []
        for n, (name, path, body, priority) in enumerate([
                ("L1", "/v1/completions", {"prompt": "The capital of France is"}, 3),
                ("L2", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, 5),
                ("H", "/v1/completions", {"prompt": "One, two, three,"}, -1)]):
            threads.append(threading.Thread(target=send, args=(name, path, body, priority)))
            threads[-1].start()
            deadline = time.monotonic() + 30
            while waiting(url) < n + 1 and time.monotonic() < deadline:  # queued in the engine, in this order
                time.sleep(0.05)
            assert waiting(url) == n + 1, f"{name} was not queued behind the running request"
        assert not errors and not finished
        # closing the stream aborts the request that holds the slot
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert finished == (["H", "L1", "L2"] if prio else ["L1", "L2", "H"])


@pytest.mark.parametrize("body", [{"prompt": "Hi"}, {"messages": [{"role": "user", "content": "Hi"}]}], ids=["completions", "chat"])
def test_priority_field_is_checked(policy_server, body):
    """Under fcfs a non-zero priority is a 400 naming it (vLLM refuses it too) and 0 is taken; under
    priority any int64 is; a value of another type, or out of range, is a 400 under both."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    post = lambda priority: httpx.post(policy_server.url + path, timeout=60,  # noqa: E731
                                       json={"model": MODEL, "max_tokens": 1, **body, "priority": priority})
    r = post(0)
    assert r.status_code == 200, r.text
    r = post(-3)
    if policy_server.policy == "fcfs":
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        assert "--scheduling-policy priority" in r.json()["error"]["message"]
    else:
        assert r.status_code == 200, r.text
    for bad in ("high", 1.5, True, None, [1], 2**63, -(2**63) - 1, 10**30):
        r = post(bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", (bad, r.text)
