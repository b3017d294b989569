"""The two distributions, built as the images build them: the product's wheel (``specpilot``)
holds one import namespace and nothing of the tools; the tools' wheel (``specpilot-tools``) holds
the simulator, the demo and the benchmarks and adds their commands to the CLI.

Each wheel is built offline (no build isolation: setuptools comes with the venv) from a copy of
what its build sees: the product from the vLLM image's build context (its .dockerignore
allow-list), the tools from benchmarks/ (never in the checkout itself, where a build/ folder
would be left among the sources).
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tests.deploy.test_images import context_allow_list

ROOT = Path(__file__).resolve().parents[2]


def build_wheel(source: Path, out: Path) -> zipfile.ZipFile:
    got = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--quiet", "--wheel-dir", str(out), str(source)],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def metadata(wheel: zipfile.ZipFile) -> tuple[list[str], configparser.ConfigParser]:
    """The wheel's Requires-Dist lines and its entry points."""
    info = next(n.split("/")[0] for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    requires = Parser().parsestr(wheel.read(f"{info}/METADATA").decode()).get_all(
        "Requires-Dist") or []
    points = configparser.ConfigParser()
    points.read_string(wheel.read(f"{info}/entry_points.txt").decode())
    return requires, points


@pytest.fixture(scope="module")
def product_wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    context = tmp_path_factory.mktemp("context")
    for name in context_allow_list(ROOT / "deploy" / "docker" / "vllm.Dockerfile"):
        source = ROOT / name
        if source.is_dir():
            # symlinks=True: the namespace's links travel as links, as Docker's COPY keeps them.
            shutil.copytree(source, context / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(source, context / name)
    return build_wheel(context, tmp_path_factory.mktemp("wheel"))


def test_the_product_wheel_is_one_namespace_without_the_tools(
        product_wheel: zipfile.ZipFile) -> None:
    names = product_wheel.namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"specpilot"}, tops
    for module in ("specpilot/controller/cli.py", "specpilot/controller/core/controller.py",
                   "specpilot/engine_plugin/scheduler.py", "specpilot/engine_plugin/policy/view.py",
                   "specpilot/contract/pricing.py", "specpilot/v1/engine_pb2.py",
                   "specpilot/v1/engine.proto", "specpilot/controller/dashboard/static/index.html"):
        assert module in names, module
    assert not [n for n in names if "benchmarks" in n or "/sim/" in n], "the tools are packed"
    requires, points = metadata(product_wheel)
    assert not [r for r in requires if r.split()[0].split(">")[0] in ("tqdm", "matplotlib")]
    assert points["console_scripts"]["specpilot"] == "specpilot.controller.cli:main"
    assert points["vllm.general_plugins"]["specpilot"] == "specpilot.engine_plugin:register"
    assert not points.has_section("specpilot.commands")


def test_the_tools_wheel_holds_the_tools_and_their_commands(tmp_path: Path) -> None:
    # The control for the check above: the same reading finds the tools where they are.
    source = tmp_path / "benchmarks"
    shutil.copytree(ROOT / "benchmarks", source, ignore=shutil.ignore_patterns(
        "__pycache__", "*.pyc", "*.egg-info", "build", "results"))
    wheel = build_wheel(source, tmp_path / "wheel")
    names = wheel.namelist()
    assert "benchmarks/sim/run.py" in names and "benchmarks/demo/cli.py" in names
    assert [n for n in names if n.startswith("benchmarks/scenarios/") and n.endswith(".yaml")]
    assert not [n for n in names if n.startswith("specpilot/")]
    requires, points = metadata(wheel)
    assert "specpilot" in requires and any(r.startswith("tqdm") for r in requires)
    assert dict(points["specpilot.commands"]) == {
        name: f"benchmarks.commands:{name}" for name in ("simulate", "demo", "models", "bench")}
