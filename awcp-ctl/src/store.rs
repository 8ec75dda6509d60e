//! The daemon's durable state: one SQLite database (rusqlite, bundled), so delegations,
//! leases and exports survive a restart and one command starts everything.

use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};

use awcp_protocol::TransportType;
use awcp_protocol::api::DelegationRecord;

use crate::watch::WatchEvent;

/// Everything the daemon keeps about one delegation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredDelegation {
    /// The reference's record shape (what `GET /delegation/:id` returns).
    pub record: DelegationRecord,
    /// The export serving the workspace.
    pub export_id: String,
    /// Its capability token.
    pub token: String,
    /// The delegated directory.
    pub source: PathBuf,
    /// `ro` delegation.
    pub read_only: bool,
    /// History, for `watch` and `delegate --wait`.
    pub events: Vec<WatchEvent>,
    /// Last SSE id seen from the Executor, to resume its stream.
    #[serde(default)]
    pub last_event_id: Option<String>,
    /// The transport (`awcpfs` for delegations stored before there was a choice).
    #[serde(default = "default_transport")]
    pub transport: TransportType,
    /// The Executor's token (the `auth` credential of `POST /delegate`), sent in INVITE's
    /// `auth` and as a bearer token on every other request to the Executor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_token: Option<String>,
    /// The delegation asked for a multi-round session.
    #[serde(default)]
    pub multi_round: bool,
    /// Every resource of an `awcpfs` delegation with its own export (empty for delegations
    /// stored before there could be several: then `export_id`, `source` and `read_only`
    /// describe the one resource). The first is the one `export_id` names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resources: Vec<StoredResource>,
}

/// One resource of a delegation and the export serving it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredResource {
    /// Its name (the directory it is mounted as on the Executor when there are several).
    pub name: String,
    /// The export serving it.
    pub export_id: String,
    /// The delegated directory.
    pub source: PathBuf,
    /// `ro` resource.
    pub read_only: bool,
}

impl StoredDelegation {
    /// What the daemon sends as `Authorization: Bearer` on every request that touches
    /// this delegation on its Executor (all but INVITE): the Executor's token when the
    /// delegation was given one, else, for `awcpfs`, the capability token START carries —
    /// the proof the Executor asks for before it serves, cancels or deletes anything of
    /// the delegation.
    pub fn executor_credential(&self) -> Option<String> {
        self.executor_token
            .clone()
            .or_else(|| (self.transport == TransportType::Awcpfs).then(|| self.token.clone()))
    }

    /// The delegation's resources with their exports (one, for rows stored before
    /// `resources` existed).
    pub fn exported_resources(&self) -> Vec<StoredResource> {
        if !self.resources.is_empty() {
            return self.resources.clone();
        }
        vec![StoredResource {
            name: self
                .record
                .environment
                .resources
                .first()
                .map(|r| r.name.clone())
                .unwrap_or_else(|| "workspace".into()),
            export_id: self.export_id.clone(),
            source: self.source.clone(),
            read_only: self.read_only,
        }]
    }
}

fn default_transport() -> TransportType {
    TransportType::Awcpfs
}

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite failed.
    #[error("the state database {path} failed")]
    Sqlite {
        /// Which database.
        path: PathBuf,
        /// Why.
        #[source]
        source: rusqlite::Error,
    },
    /// The database file could not be created private (0600).
    #[error("cannot create the state database {path} with mode 0600")]
    Io {
        /// Which database.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A stored row does not parse.
    #[error("a stored delegation is unreadable")]
    Corrupt {
        /// Why.
        #[source]
        source: serde_json::Error,
    },
}

/// The store.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    conn: Mutex<Connection>,
}

impl Store {
    /// Open (or create) the database at `path`.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let err = |source| StoreError::Sqlite {
            path: path.to_path_buf(),
            source,
        };
        // 0600 before SQLite opens it: SQLite gives the WAL and SHM files the database's
        // mode, and all three hold capability tokens. Files of older versions are tightened.
        let private = |p: &Path| {
            awcpfs::private::file_options()
                .open(p)
                .and_then(|_| awcpfs::private::restrict(p, awcpfs::private::FILE_MODE))
        };
        private(path).map_err(|source| StoreError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        for suffix in ["-wal", "-shm"] {
            let mut side = path.as_os_str().to_owned();
            side.push(suffix);
            let side = PathBuf::from(side);
            if side.exists() {
                let _ = private(&side);
            }
        }
        let conn = Connection::open(path).map_err(err)?;
        conn.execute_batch(
            "PRAGMA journal_mode=WAL;
             PRAGMA synchronous=NORMAL;
             CREATE TABLE IF NOT EXISTS delegations (
                 id TEXT PRIMARY KEY,
                 body TEXT NOT NULL,
                 updated_at TEXT NOT NULL
             );",
        )
        .map_err(err)?;
        Ok(Store {
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
        })
    }

    fn err(&self, source: rusqlite::Error) -> StoreError {
        StoreError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    /// Insert or replace a delegation.
    pub fn put(&self, d: &StoredDelegation) -> Result<(), StoreError> {
        let body = serde_json::to_string(d).map_err(|source| StoreError::Corrupt { source })?;
        self.conn
            .lock()
            .execute(
                "INSERT INTO delegations (id, body, updated_at) VALUES (?1, ?2, ?3)
                 ON CONFLICT(id) DO UPDATE SET body = excluded.body, updated_at = excluded.updated_at",
                params![d.record.id.as_str(), body, d.record.updated_at],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// One delegation.
    pub fn get(&self, id: &str) -> Result<Option<StoredDelegation>, StoreError> {
        let body: Option<String> = self
            .conn
            .lock()
            .query_row("SELECT body FROM delegations WHERE id = ?1", [id], |r| {
                r.get(0)
            })
            .optional()
            .map_err(|e| self.err(e))?;
        body.map(|b| serde_json::from_str(&b).map_err(|source| StoreError::Corrupt { source }))
            .transpose()
    }

    /// Every delegation, oldest first.
    pub fn all(&self) -> Result<Vec<StoredDelegation>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare("SELECT body FROM delegations ORDER BY rowid")
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map([], |r| r.get::<_, String>(0))
            .map_err(|e| self.err(e))?;
        let mut out = Vec::new();
        for row in rows {
            let body = row.map_err(|e| self.err(e))?;
            out.push(serde_json::from_str(&body).map_err(|source| StoreError::Corrupt { source })?);
        }
        Ok(out)
    }
}
