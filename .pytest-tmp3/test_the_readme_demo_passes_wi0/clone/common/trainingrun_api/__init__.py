"""trainingrun_api: what the operator and the trainer agree on, in one torch-free package both import.

- `contract`: the environment a trainer container gets, the report endpoint, the time helpers;
- `progress_report`: the report rank 0 sends back (checked once, by its models) and what is derived from reports;
- `exit_codes`: what a trainer's exit code means to the operator (retry, give up, preempted);
- `config`: the trainer config models (`spec.trainer`; `RunConfig`, the file mounted at TRAININGRUN_CONFIG);
- `checkpoint_config`: `spec.checkpoint`, and the rules a checkpoint URI follows;
- `model_base`: the base of every API model, `ConfigError`, and the rules about credentials in URIs;
- `components`: the built-in classes a `classPath` may name and the checks of their `initArgs`.

It imports neither package: the arrows go operator -> trainingrun_api <- trainer (tests/unit/test_import_graph.py).
"""
