"""Power cuts for the chaos run (`python -m bench.chaos --power-cuts`).

Two disks of bench/power_cut.py: the broker's data dir (`ROOT/data`) and the disk the
results clients write their output and error files to (`ROOT/client`). A cut of the
first is the broker's machine losing power: the broker and every stage die together, what
the kernel still held is dropped, and the broker starts on what was fsynced. A cut of the
second is the client's machine losing power: the results clients writing there die, their
files keep only what they fsynced, and they are run again. Each disk keeps a seeded
random part of its unsynced writes at a cut, torn at 512-byte sectors (a disk's own
write-back order), so the same seed replays the same remains.
"""

from __future__ import annotations

from pathlib import Path

from bench.power_cut import PowerDisk, available

BROKER_CUT = "broker and its data dir"
CLIENT_CUT = "results clients' output disk"


class PowerCuts:
    def __init__(self, root: Path, seed: int) -> None:
        reason = available()
        if reason:
            raise SystemExit(f"--power-cuts cannot run here: {reason}")
        self.data = PowerDisk(root / "disk-data", root / "data", seed=seed).mount()
        self.logs = root / "broker-log"
        self._logs_aside()
        try:
            self.client = PowerDisk(root / "disk-client", root / "client", seed=seed + 1).mount()
        except BaseException:
            self.data.close()
            raise

    @property
    def out_dir(self) -> Path:
        """Where the results clients write (on the client's disk)."""
        return self.client.mount_path

    def cut_broker(self, broker_pid: int) -> None:
        """The broker's machine loses power; its disk comes back with what was durable (the
        caller starts the broker again)."""
        self.data.cut(broker_pid)
        self.data.mount()
        self._logs_aside()

    def _logs_aside(self) -> None:
        """The broker's logs go to `ROOT/broker-log`, off the power-cut disk: nothing is
        acknowledged from them, and every life's log outlives the cuts for the reader of a
        failed run (on the disk, a cut takes each life's unsynced log with it)."""
        self.logs.mkdir(exist_ok=True)
        (self.data.mount_path / "log").symlink_to(self.logs, target_is_directory=True)

    def cut_client(self, clients: list[int]) -> None:
        """The results clients' machine loses power: `clients` (their pids) die with it,
        each wherever it is (one between two pages holds no file on the disk), and the
        caller runs them again."""
        self.client.cut(*clients)
        self.client.mount()

    def close(self) -> None:
        self.client.close()
        self.data.close()
