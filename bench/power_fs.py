"""A FUSE file system that loses what power loss loses: every write not yet fsynced.

`python -m bench.power_fs LIVE STATE MOUNT` mounts LIVE at MOUNT as a passthrough (reads
and writes go to LIVE, so the programs on MOUNT see their own writes) and keeps in STATE
what a disk would still hold after the power went out at this moment:

- `STATE/data/<id>`: each file's contents as of its last fsync or fdatasync (a file is
  known by an id of its own, not its name: a rename moves a name, not the data);
- `STATE/pending/<id>`: the writes and truncates since then, in order, applied to
  `data/<id>` only when the file's fsync comes (and a seeded cut may keep some, torn);
- `STATE/names.json`: each directory's entries (name -> kind, id, mode) as of its last
  fsync; a create, rename, unlink or mkdir is durable only once its directory is fsynced.

A cut can be armed at a moment (`STATE/arm.json`, read every 10 ms: `{"op": "fsync",
"glob": "segments/in-*", "nth": 3, "when": "after"}`): the nth matching operation
(fsync, fsyncdir, create, mkdir, rename (by its new name), unlink, write, truncate) since
it was armed is done ("after") or not ("before"), then this file system stops: that
operation and every later one that changes anything never answer, and `STATE/fired` says
which operation it was. The caller then cuts the power at exactly that moment.

What LIVE held when it was mounted is durable. Nothing is held in this process's memory
that STATE does not hold, so the daemon can be SIGKILLed at any moment: `materialize`
builds the directory a restarted machine would find from STATE alone.

A shared writable mmap works through it (no direct_io): the kernel keeps dirty pages until
msync, fdatasync or its own write-back sends them here as writes, and they count only once
a fsync follows. A cut (bench/power_cut.py) kills the programs, aborts the FUSE connection
so that no page left in the kernel arrives, and kills this process.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import random
import stat
import struct
import sys
import threading
import time
from pathlib import Path

import mfusepy

ROOT = 0  # the id of the mounted directory itself
_RECORD = struct.Struct("<cQQ")  # b"w" offset length (then the bytes), or b"t" size 0
SECTOR_BYTES = 512  # what a disk writes whole or not at all


def copy_sparse(src: Path, dst: Path) -> None:
    """Copy a file keeping its holes (segments are preallocated, mostly zeros)."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        pos = 0
        while pos < size:
            try:
                data_at = os.lseek(fin.fileno(), pos, os.SEEK_DATA)
            except OSError:  # no data past pos
                break
            hole_at = os.lseek(fin.fileno(), data_at, os.SEEK_HOLE)
            os.copy_file_range(fin.fileno(), fout.fileno(), hole_at - data_at, data_at, data_at)
            pos = hole_at
        fout.truncate(size)


def read_records(path: Path):
    """The pending writes and truncates of one file, oldest first: (kind, offset, data)."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return
    at = 0
    while at + _RECORD.size <= len(blob):
        kind, offset, length = _RECORD.unpack_from(blob, at)
        at += _RECORD.size
        if kind == b"w":
            data = blob[at : at + length]
            if len(data) < length:  # the daemon died mid-record: never acknowledged
                return
            at += length
            yield kind, offset, data
        else:
            yield kind, offset, b""


def apply_records(target: Path, records) -> None:
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for kind, offset, data in records:
            if kind == b"w":
                os.pwrite(fd, data, offset)
            else:
                os.ftruncate(fd, offset)
    finally:
        os.close(fd)


def torn(records, rng: random.Random):
    """Disk write-back reordering: a random half of the unsynced writes reach the disk, each
    as a random subset of its 512-byte sectors (truncates are kept or lost whole)."""
    for kind, offset, data in records:
        if rng.random() < 0.5:
            continue
        if kind == b"t":
            yield kind, offset, data
            continue
        end = offset + len(data)
        at = offset
        while at < end:
            stop = min(end, (at // SECTOR_BYTES + 1) * SECTOR_BYTES)
            if rng.random() < 0.5:
                yield kind, at, data[at - offset : stop - offset]
            at = stop


def materialize(state: Path, out: Path, seed: int | None = None) -> dict:
    """Build in `out` (which must not exist) what the disk holds after a cut: the durable
    names, each file's durable contents, and with `seed` a torn random subset of the writes
    still pending. Returns counts for the caller's report."""
    names = json.loads((state / "names.json").read_text())
    rng = random.Random(seed)
    counts = {"files": 0, "pending_files_lost": 0, "torn_records_kept": 0}
    out.mkdir(parents=True)

    def build(dir_id: int, where: Path, depth: int) -> None:
        for name, (kind, ident, mode) in sorted(names.get(str(dir_id), {}).items()):
            path = where / name
            if kind == "d" and depth < 64:
                path.mkdir(mode=0o700)
                build(ident, path, depth + 1)
            elif kind == "f":
                data = state / "data" / str(ident)
                if data.exists():
                    copy_sparse(data, path)
                else:
                    path.touch()
                pending = state / "pending" / str(ident)
                if pending.exists():
                    counts["pending_files_lost"] += 1
                    if seed is not None:
                        kept = list(torn(read_records(pending), rng))
                        counts["torn_records_kept"] += len(kept)
                        apply_records(path, kept)
                counts["files"] += 1
            else:
                continue
            os.chmod(path, stat.S_IMODE(mode))

    build(ROOT, out, 0)
    return counts


class PowerCutFS(mfusepy.Operations):
    use_ns = True

    def __init__(self, live: Path, state: Path) -> None:
        self.live = str(live)
        self.state = state
        # Not `self.lock`: mfusepy takes an attribute of that name for the POSIX-lock
        # operation (and called the Lock for every close); without it the kernel keeps locks.
        self._lock = threading.Lock()
        self.ids: dict[int, int] = {}  # LIVE inode -> file id
        self.next_id = ROOT
        self.fh_ids: dict[int, int] = {}  # open fd -> file id
        (state / "data").mkdir(parents=True)
        (state / "pending").mkdir()
        self.names: dict[str, dict[str, list]] = {}
        self.armed: dict | None = None
        self.seen = 0
        self.frozen = threading.Event()
        self._snapshot()
        threading.Thread(target=self._watch_arm, daemon=True).start()

    # -- durable state --------------------------------------------------------------

    def _new_id(self, ino: int) -> int:
        ident = self.next_id
        self.next_id += 1
        self.ids[ino] = ident
        return ident

    def _id(self, ino: int) -> int:
        return self.ids[ino] if ino in self.ids else self._new_id(ino)

    def _snapshot(self) -> None:
        """Everything LIVE holds at mount is durable."""
        self._new_id(os.stat(self.live).st_ino)
        for top, _dirs, files in os.walk(self.live):
            self._durable_listing(top)
            for name in files:
                st = os.lstat(os.path.join(top, name))
                if stat.S_ISREG(st.st_mode):
                    copy_sparse(Path(top, name), self.state / "data" / str(self._id(st.st_ino)))
        self._save_names()

    def _durable_listing(self, real_dir: str) -> None:
        entries = {}
        for name in os.listdir(real_dir):
            st = os.lstat(os.path.join(real_dir, name))
            if stat.S_ISDIR(st.st_mode):
                kind = "d"
            elif stat.S_ISREG(st.st_mode):
                kind = "f"
            else:  # sockets, fifos: nothing of theirs outlives a power cut
                continue
            entries[name] = [kind, self._id(st.st_ino), st.st_mode]
        self.names[str(self._id(os.stat(real_dir).st_ino))] = entries

    def _save_names(self) -> None:
        tmp = self.state / "names.json.tmp"
        tmp.write_text(json.dumps(self.names))
        os.replace(tmp, self.state / "names.json")

    def _pend(self, ident: int, kind: bytes, offset: int, data: bytes = b"") -> None:
        with open(self.state / "pending" / str(ident), "ab") as out:
            out.write(_RECORD.pack(kind, offset, len(data)) + data)

    def _sync_file(self, ident: int) -> None:
        pending = self.state / "pending" / str(ident)
        if pending.exists():
            apply_records(self.state / "data" / str(ident), read_records(pending))
            pending.unlink()

    # -- armed cuts -----------------------------------------------------------------

    def _watch_arm(self) -> None:
        arm = self.state / "arm.json"
        while True:
            if arm.exists():
                spec = json.loads(arm.read_text())
                arm.unlink()
                with self._lock:
                    self.armed, self.seen = spec, 0
            time.sleep(0.01)

    def _hang(self) -> None:
        while True:
            time.sleep(3600)

    def _moment(self, op: str, path: str | None) -> str | None:
        """Call holding the lock, before the operation: None to go on, else "before" or
        "after" (the armed moment). Hangs for ever once the moment has passed."""
        if self.frozen.is_set():
            self._lock.release()
            self._hang()
        spec = self.armed
        if spec is None or spec["op"] != op or path is None:
            return None
        if not fnmatch.fnmatchcase(path.lstrip("/"), spec["glob"]):
            return None
        self.seen += 1
        if self.seen < spec.get("nth", 1):
            return None
        self.armed = None
        self.frozen.set()
        (self.state / "fired.tmp").write_text(json.dumps({"op": op, "path": path}))
        os.replace(self.state / "fired.tmp", self.state / "fired")
        if spec.get("when", "after") == "before":
            self._lock.release()
            self._hang()
        return "after"

    def _after(self, moment: str | None) -> None:
        """Call holding the lock, once the operation is done."""
        if moment is not None:
            self._lock.release()
            self._hang()

    # -- operations -----------------------------------------------------------------

    def _real(self, path: str) -> str:
        return self.live + path

    def getattr(self, path, fh=None):
        st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino")
        attrs = {k: getattr(st, k) for k in keys}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return attrs

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._real(path))]

    def access(self, path, amode):
        if not os.access(self._real(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def statfs(self, path):
        sv = os.statvfs(self._real(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files")
        return {k: getattr(sv, k) for k in (*keys, "f_flag", "f_frsize", "f_namemax")}

    def mkdir(self, path, mode):
        with self._lock:
            moment = self._moment("mkdir", path)
            os.mkdir(self._real(path), mode)
            self._new_id(os.lstat(self._real(path)).st_ino)
            self._after(moment)
        return 0

    def mknod(self, path, mode, dev):
        os.mknod(self._real(path), mode, dev)
        return 0

    def rmdir(self, path):
        with self._lock:
            moment = self._moment("unlink", path)
            os.rmdir(self._real(path))
            self._after(moment)
        return 0

    def unlink(self, path):
        with self._lock:
            moment = self._moment("unlink", path)
            os.unlink(self._real(path))
            self._after(moment)
        return 0

    def rename(self, old, new):
        with self._lock:
            moment = self._moment("rename", new)
            os.rename(self._real(old), self._real(new))
            self._after(moment)
        return 0

    def link(self, target, source):
        os.link(self._real(source), self._real(target))
        return 0

    def symlink(self, target, source):
        os.symlink(source, self._real(target))
        return 0

    def readlink(self, path):
        return os.readlink(self._real(path))

    def chmod(self, path, mode):
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path, uid, gid):
        os.chown(self._real(path), uid, gid)
        return 0

    def utimens(self, path, times=None):
        os.utime(self._real(path), ns=times)
        return 0

    def _opened(self, fd: int, ident: int) -> int:
        self.fh_ids[fd] = ident
        return fd

    def create(self, path, mode, flags=0):
        with self._lock:
            moment = self._moment("create", path)
            fd = os.open(self._real(path), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
            fd = self._opened(fd, self._new_id(os.fstat(fd).st_ino))
            self._after(moment)
            return fd

    def open(self, path, flags):
        # Writes arrive with their offsets (O_APPEND is the kernel's business); the
        # kernel's page cache may read a page a program only writes.
        keep = flags & ~(os.O_APPEND | os.O_ACCMODE | os.O_CREAT | os.O_EXCL | os.O_TRUNC)
        mode = os.O_RDONLY if flags & os.O_ACCMODE == os.O_RDONLY else os.O_RDWR
        with self._lock:
            fd = os.open(self._real(path), keep | mode)
            ident = self._id(os.fstat(fd).st_ino)
            if flags & os.O_TRUNC:
                self._moment("truncate", path)
                os.ftruncate(fd, 0)
                self._pend(ident, b"t", 0)
            return self._opened(fd, ident)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        with self._lock:
            moment = self._moment("write", path)
            written = os.pwrite(fh, data, offset)
            self._pend(self.fh_ids[fh], b"w", offset, bytes(data[:written]))
            self._after(moment)
        return written

    def truncate(self, path, length, fh=None):
        with self._lock:
            moment = self._moment("truncate", path)
            if fh is None:
                os.truncate(self._real(path), length)
                ident = self._id(os.lstat(self._real(path)).st_ino)
            else:
                os.ftruncate(fh, length)
                ident = self.fh_ids[fh]
            self._pend(ident, b"t", length)
            self._after(moment)
        return 0

    def fallocate(self, path, mode, offset, size, fh):
        if mode != 0:
            raise mfusepy.FuseOSError(errno.EOPNOTSUPP)
        with self._lock:
            self._moment("fallocate", path)
            before = os.fstat(fh).st_size
            os.posix_fallocate(fh, offset, size)
            if offset + size > before:  # a size change is a pending truncate up
                self._pend(self.fh_ids[fh], b"t", offset + size)
        return 0

    def fsync(self, path, datasync, fh):
        with self._lock:
            moment = self._moment("fsync", path)
            self._sync_file(self.fh_ids[fh])
            self._after(moment)
        return 0

    def fsyncdir(self, path, datasync, fh):
        with self._lock:
            moment = self._moment("fsyncdir", path)
            self._durable_listing(self._real(path))
            self._save_names()
            self._after(moment)
        return 0

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        with self._lock:
            self.fh_ids.pop(fh, None)
            os.close(fh)
        return 0


def main(argv: list[str]) -> None:
    live, state, mount = (Path(a).resolve() for a in argv[:3])
    fs = PowerCutFS(live, state)
    (state / "ready").write_text(str(os.getpid()))
    mfusepy.FUSE(fs, str(mount), foreground=True, hard_remove=True, fsname="powercut")


if __name__ == "__main__":
    main(sys.argv[1:])
