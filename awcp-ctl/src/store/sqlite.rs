//! The default engine: one SQLite file in the state directory (rusqlite, bundled), for one
//! daemon. Owners and heartbeats are kept here too, so the daemon runs the same code on
//! both engines, but a SQLite file is not meant to be shared by daemons on several machines
//! (its locking does not reach over a network filesystem): use PostgreSQL for that.

use std::path::{Path, PathBuf};
use std::time::Duration;

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, params};

use super::migrations::{self, Migration};
use super::{ClientTokenRow, DaemonRow, StateStore, StoreError, StoredDelegation, StoredRow};

/// The SQLite store.
#[derive(Debug)]
pub struct SqliteStore {
    path: PathBuf,
    conn: Mutex<Connection>,
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn decode(body: &str) -> Result<StoredDelegation, StoreError> {
    serde_json::from_str(body).map_err(|source| StoreError::Corrupt { source })
}

const ROW: &str = "SELECT body, owner, version FROM delegations";

impl SqliteStore {
    /// Open (or create) the database at `path`, and migrate it.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
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
        let mut conn = Connection::open(path).map_err(err)?;
        conn.execute_batch("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;")
            .map_err(err)?;
        // The AECP store opens its own connection to this file: wait for its writes.
        conn.busy_timeout(Duration::from_secs(5)).map_err(err)?;
        migrate(&mut conn, migrations::SQLITE).map_err(|e| match e {
            Migrate::Sql(source) => err(source),
            Migrate::TooNew(found) => StoreError::TooNew {
                found,
                known: migrations::latest(migrations::SQLITE),
            },
        })?;
        Ok(SqliteStore {
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

    fn rows(&self, sql: &str, args: impl rusqlite::Params) -> Result<Vec<StoredRow>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn.prepare(sql).map_err(|e| self.err(e))?;
        let raw = stmt
            .query_map(args, |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, Option<String>>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e))?;
        raw.into_iter()
            .map(|(body, owner, version)| {
                Ok(StoredRow {
                    delegation: decode(&body)?,
                    owner,
                    version,
                })
            })
            .collect()
    }
}

enum Migrate {
    Sql(rusqlite::Error),
    TooNew(i64),
}

impl From<rusqlite::Error> for Migrate {
    fn from(e: rusqlite::Error) -> Self {
        Migrate::Sql(e)
    }
}

fn migrate(conn: &mut Connection, list: &[Migration]) -> Result<(), Migrate> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS delegator_schema (
             version INTEGER PRIMARY KEY,
             name TEXT NOT NULL,
             applied_at TEXT NOT NULL
         );",
    )?;
    // IMMEDIATE: two processes opening one file at once apply each migration once.
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let done: i64 = tx.query_row(
        "SELECT COALESCE(MAX(version), 0) FROM delegator_schema",
        [],
        |r| r.get(0),
    )?;
    if done > migrations::latest(list) {
        return Err(Migrate::TooNew(done));
    }
    for m in list.iter().filter(|m| m.version > done) {
        tracing::info!(
            version = m.version,
            name = m.name,
            "migrating the SQLite state"
        );
        tx.execute_batch(m.sql)?;
        tx.execute(
            "INSERT INTO delegator_schema (version, name, applied_at) VALUES (?1, ?2, ?3)",
            params![m.version, m.name, crate::now_iso()],
        )?;
    }
    tx.commit()?;
    Ok(())
}

impl StateStore for SqliteStore {
    fn describe(&self) -> String {
        format!("sqlite:{}", self.path.display())
    }

    fn shared(&self) -> bool {
        false
    }

    fn put(&self, owner: &str, d: &StoredDelegation) -> Result<(), StoreError> {
        let body = serde_json::to_string(d).map_err(|source| StoreError::Corrupt { source })?;
        let conn = self.conn.lock();
        let changed = conn
            .execute(
                "INSERT INTO delegations (id, body, updated_at, owner, terminal, version)
                 VALUES (?1, ?2, ?3, ?4, ?5,
                         (SELECT COALESCE(MAX(version), 0) + 1 FROM delegations))
                 ON CONFLICT(id) DO UPDATE SET body = excluded.body,
                     updated_at = excluded.updated_at, owner = excluded.owner,
                     terminal = excluded.terminal, version = excluded.version
                 WHERE delegations.owner IS NULL OR delegations.owner = excluded.owner",
                params![
                    d.record.id.as_str(),
                    body,
                    d.record.updated_at,
                    owner,
                    d.record.state.is_terminal(),
                ],
            )
            .map_err(|e| self.err(e))?;
        if changed == 0 {
            let holder: Option<String> = conn
                .query_row(
                    "SELECT owner FROM delegations WHERE id = ?1",
                    [d.record.id.as_str()],
                    |r| r.get(0),
                )
                .optional()
                .map_err(|e| self.err(e))?
                .flatten();
            return Err(StoreError::NotOwner {
                id: d.record.id.as_str().to_string(),
                owner: holder.unwrap_or_default(),
            });
        }
        Ok(())
    }

    fn get(&self, id: &str) -> Result<Option<StoredRow>, StoreError> {
        Ok(self
            .rows(&format!("{ROW} WHERE id = ?1"), [id])?
            .into_iter()
            .next())
    }

    fn changed_since(&self, version: i64) -> Result<Vec<StoredRow>, StoreError> {
        self.rows(
            &format!("{ROW} WHERE version > ?1 ORDER BY version, rowid"),
            [version],
        )
    }

    fn heartbeat(&self, daemon: &str, api_url: &str) -> Result<(), StoreError> {
        self.conn
            .lock()
            .execute(
                "INSERT INTO daemons (id, api_url, beat_ms) VALUES (?1, ?2, ?3)
                 ON CONFLICT(id) DO UPDATE SET api_url = excluded.api_url,
                     beat_ms = excluded.beat_ms",
                params![daemon, api_url, now_ms()],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    fn daemons(&self) -> Result<Vec<DaemonRow>, StoreError> {
        let now = now_ms();
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare("SELECT id, api_url, beat_ms FROM daemons ORDER BY id")
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok(DaemonRow {
                    id: r.get(0)?,
                    api_url: r.get(1)?,
                    age: Duration::from_millis(
                        u64::try_from(now - r.get::<_, i64>(2)?).unwrap_or(0),
                    ),
                })
            })
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e))?;
        Ok(rows)
    }

    fn claim_orphans(&self, daemon: &str, lapse: Duration) -> Result<Vec<StoredRow>, StoreError> {
        let fresh_after = now_ms() - i64::try_from(lapse.as_millis()).unwrap_or(i64::MAX);
        let mut conn = self.conn.lock();
        let tx = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(|e| self.err(e))?;
        let raw = {
            let mut stmt = tx
                .prepare(
                    "UPDATE delegations SET owner = ?1,
                         version = (SELECT COALESCE(MAX(version), 0) + 1 FROM delegations)
                     WHERE NOT terminal
                       AND (owner IS NULL OR owner <> ?1)
                       AND (owner IS NULL OR owner NOT IN
                            (SELECT id FROM daemons WHERE beat_ms >= ?2))
                       AND EXISTS (SELECT 1 FROM daemons WHERE id = ?1 AND beat_ms >= ?2)
                     RETURNING body, owner, version",
                )
                .map_err(|e| self.err(e))?;
            stmt.query_map(params![daemon, fresh_after], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, Option<String>>(1)?,
                    r.get(2)?,
                ))
            })
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<(String, Option<String>, i64)>, _>>()
            .map_err(|e| self.err(e))?
        };
        tx.commit().map_err(|e| self.err(e))?;
        raw.into_iter()
            .map(|(body, owner, version)| {
                Ok(StoredRow {
                    delegation: decode(&body)?,
                    owner,
                    version,
                })
            })
            .collect()
    }

    fn add_client_token(&self, t: &ClientTokenRow) -> Result<(), StoreError> {
        self.conn
            .lock()
            .execute(
                "INSERT INTO client_tokens (id, salt, hash, label, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![t.id, t.salt, t.hash, t.label, t.created_at],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    fn client_tokens(&self) -> Result<Vec<ClientTokenRow>, StoreError> {
        let conn = self.conn.lock();
        let mut stmt = conn
            .prepare(
                "SELECT id, salt, hash, label, created_at FROM client_tokens
                 ORDER BY created_at, id",
            )
            .map_err(|e| self.err(e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok(ClientTokenRow {
                    id: r.get(0)?,
                    salt: r.get(1)?,
                    hash: r.get(2)?,
                    label: r.get(3)?,
                    created_at: r.get(4)?,
                })
            })
            .map_err(|e| self.err(e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.err(e))?;
        Ok(rows)
    }

    fn remove_client_token(&self, id: &str) -> Result<bool, StoreError> {
        let n = self
            .conn
            .lock()
            .execute("DELETE FROM client_tokens WHERE id = ?1", params![id])
            .map_err(|e| self.err(e))?;
        Ok(n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::store::suite::store_suite!(|| {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("delegator.db")).unwrap();
        Some((Box::new(store) as Box<dyn StateStore>, dir))
    });

    /// A file written before migrations existed (one `delegations` table, no owners) is
    /// adopted: its rows stay readable, and the first daemon to write them owns them.
    #[test]
    fn a_file_of_an_earlier_version_is_adopted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("delegator.db");
        let d = crate::store::suite::delegation("old", awcp_protocol::DelegationState::Running);
        let id = d.record.id.as_str();
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(
                "CREATE TABLE delegations (id TEXT PRIMARY KEY, body TEXT NOT NULL,
                 updated_at TEXT NOT NULL);",
            )
            .unwrap();
            conn.execute(
                "INSERT INTO delegations VALUES (?1, ?2, ?3)",
                params![id, serde_json::to_string(&d).unwrap(), "t"],
            )
            .unwrap();
        }
        let store = SqliteStore::open(&path).unwrap();
        let row = store.get(id).unwrap().unwrap();
        assert_eq!(row.owner, None);
        assert!(row.version > 0);
        store.put("dmn_a", &d).unwrap();
        assert_eq!(
            store.get(id).unwrap().unwrap().owner.as_deref(),
            Some("dmn_a")
        );
        // Opening it again applies nothing twice.
        drop(store);
        SqliteStore::open(&path).unwrap();
    }
}
