"""The console scripts pyproject.toml installs: each names an importable main() that answers `--version` with the
distribution's version and `--help` with its options' defaults, exiting 0 before anything loads. They run in this
process with sys.argv as the installed script (or `python -m`) would set it, calling what [project.scripts] names."""

import importlib
import sys
import tomllib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pytest

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
# script: (its module, one of its options' defaults as --help states it)
COMMANDS = {
    "inkling-serve": ("serving.main", "50051"),
    "inkling-client": ("serving.client", "127.0.0.1:50051"),
    "inkling-generate": ("inkling_jax.generate", "tp1"),
    "inkling-offline": ("inkling_jax.offline", "tp1"),
    "inkling-score": ("inkling_jax.score", "float32"),
    "inkling-complete": ("inkling_jax.complete", "16"),
    "inkling-synthetic": ("inkling_jax.checkpoint.synthetic", "bf16"),
    "inkling-convert": ("inkling_jax.checkpoint.orbax_io", "bfloat16"),
    "inkling-param-count": ("inkling_jax.param_count", "bfloat16"),
    "inkling-image-processor": ("inkling_jax.image_processor", "67108864"),
}


def entry_point(script: str) -> Callable[[], object]:
    module, _, function = SCRIPTS[script].partition(":")
    return getattr(importlib.import_module(module), function)


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, script: str, argv: list[str]) -> str:
    """What `script`'s entry point prints with sys.argv set to `argv`; it must exit with status 0."""
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        entry_point(script)()
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_every_command_has_a_script():
    assert {script: target.partition(":")[0] for script, target in SCRIPTS.items()} == {
        script: module for script, (module, _) in COMMANDS.items()
    }


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_version_is_the_distributions(monkeypatch, capsys, script):
    assert run(monkeypatch, capsys, script, [script, "--version"]) == f"inkling_jax {PYPROJECT['project']['version']}\n"


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_help_states_defaults_and_names_the_command_run(monkeypatch, capsys, script):
    module, default = COMMANDS[script]
    text = " ".join(run(monkeypatch, capsys, script, [script, "--help"]).split())  # unwrapped
    assert text.startswith(f"usage: {script} [-h] [--version]")
    assert f"(default: {default})" in text and "(default: None)" not in text
    as_module = run(monkeypatch, capsys, script, [f"/src/{module.replace('.', '/')}.py", "--help"])  # python -m's argv
    assert as_module.startswith(f"usage: python -m {module} ")


def test_an_uninstalled_tree_still_answers_version(monkeypatch, capsys):
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    out = run(monkeypatch, capsys, "inkling-param-count", ["inkling-param-count", "--version"])
    assert out == "inkling_jax (version unknown: not installed)\n"
