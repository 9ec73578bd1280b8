"""``stalwart lighthouse``: run the lighthouse server in the foreground.

Also runnable as ``python -m stalwart.cli.lighthouse``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from stalwart.coord.persist import read_plan
from stalwart.coord.server import Lighthouse
from stalwart.data.plan import EpochPlan

_PLAN_OPTIONS = {
    "dataset_size": ("--dataset-size", "dataset_size"),
    "global_batch": ("--global-batch", "global_batch_size"),
    "seed": ("--seed", "seed"),
    "multiple": ("--multiple", "local_batch_multiple"),
    "drop_last": ("--drop-last", "drop_last"),
    "no_shuffle": ("--no-shuffle", "shuffle"),
}


@click.command("lighthouse")
@click.option("--min-replicas", type=click.IntRange(min=1), required=True, help="Fewest members a quorum may have.")
@click.option(
    "--start-replicas",
    type=click.IntRange(min=1),
    default=None,
    help="Members the first quorum waits for, up to --join-timeout (default: --min-replicas).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (HTTP and TCPStore).")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True, help="HTTP port (0: a free one).")
@click.option("--store-port", type=click.IntRange(0, 65535), default=0, show_default=True, help="TCPStore port.")
@click.option(
    "--state",
    "state_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="SQLite file holding the state; a restarted lighthouse resumes from it.",
)
@click.option("--token", envvar="STALWART_LIGHTHOUSE_TOKEN", help="Bearer token every request must carry.")
@click.option(
    "--heartbeat-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
    help="Seconds of silence after which a member is dead.",
)
@click.option(
    "--join-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds a quorum waits for members that have not asked.",
)
@click.option("--dataset-size", type=click.IntRange(min=1), help="Samples in the dataset.")
@click.option("--global-batch", type=click.IntRange(min=1), help="Samples per step.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Shuffle seed.")
@click.option("--multiple", type=click.IntRange(min=1), default=1, show_default=True, help="local_batch_multiple.")
@click.option("--drop-last", is_flag=True, help="Skip the tail shorter than a step.")
@click.option("--no-shuffle", is_flag=True, help="Keep the dataset's order.")
def lighthouse_command(
    min_replicas: int,
    start_replicas: int | None,
    host: str,
    port: int,
    store_port: int,
    state_path: Path | None,
    token: str | None,
    heartbeat_timeout: float,
    join_timeout: float,
    **plan_options: Any,
) -> None:
    """Serve membership, quorums and the data ledger to the workers of one job.

    The ledger follows the plan given by the dataset options; when --state
    holds a persisted state, its plan is used and an option that contradicts
    it is an error.
    """
    plan = _plan(click.get_current_context(), state_path, plan_options)
    try:
        lighthouse = Lighthouse(
            plan,
            min_replicas=min_replicas,
            start_replicas=start_replicas,
            host=host,
            port=port,
            state_path=state_path,
            token=token,
            heartbeat_timeout=heartbeat_timeout,
            join_timeout=join_timeout,
            store_port=store_port,
        )
        lighthouse.start()
    except (OSError, ValueError, RuntimeError) as error:
        raise click.ClickException(str(error)) from error
    click.echo(f"lighthouse listening on {lighthouse.url} store {host}:{lighthouse.store_port}")
    lighthouse.serve_forever()


def _plan(context: click.Context, state_path: Path | None, options: dict[str, Any]) -> EpochPlan:
    """The persisted plan (checked against options given explicitly), else the plan the options describe."""
    wanted = {field: options[name] for name, (_, field) in _PLAN_OPTIONS.items()}
    wanted["shuffle"] = not options["no_shuffle"]
    persisted = read_plan(state_path) if state_path is not None else None
    if persisted is None:
        if options["dataset_size"] is None or options["global_batch"] is None:
            raise click.UsageError("--dataset-size and --global-batch are required unless --state holds a state")
        try:
            return EpochPlan(**wanted)
        except (TypeError, ValueError) as error:
            raise click.UsageError(str(error)) from error
    saved = persisted.to_dict()
    for name, (flag, field) in _PLAN_OPTIONS.items():
        given = context.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
        if given and wanted[field] != saved[field]:
            raise click.UsageError(
                f"{flag} says {field}={wanted[field]!r} but the state in {state_path} has {field}={saved[field]!r}"
            )
    return persisted


if __name__ == "__main__":
    lighthouse_command(prog_name="stalwart lighthouse")
