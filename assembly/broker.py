"""The broker composed: the supervisor with its stages, rings and the housekeeping of the
upper floors (`python run.py --config FILE` runs it).

| handed to the supervisor | from                                                         |
|--------------------------|--------------------------------------------------------------|
| stages                   | the stage table, assembly/stages.py                          |
| rings                    | pipeline/transport/topology.py                                         |
| `check_files`            | every model's tokenizer loads (ingest/tokenize.py)           |
| `after_recovery`         | isolate damaged input segments, end lost items (collector/losses.py) |
| `collector`              | removes finished segment files (collector/segments.py)       |
"""

from __future__ import annotations

from assembly.stages import stage_specs
from collector.losses import after_recovery
from collector.segments import SegmentCollector
from ingest.tokenize import load_tokenizers
from pipeline.core.errors import ConfigError, FabricError
from pipeline.process.housekeeping import Housekeeping
from pipeline.process.supervisor import Supervisor
from pipeline.transport.topology import ring_specs


def check_tokenizers(settings) -> None:
    """ConfigError when a model's tokenizer file does not load, as the tokenizer stages
    would load it (so the broker says why at start instead of a stage dying in a loop)."""
    try:
        load_tokenizers(settings)
    except FabricError as exc:
        raise ConfigError(f"[[models]] tokenizer: {exc}") from None


def broker_supervisor(settings) -> Supervisor:
    """The supervisor of a whole broker with `settings` (not yet started)."""
    housekeeping = Housekeeping(
        check_files=check_tokenizers,
        after_recovery=after_recovery,
        collector=SegmentCollector(settings.collector.interval_s),
    )
    return Supervisor(settings, stage_specs(settings), ring_specs(settings), housekeeping)
