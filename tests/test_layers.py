"""The layers show in the folders: core imports none of the others, server and client meet
only through the protocol and the store, the simulation wraps them from outside, the CLI
sits on top. Checked by parsing every import (lazy ones inside functions included)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {  # folder: (package, the fedrl packages it may import)
    "fedrl": ("fedrl", set()),
    "strategies": ("fedrl.strategies", {"fedrl"}),
    "clients": ("fedrl.clients", {"fedrl"}),
    "sim": ("fedrl.sim", {"fedrl", "fedrl.strategies", "fedrl.clients"}),
    "deploy": ("fedrl.deploy", {"fedrl"}),  # starts the real apps as processes: imports neither
    "volunteer": ("fedrl.volunteer", {"fedrl", "fedrl.clients", "fedrl.deploy"}),  # runs a client
    "cli": (
        "fedrl.cli",
        {"fedrl", "fedrl.strategies", "fedrl.clients", "fedrl.sim", "fedrl.deploy", "fedrl.volunteer"},
    ),
}
PACKAGES = {package for package, _ in LAYERS.values()}


def layer_of(module: str) -> str | None:
    """The layer package a `fedrl...` module belongs to (the longest matching prefix)."""
    matches = [p for p in PACKAGES if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" and node.args:
            if isinstance(node.args[0], ast.Constant):
                names.append(node.args[0].value)
    return [n for n in names if n.startswith("fedrl")]


@pytest.mark.parametrize("folder", list(LAYERS))
def test_imports_obey_the_layers(folder):
    package, allowed = LAYERS[folder]
    wrong = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imports(path):
            layer = layer_of(name)
            if layer not in {package} | allowed:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_lazy_and_from_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from fedrl.sim import link\n    __import__('fedrl.clients.client_app')\n")
    assert {layer_of(n) for n in imports(path)} == {"fedrl.sim", "fedrl.clients"}
