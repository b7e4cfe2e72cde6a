"""docker/Dockerfile, checked statically (no Docker engine on the development machines): its pins must
satisfy slime_rl's own requirements, or the image would fail at `pip install` or, worse, at run time."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()


def build_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(.*)$", DOCKERFILE, flags=re.MULTILINE))


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    return {r.name: r for r in reqs}


def test_pins_satisfy_pyproject():
    args, reqs = build_args(), requirements()
    for arg, package in [("TORCH_VERSION", "torch"), ("MEGATRON_CORE_VERSION", "megatron-core"),
                         ("RAY_VERSION", "ray"), ("SGLANG_VERSION", "sglang")]:
        assert reqs[package].specifier.contains(Version(args[arg])), (arg, args[arg], str(reqs[package]))
    requires_python = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert SpecifierSet(requires_python).contains(Version(args["PYTHON_VERSION"]))


def test_every_build_arg_is_used_and_documented():
    readme = (ROOT / "docker" / "README.md").read_text()
    body = re.sub(r"^ARG .*$", "", DOCKERFILE, flags=re.MULTILINE)
    for arg in build_args():
        assert f"${{{arg}}}" in body or f"${arg}" in body, f"ARG {arg} is never used"
        assert f"`{arg}`" in readme, f"ARG {arg} missing from docker/README.md"


def pip_commands() -> list[str]:
    """Every `pip install` command of the RUN instructions, in order (continuation lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    commands = [c.strip() for line in joined.splitlines() if line.startswith("RUN ") for c in line[4:].split("&&")]
    return [c for c in commands if "pip install" in c]


def test_torch_installed_before_anything_that_could_replace_it_and_slime_rl_last():
    pips = pip_commands()
    assert "torch==${TORCH_VERSION}" in pips[1] and "--index-url" in pips[1]  # right after pip's own upgrade
    sglang = [c for c in pips if "sglang==" in c]
    assert sglang and all("torch==${TORCH_VERSION}" in c for c in sglang)  # SGLang's install keeps the pin
    assert 'pip install -e ".[' in pips[-1]
    assert DOCKERFILE.index("COPY pyproject.toml") < DOCKERFILE.index('pip install -e ".[')
