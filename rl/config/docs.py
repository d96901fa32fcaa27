"""docs/run-files.md, generated from the config models (`agentrl config docs`), so the reference
cannot drift from the code: every key with its type, default and meaning, section by section.
A test regenerates it and compares it with the committed file."""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rl.config.runfile import RunConfig

PREFACE = """\
# Run files: every key

<!-- Generated from rl/config/runfile.py, sections.py and trainer.py by
`agentrl config docs --output docs/run-files.md`; tests/rl/test_config_docs.py fails when this
file and the code differ. -->

A run file is YAML; every key has a default, so a run file holds only what differs
(`configs/quickstart.yaml` is the reference). Any key can be overridden on the command line with
a dotted path: `agentrl train RUN.yaml trainer.lr=3e-4 env.kwargs.difficulty=2`. Unknown keys,
wrong types and impossible values fail before anything starts, naming the key
(`agentrl check RUN.yaml` checks only). Editors can validate run files against the JSON Schema
that `agentrl config schema --output agentrl.schema.json` writes.

**Turns.** `rollout.max_turns` caps the model's turns in an episode (the agent loop ends it as
truncated, "out of turns"); an env's own `env.kwargs.max_turns` (every `ToolEnv` takes one) makes
the env truncate it after that many steps. The smaller one wins; set both when you change
either. A curriculum stage's `max_turns` replaces `rollout.max_turns` while it lasts, and its
`env_kwargs` are merged over `env.kwargs`.

**Reward.** The `reward:` section alone decides what the learner trains on: total = sum of
weight x term over the non-zero weights. An env's own Gymnasium step rewards count only through
`reward.env_reward`; `task_completion` reads the env's final outcome.
"""


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value)}`"


def _bounds(field: FieldInfo) -> str:
    marks = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    out = []
    for meta in field.metadata:
        for name, sign in marks.items():
            if getattr(meta, name, None) is not None:
                out.append(f"{sign} {getattr(meta, name)}")
    return f" ({', '.join(out)})" if out else ""


def _section(model: type[BaseModel]) -> type[BaseModel] | None:
    """The section model a field holds, if any (directly, or as list items)."""
    for candidate in (model, *typing.get_args(model)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _rows(model: type[BaseModel], prefix: str, sections: list) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        inner = _section(field.annotation)
        if inner is not None:
            sections.append((key, inner, field))
            continue
        meaning = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(
            f"| `{key}` | {_type(field.annotation)}{_bounds(field)} | {_default(field)} | "
            f"{meaning} |"
        )
    return rows


def run_file_reference() -> str:
    """The whole reference, as markdown."""
    parts = [PREFACE]
    sections: list = []
    top = _rows(RunConfig, "", sections)
    parts.append("## Top level\n\n| key | type | default | meaning |\n|---|---|---|---|")
    parts.append("\n".join(top) + "\n")
    while sections:
        key, model, field = sections.pop(0)
        listed = typing.get_origin(field.annotation) is list
        title = f"`{key}:` (a list; each item:)" if listed else f"`{key}:`"
        doc = " ".join(((field.description or model.__doc__) or "").split())
        prefix = f"{key}[].".replace("[].", "[i].") if listed else f"{key}."
        rows = _rows(model, prefix, sections)
        if not rows:  # only sections under it (testing:): no empty table
            parts.append(f"## {title}\n\n{doc}\n")
            continue
        parts.append(
            f"## {title}\n\n{doc}\n\n| key | type | default | meaning |\n|---|---|---|---|"
        )
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)
