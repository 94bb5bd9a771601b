"""Exit codes of `python run.py`, documented in docs/operations.md: the one table of them."""

OK = 0  # success; `check`: no findings
FINDINGS = 1  # `check`: findings remain (each printed on its own line)
USAGE = 2  # bad command line (argparse's own code)
CONFIG = 3  # the configuration file is missing or invalid
LOCKED = 4  # the data dir is locked by another broker or check
STAGE_FAILED = 5  # a stage died repeatedly within supervisor.restart_window_s; the broker stopped
UNAVAILABLE = (
    6  # `submit`: the broker did not answer; run it again with the same --job-id to resume
)
FAILED = (
    7  # a command failed for another reason, named in its last line (a refused chunk, bad input)
)
CANNOT_WRITE = 8  # `batch`: OUT or its state dir cannot be written (a read-only directory)
ENGINE_CANNOT_START = 10  # a local worker: its engine failed to load (an EngineError: the model,
# its options, the host); its log's last ERROR line says why, and `status` and `batch` show it
DEADLINE_AT_RISK = 11  # `submit --deadline-strict`: the job would not finish by its deadline
# with the workers there are; refused before any line was stored (it says why)
ALL_FAILED = 9  # `batch`: every line has its outcome, but not one succeeded: only error lines
INTERRUPTED = 130  # Ctrl-C (SIGINT): `batch`, `submit`, `demo` stopped; the same command resumes
