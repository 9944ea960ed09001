"""What every command line of the project shares: `--version`, and `--help` stating each option's default.

Commands start from `argument_parser(module, description)`, run either as `python -m MODULE` or as the console
script pyproject.toml installs for it (`inkling-serve`, ...); usage lines name the form that was run.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "inkling_jax"
SCRIPT_PREFIX = "inkling-"  # every console script's name starts so (pyproject.toml's [project.scripts])


def version() -> str:
    """The installed distribution's version; a note instead when the source tree runs uninstalled."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "(version unknown: not installed)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`(default: ...)` after each option's help, except where there is none to state (None, False, empty) or the
    help states it itself with %(default)s."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if _states_nothing(action.default):
            return action.help
        return super()._get_help_string(action)


class RawDescriptionHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """The same, with the description as written: a module docstring's paragraphs and usage examples."""


def _states_nothing(default: object) -> bool:
    empty = isinstance(default, str | list | tuple) and not default
    return default is None or default is False or default is argparse.SUPPRESS or empty


def argument_parser(module: str, description: str, raw_description: bool = False) -> argparse.ArgumentParser:
    """A parser with `--version` and defaults in its help, named `python -m module` or the console script run;
    `raw_description` keeps the description's line breaks (a whole docstring, as bench's commands show)."""
    script = Path(sys.argv[0]).name
    prog = script if script.startswith(SCRIPT_PREFIX) else f"python -m {module}"
    formatter = RawDescriptionHelpFormatter if raw_description else HelpFormatter
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"{DISTRIBUTION} {version()}")
    return parser
