"""The rooms of slime_rl import downward only (ARCHITECTURE.md), and the heavy or cluster-only
packages stay in their room: every import statement of the package is read (module level and
inside functions), so a lazy import against the order fails too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "slime_rl"
# the order written independently of ARCHITECTURE.md's table, which the last test compares with it
ORDER = ["config", "observability", "algo", "data", "rewards", "engines", "rollout", "trainer", "weight_sync",
         "orchestration"]
# the driver, its checks and the command line: may import every room; no room imports them
BOTTOM = {"train", "preflight", "cli"}
# third-party packages and the one room (or module) allowed to import them
CONFINED = {"ray": ("orchestration",), "megatron": ("trainer/mcore.py", "trainer/cpu_compat.py"),
            "sglang": ("engines",), "sglang_router": ("engines",), "verifiers": ("rollout/agent/verifiers_env.py",)}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "slime_rl" and len(parts) > 1 else None


def _imports() -> list[tuple[Path, int, str]]:
    """(file, line, imported module) of every import in the package, relative ones resolved."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        pkg = path.relative_to(ROOT).with_suffix("").parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(path, node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(pkg[: len(pkg) - node.level + 1]) if node.level else ""
                module = ".".join(x for x in (base, node.module or "") if x)
                out.append((path, node.lineno, module))
    return out


def test_every_module_is_in_a_known_room():
    rooms = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.glob("*")
             if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file())}
    assert rooms - {"__init__"} == set(ORDER) | BOTTOM


def test_rooms_import_only_rooms_above_them():
    bad = []
    for path, line, module in _imports():
        src, dst = _room(".".join(path.relative_to(ROOT).with_suffix("").parts)), _room(module)
        if dst is None or src == dst or src in BOTTOM:
            continue
        if dst in BOTTOM or ORDER.index(dst) > ORDER.index(src):
            bad.append(f"{path.relative_to(ROOT)}:{line}: {src} imports {module}")
    assert not bad, "imports against the room order:\n" + "\n".join(bad)


def test_confined_packages_stay_in_their_room():
    bad = []
    for path, line, module in _imports():
        top = module.split(".")[0]
        if top not in CONFINED:
            continue
        where = path.relative_to(PACKAGE).as_posix()
        if not any(where == allowed or where.startswith(allowed + "/") for allowed in CONFINED[top]):
            bad.append(f"slime_rl/{where}:{line}: imports {module}")
    assert not bad, "\n".join(bad)


def test_architecture_md_lists_the_same_order():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    listed = re.findall(r"^\| \d+ \| `(\w+)` \|", text, flags=re.MULTILINE)
    assert listed == ORDER
