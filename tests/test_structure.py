"""The package's structure as tests: the import contracts of pyproject.toml ([tool.importlinter],
run by import-linter's `lint-imports`) hold, break when a module imports across them (a
function-level import included), and cover every module; the generic train step and loop never
name a registered loss."""

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bapo_jax.algorithms import registry

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bapo_jax"
CONFIG = ROOT / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONTRACTS = tomllib.loads(CONFIG.read_text(encoding="utf-8"))["tool"]["importlinter"]["contracts"]
BY_ID = {contract["id"]: contract for contract in CONTRACTS}


def _lint_imports(cwd: Path, config: Path, pythonpath: Path | None = None):
    """`lint-imports` on `config`, run in `cwd` (which it puts first on sys.path)."""
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} missing: pip install -e '.[test]'"
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}  # no wrapped or coloured names
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [str(LINT_IMPORTS), str(config), "--no-cache", "--no-logo"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_contracts_hold():
    result = _lint_imports(ROOT, CONFIG)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in out
    for contract in CONTRACTS:
        assert f"{contract['name']} KEPT" in out


def test_the_contracts_say_what_the_design_says():
    # The rules issue 52 asks for, in case someone edits the config and drops one.
    assert "bapo_jax.kernels" in BY_ID["models"]["forbidden_modules"]
    assert BY_ID["models"]["source_modules"] == ["bapo_jax.models"]
    assert BY_ID["algorithms"]["source_modules"] == ["bapo_jax.algorithms"]
    assert {"bapo_jax.train", "bapo_jax.rollout"} <= set(BY_ID["algorithms"]["forbidden_modules"])
    assert BY_ID["kernels"]["allowed_importers"] == ["bapo_jax.rollout.cpu_kernels"]
    assert BY_ID["layers"]["type"] == "layers"
    assert not any("ignore_imports" in contract for contract in CONTRACTS)  # no exceptions


def _layer_modules() -> list[str]:
    return [
        name.strip()
        for layer in BY_ID["layers"]["layers"]
        for name in layer.replace(":", "|").split("|")
    ]


def test_every_module_is_in_a_layer():
    """A new package (or sharding module) must be placed in the layers: a module in no layer
    would escape the contract. Only the two bare package inits are in none."""
    layers = _layer_modules()
    unplaced = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module in ("bapo_jax", "bapo_jax.sharding"):
            continue
        if not any(module == layer or module.startswith(layer + ".") for layer in layers):
            unplaced.append(module)
    assert unplaced == []


def _copy_package(tmp_path: Path) -> Path:
    """The package's Python files (no assets, no caches) and the config, under tmp_path."""

    def ignore(directory, names):
        return [
            name
            for name in names
            if name == "__pycache__"
            or (not (Path(directory) / name).is_dir() and not name.endswith(".py"))
        ]

    shutil.copytree(PACKAGE, tmp_path / "bapo_jax", ignore=ignore)
    shutil.copy(CONFIG, tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize(
    "added",
    [
        "\nimport bapo_jax.kernels  # noqa\n",
        "\n\ndef _lazy():\n    import bapo_jax.kernels  # noqa\n",
    ],
    ids=["module_level", "inside_a_function"],
)
def test_a_model_importing_the_kernels_breaks_the_contracts(tmp_path, added):
    copy = _copy_package(tmp_path)
    with open(copy / "bapo_jax" / "models" / "layers.py", "a", encoding="utf-8") as f:
        f.write(added)
    result = _lint_imports(copy, copy / "pyproject.toml", pythonpath=copy)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    broken = {BY_ID[i]["name"] for i in ("layers", "models", "kernels")}
    for contract in CONTRACTS:
        verdict = "BROKEN" if contract["name"] in broken else "KEPT"
        assert f"{contract['name']} {verdict}" in out, out
    assert f"Contracts: {len(CONTRACTS) - 3} kept, 3 broken." in out
    # The copy was analysed (the import is only there), and the report names the import.
    assert "bapo_jax.models.layers -> bapo_jax.kernels" in out


# ---------------------------------------------------------------------------------------------
# The generic train step and loop ask the registry and never name a loss.

GENERIC = [PACKAGE / "train" / "step.py", PACKAGE / "train" / "loop.py"]


def _named_losses(source: str, losses: set[str]) -> list[tuple[int, str]]:
    """(line, text) of each place `source` names one of `losses`: a string literal equal to one
    (or with one as a "/"-separated part, as metric keys are), or an identifier equal to one
    (a variable, attribute, argument, keyword, function or imported name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in losses or set(node.value.split("/")) & losses:
                found.append((node.lineno, repr(node.value)))
            continue
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg | ast.keyword):
            names = [node.arg] if node.arg else []
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.alias):
            names = [node.name.rsplit(".", 1)[-1], node.asname or ""]
        for name in names:
            if name in losses:
                found.append((getattr(node, "lineno", 0), name))
    return found


def test_the_registry_has_losses_to_look_for():
    names = set(registry.loss_names())
    assert {"bapo", "ppo_clip", "clip_higher"} <= names


def test_the_loss_name_check_finds_names():
    losses = {"bapo", "ppo_clip"}
    source = (
        "from bapo_jax.algorithms import bapo\n"
        'if config.loss == "ppo_clip":\n'
        "    x = spec.bapo\n"
        'key = "bapo/rho"\n'
        "f(ppo_clip=1)\n"
        '"""BAPO and bapo_jax are prose and a package, not a loss name."""\n'
    )
    assert sorted(_named_losses(source, losses)) == [
        (1, "bapo"),
        (2, "'ppo_clip'"),
        (3, "bapo"),
        (4, "'bapo/rho'"),
        (5, "ppo_clip"),
    ]


@pytest.mark.parametrize("path", GENERIC, ids=lambda p: p.name)
def test_the_train_step_and_loop_never_name_a_loss(path):
    losses = set(registry.loss_names())
    assert _named_losses(path.read_text(encoding="utf-8"), losses) == []
