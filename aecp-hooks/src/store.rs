//! The AECP store: artifacts, deliveries, ownership, contracts and their consumers, and an
//! append-only audit log — SQLite tables in the daemon's database (`delegator.db`), opened on
//! their own connection (the daemon's delegation table is untouched; WAL lets both write).
//!
//! The audit log (`aecp_audit`) is append-only by construction: triggers abort any `UPDATE`
//! or `DELETE` of it. Every state change below appends its entry in the same transaction, so
//! what the log says happened did happen. Kinds: `publish`, `witness`, `delivery`, `flag`,
//! `refutation`, `declaration`, `revision`, `dependency` (a consumer registered: `"auto"`
//! says whether by the mount's observer), `acknowledgement`, `verdict`, `rejection`.
//!
//! Contracts are stored as JSON blobs (their model belongs to the contract library) with
//! their consumers and stale flags, so the contract pipeline plugs in without a migration.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, Transaction, params};
use serde::{Deserialize, Serialize};

use crate::knowledge::{Artifact, ArtifactId, Draft, WitnessStatus};
use crate::policy::Owner;
use crate::witness::WitnessRun;

/// A store failure.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite refused.
    #[error("AECP store: {context}")]
    Sqlite {
        /// What was being done.
        context: &'static str,
        /// The cause.
        #[source]
        source: rusqlite::Error,
    },
    /// A stored row does not decode.
    #[error("AECP store: row {id} of {table} is not valid JSON")]
    Corrupt {
        /// The table.
        table: &'static str,
        /// The row.
        id: i64,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// No artifact with that id.
    #[error("no artifact {id}: see `awcp-ctl aecp list` for the ids")]
    UnknownArtifact {
        /// The id.
        id: ArtifactId,
    },
    /// No contract for that module.
    #[error("no contract for module `{module}` in this workspace")]
    UnknownContract {
        /// The module path.
        module: String,
    },
}

mod violations;

pub use violations::{HeldWrite, MAX_HELD_CONTENT, StoredViolation};

fn sql(context: &'static str) -> impl FnOnce(rusqlite::Error) -> StoreError {
    move |source| StoreError::Sqlite { context, source }
}

/// One audit log entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditEntry {
    /// Position in the log (strictly increasing).
    pub seq: i64,
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// The workspace (Delegator directory).
    pub workspace: String,
    /// What happened (see the module docs).
    pub kind: String,
    /// The artifact concerned, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<ArtifactId>,
    /// The worker that acted or was acted upon, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// Details (JSON).
    pub detail: serde_json::Value,
}

/// A stored contract revision (the body is the contract library's JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredContract {
    /// The module path, workspace-relative (`pkg/acct.py`).
    pub module: String,
    /// 1 for the declaration, +1 per revision.
    pub revision: u32,
    /// The contract as JSON.
    pub body: serde_json::Value,
    /// The worker that declared or revised it.
    pub by: String,
    /// When.
    pub at_ms: u64,
}

/// A consumer of a contracted module.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Consumer {
    /// The worker.
    pub worker: String,
    /// The symbols it depends on (empty: the whole module).
    pub symbols: Vec<String>,
    /// The revision it last acknowledged (or registered at).
    pub acked_revision: u32,
    /// Whether a newer revision awaits its acknowledgement.
    pub stale: bool,
}

/// Most files recorded as one worker's written-back files (its ownership without `--owns`):
/// a worker that writes back a whole generated tree owns its first 10,000 files, which keeps
/// the row and the forwarding decision small.
pub const MAX_WRITTEN: usize = 10_000;

/// The AECP tables on one SQLite connection.
pub struct Store {
    conn: Mutex<Connection>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS aecp_artifacts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    workspace TEXT NOT NULL,
    status TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS aecp_artifacts_ws ON aecp_artifacts(workspace);
CREATE TABLE IF NOT EXISTS aecp_deliveries (
    worker TEXT NOT NULL,
    artifact INTEGER NOT NULL,
    revision INTEGER NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (worker, artifact)
);
CREATE TABLE IF NOT EXISTS aecp_workers (
    worker TEXT PRIMARY KEY,
    workspace TEXT NOT NULL,
    globs TEXT NOT NULL,
    written TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS aecp_contracts (
    workspace TEXT NOT NULL,
    module TEXT NOT NULL,
    revision INTEGER NOT NULL,
    body TEXT NOT NULL,
    by_worker TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (workspace, module, revision)
);
CREATE TABLE IF NOT EXISTS aecp_consumers (
    workspace TEXT NOT NULL,
    module TEXT NOT NULL,
    worker TEXT NOT NULL,
    symbols TEXT NOT NULL,
    acked_revision INTEGER NOT NULL,
    stale INTEGER NOT NULL,
    PRIMARY KEY (workspace, module, worker)
);
CREATE TABLE IF NOT EXISTS aecp_audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms INTEGER NOT NULL,
    workspace TEXT NOT NULL,
    kind TEXT NOT NULL,
    artifact INTEGER,
    worker TEXT,
    detail TEXT NOT NULL
);
CREATE TRIGGER IF NOT EXISTS aecp_audit_no_update BEFORE UPDATE ON aecp_audit
    BEGIN SELECT RAISE(ABORT, 'the AECP audit log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS aecp_audit_no_delete BEFORE DELETE ON aecp_audit
    BEGIN SELECT RAISE(ABORT, 'the AECP audit log is append-only'); END;
";

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn audit(
    tx: &Transaction<'_>,
    workspace: &str,
    kind: &str,
    artifact: Option<ArtifactId>,
    worker: Option<&str>,
    detail: serde_json::Value,
) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO aecp_audit (at_ms, workspace, kind, artifact, worker, detail) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![now_ms() as i64, workspace, kind, artifact.map(|a| a as i64), worker, detail.to_string()],
    )
    .map_err(sql("appending to the audit log"))?;
    Ok(())
}

fn decode_artifact(id: i64, body: &str) -> Result<Artifact, StoreError> {
    serde_json::from_str(body).map_err(|source| StoreError::Corrupt {
        table: "aecp_artifacts",
        id,
        source,
    })
}

impl Store {
    /// Opens (creating) the AECP tables in the database at `path`.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let conn = Connection::open(path).map_err(sql("opening the database"))?;
        Store::init(conn)
    }

    /// A store in memory (tests, `awcp-ctl aecp` without a daemon).
    pub fn in_memory() -> Result<Store, StoreError> {
        Store::init(Connection::open_in_memory().map_err(sql("opening the database"))?)
    }

    fn init(conn: Connection) -> Result<Store, StoreError> {
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(sql("setting a timeout"))?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(sql("enabling WAL"))?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(sql("setting durability"))?;
        conn.execute_batch(SCHEMA)
            .map_err(sql("creating the AECP tables"))?;
        conn.execute_batch(violations::SCHEMA)
            .map_err(sql("creating the AECP tables"))?;
        Ok(Store {
            conn: Mutex::new(conn),
        })
    }

    fn tx<T>(
        &self,
        context: &'static str,
        f: impl FnOnce(&Transaction<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.lock();
        let tx = conn.transaction().map_err(sql(context))?;
        let out = f(&tx)?;
        tx.commit().map_err(sql(context))?;
        Ok(out)
    }

    /// Stores a publication that passed its witness (or has none): returns the artifact with
    /// its id. Appends `publish`, and `witness` when one ran.
    pub fn publish(
        &self,
        workspace: &str,
        draft: &Draft,
        bound: &str,
        producer: &str,
        status: WitnessStatus,
        run: Option<&WitnessRun>,
    ) -> Result<Artifact, StoreError> {
        self.tx("storing an artifact", |tx| {
            tx.execute(
                "INSERT INTO aecp_artifacts (workspace, status, body) VALUES (?1, ?2, '')",
                params![workspace, status.as_str()],
            )
            .map_err(sql("storing an artifact"))?;
            let id = tx.last_insert_rowid() as ArtifactId;
            let a = Artifact {
                id,
                claim: draft.claim.clone(),
                scope: draft.scope.clone(),
                bound: bound.to_owned(),
                witness: draft.witness.clone(),
                status,
                producer: producer.to_owned(),
                created_ms: now_ms(),
                revision: 1,
            };
            let body = serde_json::to_string(&a).expect("artifacts serialize");
            tx.execute(
                "UPDATE aecp_artifacts SET body = ?1 WHERE id = ?2",
                params![body, id as i64],
            )
            .map_err(sql("storing an artifact"))?;
            audit(
                tx,
                workspace,
                "publish",
                Some(id),
                Some(producer),
                serde_json::json!({
                    "scope": a.scope.to_string(), "bound": bound, "status": status,
                }),
            )?;
            if let Some(run) = run {
                audit(
                    tx,
                    workspace,
                    "witness",
                    Some(id),
                    Some(producer),
                    serde_json::to_value(run).unwrap_or_default(),
                )?;
            }
            Ok(a)
        })
    }

    /// Records a publication its witness refuted: nothing is stored for delivery, the audit
    /// log keeps the attempt (`witness`, then `rejection`).
    pub fn reject(
        &self,
        workspace: &str,
        draft: &Draft,
        producer: &str,
        run: &WitnessRun,
    ) -> Result<(), StoreError> {
        self.tx("recording a rejection", |tx| {
            audit(
                tx,
                workspace,
                "witness",
                None,
                Some(producer),
                serde_json::to_value(run).unwrap_or_default(),
            )?;
            audit(
                tx,
                workspace,
                "rejection",
                None,
                Some(producer),
                serde_json::json!({
                    "claim": draft.claim, "scope": draft.scope.to_string(), "reason": run.reason,
                }),
            )
        })
    }

    /// One artifact and its workspace.
    pub fn artifact(&self, id: ArtifactId) -> Result<(String, Artifact), StoreError> {
        let conn = self.conn.lock();
        let row: Option<(String, String)> = conn
            .query_row(
                "SELECT workspace, body FROM aecp_artifacts WHERE id = ?1",
                params![id as i64],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(sql("reading an artifact"))?;
        let (ws, body) = row.ok_or(StoreError::UnknownArtifact { id })?;
        Ok((ws, decode_artifact(id as i64, &body)?))
    }

    /// Every artifact of a workspace (refuted ones included), oldest first.
    pub fn artifacts(&self, workspace: &str) -> Result<Vec<Artifact>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare("SELECT id, body FROM aecp_artifacts WHERE workspace = ?1 ORDER BY id")
            .map_err(sql("listing artifacts"))?;
        let rows = stmt
            .query_map(params![workspace], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
            })
            .map_err(sql("listing artifacts"))?;
        let mut out = Vec::new();
        for row in rows {
            let (id, body) = row.map_err(sql("listing artifacts"))?;
            out.push(decode_artifact(id, &body)?);
        }
        Ok(out)
    }

    /// A consumer disputes an artifact: appends `flag`.
    pub fn flag(&self, id: ArtifactId, worker: &str, reason: &str) -> Result<(), StoreError> {
        let (ws, _) = self.artifact(id)?;
        self.tx("recording a flag", |tx| {
            audit(
                tx,
                &ws,
                "flag",
                Some(id),
                Some(worker),
                serde_json::json!({ "reason": reason }),
            )
        })
    }

    /// The outcome of a witness re-run (after a flag): sets the status, bumps the revision
    /// when it changed (so it is delivered again, or — refuted — never again), appends
    /// `witness` and, when refuted, `refutation`. Returns the artifact as it now is.
    pub fn rerun(
        &self,
        id: ArtifactId,
        worker: &str,
        run: &WitnessRun,
    ) -> Result<Artifact, StoreError> {
        let (ws, mut a) = self.artifact(id)?;
        self.tx("recording a witness run", |tx| {
            audit(
                tx,
                &ws,
                "witness",
                Some(id),
                Some(worker),
                serde_json::to_value(run).unwrap_or_default(),
            )?;
            // A refuted artifact stays refuted; an unchecked run changes nothing.
            let new = match (a.status, run.status) {
                (WitnessStatus::Refuted, _) | (_, WitnessStatus::Unchecked) => a.status,
                (_, s) => s,
            };
            if new != a.status {
                a.status = new;
                a.revision += 1;
                let body = serde_json::to_string(&a).expect("artifacts serialize");
                tx.execute(
                    "UPDATE aecp_artifacts SET status = ?1, body = ?2 WHERE id = ?3",
                    params![new.as_str(), body, id as i64],
                )
                .map_err(sql("updating an artifact"))?;
                if new == WitnessStatus::Refuted {
                    audit(
                        tx,
                        &ws,
                        "refutation",
                        Some(id),
                        Some(worker),
                        serde_json::json!({ "reason": run.reason }),
                    )?;
                }
            }
            Ok(a.clone())
        })
    }

    /// Records that `worker` received `id` at `revision`; false if it already had it.
    pub fn record_delivery(
        &self,
        worker: &str,
        id: ArtifactId,
        revision: u32,
    ) -> Result<bool, StoreError> {
        let (ws, _) = self.artifact(id)?;
        self.tx("recording a delivery", |tx| {
            let had: Option<i64> = tx
                .query_row(
                    "SELECT revision FROM aecp_deliveries WHERE worker = ?1 AND artifact = ?2",
                    params![worker, id as i64],
                    |r| r.get(0),
                )
                .optional()
                .map_err(sql("recording a delivery"))?;
            if had.is_some_and(|r| r >= i64::from(revision)) {
                return Ok(false);
            }
            tx.execute(
                "INSERT OR REPLACE INTO aecp_deliveries (worker, artifact, revision, at_ms) VALUES (?1, ?2, ?3, ?4)",
                params![worker, id as i64, revision, now_ms() as i64],
            )
            .map_err(sql("recording a delivery"))?;
            audit(tx, &ws, "delivery", Some(id), Some(worker), serde_json::json!({ "revision": revision }))?;
            Ok(true)
        })
    }

    /// What `worker` has received: (artifact, revision), in delivery order.
    pub fn delivered(&self, worker: &str) -> Result<Vec<(ArtifactId, u32)>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare("SELECT artifact, revision FROM aecp_deliveries WHERE worker = ?1 ORDER BY at_ms, artifact")
            .map_err(sql("reading deliveries"))?;
        let rows = stmt
            .query_map(params![worker], |r| {
                Ok((r.get::<_, i64>(0)? as ArtifactId, r.get::<_, u32>(1)?))
            })
            .map_err(sql("reading deliveries"))?;
        rows.collect::<Result<_, _>>()
            .map_err(sql("reading deliveries"))
    }

    /// Registers a worker of a workspace with the globs it owns (`--owns`; empty: it owns
    /// what it writes back). Keeps files already recorded as written.
    pub fn set_owner(
        &self,
        workspace: &str,
        worker: &str,
        globs: &[String],
    ) -> Result<(), StoreError> {
        self.tx("registering a worker", |tx| {
            tx.execute(
                "INSERT INTO aecp_workers (worker, workspace, globs, written) VALUES (?1, ?2, ?3, '[]')
                 ON CONFLICT(worker) DO UPDATE SET globs = excluded.globs, workspace = excluded.workspace",
                params![worker, workspace, serde_json::to_string(globs).expect("strings serialize")],
            )
            .map_err(sql("registering a worker"))?;
            Ok(())
        })
    }

    /// Adds files a worker wrote back (its ownership when it gave no `--owns`).
    pub fn add_written(
        &self,
        workspace: &str,
        worker: &str,
        files: &[String],
    ) -> Result<(), StoreError> {
        self.tx("recording written files", |tx| {
            let current: Option<String> = tx
                .query_row("SELECT written FROM aecp_workers WHERE worker = ?1", params![worker], |r| r.get(0))
                .optional()
                .map_err(sql("recording written files"))?;
            let mut written: Vec<String> =
                current.and_then(|c| serde_json::from_str(&c).ok()).unwrap_or_default();
            let mut seen: std::collections::HashSet<String> = written.iter().cloned().collect();
            for f in files {
                if written.len() >= MAX_WRITTEN {
                    break;
                }
                if seen.insert(f.clone()) {
                    written.push(f.clone());
                }
            }
            tx.execute(
                "INSERT INTO aecp_workers (worker, workspace, globs, written) VALUES (?1, ?2, '[]', ?3)
                 ON CONFLICT(worker) DO UPDATE SET written = excluded.written",
                params![worker, workspace, serde_json::to_string(&written).expect("strings serialize")],
            )
            .map_err(sql("recording written files"))?;
            Ok(())
        })
    }

    /// The workers of a workspace and what they own.
    pub fn owners(&self, workspace: &str) -> Result<Vec<Owner>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare("SELECT worker, globs, written FROM aecp_workers WHERE workspace = ?1 ORDER BY rowid")
            .map_err(sql("listing workers"))?;
        let rows = stmt
            .query_map(params![workspace], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })
            .map_err(sql("listing workers"))?;
        let mut out = Vec::new();
        for row in rows {
            let (worker, globs, written) = row.map_err(sql("listing workers"))?;
            out.push(Owner {
                worker,
                globs: serde_json::from_str(&globs).unwrap_or_default(),
                written: serde_json::from_str(&written).unwrap_or_default(),
            });
        }
        Ok(out)
    }

    /// Declares (revision 1) or revises (next revision) a module's contract; a revision marks
    /// every consumer stale. Appends `declaration` or `revision`. Returns the new revision and
    /// the consumers made stale.
    pub fn put_contract(
        &self,
        workspace: &str,
        module: &str,
        body: &serde_json::Value,
        by: &str,
    ) -> Result<(u32, Vec<String>), StoreError> {
        self.tx("storing a contract", |tx| {
            let last: Option<u32> = tx
                .query_row(
                    "SELECT MAX(revision) FROM aecp_contracts WHERE workspace = ?1 AND module = ?2",
                    params![workspace, module],
                    |r| r.get(0),
                )
                .map_err(sql("storing a contract"))?;
            let revision = last.unwrap_or(0) + 1;
            tx.execute(
                "INSERT INTO aecp_contracts (workspace, module, revision, body, by_worker, at_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![workspace, module, revision, body.to_string(), by, now_ms() as i64],
            )
            .map_err(sql("storing a contract"))?;
            let mut stale = Vec::new();
            if revision > 1 {
                let mut stmt = tx
                    .prepare("SELECT worker FROM aecp_consumers WHERE workspace = ?1 AND module = ?2 AND acked_revision < ?3")
                    .map_err(sql("marking consumers stale"))?;
                stale = stmt
                    .query_map(params![workspace, module, revision], |r| r.get(0))
                    .map_err(sql("marking consumers stale"))?
                    .collect::<Result<_, _>>()
                    .map_err(sql("marking consumers stale"))?;
                tx.execute(
                    "UPDATE aecp_consumers SET stale = 1 WHERE workspace = ?1 AND module = ?2 AND acked_revision < ?3",
                    params![workspace, module, revision],
                )
                .map_err(sql("marking consumers stale"))?;
            }
            let kind = if revision == 1 { "declaration" } else { "revision" };
            audit(tx, workspace, kind, None, Some(by), serde_json::json!({
                "module": module, "revision": revision, "stale": stale,
            }))?;
            Ok((revision, stale))
        })
    }

    /// The newest revision of a module's contract.
    pub fn contract(
        &self,
        workspace: &str,
        module: &str,
    ) -> Result<Option<StoredContract>, StoreError> {
        self.contract_at(workspace, module, u32::MAX)
    }

    /// The newest revision of a module's contract not above `revision`.
    pub fn contract_at(
        &self,
        workspace: &str,
        module: &str,
        revision: u32,
    ) -> Result<Option<StoredContract>, StoreError> {
        let conn = self.conn.lock();
        conn.query_row(
            "SELECT revision, body, by_worker, at_ms FROM aecp_contracts WHERE workspace = ?1 AND module = ?2 AND revision <= ?3 ORDER BY revision DESC LIMIT 1",
            params![workspace, module, revision],
            |r| Ok((r.get::<_, u32>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?, r.get::<_, i64>(3)?)),
        )
        .optional()
        .map_err(sql("reading a contract"))?
        .map(|(revision, body, by, at)| {
            Ok(StoredContract {
                module: module.to_owned(),
                revision,
                body: serde_json::from_str(&body).map_err(|source| StoreError::Corrupt {
                    table: "aecp_contracts",
                    id: i64::from(revision),
                    source,
                })?,
                by,
                at_ms: at as u64,
            })
        })
        .transpose()
    }

    /// Registers `worker` as a consumer of `module` (merging symbols), at the current
    /// revision.
    pub fn add_consumer(
        &self,
        workspace: &str,
        module: &str,
        worker: &str,
        symbols: &[String],
    ) -> Result<(), StoreError> {
        let current =
            self.contract(workspace, module)?
                .ok_or_else(|| StoreError::UnknownContract {
                    module: module.to_owned(),
                })?;
        self.tx("registering a consumer", |tx| {
            let old: Option<String> = tx
                .query_row(
                    "SELECT symbols FROM aecp_consumers WHERE workspace = ?1 AND module = ?2 AND worker = ?3",
                    params![workspace, module, worker],
                    |r| r.get(0),
                )
                .optional()
                .map_err(sql("registering a consumer"))?;
            let mut all: Vec<String> = old.and_then(|o| serde_json::from_str(&o).ok()).unwrap_or_default();
            for s in symbols {
                if !all.contains(s) {
                    all.push(s.clone());
                }
            }
            tx.execute(
                "INSERT INTO aecp_consumers (workspace, module, worker, symbols, acked_revision, stale) VALUES (?1, ?2, ?3, ?4, ?5, 0)
                 ON CONFLICT(workspace, module, worker) DO UPDATE SET symbols = excluded.symbols",
                params![workspace, module, worker, serde_json::to_string(&all).expect("strings serialize"), current.revision],
            )
            .map_err(sql("registering a consumer"))?;
            audit(tx, workspace, "dependency", None, Some(worker), serde_json::json!({
                "module": module, "symbols": symbols, "auto": false, "revision": current.revision,
            }))?;
            Ok(())
        })
    }

    /// Registers `worker` as a consumer of the whole of `module` because its mount saw it
    /// read or import the module at revision `seen` — once: a worker already registered
    /// (explicitly or automatically) is left as it is. A worker that saw an older revision
    /// than the newest is registered stale. Appends `dependency` with `"auto": true`.
    /// Returns whether it was newly registered.
    pub fn add_consumer_auto(
        &self,
        workspace: &str,
        module: &str,
        worker: &str,
        seen: u32,
    ) -> Result<bool, StoreError> {
        let current =
            self.contract(workspace, module)?
                .ok_or_else(|| StoreError::UnknownContract {
                    module: module.to_owned(),
                })?;
        let acked = seen.clamp(1, current.revision);
        self.tx("registering a consumer", |tx| {
            let added = tx
                .execute(
                    "INSERT OR IGNORE INTO aecp_consumers (workspace, module, worker, symbols, acked_revision, stale) VALUES (?1, ?2, ?3, '[]', ?4, ?5)",
                    params![workspace, module, worker, acked, acked < current.revision],
                )
                .map_err(sql("registering a consumer"))?;
            if added == 0 {
                return Ok(false);
            }
            audit(tx, workspace, "dependency", None, Some(worker), serde_json::json!({
                "module": module, "symbols": [], "auto": true, "revision": acked,
            }))?;
            Ok(true)
        })
    }

    /// `worker`'s standing as a consumer of `module`, if it is one.
    pub fn consumer(
        &self,
        workspace: &str,
        module: &str,
        worker: &str,
    ) -> Result<Option<Consumer>, StoreError> {
        Ok(self
            .consumers(workspace, module)?
            .into_iter()
            .find(|c| c.worker == worker))
    }

    /// The modules `worker` consumes in `workspace`.
    pub fn consumed_by(&self, workspace: &str, worker: &str) -> Result<Vec<String>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare("SELECT module FROM aecp_consumers WHERE workspace = ?1 AND worker = ?2 ORDER BY module")
            .map_err(sql("listing consumers"))?;
        let rows = stmt
            .query_map(params![workspace, worker], |r| r.get(0))
            .map_err(sql("listing consumers"))?;
        rows.collect::<Result<_, _>>()
            .map_err(sql("listing consumers"))
    }

    /// The newest revision of every contracted module of a workspace, by module path.
    pub fn contracts(&self, workspace: &str) -> Result<Vec<StoredContract>, StoreError> {
        let modules: Vec<String> = {
            let conn = self.conn.lock();
            let mut stmt = conn
                .prepare("SELECT DISTINCT module FROM aecp_contracts WHERE workspace = ?1 ORDER BY module")
                .map_err(sql("listing contracts"))?;
            let rows = stmt
                .query_map(params![workspace], |r| r.get(0))
                .map_err(sql("listing contracts"))?;
            rows.collect::<Result<_, _>>()
                .map_err(sql("listing contracts"))?
        };
        let mut out = Vec::with_capacity(modules.len());
        for m in modules {
            out.extend(self.contract(workspace, &m)?);
        }
        Ok(out)
    }

    /// The consumers of a module.
    pub fn consumers(&self, workspace: &str, module: &str) -> Result<Vec<Consumer>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare("SELECT worker, symbols, acked_revision, stale FROM aecp_consumers WHERE workspace = ?1 AND module = ?2 ORDER BY worker")
            .map_err(sql("listing consumers"))?;
        let rows = stmt
            .query_map(params![workspace, module], |r| {
                Ok(Consumer {
                    worker: r.get(0)?,
                    symbols: serde_json::from_str(&r.get::<_, String>(1)?).unwrap_or_default(),
                    acked_revision: r.get(2)?,
                    stale: r.get::<_, i64>(3)? != 0,
                })
            })
            .map_err(sql("listing consumers"))?;
        rows.collect::<Result<_, _>>()
            .map_err(sql("listing consumers"))
    }

    /// A consumer acknowledges the newest revision: clears its stale flag, appends
    /// `acknowledgement`.
    pub fn ack(&self, workspace: &str, module: &str, worker: &str) -> Result<u32, StoreError> {
        let current =
            self.contract(workspace, module)?
                .ok_or_else(|| StoreError::UnknownContract {
                    module: module.to_owned(),
                })?;
        self.tx("recording an acknowledgement", |tx| {
            tx.execute(
                "UPDATE aecp_consumers SET stale = 0, acked_revision = ?4 WHERE workspace = ?1 AND module = ?2 AND worker = ?3",
                params![workspace, module, worker, current.revision],
            )
            .map_err(sql("recording an acknowledgement"))?;
            audit(tx, workspace, "acknowledgement", None, Some(worker), serde_json::json!({
                "module": module, "revision": current.revision,
            }))?;
            Ok(current.revision)
        })
    }

    /// Appends a verifier's `verdict` on a submitted module.
    pub fn record_verdict(
        &self,
        workspace: &str,
        module: &str,
        worker: &str,
        verdict: &serde_json::Value,
    ) -> Result<(), StoreError> {
        self.tx("recording a verdict", |tx| {
            audit(
                tx,
                workspace,
                "verdict",
                None,
                Some(worker),
                serde_json::json!({
                    "module": module, "verdict": verdict,
                }),
            )
        })
    }

    /// The audit log of a workspace after `since` (a `seq`; 0 for all), oldest first.
    pub fn audit_log(&self, workspace: &str, since: i64) -> Result<Vec<AuditEntry>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare("SELECT seq, at_ms, workspace, kind, artifact, worker, detail FROM aecp_audit WHERE workspace = ?1 AND seq > ?2 ORDER BY seq")
            .map_err(sql("reading the audit log"))?;
        let rows = stmt
            .query_map(params![workspace, since], |r| {
                Ok(AuditEntry {
                    seq: r.get(0)?,
                    at_ms: r.get::<_, i64>(1)? as u64,
                    workspace: r.get(2)?,
                    kind: r.get(3)?,
                    artifact: r.get::<_, Option<i64>>(4)?.map(|a| a as ArtifactId),
                    worker: r.get(5)?,
                    detail: serde_json::from_str(&r.get::<_, String>(6)?).unwrap_or_default(),
                })
            })
            .map_err(sql("reading the audit log"))?;
        rows.collect::<Result<_, _>>()
            .map_err(sql("reading the audit log"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::knowledge::{Scope, Witness};

    fn draft() -> Draft {
        Draft {
            claim: "parse() rejects empty input".into(),
            scope: Scope::Symbol("pkg.a.parse".into()),
            witness: Some(Witness {
                argv: vec!["sh".into(), "-c".into(), "echo AECP-READY".into()],
                marker: "AECP-READY".into(),
                timeout_ms: 10_000,
            }),
        }
    }

    fn run(status: WitnessStatus) -> WitnessRun {
        WitnessRun {
            status,
            marker_seen: status != WitnessStatus::Unchecked,
            exit_code: Some(if status == WitnessStatus::Checked {
                0
            } else {
                1
            }),
            timed_out: false,
            network: "isolated".into(),
            reason: "r".into(),
            output_tail: String::new(),
            elapsed_ms: 1,
        }
    }

    fn kinds(s: &Store, ws: &str) -> Vec<String> {
        s.audit_log(ws, 0)
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect()
    }

    #[test]
    fn durable_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("delegator.db");
        let id = {
            let s = Store::open(&db).unwrap();
            let a = s
                .publish(
                    "/ws",
                    &draft(),
                    "pkg/a.py",
                    "w1",
                    WitnessStatus::Checked,
                    Some(&run(WitnessStatus::Checked)),
                )
                .unwrap();
            s.record_delivery("w2", a.id, 1).unwrap();
            a.id
        };
        let s = Store::open(&db).unwrap();
        let (ws, a) = s.artifact(id).unwrap();
        assert_eq!(ws, "/ws");
        assert_eq!(a.bound, "pkg/a.py");
        assert_eq!(a.status, WitnessStatus::Checked);
        assert_eq!(s.delivered("w2").unwrap(), [(id, 1)]);
        assert_eq!(kinds(&s, "/ws"), ["publish", "witness", "delivery"]);
    }

    #[test]
    fn flag_then_rerun_refutes_and_the_log_keeps_it() {
        let s = Store::in_memory().unwrap();
        let a = s
            .publish(
                "/ws",
                &draft(),
                "pkg/a.py",
                "w1",
                WitnessStatus::Checked,
                None,
            )
            .unwrap();
        s.flag(a.id, "w2", "fails on my side").unwrap();
        // An environment failure on re-run leaves it as it was.
        let same = s.rerun(a.id, "w2", &run(WitnessStatus::Unchecked)).unwrap();
        assert_eq!((same.status, same.revision), (WitnessStatus::Checked, 1));
        let refuted = s.rerun(a.id, "w2", &run(WitnessStatus::Refuted)).unwrap();
        assert_eq!(
            (refuted.status, refuted.revision),
            (WitnessStatus::Refuted, 2)
        );
        // Refuted stays refuted even if a later run passes.
        let after = s.rerun(a.id, "w3", &run(WitnessStatus::Checked)).unwrap();
        assert_eq!(after.status, WitnessStatus::Refuted);
        assert_eq!(s.artifacts("/ws").unwrap().len(), 1, "kept, not deleted");
        assert_eq!(
            kinds(&s, "/ws"),
            [
                "publish",
                "flag",
                "witness",
                "witness",
                "refutation",
                "witness"
            ]
        );
    }

    /// The whole dispute path with a real witness: checked at publication, the code
    /// changes, a consumer flags it, the re-run refutes it, and the store keeps the record.
    #[test]
    fn flag_reruns_a_real_witness_and_refutes() {
        let ws = tempfile::tempdir().unwrap();
        std::fs::write(ws.path().join("a.py"), "LIMIT = 10\n").unwrap();
        let witness = Witness {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "echo AECP-READY; grep -q 'LIMIT = 10' a.py".into(),
            ],
            marker: "AECP-READY".into(),
            timeout_ms: 30_000,
        };
        let d = Draft {
            claim: "LIMIT is 10".into(),
            scope: Scope::File("a.py".into()),
            witness: Some(witness.clone()),
        };
        let spec = crate::witness::RunSpec {
            dir: ws.path().into(),
            user: None,
            isolate_network: true,
        };
        let first = crate::witness::run(&witness, &spec).unwrap();
        assert_eq!(first.status, WitnessStatus::Checked);
        let s = Store::in_memory().unwrap();
        let a = s
            .publish("/ws", &d, "a.py", "A", first.status, Some(&first))
            .unwrap();
        std::fs::write(ws.path().join("a.py"), "LIMIT = 20\n").unwrap();
        s.flag(a.id, "B", "LIMIT looks different").unwrap();
        let again = crate::witness::run(&witness, &spec).unwrap();
        let after = s.rerun(a.id, "B", &again).unwrap();
        assert_eq!(after.status, WitnessStatus::Refuted);
        let policy = crate::policy::Policy::default();
        assert!(
            !policy.deliverable(&after, &Default::default()),
            "never delivered again"
        );
        assert!(kinds(&s, "/ws").contains(&"refutation".to_owned()));
    }

    #[test]
    fn the_audit_log_is_append_only() {
        let s = Store::in_memory().unwrap();
        s.publish(
            "/ws",
            &draft(),
            "pkg/a.py",
            "w1",
            WitnessStatus::Unchecked,
            None,
        )
        .unwrap();
        let conn = s.conn.lock();
        assert!(conn.execute("DELETE FROM aecp_audit", []).is_err());
        assert!(
            conn.execute("UPDATE aecp_audit SET kind = 'x'", [])
                .is_err()
        );
    }

    #[test]
    fn rejected_publications_are_logged_not_stored() {
        let s = Store::in_memory().unwrap();
        s.reject("/ws", &draft(), "w1", &run(WitnessStatus::Refuted))
            .unwrap();
        assert!(s.artifacts("/ws").unwrap().is_empty());
        assert_eq!(kinds(&s, "/ws"), ["witness", "rejection"]);
    }

    #[test]
    fn deliveries_once_per_revision() {
        let s = Store::in_memory().unwrap();
        let a = s
            .publish(
                "/ws",
                &draft(),
                "pkg/a.py",
                "w1",
                WitnessStatus::Unchecked,
                None,
            )
            .unwrap();
        assert!(s.record_delivery("w2", a.id, 1).unwrap());
        assert!(!s.record_delivery("w2", a.id, 1).unwrap());
        assert!(s.record_delivery("w2", a.id, 2).unwrap());
        assert!(matches!(
            s.record_delivery("w2", 999, 1),
            Err(StoreError::UnknownArtifact { id: 999 })
        ));
    }

    #[test]
    fn ownership_globs_and_written_files() {
        let s = Store::in_memory().unwrap();
        s.set_owner("/ws", "w1", &["pkg/**".into()]).unwrap();
        s.set_owner("/ws", "w2", &[]).unwrap();
        s.add_written("/ws", "w2", &["app/main.py".into()]).unwrap();
        s.add_written("/ws", "w2", &["app/main.py".into(), "app/b.py".into()])
            .unwrap();
        s.set_owner("/other", "w3", &[]).unwrap();
        let owners = s.owners("/ws").unwrap();
        assert_eq!(owners.len(), 2);
        assert!(owners[0].owns("pkg/a.py"));
        assert_eq!(owners[1].written, ["app/main.py", "app/b.py"]);
    }

    #[test]
    fn contract_revision_marks_consumers_stale_until_ack() {
        let s = Store::in_memory().unwrap();
        let v1 = serde_json::json!({"module": "pkg/acct.py", "symbols": []});
        assert_eq!(
            s.put_contract("/ws", "pkg/acct.py", &v1, "w1").unwrap(),
            (1, vec![])
        );
        assert!(matches!(
            s.add_consumer("/ws", "pkg/none.py", "w2", &[]),
            Err(StoreError::UnknownContract { .. })
        ));
        s.add_consumer("/ws", "pkg/acct.py", "w2", &["Account".into()])
            .unwrap();
        let (rev, stale) = s.put_contract("/ws", "pkg/acct.py", &v1, "w1").unwrap();
        assert_eq!((rev, stale), (2, vec!["w2".to_owned()]));
        assert!(s.consumers("/ws", "pkg/acct.py").unwrap()[0].stale);
        assert_eq!(s.ack("/ws", "pkg/acct.py", "w2").unwrap(), 2);
        let c = &s.consumers("/ws", "pkg/acct.py").unwrap()[0];
        assert!(!c.stale);
        assert_eq!(c.acked_revision, 2);
        assert_eq!(
            s.contract("/ws", "pkg/acct.py").unwrap().unwrap().revision,
            2
        );
        s.record_verdict(
            "/ws",
            "pkg/acct.py",
            "w1",
            &serde_json::json!({"verdict": "ok"}),
        )
        .unwrap();
        assert_eq!(
            kinds(&s, "/ws"),
            [
                "declaration",
                "dependency",
                "revision",
                "acknowledgement",
                "verdict"
            ]
        );
    }
    #[test]
    fn automatic_consumers_register_once_and_stale_when_behind() {
        let s = Store::in_memory().unwrap();
        let v = serde_json::json!({"module": "pkg/acct.py", "symbols": []});
        assert!(matches!(
            s.add_consumer_auto("/ws", "pkg/acct.py", "w2", 1),
            Err(StoreError::UnknownContract { .. })
        ));
        s.put_contract("/ws", "pkg/acct.py", &v, "w1").unwrap();
        assert!(s.add_consumer_auto("/ws", "pkg/acct.py", "w2", 1).unwrap());
        assert!(
            !s.add_consumer_auto("/ws", "pkg/acct.py", "w2", 1).unwrap(),
            "once"
        );
        let c = s.consumer("/ws", "pkg/acct.py", "w2").unwrap().unwrap();
        assert_eq!((c.acked_revision, c.stale, c.symbols.len()), (1, false, 0));
        // An explicit `depend` keeps the registration and merges its symbols.
        s.add_consumer("/ws", "pkg/acct.py", "w2", &["f".into()])
            .unwrap();
        assert!(!s.add_consumer_auto("/ws", "pkg/acct.py", "w2", 1).unwrap());
        assert_eq!(
            s.consumer("/ws", "pkg/acct.py", "w2")
                .unwrap()
                .unwrap()
                .symbols,
            ["f"]
        );
        // A worker whose mount saw revision 1 after revision 2 was stored is stale at once.
        s.put_contract("/ws", "pkg/acct.py", &v, "w1").unwrap();
        assert!(s.add_consumer_auto("/ws", "pkg/acct.py", "w3", 1).unwrap());
        let c3 = s.consumer("/ws", "pkg/acct.py", "w3").unwrap().unwrap();
        assert_eq!((c3.acked_revision, c3.stale), (1, true));
        assert_eq!(s.consumed_by("/ws", "w3").unwrap(), ["pkg/acct.py"]);
        assert_eq!(s.contracts("/ws").unwrap().len(), 1);
        assert_eq!(s.contracts("/ws").unwrap()[0].revision, 2);
        assert_eq!(
            s.contract_at("/ws", "pkg/acct.py", 1)
                .unwrap()
                .unwrap()
                .revision,
            1
        );
        let autos: Vec<bool> = s
            .audit_log("/ws", 0)
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == "dependency")
            .map(|e| e.detail["auto"].as_bool().unwrap())
            .collect();
        assert_eq!(autos, [true, false, true], "one entry per registration");
    }

    #[test]
    fn written_files_are_bounded() {
        let s = Store::in_memory().unwrap();
        let many: Vec<String> = (0..MAX_WRITTEN + 5).map(|i| format!("f{i}.py")).collect();
        s.add_written("/ws", "w", &many).unwrap();
        s.add_written("/ws", "w", &many).unwrap();
        assert_eq!(s.owners("/ws").unwrap()[0].written.len(), MAX_WRITTEN);
    }
}
