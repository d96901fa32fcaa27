"""What one actor asks Ray for: CPU, GPU and custom resources, as run-file types and requests.

Used by the run file's sections (`rollout.resources`, `trainer.resources`) and by placement
(rl/run/placement.py), which checks the requests against the cluster.
"""

from __future__ import annotations

import math
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
        if name == "GPU" and 0 < amount < 1 and abs(amount - 1 / round(1 / amount)) > 1 / UNIT:
            raise ValueError(
                "GPU below 1 must be a whole fraction of one GPU (Ray packs shares onto a "
                f"single GPU, so the rest would be wasted): 0.5, 0.3333, 0.25, 0.2, ...; got "
                f"{amount:g}"
            )
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


def gpu_share(resources: dict[str, float]) -> float:
    """The GPUs one cuda actor holds: `resources.GPU` where the run file sets it (0.25: a quarter
    of one GPU), else one."""
    return float(resources.get("GPU", 1.0))


def gpu_fraction(resources: dict[str, float]) -> float:
    """The part of one GPU a cuda actor holds: its share below one, else the whole GPU."""
    share = gpu_share(resources)
    return share if 0 < share < 1 else 1.0


def gpus_needed(*groups: tuple[int, float]) -> int:
    """Whole GPUs that the actors of `groups` ((count, share) each) take together. Shares below
    one are packed onto GPUs first-fit, largest first, in Ray's 1/10,000 steps, as Ray fits each
    onto a single GPU (4 x 0.25 on one; a 0.5 and two 0.25 on one); whole shares take that many
    GPUs each; a share of 0 takes none."""
    whole, parts = 0, []
    for count, share in groups:
        if share >= 1:
            whole += count * math.ceil(share)
        elif share > 0:
            parts += [round(share * UNIT)] * count
    rooms: list[int] = []  # what is left of each GPU in use
    for part in sorted(parts, reverse=True):
        fit = next((i for i, room in enumerate(rooms) if room >= part), None)
        if fit is None:
            rooms.append(UNIT - part)
        else:
            rooms[fit] -= part
    return whole + len(rooms)


def ask(cpus: float, resources: dict[str, float], device: str = "cpu") -> dict[str, float]:
    """One actor's request to Ray: its CPUs plus `resources`, without zero amounts; a GPU only on
    a cuda device, one unless `resources` says how many (`auto` counts as cpu: resolve it first,
    rl/run/devices.py; a part that `auto` put on the CPU reserves no GPU)."""
    gpu = {"GPU": gpu_share(resources) if device == "cuda" else 0.0}
    merged = {"CPU": cpus, **resources, **gpu}
    return {name: amount for name, amount in merged.items() if amount > 0}


def check_gpu_ask(section: Any, name: str) -> None:
    """A ConfigError naming `resources.GPU` for an ask that does not match the device: a GPU for
    actors on the CPU (`<name>.device: cpu`) would sit idle, or wait forever where there is none;
    `GPU: 0` on cuda reserves nothing, and Ray would let every such actor onto GPU 0."""
    if section.device == "cuda" and section.resources.get("GPU", 1) == 0:
        raise ConfigError(
            "resources.GPU",
            f"is 0 with {name}.device: cuda: the actors would use a GPU Ray never reserved for "
            "them (all on GPU 0); remove it (one GPU each), or give each a share such as 0.25",
        )
    if section.device == "cpu" and section.resources.get("GPU", 0) > 0:
        raise ConfigError(
            "resources.GPU",
            f"asks Ray for {section.resources['GPU']:g} GPU for actors that run on the CPU "
            f"({name}.device: cpu): remove it, or set {name}.device: cuda (or auto: cuda when "
            "the GPUs cover every actor's share)",
        )


def ray_options(request: dict[str, float]) -> dict[str, Any]:
    """`request` as keyword arguments of `ray.remote` / `.options` (CPU and GPU have their own)."""
    custom = {k: v for k, v in request.items() if k not in ("CPU", "GPU")}
    return {
        "num_cpus": request.get("CPU", 0),
        "num_gpus": request.get("GPU", 0),
        "resources": custom,
    }
