"""The ``stalwart`` command line: one module per subcommand, gathered here."""

from __future__ import annotations

import click

from stalwart import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="stalwart")
def cli() -> None:
    """Fault-tolerant, elastic data-parallel training for PyTorch."""


def _register() -> None:
    from stalwart.cli.audit import audit_command
    from stalwart.cli.demo import demo_command
    from stalwart.cli.lighthouse import lighthouse_command
    from stalwart.cli.simulate import simulate_command

    for command in (audit_command, demo_command, lighthouse_command, simulate_command):
        cli.add_command(command)


_register()


def main() -> None:
    """Entry point of the ``stalwart`` console script."""
    cli()
