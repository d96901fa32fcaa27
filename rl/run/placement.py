"""Placement by resources: what the run's actors ask Ray for, and whether the cluster can hold
them at all, checked right after Ray starts (or the driver joins a cluster), before any work.

Learner ranks ask for `trainer.resources` (CPU: `trainer.cpus` unless given there), rollout
workers for `rollout.resources` (CPU: `rollout.cpus_per_worker` unless given there). The check
reads the resources of the cluster's live nodes (what they have, not what is free now: other
work ends, a missing resource never appears) and fails with one line naming what is missing
when
  1. the learner ranks, or the workers, need more of a resource than the cluster has in all;
  2. both together need more than it has;
  3. one actor needs more than any single node has; or
  4. the totals suffice but no assignment of the actors to the nodes does (exact, by dynamic
     programming over the nodes: two kinds of actor, so it is cheap).
Nodes that are not up yet (an autoscaler's) are not counted: start them before the run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.config.resources import UNIT

if TYPE_CHECKING:
    from rl.config.runfile import RunConfig


class PlacementError(RuntimeError):
    """The cluster cannot hold the run's actors; the message is one line saying what is missing
    and what to change."""


@dataclass(frozen=True, slots=True)
class Demand:
    """`count` actors of one kind, each asking for `request`."""

    label: str
    count: int
    request: dict[str, float]
    section: str
    count_key: str
    cpu_key: str

    def keys(self, name: str) -> list[str]:
        """The settings that lower this demand's need for resource `name`."""
        amount = self.cpu_key if name == "CPU" else f"resources.{name}"
        return [f"{self.section}.{self.count_key}", f"{self.section}.{amount}"]


def demands(cfg: RunConfig) -> tuple[Demand, Demand]:
    """The learner ranks and the rollout workers of a run."""
    t, r = cfg.trainer, cfg.rollout
    return (
        Demand("learner ranks", t.world_size, t.ray_resources, "trainer", "world_size", "cpus"),
        Demand(
            "rollout workers",
            r.num_workers,
            r.ray_resources,
            "rollout",
            "num_workers",
            "cpus_per_worker",
        ),
    )


def show(request: dict[str, float]) -> str:
    """{CPU: 0.5, rollout: 1}"""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in request.items()) + "}"


def _units(amount: float) -> int:
    return round(amount * UNIT)


def _total(nodes: Sequence[dict[str, float]], name: str) -> float:
    return sum(node.get(name, 0.0) for node in nodes)


def _hint(needs: Sequence[Demand], name: str, have: float, local: bool) -> str:
    if name != "CPU" and have == 0:
        sections = " or ".join(f"{d.section}.resources" for d in needs)
        return f"add a node with the `{name}` resource or set {sections}"
    keys = [key for d in needs for key in d.keys(name)]
    more = "raise ray.num_cpus, " if local and name == "CPU" else ""
    return f"lower {', '.join(keys[:-1])} or {keys[-1]}, {more}or add nodes with more `{name}`"


def _alone(d: Demand, nodes, local: bool) -> str | None:
    """Check 1: one kind of actor against the cluster's totals."""
    short = [
        (name, _total(nodes, name))
        for name, amount in d.request.items()
        if d.count * _units(amount) > _units(_total(nodes, name))
    ]
    if not short:
        return None
    has = ", ".join(f"{name}: {have:g}" for name, have in short)
    hints = "; ".join(_hint([d], name, have, local) for name, have in short)
    return f"{d.label} need {d.count} x {show(d.request)} but the cluster has {has}; {hints}"


def _together(needs: Sequence[Demand], nodes, local: bool) -> str | None:
    """Check 2: all actors together against the cluster's totals."""
    for name in dict.fromkeys(k for d in needs for k in d.request):
        users = [d for d in needs if name in d.request]
        need = sum(d.count * _units(d.request[name]) for d in users)
        have = _total(nodes, name)
        if need > _units(have):
            parts = " + ".join(f"{d.count} x {d.request[name]:g}" for d in users)
            who = " and ".join(d.label for d in users)
            return (
                f"{who} need {name}: {need / UNIT:g} in all ({parts}) but the cluster has "
                f"{name}: {have:g}; {_hint(users, name, have, local)}"
            )
    return None


def _room(node: dict[str, float], request: dict[str, float], count: int) -> dict[str, int] | None:
    """What is left of `node` after `count` actors of `request` (None: they do not fit)."""
    left = {name: _units(node.get(name, 0.0)) for name in node}
    for name, amount in request.items():
        left[name] = left.get(name, 0) - count * _units(amount)
        if left[name] < 0:
            return None
    return left


def _how_many(room: dict[str, int], request: dict[str, float], cap: int) -> int:
    counts = [room.get(name, 0) // _units(amount) for name, amount in request.items()]
    return min([cap, *counts])


def _nodes_text(nodes, names) -> str:
    """The nodes' amounts of `names`, alike nodes counted: {CPU: 2} x 3, {CPU: 8, GPU: 1}"""
    shapes = Counter(show({n: node.get(n, 0.0) for n in names}) for node in nodes)
    text = [shape + (f" x {count}" if count > 1 else "") for shape, count in shapes.items()]
    more = f" and {len(text) - 4} more" if len(text) > 4 else ""
    return ", ".join(text[:4]) + more


def _one_node(d: Demand, nodes) -> str | None:
    """Check 3: one actor against the biggest nodes."""
    if any(_room(node, d.request, 1) is not None for node in nodes):
        return None
    return (
        f"each of the {d.label} needs {show(d.request)} on one node but no node has that much "
        f"(nodes: {_nodes_text(nodes, d.request)}); lower {d.section}.resources, or add a "
        "bigger node"
    )


def _packs(learner: Demand, workers: Demand, nodes) -> bool:
    """Check 4: can every learner rank and every worker be given a node? best[a] is the most
    workers that fit beside a learner ranks on the nodes seen so far."""
    best = {0: 0}
    for node in nodes:
        beside = []  # beside[k]: workers that fit on this node next to k learner ranks
        for k in range(learner.count + 1):
            room = _room(node, learner.request, k)
            if room is None:
                break
            beside.append(_how_many(room, workers.request, workers.count))
        after: dict[int, int] = {}
        for placed, fitted in best.items():
            for k, here in enumerate(beside[: learner.count - placed + 1]):
                total = min(workers.count, fitted + here)
                after[placed + k] = max(after.get(placed + k, -1), total)
        best = after
    return best.get(learner.count, -1) >= workers.count


def unmet(
    needs: tuple[Demand, Demand], nodes: Sequence[dict[str, float]], local: bool = False
) -> str | None:
    """One line naming what the cluster's `nodes` (their resources) lack for `needs` (learner
    ranks, rollout workers), or None when they can hold them all."""
    problems = [_alone(d, nodes, local) for d in needs]
    problems += [_together(needs, nodes, local)]
    problems += [_one_node(d, nodes) for d in needs]
    problem = next(filter(None, problems), None)
    if problem:
        return problem
    if _packs(*needs, nodes):
        return None
    names = list(dict.fromkeys(k for d in needs for k in d.request))
    sizes = " and ".join(f"{d.label} {d.count} x {show(d.request)}" for d in needs)
    return (
        f"{sizes} fit the cluster's totals but not its nodes ({_nodes_text(nodes, names)}); "
        "ask for less per actor, or add nodes"
    )


def check_cluster(cfg: RunConfig) -> None:
    """Raise PlacementError unless the cluster Ray is connected to can hold the run's actors."""
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    problem = unmet(demands(cfg), nodes, local=cfg.ray.address == "local")
    if problem:
        raise PlacementError(problem)


def unplaced(d: Demand, timeout_s: float, total: dict, free: dict) -> str:
    """The learner ranks' placement group did not come up: the cluster has the resources (the
    check passed), so others hold them."""
    has = ", ".join(f"{k}: {total.get(k, 0):g} ({free.get(k, 0):g} free)" for k in d.request)
    return (
        f"could not place {d.count} {d.label} x {show(d.request)} within {timeout_s:g} s: the "
        f"cluster has {has}; other work holds them: free them, or lower "
        f"{', '.join(d.keys('CPU'))} or {d.section}.resources"
    )
