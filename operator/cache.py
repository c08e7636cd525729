"""The operator's reads: a watch cache (what controller-runtime's informers are) of every kind it watches.

kopf's watch streams deliver each InferenceService, engine pod and owned Deployment to an event handler
(controller.py) that puts it here; reconcile, the status writer and the autoscaler read from here and
never GET or LIST per event or per tick. Writes put their response back (write-through), so a read
right after our own write sees it before the watch does. At startup each kind is listed once
(`prime`), so that the first reconciles see the pods that exist rather than an empty cache.

Objects are kept by (namespace, name) per kind and replaced only by a newer resourceVersion: a watch
event that arrives after our own write's response cannot roll the cache back. `put` says whether the
object changed, which is how a relist (kopf lists again whenever a watch stream ends) is told from a
change: an unchanged object triggers nothing.
"""

from __future__ import annotations

import copy
import threading

ISVC, POD, DEPLOYMENT = "inferenceservice", "pod", "deployment"
LWS = "leaderworkerset"  # a service whose replicas are groups of pods
CLAIM, LOADER = "claim", "loader"  # the model cache's claims, and its loader Jobs' pods


def _version(obj: dict) -> int | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return int(rv) if rv and rv.isdigit() else None


class ObjectCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, dict[tuple[str, str], dict]] = {ISVC: {}, POD: {}, DEPLOYMENT: {}, LWS: {}, CLAIM: {}, LOADER: {}}

    def put(self, kind: str, obj: dict) -> bool:
        """Store `obj` unless the cache holds a newer version; True when what is stored changed."""
        meta = obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        with self._lock:
            old = self._objects[kind].get(key)
            if old is not None:
                new_v, old_v = _version(obj), _version(old)
                if new_v is not None and old_v is not None and new_v <= old_v:
                    return False
            self._objects[kind][key] = copy.deepcopy(obj)
            return True

    def delete(self, kind: str, namespace: str, name: str) -> None:
        with self._lock:
            self._objects[kind].pop((namespace, name), None)

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        with self._lock:
            obj = self._objects[kind].get((namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def newest(self, kind: str, obj: dict) -> dict:
        """`obj` (e.g. a handler's body) or the cache's copy of it, whichever is newer; stored."""
        self.put(kind, obj)
        meta = obj["metadata"]
        return self.get(kind, meta.get("namespace", ""), meta["name"]) or obj

    def all(self, kind: str) -> list[dict]:
        with self._lock:
            return [copy.deepcopy(o) for o in self._objects[kind].values()]

    def with_labels(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict]:
        with self._lock:
            return [copy.deepcopy(o) for (ns, _), o in self._objects[kind].items()
                    if ns == namespace and all(((o["metadata"].get("labels") or {}).get(k)) == v for k, v in labels.items())]

    def replace_all(self, kind: str, objects: list[dict]) -> None:
        """A full listing: what it has is put, what it lacks is gone."""
        keys = {(o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in objects}
        for obj in objects:
            self.put(kind, obj)
        with self._lock:
            for key in set(self._objects[kind]) - keys:
                del self._objects[kind][key]


CACHE = ObjectCache()
