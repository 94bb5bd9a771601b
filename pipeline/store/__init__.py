"""Storage: the segment files, records, the data dir and `jobs/`, salvage, recovery and the check. Imports only core.

Rooms of pipeline/ (docs/architecture.md, "Floors"): process > telemetry > store | transport > core,
kept by the import-linter contract in pyproject.toml.

| module              | what |
|---------------------|------|
| `check.py`          | The consistency check of the logs: what `python run.py check` finds in segment files |
| `counter.py`        | A durable counter shared by processes: ids that increase and are never reused |
| `datadir.py`        | The data directory: where each kind of file lives, and who may use it |
| `disk_full.py`      | A full disk, as one stage sees it: one try a second while full, and two log lines |
| `durable.py`        | Durable small writes: a directory's entries synced, a small file replaced whole or not at all |
| `intern_table.py`   | An intern table: each distinct value (a JSON dict) stored once, durably, under a small id |
| `job_files.py`      | The `jobs/` directory: every file in it, who writes it, and the one reader of each |
| `job_record.py`     | The job record, `jobs/<job_id>/job.json`: its fields, its checksum and its one reader |
| `model_names.py`    | What a model name (or an alias, or a vector store's name) may be |
| `records.py`        | Append-only files of checksummed JSON records: the shape table and job journals |
| `recovery.py`       | Recovery: rebuild the queue from the segment markers, and nothing else |
| `salvage.py`        | Isolating a damaged input segment: serve what can be trusted, move the file aside |
| `scan.py`           | Reading a segment file from its markers alone, as recovery and check do |
| `segment.py`        | Segment files: the append-only, memory-mapped log that is the queue |
| `segment_append.py` | Appending to segments: ids handed out once, and the rotating appender a writer keeps |
| `segment_format.py` | The segment file format: layout, header codec, slot dtype and checksum |
"""
