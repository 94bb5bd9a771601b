"""Delivery on the client's side: result pages rendered as OpenAI Batch lines, written once.

| module | the one idea it holds |
|--------|-----------------------|
| `result_page.py` | a result page's columns and its checks before rendering |
| `lines.py` | a result page -> output and error lines, and each line's key |
| `line_templates.py` | the common line forms built a whole page at once, from a template and columns |
| `line_bodies.py` | the one-at-a-time line bodies (what the templates do not cover), from one `Generated` record |
| `join.py` | the parts of a fan-out line joined into one response |
| `responses.py`, `logprobs.py` | /v1/responses bodies; logprobs in OpenAI's shapes |
| `result_file.py` | `ResultFile`: an output file that holds each key at most once, synced before an ack |
| `heap.py` | `run.py results` keeps freed page buffers for the next page (glibc thresholds) |
"""
