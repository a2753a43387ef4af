"""kvctl cat: print a recording exactly as tap prints a live stream."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ..help import KvctlCommand
from ..options import Sources, filter_options, limit_options, output_options
from ..selection import Filters, Limits

if TYPE_CHECKING:
    from ..output import Output


@click.command("cat", cls=KvctlCommand)
@click.argument("sources", nargs=-1, required=True, metavar="RECORDING...")
@filter_options
@limit_options
@output_options
def command(
    sources: tuple[str, ...],
    selection: Filters,
    limits: Limits,
    out: Output,
) -> None:
    """Print the events of recordings (files, segment directories or journals) in recorded
    order, with tap's formatter, filters and stop conditions.

    A dataset (the segments of partitioned recorders, flat or hive, in a directory or
    s3://bucket/prefix) prints in receive-time order, merged across its partitions and
    segments; --worker then skips the files, row groups and rows of other workers unread.

    \b
    Example:
      kvctl cat run.parquet
      kvctl cat run.parquet --json --hash-format string --type BlockRemoved | jq .block_hashes
      kvctl cat segments/ -c 20 --worker 3
      kvctl cat s3://bucket/fleet/ --worker 7 -c 100
    """
    from ..session import stream

    stream(Sources(sources), selection, limits, out)
