"""local.processes: the log follower returns each complete line once, and nothing before the file exists."""

from trainingrun_operator import local


def test_log_follower_returns_each_complete_line_once(tmp_path):
    path = tmp_path / "attempt-1.log"
    follower = local.LogFollower(path)
    assert follower.new_lines() == []  # not created yet
    path.write_text("one\ntw")
    assert follower.new_lines() == ["one"]
    with open(path, "a") as f:
        f.write("o\nthree\n")
    assert follower.new_lines() == ["two", "three"]
    assert follower.new_lines() == []
