"""tests/unit mirrors the packages: a test of a module sits in the folder of its package and is named after it, and
only the checks of the repository as a whole (its import graph, README and docs, images, benchmark scripts, this
layout, and the test session's own folders) sit at the top."""

import os
import subprocess
import sys
from pathlib import Path

UNIT = Path(__file__).resolve().parent
REPOSITORY_WIDE = {
    "test_benchmark_scripts.py",
    "test_images.py",
    "test_import_graph.py",
    "test_layout.py",
    "test_readme.py",
}
PACKAGE_FOLDERS = {
    "api": "common/trainingrun_api",
    "operator": "operator/trainingrun_operator",
    "trainer": "trainer_image/trainingrun_trainer",
}


def test_only_repository_wide_checks_sit_at_the_top():
    assert {p.name for p in UNIT.glob("test_*.py")} == REPOSITORY_WIDE


def test_every_test_folder_is_a_folder_of_its_package():
    repo = UNIT.parents[1]
    for folder in (p for p in UNIT.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        top, *rest = folder.relative_to(UNIT).parts
        assert top in PACKAGE_FOLDERS, folder
        assert (repo / PACKAGE_FOLDERS[top] / Path(*rest)).is_dir(), f"{folder} mirrors no package folder"


#: Modules whose behaviour only a whole program shows, and the test that runs them. Test file names are unique across
#: tests/ (pytest imports them by name), so a module may be named with its folder or package in front:
#: checkpoint/storage.py by test_checkpoint_storage_hashing.py, the operator's metrics.py by test_operator_metrics.py.
TESTED_ELSEWHERE = {
    "operator/trainingrun_operator/handlers.py": "tests/real_api/test_operator_real.py",  # kopf's handlers, running
    "operator/trainingrun_operator/plans.py": "tests/real_api/test_operator_real.py",  # API calls: a real server
    "trainer_image/trainingrun_trainer/checkpoint/context.py": "tests/unit/trainer/checkpoint/test_checkpoint_store.py",
    "trainer_image/trainingrun_trainer/checkpoint/layout.py": "tests/unit/trainer/checkpoint/test_checkpoint_store.py",
    "trainer_image/trainingrun_trainer/checkpoint/writer.py": "tests/unit/trainer/checkpoint/test_checkpoint_saving.py",
}


def test_every_module_has_a_test_named_after_it():
    repo = UNIT.parents[1]
    untested = []
    for top, package in PACKAGE_FOLDERS.items():
        for module in sorted((repo / package).rglob("*.py")):
            if module.name in ("__init__.py", "__main__.py"):
                continue
            folder = module.parent.relative_to(repo / package)
            tests = {p.name for p in (UNIT / top / folder).glob("test_*.py")}
            prefixes = {f"test_{module.stem}"} | {f"test_{part}_{module.stem}" for part in (top, *folder.parts)}
            named = any(
                name.removesuffix(".py") == prefix or name.startswith(prefix + "_")
                for name in tests
                for prefix in prefixes
            )
            path = str(module.relative_to(repo))
            if not named and not (path in TESTED_ELSEWHERE and (repo / TESTED_ELSEWHERE[path]).is_file()):
                untested.append(path)
    assert untested == [], "give each its test_<module>.py in the mirrored folder (or a line in TESTED_ELSEWHERE)"


def test_the_processes_a_test_starts_keep_their_temporary_folders_in_the_sessions_own():
    """tests/conftest.py: what torchrun's agents and their workers leave in the temporary directory when a test kills
    them (torchelastic_*, pymp-*) lands in this session's folder, which goes when the session ends: `make test`
    leaves nothing in /tmp."""
    made = subprocess.run(
        [sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='torchelastic_'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(made).parent.name.startswith("trainingrun-tests-tmp-"), made
    assert Path(made).parent == Path(os.environ["TMPDIR"])
