"""No module of ``broker_lookup`` or ``workers`` imports pickle or a pickling library,
and none calls ``torch.load``/``torch.save`` (they pickle by default): nothing read
from Redis or disk can ever execute code when decoded."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BANNED = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}


def offences(path: Path) -> list[str]:
    """``line name`` of every banned import or torch.load/save call in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in ("load", "save")
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            names = ["torch." + node.attr]
        found += [
            f"{getattr(node, 'lineno', 0)} {n}"
            for n in names
            if n in BANNED or n.startswith("torch.")
        ]
    return found


def test_no_module_imports_pickle() -> None:
    paths = sorted([*(ROOT / "broker_lookup").rglob("*.py"), *(ROOT / "workers").rglob("*.py")])
    assert len(paths) > 20  # the walk found the packages
    hits = {str(p.relative_to(ROOT)): offences(p) for p in paths}
    assert {p: h for p, h in hits.items() if h} == {}


def test_the_check_catches_what_it_must(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nfrom dill import loads\nimport os.path\nimport torch\ntorch.load('x')\n"
    )
    assert offences(bad) == ["1 pickle", "2 dill", "5 torch.load"]
