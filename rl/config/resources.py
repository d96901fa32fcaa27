"""What one actor asks Ray for: CPU, GPU and custom resources, as run-file types and requests.

Used by the run file's sections (`rollout.resources`, `trainer.resources`) and by placement
(rl/run/placement.py), which checks the requests against the cluster.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from rl.config.errors import ConfigError

UNIT = 10_000  # Ray counts resources in steps of 1/10,000


def _resources(value: dict[str, float]) -> dict[str, float]:
    for name, amount in value.items():
        if name in ("memory", "object_store_memory") or not re.fullmatch(
            r"[A-Za-z_][\w.:/-]*", name
        ):
            raise ValueError(
                f"{name!r} is not a resource to ask for: use CPU, GPU or a custom resource that "
                "nodes offer (e.g. rollout)"
            )
        if name == "GPU" and amount > 1 and not float(amount).is_integer():
            raise ValueError(f"GPU above 1 must be a whole number; got {amount:g}")
        if 0 < amount < 1 / UNIT:
            raise ValueError(f"{name}: Ray counts resources in steps of 0.0001; got {amount:g}")
    return value


Resources = Annotated[dict[str, Annotated[float, Field(ge=0)]], AfterValidator(_resources)]
"""Ray resources of one actor: CPU, GPU and custom resources (`{CPU: 1, GPU: 0, rollout: 1}`)."""


def fold_cpus(section: Any, key: str) -> None:
    """`resources.CPU` and the older `<key>` (rollout.cpus_per_worker, trainer.cpus) are one
    setting: write either, or both if they agree. `<key>` then holds the value, so a saved
    config.yaml (which has both) loads again."""
    if "CPU" not in section.resources:
        return
    cpus, older = section.resources["CPU"], getattr(section, key)
    if key in section.model_fields_set and cpus != older:
        raise ConfigError(
            "resources.CPU",
            f"is {cpus:g} but {key} is {older:g}: both set the CPUs of one actor; keep one "
            f"({key} is the older spelling)",
        )
    setattr(section, key, cpus)


def ask(cpus: float, resources: dict[str, float], device: str = "cpu") -> dict[str, float]:
    """One actor's request to Ray: its CPUs plus `resources`, without zero amounts; on a cuda
    device one GPU unless `resources` says how many (`auto` counts as cpu: resolve it first,
    rl/run/devices.py)."""
    gpu = {"GPU": 1.0} if device == "cuda" and "GPU" not in resources else {}
    merged = {"CPU": cpus, **gpu, **resources}
    return {name: amount for name, amount in merged.items() if amount > 0}


def ray_options(request: dict[str, float]) -> dict[str, Any]:
    """`request` as keyword arguments of `ray.remote` / `.options` (CPU and GPU have their own)."""
    custom = {k: v for k, v in request.items() if k not in ("CPU", "GPU")}
    return {
        "num_cpus": request.get("CPU", 0),
        "num_gpus": request.get("GPU", 0),
        "resources": custom,
    }
