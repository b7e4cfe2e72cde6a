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


# Read from SGLang 0.5.23's wheel METADATA (`pip download --no-deps sglang==0.5.23`): Requires-Dist
# torch==2.14.1, cuda-python>=13.0, flashinfer_python[cu13]==0.7.2, nvidia-cutlass-dsl[cu13]==4.8.0,
# nvshmem4py-cu13 -- its kernels are CUDA 13 builds
SGLANG_WHEEL = {"0.5.23": {"torch": "2.14.1", "cuda_major": 13}}


def cuda_of_image(image: str) -> tuple[int, int]:
    """nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04 -> (13, 0)."""
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)(?:\.\d+)?-.*", image)
    assert match, f"CUDA_IMAGE {image!r} is not an nvidia/cuda:<major>.<minor>[.<patch>]-... tag"
    return int(match.group(1)), int(match.group(2))


def cuda_of_torch_index(url: str) -> tuple[int, int]:
    """https://download.pytorch.org/whl/cu130 -> (13, 0); cu129 -> (12, 9)."""
    match = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d+)(\d)", url)
    assert match, f"TORCH_INDEX_URL {url!r} is not a PyTorch CUDA index (.../whl/cuXYZ)"
    return int(match.group(1)), int(match.group(2))


def test_base_image_cuda_matches_torch_index_and_sglang():
    args = build_args()
    base = cuda_of_image(args["CUDA_IMAGE"])
    assert base == cuda_of_torch_index(args["TORCH_INDEX_URL"]), (args["CUDA_IMAGE"], args["TORCH_INDEX_URL"])
    wheel = SGLANG_WHEEL[args["SGLANG_VERSION"]]
    assert base[0] == wheel["cuda_major"], f"SGLang {args['SGLANG_VERSION']} needs CUDA {wheel['cuda_major']} packages"
    assert args["TORCH_VERSION"] == wheel["torch"]


def test_our_checks_of_cuda_tags():
    assert cuda_of_image("nvidia/cuda:12.9.1-cudnn-devel-ubuntu24.04") == (12, 9)
    assert cuda_of_torch_index("https://download.pytorch.org/whl/cu129") == (12, 9)
    assert cuda_of_torch_index("https://download.pytorch.org/whl/cu130") == (13, 0)


def test_sglang_pins_are_the_versions_our_launcher_checks_flags_against():
    """--sglang-* / --router-* are checked against flag tables taken from one SGLang / router version
    (slime_rl/engines/*_args.json); the image must ship those versions, and the contract tests' too."""
    import json

    args = build_args()
    engines = ROOT / "slime_rl" / "engines"
    server = json.loads((engines / "sglang_server_args.json").read_text())["program"]
    router = json.loads((engines / "sglang_router_args.json").read_text())["program"]
    assert server.startswith(f"sglang {args['SGLANG_VERSION']} "), server
    assert router.startswith(f"sglang-router {args['SGLANG_ROUTER_VERSION']} "), router
    setup = (ROOT / "launch" / "setup.sh").read_text()
    assert f"SGLANG_VERSION={args['SGLANG_VERSION']}\n" in setup


def test_matplotlib_is_installed_and_imported():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    last = pip_commands()[-1]
    extras = re.search(r'pip install -e "\.\[([^\]]*)\]"', last).group(1).split(",")
    assert any(Requirement(r).name == "matplotlib" for e in extras for r in project["optional-dependencies"][e])
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    assert re.search(r"python -c \"import [^\"]*\bmatplotlib\b", joined)
