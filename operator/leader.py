"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it.

Only the leader runs the kopf handlers and the autoscaler; a standby only watches the Lease. kopf's
own peering is not leader election (peers of equal priority all freeze), so the operator process
waits for the Lease before it starts kopf at all, and exits at once if it cannot renew it in time:
Kubernetes restarts it as a standby, and no second writer can exist while the Lease is valid.

Expiry is judged on this process's clock from when it last saw the Lease change (never by comparing
its clock with another host's renewTime), so clock skew between replicas cannot elect two leaders.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("kvpilot.leader")
LEASE_NAME = "kvpilot-operator"


def default_identity() -> str:
    """Unique per process: two operators on one host (or a restarted pod) are different candidates."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class LeaderElector:
    api: client.CoordinationV1Api
    namespace: str
    identity: str
    lease_seconds: float = 15.0
    renew_deadline_seconds: float = 10.0     # a leader that could not renew for this long steps down
    retry_seconds: float = 2.0
    name: str = LEASE_NAME
    _observed: tuple | None = None          # (holder, renewTime, transitions) as last seen
    _observed_at: float = 0.0                # time.monotonic() when that last changed
    _last_renewed: float = field(default=0.0)

    def _lease_body(self, transitions: int, acquired: datetime | None) -> client.V1Lease:
        now = _now()
        return client.V1Lease(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                              spec=client.V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=int(round(self.lease_seconds)),
                                                      acquire_time=acquired or now, renew_time=now, lease_transitions=transitions))

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this process holds the Lease afterwards."""
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise
            try:
                self.api.create_namespaced_lease(self.namespace, self._lease_body(0, None))
            except ApiException as e2:
                if e2.status == 409:  # another candidate created it first
                    return False
                raise
            return self._won()
        spec = lease.spec or client.V1LeaseSpec()
        seen = (spec.holder_identity, spec.renew_time, spec.lease_transitions)
        if seen != self._observed:
            self._observed, self._observed_at = seen, time.monotonic()
        mine = spec.holder_identity == self.identity
        duration = spec.lease_duration_seconds or self.lease_seconds
        free = not spec.holder_identity or time.monotonic() - self._observed_at > duration
        if not mine and not free:
            return False
        transitions = (spec.lease_transitions or 0) + (0 if mine else 1)
        body = self._lease_body(transitions, spec.acquire_time if mine else None)
        body.metadata.resource_version = lease.metadata.resource_version  # optimistic concurrency: one winner
        try:
            self.api.replace_namespaced_lease(self.name, self.namespace, body)
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        if not mine:
            log.info("took over the lease %s/%s from %r", self.namespace, self.name, spec.holder_identity)
        return self._won()

    def _won(self) -> bool:
        self._last_renewed = time.monotonic()
        return True

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Block until this process leads (True) or stop is set (False)."""
        log.info("waiting to lead (lease %s/%s, identity %s)", self.namespace, self.name, self.identity)
        while not (stop and stop.is_set()):
            try:
                if self.try_acquire_or_renew():
                    log.info("leading as %s", self.identity)
                    return True
            except ApiException as e:
                log.warning("lease %s/%s: %s %s", self.namespace, self.name, e.status, e.reason)
            time.sleep(self.retry_seconds)
        return False

    def keep_leading(self, on_lost, stop: threading.Event) -> threading.Thread:
        """Renew in the background; call on_lost() once renewal has failed for renew_deadline_seconds."""

        def renew() -> None:
            while not stop.wait(self.retry_seconds):
                try:
                    if self.try_acquire_or_renew():
                        continue
                    reason = "another candidate holds the lease"
                except Exception as e:  # noqa: BLE001 - the API server blinked: retry until the deadline
                    reason = f"{type(e).__name__}: {e}"
                if time.monotonic() - self._last_renewed > self.renew_deadline_seconds or reason.startswith("another"):
                    log.error("lost the lease %s/%s (%s): stepping down", self.namespace, self.name, reason)
                    on_lost()
                    return

        thread = threading.Thread(target=renew, name="lease-renewal", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """On a clean exit: hand the Lease over at once instead of letting it run out (called once the
        renewal has stopped; a conflict is retried on the fresh object)."""
        for _ in range(3):
            try:
                lease = self.api.read_namespaced_lease(self.name, self.namespace)
                if not (lease.spec and lease.spec.holder_identity == self.identity):
                    return
                lease.spec.holder_identity = None
                lease.spec.renew_time = None
                self.api.replace_namespaced_lease(self.name, self.namespace, lease)
                log.info("released the lease %s/%s", self.namespace, self.name)
                return
            except ApiException as e:
                if e.status != 409:
                    log.warning("could not release the lease: %s %s", e.status, e.reason)
                    return
        log.warning("could not release the lease %s/%s: it kept changing", self.namespace, self.name)
