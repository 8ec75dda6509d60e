//! The schema of each engine, as numbered migrations applied in order at open.
//!
//! Each engine records what it applied in its own table (`delegator_schema` in SQLite,
//! `awcp_schema` in PostgreSQL), one row per migration, in the same transaction as the
//! migration itself. Never edit a migration that has shipped: add the next one. A
//! database whose newest applied version is past [`Migration`] lists' end was written by a
//! newer awcp-ctl and is refused ([`super::StoreError::TooNew`]).
//!
//! The SQLite file is shared with the AECP store (`aecp-hooks`), whose tables are prefixed
//! `aecp_`; nothing here touches them.

/// One step of a schema.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Its number: 1, 2, … without gaps.
    pub version: i64,
    /// What it does, for logs.
    pub name: &'static str,
    /// The statements (several, `;`-separated).
    pub sql: &'static str,
}

/// The SQLite schema (`<state-dir>/delegator.db`).
pub const SQLITE: &[Migration] = &[
    Migration {
        version: 1,
        name: "delegations as JSON documents",
        // `IF NOT EXISTS`: files of earlier versions made this table before there was a
        // migration table, and are adopted as they are.
        sql: "CREATE TABLE IF NOT EXISTS delegations (
                  id TEXT PRIMARY KEY,
                  body TEXT NOT NULL,
                  updated_at TEXT NOT NULL
              );",
    },
    Migration {
        version: 2,
        name: "owners, versions and daemon heartbeats",
        sql: "ALTER TABLE delegations ADD COLUMN owner TEXT;
              ALTER TABLE delegations ADD COLUMN terminal INTEGER NOT NULL DEFAULT 0;
              ALTER TABLE delegations ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
              UPDATE delegations SET version = rowid,
                  terminal = json_extract(body, '$.record.state')
                      IN ('completed', 'error', 'cancelled', 'expired');
              CREATE INDEX delegations_by_version ON delegations (version);
              CREATE TABLE daemons (
                  id TEXT PRIMARY KEY,
                  api_url TEXT NOT NULL,
                  beat_ms INTEGER NOT NULL
              );",
    },
    Migration {
        version: 3,
        name: "client tokens, kept hashed",
        sql: "CREATE TABLE client_tokens (
                  id TEXT PRIMARY KEY,
                  salt TEXT NOT NULL,
                  hash TEXT NOT NULL,
                  label TEXT NOT NULL,
                  created_at TEXT NOT NULL
              );",
    },
];

/// The PostgreSQL schema (`serve --state postgres://…`).
pub const POSTGRES: &[Migration] = &[
    Migration {
        version: 1,
        name: "delegations, owners, versions and daemon heartbeats",
        sql: "CREATE SEQUENCE delegation_version;
          CREATE TABLE delegations (
              id TEXT PRIMARY KEY,
              body TEXT NOT NULL,
              owner TEXT,
              terminal BOOLEAN NOT NULL DEFAULT false,
              version BIGINT NOT NULL,
              created_at TEXT NOT NULL,
              updated_at TEXT NOT NULL
          );
          CREATE INDEX delegations_by_version ON delegations (version);
          CREATE INDEX delegations_running_by_owner ON delegations (owner) WHERE NOT terminal;
          CREATE TABLE daemons (
              id TEXT PRIMARY KEY,
              api_url TEXT NOT NULL,
              beat_at TIMESTAMPTZ NOT NULL
          );",
    },
    Migration {
        version: 2,
        name: "client tokens, kept hashed",
        sql: "CREATE TABLE client_tokens (
                  id TEXT PRIMARY KEY,
                  salt TEXT NOT NULL,
                  hash TEXT NOT NULL,
                  label TEXT NOT NULL,
                  created_at TEXT NOT NULL
              );",
    },
];

/// The newest version of a list.
pub fn latest(list: &[Migration]) -> i64 {
    list.last().map_or(0, |m| m.version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_dense_from_one() {
        for list in [SQLITE, POSTGRES] {
            for (i, m) in list.iter().enumerate() {
                assert_eq!(m.version, i as i64 + 1, "{}", m.name);
            }
        }
    }
}
