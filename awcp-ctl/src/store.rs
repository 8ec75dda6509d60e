//! The daemon's durable state: its delegations (with their leases, exports and event
//! history) and, when several daemons share one database, who owns each of them.
//!
//! [`StateStore`] is the one interface the daemon uses; two engines implement it:
//!
//! * [`sqlite::SqliteStore`] (the default: `<state-dir>/delegator.db`, rusqlite bundled,
//!   nothing to set up), for one daemon;
//! * [`postgres::PgStore`] (`serve --state postgres://…`), which several daemons share, so
//!   one of them can take over the delegations of another that died.
//!
//! Both keep a delegation as one JSON document (the [`StoredDelegation`]) beside the few
//! columns the daemons query: its state (terminal or not), its **owner** (the daemon that
//! runs its lease watch and event pump) and a **version** that grows on every write, so a
//! daemon can read only what changed since it last looked. Writes are fenced by owner: a
//! daemon whose delegation was taken over can no longer overwrite it
//! ([`StoreError::NotOwner`]). Each daemon writes a heartbeat row; a delegation whose owner's
//! heartbeat is older than the lapse is claimed by a live daemon ([`StateStore::claim_orphans`]).
//! Schemas are versioned ([`migrations`]) and migrated at open.

pub mod migrations;
pub mod postgres;
pub mod sqlite;
#[cfg(test)]
mod suite;

use std::path::PathBuf;
use std::time::Duration;

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
    /// PostgreSQL failed (or could not be reached).
    #[error("the PostgreSQL state database {url} failed")]
    Postgres {
        /// Which database (without its password).
        url: String,
        /// Why.
        #[source]
        source: ::postgres::Error,
    },
    /// PostgreSQL did not answer in time (the daemon goes on; the call is given up).
    #[error("the PostgreSQL state database {url} did not answer within {after:?}")]
    Timeout {
        /// Which database (without its password).
        url: String,
        /// How long the caller waited.
        after: Duration,
    },
    /// The PostgreSQL worker thread is gone (it panicked, or the store was dropped).
    #[error("the PostgreSQL state database {url} is closed")]
    Closed {
        /// Which database (without its password).
        url: String,
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
    /// The database holds a newer schema than this binary knows.
    #[error(
        "the state database's schema is version {found}, newer than this awcp-ctl knows \
         ({known}); upgrade awcp-ctl"
    )]
    TooNew {
        /// The schema version found.
        found: i64,
        /// The newest this binary knows.
        known: i64,
    },
    /// Another daemon owns the delegation now (it took it over): this daemon must not
    /// write it.
    #[error("delegation {id} is owned by daemon {owner} now; this daemon no longer writes it")]
    NotOwner {
        /// The delegation.
        id: String,
        /// Its owner.
        owner: String,
    },
    /// `--state` names no engine this binary knows.
    #[error(
        "unsupported state URL {given:?}: give `postgres://user:pass@host/db` (or \
         `postgresql://…`), or leave --state out for the SQLite file in the state directory"
    )]
    BadUrl {
        /// What was given (without its password).
        given: String,
    },
}

/// A delegation as stored, with the columns the daemons coordinate by.
#[derive(Debug, Clone)]
pub struct StoredRow {
    /// The delegation.
    pub delegation: StoredDelegation,
    /// The daemon that runs its lease watch and event pump (`None`: rows written before
    /// there were owners; the first daemon to write them takes them).
    pub owner: Option<String>,
    /// Grows with every write of any row of the database.
    pub version: i64,
}

/// A daemon's heartbeat row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonRow {
    /// Its id (stable across restarts of one state directory).
    pub id: String,
    /// Its daemon API URL (for hints: where to revoke what it owns).
    pub api_url: String,
    /// How long ago it last beat, by the database's clock.
    pub age: Duration,
}

/// A client credential of the daemon API as stored (`awcp-ctl token create`): never the
/// token itself, only a salted hash of it (see [`crate::daemon::tokens`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientTokenRow {
    /// Its public id (`tok_…`), also the token's first part.
    pub id: String,
    /// Random salt, hex.
    #[serde(skip_serializing)]
    pub salt: String,
    /// SHA-256 of salt and secret, hex.
    #[serde(skip_serializing)]
    pub hash: String,
    /// What the operator called it.
    pub label: String,
    /// When it was made, ISO 8601.
    pub created_at: String,
}

/// The daemon's durable state: see the module docs.
///
/// Calls block (a local file, or a round trip to PostgreSQL); they are short, and the
/// daemon makes them where it made SQLite calls before.
pub trait StateStore: Send + Sync + std::fmt::Debug {
    /// What this store is, for logs and `awcp-ctl status` (never a password).
    fn describe(&self) -> String;

    /// Whether several daemons may share this store (then they beat, refresh their copies
    /// of each other's delegations and take over from a daemon that died).
    fn shared(&self) -> bool;

    /// Insert or replace a delegation on behalf of daemon `owner`: a new row becomes
    /// `owner`'s; an existing one is replaced only if `owner` owns it (or nobody does),
    /// else [`StoreError::NotOwner`] and nothing is written.
    fn put(&self, owner: &str, d: &StoredDelegation) -> Result<(), StoreError>;

    /// One delegation.
    fn get(&self, id: &str) -> Result<Option<StoredRow>, StoreError>;

    /// Every row written after `version` (all rows for 0), in version order.
    fn changed_since(&self, version: i64) -> Result<Vec<StoredRow>, StoreError>;

    /// Every delegation, oldest first.
    fn all(&self) -> Result<Vec<StoredDelegation>, StoreError> {
        let mut rows = self.changed_since(0)?;
        rows.sort_by(|a, b| {
            a.delegation
                .record
                .created_at
                .cmp(&b.delegation.record.created_at)
        });
        Ok(rows.into_iter().map(|r| r.delegation).collect())
    }

    /// Record that daemon `daemon` (serving its API at `api_url`) is alive now.
    fn heartbeat(&self, daemon: &str, api_url: &str) -> Result<(), StoreError>;

    /// Every daemon that ever beat, with the age of its last heartbeat.
    fn daemons(&self) -> Result<Vec<DaemonRow>, StoreError>;

    /// Take over, for `daemon`, every delegation that has not ended and whose owner's
    /// heartbeat is older than `lapse` (or that has no owner, or whose owner never beat).
    /// Atomic per row: of two daemons claiming at once, one gets each row. Nothing is
    /// claimed unless `daemon`'s own heartbeat is fresh (a daemon cut off from the
    /// database must not take anything). Returns the rows claimed.
    fn claim_orphans(&self, daemon: &str, lapse: Duration) -> Result<Vec<StoredRow>, StoreError>;

    /// Record a client credential (its salted hash), for every daemon of this store.
    fn add_client_token(&self, t: &ClientTokenRow) -> Result<(), StoreError>;

    /// Every client credential, oldest first.
    fn client_tokens(&self) -> Result<Vec<ClientTokenRow>, StoreError>;

    /// Forget a client credential; whether there was one.
    fn remove_client_token(&self, id: &str) -> Result<bool, StoreError>;
}

/// Where the daemon keeps its state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateLocation {
    /// The default: `delegator.db` in the state directory.
    Sqlite(PathBuf),
    /// A PostgreSQL connection URL (`postgres://user:pass@host:port/db`).
    Postgres(String),
}

impl StateLocation {
    /// `--state`'s value (`None`: the SQLite file in `state_dir`).
    pub fn parse(given: Option<&str>, state_dir: &std::path::Path) -> Result<Self, StoreError> {
        match given {
            None => Ok(StateLocation::Sqlite(state_dir.join("delegator.db"))),
            Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
                Ok(StateLocation::Postgres(url.to_string()))
            }
            Some(other) => Err(StoreError::BadUrl {
                given: postgres::redact(other),
            }),
        }
    }

    /// Open (and migrate) the store.
    pub fn open(&self) -> Result<Box<dyn StateStore>, StoreError> {
        Ok(match self {
            StateLocation::Sqlite(path) => Box::new(sqlite::SqliteStore::open(path)?),
            StateLocation::Postgres(url) => Box::new(postgres::PgStore::connect(url)?),
        })
    }
}
