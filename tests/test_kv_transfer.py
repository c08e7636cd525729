"""Prefill/decode disaggregation (server/engine/kv_transfer.py): a prefill engine holds a finished
prompt's blocks, a decode engine pulls them over TCP and decodes; greedy tokens equal the aggregated
engine's, one request and a batch, with the decode side's own prefill work counted (a decode side that
ignored the params and recomputed would fail); a prefill engine gone before the pull, a hold nobody
pulls, and an engine of other settings: recomputed or released, same tokens, no block leaked on either
side; the HTTP surface in vLLM's kv_transfer_params fields; what is not implemented is refused."""

from __future__ import annotations

import json
import time

import httpx
import pytest

BLOCK = 16
PROMPTS = [f"{subject} " + " ".join(f"Fact {i} about {subject.lower()} matters for reason {i * 5 % 11}." for i in range(8))
           for subject in ("Lighthouses", "Beekeeping", "Tidal mills")]


def params(**kw):
    from kvpilot.server import SamplingParams

    return SamplingParams(**{"temperature": 0, "max_tokens": 10, "ignore_eos": True, **kw})


def transfer(**kw):
    from kvpilot.server.engine.sampling_params import KVTransferParams

    return KVTransferParams(**kw)


def engine(**kw):
    from kvpilot.server import LLM

    return LLM(num_threads=1, show_progress=False, kv_cache_memory="32MiB", **kw)


POOL_SECRET = "the-pool-secret-of-these-tests-0123456789"


@pytest.fixture(scope="module", autouse=True)
def pool_secret():
    """The prefill and decode engines of these tests, one pool: one secret (a prefill or decode engine refuses to start without)."""
    import os

    from kvpilot.server.engine.kv_trust import SECRET_ENV

    before = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = POOL_SECRET
    yield
    if before is None:
        del os.environ[SECRET_ENV]
    else:
        os.environ[SECRET_ENV] = before


@pytest.fixture(scope="module")
def reference():
    llm = engine()
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params())]


# The prefill engine's hold: a decode engine reads pulled blocks by 0.8 x HOLD_S - 1 s after the pull's
# answer (kv_transfer.py). 3 s left 1.4 s, which one decode step of other prompts outlasted on a loaded CI machine.
HOLD_S = 6


@pytest.fixture(scope="module")
def prefill():
    return engine(kv_role="prefill", kv_transfer_port=0, kv_transfer_timeout=HOLD_S)


def prefilled(prefill_llm, prompts):
    outs = prefill_llm.generate(prompts, params(max_tokens=1, kv_transfer=transfer(do_remote_decode=True)))
    return [o.kv_transfer_params for o in outs]


def prompt_blocks(llm, prompt):
    return (len(llm.engine.tokenizer.encode(prompt)) - 1) // BLOCK


@pytest.mark.timeout(240)
def test_prefill_then_decode_equals_the_aggregated_engine_one_and_batched(prefill, reference):
    from kvpilot.server.engine.sampling_params import KVTransferParams

    decode = engine(kv_role="decode", kv_transfer_timeout=10)
    free = prefill.engine.block_manager.num_free_blocks
    # one request
    [sent] = prefilled(prefill, PROMPTS[:1])
    assert sent["do_remote_prefill"] and sent["remote_port"] == prefill.engine.kv_connector.sender.port
    assert len(sent["remote_block_ids"]) == prompt_blocks(prefill, PROMPTS[0])
    assert prefill.engine.kv_connector.sender.num_held_blocks() == prompt_blocks(prefill, PROMPTS[0])  # held until pulled
    [out] = decode.generate(PROMPTS[:1], params(kv_transfer=KVTransferParams.from_dict(sent)))
    assert out.outputs[0].token_ids == reference[0]
    pulled = prompt_blocks(decode, PROMPTS[0])
    # the decode side computed only the prompt's tail: a side that recomputed would have pulled nothing
    assert decode.engine.kv_connector.receiver.stats.pulled_blocks == pulled and out.num_cached_tokens == pulled * BLOCK
    assert out.metrics.cached_sources == {"p2p": pulled * BLOCK}  # (#70: prompt_tokens_cached_by_source)
    # a batch of two more
    sent = prefilled(prefill, PROMPTS[1:])
    outs = decode.generate(PROMPTS[1:], [params(kv_transfer=KVTransferParams.from_dict(p)) for p in sent])
    assert [o.outputs[0].token_ids for o in outs] == reference[1:]
    assert decode.engine.kv_connector.receiver.stats.pulled_blocks == sum(prompt_blocks(decode, p) for p in PROMPTS)
    assert decode.engine.kv_connector.receiver.stats.failed_pulls == 0
    prefill.generate(["a step"], params(max_tokens=1))  # the prefill engine's loop gives pulled holds back
    assert prefill.engine.kv_connector.sender.num_held_blocks() == 0 and prefill.engine.block_manager.num_free_blocks == free
    assert decode.engine.block_manager.num_free_blocks == decode.engine.block_manager.num_blocks


@pytest.mark.timeout(240)
def test_a_prefill_engine_gone_an_unpulled_hold_and_other_settings_recompute_or_release(prefill, reference):
    from kvpilot.server.engine.sampling_params import KVTransferParams

    decode = engine(kv_role="decode", kv_transfer_timeout=30)
    # prefill engines gone before the pull: computed here, same tokens, nothing leaked; each dead peer is
    # noticed within a second, and pulls run side by side (they waited the whole timeout, one after
    # another: a live handoff behind three dead ones took 60 s; issue #75)
    gone = engine(kv_role="prefill", kv_transfer_port=0)
    dead = prefilled(gone, PROMPTS[1:]) + prefilled(gone, [f"Gone: {PROMPTS[0]}"])
    gone.engine.close()
    del gone
    [live] = prefilled(prefill, PROMPTS[:1])
    started = time.monotonic()
    outs = decode.generate([*PROMPTS[1:], f"Gone: {PROMPTS[0]}", PROMPTS[0]], [params(kv_transfer=KVTransferParams.from_dict(p)) for p in [*dead, live]])
    assert time.monotonic() - started < 15  # the timeout is 30 s
    assert [o.outputs[0].token_ids for o in outs[:2]] + [outs[3].outputs[0].token_ids] == [*reference[1:], reference[0]]
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 0, 0] and outs[3].num_cached_tokens > 0
    stats = decode.engine.kv_connector.receiver.stats
    assert stats.failed_pulls == 3 and stats.pulled_blocks == prompt_blocks(decode, PROMPTS[0])
    assert decode.engine.block_manager.num_free_blocks == decode.engine.block_manager.num_blocks

    # a hold nobody pulls is released after kv_transfer_timeout
    prefill.engine.step()  # (gives back the blocks pulled above)
    free = prefill.engine.block_manager.num_free_blocks
    prefilled(prefill, PROMPTS[1:2])
    assert prefill.engine.kv_connector.sender.num_held_blocks() > 0
    time.sleep(HOLD_S + 0.2)
    prefill.generate(["a step"], params(max_tokens=1))
    assert prefill.engine.kv_connector.sender.num_held_blocks() == 0 and prefill.engine.kv_connector.sender.stats.expired_transfers >= 1
    assert prefill.engine.block_manager.num_free_blocks == free

    # a decode engine of other settings (its KV identity differs): refused by identity, computed here
    other = engine(kv_role="decode", kv_cache_dtype="bfloat16", kv_transfer_timeout=2)
    own = other.generate(PROMPTS[2:], params())[0].outputs[0].token_ids
    other.engine.block_manager.cached.clear()  # (its own prefix cache must not answer instead)
    [sent] = prefilled(prefill, PROMPTS[2:])
    [out] = other.generate(PROMPTS[2:], params(kv_transfer=KVTransferParams.from_dict(sent)))
    assert out.outputs[0].token_ids == own and other.engine.kv_connector.receiver.stats.failed_pulls == 1
    assert other.engine.kv_connector.receiver.stats.pulled_blocks == 0


@pytest.mark.timeout(120)
def test_pulled_blocks_are_not_read_past_the_hold_and_a_request_let_go_releases_it(prefill, reference):
    """The prefill engine holds pulled blocks for its timeout from the pull's answer, then may reuse them:
    a decode engine that could not admit the prompt within it (here: the test waits) computes the prompt
    instead of reading blocks that may be another's by then (the hold is given back at once). A decode
    request aborted while its pull is answered, and one whose prompt is all in the decode engine's cache,
    release the prefill engine's hold at once (not at its timeout)."""
    from kvpilot.server.engine.sampling_params import KVTransferParams

    sender = prefill.engine.kv_connector.sender
    expired = sender.stats.expired_transfers
    decode = engine(kv_role="decode", kv_transfer_timeout=30)
    eng = decode.engine
    [late] = prefilled(prefill, PROMPTS[:1])
    request = eng.add_request(PROMPTS[0], params(kv_transfer=KVTransferParams.from_dict(late)))
    eng.step()  # looked up: the pull begins
    load = eng.requests[request].seqs[0].kv_load
    assert load.done.wait(10) and load.remote is not None
    time.sleep(0.8 * HOLD_S - 1 + 0.3)  # past the read-by time of the prefill engine's hold
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done[request].outputs[0].token_ids == reference[0] and done[request].num_cached_tokens == 0
    assert eng.kv_connector.receiver.stats.failed_pulls == 1 and eng.kv_connector.receiver.stats.pulled_blocks == 0

    def released(seconds: float = 2.0) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            prefill.engine.step()  # (gives back what was released)
            if sender.num_held_blocks() == 0:
                return True
            time.sleep(0.05)
        return False

    assert released()  # (told, not expired: the hold's own timeout is HOLD_S after the pull)
    [aborted] = prefilled(prefill, PROMPTS[1:2])
    request = eng.add_request(PROMPTS[1], params(kv_transfer=KVTransferParams.from_dict(aborted)))
    eng.step()
    eng.abort_request(request)
    assert released() and sender.stats.expired_transfers == expired
    decode.generate(PROMPTS[2:], params())  # its own cache has the prompt: nothing to pull
    [cached] = prefilled(prefill, PROMPTS[2:])
    [out] = decode.generate(PROMPTS[2:], params(kv_transfer=KVTransferParams.from_dict(cached)))
    assert out.outputs[0].token_ids == reference[2] and released() and sender.stats.expired_transfers == expired


@pytest.fixture
def fake_prefill_engine():
    """A ZeroMQ server where a forged kv_transfer_params would send a decode engine: it records any
    pull and answers with blocks of its choosing (the issue's poisoning demo answered another text's K/V)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, port
    sock.close()


@pytest.mark.timeout(120)
def test_transfer_params_not_signed_by_the_pool_are_refused_before_any_connection(prefill, fake_prefill_engine):
    """Issue #75: a client's own params (host, port, the engine id any prefill answer shows) made a
    decode engine connect where they said and cache the K/V that came back under the keys it asked
    for, for every later request sharing the prompt. Now only params a prefill engine of the pool
    signed are taken: a client's, a signed one pointed elsewhere, one signed with another secret are
    refused at admission, and the puller itself never connects for them."""
    from kvpilot.server.engine.block_manager import block_hash
    from kvpilot.server.engine.kv_tiers import BlockLoad
    from kvpilot.server.engine.kv_trust import sign_params
    from kvpilot.server.engine.limits import RequestRejected
    from kvpilot.server.engine.sampling_params import KVTransferParams

    fake, port = fake_prefill_engine
    decode = engine(kv_role="decode", kv_transfer_timeout=5)
    [signed] = prefilled(prefill, PROMPTS[:1])
    forged = {k: v for k, v in signed.items() if k != "signature"} | {"remote_port": port, "remote_request_id": "stolen"}
    other_pool = {**forged, "signature": sign_params(b"another pool's secret", forged)}
    ids = decode.engine.tokenizer.encode(PROMPTS[0])
    for bad in (forged, {**forged, "signature": signed["signature"]}, other_pool):
        with pytest.raises(RequestRejected, match="not signed by a prefill engine of this engine's pool") as refused:
            decode.generate(PROMPTS[:1], params(kv_transfer=KVTransferParams.from_dict(bad)))
        assert refused.value.param == "kv_transfer_params"
    salt, chunk = decode.engine.block_manager.salt, tuple(ids[:BLOCK])
    load = decode.engine.kv_connector.receiver.pull(KVTransferParams.from_dict(forged), BlockLoad(0, salt, [block_hash(salt, chunk)], [chunk]))
    assert load.done.wait(10) and load.payloads == []  # the puller refuses them too (defence in depth)
    assert fake.poll(500) == 0  # nobody connected to the forger's server
    [out] = decode.generate(PROMPTS[:1], params(kv_transfer=KVTransferParams.from_dict(signed)))  # the pool's own: pulled
    assert decode.engine.kv_connector.receiver.stats.pulled_blocks == prompt_blocks(decode, PROMPTS[0]) and out.num_cached_tokens > 0


@pytest.mark.timeout(120)
def test_the_transfer_port_serves_the_pool_alone_and_survives_what_a_member_sends(prefill, reference):
    """Issue #75: one 2-frame message killed the prefill engine's sender thread (every later handoff
    then waited the whole timeout), a 512 MiB frame was read whole, and anyone could pull a held
    prompt's K/V by its id. Now the port speaks CURVE with the pool's keys: a peer without them is
    disconnected before it sends a frame; from a peer with them, a malformed pull gets an error
    answer, an unsigned one is refused with the hold kept, an oversized frame disconnects it, and the
    pool's own pull still works."""
    import zmq
    import zmq.utils.monitor

    from kvpilot.server.engine.kv_transfer import curve_keys
    from kvpilot.server.engine.sampling_params import KVTransferParams

    [sent] = prefilled(prefill, PROMPTS[:1])
    address = f"tcp://127.0.0.1:{prefill.engine.kv_connector.sender.port}"
    context = zmq.Context.instance()

    def connect(keys: tuple[bytes, bytes] | None):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if keys:
            sock.curve_serverkey = sock.curve_publickey = keys[0]
            sock.curve_secretkey = keys[1]
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        sock.connect(address)
        return sock, monitor

    def events(monitor, seconds: float, until: int | None = None) -> set[int]:
        """The monitor's events for `seconds`, or until `until` is one of them."""
        seen, deadline = set(), time.monotonic() + seconds
        while time.monotonic() < deadline and until not in seen:
            if monitor.poll(100):
                seen.add(zmq.utils.monitor.recv_monitor_message(monitor)["event"])
        return seen

    stranger, monitor = connect(None)  # the probes, without the pool's keys
    stranger.send_multipart([b"{}", b"{}"])
    stranger.send(json.dumps({"transfer": sent["remote_request_id"], "keys": []}).encode())
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events(monitor, 2) and not stranger.poll(500)
    stranger.close()
    imposter, monitor = connect(curve_keys(b"another pool's secret, 32 chars or more"))
    imposter.send(b"{}")
    assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events(monitor, 2) and not imposter.poll(500)
    imposter.close()

    member, monitor = connect(curve_keys(POOL_SECRET.encode()))

    def answer():
        assert member.poll(5000), "the sender did not answer"
        return json.loads(member.recv_multipart()[0])

    member.send_multipart([b"{}", b"{}"])
    assert "one frame" in answer()["error"]
    member.send(b"[]")
    assert "JSON object" in answer()["error"]
    member.send(json.dumps({"transfer": sent["remote_request_id"], "keys": [], "mac": "0" * 64}).encode())
    assert "not signed" in answer()["error"]
    assert prefill.engine.kv_connector.sender.num_held_blocks() == len(sent["remote_block_ids"])  # still held for the pool's pull
    events(monitor, 0.2)
    member.send(b"x" * (64 << 20))
    assert zmq.EVENT_DISCONNECTED in events(monitor, 20, until=zmq.EVENT_DISCONNECTED)
    member.close()

    decode = engine(kv_role="decode", kv_transfer_timeout=10)
    [out] = decode.generate(PROMPTS[:1], params(kv_transfer=KVTransferParams.from_dict(sent)))
    assert out.outputs[0].token_ids == reference[0]
    assert decode.engine.kv_connector.receiver.stats.pulled_blocks == prompt_blocks(decode, PROMPTS[0])


def test_prefill_and_decode_engines_need_the_pools_secret(monkeypatch):
    """Without it each would make up its own and every handoff would fail, said only in a log line."""
    from kvpilot.server.engine.kv_trust import SECRET_ENV, transfer_secret

    monkeypatch.delenv(SECRET_ENV)
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match=f"kv_role {role} needs {SECRET_ENV}"):
            transfer_secret(role)
    assert len(transfer_secret("both")) >= 32  # one engine hands off to itself: it makes one up
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 32 characters"):
        transfer_secret("both")


@pytest.mark.parametrize("settings,refusal", [
    ({"kv_role": "prefill", "enable_prefix_caching": False}, "kv_role=prefill needs enable_prefix_caching"),
    ({"kv_transfer_port": 7000}, "kv_transfer_port need kv_role"),
    ({"kv_transfer_config": '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'}, "kv_connector 'NixlConnector' is not implemented"),
    ({"kv_transfer_config": '{"kv_connector": "KVPilotNixlConnector", "kv_role": "kv_leader"}'}, "kv_role 'kv_leader' is not implemented"),
])
def test_what_disaggregation_does_not_do_is_refused(settings, refusal):
    import re

    from pydantic import ValidationError

    from kvpilot.server.config import EngineConfig

    with pytest.raises(ValidationError, match=re.escape(refusal)):
        EngineConfig(**settings)
    config = EngineConfig(kv_transfer_config='{"kv_connector": "KVPilotNixlConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": '
                                             '{"timeout": 5}}')
    assert (config.kv_role, config.kv_transfer_timeout) == ("decode", 5.0)


def test_requests_an_engine_cannot_serve_are_rejected_by_name(prefill):
    from kvpilot.server.engine.limits import RequestRejected
    from kvpilot.server.engine.sampling_params import KVTransferParams

    ids = prefill.engine.tokenizer.encode(PROMPTS[0])
    with pytest.raises(RequestRejected, match="do_remote_prefill needs an engine whose kv_role is decode or both"):
        prefill.engine.limits.admit(ids, params(kv_transfer=transfer(do_remote_prefill=True, remote_host="h", remote_port=1,
                                                                       remote_request_id="r", remote_engine_id="e")))
    with pytest.raises(RequestRejected, match="n > 1 is not implemented"):
        prefill.engine.limits.admit(ids, params(n=2, temperature=1.0, kv_transfer=transfer(do_remote_decode=True)))
    for bad, why in [({"do_remote_prefill": True}, "remote_host"), ({"do_remote_decode": "yes"}, "must be a boolean"),
                     ({"remote_cluster": "x"}, "remote_cluster not implemented")]:
        with pytest.raises(ValueError, match=why):
            KVTransferParams.from_dict(bad)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A prefill and a decode `kvpilot serve`."""
    from server_harness import serve_for_tests

    pool = {"KVPILOT_KV_TRANSFER_SECRET": POOL_SECRET}
    prefill_server = serve_for_tests(tmp_path_factory, "--kv-cache-memory", "32MiB", "--kv-role", "prefill", "--kv-transfer-port", "0", env=pool)
    decode_server = serve_for_tests(tmp_path_factory, "--kv-cache-memory", "32MiB", "--kv-role", "decode", env=pool)
    try:
        yield next(prefill_server), next(decode_server)
    finally:
        for server in (prefill_server, decode_server):
            next(server, None)


def metric(server, name: str) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))


def pulled_blocks(server) -> float:
    return metric(server, "kvpilot:kv_transfer_pulled_blocks_total")


BODY = {"prompt": PROMPTS[0], "temperature": 0, "max_tokens": 10, "ignore_eos": True}


@pytest.mark.timeout(240)
def test_over_http_the_prefill_answer_carries_what_the_decode_request_passes_on(servers):
    """The prefill request's answer has kv_transfer_params, the decode request with them answers as the
    aggregated engine does and its metrics count the pulled blocks; a streamed prefill request and
    incomplete params are 400s."""
    p, d = servers
    before = pulled_blocks(d)
    first = httpx.post(p.url + "/v1/completions", json={**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
                       timeout=120).json()
    sent = first["kv_transfer_params"]
    assert sent["do_remote_prefill"] is True and sent["remote_host"] == "127.0.0.1"
    forged = {**sent, "remote_host": "127.0.0.2"}  # a client pointing the decode engine elsewhere
    refused = httpx.post(d.url + "/v1/completions", json={**BODY, "kv_transfer_params": forged}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params", refused.text
    answer = httpx.post(d.url + "/v1/completions", json={**BODY, "kv_transfer_params": sent}, timeout=120).json()
    # pulled, the blocks go back at once though the prefill engine is idle (they stayed held until its next request)
    deadline = time.monotonic() + 10
    while metric(p, "kvpilot:kv_transfer_held_blocks") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(p, "kvpilot:kv_transfer_held_blocks") == 0 and metric(p, "kvpilot:kv_cache_usage_perc") == 0
    plain = httpx.post(p.url + "/v1/completions", json=BODY, timeout=120).json()
    assert answer["choices"][0]["text"] == plain["choices"][0]["text"] and "kv_transfer_params" not in answer
    assert pulled_blocks(d) - before == len(sent["remote_block_ids"]) > 0
    streamed = httpx.post(p.url + "/v1/completions", json={**BODY, "stream": True, "kv_transfer_params": {"do_remote_decode": True}}, timeout=60)
    assert streamed.status_code == 400 and "stream must be false" in streamed.text
    refused = httpx.post(p.url + "/v1/completions", json={**BODY, "kv_transfer_params": {"do_remote_prefill": True}}, timeout=60)
    assert refused.status_code == 400 and "remote_host" in refused.text


@pytest.mark.timeout(240)
def test_the_gateway_prefills_on_a_prefill_pod_then_streams_the_decode_pods_answer(servers):
    """A disaggregated model through kvpilot-gateway: completions and chat, streamed or not, answer as
    the aggregated engine does, with the decode pod pulling the prompt's blocks; with its prefill pod
    gone, the decode pod computes the prompt (counted), and a client error from the prefill pod is the
    answer."""
    from kvpilot.operator.gateway.proxy import StaticEndpoints, build_app
    from server_harness import asgi_server, free_port

    p, d = servers
    model = httpx.get(d.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    endpoint = lambda server: server.url.removeprefix("http://")  # noqa: E731
    dead = f"127.0.0.1:{free_port()}"
    source = StaticEndpoints({model: [endpoint(d)]}, prefill={model: [endpoint(p)]})
    with asgi_server(build_app(source)) as url:
        # prompts the decode pod has not seen (its prefix cache would answer instead of a pull)
        first, second, third = (f"Through the gateway, {n}: {PROMPTS[n]}" for n in range(3))
        plain = httpx.post(p.url + "/v1/completions", json={**BODY, "model": model, "prompt": first}, timeout=120).json()["choices"][0]["text"]
        before = pulled_blocks(d)
        whole = httpx.post(url + "/v1/completions", json={**BODY, "model": model, "prompt": first}, timeout=120).json()
        assert whole["choices"][0]["text"] == plain and pulled_blocks(d) > before
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "model": model, "prompt": second, "stream": True},
                          timeout=120) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        streamed = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks)
        direct = httpx.post(p.url + "/v1/completions", json={**BODY, "model": model, "prompt": second}, timeout=120).json()
        assert streamed == direct["choices"][0]["text"]
        chat = {"model": model, "messages": [{"role": "user", "content": third}], "temperature": 0, "max_tokens": 8}
        assert (httpx.post(url + "/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]["message"]
                == httpx.post(p.url + "/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]["message"])
        bad = httpx.post(url + "/v1/completions", json={**BODY, "model": model, "temperature": -1}, timeout=60)
        assert bad.status_code == 400 and "temperature" in bad.text  # the prefill pod's answer
        source.prefill[model] = [dead]  # the prefill pool gone: the decode pod computes the prompt
        pulled = pulled_blocks(d)
        fourth = f"Once more: {PROMPTS[2]}"
        fallback = httpx.post(url + "/v1/completions", json={**BODY, "model": model, "prompt": fourth}, timeout=120).json()
        direct = httpx.post(p.url + "/v1/completions", json={**BODY, "model": model, "prompt": fourth}, timeout=120).json()
        assert fallback["choices"][0]["text"] == direct["choices"][0]["text"] and pulled_blocks(d) == pulled
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert f'kvpilot_gateway_prefill_requests_total{{model="{model}",outcome="handed_off"}} 3.0' in metrics
        assert f'kvpilot_gateway_prefill_requests_total{{model="{model}",outcome="failed"}} 1.0' in metrics


@pytest.mark.timeout(120)
def test_a_stop_string_ends_a_prefill_request_with_its_transfer_params(prefill, reference):
    """A prefill request (do_remote_decode) whose text meets a stop string before max_tokens: the stop
    string is matched by the output assembler after the engine's step, which then ends the sequence
    and holds its blocks; the answer waits for that final delta and carries the params (they were lost,
    the blocks held until the timeout)."""
    tok = prefill.engine.tokenizer
    text = tok.decode(reference[0][:6])
    stop = text[len(tok.decode(reference[0][:3])):].strip()[:4]
    assert stop and stop in text
    out = prefill.generate(PROMPTS[0], params(max_tokens=10, stop=[stop], kv_transfer=transfer(do_remote_decode=True)))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop and len(out.outputs[0].token_ids) < 10
    assert out.kv_transfer_params is not None and out.kv_transfer_params["remote_block_ids"]
    assert not prefill.engine.requests


def _kill_with_its_ranks(server) -> None:
    """SIGKILL a server and the tensor-parallel ranks it started (a pod killed: nothing gets to clean up)."""
    import os
    import signal
    import subprocess

    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in [server.proc.pid, *map(int, children)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.proc.wait(30)


@pytest.mark.timeout(420)
def test_three_decode_ranks_read_from_three_prefill_ranks_and_failures_cost_time_only(tmp_path, reference, caplog, monkeypatch):
    """Issue #64, two processes: a prefill server of three ranks hands prompts off to a decode engine of
    three ranks (each rank reads its own shard from the prefill rank of its index, with NIXL over TCP):
    greedy tokens equal the aggregated engine's. A decode engine of one rank refuses the three-rank
    prefill engine by name and computes the prompt, one of another pool refuses its params; a prefill
    server killed after the handshake, before
    the decode ranks read, makes every decode rank drop the blocks, and the prompt is computed: the same
    tokens either way."""
    from kvpilot.server.engine.kv_trust import SECRET_ENV
    from kvpilot.server.engine.limits import RequestRejected
    from kvpilot.server.engine.sampling_params import KVTransferParams
    from server_harness import ServerProcess

    server = ServerProcess("--kv-cache-memory", "32MiB", "--tensor-parallel-size", "3", "--kv-role", "prefill", "--kv-transfer-port", "0",
                           "--kv-transfer-timeout", "60", env={"KVPILOT_KV_TRANSFER_SECRET": POOL_SECRET},
                           log_path=tmp_path / "prefill.log").wait_ready(240)
    try:
        sent = [httpx.post(server.url + "/v1/completions", json={"prompt": p, "max_tokens": 1, "temperature": 0,
                                                                 "kv_transfer_params": {"do_remote_decode": True}}, timeout=120).json()["kv_transfer_params"]
                for p in PROMPTS]
        assert [s["tp_size"] for s in sent] == [3] * 3
        one = engine(kv_role="decode", kv_transfer_timeout=10)
        with caplog.at_level("WARNING", logger="kvpilot.server.kv_transfer"):
            [out] = one.generate(PROMPTS[:1], params(kv_transfer=KVTransferParams.from_dict(sent[0])))
        stats = one.engine.kv_connector.receiver.stats
        assert out.outputs[0].token_ids == reference[0] and stats.pulled_blocks == 0 and stats.failed_pulls == 1
        assert "the prefill engine runs tensor_parallel_size=3 and this decode engine 1" in caplog.text
        one.engine.close()
        with monkeypatch.context() as patched:  # a decode engine of another pool (another secret): the params are a 400's cause
            patched.setenv(SECRET_ENV, "another pool's secret, 32 characters or more")
            stranger = engine(kv_role="decode", kv_transfer_timeout=10)
        with pytest.raises(RequestRejected, match="not signed by a prefill engine of this engine's pool"):
            stranger.generate(PROMPTS[:1], params(kv_transfer=KVTransferParams.from_dict(sent[0])))
        stranger.engine.close()
        decode = engine(kv_role="decode", kv_transfer_timeout=10, tensor_parallel_size=3)
        try:
            [out] = decode.generate(PROMPTS[1:2], params(kv_transfer=KVTransferParams.from_dict(sent[1])))
            stats = decode.engine.kv_connector.receiver.stats
            assert out.outputs[0].token_ids == reference[1] and stats.pulled_blocks == prompt_blocks(decode, PROMPTS[1]) > 0
            assert out.num_cached_tokens == stats.pulled_blocks * BLOCK
            # killed mid-transfer: the decode engine has the blocks' whereabouts, the prefill ranks are gone before it reads them
            eng = decode.engine
            request = eng.add_request(PROMPTS[2], params(kv_transfer=KVTransferParams.from_dict(sent[2])))
            eng.step()  # looked up: the pull's handshake begins
            load = eng.requests[request].seqs[0].kv_load
            assert load.done.wait(30) and load.remote is not None and len(load.payloads) == prompt_blocks(decode, PROMPTS[2])
            _kill_with_its_ranks(server)
            done = {}
            while eng.has_unfinished_requests():
                done.update({o.request_id: o for o in eng.step() if o.finished})
            assert done[request].outputs[0].token_ids == reference[2] and done[request].num_cached_tokens == 0
            assert stats.failed_pulls == 1 and stats.pulled_blocks == prompt_blocks(decode, PROMPTS[1])
        finally:
            decode.engine.close()
    finally:
        if server.proc.poll() is None:
            _kill_with_its_ranks(server)
