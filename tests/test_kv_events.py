"""KV events for routers (server/engine/kv_events.py): a plain ZeroMQ SUB socket and a msgpack decoder
rebuild the engine's prefix cache and its host tier exactly from what the engine publishes (blocks
stored, evicted, cleared), a batch missed while unsubscribed comes back from the replay socket, the
frames are vLLM's layout; --kv-events-config is vLLM's and what it does not take is refused;
/reset_prefix_cache through the server, behind its API key."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

BLOCK = 16
TOPIC = b"kv@pod-a@smollm2"
# Five prompts of about 150 tokens, no block shared between them, then one sharing the first's prefix.
PROMPTS = [f"{subject} " + " ".join(f"Note {i} about {subject.lower()}: it matters for reason {i * 7 % 13}." for i in range(12))
           for subject in ("Volcanoes", "Glaciers", "Harbours", "Orchards", "Lighthouses")]


def events_config(**extra) -> str:
    import json

    return json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                       "topic": TOPIC.decode(), **extra})


class Subscriber:
    """What a router keeps: per medium, the block hashes a replica holds, rebuilt from its events alone."""

    def __init__(self, endpoint: str):
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.socket.connect(endpoint)
        self.held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        self.parents: dict[int, int | None] = {}
        self.tokens: dict[int, list[int]] = {}
        self.next_seq = 0
        self.kinds: list[str] = []
        self.replayed = 0  # batches had from the replay socket

    def apply(self, payload: bytes) -> None:
        batch = msgspec.msgpack.decode(payload)
        assert isinstance(batch, list) and len(batch) == 3 and isinstance(batch[0], float) and batch[2] == 0  # [ts, events, dp rank]
        for event in batch[1]:
            kind = event["type"]
            self.kinds.append(kind)
            if kind == "BlockStored":
                assert set(event) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                                      "extra_keys", "group_idx", "kv_cache_spec_kind"}
                assert event["extra_keys"] == [None] * len(event["block_hashes"]) and event["group_idx"] == 0
                assert event["block_size"] == BLOCK and len(event["token_ids"]) == BLOCK * len(event["block_hashes"])
                parent = event["parent_block_hash"]
                for i, h in enumerate(event["block_hashes"]):
                    self.held[event["medium"]].add(h)
                    self.parents[h] = parent
                    self.tokens[h] = event["token_ids"][i * BLOCK:(i + 1) * BLOCK]
                    parent = h
            elif kind == "BlockRemoved":
                assert set(event) == {"type", "block_hashes", "medium"}
                for h in event["block_hashes"]:
                    self.held[event["medium"]].remove(h)  # a removal of a block never stored would be an error
            else:
                assert event == {"type": "AllBlocksCleared"}
                self.held["GPU"].clear()

    def receive(self, replay_endpoint: str, timeout: float = 5.0) -> None:
        """Every batch published so far: from the SUB socket, and a gap in the sequence numbers asked of the
        replay socket (as vLLM's subscribers do); returns once a quiet FLUSH interval passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.socket.poll(300):
                return
            topic, seq, payload = self.socket.recv_multipart()
            assert topic == TOPIC and len(seq) == 8
            seq = int.from_bytes(seq, "big")
            if seq > self.next_seq:
                self.replay(replay_endpoint, self.next_seq, seq)
            if seq == self.next_seq:
                self.apply(payload)
                self.next_seq += 1
        raise AssertionError("the events did not stop")

    def replay(self, endpoint: str, first: int, upto: int) -> None:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(endpoint)
        try:
            dealer.send_multipart([b"", first.to_bytes(8, "big")])
            while True:
                assert dealer.poll(5000), "no replay answer"
                empty, seq, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq, "big", signed=True)
                if seq == -1:
                    assert empty == b"" and payload == b""
                    return
                if self.next_seq <= seq < upto:
                    assert seq == self.next_seq
                    self.apply(payload)
                    self.next_seq += 1
                    self.replayed += 1
        finally:
            dealer.close(linger=0)


def external(key: bytes) -> int:
    return int.from_bytes(key[-8:], "big")


def greedy(llm, prompts, tokens=4):
    from kvpilot.server import SamplingParams

    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))


@pytest.mark.timeout(240)
def test_a_subscriber_rebuilds_the_prefix_cache_and_host_tier_from_the_events_with_a_replay():
    from kvpilot.server import LLM

    # 16 MiB: 22 blocks of 16 tokens: each prompt (9 blocks) evicts what the one before the last left
    llm = LLM(num_threads=1, show_progress=False, kv_cache_memory="16MiB", kv_host_offload_size="4MiB", kv_events_config=events_config())
    engine = llm.engine
    publisher, bm, host = engine.kv_event_publisher, engine.block_manager, engine.kv_connector.host
    sub = Subscriber(publisher.endpoint)
    time.sleep(0.3)  # a SUB socket's subscription reaches the PUB side after its connect (ZeroMQ's slow joiner)

    def check():
        sub.receive(publisher.replay_endpoint)
        assert sub.held["GPU"] == {external(k) for k in bm.cached}
        assert sub.held["CPU"] == {external(k) for k in host._blocks}

    greedy(llm, PROMPTS[:1])
    check()
    first_ids = engine.tokenizer.encode(PROMPTS[0])
    chain = [h for h in sub.held["GPU"] if sub.parents[h] is None]
    assert len(chain) == 1 and sub.tokens[chain[0]] == first_ids[:BLOCK]  # a first block: no parent, the prompt's first tokens

    sub.socket.close(linger=0)  # the router restarts: what is published meanwhile it misses ...
    greedy(llm, PROMPTS[1:3])
    time.sleep(0.3)
    sub.socket = zmq.Context.instance().socket(zmq.SUB)
    sub.socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.socket.connect(publisher.endpoint)
    time.sleep(0.3)
    greedy(llm, PROMPTS[3:5])  # ... and has back from the replay socket once a later batch shows the gap
    check()
    assert sub.replayed >= 1
    assert "BlockRemoved" in sub.kinds  # the small cache evicted blocks, and the host tier some of its own
    assert len(sub.held["CPU"]) == host.max_blocks

    greedy(llm, [PROMPTS[4] + " And one more sentence."])  # a prefix hit: nothing of it is stored again
    check()

    engine.reset_prefix_cache()
    check()
    assert sub.kinds[-1] == "AllBlocksCleared" and not bm.cached and sub.held["CPU"]
    engine.reset_prefix_cache(external=True)  # the tiers too
    check()
    assert not sub.held["CPU"]
    greedy(llm, PROMPTS[:1])
    check()
    assert sub.held["GPU"]
    llm.engine.close()


def test_an_adapters_blocks_carry_its_id_and_name_and_a_run_breaks_at_a_block_cached_already():
    from kvpilot.server.engine.block_manager import BlockManager
    from kvpilot.server.engine.kv_events import KVEventRecorder
    from kvpilot.server.engine.sampling_params import SamplingParams
    from kvpilot.server.engine.sequence import Sequence

    recorder = KVEventRecorder(4, lora_name={3: "sql-adapter"}.get)
    bm = BlockManager(8, 4, adapter_fingerprint=lambda a: bytes([a]) * 32, events=recorder)
    one = Sequence(0, "a", 0, list(range(10)), SamplingParams(max_tokens=1), 1, adapter=3)
    assert bm.allocate(one, 10, bm.match_prefix(one))
    bm.cache_full_blocks(one, 10)
    # the same first 8 tokens computed alongside (no prefix hit: admitted in the same step) then 4 of its own
    two = Sequence(1, "b", 0, list(range(8)) + [50, 51, 52, 53, 54], SamplingParams(max_tokens=1), 1, adapter=3)
    assert bm.allocate(two, 13, [])
    bm.cache_full_blocks(two, 13)
    events = [msgspec.msgpack.decode(msgspec.msgpack.encode(e)) for e in recorder.take()]
    keys = one.block_hashes + two.block_hashes[2:]
    assert events == [
        {"type": "BlockStored", "block_hashes": [external(k) for k in one.block_hashes], "parent_block_hash": None,
         "token_ids": list(range(8)), "block_size": 4, "lora_id": 3, "medium": "GPU", "lora_name": "sql-adapter",
         "extra_keys": [["sql-adapter"], ["sql-adapter"]], "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockStored", "block_hashes": [external(keys[2])], "parent_block_hash": external(keys[1]),
         "token_ids": [50, 51, 52, 53], "block_size": 4, "lora_id": 3, "medium": "GPU", "lora_name": "sql-adapter",
         "extra_keys": [["sql-adapter"]], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}]
    assert bm.reset_prefix_cache() == 3 and [type(e).__name__ for e in recorder.take()] == ["AllBlocksCleared"]


@pytest.mark.parametrize("settings, refusal", [
    ('{"enable_kv_cache_events": true, "port": 5557}', "port: unknown key"),
    ('{"publisher": "zmq"}', "publisher zmq needs enable_kv_cache_events true"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
    ("[5557]", "must be a JSON object"),
    ("{nope", "not JSON"),
])
def test_what_kv_events_config_does_not_take_is_refused_by_name(settings, refusal):
    from kvpilot.server.config import EngineConfig

    with pytest.raises(ValueError, match=refusal):
        EngineConfig(kv_events_config=settings)
    assert EngineConfig(kv_events_config='{"publisher": "null"}').kv_events() is None  # vLLM's off switch
    assert EngineConfig.from_cli_args(["--kv-events-config", events_config()]).kv_events().topic == TOPIC.decode()
