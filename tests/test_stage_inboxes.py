"""Router and writer stages in-process: a malformed message on their wakeup socket is
logged, counted and skipped (pipeline/wire/sockets.py Inbox), never raised out of step()."""

from __future__ import annotations

import pytest
import zmq
from broker import write_config
from conftest import wait_for

from config import load_settings
from pipeline import wire
from pipeline.datadir import DataDir
from pipeline.topology import internal_address
from router.router_stage import RouterStage
from router.writer_stage import WriterStage


@pytest.mark.parametrize("stage_class", [RouterStage, WriterStage])
def test_a_malformed_wakeup_is_counted_and_skipped(tmp_path, stage_class):
    settings = load_settings(write_config(tmp_path))
    DataDir(settings.data_path).ensure()
    stage = stage_class(settings, 0)
    stage.open()
    context = zmq.Context()
    sender = wire.open_socket(
        context,
        zmq.PUSH,
        send_timeout_ms=5000,
        connect=internal_address(settings, f"{stage.name}-0"),
    )
    try:
        sender.send_multipart([b"not a message"])

        def skipped() -> bool:
            stage.step(1000.0)
            return stage.wakeups.dropped == 1

        wait_for(skipped, f"the {stage.name} to skip the malformed wakeup", 10)
        stage.step(1000.0)  # and it goes on stepping
    finally:
        sender.close(0)
        context.term()
        stage.close()
