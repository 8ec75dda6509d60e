//! A mount unmounted from outside (`umount`, `fusermount3 -u`) ends: its changes are
//! written back and the mount reports its end, instead of holding the lease and its state
//! directory with nothing left to serve. Over both FUSE transports.

use std::time::Duration;

use awcpfs::mount::EndReason;
use awcpfs::mount::uring::FuseTransport;
use awcpfs::testing::{fuse_available, uring_available};

mod common;
use common::InProcess;

fn unmounted_from_outside_case(transport: FuseTransport) {
    let mut m = InProcess::start(
        |src| std::fs::write(src.join("old.txt"), "old\n").unwrap(),
        |cfg| cfg.kernel.transport = transport,
    );
    // A change still on its way to the Delegator when the mount point goes away.
    std::fs::write(m.mnt.join("new.txt"), "written just before the unmount\n").unwrap();
    let out = std::process::Command::new("umount")
        .arg(&m.mnt)
        .output()
        .expect("running umount");
    assert!(
        out.status.success(),
        "umount failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        m.mount().wait(Duration::from_secs(20)),
        Some(EndReason::Unmounted),
        "the mount did not end after its mount point was unmounted"
    );
    assert_eq!(
        std::fs::read_to_string(m.src.join("new.txt")).unwrap(),
        "written just before the unmount\n",
        "the change made before the unmount did not reach the Delegator"
    );
    assert!(!m.mount().unsynced());
    m.end();
}

#[test]
fn a_mount_unmounted_from_outside_writes_back_and_ends() {
    if !fuse_available() {
        return;
    }
    unmounted_from_outside_case(FuseTransport::Dev);
}

#[test]
fn a_mount_unmounted_from_outside_writes_back_and_ends_over_io_uring() {
    if !uring_available() {
        return;
    }
    unmounted_from_outside_case(FuseTransport::Uring);
}
