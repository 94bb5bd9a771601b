"""Error and budget caps over HTTP, with the official openai client unchanged: a batch with
`metadata.fabric_max_error_rate` whose every line the engine refuses ends `failed` after the
minimum sample, its `errors` naming the limit and the numbers, and its error file holding an
`error_cap` line for each line not run; a bad limit is refused at create."""

from __future__ import annotations

from collections import Counter

import openai
import pytest
from test_api_broker import api_broker, finish, lines_of, upload
from test_job_caps import REFUSE, write_lines

LINES = 2000
# one local echo worker that refuses lines starting with REFUSE, in small batches, so that
# a stop comes long before the last line
WORKER = f"batch_items = 8\nprefetch = 1\ntarget_batch_s = 0\noptions = {{refuse_token = {REFUSE}}}"


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    broker, url = api_broker(tmp_path_factory.mktemp("api-caps"), worker_keys=WORKER)
    try:
        yield broker, openai.OpenAI(base_url=url, api_key="any", max_retries=0)
    finally:
        broker.close()


def test_a_batch_whose_every_line_fails_ends_failed_after_the_minimum_sample(capped, tmp_path):
    _, client = capped
    write_lines(tmp_path / "in.jsonl", LINES, refused_every=1)
    batch = client.batches.create(
        input_file_id=upload(client, tmp_path / "in.jsonl").id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata={"fabric_max_error_rate": "0.5", "fabric_min_sample": "30"},
    )
    batch = finish(client, batch.id)
    assert batch.status == "failed", batch
    assert batch.errors is not None and len(batch.errors.data) == 1
    entry = batch.errors.data[0]
    assert (entry.code, entry.param) == ("error_cap", "fabric_max_error_rate")
    assert "min sample 30" in entry.message and "passed max_error_rate 0.5" in entry.message
    errors = lines_of(client, batch.error_file_id)
    codes = Counter(line["error"]["code"] for line in errors)
    assert len(errors) == LINES and codes["error_cap"] > LINES // 2, codes
    assert codes["item_failed"] >= 30, codes  # the sample: the engine's own errors
    assert batch.request_counts.failed == LINES


def test_a_batch_under_its_cap_completes(capped, tmp_path):
    _, client = capped
    write_lines(tmp_path / "in.jsonl", 300, refused_every=10)
    batch = client.batches.create(
        input_file_id=upload(client, tmp_path / "in.jsonl").id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata={"fabric_max_error_rate": "0.2", "fabric_max_errors": "100"},
    )
    batch = finish(client, batch.id)
    assert batch.status == "completed" and batch.errors is None, batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (270, 30)
    assert len(lines_of(client, batch.output_file_id)) == 270


def test_a_bad_limit_is_refused_at_create(capped, tmp_path):
    _, client = capped
    write_lines(tmp_path / "in.jsonl", 3, refused_every=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(
            input_file_id=upload(client, tmp_path / "in.jsonl").id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata={"fabric_max_error_rate": "50%"},
        )
    assert "fabric_max_error_rate" in str(refused.value) and "50%" in str(refused.value)
