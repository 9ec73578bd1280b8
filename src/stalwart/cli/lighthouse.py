"""``stalwart lighthouse``: run the lighthouse server in the foreground.

Also runnable as ``python -m stalwart.cli.lighthouse``.
"""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from stalwart.coord.connections import HEADER_TIMEOUT
from stalwart.coord.persist import StateLockedError, read_ledger, read_plan
from stalwart.coord.server import Lighthouse
from stalwart.coord.settings import MAX_UNAUTHENTICATED, LighthouseSettings
from stalwart.coord.tls import ExposedSecretError, check_private
from stalwart.data.plan import EpochPlan
from stalwart.errors import InsecureLighthouseError

_PLAN_OPTIONS = {
    "dataset_size": ("--dataset-size", "dataset_size"),
    "global_batch": ("--global-batch", "global_batch_size"),
    "seed": ("--seed", "seed"),
    "multiple": ("--multiple", "local_batch_multiple"),
    "drop_last": ("--drop-last", "drop_last"),
    "no_shuffle": ("--no-shuffle", "shuffle"),
    "block_size": ("--block-size", "block_size"),
    "window": ("--window", "window"),
}
_MALFORMED_STATE = (sqlite3.Error, AttributeError, KeyError, TypeError, ValueError)
"""What reading a file that is not a lighthouse state, or a damaged one, raises."""
_TOKEN_HINT = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'


def _existing_parent(context: click.Context, parameter: click.Parameter, path: Path | None) -> Path | None:
    """Refuse a state file in a directory that does not exist, before SQLite fails on it."""
    if path is not None and not path.parent.is_dir():
        raise click.BadParameter(f"the directory {path.parent} of {path} does not exist")
    return path


def _non_empty(context: click.Context, parameter: click.Parameter, value: str | None) -> str | None:
    """Refuse an empty string, which would otherwise mean a different thing (no token) or fail later (no host)."""
    if value is not None and not value.strip():
        hint = f"; generate a token with {_TOKEN_HINT}" if parameter.name == "token" else ""
        raise click.BadParameter(f"must not be empty{hint}")
    return value


@click.command("lighthouse")
@click.option(
    "--min-replicas",
    type=click.IntRange(min=1),
    required=True,
    help="Fewest members the job starts with (or restarts with from a checkpoint); the survivors of a failure "
    "carry on below it until restarted members join.",
)
@click.option(
    "--start-replicas",
    type=click.IntRange(min=1),
    default=None,
    help="Members the first quorum waits for, up to --join-timeout (default: --min-replicas).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    callback=_non_empty,
    help="Address to bind. Any other than loopback needs a token and --tls-cert/--tls-key, or --insecure.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="HTTP(S) port (0: a free one); the quorum's store is served there too.",
)
@click.option(
    "--state",
    "state_path",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=_existing_parent,
    help="SQLite file holding the state, created when missing; a restarted lighthouse resumes from it.",
)
@click.option(
    "--token",
    envvar="STALWART_LIGHTHOUSE_TOKEN",
    callback=_non_empty,
    help="Bearer token every request must carry. Prefer the STALWART_LIGHTHOUSE_TOKEN environment variable or "
    "--token-file: a command line is visible to every user of the machine (ps). Without a token, requests are not "
    f"checked (loopback only, unless --insecure). Generate one with: {_TOKEN_HINT}",
)
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A file holding the bearer token (its first line), instead of --token; readable by its owner only "
    "(chmod 600), as ssh wants a key.",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="Serve a --host other than loopback without a token or without TLS, on a network you trust: anyone who "
    "reaches the port (or, without TLS, reads the traffic) drives the job.",
)
@click.option(
    "--tls-cert", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="PEM certificate (chain)."
)
@click.option(
    "--tls-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="PEM private key of --tls-cert, readable by its owner only (chmod 600): the lighthouse serves HTTPS "
    "(workers verify it with STALWART_LIGHTHOUSE_CA).",
)
@click.option(
    "--heartbeat-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
    help="Seconds of silence after which a member is dead.",
)
@click.option(
    "--header-timeout",
    type=click.FloatRange(min=0, min_open=True, max=3600),
    default=HEADER_TIMEOUT,
    show_default=True,
    help="Seconds a connection has to send a request's headers before it is closed (slow or silent clients).",
)
@click.option(
    "--max-unauthenticated",
    type=click.IntRange(min=1),
    default=MAX_UNAUTHENTICATED,
    show_default=True,
    help="Most connections that may be stalled at once: not yet past the token check, with no complete request "
    "(past it the oldest stalled one is closed; requests already sent, or waiting unread, are not).",
)
@click.option(
    "--join-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds a quorum waits for members that have not asked.",
)
@click.option(
    "--dataset-size",
    type=click.IntRange(min=1),
    help="Samples in the dataset (with --global-batch; without both, the first member's plan is adopted).",
)
@click.option(
    "--global-batch",
    type=click.IntRange(min=1),
    help="Samples per step (with --dataset-size; without both, the first member's plan is adopted).",
)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Shuffle seed.")
@click.option(
    "--multiple",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="local_batch_multiple: members' shares of a step are dealt in chunks of this many samples.",
)
@click.option("--drop-last", is_flag=True, help="Skip the tail shorter than a step.")
@click.option("--no-shuffle", is_flag=True, help="Keep the dataset's order.")
@click.option(
    "--balance-every",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Straggler relief: every this many steps the members re-weigh their shares by measured throughput, "
    "in chunks of --multiple (0: equal shares).",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Shuffle in blocks of this many consecutive samples (a Parquet row group): a member reads whole blocks.",
)
@click.option(
    "--window",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Blocks whose order is shuffled together; windows are shuffled too (1 and 1: the global shuffle).",
)
def lighthouse_command(
    min_replicas: int,
    start_replicas: int | None,
    host: str,
    port: int,
    state_path: Path | None,
    token: str | None,
    token_file: Path | None,
    insecure: bool,
    tls_cert: Path | None,
    tls_key: Path | None,
    heartbeat_timeout: float,
    header_timeout: float,
    max_unauthenticated: int,
    join_timeout: float,
    balance_every: int,
    **plan_options: Any,
) -> None:
    """Serve membership, quorums and the data ledger to the workers of one job.

    The ledger follows the plan given by the dataset options (--dataset-size
    and --global-batch, with --seed, --multiple, --drop-last, --no-shuffle,
    --block-size, --window). Without them the lighthouse adopts the plan the
    first worker registers with (the Manager's plan) and persists it; a worker
    with another plan is refused, naming each differing field. When --state
    holds a persisted state, its plan is used and an option that contradicts
    it is an error.

    A quorum needs --min-replicas members to start the job; once it trains,
    the survivors of a failure carry on whatever their number, and restarted
    workers join them at the next step.
    """
    if start_replicas is not None and start_replicas < min_replicas:
        raise click.BadParameter(
            f"must be at least --min-replicas ({min_replicas}), got {start_replicas}", param_hint="'--start-replicas'"
        )
    context = click.get_current_context()
    for secret, flag in ((token_file, "--token-file"), (tls_key, "--tls-key")):
        if secret is not None:
            try:
                check_private(secret, flag)
            except ExposedSecretError as error:
                raise click.ClickException(str(error)) from None
    token = _token(context, token, token_file)
    if (tls_cert is None) != (tls_key is None):
        missing = "--tls-key" if tls_key is None else "--tls-cert"
        raise click.UsageError(f"--tls-cert and --tls-key go together: {missing} is missing")
    plan = _plan(click.get_current_context(), state_path, plan_options)
    balance = _balance(click.get_current_context(), state_path, balance_every)
    try:
        settings = LighthouseSettings(
            min_replicas=min_replicas,
            start_replicas=start_replicas,
            host=host,
            port=port,
            state_path=state_path,
            token=token,
            heartbeat_timeout=heartbeat_timeout,
            header_timeout=header_timeout,
            max_unauthenticated=max_unauthenticated,
            join_timeout=join_timeout,
            balance_every=balance,
            insecure=insecure,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
        lighthouse = Lighthouse(plan, settings)
    except (InsecureLighthouseError, StateLockedError, ExposedSecretError) as error:
        raise click.ClickException(str(error)) from error
    except _MALFORMED_STATE as error:
        # The arguments are checked above: what is left to fail is reading the persisted state.
        if state_path is None:
            raise click.ClickException(str(error)) from error
        raise _unusable_state(state_path, error) from error
    try:
        lighthouse.start()
    except OSError as error:
        raise _listen_error(error, host, {"--port": port}) from error
    except RuntimeError as error:
        raise click.ClickException(str(error)) from error
    click.echo(f"lighthouse listening on {lighthouse.url}")
    if plan is None:
        click.echo("no plan given: the first worker's plan (dataset size, global batch, ...) is adopted")
    lighthouse.serve_forever()


def _token(context: click.Context, token: str | None, token_file: Path | None) -> str | None:
    """The token from --token (or its environment variable) or --token-file; a warning when it is on the command
    line, where every user of the machine can read it."""
    if token_file is not None:
        if token is not None:
            raise click.UsageError("--token-file and --token (or STALWART_LIGHTHOUSE_TOKEN) are exclusive: give one")
        lines = token_file.read_text(encoding="utf-8").splitlines()
        token = lines[0].strip() if lines else ""
        if not token:
            raise click.BadParameter(
                f"{token_file} holds no token; generate one with {_TOKEN_HINT}", param_hint="'--token-file'"
            )
    elif token is not None and context.get_parameter_source("token") == ParameterSource.COMMANDLINE:
        click.echo(
            "warning: --token on the command line is visible to every user of this machine (ps); use the "
            "STALWART_LIGHTHOUSE_TOKEN environment variable or --token-file",
            err=True,
        )
    return token


def _plan(context: click.Context, state_path: Path | None, options: dict[str, Any]) -> EpochPlan | None:
    """The persisted plan (checked against options given explicitly), else the plan the options describe, else
    None (the first member's is adopted)."""
    wanted = {field: options[name] for name, (_, field) in _PLAN_OPTIONS.items()}
    wanted["shuffle"] = not options["no_shuffle"]
    persisted = _persisted_plan(state_path) if state_path is not None else None
    if persisted is None:
        size, batch = options["dataset_size"], options["global_batch"]
        if size is None and batch is None:
            given = [flag for name, (flag, _) in _PLAN_OPTIONS.items() if _given(context, name)]
            if given:
                raise click.UsageError(
                    f"{', '.join(given)} describe a plan: give --dataset-size and --global-batch too, or none of "
                    "them to adopt the plan of the first worker"
                )
            return None
        if size is None or batch is None:
            missing = "--dataset-size" if size is None else "--global-batch"
            raise click.UsageError(
                f"--dataset-size and --global-batch go together: {missing} is missing (or give neither, to adopt "
                "the plan of the first worker)"
            )
        try:
            return EpochPlan(**wanted)
        except (TypeError, ValueError) as error:
            raise click.UsageError(str(error)) from error
    saved = persisted.to_dict()
    for name, (flag, field) in _PLAN_OPTIONS.items():
        if _given(context, name) and wanted[field] != saved[field]:
            raise click.UsageError(
                f"{flag} says {field}={wanted[field]!r} but the state in {state_path} has {field}={saved[field]!r}"
            )
    return persisted


def _given(context: click.Context, name: str) -> bool:
    """Whether option ``name`` was given (on the command line or by its environment variable)."""
    return context.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)


def _balance(context: click.Context, state_path: Path | None, balance_every: int) -> int | None:
    """``--balance-every`` for a new state; None (the persisted setting) when --state holds one it must agree with."""
    if state_path is None:
        return balance_every
    try:
        ledger = read_ledger(state_path)
    except StateLockedError as error:
        raise click.ClickException(str(error)) from error
    except _MALFORMED_STATE as error:
        raise _unusable_state(state_path, error) from error
    if ledger is None:
        return balance_every
    saved = ledger.get("balance", {}).get("every", 0)
    if _given(context, "balance_every") and balance_every != saved:
        raise click.UsageError(
            f"--balance-every says balance_every={balance_every} but the state in {state_path} has "
            f"balance_every={saved}"
        )
    return None


def _persisted_plan(path: Path) -> EpochPlan | None:
    """The plan persisted in ``path`` (None when it holds no state); a file that is no lighthouse state is refused."""
    try:
        return read_plan(path)
    except StateLockedError as error:
        raise click.ClickException(str(error)) from error
    except _MALFORMED_STATE as error:
        raise _unusable_state(path, error) from error


def _unusable_state(path: Path, error: Exception) -> click.ClickException:
    """One sentence: which file, why it cannot be resumed from, and what to do instead."""
    return click.ClickException(
        f"{path} is not a stalwart lighthouse state or cannot be read ({type(error).__name__}: {error}); "
        "point --state at a new file, or remove this one if its state is not needed"
    )


def _listen_error(error: OSError, host: str, ports: dict[str, int]) -> click.ClickException:
    """One sentence naming the address that could not be bound (the one in the error when both ports are given)."""
    given = {flag: port for flag, port in ports.items() if port}
    named = {flag: port for flag, port in given.items() if str(port) in str(error)} or given
    shown = f"[{host}]" if ":" in host else host
    where = " or ".join(f"{shown}:{port} ({flag})" for flag, port in named.items()) or host
    if error.errno == errno.EADDRINUSE:
        return click.ClickException(f"{where} is already in use; choose another port, or 0 for a free one")
    return click.ClickException(f"cannot listen on {where}: {error.strerror or error}")


if __name__ == "__main__":
    lighthouse_command(prog_name="stalwart lighthouse")
