"""Pure status computation: conditions and replica counts from what the cluster reports."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from kvpilot.operator.builders.manifests import is_ready
from kvpilot.operator.crd_types import Condition, GroupStatus, InferenceServiceStatus, MetricsSnapshot, ScaleDownWindow, ScalingEvent

# LeaderWorkerSet's labels of every pod of a group: the group's index, and the pod's in it (the leader's is 0)
GROUP_INDEX_LABEL, WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index", "leaderworkerset.sigs.k8s.io/worker-index"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conditions: list[Condition], type_: str, status: str, reason: str, message: str, generation: int | None, now: str) -> list[Condition]:
    """Replace one condition; lastTransitionTime moves only when the status flips."""
    old = next((c for c in conditions if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == status and old.last_transition_time else now
    new = Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=since, observed_generation=generation)
    return [c for c in conditions if c.type != type_] + [new]


def pod_problems(pods: list[dict]) -> list[tuple[str, str]]:
    """(reason, message) for pods that cannot run, in the cluster's own words."""
    problems = []
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        name = pod["metadata"]["name"]
        for c in pod.get("status", {}).get("conditions", []) or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                problems.append(("Unschedulable", f"pod {name}: {c.get('message', 'cannot be scheduled')}"))
        grouped = GROUP_INDEX_LABEL in (pod["metadata"].get("labels") or {})
        for cs in pod.get("status", {}).get("containerStatuses", []) or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            terminated = (cs.get("lastState") or {}).get("terminated") or {}
            if grouped and cs.get("restartCount") and waiting.get("reason") != "CrashLoopBackOff" and terminated.get("exitCode"):
                # A group's pod restarted (the kubelet restarts a container at once the first time): LeaderWorkerSet recreates
                # the whole group now, so this is the one moment it shows; its Event stays
                why = (terminated.get("message") or terminated.get("reason") or "").strip()
                problems.append(("GroupPodFailed", f"pod {name} container {cs.get('name')} exited {terminated['exitCode']}: {why} "
                                                   "(LeaderWorkerSet recreates its group)"))
            if waiting.get("reason") in ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError", "InvalidImageName"):
                # A crashed container's own last words (its termination message: the engine writes its
                # fatal error there) say more than the kubelet's back-off notice.
                why = terminated.get("message") or waiting.get("message", waiting["reason"])
                problems.append((waiting["reason"], f"pod {name} container {cs.get('name')}: {why.strip()}"))
    return problems


def group_statuses(pods: list[dict], size: int) -> list[GroupStatus]:
    """Each LeaderWorkerSet group among `pods` (by its index label; pods being deleted left out): its pods, how many are
    Ready, and the names of those that are not."""
    groups: dict[int, list[dict]] = {}
    for pod in pods:
        index = ((pod.get("metadata") or {}).get("labels") or {}).get(GROUP_INDEX_LABEL)
        if index is not None and index.isdigit() and not pod["metadata"].get("deletionTimestamp"):
            groups.setdefault(int(index), []).append(pod)
    out = []
    for index in sorted(groups):
        members = sorted(groups[index], key=lambda p: p["metadata"]["name"])
        ready = [p for p in members if is_ready(p)]
        # The leader is <lws>-<index>, each worker <lws>-<index>-<worker index>: named by a worker while the leader is gone
        leader = next((p["metadata"]["name"] for p in members if p["metadata"]["labels"].get(WORKER_INDEX_LABEL) == "0"),
                      members[0]["metadata"]["name"].rsplit("-", 1)[0])
        out.append(GroupStatus(name=leader, pods=len(members), ready_pods=len(ready), ready=len(ready) == size == len(members),
                               not_ready=[p["metadata"]["name"] for p in members if not is_ready(p)]))
    return out


def compute_status(prev: InferenceServiceStatus | None, generation: int, desired: int, selector: str, endpoint: str,
                   deployment: dict | None, pods: list[dict], spec_problems: list[tuple[str, str]], now: datetime | None = None,
                   wakes_from_zero: bool = False, filling: str | None = None,
                   serving_problems: list[tuple[str, str]] = ()) -> InferenceServiceStatus:
    """filling: what the pods wait for (model cache entries being filled), if anything.
    serving_problems: what is wrong with how the running service is reached (a name collision): Degraded, nothing held back.
    wakes_from_zero: at 0 replicas, a request through the gateway scales the service up again (minReplicas 0 with
    autoscaling on): it is then Ready (reason ScaledToZero) — it serves, after a cold start."""
    now = now or datetime.now(UTC)
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    status = (prev or InferenceServiceStatus()).model_copy(deep=True)
    status.observed_generation = generation
    status.selector = selector
    status.endpoint = endpoint
    dstat = (deployment or {}).get("status", {}) or {}
    status.replicas = dstat.get("replicas", 0)
    status.ready_replicas = dstat.get("readyReplicas", 0)
    status.updated_replicas = dstat.get("updatedReplicas", 0)
    if status.desired_replicas is None or not spec_problems:
        status.desired_replicas = desired
    conds = status.conditions
    problems = spec_problems + list(serving_problems) + pod_problems(pods)
    if problems:
        reason = problems[0][0]
        conds = set_condition(conds, "Degraded", "True", reason, "; ".join(m for _, m in problems)[:1000], generation, stamp)
    else:
        conds = set_condition(conds, "Degraded", "False", "AsExpected", "", generation, stamp)
    ready, updated = status.ready_replicas or 0, status.updated_replicas or 0
    if spec_problems:
        conds = set_condition(conds, "Progressing", "False", spec_problems[0][0], "spec cannot be rolled out", generation, stamp)
    elif filling:
        conds = set_condition(conds, "Progressing", "True", "ModelCacheFilling", filling, generation, stamp)
    elif deployment is None or updated < desired or ready < desired or (status.replicas or 0) > desired:
        conds = set_condition(conds, "Progressing", "True", "RollingOut", f"{updated}/{desired} pods updated, {ready}/{desired} ready", generation, stamp)
    else:
        conds = set_condition(conds, "Progressing", "False", "Stable", f"{ready}/{desired} pods ready", generation, stamp)
    if ready >= 1:
        conds = set_condition(conds, "Ready", "True", "Serving", f"{ready}/{desired} pods ready", generation, stamp)
    elif desired == 0 and not problems:
        conds = set_condition(conds, "Ready", "True" if wakes_from_zero else "False", "ScaledToZero",
                              "scaled to zero: the next request through kvpilot-gateway wakes it" if wakes_from_zero else
                              "spec.replicas is 0 and autoscaling is off: nothing will start a pod", generation, stamp)
    else:
        reason = problems[0][0] if problems else "NoReadyPods"
        conds = set_condition(conds, "Ready", "False", reason, f"0/{desired} pods ready", generation, stamp)
    status.conditions = conds
    return status


@dataclass(slots=True)
class AutoscalerReport:
    """The autoscaler's part of status, handed to the one status writer (reconcile.write_status), which
    applies the latest report to every status it writes."""

    active: tuple[str, str, str]                    # ScalingActive: status, reason, message
    generation: int | None
    last_metrics: MetricsSnapshot | None = None
    scaling_history: list[ScalingEvent] | None = None  # the whole list, once the autoscaler has scaled
    last_scale_time: str | None = None
    window: ScaleDownWindow | None = None
    written: bool = False                           # a status with it applied has been written (or found current)

    def apply(self, status: InferenceServiceStatus, now: str) -> None:
        status.conditions = set_condition(status.conditions, "ScalingActive", *self.active, self.generation, now)
        if self.last_metrics is not None:
            status.last_metrics = self.last_metrics
        if self.scaling_history is not None:
            status.scaling_history, status.last_scale_time = self.scaling_history, self.last_scale_time
        if self.window is not None:
            status.scale_down_window = self.window


    def same_as(self, other: AutoscalerReport) -> bool:
        """Equal but for when the metrics were read."""
        def seen(m: MetricsSnapshot | None):
            return None if m is None else m.model_copy(update={"time": None})
        return (self.active, self.generation, seen(self.last_metrics), self.scaling_history, self.last_scale_time, self.window) == \
            (other.active, other.generation, seen(other.last_metrics), other.scaling_history, other.last_scale_time, other.window)


def unchanged(old: dict, new: dict) -> bool:
    """Whether two statuses (as written) differ in nothing but when metrics were last read: such a
    status is not written (each autoscaler pass would otherwise write every service's status)."""
    def strip(raw: dict) -> dict:
        out = dict(raw)
        if "lastMetrics" in out:
            out["lastMetrics"] = {k: v for k, v in out["lastMetrics"].items() if k != "time"}
        return out
    return strip(old) == strip(new)
