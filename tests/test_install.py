"""Installing ssl-vit: beside a torch the environment already has (pyproject.toml's ranges), and the
exact versions of `make install` (requirements/constraints.txt).

The pip tests ask pip itself, offline: a new environment sees every dependency that this one has
installed except torch and torchvision (its .pth file names a folder of links to this site-packages,
less their metadata), holds those two at the versions a test gives (bare `.dist-info` folders), and a
folder of metadata-only wheels offers releases below, inside and above the range, each torchvision
asking for its torch as the real ones do. `pip install --dry-run --report` of the project then says
what pip would install there, without downloading anything or changing either environment.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
# torchvision's releases name their torch: 0.25.0 `torch (==2.10.0)`, 0.29.1 `torch (>=2.14.0)`, and
# 0.29.2, released with torch 2.15.0 and built for it, `torch (>=2.14.0)` as well. torch 2.16.0 and
# torchvision 0.30.0 stand for releases newer than the range; they exist here as metadata only.
TORCH_OF = {
    "0.24.1": "==2.9.1",
    "0.25.0": "==2.10.0",
    "0.27.0": "==2.12.0",
    "0.29.1": ">=2.14.0",
    "0.29.2": ">=2.14.0",
    "0.30.0": ">=2.16.0",
}
OFFERED = {
    "torch": ["2.9.1", "2.12.0", "2.14.1", "2.15.0", "2.16.0"],
    "torchvision": ["0.24.1", "0.27.0", "0.29.1", "0.29.2", "0.30.0"],
}


def metadata(name: str, version: str) -> str:
    requires = f"Requires-Dist: torch{TORCH_OF[version]}\n" if name == "torchvision" else ""
    return f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}"


def offer_wheels(folder: Path) -> Path:
    """Wheels that carry only their metadata: enough for pip to choose among them."""
    folder.mkdir()
    for name, versions in OFFERED.items():
        for version in versions:
            info = f"{name}-{version}.dist-info"
            with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
                wheel.writestr(f"{info}/METADATA", metadata(name, version))
                wheel.writestr(
                    f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                )
                wheel.writestr(f"{info}/RECORD", "")
    return folder


def environment_with(tmp_path: Path, installed: dict[str, str]) -> Path:
    """A venv that holds torch and torchvision only as `installed` says (metadata alone) and sees
    everything else this environment has installed."""
    others = tmp_path / "others"  # this site-packages less torch's and torchvision's metadata
    others.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not re.fullmatch(r"torch(vision)?-[^-]+\.dist-info", entry.name):
            (others / entry.name).symlink_to(entry)
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "others.pth").write_text(f"{others}\n")
    for name, version in installed.items():
        (Path(site) / f"{name}-{version}.dist-info").mkdir()
        (Path(site) / f"{name}-{version}.dist-info" / "METADATA").write_text(metadata(name, version))
    return python


def pip_dry_run(tmp_path: Path, installed: dict[str, str], *also: str) -> subprocess.CompletedProcess:
    """`pip install --dry-run ssl-vit [ALSO...]` into an environment holding `installed`; its report,
    on success, in tmp_path/report.json."""
    tmp_path.mkdir(exist_ok=True)
    python = environment_with(tmp_path, installed)
    project = tmp_path / "project"  # what pip reads to build ssl-vit's metadata, nothing written in ROOT
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (project / name).write_bytes((ROOT / name).read_bytes())
    # No pip.conf or PIP_* variable of this machine (a cap on torch, other indexes) takes part; the
    # build runs on this environment's setuptools (77 or newer, as pyproject's build-system asks and
    # the constraints file pins), so no index is asked at all.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    wheels = offer_wheels(tmp_path / "wheels")
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--dry-run", "--quiet",
         "--report", tmp_path / "report.json", "--no-index", "--find-links", wheels,
         "--no-build-isolation", project, *also],
        env={**env, "PIP_CONFIG_FILE": os.devnull}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def would_install(tmp_path: Path, installed: dict[str, str], *also: str) -> dict[str, str]:
    """{name: version} that pip would install besides ssl-vit itself."""
    proc = pip_dry_run(tmp_path, installed, *also)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    chosen = {item["metadata"]["name"]: item["metadata"]["version"] for item in report["install"]}
    assert chosen.pop("ssl-vit")
    return chosen


@pytest.mark.slow
@pytest.mark.parametrize(
    "torch, torchvision",
    [("2.10.0", "0.25.0"), ("2.14.1", "0.29.1"), ("2.15.0", "0.29.2")],
    ids=["oldest-tested", "pinned", "newest-tested"],
)
def test_a_torch_inside_the_range_is_left_in_place(tmp_path, torch, torchvision):
    # Newer releases inside the range are on offer; pip still keeps what the environment has.
    assert would_install(tmp_path, {"torch": torch, "torchvision": torchvision}) == {}


@pytest.mark.slow
@pytest.mark.parametrize(
    "torch, torchvision", [("2.9.1", "0.24.1"), ("2.16.0", "0.30.0")], ids=["older", "newer-untested"]
)
def test_a_torch_outside_the_range_is_replaced_by_one_inside(tmp_path, torch, torchvision):
    installed = {"torch": torch, "torchvision": torchvision}
    assert would_install(tmp_path, installed) == {"torch": "2.15.0", "torchvision": "0.29.2"}


@pytest.mark.slow
def test_a_torch_without_torchvision_stays_when_the_command_names_it(tmp_path):
    # The newest torchvision wants a newer torch, and pip would take both; naming the installed
    # torch (the README's command) makes pip choose the torchvision that fits it instead.
    alone = {"torch": "2.12.0"}
    assert would_install(tmp_path / "plain", alone) == {"torch": "2.15.0", "torchvision": "0.29.2"}
    assert would_install(tmp_path / "named", alone, "torch==2.12.0") == {"torchvision": "0.27.0"}


@pytest.mark.slow
def test_naming_a_torch_outside_the_range_stops_with_pip_s_conflict(tmp_path):
    proc = pip_dry_run(tmp_path, {"torch": "2.9.1", "torchvision": "0.24.1"}, "torch==2.9.1")
    assert proc.returncode == 1 and "conflicting dependencies" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "report.json").exists()


def make(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *arguments], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_make_install_installs_through_the_constraints_file(tmp_path):
    venv_dir = tmp_path / "venv"  # make's VENV, so that .venv is neither read nor written
    dry = make("-n", "-B", "install", f"VENV={venv_dir}")
    assert dry.returncode == 0, dry.stderr
    installs = [line for line in dry.stdout.splitlines() if "pip install" in line and "-e '.[dev]'" in line]
    assert installs == [
        f"{venv_dir}/bin/python -m pip install --quiet -c requirements/constraints.txt -e '.[dev]'"
    ]
    # An installed stamp is current until pyproject.toml or the constraints file is newer than it.
    venv_dir.mkdir()
    (venv_dir / ".installed").touch()
    assert make("-q", "install", f"VENV={venv_dir}").returncode == 0
    for changed in ("requirements/constraints.txt", "pyproject.toml"):
        assert make("-q", "-W", changed, "install", f"VENV={venv_dir}").returncode == 1, changed


def test_the_constraints_file_is_what_this_environment_runs_with():
    """CI's .venv was installed through the file: rewriting it from there changes nothing, unless a
    dependency was added to pyproject.toml (or a pin moved in .venv) without `make constraints`."""
    pinned_for = re.search(r'python_version == "([\d.]+)"', CONSTRAINTS.read_text()).group(1)
    if pinned_for != "{}.{}".format(*sys.version_info[:2]):
        pytest.skip(f"the constraints file pins what ran on Python {pinned_for}")
    written = subprocess.run(
        [sys.executable, ROOT / "requirements" / "freeze.py"], capture_output=True, text=True, check=True
    ).stdout
    assert written == CONSTRAINTS.read_text(), (
        "run `make constraints` and commit requirements/constraints.txt"
    )
