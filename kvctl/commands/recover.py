"""kvctl recover: turn what a killed recorder left behind into a readable recording."""

from __future__ import annotations

import click

from ..help import KvctlCommand
from ..text import plural


@click.command("recover", cls=KvctlCommand)
@click.argument("path", type=click.Path(exists=False))
@click.option("--json", "as_json", is_flag=True, help="Print the recovered recording's summary "
                                                      "as one JSON object.")
def command(path: str, as_json: bool) -> None:
    """Convert the journal of a recorder that was killed (kill -9, power loss) to Parquet.

    PATH is the journal (run.parquet.journal), the recording path it belongs to (run.parquet),
    or a segment directory. Everything flushed before the crash (at most the last second is
    lost) comes back; a torn last write is dropped.

    \b
    Example:
      kvctl recover run.parquet
      kvctl recover segments/ && kvctl inspect segments/
    """
    from ..errors import TransportError
    from ..output import dumps
    from ..transports.files import recording_info, recover

    try:
        recovered = recover(path)
        info = recording_info(recovered)
    except FileNotFoundError as exc:
        raise TransportError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise TransportError(f"{path}: cannot recover: {exc}") from None
    if as_json:
        click.echo(dumps({"path": str(recovered), **info}))
    else:
        click.echo(f"kvctl: recovered {recovered}: {plural(info.get('batches', 0), 'batch')}, "
                   f"{plural(info.get('events', 0), 'event')}, {info.get('malformed', 0)} "
                   "malformed",
                   err=True)
