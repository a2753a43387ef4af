"""Everything about recordings, one job per module (commands import from the modules; this
package imports nothing, so that ``kvctl --help`` never loads pyarrow):

- :mod:`.schema`: the Parquet columns (``COLUMNS``), the Arrow schema, gap markers;
  :mod:`.tagged_json`: lossless JSON for values no column fits;
  :mod:`.rows` (batches -> rows) and :mod:`.rebuild` (rows -> batches). Pure.
- :mod:`.journal`: the raw journal the recorder appends to (writer, reader, header).
- :mod:`.convert`: journal -> Parquet (re-decoding the frames); :mod:`.converter`: the
  process that does it while recording, and the recorder's handle on it; :mod:`.disk`:
  atomic publishing, temp files, whether a writer still runs.
- :mod:`.layout`: file names, segment directories, the manifest, what may be overwritten.
- :mod:`.writer`: ``RecordingWriter`` (journal, rotation, converter); :mod:`.recover`.
- :mod:`.reader`: ``open_recording``; :mod:`.source`: ``RecordingSource`` for the pipeline;
  :mod:`.info`: what ``kvctl inspect`` shows.
"""
