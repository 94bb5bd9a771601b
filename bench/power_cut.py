"""Power cuts of a directory: mount it on the power-cut file system, cut, mount what survived.

`PowerDisk(base, mount)` serves `mount` from bench/power_fs.py. Each life has its own
backing directory and state under `base` (`life-N/live`, `life-N/state`). `cut()` is the
power going out: every process using the mount (and the process trees given) is SIGKILLed,
the FUSE connection is aborted (dirty pages the kernel still holds go with it, and nothing
more reaches the file system), the daemon is killed, and the next life's directory is built
from the state alone (bench/power_fs.py `materialize`): what was fsynced, under the names
whose directories were fsynced. With `seed`, a seeded random subset of the unsynced writes
survives too, torn at 512-byte boundaries (a disk's own write-back order). `mount()` then
serves that directory at the same path.

Needs /dev/fuse, `fusermount3` (Debian's fuse3) and the `mfusepy` package; `available()`
says why not where one is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.power_fs import materialize
from pipeline.process.supervisor_report import still_running

REPO = Path(__file__).resolve().parents[1]
FUSECTL = Path("/sys/fs/fuse/connections")


def available() -> str | None:
    """None where power cuts can run here, else what is missing and how to get it."""
    if not Path("/dev/fuse").exists():
        return "/dev/fuse is missing (power cuts need FUSE)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing: apt-get install -y fuse3"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy cannot be loaded ({e}): pip install mfusepy (the test extra)"
    if os.geteuid() != 0:
        return "power cuts run as root (they mount fusectl and abort FUSE connections)"
    return None


def _fusectl() -> None:
    """Mount the FUSE control file system, where connections are aborted, if it is not."""
    if not any(FUSECTL.iterdir()) and not os.path.ismount(FUSECTL):
        subprocess.run(["mount", "-t", "fusectl", "none", str(FUSECTL)], check=False)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _session_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def _in_sessions(sessions: set[int]) -> set[int]:
    """Processes of `sessions`: a child forked while its tree was being killed is in none
    of the trees walked, but in its parent's session."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _session_of(int(entry.name)) in sessions:
            found.add(int(entry.name))
    return found


def _users(mount: Path) -> set[int]:
    """Processes with a file, a mapping or a working directory under `mount`."""
    prefix = str(mount) + "/"
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = [os.readlink(entry / "cwd")]
            links += [os.readlink(fd) for fd in (entry / "fd").iterdir()]
            maps = (entry / "maps").read_text()
        except OSError:
            continue
        if any(link == str(mount) or link.startswith(prefix) for link in links) or prefix in maps:
            found.add(int(entry.name))
    return found


class PowerDisk:
    def __init__(self, base: Path, mount: Path, seed: int | None = None) -> None:
        self.base = Path(base)
        self.mount_path = Path(mount)
        self.seed = seed
        self.life = 0
        self.daemon: subprocess.Popen | None = None
        self.cuts = 0
        self.last_cut: dict = {}
        self.last_fired: dict | None = None

    def _dir(self, life: int) -> Path:
        return self.base / f"life-{life}"

    def mount(self) -> PowerDisk:
        """Serve the current life's directory at the mount path (made if it is missing)."""
        _fusectl()
        live = self._dir(self.life) / "live"
        live.mkdir(parents=True, exist_ok=True)
        self.mount_path.mkdir(parents=True, exist_ok=True)
        if not os.path.ismount(self.mount_path):
            left = sorted(p.name for p in self.mount_path.iterdir())
            if left:  # the mount would hide them: someone wrote with the power off
                raise RuntimeError(
                    f"{self.mount_path} holds {left[:5]} while unmounted: a process outlived "
                    "the power cut and wrote there; cut its tree with the disk (`cut(pid)`)"
                )
        log = open(self._dir(self.life) / "daemon.log", "w")  # noqa: SIM115
        self.daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.power_fs",
                str(live),
                str(self.state),
                str(self.mount_path),
            ],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mount_path):
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                said = (self._dir(self.life) / "daemon.log").read_text()
                raise RuntimeError(f"the power-cut file system did not mount: {said}")
            time.sleep(0.02)
        return self

    @property
    def live(self) -> Path:
        """The backing directory of this life: what the programs on the mount see, synced or
        not (read it to watch them without going through the mount)."""
        return self._dir(self.life) / "live"

    @property
    def state(self) -> Path:
        return self._dir(self.life) / "state"

    def arm(self, op: str, glob: str, nth: int = 1, when: str = "after") -> None:
        """Stop the file system at the nth `op` on a path matching `glob` (relative to the
        mount) from now: done ("after") or not ("before"), then nothing more changes
        (bench/power_fs.py). `fired()` says when it happened; `cut()` next."""
        spec = {"op": op, "glob": glob, "nth": nth, "when": when}
        tmp = self.state / "arm.json.tmp"
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, self.state / "arm.json")

    def fired(self) -> dict | None:
        """The armed operation that stopped the file system (op and path), once it came."""
        path = self.state / "fired"
        return json.loads(path.read_text()) if path.exists() else None

    def _connection(self) -> Path:
        return FUSECTL / str(os.minor(os.stat(self.mount_path).st_dev))

    def cut(self, *trees: int) -> dict:
        """The power goes out: kill the process trees rooted at `trees` and every process
        using the mount, drop what the kernel holds, and build what survived. Returns
        counts (files, files with writes lost, torn writes kept). Call `mount()` next."""
        self.last_fired = self.fired()
        self._power_off(trees)
        old = self.state
        self.life += 1
        seed = None if self.seed is None else self.seed * 100003 + self.life
        self.last_cut = materialize(old, self._dir(self.life) / "live", seed=seed)
        shutil.rmtree(self._dir(self.life - 1), ignore_errors=True)
        self.cuts += 1
        return self.last_cut

    def _power_off(self, trees) -> None:
        connection = self._connection()
        me = {os.getpid(), os.getppid()}
        tree = _children()
        victims = set()
        todo = list(trees)
        while todo:
            pid = todo.pop()
            if pid not in victims:
                victims.add(pid)
                todo.extend(tree.get(pid, []))
        victims |= _users(self.mount_path)
        victims -= me
        # sessions of their own (a broker started with start_new_session), never ours
        sessions = {_session_of(pid) for pid in trees} - {None, os.getsid(0)}
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for _ in range(3):  # what was forked while the trees were being killed
            late = _in_sessions(sessions) - victims - me
            for pid in late:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            victims |= late
        (connection / "abort").write_text("1")
        self.daemon.kill()
        self.daemon.wait(timeout=30)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mount_path)], check=False)
        deadline = time.monotonic() + 30
        while any(still_running(pid) for pid in victims):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {sorted(victims)} outlived a power cut")
            time.sleep(0.02)

    def close(self) -> None:
        """Unmount, killing what still uses the mount (what it held is thrown away with
        the backing directory)."""
        if self.daemon is not None and self.daemon.poll() is None:
            self._power_off(())
