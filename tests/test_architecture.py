"""The layer contract (pyproject ``[tool.importlinter]``): every module imports only downwards, and none is left out."""

from __future__ import annotations

import re
from pathlib import Path

from importlinter.cli import lint_imports

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _lint(config: Path, capsys) -> tuple[int, str]:
    # In-process (no subprocess start-up); the import graph is small, no cache is written.
    code = lint_imports(config_filename=str(config), no_cache=True, no_logo=True)
    return code, capsys.readouterr().out


def _summary(out: str) -> tuple[int, int]:
    m = re.search(r"Contracts: (\d+) kept, (\d+) broken\.", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def test_layers_only_import_downwards(capsys):
    import tomllib

    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    code, out = _lint(PYPROJECT, capsys)
    assert code == 0, out
    # Every contract of pyproject was checked and kept (not "some number ending in 0 broken").
    assert _summary(out) == (len(contracts), 0), out
    assert all(f"{c['name']} KEPT" in out for c in contracts), out


def test_the_linter_would_catch_an_upward_import(tmp_path, capsys):
    """The same contract with its layers upside down must break: the check above is not vacuous."""
    import tomllib

    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    contract = config["contracts"][0]
    flipped = "\n".join(
        ["[tool.importlinter]", f'root_package = "{config["root_package"]}"', "exclude_type_checking_imports = true",
         "[[tool.importlinter.contracts]]", 'name = "flipped"', 'type = "layers"',
         "layers = [" + ", ".join(f'"{layer}"' for layer in reversed(contract["layers"])) + "]"])
    (tmp_path / "pyproject.toml").write_text(flipped)
    code, out = _lint(tmp_path / "pyproject.toml", capsys)
    assert code != 0 and _summary(out) == (0, 1), out


def test_the_contract_covers_every_module():
    """Every module of src/sinklab sits in a layer, except package facades that only re-export their own modules."""
    import tomllib

    import grimp

    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    layers = [name.strip() for contract in config["contracts"] for layer in contract["layers"]
              for name in layer.replace("|", ":").split(":")]
    graph = grimp.build_graph("sinklab", exclude_type_checking_imports=True, cache_dir=None)
    assert set(layers) <= graph.modules, set(layers) - graph.modules  # no stale names

    def placed(module: str) -> bool:
        return any(module == layer or module.startswith(layer + ".") for layer in layers)

    outside = {}
    for module in sorted(graph.modules):
        if placed(module) or module == "sinklab":  # the root package is the public facade of everything
            continue
        foreign = {m for m in graph.find_modules_directly_imported_by(module) if not m.startswith(module + ".")}
        if foreign or not graph.find_children(module):  # a plain module, or a package that does more than re-export
            outside[module] = sorted(foreign)
    assert not outside, f"modules outside the layer contract (add them to [tool.importlinter]): {outside}"


def test_no_private_names_cross_modules():
    """No module imports another module's ``_private`` name or reads ``module._private`` (``_compat`` is the
    module of transformers internals: it is imported by name, its own names are public)."""
    import ast

    src = PYPROJECT.parent / "src" / "sinklab"
    found = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") and alias.name != "_compat":
                        found.append(f"{path.relative_to(src)}: from {node.module} import {alias.name}")
                    if node.level:
                        modules.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__") and node.value.id != "_compat"):
                found.append(f"{path.relative_to(src)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not found, found
