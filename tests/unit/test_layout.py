"""tests/unit mirrors the packages: a test of a module sits in the folder of its package, and only the checks of the
repository as a whole (its import graph, README and docs, images, benchmark scripts, this layout) sit at the top."""

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
