"""Thin Kubernetes access for the operator: server-side apply, get/list, status patches, Events."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from datetime import UTC, datetime

from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError

from kvpilot.operator.crd_types import GROUP, KIND, PLURAL, VERSION

FIELD_MANAGER = "kvpilot-operator"
USER_AGENT = "kvpilot-operator"
log = logging.getLogger("kvpilot.operator")
_identity = os.environ.get("HOSTNAME", "local")


def set_identity(identity: str) -> str:
    """This process's name as a leader-election candidate; Events name it as their reportingInstance."""
    global _identity
    _identity = identity
    return identity


def load_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(os.environ.get("KUBECONFIG"))


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None):
        self.api_client = api_client or client.ApiClient()
        self.api_client.user_agent = USER_AGENT  # what audit logs and API server metrics know it by
        self.dyn = DynamicClient(self.api_client)
        self.core = client.CoreV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self._discovery = threading.Lock()  # the dynamic client's discovery cache is not thread-safe
        self._resources: dict[tuple[str, str], object] = {}
        self._absent: dict[tuple[str, str], float] = {}

    def _resource(self, api_version: str, kind: str):
        key = (api_version, kind)
        with self._discovery:
            if key not in self._resources:
                self._resources[key] = self.dyn.resources.get(api_version=api_version, kind=kind)
            return self._resources[key]

    def has_kind(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves this kind (e.g. PodMonitor when prometheus-operator is installed)."""
        key = (api_version, kind)
        with self._discovery:
            if key in self._resources:
                return True
            checked = self._absent.get(key)
            if checked is not None and time.monotonic() - checked < 60:  # re-ask now and then: it may get installed
                return False
            try:
                self.dyn.resources.invalidate_cache()
                self._resources[key] = self.dyn.resources.get(api_version=api_version, kind=kind)
                return True
            except ResourceNotFoundError:
                self._absent[key] = time.monotonic()
                return False

    def apply(self, obj: dict, field_manager: str = FIELD_MANAGER) -> dict:
        meta = obj["metadata"]
        res = self._resource(obj["apiVersion"], obj["kind"])
        return res.server_side_apply(body=obj, name=meta["name"], namespace=meta.get("namespace"),
                                     field_manager=field_manager, force_conflicts=True).to_dict()

    def create_unless_present(self, obj: dict) -> None:
        """Create `obj`; one of that name already there is left as it is (a Job's template is immutable)."""
        res = self._resource(obj["apiVersion"], obj["kind"])
        try:
            res.create(body=obj, namespace=obj["metadata"].get("namespace"))
        except DynamicApiError as e:
            if e.status != 409:
                raise

    def delete(self, api_version: str, kind: str, name: str, namespace: str) -> None:
        """An object no longer wanted (one already gone is fine)."""
        try:
            self._resource(api_version, kind).delete(name=name, namespace=namespace)
        except DynamicApiError as e:
            if e.status != 404:
                raise


    def annotate_claim(self, name: str, namespace: str, annotations: dict[str, str]) -> dict:
        """The claim as written (for the cache)."""
        return self._resource("v1", "PersistentVolumeClaim").patch(body={"metadata": {"annotations": annotations}}, name=name, namespace=namespace,
                                                                   content_type="application/merge-patch+json").to_dict()

    def annotate_pod(self, name: str, namespace: str, annotations: dict[str, str]) -> dict:
        """The pod as written (for the cache): the adapters it holds (operator/adapter_sync.py)."""
        return self._resource("v1", "Pod").patch(body={"metadata": {"annotations": annotations}}, name=name, namespace=namespace,
                                                 content_type="application/merge-patch+json").to_dict()

    def secret_data(self, name: str, namespace: str) -> dict[str, str]:
        """A Secret's data (base64 values): an InferenceService's API key, to load adapters into its pods."""
        return self.core.read_namespaced_secret(name, namespace).data or {}

    def list(self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None) -> list[dict]:
        """Objects of a kind in a namespace (None: every namespace). Only the cache's priming lists."""
        items = self._resource(api_version, kind).get(namespace=namespace, label_selector=label_selector).to_dict().get("items", [])
        for item in items:  # a list's items carry neither: put them back so that they read as watched objects
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    def patch_isvc_status(self, name: str, namespace: str, status: dict) -> dict:
        """The object as written (for the cache)."""
        return self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": status})

    def scale_isvc(self, name: str, namespace: str, replicas: int) -> None:
        """Through the scale subresource: the operator is the one writer of spec.replicas."""
        self.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, name, {"spec": {"replicas": replicas}})

    def scale_prefill(self, name: str, namespace: str, replicas: int) -> None:
        """A disaggregated service's prefill pool (no scale subresource of its own: the autoscaler is that field's one writer)."""
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                   {"spec": {"disaggregation": {"prefill": {"replicas": replicas}}}})

    def event(self, obj: dict, type_: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        now = datetime.now(UTC)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=f"{meta['name']}.{uuid.uuid4().hex[:12]}", namespace=meta["namespace"]),
            involved_object=client.V1ObjectReference(api_version=obj.get("apiVersion", f"{GROUP}/{VERSION}"), kind=obj.get("kind", KIND),
                                                     name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid")),
            type=type_, reason=reason, message=message[:1024], first_timestamp=now, last_timestamp=now, count=1,
            source=client.V1EventSource(component=FIELD_MANAGER), reporting_component=FIELD_MANAGER,
            reporting_instance=_identity)
        try:
            self.core.create_namespaced_event(meta["namespace"], body)
        except ApiException as e:  # an Event is best effort: never fail a reconcile over it
            log.warning("could not record event %s/%s: %s", reason, meta["name"], e.reason)
