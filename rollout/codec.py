"""Trajectory groups <-> bytes for the Redis stream: msgpack with raw little-endian arrays.

Never pickle: a stream entry is data, decoding it cannot run code. Token arrays travel as raw
`int32` / `uint8` / `float32` buffers (4 bytes a token, not a msgpack int each).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup

FORMAT_VERSION = 1
_ARRAYS = {
    "token_ids": "<i4",
    "loss_mask": "<u1",
    "sample_logprobs": "<f4",
    "token_versions": "<i4",
}
_SCALARS = (
    "task_id",
    "prompt_length",
    "finish_detail",
    "outcome",
    "num_turns",
    "num_tool_calls",
    "num_tool_errors",
    "num_parse_errors",
    "reward",
    "reward_parts",
    "messages",
)


_OPTIONAL = {"traj_id": "", "attempt": 1, "resumed": 0, "env_reward": 0.0}
"""Scalars added after format 1 was first written; older entries decode with these."""


class CodecError(ValueError):
    """A stream entry that is not a trajectory group of a format we read."""


def encode_group(group: TrajectoryGroup) -> bytes:
    payload = {
        "v": FORMAT_VERSION,
        "group_id": group.group_id,
        "task_id": group.task_id,
        "trajectories": [_encode_traj(t) for t in group.trajectories],
    }
    return msgpack.packb(payload, use_bin_type=True)


def _encode_traj(traj: Trajectory) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(traj, name) for name in (*_SCALARS, *_OPTIONAL)}
    out["status"] = str(traj.status)
    for name, dtype in _ARRAYS.items():
        out[name] = np.asarray(getattr(traj, name), dtype=dtype).tobytes()
    if traj.routed_experts is not None:  # [T-1, M, K] int16: 2 bytes per expert choice
        routed = np.asarray(traj.routed_experts, dtype="<i2")
        out["routed_experts"] = {"shape": list(routed.shape), "data": routed.tobytes()}
    return out


def decode_group(data: bytes) -> TrajectoryGroup:
    try:
        payload = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError) as exc:
        raise CodecError(f"not a msgpack payload: {exc}") from None
    if not isinstance(payload, dict) or payload.get("v") != FORMAT_VERSION:
        raise CodecError(f"unknown trajectory format (want v={FORMAT_VERSION})")
    try:
        trajs = [_decode_traj(t) for t in payload["trajectories"]]
        return TrajectoryGroup(
            group_id=payload["group_id"], task_id=payload["task_id"], trajectories=trajs
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CodecError(f"malformed trajectory group: {exc}") from None


def _decode_traj(data: dict[str, Any]) -> Trajectory:
    fields = {name: data[name] for name in _SCALARS}
    fields.update({name: data.get(name, default) for name, default in _OPTIONAL.items()})
    arrays = {
        name: np.frombuffer(data[name], dtype=dtype).tolist() for name, dtype in _ARRAYS.items()
    }
    lengths = {len(a) for a in arrays.values()}
    if len(lengths) != 1:
        raise ValueError(f"array lengths differ: {sorted(lengths)}")
    return Trajectory(
        status=RolloutStatus(data["status"]),
        routed_experts=_decode_routes(data.get("routed_experts")),
        **fields,
        **arrays,
    )


def _decode_routes(routed: dict[str, Any] | None) -> np.ndarray | None:
    """int16 [T-1, M, K], an array of its own (writable, not a view of the payload)."""
    if routed is None:
        return None
    if len(routed["shape"]) != 3:
        raise ValueError(f"routed_experts must be [T-1, M, K], got shape {routed['shape']}")
    flat = np.frombuffer(routed["data"], dtype="<i2")
    return flat.astype(np.int16).reshape(routed["shape"])


def encode_episode(traj: Trajectory, extra: dict[str, Any]) -> bytes:
    """An unfinished episode (partial rollout): its trajectory so far plus plain `extra` data
    (the env's `get_state()`, the turn in progress, its tools). Never pickle."""
    return msgpack.packb(
        {"v": FORMAT_VERSION, "traj": _encode_traj(traj), "extra": extra}, use_bin_type=True
    )


def decode_episode(data: bytes) -> tuple[Trajectory, dict[str, Any]]:
    try:
        payload = msgpack.unpackb(data, raw=False, strict_map_key=True)
        if payload.get("v") != FORMAT_VERSION:
            raise ValueError(f"unknown episode format (want v={FORMAT_VERSION})")
        return _decode_traj(payload["traj"]), payload["extra"]
    except (msgpack.UnpackException, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CodecError(f"malformed saved episode: {exc}") from None
