"""Two operator processes on the real control plane: exactly one leads (holds the Lease) and writes;
when the leader is killed, the other takes over within the lease time."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from e2e.operator_proc import OperatorProcess
from e2e.waiting import wait_until

pytestmark = pytest.mark.cluster
LEASE_SECONDS = 4.0


def lease_holder(cluster, namespace):
    r = cluster.kubectl("get", "lease", "kvpilot-operator", "-n", namespace, "-o", "json", check=False)
    return json.loads(r.stdout)["spec"].get("holderIdentity") if r.returncode == 0 else None


def reporters(cluster, namespace, name):
    items = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
    return {e.get("reportingInstance") for e in items if e["involvedObject"]["name"] == name}


def isvc(name):
    return json.dumps({"apiVersion": "serving.kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
                       "spec": {"model": {"source": "smollm3-9000b"}}})  # Degraded/UnknownModel: a status and an Event, no pods


def test_one_leader_writes_and_the_other_takes_over(cluster, namespace, tmp_path):
    from pathlib import Path

    cluster.kubectl("apply", "-f", str(Path(__file__).resolve().parents[1] / "crds"))
    lease_ns = namespace  # a Lease of this test's own
    ops = {who: OperatorProcess(cluster.kubeconfig, tmp_path / f"{who}.log", env={"POD_NAME": who}, lease_namespace=lease_ns,
                                lease_seconds=LEASE_SECONDS) for who in ("op-a", "op-b")}
    try:
        holder = wait_until(lambda: lease_holder(cluster, lease_ns), timeout=30, what="a leader")
        leader = holder.split("_")[0]
        standby = ({"op-a", "op-b"} - {leader}).pop()
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc("first"))
        wait_until(lambda: reporters(cluster, namespace, "first"), timeout=30, what="the leader's Event")
        time.sleep(2)
        assert reporters(cluster, namespace, "first") == {holder}  # only the leader wrote
        assert "leading as" in ops[leader].log() and "leading as" not in ops[standby].log()
        assert lease_holder(cluster, lease_ns) == holder
        # the leader dies without releasing: the standby takes the Lease once it has run out
        killed = time.monotonic()
        os.killpg(ops[leader].proc.pid, signal.SIGKILL)
        new = wait_until(lambda: (lambda h: h if h and h != holder else None)(lease_holder(cluster, lease_ns)), timeout=30, what="take-over")
        took = time.monotonic() - killed
        assert new.split("_")[0] == standby and took < LEASE_SECONDS * 3, took
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=isvc("second"))
        wait_until(lambda: reporters(cluster, namespace, "second") == {new}, timeout=30, what="the new leader's Event")
        print(f"take-over after the leader was killed: {took:.1f} s (lease {LEASE_SECONDS:g} s)")
    finally:
        for op in ops.values():
            op.stop()
    assert lease_holder(cluster, lease_ns) in (None, "")  # a clean stop hands the Lease back
