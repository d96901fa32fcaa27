"""The run file: YAML -> typed, checked `RunConfig` (pydantic models), before anything starts.

runfile (RunConfig, load_config, overrides), sections, mix (env.mix) and trainer (the sections'
models, on base's Section), cluster (multi-node checks), resources (what an actor asks Ray for),
errors (ConfigError, named by dotted key), docs (docs/run-files.md generated from the models).
Imports no other room of rl/.
"""
