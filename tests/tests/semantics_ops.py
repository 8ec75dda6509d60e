"""One fixed sequence of POSIX operations, run in the directory given as argv[1].

Prints one line per check, `name: result`, where a result is a value or an errno name. The
semantics test runs it on an awcpfs mount and on a native directory and compares the lines:
they must be equal except for the differences docs/SEMANTICS.md documents.
"""

import ctypes
import errno
import fcntl
import mmap
import os
import stat
import sys

os.chdir(sys.argv[1])
os.umask(0o022)
libc = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


def out(name, value):
    print(f"{name}: {value}", flush=True)


def attempt(name, f):
    try:
        r = f()
        out(name, "ok" if r is None else r)
    except OSError as e:
        out(name, errno.errorcode.get(e.errno, e.errno))


def renameat2(a, b, flags):
    if libc.renameat2(-100, a.encode(), -100, b.encode(), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def fallocate(fd, mode, off, length):
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, mode, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def write(path, data, mode=0o644):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.write(fd, data)
    os.close(fd)


def read(path):
    with open(path, "rb") as f:
        return f.read()


# --- hard links -------------------------------------------------------------------------
os.mkdir("links")
write("links/a", b"one\n")
attempt("link", lambda: os.link("links/a", "links/b"))
out("link.nlink", (os.stat("links/a").st_nlink, os.stat("links/b").st_nlink))
out("link.same_ino", os.stat("links/a").st_ino == os.stat("links/b").st_ino)
with open("links/b", "ab") as f:
    f.write(b"two\n")
out("link.shared_content", read("links/a"))
attempt("link.onto_existing", lambda: os.link("links/a", "links/b"))
attempt("link.directory", lambda: os.link("links", "links2"))
attempt("link.missing", lambda: os.link("links/nope", "links/c"))
os.link("links/a", "links/c")
os.unlink("links/a")
out("link.after_unlink", (os.stat("links/b").st_nlink, read("links/c")))
os.rename("links/c", "links/d")
out("link.after_rename", (os.stat("links/b").st_nlink, os.stat("links/d").st_nlink))
os.symlink("b", "links/sym")
attempt("link.symlink", lambda: os.link("links/sym", "links/sym2", follow_symlinks=False))
out("link.symlink_is_link", stat.S_ISLNK(os.lstat("links/sym2").st_mode))
# A hard link kept for the write-back check.
write("links/keep", b"kept\n")
os.link("links/keep", "links/keep2")

# --- rename flags -----------------------------------------------------------------------
os.mkdir("ren")
write("ren/x", b"x")
write("ren/y", b"y")
os.mkdir("ren/dir")
attempt("rename.noreplace_existing", lambda: renameat2("ren/x", "ren/y", RENAME_NOREPLACE))
attempt("rename.noreplace_free", lambda: renameat2("ren/x", "ren/z", RENAME_NOREPLACE))
attempt("rename.exchange", lambda: renameat2("ren/z", "ren/y", RENAME_EXCHANGE))
out("rename.exchanged", (read("ren/z"), read("ren/y")))
attempt("rename.exchange_missing", lambda: renameat2("ren/z", "ren/none", RENAME_EXCHANGE))
attempt("rename.exchange_file_dir", lambda: renameat2("ren/z", "ren/dir", RENAME_EXCHANGE))
out("rename.kinds", (stat.S_ISDIR(os.stat("ren/z").st_mode), stat.S_ISDIR(os.stat("ren/dir").st_mode)))
attempt("rename.dir_over_file", lambda: os.rename("ren/z", "ren/y"))
attempt("rename.file_over_dir", lambda: os.rename("ren/y", "ren/z"))
attempt("rename.into_itself", lambda: os.rename("ren/z", "ren/z/sub"))
write("ren/z/inner", b"i")
os.mkdir("ren/empty")
attempt("rename.over_nonempty_dir", lambda: os.rename("ren/empty", "ren/z"))
attempt("rename.over_empty_dir", lambda: os.rename("ren/z", "ren/empty"))
ino = os.stat("ren/y").st_ino
os.rename("ren/y", "ren/y2")
out("rename.keeps_ino", os.stat("ren/y2").st_ino == ino)

# --- open files that lose their name ------------------------------------------------------
os.mkdir("open")
write("open/victim", b"old content")
write("open/new", b"new content")
fd = os.open("open/victim", os.O_RDWR)
os.rename("open/new", "open/victim")
out("rename_over_open.read", os.pread(fd, 100, 0))
out("rename_over_open.nlink", os.fstat(fd).st_nlink)
out("rename_over_open.path", read("open/victim"))
os.close(fd)
write("open/gone", b"still here")
fd = os.open("open/gone", os.O_RDWR)
os.unlink("open/gone")
os.pwrite(fd, b"STILL", 0)
out("unlink_open.read", os.pread(fd, 100, 0))
out("unlink_open.fstat", (os.fstat(fd).st_nlink, os.fstat(fd).st_size))
out("unlink_open.listed", "gone" in os.listdir("open"))
os.close(fd)

# --- open flags ---------------------------------------------------------------------------
write("flags", b"abc")
fd = os.open("flags", os.O_WRONLY | os.O_APPEND)
os.lseek(fd, 0, os.SEEK_SET)
os.write(fd, b"de")
os.close(fd)
out("o_append", read("flags"))
fd = os.open("flags", os.O_WRONLY | os.O_TRUNC)
out("o_trunc.size", os.fstat(fd).st_size)
os.close(fd)
attempt("o_excl.existing", lambda: os.close(os.open("flags", os.O_WRONLY | os.O_CREAT | os.O_EXCL)))
attempt("o_excl.new", lambda: os.close(os.open("flags2", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)))
out("o_excl.mode", oct(os.stat("flags2").st_mode & 0o777))
attempt("o_creat.in_missing_dir", lambda: os.open("nodir/f", os.O_WRONLY | os.O_CREAT))
attempt("o_directory.on_file", lambda: os.open("flags", os.O_RDONLY | os.O_DIRECTORY))
attempt("open.dir_for_write", lambda: os.open("links", os.O_WRONLY))
attempt("o_tmpfile", lambda: os.close(os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o600)))

# --- sparse and large files ---------------------------------------------------------------
# One file past 4 GiB, almost all hole (kept for the write-back check).
GIB = 1 << 30
fd = os.open("big", os.O_RDWR | os.O_CREAT, 0o644)
os.pwrite(fd, b"past 4 GiB", 4 * GIB + 3)
os.fsync(fd)
st = os.fstat(fd)
out("big.size", st.st_size)
out("big.read_back", os.pread(fd, 10, 4 * GIB + 3))
out("big.read_hole", os.pread(fd, 4, 3 * GIB))
out("big.blocks_small", st.st_blocks * 512 < 64 << 20)
os.ftruncate(fd, 4 * GIB + 13)
out("big.size_after_ftruncate", os.fstat(fd).st_size)
os.close(fd)

# --- fallocate ------------------------------------------------------------------------------
fd = os.open("falloc", os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"x" * 10)
attempt("fallocate.grow", lambda: os.posix_fallocate(fd, 0, 1 << 20))
out("fallocate.size", os.fstat(fd).st_size)
attempt("fallocate.keep_size", lambda: fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, 4 << 20))
out("fallocate.size_kept", os.fstat(fd).st_size)
attempt("fallocate.punch", lambda: fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096))
out("fallocate.punched", os.pread(fd, 10, 0))
os.close(fd)

# --- times, modes, owners -----------------------------------------------------------------
write("times", b"t")
os.utime("times", ns=(1_234_567_890_123_456_789, 1_300_000_000_987_654_321))
st = os.stat("times")
out("utimens.ns", (st.st_atime_ns, st.st_mtime_ns))
os.utime("times", ns=(1_000_000_000_000_000_001, 1_000_000_000_000_000_002), follow_symlinks=True)
out("utimens.again", os.stat("times").st_mtime_ns)
os.chmod("times", 0o4755)
out("chmod.setuid_local", oct(os.stat("times").st_mode & 0o7777))
os.chmod("times", 0o640)
out("chmod", oct(os.stat("times").st_mode & 0o7777))
attempt("chown.same", lambda: os.chown("times", os.getuid(), os.getgid()))
attempt("chown.other", lambda: os.chown("times", 4242, 4343))
out("chown.result", (os.stat("times").st_uid, os.stat("times").st_gid))
ctime = os.stat("times").st_ctime_ns
os.chmod("times", 0o600)
out("chmod.ctime_moves", os.stat("times").st_ctime_ns >= ctime)
# A write by a process without CAP_FSETID clears set-user-ID and set-group-ID (awcpfs does it
# itself when the kernel asks, FUSE_HANDLE_KILLPRIV_V2).
write("suid", b"s")
os.chmod("suid", 0o6777)
wfd = os.open("suid", os.O_WRONLY | os.O_APPEND)
pid = os.fork()
if pid == 0:
    try:
        os.setgid(4343)
        os.setuid(4242)
        os.write(wfd, b"x")
        os._exit(0)
    except BaseException:
        os._exit(1)
os.close(wfd)
out("killpriv.writer", os.waitpid(pid, 0)[1])
out("killpriv.mode", oct(os.stat("suid").st_mode & 0o7777))
out("killpriv.content", open("suid", "rb").read())

# --- extended attributes --------------------------------------------------------------------
write("xa", b"x")
attempt("xattr.set", lambda: os.setxattr("xa", "user.color", b"blue"))
attempt("xattr.get", lambda: os.getxattr("xa", "user.color"))
attempt("xattr.create_existing", lambda: os.setxattr("xa", "user.color", b"red", os.XATTR_CREATE))
attempt("xattr.replace_missing", lambda: os.setxattr("xa", "user.size", b"1", os.XATTR_REPLACE))
attempt("xattr.replace", lambda: os.setxattr("xa", "user.color", b"green", os.XATTR_REPLACE))
attempt("xattr.binary", lambda: os.setxattr("xa", "user.bin", bytes(range(256))))
out("xattr.binary_back", os.getxattr("xa", "user.bin") == bytes(range(256)))
out("xattr.list", sorted(n for n in os.listxattr("xa") if n.startswith("user.")))
attempt("xattr.remove", lambda: os.removexattr("xa", "user.color"))
attempt("xattr.get_removed", lambda: os.getxattr("xa", "user.color"))
attempt("xattr.remove_missing", lambda: os.removexattr("xa", "user.color"))
attempt("xattr.dir", lambda: os.setxattr("links", "user.d", b"1"))
attempt("xattr.symlink", lambda: os.setxattr("links/sym", "user.s", b"1", follow_symlinks=False))
attempt("xattr.too_big", lambda: os.setxattr("xa", "user.big", b"x" * (65537)))
os.link("xa", "xa-link")
out("xattr.through_link", os.getxattr("xa-link", "user.bin") == bytes(range(256)))

# --- locks ----------------------------------------------------------------------------------
write("lockme", b"l")
f1 = os.open("lockme", os.O_RDWR)
f2 = os.open("lockme", os.O_RDWR)
fcntl.flock(f1, fcntl.LOCK_EX)
attempt("flock.conflict", lambda: fcntl.flock(f2, fcntl.LOCK_EX | fcntl.LOCK_NB))
fcntl.flock(f1, fcntl.LOCK_UN)
attempt("flock.after_unlock", lambda: fcntl.flock(f2, fcntl.LOCK_EX | fcntl.LOCK_NB))
fcntl.flock(f2, fcntl.LOCK_UN)
fcntl.lockf(f1, fcntl.LOCK_EX)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        fcntl.lockf(os.open("lockme", os.O_RDWR), fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(w, b"ok")
    except OSError as e:
        os.write(w, errno.errorcode[e.errno].encode())
    os._exit(0)
os.waitpid(pid, 0)
out("fcntl_lock.other_process", os.read(r, 100).decode())
os.close(f1)
os.close(f2)

# --- mmap -----------------------------------------------------------------------------------
write("mapped", b"\0" * 8192)
fd = os.open("mapped", os.O_RDWR)
m = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
m[0:5] = b"hello"
m[4096:4101] = b"world"
m.flush()
out("mmap.read_while_mapped", os.pread(fd, 5, 4096))
m.close()
os.close(fd)
data = read("mapped")
out("mmap.after_unmap", (data[0:5], data[4096:4101]))

# --- statfs, names, paths -------------------------------------------------------------------
sv = os.statvfs(".")
out("statfs.namemax", sv.f_namemax)
out("statfs.sane", sv.f_bsize > 0 and sv.f_blocks > 0 and sv.f_bavail <= sv.f_blocks)
long_utf8 = "é" * 127 + "a"  # 255 bytes
attempt("name.255_utf8", lambda: write(long_utf8, b"long"))
out("name.255_listed", long_utf8 in os.listdir("."))
attempt("name.256", lambda: write("b" * 256, b""))
attempt("name.non_utf8", lambda: write(b"bad\xff\xfename", b"latin"))
out("name.non_utf8_listed", b"bad\xff\xfename" in os.listdir(b"."))
out("name.non_utf8_read", read(b"bad\xff\xfename"))
attempt("name.255_non_utf8", lambda: write(b"\xff" * 255, b"ff"))
attempt("name.256_non_utf8", lambda: write(b"\xff" * 256, b""))
attempt("name.non_utf8_lookup", lambda: os.stat(b"missing\xff"))
# Deep: 40 levels of 120-byte names (over 4 KiB of path), walked with directory fds.
dfd = os.open(".", os.O_RDONLY)
for i in range(40):
    name = f"{i:03d}" + "d" * 117
    os.mkdir(name, dir_fd=dfd)
    nfd = os.open(name, os.O_RDONLY, dir_fd=dfd)
    os.close(dfd)
    dfd = nfd
fd = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=dfd)
os.write(fd, b"deep")
os.close(fd)
fd = os.open("leaf", os.O_RDONLY, dir_fd=dfd)
out("deep.read", os.read(fd, 10))
os.close(fd)
os.close(dfd)

# --- attributes -----------------------------------------------------------------------------
os.makedirs("nl/a")
os.mkdir("nl/b")
write("nl/f", b"f")
out("nlink.dir", os.stat("nl").st_nlink)
out("nlink.file", os.stat("nl/f").st_nlink)
write("blocks", b"b" * 10000)
st = os.stat("blocks")
out("blocks.plausible", 10000 <= st.st_blocks * 512 < 10000 + (1 << 20))
out("blksize", st.st_blksize > 0)
ino = os.stat("blocks").st_ino
with open("blocks", "ab") as f:
    f.write(b"more")
os.chmod("blocks", 0o600)
out("ino.stable", os.stat("blocks").st_ino == ino)
out("dir.size_positive", os.stat("nl").st_size > 0)
out("done", True)
