"""Delivery on the client's side: result pages rendered as OpenAI Batch lines, written once.

| module | the one idea it holds |
|--------|-----------------------|
| `lines.py` | a result page -> output and error lines, and each line's key |
| `result_file.py` | `ResultFile`: an output file that holds each key at most once, synced before an ack |
"""
