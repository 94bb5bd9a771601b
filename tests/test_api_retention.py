"""A batch's output and error files follow its broker job's retention, through a real broker
with a short `completion.results_retention_s`: the File objects carry `expires_at` (the job's
finished mark + retention) once known, and when the job's results are removed their File
objects answer 404 with OpenAI's error body and leave the listing; the batch stays."""

from __future__ import annotations

import math

import openai
import pytest
from conftest import wait_for
from test_api_broker import api_broker, finish, lines_of, requests_file, upload

from collector.results_client import ResultsClient
from pipeline.store.job_files import JobFiles
from pipeline.transport.topology import client_address

RETENTION_S = 12.0  # long enough to download the files first on a loaded machine


@pytest.fixture
def short(tmp_path):
    broker, url = api_broker(tmp_path, retention_s=RETENTION_S)
    try:
        yield broker, openai.OpenAI(base_url=url, api_key="any", max_retries=0)
    finally:
        broker.close()


def test_output_and_error_files_go_with_the_jobs_results(short, tmp_path):
    broker, client = short
    path = tmp_path / "requests.jsonl"
    custom_ids = requests_file(path, 40, "/v1/embeddings")
    with open(path, "ab") as bad:  # a line for another endpoint: the batch gets an error file
        bad.write(b'{"custom_id": "x", "method": "POST", "url": "/v1/completions", ')
        bad.write(b'"body": {"model": "echo", "prompt_token_ids": [1], "max_tokens": 2}}\n')
    file = upload(client, path)
    batch = client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata={"fabric_accept_partial": "true"},
    )
    batch = finish(client, batch.id)
    assert batch.status == "completed" and batch.error_file_id, batch
    ids = (batch.output_file_id, batch.error_file_id)
    jobs = JobFiles(broker.settings.data_path)
    # completion writes the mark just after the last result is stored: maybe after the batch
    # saw every result and completed
    finished_ns = wait_for(lambda: jobs.finished_ns(batch.id), "the job's finished mark")
    expires_at = math.ceil(finished_ns / 1e9 + RETENTION_S)

    def stamped():
        return all(client.files.retrieve(i).expires_at == expires_at for i in ids)

    wait_for(stamped, "the output files' expires_at", timeout_s=30, interval_s=0.2)
    out, err = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert {x["custom_id"] for x in out} == custom_ids and [x["custom_id"] for x in err] == ["x"]

    def gone():
        try:
            client.files.retrieve(batch.output_file_id)
        except openai.NotFoundError:
            return True
        return False

    wait_for(gone, "the output file to expire", timeout_s=RETENTION_S + 60, interval_s=0.2)
    for file_id in ids:
        for read in (client.files.retrieve, client.files.content):
            with pytest.raises(openai.NotFoundError) as caught:
                read(file_id)
            assert caught.value.body["message"] == f"No such file: '{file_id}'."
            assert caught.value.body["param"] == "id" and caught.value.status_code == 404
    listed = {f.id for f in client.files.list()}
    assert file.id in listed and not listed & set(ids)
    assert client.batches.retrieve(batch.id).output_file_id == batch.output_file_id
    with ResultsClient(client_address(broker.settings.completion.bind)) as results:
        # the broker's copy of the results is gone too (its collector sweeps every 0.3 s)
        wait_for(
            lambda: results.job_status(batch.id)["state"] == "expired",
            "the job's results to be removed",
            timeout_s=30,
            interval_s=0.2,
        )
    assert not any(broker.settings.data_path.glob(f"api/batches/{batch.id}/*.jsonl"))
