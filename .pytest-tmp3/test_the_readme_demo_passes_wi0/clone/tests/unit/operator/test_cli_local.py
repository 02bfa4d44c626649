"""cli_local: the commands that run on the user's machine: `trainingrun checkpoints` lists valid and invalid checkpoints (table and JSON), progress bars only on terminals with rich."""

from trainingrun_operator import cli


def test_checkpoints_lists_valid_and_invalid(tmp_path, capsys):
    import json

    import torch

    from trainingrun_trainer.checkpoint import CheckpointStore

    uri = f"file://{tmp_path}/ckpt"
    store = CheckpointStore(uri, keep=5)
    for step in (10, 20):
        store.save(
            step,
            {"model": {"w": torch.full((4,), float(step))}},
            {"step": step},
            model_digest=f"d{step}",
            blocking=True,
        )
    store.close()
    (tmp_path / "ckpt" / "step-00000020" / "manifest.json").unlink()  # as if the save died before its commit
    assert cli.main(["checkpoints", uri, "--json"]) == 0
    listed = {c["step"]: c for c in json.loads(capsys.readouterr().out)}
    assert listed[10]["valid"] is True and listed[10]["model_digest"] == "d10"
    assert listed[20]["valid"] is False and "no manifest" in listed[20]["reason"]
    assert cli.main(["checkpoints", uri]) == 0
    table = capsys.readouterr().out
    assert "STEP" in table and "no manifest (partial save)" in table
    assert cli.main(["checkpoints", f"file://{tmp_path}/empty"]) == 0
    assert "no checkpoints under" in capsys.readouterr().out


def test_progress_bars_only_on_terminals_with_rich(monkeypatch):
    import importlib.util
    import io

    from trainingrun_operator import cli_local

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert cli_local.progress_bars(Terminal()) and not cli_local.progress_bars(io.StringIO())
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rich" else found(name, *a))
    assert not cli_local.progress_bars(Terminal())  # without the cli extra: plain lines


def test_byte_progress_prints_a_line_per_tenth_off_terminals():
    import io

    from trainingrun_operator.cli_local import ByteProgress

    out = io.StringIO()
    bar = ByteProgress(out)
    for done in (0, 5, 10, 95, 100, 400, 1000):
        bar.update(done, 1000)
    bar.update(1, 0)  # a total of nothing: no division
    bar.close()
    assert out.getvalue().splitlines() == [
        "0/1000 bytes (0%)",
        "100/1000 bytes (10%)",
        "400/1000 bytes (40%)",
        "1000/1000 bytes (100%)",
    ]


def test_the_header_counts_simulated_nodes(tmp_path, capsys, monkeypatch):
    """Issue 78 item 6: on main `--nodes 2` said `on 1 process(es)`. The runner is stopped right after the header."""
    import pytest

    from trainingrun_operator import local

    class Stopped(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stopped

    monkeypatch.setattr(local, "LocalRunner", stop)
    path = tmp_path / "run.yaml"
    path.write_text("apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: nodes}\nspec: {}\n")
    with pytest.raises(Stopped):
        cli.main(["local", str(path), "--nodes", "2", "--runs-dir", str(tmp_path / "runs")])
    assert "steps on 2 simulated nodes of 1 process(es)" in capsys.readouterr().out
