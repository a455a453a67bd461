"""`ssl-vit data convert`'s progress (`ssl_vit.progress.count`, the display evaluation's `job` draws its
bars with): a line per finished shard on a non-terminal stderr, a bar on a terminal, nothing with
--no-progress. Through the CLI, as users run it."""

import re

from cli_helpers import run_cli, run_on_terminal

LINE = r"train-00000{shard}\.tar: {done}/30 images \({pct}%\)(, ETA \d+:\d\d:\d\d)?, \d+ images/s"


def test_a_line_per_finished_shard_when_stderr_is_not_a_terminal(tmp_path):
    proc = run_cli("data", "convert", "synthetic:30", str(tmp_path / "out"), "--shard-size", "12")
    lines = proc.stderr.splitlines()
    expected = [LINE.format(shard=0, done=12, pct=40), LINE.format(shard=1, done=24, pct=80)]
    expected.append(LINE.format(shard=2, done=30, pct=100))
    assert len(lines) == 3 and all(re.fullmatch(p, line) for p, line in zip(expected, lines)), lines
    assert proc.stdout.startswith("wrote 30 samples") and "\x1b" not in proc.stdout + proc.stderr
    quiet = run_cli("data", "convert", "synthetic:30", str(tmp_path / "quiet"), "--no-progress")
    assert quiet.stderr == ""


def test_a_bar_on_a_terminal(tmp_path):
    status, shown = run_on_terminal(
        ["data", "convert", "synthetic:30", str(tmp_path / "out"), "--shard-size", "12"], cwd=tmp_path
    )
    assert status == 0, shown[-3000:]
    assert "writing train" in shown and "30/30" in shown and "━" in shown, shown[-3000:]
    assert re.search(r"[\d,]+ images/s", shown), shown[-3000:]
    assert ".tar: " not in shown  # the lines of a log are not printed on a terminal
