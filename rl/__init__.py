"""The learner and the orchestration: config, Ray + Redis launch, GRPO, weight sync, metrics.

Kept import-light: `rl.config.runfile` loads and checks a run file without importing torch or ray.
"""
