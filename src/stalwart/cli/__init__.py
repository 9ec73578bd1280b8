"""The ``stalwart`` command line: one module per subcommand, imported only when that subcommand runs.

The subcommands import torch, which takes seconds; ``stalwart --help`` lists
them from the table below without importing any of them.
"""

from __future__ import annotations

import importlib

import click

from stalwart import __version__

SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "audit": ("stalwart.cli.audit", "audit_command", "Check that each epoch in DIRECTORY was consumed exactly once."),
    "demo": ("stalwart.cli.demo", "demo_command", "Train on a local cluster while workers are killed, and report."),
    "lighthouse": ("stalwart.cli.lighthouse", "lighthouse_command", "Serve membership, quorums and the data ledger."),
    "redundancy": (
        "stalwart.cli.redundancy",
        "redundancy_command",
        "Optimizer state per process and the failures it survives.",
    ),
    "simulate": ("stalwart.cli.simulate", "simulate_command", "Run the data ledger with random failures and joins."),
}
"""Subcommand name -> (module, attribute of its ``click.Command``, short help shown by ``stalwart --help``)."""


class LazyGroup(click.Group):
    """A group whose subcommands are imported from :data:`SUBCOMMANDS` only when one is run or its help shown."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every subcommand's name, without importing any."""
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """Import and return the named subcommand; None for an unknown name (click then says so)."""
        if cmd_name not in SUBCOMMANDS:
            return None
        module, attribute, _ = SUBCOMMANDS[cmd_name]
        command: click.Command = getattr(importlib.import_module(module), attribute)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List the subcommands with their short help from the table, so that ``--help`` imports none of them."""
        with formatter.section("Commands"):
            formatter.write_dl([(name, SUBCOMMANDS[name][2]) for name in self.list_commands(ctx)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="stalwart")
def cli() -> None:
    """Fault-tolerant, elastic data-parallel training for PyTorch."""


def main() -> None:
    """Entry point of the ``stalwart`` console script."""
    cli()
