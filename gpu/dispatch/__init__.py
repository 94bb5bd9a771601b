"""The dispatch stage and what it is made of (docs/dispatch.md).

| module            | one idea                                                                |
|-------------------|-------------------------------------------------------------------------|
| `dispatch_stage.py` | DispatchStage: sockets, the step loop, worker messages, hand-outs       |
| `inbox.py`        | what writers and completion tell it: APPENDED, RETIRED, CANCEL_JOB      |
| `timeouts.py`     | what time takes back: silent sessions, expired leases, stalled sessions |
| `state.py`        | DispatchState: what is queued, taking a batch, claims, cancelled jobs   |
| `reclaim.py`      | the end of a lease: reclaims, rewinds, attempts, dead letters, retires  |
| `segment_queue.py`| one input segment's queue: cursor, written end, slots out, the scan     |
| `leases.py`       | the lease table: which batch is out with which session                  |
| `batch.py`        | a batch and its items (ITEM_DTYPE), quarantined slots                   |
| `batch_ids.py`    | batch ids reserved durably, never reused                                |
| `work_finder.py`  | how dispatch learns of work: segment files, APPENDED, the rescan        |
| `registration.py` | holdings coming back: reloaded leases, WORKER_HELLO claims              |
| `sessions.py`     | a worker session and a parked work request                             |
| `stall.py`        | sessions that renew leases but send no results                          |
| `work_token.py`   | work tokens: results and claims only for work this data dir handed out  |
| `forward.py`      | results pass through unparsed; the queue to completion                  |
| `item_errors.py`  | dead letters, quarantined and cancelled items until completion retires them |
| `lease_recorder.py` | keeping the dispatch file in step with the lease table                |
| `file.py`, `file_format.py` | the dispatch file: its writer; its layout and reading       |
| `arrivals.py`     | when queued slots arrived (the queue's age)                             |
| `deadlines.py`    | which jobs have a deadline, from their job records                      |
| `deadline_order.py` | least slack first, within a bounded share (a hint)                    |
| `demand.py`       | the estimate: workers needed, each deadline job's projected finish      |
| `demand_view.py`  | the demand's inputs gathered once a second; what status and metrics show |
| `worker_rates.py` | each worker's measured items/s and tokens/s, from its results           |
| `report.py`       | the status answer and the metrics: read-only views of the stage         |
"""
