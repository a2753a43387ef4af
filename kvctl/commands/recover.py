"""kvctl recover: turn what a killed recorder left behind into a readable recording."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..help import KvctlCommand
from ..options import reporting
from ..text import plural

if TYPE_CHECKING:
    from ..output import Output


@click.command("recover", cls=KvctlCommand)
@click.argument("path", type=click.Path(exists=False))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    help="Write the recovered recording here (a new file) instead of the journal's "
    "own recording path, e.g. when that path already holds another recording.",
)
@reporting("No summary on stderr (errors excepted).")
def command(path: str, output: str | None, out: Output) -> None:
    """Convert the journal of a recorder that was killed (kill -9, power loss) to Parquet.

    PATH is the journal (run.parquet.journal), the recording path it belongs to (run.parquet),
    or a segment directory. Everything flushed before the crash (at most the last second is
    lost) comes back; a torn last write is dropped. Nothing is replaced: if the recording path
    already holds another file, recover refuses (exit 1) and keeps the journal; give -o. A
    file that is not a kvctl journal is refused and left untouched. The journal is removed
    only once the complete recording is in place.

    \b
    Example:
      kvctl recover run.parquet
      kvctl recover run.parquet.journal -o run-recovered.parquet
      kvctl recover segments/ && kvctl inspect segments/
    """
    from ..errors import TransportError
    from ..recording.disk import OutputExists
    from ..recording.info import recording_info
    from ..recording.journal import NotAJournal
    from ..recording.layout import NotARecording
    from ..recording.recover import RecorderRunning, recover

    try:
        recovered = recover(path, output)
        info = recording_info(recovered)
    except (NotAJournal, NotARecording, OutputExists, RecorderRunning, FileNotFoundError) as exc:
        raise TransportError(str(exc)) from None
    except OSError as exc:  # e.g. the disk is still full: the journal stays where it was
        why = exc.strerror or exc
        raise TransportError(
            f"{path}: cannot recover: {why} (the journal is kept; -o NEW.parquet writes elsewhere)"
        ) from None
    except ValueError as exc:
        raise TransportError(f"{path}: cannot recover: {exc}") from None
    if out.as_json:
        out.json({"path": str(recovered), **info})
    elif not out.quiet:
        click.echo(
            f"kvctl: recovered {recovered}: {plural(info.get('batches', 0), 'batch')}, "
            f"{plural(info.get('events', 0), 'event')}, {info.get('malformed', 0)} "
            "malformed",
            err=True,
        )
