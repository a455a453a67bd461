"""`ssl-vit --help` and the help of every argparse subcommand start without importing torch, Lightning,
timm, W&B or the readers' pyarrow and webdataset: the parsers are registered by light modules, and a
command imports what it runs."""

import subprocess
import sys
from pathlib import Path

HEAVY = (
    "torch", "pytorch_lightning", "lightning_fabric", "timm", "wandb", "matplotlib", "sklearn", "pyarrow",
    "webdataset",
)  # fmt: skip
HELP = [
    [], ["info"], ["data", "convert"], ["data", "inspect"], ["evaluate"], ["compare"], ["export"],
    ["analyze"], ["bench", "step"], ["bench", "loop"], ["bench", "scaling"], ["bench", "data"],
]  # fmt: skip
PROBE = f"""
import contextlib, io, sys
from ssl_vit.cli import main
for argv in {HELP!r}:
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    assert out.getvalue().startswith("usage: ssl-vit"), argv
print(*sorted(name for name in {HEAVY!r} if name in sys.modules))
"""


def test_help_of_every_argparse_command_imports_nothing_heavy():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == []


def test_the_installed_console_script_runs_the_cli():
    """The `ssl-vit` executable the install puts next to the interpreter (the other tests run the CLI
    through a fork server or `python -m ssl_vit`): a real command, with its output and exit status."""
    sslvit = Path(sys.executable).parent / "ssl-vit"
    proc = subprocess.run([str(sslvit), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: ssl-vit"), proc.stderr[-3000:]
    proc = subprocess.run(
        [str(sslvit), "info", "--variant", "X/16"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith("ssl-vit: error:"), proc.stderr[-3000:]
