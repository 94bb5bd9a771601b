"""The OpenAI Files and Batches API over HTTP (docs/http-api.md).

| module            | what                                                               |
|-------------------|--------------------------------------------------------------------|
| `api_stage.py`    | the `api` stage: uvicorn serving `app.py`, and (api-0) the batch driver |
| `app.py`          | the FastAPI routes: /v1/files and /v1/batches                      |
| `route_stats.py`  | requests and seconds per route (an ASGI middleware): the metrics   |
| `errors.py`       | OpenAI's error body and status codes                              |
| `keys.py`         | API keys (stored hashed) and their owners                          |
| `file_store.py`   | files on disk: records, content, ids that exist only once durable  |
| `upload.py`       | a multipart upload streamed to disk with bounded memory           |
| `batch_record.py` | a batch record, typed: the JSON of `batch.json`                    |
| `batch_store.py`  | batch records on disk, the OpenAI Batch object                     |
| `batch_driver.py` | moves each batch through its states over the ingest and completion paths, on the `now` it is given |
| `batch_files.py`  | a batch's output and error files and their File records (for the driver) |
| `batch_validation.py` | OpenAI's validation of a batch, its lines sent as they check out |
| `retention.py`    | a batch's output and error files follow its job's results retention |

The stage is the top floor beside collector/: it imports pipeline, config,
ingest and collector, and nothing imports it but the stage table.
"""
