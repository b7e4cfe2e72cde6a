"""config/groups.py and config/groups_rollout.py declare each setting once per group: a second declaration
of a dataclass field silently replaces the first (Python keeps the last), so a merge that repeats one goes
unseen at run time."""

import ast
from collections import Counter
from pathlib import Path

import slime_rl.config.groups as groups
import slime_rl.config.groups_rollout as groups_rollout


def test_every_group_field_is_declared_once():
    classes = [n for module in (groups, groups_rollout) for n in ast.parse(Path(module.__file__).read_text()).body
               if isinstance(n, ast.ClassDef)]
    repeated = {}
    for cls in classes:
        names = Counter(s.target.id for s in cls.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
        repeated |= {f"{cls.name}.{n}": c for n, c in names.items() if c > 1}
    assert not repeated, repeated
