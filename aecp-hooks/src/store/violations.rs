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
";

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
