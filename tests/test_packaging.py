"""What `pip install fedrl` gives a volunteer: a wheel, not the editable tree the tests run on.
setuptools' editable finder maps whole folders (`fedrl` -> fedrl/), so a subpackage missing from
pyproject's `packages`, or a data file missing from `package-data`, works in every test here and
is absent from the wheel. So the wheel is built from the sources, compared with them file by
file, and every module is imported from it alone."""

import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import fedrl

REPO = Path(__file__).parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
NOT_SHIPPED = {"deploy/compose-test.sh", "deploy/compose.host.yml", "deploy/prometheus.Dockerfile"}
NOT_SHIPPED |= {"deploy/prometheus.sh"}  # the compose stack's, run from the repository


def files_under(folder: str) -> list[Path]:
    return [p for p in (REPO / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def source_files() -> dict[str, Path]:
    """Each source file under a package folder, keyed by where the wheel must hold it."""
    files = {}
    for package, folder in SETUPTOOLS["package-dir"].items():
        for path in files_under(folder):
            if path.relative_to(REPO).as_posix() not in NOT_SHIPPED:
                files[f"{package.replace('.', '/')}/{path.relative_to(REPO / folder).as_posix()}"] = path
    return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the sources (setuptools keeps a build/ folder in the tree it builds,
    whose stale files would go into the wheel)."""
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((REPO / name).read_bytes())
    for folder in set(SETUPTOOLS["package-dir"].values()):
        for path in files_under(folder):  # all of it: a package-data glob that takes too much shows
            target = src / path.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, src]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = dist.glob("fedrl-*.whl")
    return built


def test_the_wheel_holds_every_source_file_and_nothing_stale(wheel):
    with zipfile.ZipFile(wheel) as archive:
        shipped = {n for n in archive.namelist() if not n.split("/")[0].endswith(".dist-info")}
        scripts = archive.read(next(n for n in archive.namelist() if n.endswith("entry_points.txt")))
    expected = source_files()
    assert sorted(set(expected) - shipped) == [], "in the sources, not in the wheel"
    assert sorted(shipped - set(expected)) == [], "in the wheel, not in the sources"
    assert "fedrl = fedrl.cli.main:main" in scripts.decode()


def test_every_module_imports_from_the_installed_wheel_alone(wheel, tmp_path):
    # installed inside someone else's repository (a project that vendors its venv)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=u", "-c", "user.email=u@example.org"]
    (tmp_path / "theirs.txt").write_text("not fedrl\n")
    for step in (["init", "-q"], ["add", "theirs.txt"], ["commit", "-q", "-m", "theirs"]):
        subprocess.run([*git, *step], check=True, capture_output=True)
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, wheel]
    done = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    modules = sorted(
        name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for name in source_files()
        if name.endswith(".py") and not name.endswith("/__main__.py")  # that one runs the CLI
    )
    script = f"""
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
from fedrl.deploy.federation import app_config
from fedrl.sim.scenario import load_scenario, shipped
from fedrl.bench.common import code_version
print(json.dumps({{
    "code": code_version(),
    "file": sys.modules["fedrl"].__file__,
    "scenarios": sorted(shipped()),
    "default": load_scenario("default").name,
    "app": len(app_config()),
    "imported": sorted(m for m in sys.modules if m.startswith("fedrl")),
}}))
"""
    # run outside the repository, with the installed copy ahead of the editable one
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    cmd = [sys.executable, "-c", script]
    ran = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    said = json.loads(ran.stdout.strip().splitlines()[-1])
    assert Path(said["file"]).is_relative_to(site), said["file"]
    assert "default" in said["scenarios"] and said["default"] == "default" and said["app"] > 10
    assert set(modules) <= set(said["imported"])
    # installed, it is a version, not the commit of the repository it was installed in
    assert said["code"] == {"version": fedrl.__version__, "commit": None}
