"""The completion stage (`completion-0`): results in, durable, inputs retired; results out.

| module | the one idea it holds |
|--------|-----------------------|
| `completion_stage.py` | the stage: its sockets, its `step(now)` loop, the group commit and RETIRED, request routing, tidying |
| `intake.py` | result intake: RESULTS and ITEM_ERRORS checked and recorded, rejected lines as error results |
| `result_check.py` | every worker result checked against its item |
| `results_log.py` | `CompletionLog`: the durable path, output then tombstone then count |
| `record_format.py` | a completion-log slot: the flags word, the body, the size classes |
| `job_results.py` | one job's part of the log in memory: appenders, readers, exact counters |
| `pages.py` | reading a job's results back as pages, marking them delivered |
| `delivery.py` | FETCH -> RESULT_PAGE, one outstanding page per job, acks |
| `job_status.py` | JOB_STATUS: a job's state and counters (reads only) |
| `cancel.py` | CANCEL: the cancel mark and CANCEL_JOB to dispatch |
| `figures.py` | what the stage reports to the metrics |
| `input_segments.py` | the input segments it has open to write tombstones into |
| `finishing.py` | where a job finishes: its segments sealed, `jobs/<id>/finished` written |

docs/completion.md describes the whole.
"""
