//! The toolchain matrix of issue 4: the real tools an agent runs, on a real mount, end to
//! end. Each test delegates a workspace, runs a tool's whole workflow on the mount as the
//! agent, and then checks what arrived at the Delegator.
//!
//! The agent is a shell script (`set -eu`) written next to the temp dir's state; its output
//! goes to `agent.log` there and is printed when the delegation does not complete. Missing
//! tools fail the test under `CI=true` (`.ci/run` installs them) and skip it loudly elsewhere.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::{Harness, fuse_available, sample_repo, sh, tools_available, uring_available};
use awcpfs::mount::FuseTransport;

const TASK_TIMEOUT: Duration = Duration::from_secs(240);

/// The agent command: run `agent.sh` from the temp dir (three levels above the mount point
/// `<tmp>/executor/work/<id>`), output to `agent.log` beside it.
const AGENT: &str = "exec sh -eu ../../../agent.sh > ../../../agent.log 2>&1";

struct Run {
    h: Harness,
    repo: PathBuf,
}

impl Run {
    fn tmp(&self) -> &Path {
        self.h.tmp.path()
    }
}

/// Start the services, let `setup` fill the Delegator's workspace (`repo`) and the temp dir,
/// delegate `repo` read-write, run `script` as the agent and wait for the end. Panics with
/// the agent's output unless the delegation completed.
async fn run_agent(script: &str, setup: impl FnOnce(&Path, &Path)) -> Run {
    run_agent_with(script, setup, false).await
}

/// [`run_agent`], with the mounts' writeback cache on when `writeback_cache` is set.
async fn run_agent_with(
    script: &str,
    setup: impl FnOnce(&Path, &Path),
    writeback_cache: bool,
) -> Run {
    run_agent_cfg(script, setup, |c| c.writeback_cache = writeback_cache).await
}

/// [`run_agent_with`], the mounts served over `transport`.
async fn run_agent_on(
    script: &str,
    setup: impl FnOnce(&Path, &Path),
    writeback_cache: bool,
    transport: FuseTransport,
) -> Run {
    run_agent_cfg(script, setup, |c| {
        c.writeback_cache = writeback_cache;
        c.fuse_transport = transport;
    })
    .await
}

/// [`run_agent`], adjusting the Executor's config first. The agent runs confined, as by
/// default, and may also write in the temp dir (`../../..`: its script, its log, fixtures),
/// which the harness shares with it.
async fn run_agent_cfg(
    script: &str,
    setup: impl FnOnce(&Path, &Path),
    adjust: impl FnOnce(&mut awcp_ctl::executor::ExecutorConfig),
) -> Run {
    let mut as_root = false;
    let h = Harness::start_with(AGENT, |c| {
        adjust(c);
        as_root = c.unsafe_agent_as_root;
    })
    .await;
    let repo = h.path("repo");
    std::fs::create_dir_all(&repo).unwrap();
    setup(h.tmp.path(), &repo);
    std::fs::write(h.path("agent.sh"), script).unwrap();
    // What the setup left beside the workspace (a bare repository, fixtures) is the agent
    // user's, as a directory shared with it would be (git refuses a repository of another
    // owner).
    if let Some(u) = awcp_tests::default_agent_user().filter(|_| !as_root) {
        for entry in std::fs::read_dir(h.tmp.path()).unwrap().flatten() {
            let name = entry.file_name();
            if !["executor", "delegator", "repo"].contains(&name.to_str().unwrap_or("")) {
                sh(
                    h.tmp.path(),
                    &format!("chown -R {}:{} '{}'", u.uid, u.gid, entry.path().display()),
                );
            }
        }
    }
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    let state = h.wait_end(&id, TASK_TIMEOUT).await;
    let log = std::fs::read_to_string(h.path("agent.log")).unwrap_or_default();
    assert_eq!(
        state,
        DelegationState::Completed,
        "the agent failed; its output:\n{log}\nrecord: {:?}",
        h.client.get(&id).await.map(|v| v.record)
    );
    eprintln!("agent output:\n{log}");
    Run { h, repo }
}

fn read(p: impl AsRef<Path>) -> String {
    let p = p.as_ref();
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn git_clone_branch_rebase_merge_stash_gc_on_the_mount() {
    git_clone_branch_rebase_merge_stash_gc_on_the_mount_case(false, FuseTransport::Auto).await;
}

/// The same over FUSE-over-io_uring (the second adapter).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uring_git_clone_branch_rebase_merge_stash_gc_on_the_mount() {
    if uring_available() {
        git_clone_branch_rebase_merge_stash_gc_on_the_mount_case(false, FuseTransport::Uring).await;
    }
}

/// The same with git's index, packs and refs written through the kernel's writeback cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wbcache_git_clone_branch_rebase_merge_stash_gc_with_the_writeback_cache() {
    git_clone_branch_rebase_merge_stash_gc_on_the_mount_case(true, FuseTransport::Auto).await;
}

async fn git_clone_branch_rebase_merge_stash_gc_on_the_mount_case(
    writeback_cache: bool,
    transport: FuseTransport,
) {
    if !fuse_available() || !tools_available(&["git"]) {
        return;
    }
    let script = r#"
        G="git -c user.email=agent@x -c user.name=agent -c gc.auto=0"
        T=../../..
        # A clone from a bare repository outside the mount.
        $G clone -q $T/bare.git from-bare
        cd from-bare
        $G checkout -q -b feature
        echo "feature work" > feature.txt
        $G add feature.txt && $G commit -qm "feature: add"
        $G checkout -q main
        echo "main work" >> README.md
        $G commit -qam "main: edit readme"
        $G checkout -q feature
        $G rebase -q main
        test "$($G log --format=%s -1 HEAD~1)" = "main: edit readme"
        $G checkout -q main
        $G merge -q --no-ff -m "merge feature" feature
        test -f feature.txt
        # stash and pop
        echo "wip" >> feature.txt
        $G stash -q
        test "$(cat feature.txt)" = "feature work"
        $G stash pop -q
        grep -q wip feature.txt
        $G commit -qam "wip committed"
        $G gc -q --prune=now
        $G fsck --strict
        $G push -q origin main
        test -z "$($G status --porcelain)"
        cd ..
        # A clone of the Delegator's repository (the workspace itself), local (hard links
        # for the objects) and through the pack protocol.
        $G clone -q . clone-local
        $G clone -q --no-local . clone-packed
        (cd clone-local && $G fsck --strict && test -f calc/ops.py)
        (cd clone-packed && $G fsck --strict && test -f calc/ops.py)
        # git status after changes made by other tools.
        test -z "$($G status --porcelain --untracked-files=no)"
        sed -i 's/add/plus/' calc/ops.py
        touch README.md
        chmod +x calc/__init__.py
        mv tool.sh tool2.sh
        echo new > untracked.txt
        $G status --porcelain > ../../../status.txt
        $G add -A && $G commit -qm "agent: external changes"
        test -z "$($G status --porcelain)"
        echo git-ok
    "#;
    let run = run_agent_on(
        script,
        |tmp, repo| {
            sample_repo(repo);
            // The bare repository the agent clones from: a copy of the sample's history.
            sh(tmp, "git clone -q --bare repo bare.git");
            // Clones inside the workspace would make the Delegator's repo see nested repos;
            // that is what an agent does, so keep them.
        },
        writeback_cache,
        transport,
    )
    .await;
    let status = read(run.tmp().join("status.txt"));
    for want in [
        " M calc/ops.py",
        " M calc/__init__.py",
        " D tool.sh",
        "?? tool2.sh",
        "?? untracked.txt",
    ] {
        assert!(
            status.contains(want),
            "git status missed {want:?}:\n{status}"
        );
    }
    assert!(
        !status.contains("README.md"),
        "a touch alone must not show as a change:\n{status}"
    );
    // At the Delegator: the workspace's own repository, the clones, and the bare repository
    // the agent pushed to.
    assert_eq!(sh(&run.repo, "git status --porcelain"), "");
    assert!(sh(&run.repo, "git log --format=%s -1").starts_with("agent: external changes"));
    for clone in ["from-bare", "clone-local", "clone-packed"] {
        sh(&run.repo.join(clone), "git fsck --strict");
        assert_eq!(sh(&run.repo.join(clone), "git status --porcelain"), "");
    }
    // The bare repository is the agent user's now (git refuses another owner's).
    let log = sh(
        &run.tmp().join("bare.git"),
        "git -c safe.directory='*' log --format=%s main",
    );
    assert!(log.starts_with("wip committed\nmerge feature\n"), "{log}");
    run.h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn make_with_gcc_dependency_files_and_rebuild_after_touch() {
    make_with_gcc_dependency_files_and_rebuild_after_touch_case(false).await;
}

/// The same with the linker's scattered small writes batched by the kernel's writeback cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wbcache_make_with_gcc_and_rebuild_with_the_writeback_cache() {
    make_with_gcc_dependency_files_and_rebuild_after_touch_case(true).await;
}

async fn make_with_gcc_dependency_files_and_rebuild_after_touch_case(writeback_cache: bool) {
    if !fuse_available() || !tools_available(&["make", "gcc"]) {
        return;
    }
    let script = r#"
        make > build1.log
        ./app > run1.txt
        make -q  # up to date: exit 0, nothing run
        test -f main.d && test -f util.d
        grep -q util.h main.d
        touch util.h
        make > build2.log
        grep -q "main.c" build2.log && grep -q "util.c" build2.log
        sed -i 's/41/42/' util.c
        make > build3.log
        grep -q "util.c" build3.log
        ! grep -q "main.c" build3.log
        ./app > run2.txt
        make -q
        echo make-ok
    "#;
    let run = run_agent_with(script, |_, repo| {
        std::fs::write(
            repo.join("Makefile"),
            "CFLAGS = -O0 -MMD -MP\nOBJS = main.o util.o\n\nall: app\n\napp: $(OBJS)\n\tgcc -o $@ $(OBJS)\n\n%.o: %.c\n\tgcc $(CFLAGS) -c -o $@ $<\n\n-include $(OBJS:.o=.d)\n",
        )
        .unwrap();
        std::fs::write(repo.join("util.h"), "int answer(void);\n").unwrap();
        std::fs::write(
            repo.join("util.c"),
            "#include \"util.h\"\nint answer(void) { return 41; }\n",
        )
        .unwrap();
        std::fs::write(
            repo.join("main.c"),
            "#include <stdio.h>\n#include \"util.h\"\nint main(void) { printf(\"%d\\n\", answer()); return 0; }\n",
        )
        .unwrap();
    }, writeback_cache)
    .await;
    assert_eq!(read(run.repo.join("run1.txt")), "41\n");
    assert_eq!(read(run.repo.join("run2.txt")), "42\n");
    // The binary and the dependency files came back; the binary runs at the Delegator.
    assert_eq!(sh(&run.repo, "./app"), "42\n");
    assert!(read(run.repo.join("main.d")).contains("util.h"));
    let mode = std::fs::metadata(run.repo.join("app")).unwrap().mode();
    assert_eq!(mode & 0o111, 0o111, "the linker's exec bits: {mode:o}");
    // What gcc's assembler and linker created, the Executor's mount handed to the kernel
    // (`--passthrough-writes toolchain`, its default) — except under the writeback cache,
    // which excludes it. Counted once the mount has ended.
    let url = format!(
        "{}/metrics",
        run.h.executor.awcp_url().trim_end_matches("/awcp")
    );
    let credential = run.h.credential();
    let mut m = crate::metrics::scrape(&url, Some(&credential)).await;
    let started = std::time::Instant::now();
    while m.get("awcp_mounts_total") != Some(&1.0) && started.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        m = crate::metrics::scrape(&url, Some(&credential)).await;
    }
    let passed = crate::metrics::get(&m, "awcp_mount_passthrough_opens_total");
    if writeback_cache {
        assert_eq!(passed, 0.0, "passthrough under the writeback cache");
    } else {
        // main.o, util.o, app three times over, and the dependency files.
        assert!(passed >= 5.0, "{passed} files passed through");
    }
    run.h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite3_transactions_and_concurrent_writers_arrive_intact() {
    sqlite3_transactions_and_concurrent_writers_arrive_intact_case(false).await;
}

/// The same with a WAL database's shared writable mapping and two writers under the writeback cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wbcache_sqlite3_concurrent_writers_with_the_writeback_cache() {
    sqlite3_transactions_and_concurrent_writers_arrive_intact_case(true).await;
}

async fn sqlite3_transactions_and_concurrent_writers_arrive_intact_case(writeback_cache: bool) {
    if !fuse_available() || !tools_available(&["sqlite3"]) {
        return;
    }
    // Two writers at once (locking within the Executor), a rollback-journal database and a
    // WAL one (its -shm file is a shared writable mapping).
    let script = r#"
        sqlite3 rollback.db "CREATE TABLE t(i INTEGER PRIMARY KEY, v TEXT);"
        sqlite3 wal.db "PRAGMA journal_mode=WAL; CREATE TABLE t(i INTEGER PRIMARY KEY, v TEXT);" > /dev/null
        for db in rollback.db wal.db; do
          for w in 1 2; do
            (
              n=0
              while [ $n -lt 20 ]; do
                sqlite3 -cmd ".timeout 10000" $db "BEGIN IMMEDIATE; WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<50) INSERT INTO t(v) SELECT 'w$w-$n-' || x FROM c; COMMIT;"
                n=$((n+1))
              done
            ) &
          done
          wait
        done
        sqlite3 rollback.db "BEGIN; INSERT INTO t(v) VALUES('rolled back'); ROLLBACK;"
        test "$(sqlite3 rollback.db 'SELECT count(*) FROM t')" = 2000
        test "$(sqlite3 wal.db 'SELECT count(*) FROM t')" = 2000
        test "$(sqlite3 rollback.db 'PRAGMA integrity_check')" = ok
        echo sqlite-ok
    "#;
    let run = run_agent_with(script, |_, _| {}, writeback_cache).await;
    for db in ["rollback.db", "wal.db"] {
        assert_eq!(
            sh(&run.repo, &format!("sqlite3 {db} 'PRAGMA integrity_check'")),
            "ok\n"
        );
        assert_eq!(
            sh(
                &run.repo,
                &format!(
                    "sqlite3 {db} \"SELECT count(*), count(DISTINCT v) FROM t WHERE v LIKE 'w%'\""
                )
            ),
            "2000|2000\n",
            "{db}"
        );
    }
    assert!(!run.repo.join("rollback.db-journal").exists());
    assert!(
        !run.repo.join("wal.db-wal").exists(),
        "WAL not checkpointed"
    );
    run.h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_venv_editable_install_tests_and_compileall() {
    python_venv_editable_install_tests_and_compileall_case(false, FuseTransport::Auto).await;
}

/// The same over FUSE-over-io_uring.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uring_python_venv_editable_install_tests_and_compileall() {
    if uring_available() {
        python_venv_editable_install_tests_and_compileall_case(false, FuseTransport::Uring).await;
    }
}

/// The same with thousands of small .pyc and venv files written through the writeback cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wbcache_python_venv_tests_and_compileall_with_the_writeback_cache() {
    python_venv_editable_install_tests_and_compileall_case(true, FuseTransport::Auto).await;
}

async fn python_venv_editable_install_tests_and_compileall_case(
    writeback_cache: bool,
    transport: FuseTransport,
) {
    if !fuse_available() || !tools_available(&["python3"]) {
        return;
    }
    // `pip install -e .` without the network: with setuptools when the venv has it and wheel
    // (`--no-build-isolation` uses the venv's own), else with a build backend that ships in
    // the package (`backend-path`), so nothing is downloaded either way.
    let script = r#"
        python3 -m venv .venv
        .venv/bin/python -m pip --version
        if .venv/bin/python -c 'import setuptools, wheel' 2> /dev/null; then
          echo "backend: setuptools"
          cp pyproject-setuptools.toml pyproject.toml
        else
          echo "backend: in-tree (the venv has no setuptools and wheel)"
          cp pyproject-intree.toml pyproject.toml
        fi
        PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
          .venv/bin/python -m pip install -q --no-index --no-build-isolation -e .
        cd /
        "$AWCP_WORKSPACE/.venv/bin/python" -c 'import calc.ops as o; assert o.add(2, 3) == 5'
        cd "$AWCP_WORKSPACE"
        # An edit shows through the editable install at once.
        sed -i 's/return a \* b/return a * b  # edited/' calc/ops.py
        .venv/bin/python -m unittest discover -q -s tests -t . 2> unittest.log
        grep -q OK unittest.log
        .venv/bin/python -m compileall -q calc tests
        ls calc/__pycache__ > pycache.txt
        echo python-ok
    "#;
    let run = run_agent_on(script, |_, repo| {
        sample_repo(repo);
        std::fs::write(
            repo.join("pyproject-setuptools.toml"),
            "[build-system]\nrequires = [\"setuptools\"]\nbuild-backend = \"setuptools.build_meta\"\n\n[project]\nname = \"calc\"\nversion = \"0.1\"\n\n[tool.setuptools]\npackages = [\"calc\"]\n",
        )
        .unwrap();
        std::fs::write(
            repo.join("pyproject-intree.toml"),
            "[build-system]\nrequires = []\nbuild-backend = \"backend\"\nbackend-path = [\"_build\"]\n\n[project]\nname = \"calc\"\nversion = \"0.1\"\n",
        )
        .unwrap();
        std::fs::create_dir_all(repo.join("_build")).unwrap();
        // A PEP 660 backend: an editable wheel is a .pth file pointing at the source tree.
        std::fs::write(
            repo.join("_build/backend.py"),
            r#"import base64, hashlib, os, zipfile

NAME, VERSION = "calc", "0.1"
DIST = f"{NAME}-{VERSION}.dist-info"


def _record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _wheel(directory, files):
    wheel = f"{NAME}-{VERSION}-py3-none-any.whl"
    files[f"{DIST}/METADATA"] = f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n".encode()
    files[f"{DIST}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: in-tree\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [_record_line(n, d) for n, d in files.items()] + [f"{DIST}/RECORD,,"]
    files[f"{DIST}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(os.path.join(directory, wheel), "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
    return wheel


def get_requires_for_build_editable(config_settings=None):
    return []


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return _wheel(wheel_directory, {f"_{NAME}_editable.pth": (src + "\n").encode()})


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise NotImplementedError("only editable installs")
"#,
        )
        .unwrap();
    }, writeback_cache, transport)
    .await;
    let log = read(run.tmp().join("agent.log"));
    assert!(log.contains("python-ok"), "{log}");
    assert!(read(run.repo.join("unittest.log")).contains("Ran 2 tests"));
    let pycache = read(run.repo.join("pycache.txt"));
    assert!(pycache.contains("ops.cpython-"), "{pycache}");
    // The venv and the compiled files are at the Delegator.
    assert!(run.repo.join(".venv/pyvenv.cfg").is_file());
    assert!(sh(&run.repo, "ls calc/__pycache__").contains("ops.cpython-"));
    let pth = sh(
        &run.repo,
        "cat .venv/lib/python3*/site-packages/*.pth 2>/dev/null; ls .venv/lib/python3*/site-packages",
    );
    assert!(pth.contains("calc"), "editable install missing: {pth}");
    run.h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cargo_new_build_test_with_a_vendored_path_dependency() {
    if !fuse_available() || !tools_available(&["cargo"]) {
        return;
    }
    // Offline, with a CARGO_HOME of its own outside the mount and the target dir on the
    // mount (the test process's CARGO_TARGET_DIR must not leak in).
    let script = r#"
        unset CARGO_TARGET_DIR RUSTFLAGS CARGO_BUILD_TARGET_DIR
        export CARGO_HOME="$PWD/../../../cargo-home" CARGO_NET_OFFLINE=true CARGO_TERM_COLOR=never
        cargo new -q --vcs none app
        cd app
        printf 'greet = { path = "../vendor/greet" }\n' >> Cargo.toml
        cat > src/main.rs <<'RS'
fn main() {
    println!("{}", greet::hello("mount"));
}

#[cfg(test)]
mod tests {
    #[test]
    fn greets() {
        assert_eq!(greet::hello("x"), "hello, x");
    }
}
RS
        cargo build 2> build1.log
        grep -q "Compiling greet" build1.log
        ./target/debug/app > ../run1.txt
        cargo test -q 2> test.log > test.out
        grep -q "test result: ok. 1 passed" test.out
        cargo build 2> build2.log
        ! grep -q Compiling build2.log
        sed -i 's/"hello, {name}"/"hi, {name}"/' ../vendor/greet/src/lib.rs
        sed -i 's/"hello, x"/"hi, x"/' src/main.rs
        cargo build 2> build3.log
        grep -q "Compiling greet" build3.log && grep -q "Compiling app" build3.log
        ./target/debug/app > ../run2.txt
        cargo test -q > test2.out 2>&1
        echo cargo-ok
    "#;
    let run = run_agent_cfg(
        script,
        |_, repo| {
            let lib = repo.join("vendor/greet/src");
            std::fs::create_dir_all(&lib).unwrap();
            std::fs::write(
                repo.join("vendor/greet/Cargo.toml"),
                "[package]\nname = \"greet\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
            )
            .unwrap();
            std::fs::write(
                lib.join("lib.rs"),
                "pub fn hello(name: &str) -> String {\n    format!(\"hello, {name}\")\n}\n",
            )
            .unwrap();
        },
        // rustup's toolchain lives under /root (0700 here), out of the agents' user's
        // reach: this agent runs as root, still under Landlock, reading the toolchain.
        |c| {
            c.unsafe_agent_as_root = true;
            c.agent_allow_read
                .extend(["/root/.cargo", "/root/.rustup"].map(PathBuf::from));
        },
    )
    .await;
    assert_eq!(read(run.repo.join("run1.txt")), "hello, mount\n");
    assert_eq!(read(run.repo.join("run2.txt")), "hi, mount\n");
    assert!(read(run.repo.join("app/Cargo.toml")).contains("greet = { path"));
    assert!(run.repo.join("app/Cargo.lock").is_file());
    assert_eq!(sh(&run.repo, "./app/target/debug/app"), "hi, mount\n");
    run.h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vim_scripted_edits_with_swap_and_backup_files() {
    if !fuse_available() || !tools_available(&["vim"]) {
        return;
    }
    // Two save strategies: rename the original to the backup and write a new file
    // (`backupcopy=no`), and copy to the backup then overwrite in place (`backupcopy=yes`).
    // `backupskip=` because its default skips backups under /tmp, where the mount is.
    let script = r#"
        chmod 640 a.txt b.txt
        vim -es -N -u NONE -i NONE -c 'set swapfile backup backupskip= writebackup backupcopy=no' \
            -c '%s/old/new/g' -c 'wq' a.txt
        vim -es -N -u NONE -i NONE -c 'set swapfile backup backupskip= writebackup backupcopy=yes' \
            -c '%s/old/new/g' -c 'wq' b.txt
        # An edit abandoned after its swap file was written: the file is untouched and
        # the swap file is gone.
        vim -es -N -u NONE -i NONE -c 'set swapfile updatecount=1' -c '%s/old/new/g' \
            -c 'preserve' -c 'q!' c.txt
        test -z "$(ls -A | grep '\.swp$' || true)"
        echo vim-ok
    "#;
    let run = run_agent(script, |_, repo| {
        for f in ["a.txt", "b.txt", "c.txt"] {
            std::fs::write(repo.join(f), "old line\nanother old one\n").unwrap();
        }
    })
    .await;
    for f in ["a.txt", "b.txt"] {
        assert_eq!(read(run.repo.join(f)), "new line\nanother new one\n", "{f}");
        assert_eq!(
            read(run.repo.join(format!("{f}~"))),
            "old line\nanother old one\n",
            "{f}~"
        );
        let mode = std::fs::metadata(run.repo.join(f)).unwrap().mode();
        assert_eq!(mode & 0o777, 0o640, "{f}: mode after save {mode:o}");
    }
    assert_eq!(read(run.repo.join("c.txt")), "old line\nanother old one\n");
    run.h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tar_extracts_hard_links_symlinks_modes_and_times() {
    if !fuse_available() || !tools_available(&["tar"]) {
        return;
    }
    let script = r#"
        mkdir x
        tar -xpf ../../../fixture.tar -C x
        # Hard links share one inode and count their links.
        test "$(stat -c %i x/t/data.bin)" = "$(stat -c %i x/t/hard.bin)"
        test "$(stat -c %h x/t/data.bin)" = 2
        test "$(readlink x/t/rel-link)" = data.bin
        test "$(readlink x/t/sub/up-link)" = ../data.bin
        cmp x/t/sub/up-link x/t/data.bin
        test "$(stat -c %a x/t/run.sh)" = 751
        test "$(stat -c %Y x/t/old.txt)" = 1000000000
        # Writing through one name shows through the other.
        echo more >> x/t/hard.bin
        cmp x/t/data.bin x/t/hard.bin
        # And the archive made on the mount lists the same entries.
        tar -cf again.tar -C x t
        tar -tvf again.tar > again.txt
        echo tar-ok
    "#;
    let run = run_agent(script, |tmp, _| {
        let t = tmp.join("fixture/t");
        std::fs::create_dir_all(t.join("sub")).unwrap();
        std::fs::write(t.join("data.bin"), vec![7u8; 70_000]).unwrap();
        std::fs::hard_link(t.join("data.bin"), t.join("hard.bin")).unwrap();
        std::os::unix::fs::symlink("data.bin", t.join("rel-link")).unwrap();
        std::os::unix::fs::symlink("../data.bin", t.join("sub/up-link")).unwrap();
        std::fs::write(t.join("run.sh"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(t.join("run.sh"), std::fs::Permissions::from_mode(0o751)).unwrap();
        std::fs::write(t.join("old.txt"), "old\n").unwrap();
        sh(
            tmp,
            "touch -d @1000000000 fixture/t/old.txt && tar -cf fixture.tar -C fixture t",
        );
    })
    .await;
    let x = run.repo.join("x/t");
    let mut want = vec![7u8; 70_000];
    want.extend_from_slice(b"more\n");
    assert_eq!(std::fs::read(x.join("data.bin")).unwrap(), want);
    assert_eq!(std::fs::read(x.join("hard.bin")).unwrap(), want);
    assert_eq!(
        std::fs::read_link(x.join("sub/up-link")).unwrap(),
        Path::new("../data.bin")
    );
    assert_eq!(
        std::fs::metadata(x.join("run.sh")).unwrap().mode() & 0o7777,
        0o751
    );
    assert_eq!(
        std::fs::metadata(x.join("old.txt")).unwrap().mtime(),
        1_000_000_000
    );
    // Hard links arrive as hard links.
    let a = std::fs::metadata(x.join("data.bin")).unwrap();
    let b = std::fs::metadata(x.join("hard.bin")).unwrap();
    assert_eq!(a.ino(), b.ino(), "hard links written back as copies");
    assert_eq!(a.nlink(), 2);
    let listing = read(run.repo.join("again.txt"));
    assert!(
        listing.contains("t/hard.bin link to t/data.bin"),
        "{listing}"
    );
    run.h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rsync_into_the_mount_and_cp_a_out_preserve_modes_and_times() {
    if !fuse_available() || !tools_available(&["rsync", "cp"]) {
        return;
    }
    let script = r#"
        T=../../..
        rsync -a $T/src/ synced/
        # A second run finds nothing to do: sizes, times and modes all match.
        test -z "$(rsync -ai $T/src/ synced/)"
        # Change one file at the source; rsync's delta transfer rewrites only it.
        echo changed >> $T/src/a.txt
        rsync -ai $T/src/ synced/ > second.txt
        grep -q a.txt second.txt
        # cp -a out of the mount, and within it.
        cp -a synced $T/out
        cp -a synced copy
        echo rsync-ok
    "#;
    let run = run_agent(script, |tmp, _| {
        let s = tmp.join("src");
        std::fs::create_dir_all(s.join("d/e")).unwrap();
        std::fs::write(s.join("a.txt"), "a\n").unwrap();
        std::fs::write(s.join("d/big.bin"), vec![3u8; 300_000]).unwrap();
        std::fs::write(s.join("d/e/x.sh"), "#!/bin/sh\n").unwrap();
        std::os::unix::fs::symlink("../a.txt", s.join("d/link")).unwrap();
        sh(
            tmp,
            "chmod 700 src/d/e/x.sh && chmod 750 src/d && touch -d @1200000000 src/a.txt src/d/big.bin && touch -h -d @1300000000 src/d/link",
        );
    })
    .await;
    let tmp = run.tmp().to_path_buf();
    // The tree at the Delegator, the one copied out, and the one copied within the mount
    // all match the source in content, mode and mtime.
    for tree in [
        run.repo.join("synced"),
        tmp.join("out"),
        run.repo.join("copy"),
    ] {
        let diff = sh(
            &tmp,
            // Owners aside: the agent runs unprivileged, and what it writes is its own.
            &format!(
                "rsync -ainOJ --no-owner --no-group --delete src/ {}/",
                tree.display()
            ),
        );
        assert_eq!(
            diff,
            "",
            "{} differs from the source:\n{diff}",
            tree.display()
        );
        let m = std::fs::metadata(tree.join("d/e/x.sh")).unwrap();
        assert_eq!(m.mode() & 0o777, 0o700, "{}", tree.display());
        let m = std::fs::metadata(tree.join("d")).unwrap();
        assert_eq!(m.mode() & 0o777, 0o750, "{}", tree.display());
    }
    // File mtimes survive the write-back; directory times are local to the mount (see
    // SEMANTICS.md), so only `out` (copied from the mount) has them.
    assert_eq!(
        std::fs::metadata(run.repo.join("synced/d/big.bin"))
            .unwrap()
            .mtime(),
        1_200_000_000
    );
    assert_eq!(
        std::fs::metadata(tmp.join("out/d/big.bin"))
            .unwrap()
            .mtime(),
        1_200_000_000
    );
    run.h.stop().await;
}
