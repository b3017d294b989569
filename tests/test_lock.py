"""The committed lock (constraints.txt) pins every package both distributions ask for, at a version
their ranges allow, and the venv the tests run in was installed from it: a fresh clone installs
what was tested, whatever the package index has published since."""

from __future__ import annotations

import importlib.metadata
import re
import sysconfig
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def locked(text: str) -> dict[str, Version]:
    """Name -> pinned version; every line that is not a comment must be an exact pin."""
    pins: dict[str, Version] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = PIN.match(line.strip())
        assert match, f"constraints.txt:{n}: {line!r} is not NAME==VERSION (run make lock)"
        pins[canonicalize_name(match.group(1))] = Version(match.group(2))
    return pins


def declared() -> list[Requirement]:
    """Every requirement of both pyproject files, optional extras included."""
    reqs: list[Requirement] = []
    for path in (ROOT / "pyproject.toml", ROOT / "benchmarks" / "pyproject.toml"):
        project = tomllib.loads(path.read_text(encoding="utf-8"))["project"]
        lines = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            lines += extra
        reqs += [Requirement(line) for line in lines]
    return [r for r in reqs if canonicalize_name(r.name) not in {"specpilot", "specpilot-tools"}]


def unmet(pins: dict[str, Version], reqs: list[Requirement]) -> list[str]:
    """The requirements the lock leaves unpinned or pins outside their range."""
    problems = []
    for req in reqs:
        got = pins.get(canonicalize_name(req.name))
        if got is None:
            problems.append(f"{req}: not in the lock")
        elif not req.specifier.contains(got, prereleases=True):
            problems.append(f"{req}: locked at {got}")
    return problems


def test_the_lock_pins_every_declared_requirement_within_its_range() -> None:
    problems = unmet(locked(LOCK.read_text(encoding="utf-8")), declared())
    assert not problems, ("constraints.txt is out of step with pyproject.toml (run make lock): "
                          + "; ".join(problems))


def test_a_lock_missing_a_package_or_out_of_range_is_caught() -> None:
    # Control: the check above can fail.
    pins = locked("numpy==1.20.0\n")
    problems = unmet(pins, [Requirement("numpy>=1.26"), Requirement("redis>=5.0")])
    assert problems == ["numpy>=1.26: locked at 1.20.0", "redis>=5.0: not in the lock"]


def test_the_venv_was_installed_from_the_lock() -> None:
    pins = locked(LOCK.read_text(encoding="utf-8"))
    drift = []
    # What pip installed into the venv's site-packages, not the copies other packages vendor
    # (setuptools puts its own packaging and wheel on sys.path once imported).
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    for dist in importlib.metadata.distributions(path=site):
        name = canonicalize_name(dist.metadata["Name"])
        if name in pins and Version(dist.version) != pins[name]:
            drift.append(f"{name} {dist.version} (locked {pins[name]})")
    assert not drift, ("installed packages differ from constraints.txt; reinstall from the lock "
                       "(rm .venv/.specpilot-setup-*; make setup): " + ", ".join(sorted(drift)))
