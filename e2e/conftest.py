"""Fixtures for tests on the real control plane. Missing tools fail loudly (never skip)."""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from e2e.cluster import Cluster, ToolMissing  # noqa: E402
from e2e.prometheus import Prometheus  # noqa: E402


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    c = Cluster(name="pytest", state_dir=tmp_path_factory.mktemp("cluster"))
    try:
        c.up(nodes=3, gpus_per_node=4)
    except ToolMissing as e:
        pytest.fail(str(e), pytrace=False)
    c.api("/api/v1/nodes", "POST", {"apiVersion": "v1", "kind": "Node",  # one node without GPUs
                                     "metadata": {"name": "cpu-node-0", "annotations": {"kwok.x-k8s.io/node": "fake"},
                                                  "labels": {"type": "kwok", "kubernetes.io/hostname": "cpu-node-0"}},
                                     "status": {"capacity": {"cpu": "32", "memory": "64Gi", "pods": "110"},
                                                "allocatable": {"cpu": "32", "memory": "64Gi", "pods": "110"}}})
    yield c
    c.down()


@pytest.fixture
def namespace(cluster):
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def prometheus_factory(tmp_path):
    started: list[Prometheus] = []

    def make(interval: str = "1s") -> Prometheus:
        p = Prometheus(tmp_path / f"prom-{len(started)}", interval)
        started.append(p)
        return p

    yield make
    for p in started:
        p.stop()


def start_prometheus(p: Prometheus) -> Prometheus:
    try:
        return p.start()
    except ToolMissing as e:
        pytest.fail(str(e), pytrace=False)
