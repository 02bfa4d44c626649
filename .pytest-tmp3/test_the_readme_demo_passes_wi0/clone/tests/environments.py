"""The environment a test gives the processes it starts: this process's, less the variables the test sets itself."""

import os

from trainingrun_api import contract

#: Kept whatever the prefixes: the session's own folder in node memory (conftest.py), which every trainer a test
#: starts must use, so a test's clean-up never touches another session's or a user's checkpoint copies.
KEPT = (contract.MEMORY_TIER_ROOT_ENV,)


def inherited(*prefixes: str, names: tuple = ()) -> dict[str, str]:
    """os.environ without the variables starting with `prefixes` or named in `names`, KEPT kept."""
    return {k: v for k, v in os.environ.items() if k in KEPT or not (k.startswith(prefixes) or k in names)}


def run_script(script: str, config_path, **env: str):
    """A user's script run as `python -c script` with TRAININGRUN_CONFIG at `config_path` (a run named `mine`), the
    rest of the contract unset, as a script started by hand would be: the finished process (stdout, stderr)."""
    import subprocess
    import sys

    full_env = {**inherited("TRAININGRUN_", "PET_"), "TRAININGRUN_CONFIG": str(config_path), "TRAININGRUN_NAME": "mine"}
    return subprocess.run(
        [sys.executable, "-c", script], env={**full_env, **env}, capture_output=True, text=True, timeout=120
    )
