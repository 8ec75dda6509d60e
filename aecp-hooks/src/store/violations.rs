//! The commit screen's side of the store: the current report per worker and path (what
//! `awcp-ctl aecp violations` lists, and what a mount's replica is seeded with), and the
//! two questions the screen asks on every commit — which modules have a contract, and which
//! revised modules a worker has not acknowledged.
//!
//! A report is replaced by the next one for the same worker and path and deleted when a
//! later write-back of that path passes; the verdicts themselves stay in the audit log.

use rusqlite::{OptionalExtension, params};
use serde::{Deserialize, Serialize};

use super::{Store, StoreError, now_ms, sql};
use crate::screen::StaleModule;

pub(super) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS aecp_violations (
    workspace TEXT NOT NULL,
    worker TEXT NOT NULL,
    path TEXT NOT NULL,
    report TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (worker, path)
);
CREATE INDEX IF NOT EXISTS aecp_violations_ws ON aecp_violations(workspace);
CREATE TABLE IF NOT EXISTS aecp_held (
    workspace TEXT NOT NULL,
    worker TEXT NOT NULL,
    path TEXT NOT NULL,
    content BLOB NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (worker, path)
);
CREATE INDEX IF NOT EXISTS aecp_held_ws ON aecp_held(workspace, path);
";

/// The largest held content kept for re-screening (a larger held file is released only by
/// a write-back that passes).
pub const MAX_HELD_CONTENT: usize = 4 << 20;

/// A write-back the screen held, with the content it held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldWrite {
    /// The worker whose write-back it is.
    pub worker: String,
    /// The file.
    pub path: String,
    /// What it wrote.
    pub content: Vec<u8>,
}

/// A current report of the commit screen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredViolation {
    /// The worker whose write-back it concerns.
    pub worker: String,
    /// The file.
    pub path: String,
    /// The report (`crate::screen::ScreenReport` as JSON).
    pub report: serde_json::Value,
    /// When it was made.
    pub at_ms: u64,
}

impl Store {
    /// Records (replacing) the report on `worker`'s write-back of `path`.
    pub fn set_violation(
        &self,
        workspace: &str,
        worker: &str,
        path: &str,
        report: &serde_json::Value,
    ) -> Result<(), StoreError> {
        self.conn
            .lock()
            .execute(
                "INSERT INTO aecp_violations (workspace, worker, path, report, at_ms) VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT(worker, path) DO UPDATE SET workspace = excluded.workspace, report = excluded.report, at_ms = excluded.at_ms",
                params![workspace, worker, path, report.to_string(), now_ms() as i64],
            )
            .map_err(sql("recording a violation"))?;
        Ok(())
    }

    /// Deletes the report on `worker`'s write-back of `path`; whether there was one.
    pub fn clear_violation(&self, worker: &str, path: &str) -> Result<bool, StoreError> {
        let n = self
            .conn
            .lock()
            .execute(
                "DELETE FROM aecp_violations WHERE worker = ?1 AND path = ?2",
                params![worker, path],
            )
            .map_err(sql("clearing a violation"))?;
        Ok(n > 0)
    }

    /// Keeps the content of `worker`'s held write-back of `path` (replacing an earlier one),
    /// so that a revision can screen it again; content over [`MAX_HELD_CONTENT`] is not
    /// kept (an earlier one is dropped).
    pub fn set_held(
        &self,
        workspace: &str,
        worker: &str,
        path: &str,
        content: &[u8],
    ) -> Result<(), StoreError> {
        let conn = self.conn.lock();
        if content.len() > MAX_HELD_CONTENT {
            conn.execute(
                "DELETE FROM aecp_held WHERE worker = ?1 AND path = ?2",
                params![worker, path],
            )
            .map_err(sql("forgetting a held write-back"))?;
            return Ok(());
        }
        conn.execute(
            "INSERT INTO aecp_held (workspace, worker, path, content, at_ms) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(worker, path) DO UPDATE SET workspace = excluded.workspace, content = excluded.content, at_ms = excluded.at_ms",
            params![workspace, worker, path, content, now_ms() as i64],
        )
        .map_err(sql("keeping a held write-back"))?;
        Ok(())
    }

    /// Forgets `worker`'s held write-back of `path`; whether there was one.
    pub fn clear_held(&self, worker: &str, path: &str) -> Result<bool, StoreError> {
        let n = self
            .conn
            .lock()
            .execute(
                "DELETE FROM aecp_held WHERE worker = ?1 AND path = ?2",
                params![worker, path],
            )
            .map_err(sql("forgetting a held write-back"))?;
        Ok(n > 0)
    }

    /// Forgets every report on `worker`'s files and every held content of it (its change
    /// set was discarded: nothing of it may stay behind); the paths that had a report.
    pub fn forget_worker_reports(&self, worker: &str) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn.lock();
        let tx = conn
            .transaction()
            .map_err(sql("forgetting a worker's reports"))?;
        let paths: Vec<String> = {
            let mut q = tx
                .prepare("SELECT path FROM aecp_violations WHERE worker = ?1 ORDER BY path")
                .map_err(sql("forgetting a worker's reports"))?;
            q.query_map(params![worker], |r| r.get(0))
                .map_err(sql("forgetting a worker's reports"))?
                .collect::<Result<_, _>>()
                .map_err(sql("forgetting a worker's reports"))?
        };
        tx.execute(
            "DELETE FROM aecp_violations WHERE worker = ?1",
            params![worker],
        )
        .map_err(sql("forgetting a worker's reports"))?;
        tx.execute("DELETE FROM aecp_held WHERE worker = ?1", params![worker])
            .map_err(sql("forgetting a worker's reports"))?;
        tx.commit().map_err(sql("forgetting a worker's reports"))?;
        Ok(paths)
    }

    /// The held write-backs of `path` in a workspace (every worker's).
    pub fn held_writes(&self, workspace: &str, path: &str) -> Result<Vec<HeldWrite>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare(
                "SELECT worker, path, content FROM aecp_held
                 WHERE workspace = ?1 AND path = ?2 ORDER BY worker",
            )
            .map_err(sql("listing held write-backs"))?;
        let rows = stmt
            .query_map(params![workspace, path], |r| {
                Ok(HeldWrite {
                    worker: r.get(0)?,
                    path: r.get(1)?,
                    content: r.get(2)?,
                })
            })
            .map_err(sql("listing held write-backs"))?;
        rows.collect::<Result<_, _>>()
            .map_err(sql("listing held write-backs"))
    }

    /// The current reports of a workspace (of one worker, if given), by worker and path.
    pub fn violations(
        &self,
        workspace: &str,
        worker: Option<&str>,
    ) -> Result<Vec<StoredViolation>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare(
                "SELECT worker, path, report, at_ms FROM aecp_violations
                 WHERE workspace = ?1 AND (?2 IS NULL OR worker = ?2) ORDER BY worker, path",
            )
            .map_err(sql("listing violations"))?;
        let rows = stmt
            .query_map(params![workspace, worker], |r| {
                Ok(StoredViolation {
                    worker: r.get(0)?,
                    path: r.get(1)?,
                    report: serde_json::from_str(&r.get::<_, String>(2)?).unwrap_or_default(),
                    at_ms: r.get::<_, i64>(3)? as u64,
                })
            })
            .map_err(sql("listing violations"))?;
        rows.collect::<Result<_, _>>()
            .map_err(sql("listing violations"))
    }

    /// The modules of a workspace that have a contract.
    pub fn contracted_modules(&self, workspace: &str) -> Result<Vec<String>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare(
                "SELECT DISTINCT module FROM aecp_contracts WHERE workspace = ?1 ORDER BY module",
            )
            .map_err(sql("listing contracted modules"))?;
        let rows = stmt
            .query_map(params![workspace], |r| r.get(0))
            .map_err(sql("listing contracted modules"))?;
        rows.collect::<Result<_, _>>()
            .map_err(sql("listing contracted modules"))
    }

    /// The revised modules `worker` consumes and has not acknowledged.
    pub fn stale_modules(
        &self,
        workspace: &str,
        worker: &str,
    ) -> Result<Vec<StaleModule>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare(
                "SELECT c.module, c.acked_revision,
                        (SELECT MAX(revision) FROM aecp_contracts k WHERE k.workspace = c.workspace AND k.module = c.module)
                 FROM aecp_consumers c WHERE c.workspace = ?1 AND c.worker = ?2 AND c.stale = 1 ORDER BY c.module",
            )
            .map_err(sql("listing stale modules"))?;
        let rows = stmt
            .query_map(params![workspace, worker], |r| {
                Ok(StaleModule {
                    module: r.get(0)?,
                    acked_revision: r.get(1)?,
                    revision: r.get::<_, Option<u32>>(2)?.unwrap_or(0),
                })
            })
            .map_err(sql("listing stale modules"))?;
        rows.collect::<Result<_, _>>()
            .map_err(sql("listing stale modules"))
    }

    /// Whether `module` has a contract in `workspace` (a cheap check before reading it).
    pub fn has_contract(&self, workspace: &str, module: &str) -> Result<bool, StoreError> {
        self.conn
            .lock()
            .query_row(
                "SELECT 1 FROM aecp_contracts WHERE workspace = ?1 AND module = ?2 LIMIT 1",
                params![workspace, module],
                |_| Ok(()),
            )
            .optional()
            .map(|r| r.is_some())
            .map_err(sql("looking up a contract"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn violations_are_replaced_listed_and_cleared() {
        let s = Store::in_memory().unwrap();
        let r1 = serde_json::json!({"verdict": "mismatch", "n": 1});
        let r2 = serde_json::json!({"verdict": "syntax", "n": 2});
        s.set_violation("/ws", "A", "pkg/a.py", &r1).unwrap();
        s.set_violation("/ws", "A", "pkg/a.py", &r2).unwrap();
        s.set_violation("/ws", "B", "pkg/b.py", &r1).unwrap();
        s.set_violation("/other", "C", "x.py", &r1).unwrap();
        let all = s.violations("/ws", None).unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].report, r2, "the newest report replaces the last");
        let a = s.violations("/ws", Some("A")).unwrap();
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].path, "pkg/a.py");
        assert!(s.clear_violation("A", "pkg/a.py").unwrap());
        assert!(!s.clear_violation("A", "pkg/a.py").unwrap());
        assert!(s.violations("/ws", Some("A")).unwrap().is_empty());
    }

    #[test]
    fn a_discarded_workers_reports_and_held_content_are_all_forgotten() {
        let s = Store::in_memory().unwrap();
        let r = serde_json::json!({"verdict": "mismatch"});
        s.set_violation("/ws", "A", "pkg/b.py", &r).unwrap();
        s.set_violation("/ws", "A", "pkg/a.py", &r).unwrap();
        s.set_held("/ws", "A", "pkg/a.py", b"def f(y): ...\n")
            .unwrap();
        s.set_violation("/ws", "B", "pkg/a.py", &r).unwrap();
        s.set_held("/ws", "B", "pkg/a.py", b"def f(z): ...\n")
            .unwrap();
        assert_eq!(
            s.forget_worker_reports("A").unwrap(),
            ["pkg/a.py", "pkg/b.py"]
        );
        assert!(s.violations("/ws", Some("A")).unwrap().is_empty());
        let held = s.held_writes("/ws", "pkg/a.py").unwrap();
        assert_eq!(held.len(), 1, "only B's held content stays");
        assert_eq!(held[0].worker, "B");
        assert_eq!(s.violations("/ws", Some("B")).unwrap().len(), 1);
        assert!(s.forget_worker_reports("A").unwrap().is_empty());
    }

    #[test]
    fn held_write_backs_survive_a_reopen_and_are_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("delegator.db");
        {
            let s = Store::open(&db).unwrap();
            s.set_held("/ws", "A", "pkg/a.py", b"def f(x): ...\n")
                .unwrap();
            s.set_held("/ws", "A", "pkg/a.py", b"def f(y): ...\n")
                .unwrap();
            s.set_held("/ws", "B", "pkg/a.py", b"B's\n").unwrap();
            s.set_held("/ws", "B", "pkg/b.py", b"other\n").unwrap();
            s.set_violation("/ws", "A", "pkg/a.py", &serde_json::json!({"held": true}))
                .unwrap();
        }
        // A restarted daemon opens the same file.
        let s = Store::open(&db).unwrap();
        let held = s.held_writes("/ws", "pkg/a.py").unwrap();
        assert_eq!(held.len(), 2);
        assert_eq!(
            (held[0].worker.as_str(), held[0].content.as_slice()),
            ("A", b"def f(y): ...\n".as_slice()),
            "the newest content replaces the last"
        );
        assert_eq!(s.violations("/ws", Some("A")).unwrap().len(), 1);
        assert!(s.clear_held("A", "pkg/a.py").unwrap());
        assert!(!s.clear_held("A", "pkg/a.py").unwrap());
        assert_eq!(s.held_writes("/ws", "pkg/a.py").unwrap().len(), 1);
        // Too large to keep: dropped, not kept stale.
        s.set_held("/ws", "B", "pkg/a.py", &vec![b'#'; MAX_HELD_CONTENT + 1])
            .unwrap();
        assert!(s.held_writes("/ws", "pkg/a.py").unwrap().is_empty());
    }

    #[test]
    fn stale_modules_follow_revise_and_ack() {
        let s = Store::in_memory().unwrap();
        let body = serde_json::json!({});
        assert!(s.contracted_modules("/ws").unwrap().is_empty());
        s.put_contract("/ws", "pkg/a.py", &body, "P").unwrap();
        assert!(s.has_contract("/ws", "pkg/a.py").unwrap());
        assert!(!s.has_contract("/ws", "pkg/b.py").unwrap());
        assert_eq!(s.contracted_modules("/ws").unwrap(), ["pkg/a.py"]);
        s.add_consumer("/ws", "pkg/a.py", "C", &[]).unwrap();
        assert!(s.stale_modules("/ws", "C").unwrap().is_empty());
        s.put_contract("/ws", "pkg/a.py", &body, "P").unwrap();
        assert_eq!(
            s.stale_modules("/ws", "C").unwrap(),
            [StaleModule {
                module: "pkg/a.py".into(),
                revision: 2,
                acked_revision: 1
            }]
        );
        s.ack("/ws", "pkg/a.py", "C").unwrap();
        assert!(s.stale_modules("/ws", "C").unwrap().is_empty());
    }
}
