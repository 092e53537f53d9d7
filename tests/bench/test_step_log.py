"""``bench serve --server-log-level debug --server-log`` keeps a log in which every engine
step is timed with what it held, and ``benchmarks/tools/step_log.py`` reads it back."""

import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "benchmarks" / "tools"


def test_the_server_log_times_every_step_and_step_log_groups_them(tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    run = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "bench", "serve", "--quick",
         "--concurrency", "2", "--num-prompts", "4", "--output-len", "8",
         "--out-dir", str(tmp_path), "--server-log", str(log), "--server-log-level", "debug"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    monkeypatch.syspath_prepend(str(TOOLS))
    import step_log

    steps = step_log.parse(log.read_text())
    # 2 warm-up and 4 measured requests of 8 tokens: every prompt is prefilled, and each
    # request's tokens after its first come from steps with decode rows.
    assert sum(len(chunks) for _, _, chunks in steps) >= 6
    assert sum(rows for _, rows, _ in steps) >= 6 * 7
    assert all(ms > 0 for ms, _, _ in steps)
    table = step_log.summary(steps, slowest=3)
    assert "| decode rows, no prompt chunk |" in table and "Slowest 3:" in table


def test_server_log_flags_need_a_started_server(capsys):
    from pagedserve.cli import main

    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--server-log", "x.log"]) == 2
    assert "--server-log and --server-log-level apply to a server" in capsys.readouterr().err
