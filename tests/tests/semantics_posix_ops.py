"""Special files, ownership and over-long names, run in the directory given as argv[1].

Prints one line per check, `name: result`, like `semantics_ops.py`; the semantics test runs
it on an awcpfs mount and on a native directory and compares the lines. Kept apart from
`semantics_ops.py` so its write-back is not behind that sequence's 4 GiB sparse file.
"""

import errno
import os
import socket
import stat
import sys

os.chdir(sys.argv[1])
os.umask(0o022)


def out(name, value):
    print(f"{name}: {value}", flush=True)


def attempt(name, f):
    try:
        r = f()
        out(name, "ok" if r is None else r)
    except OSError as e:
        out(name, errno.errorcode.get(e.errno, e.errno))


def write(path, data, mode=0o644):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.write(fd, data)
    os.close(fd)


# --- special files ----------------------------------------------------------------------------
# FIFOs and sockets work as on a local filesystem (the kernel runs them once the node has
# the type); device nodes are created and listed, and opening one is refused by `nodev`.
attempt("mkfifo", lambda: os.mkfifo("fifo", 0o640))
st = os.lstat("fifo")
out("mkfifo.stat", (stat.S_ISFIFO(st.st_mode), oct(st.st_mode & 0o7777), st.st_size, st.st_nlink))
pid = os.fork()
if pid == 0:
    try:
        wfd = os.open("fifo", os.O_WRONLY)
        os.write(wfd, b"through the fifo")
        os.close(wfd)
        os._exit(0)
    except BaseException:
        os._exit(1)
fd = os.open("fifo", os.O_RDONLY)
data = b""
while True:
    chunk = os.read(fd, 100)
    if not chunk:
        break
    data += chunk
os.close(fd)
out("fifo.read", data)
out("fifo.writer", os.waitpid(pid, 0)[1])
attempt("mknod.fifo", lambda: os.mknod("fifo2", 0o600 | stat.S_IFIFO))
out("mknod.fifo_stat", stat.S_ISFIFO(os.lstat("fifo2").st_mode))
attempt("fifo.rename", lambda: os.rename("fifo2", "fifo3"))
attempt("fifo.link", lambda: os.link("fifo3", "fifo4"))
out("fifo.nlink", os.lstat("fifo3").st_nlink)
attempt("fifo.chmod", lambda: os.chmod("fifo3", 0o606))
out("fifo.mode", oct(os.lstat("fifo4").st_mode & 0o7777))
attempt("fifo.unlink", lambda: os.unlink("fifo4"))
out("fifo.listed", sorted(n for n in os.listdir(".") if n.startswith("fifo")))
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
attempt("socket.bind", lambda: srv.bind("sock"))
srv.listen(1)
out("socket.stat", stat.S_ISSOCK(os.lstat("sock").st_mode))
cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
attempt("socket.connect", lambda: cli.connect("sock"))
conn, _ = srv.accept()
cli.sendall(b"ping")
out("socket.recv", conn.recv(10))
for s_ in (conn, cli, srv):
    s_.close()
attempt("socket.bind_existing", lambda: socket.socket(socket.AF_UNIX).bind("sock"))
attempt("socket.unlink", lambda: os.unlink("sock"))
attempt("mknod.char", lambda: os.mknod("cdev", 0o600 | stat.S_IFCHR, os.makedev(1, 3)))
st = os.lstat("cdev")
out("mknod.char_stat", (stat.S_ISCHR(st.st_mode), os.major(st.st_rdev), os.minor(st.st_rdev)))
attempt("mknod.block", lambda: os.mknod("bdev", 0o600 | stat.S_IFBLK, os.makedev(7, 200)))
st = os.lstat("bdev")
out("mknod.block_stat", (stat.S_ISBLK(st.st_mode), os.major(st.st_rdev), os.minor(st.st_rdev)))
attempt("open.char_device", lambda: os.close(os.open("cdev", os.O_RDONLY)))
attempt("mknod.exists", lambda: os.mkfifo("cdev"))
# The Delegator's file replaced by a FIFO (kept for the write-back check).
os.unlink("delegators")
os.mkfifo("delegators")
out("fifo.over_delegators_file", stat.S_ISFIFO(os.lstat("delegators").st_mode))
# A FIFO where a file was: the file's name now names the FIFO (kept for the write-back check).
write("was_file", b"replaced by a fifo")
os.unlink("was_file")
os.mkfifo("was_file")
out("fifo.over_file", stat.S_ISFIFO(os.lstat("was_file").st_mode))


# --- ownership ------------------------------------------------------------------------------
def as_user(name, f, uid=4242, gid=4343):
    """Run `f` in a child process as `uid`/`gid` (no other groups); print its result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                v = f()
                v = "ok" if v is None else v
            except OSError as e:
                v = errno.errorcode.get(e.errno, e.errno)
            os.write(w, str(v).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    out(name, os.read(r, 4096).decode())
    os.close(r)


def owner(path):
    st = os.lstat(path)
    return (st.st_uid, st.st_gid, oct(st.st_mode & 0o7777))


os.mkdir("own")
os.chmod("own", 0o777)
as_user("own.create", lambda: write("own/f", b"mine", 0o644))
as_user("own.mkdir", lambda: os.mkdir("own/d", 0o755))
as_user("own.symlink", lambda: os.symlink("f", "own/l"))
as_user("own.mkfifo", lambda: os.mkfifo("own/p", 0o644))
out("own.owners", [owner("own/" + n) for n in ("f", "d", "p")] + [os.lstat("own/l").st_uid])
write("own/rootf", b"root's", 0o666)
os.chmod("own/rootf", 0o666)
as_user("own.chmod_own", lambda: os.chmod("own/f", 0o640))
as_user("own.chmod_other", lambda: os.chmod("own/rootf", 0o600))
as_user("own.chown_to_root", lambda: os.chown("own/f", 0, -1))
as_user("own.chown_other_group", lambda: os.chown("own/f", -1, 0))
as_user("own.chown_own_group", lambda: os.chown("own/f", -1, 4343))
as_user("own.utime_other", lambda: os.utime("own/rootf", (1, 1)))
as_user("own.utime_now_writable", lambda: os.utime("own/rootf", None))
as_user("own.truncate_other_writable", lambda: os.truncate("own/rootf", 2))
# Set-user-ID and set-group-ID: a non-root owner's chown clears both (as ext4 does).
as_user("own.setid_chmod", lambda: os.chmod("own/f", 0o6755))
out("own.setid_mode", owner("own/f"))
as_user("own.setid_chown", lambda: os.chown("own/f", -1, 4343))
out("own.setid_after_chown", owner("own/f"))
# ... and root's, with group execute.
os.chmod("own/f", 0o6755)
os.chown("own/f", 4242, 4343)
out("own.setid_after_root_chown", owner("own/f"))
# chmod to set-group-ID by an owner outside the file's group drops the bit.
write("own/g", b"g", 0o644)
os.chown("own/g", 4242, 0)
as_user("own.setgid_non_member", lambda: os.chmod("own/g", 0o2755))
out("own.setgid_non_member_mode", owner("own/g"))
# Truncation by a non-owner clears set-user-ID (and set-group-ID with group execute).
write("own/t", b"truncate me", 0o666)
os.chmod("own/t", 0o6777)
as_user("own.truncate_setid", lambda: os.truncate("own/t", 1))
out("own.truncate_setid_mode", owner("own/t"))
# A set-group-ID directory gives its group to what is made in it; subdirectories inherit it.
os.mkdir("own/sg")
os.chown("own/sg", 0, 4444)
os.chmod("own/sg", 0o2777)
as_user("own.sg_create", lambda: write("own/sg/f", b"", 0o644))
as_user("own.sg_mkdir", lambda: os.mkdir("own/sg/d", 0o755))
out("own.sg_owners", (owner("own/sg/f"), owner("own/sg/d")))
# Sticky directory: only the owner of an entry (or of the directory) removes or renames it.
os.mkdir("own/st")
os.chmod("own/st", 0o1777)
write("own/st/roots", b"r", 0o666)
as_user("own.sticky_create", lambda: write("own/st/mine", b"m", 0o644))
as_user("own.sticky_unlink_other", lambda: os.unlink("own/st/roots"))
as_user("own.sticky_rename_other", lambda: os.rename("own/st/roots", "own/st/moved"))
as_user("own.sticky_rename_over_other", lambda: os.rename("own/st/mine", "own/st/roots"))
as_user("own.sticky_unlink_own", lambda: os.unlink("own/st/mine"))
out("own.sticky_left", sorted(os.listdir("own/st")))

# --- names over 255 bytes ---------------------------------------------------------------------
LONG = "n" * 256
os.mkdir("toolong")
write("toolong/f", b"f")
for op, f in [
    ("lookup", lambda: os.stat("toolong/" + LONG)),
    ("lstat", lambda: os.lstat("toolong/" + LONG)),
    ("open", lambda: os.open("toolong/" + LONG, os.O_RDONLY)),
    ("creat", lambda: os.open("toolong/" + LONG, os.O_WRONLY | os.O_CREAT, 0o644)),
    ("mkdir", lambda: os.mkdir("toolong/" + LONG)),
    ("mkfifo", lambda: os.mkfifo("toolong/" + LONG)),
    ("symlink", lambda: os.symlink("f", "toolong/" + LONG)),
    ("link", lambda: os.link("toolong/f", "toolong/" + LONG)),
    ("rename_from", lambda: os.rename("toolong/" + LONG, "toolong/g")),
    ("rename_to", lambda: os.rename("toolong/f", "toolong/" + LONG)),
    ("unlink", lambda: os.unlink("toolong/" + LONG)),
    ("rmdir", lambda: os.rmdir("toolong/" + LONG)),
    ("chmod", lambda: os.chmod("toolong/" + LONG, 0o600)),
    ("chown", lambda: os.chown("toolong/" + LONG, 0, 0)),
    ("truncate", lambda: os.truncate("toolong/" + LONG, 0)),
    ("utime", lambda: os.utime("toolong/" + LONG)),
    ("setxattr", lambda: os.setxattr("toolong/" + LONG, "user.x", b"1")),
    ("readlink", lambda: os.readlink("toolong/" + LONG)),
    ("symlink_target_ok", lambda: os.symlink(LONG, "toolong/s")),
]:
    attempt("nametoolong." + op, f)
out("nametoolong.left", sorted(os.listdir("toolong")))

# --- rmdir after emptying -------------------------------------------------------------------
os.mkdir("rmd")
write("rmd/a", b"a")
os.link("rmd/a", "rmd/a2")
os.mkfifo("rmd/p")
os.symlink("a", "rmd/s")
os.mkdir("rmd/sub")
write("rmd/sub/x", b"x")
os.rename("rmd/sub/x", "rmd/x")
for n in ("a", "a2", "p", "s", "x"):
    os.unlink("rmd/" + n)
os.rmdir("rmd/sub")
attempt("rmdir.emptied", lambda: os.rmdir("rmd"))
out("rmdir.gone", os.path.exists("rmd"))
out("done", True)
