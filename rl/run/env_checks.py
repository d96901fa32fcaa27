"""Check-time checks of a run file's env, before anything starts (`agentrl train`, `check` and
`eval` in rl/cli.py and rl/run/commands.py): the env id is known (`check_env_id`, on the raw run
file, before the slow policy checks), then each env (every entry of a mix, each curriculum
stage's kwargs) registers, takes its kwargs and builds once (`check_env`); for `train` and
`check`, an opening prompt leaves room for a turn (`check_prompt_room`: policy.path's tokenizer,
a fresh policy's when the run builds it). Every failure is a ConfigError naming the run-file key."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from rl.config.mix import check_mix_expert
from rl.config.runfile import ConfigError, RunConfig, policy_max_positions


def check_env_id(data: dict) -> None:
    """An unknown `env.id` (no entry point) fails here, before the policy's settings are checked
    (that imports torch and transformers: seconds), with the closest registered ids."""
    env = data.get("env")
    env = env if isinstance(env, dict) else {}
    mix = env.get("mix") if isinstance(env.get("mix"), list) else []
    sections = [("env.id", env)] + [(f"env.mix[{i}].id", entry) for i, entry in enumerate(mix)]
    for key, section in sections:
        if not isinstance(section, dict):  # the typed build names what is wrong with it
            continue
        env_id = section.get("id")  # (none: the default, a built-in)
        if section.get("entry_point") is None and isinstance(env_id, str):
            from envs.registry import RegistrationError, ensure_registered

            try:
                ensure_registered(env_id)
            except RegistrationError as exc:
                raise ConfigError(key, str(exc)) from None


def check_env(cfg: RunConfig) -> None:
    """Every env of the run registers, takes its kwargs (each stage's too) and builds once; a
    mix's entries each as if alone, with a scripted expert where needed; `policy.path` exists."""
    if cfg.env.mix is not None:  # each env of the mix as if alone (stages cannot change a mix)
        for i, entry in enumerate(cfg.env.mix):
            _check_one_env(entry, f"env.mix[{i}].", [(f"env.mix[{i}].kwargs", {})])
            check_mix_expert(cfg, entry, f"env.mix[{i}].id")
    else:
        stages = [
            (f"curriculum.{i}.env_kwargs", s.env_kwargs) for i, s in enumerate(cfg.curriculum)
        ]
        stages += [
            (f"sft.kwargs_mix.{i}.kwargs", v.kwargs) for i, v in enumerate(cfg.sft.kwargs_mix)
        ]
        _check_one_env(cfg.env, "env.", [("env.kwargs", {}), *stages])
        check_mix_expert(cfg, cfg.env, "env.id")  # a harness env without kwargs.expert
    check_policy(cfg)


def check_policy(cfg: RunConfig) -> None:
    """`policy.path` is a saved model (its config.json and tokenizer); a fresh policy's model
    config builds (policy/model_config.py: the model type, a preset only for agentrl_k3, the
    preset's name, every config key a field of the model's config)."""
    p = cfg.policy
    if p.path is not None:
        where = Path(p.path)
        if not where.is_dir():
            raise ConfigError("policy.path", f"{p.path!r} is not a directory")
        missing = [f for f in ("config.json", "tokenizer_config.json") if not (where / f).is_file()]
        if missing:
            run = (where / "final-model").is_dir()  # a run directory
            hint = f"; did you mean {str(where / 'final-model')!r}?" if run else ""
            raise ConfigError(
                "policy.path",
                f"{p.path!r} has no {' and no '.join(missing)}: name a saved model directory "
                f"(a run's final-model, sft-model or policy-init, or a transformers model){hint}",
            )
        saved = _saved_config(where / "config.json")
        _check_saved_kind(cfg, saved.get("model_type"))
        _check_experts(cfg, _experts_of(saved))
        return
    from policy.model_config import model_config

    if "vocab_size" in p.config:  # model_config sets it from policy.vocab_size
        raise ConfigError(
            "policy.config.vocab_size",
            f"set policy.vocab_size instead (the tokenizer is built to it): policy.vocab_size="
            f"{p.config['vocab_size']}",
        )
    try:
        config = model_config(p.model_type, p.config, vocab_size=p.vocab_size)
    except (ValueError, TypeError) as exc:  # TypeError: a field of the wrong type
        text = str(exc)
        key = "policy.model_type" if "model type" in text else "policy.config"
        key += ".preset" * ("preset" in text)
        raise ConfigError(key, text) from None
    _check_experts(cfg, getattr(config, "num_experts", None) if p.model_type == K3 else None)


K3 = "agentrl_k3"


def _saved_config(path: Path) -> dict:
    """A saved model's config.json ({} when unreadable: loading it will say why)."""
    import json

    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _check_saved_kind(cfg: RunConfig, kind: Any) -> None:
    """What needs the K3 policy, refused for a saved model of another type (the run file's
    own validators check only a fresh policy's policy.model_type)."""
    if kind in (K3, None):
        return
    t = cfg.trainer
    for key, on, why in (
        ("segment_tokens", t.segment_tokens > 0, "segmented training carries K3's KDA state"),
        ("context_parallel", t.context_parallel > 1, "context parallelism relays K3's state"),
        ("exact_logprobs", t.exact_logprobs, "exact mode decodes with the K3 engine"),
    ):
        if on:
            raise ConfigError(
                f"trainer.{key}",
                f"{why}, and policy.path is a {kind} model: use a saved {K3} policy, or turn "
                f"trainer.{key} off",
            )


def _experts_of(saved: dict) -> int | None:
    """A saved K3 policy's routed experts (None for another model or an unreadable file)."""
    if saved.get("model_type") != K3:
        return None
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):  # K3Config's aliases
        if isinstance(saved.get(key), int):
            return saved[key]
    return None


def _check_experts(cfg: RunConfig, experts: int | None) -> None:
    """trainer.expert_parallel > 1 needs routed experts that split evenly over its ranks (the
    learner would otherwise fail at its start, or, for a dense policy, split nothing)."""
    ep = cfg.trainer.expert_parallel
    if ep == 1:
        return
    if experts is None:
        raise ConfigError(
            "trainer.expert_parallel",
            f"{ep} ranks would split the routed experts of each MoE layer, but the policy has "
            f"none (only {K3} policies have routed experts here): set it to 1",
        )
    if experts % ep:
        raise ConfigError(
            "trainer.expert_parallel",
            f"the policy's {experts} routed experts do not split evenly over {ep} ranks: use a "
            f"divisor of {experts}",
        )


def _check_one_env(env: Any, prefix: str, stages: list[tuple[str, dict]]) -> None:
    """Register `env` (an env section or a mix entry), bind and build it with its kwargs and
    each stage's; a ConfigError names the key (`prefix` + id, entry_point or kwargs.KEY)."""
    import envs
    from envs.registry import check_build

    try:  # an `env.entry_point` is registered under `env.id` here (and in each worker)
        envs.ensure_registered(env.id, env.entry_point)
    except envs.RegistrationError as exc:
        key = "entry_point" if env.entry_point else "id"
        raise ConfigError(prefix + key, str(exc)) from None
    for where, extra in stages:
        kwargs = {**env.kwargs, **extra}
        try:
            envs.check_kwargs(env.id, kwargs)  # the env's class takes these names
            check_build(env.id, kwargs)  # built once (and closed): values it refuses
        except envs.RegistrationError as exc:
            raise ConfigError(_env_key(env, where, exc.key), str(exc)) from None


def _env_key(env: Any, where: str, key: str | None) -> str:
    """The run-file key an env build error names: env.dataset / env.grader (env.mix[i].dataset
    / ...grader for an entry of a mix) when the run file wrote the shorthand
    (rl/config/dataset.py), else `where`.`key`."""
    if env.dataset is not None and where.startswith("env.") and where.endswith(".kwargs"):
        prefix = where.removesuffix("kwargs")
        if key in (None, "path"):  # the task file's content
            return prefix + "dataset"
        if key == "grader" and env.grader is not None:
            return prefix + "grader"
    return f"{where}.{key}" if key else where


PROBE_SEEDS = 8
"""Tasks (seeds 0-7) whose opening prompts `check_prompt_room` renders, until one fits: a file
whose prompts are too long half the time is refused once in 256 seeds."""


def check_prompt_room(cfg: RunConfig, tokenizer: Any = None) -> None:
    """An opening prompt leaves room for a turn of max_new_tokens within max_seq_len (each
    curriculum stage's within its own); when none of PROBE_SEEDS tasks' does, every episode would
    end "context full" before its first token (rollout/agent.py) and the run learn nothing.
    `tokenizer`: the policy's; None: policy.path's, skipped when there is none or it does not
    load (a fresh policy's exists once rl/run/build.py prepare_policy trains it, and checks)."""
    if tokenizer is None:
        tokenizer = _saved_tokenizer(cfg.policy.path)
        if tokenizer is None:
            return
    from rl.run.curriculum import staged
    from rollout.render import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    for index in range(len(cfg.curriculum)) if cfg.curriculum else [None]:
        prompt = _prompt_over(staged(cfg, index), renderer)
        if prompt is not None:
            raise _no_room(cfg, index, prompt)


def _saved_tokenizer(path: str | None) -> Any:
    """policy.path's tokenizer, or None (no path, or one that does not load: the run says why)."""
    if path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:
        return None


def _runs_outside_code(env: Any) -> bool:
    """Whether a reset would run the user's agent (a harness env) or start MCP servers: such
    envs are not probed (side effects, and waits of up to their start-up timeouts)."""
    from envs.mixture import MIX_ID
    from rl.config.dataset import HARNESS_ENV

    whole = {"id": env.id, "kwargs": env.kwargs}
    entries = (env.kwargs.get("envs") or []) if env.id == MIX_ID else [whole]
    return any(e.get("id") == HARNESS_ENV or (e.get("kwargs") or {}).get("mcp") for e in entries)


def _prompt_over(run: RunConfig, renderer: Any) -> int | None:
    """The shortest opening prompt (tokens, as rollout/episode.py open_episode renders it) of
    tasks 0 .. PROBE_SEEDS - 1 when none leaves room for a turn, else None (it stops at the first
    that does). None too when the env cannot be probed: it runs outside code
    (`_runs_outside_code`), or its build, a reset or a render raises (the run or `agentrl envs
    check ID` says why; one failure ends the probe, so a slow failing reset is waited for once)."""
    import gymnasium

    import envs

    if _runs_outside_code(run.env):
        return None
    room, lengths = run.rollout.max_seq_len - run.rollout.max_new_tokens, []
    try:
        envs.ensure_registered(run.env.id, run.env.entry_point)
        env = gymnasium.make(run.env.id, **run.env.kwargs)
    except Exception:
        return None
    try:
        for seed in range(PROBE_SEEDS):
            observation, info = env.reset(seed=seed)
            lengths.append(len(renderer.prompt(observation, info.get("tools", []))))
            if lengths[-1] <= room:
                return None
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):  # closing is not what is checked
            env.close()
    return min(lengths, default=None)


def _no_room(cfg: RunConfig, index: int | None, prompt: int) -> ConfigError:
    """The error naming max_seq_len (the run's or the stage's), max_new_tokens, the policy's
    max_position_embeddings, and the fixes."""
    from rl.run.curriculum import staged

    rollout = staged(cfg, index).rollout
    seq, new = rollout.max_seq_len, rollout.max_new_tokens
    key, new_key = "rollout.max_seq_len", "rollout.max_new_tokens"
    if index is not None:
        key = f"curriculum[{index}].max_seq_len"
        if cfg.curriculum[index].max_new_tokens is not None:
            new_key = f"curriculum[{index}].max_new_tokens"
    limit = policy_max_positions(cfg.policy)
    takes = "" if limit is None else f" (the policy takes {limit}: max_position_embeddings)"
    fixes = [f"lower {new_key} to {seq - prompt} or less"] if prompt < seq else []
    if limit is None or prompt + new <= limit:
        fixes.insert(0, f"raise {key} to {prompt + new} or more")
    elif seq < limit and prompt < limit:
        fixes.insert(0, f"raise {key} to {limit} with {new_key} {limit - prompt} or less")
    fixes.append("give the env shorter prompts (its kwargs)")
    return ConfigError(
        key,
        f"{seq}{takes} leaves no room for a turn: the shortest opening prompt of {PROBE_SEEDS} "
        f"tasks is {prompt} tokens (the policy's tokenizer), and {prompt} + {new_key} {new} > "
        f'{seq}, so every episode would end "context full" before its first token and the run '
        f"would learn nothing; {', or '.join(fixes)}",
    )
