"""The worker SDK: pull batches ahead, keep the engine busy, return results, lose nothing
(docs/dispatch.md, Workers).

It runs on remote GPU hosts and depends on the worker protocol only
(`gpu/work_protocol.py`, `pipeline/transport/wire.py`, `pipeline/core/result_kinds.py`,
`pipeline/store/segment_format.py`) and the engines (`gpu/engines/`), never on
dispatch's modules.

| module          | what it holds                                                    |
|-----------------|------------------------------------------------------------------|
| `session`       | `Worker`, one session stepped at `now`: asking, results, hand-backs, drain; `run_worker` |
| `registration`  | registering with the broker: HELLO with backoff, WELCOME, the heartbeat's epoch |
| `engine_thread` | the engine's own thread: runs queued batches, says how each went |
| `watchdog`      | an engine that ended, hung, or takes no work ends the worker     |
| `connection`    | the sockets to dispatch and its heartbeat endpoint               |
| `held`          | a batch the worker holds, its states, and the claims HELLO makes |
| `results`       | the RESULTS arrays built from an engine's result                 |
| `options`       | `WorkerOptions`: the flags, the config, the argv of a worker     |
| `faults`        | fault injection for tests (`WorkerOptions.fault`)                      |
| `worker_stage`  | `WorkerStage`: a local worker run by the supervisor              |
| `hosted`        | `HostedWorker`: a session on a thread of another process (a Ray actor), drained on request |

This package imports nothing itself: import the module you need.
"""
