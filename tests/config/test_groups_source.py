"""config/groups.py declares each setting once per group: a second declaration of a dataclass field
silently replaces the first (Python keeps the last), so a merge that repeats one goes unseen at run time."""

import ast
from collections import Counter
from pathlib import Path

import slime_rl.config.groups as groups


def test_every_group_field_is_declared_once():
    tree = ast.parse(Path(groups.__file__).read_text())
    repeated = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names = Counter(s.target.id for s in cls.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
        repeated |= {f"{cls.name}.{n}": c for n, c in names.items() if c > 1}
    assert not repeated, repeated
