//! The shared engine: PostgreSQL (`serve --state postgres://user:pass@host:port/db`), so
//! several daemons see one set of delegations and one can take over another's.
//!
//! The client is the synchronous `postgres` crate on a thread of its own: the daemon calls
//! the store from synchronous code running on tokio's threads, where the crate's own
//! `block_on` would panic, so every call is handed to the worker thread, which owns the
//! connection, and the caller waits for its answer (one round trip, as a SQLite write waits
//! for the disk). A broken connection is dropped and opened again on the next call.
//!
//! No TLS: run the database on loopback or a private network (or behind a TLS tunnel); a
//! server that requires TLS refuses the connection with a clear error. Times (heartbeats,
//! lapses) are the database's clock, so daemons on machines whose clocks disagree still
//! agree on who has lapsed.

use std::sync::mpsc;
use std::time::Duration;

use ::postgres::{Client, Config, NoTls};

use super::migrations::{self, Migration};
use super::{ClientTokenRow, DaemonRow, StateStore, StoreError, StoredDelegation, StoredRow};

type Job = Box<dyn FnOnce(&mut Worker) + Send>;

/// The PostgreSQL store.
#[derive(Debug)]
pub struct PgStore {
    url: String,
    jobs: mpsc::Sender<Job>,
}

struct Worker {
    config: Config,
    client: Option<Client>,
}

impl Worker {
    fn client(&mut self) -> Result<&mut Client, ::postgres::Error> {
        if self.client.as_ref().is_none_or(Client::is_closed) {
            self.client = Some(self.config.connect(NoTls)?);
        }
        Ok(self.client.as_mut().expect("connected just above"))
    }
}

/// `url` without its password, for logs and errors.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (authority, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split(':').next().unwrap_or_default();
            let hidden = if userinfo.contains(':') { ":***" } else { "" };
            format!("{scheme}://{user}{hidden}@{host}{tail}")
        }
        None => url.to_string(),
    }
}

fn decode(body: &str) -> Result<StoredDelegation, StoreError> {
    serde_json::from_str(body).map_err(|source| StoreError::Corrupt { source })
}

fn rows(raw: Vec<::postgres::Row>) -> Result<Vec<StoredRow>, StoreError> {
    raw.into_iter()
        .map(|r| {
            Ok(StoredRow {
                delegation: decode(r.get::<_, &str>(0))?,
                owner: r.get(1),
                version: r.get(2),
            })
        })
        .collect()
}

/// Longest a statement may run on the server, and longest unacknowledged data may wait on
/// the connection.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest a caller waits for its answer (a connect, a queue of earlier calls, a statement).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// An arbitrary constant (the text "awcp" in ASCII) naming the advisory lock that makes
/// daemons starting together apply each migration once.
const MIGRATION_LOCK: i64 = 0x6177_6370;

fn migrate(client: &mut Client, list: &[Migration]) -> Result<Result<(), i64>, ::postgres::Error> {
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS awcp_schema (
             version BIGINT PRIMARY KEY,
             name TEXT NOT NULL,
             applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
         );",
    )?;
    let done: i64 = tx
        .query_one("SELECT COALESCE(MAX(version), 0) FROM awcp_schema", &[])?
        .get(0);
    if done > migrations::latest(list) {
        return Ok(Err(done));
    }
    for m in list.iter().filter(|m| m.version > done) {
        tracing::info!(
            version = m.version,
            name = m.name,
            "migrating the PostgreSQL state"
        );
        tx.batch_execute(m.sql)?;
        tx.execute(
            "INSERT INTO awcp_schema (version, name) VALUES ($1, $2)",
            &[&m.version, &m.name],
        )?;
    }
    tx.commit()?;
    Ok(Ok(()))
}

const ROW: &str = "SELECT body, owner, version FROM delegations";

impl PgStore {
    /// Connect to `url`, migrate the schema, and keep the connection on a worker thread.
    pub fn connect(url: &str) -> Result<PgStore, StoreError> {
        let shown = redact(url);
        let pg = |source| StoreError::Postgres {
            url: shown.clone(),
            source,
        };
        let mut config: Config = url.parse().map_err(pg)?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(5));
        }
        config.application_name("awcp-ctl");
        // A database that stops answering must not hang the daemon: the kernel gives up on
        // unacknowledged data after `tcp_user_timeout`, an idle connection is probed, and a
        // statement that runs too long is cancelled by the server. Callers stop waiting at
        // `CALL_TIMEOUT` whatever happens.
        config.tcp_user_timeout(STATEMENT_TIMEOUT);
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(5));
        let options = format!(
            "{} -c statement_timeout={}",
            config.get_options().unwrap_or_default(),
            STATEMENT_TIMEOUT.as_millis()
        );
        config.options(options.trim());
        let (jobs, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("awcp-state-pg".into())
            .spawn(move || {
                let mut worker = Worker {
                    config,
                    client: None,
                };
                for job in rx {
                    job(&mut worker);
                }
            })
            .map_err(|source| StoreError::Io {
                path: "postgres worker thread".into(),
                source,
            })?;
        let store = PgStore { url: shown, jobs };
        store
            .call(|c| migrate(c, migrations::POSTGRES))?
            .map_err(|found| StoreError::TooNew {
                found,
                known: migrations::latest(migrations::POSTGRES),
            })?;
        Ok(store)
    }

    /// Run `f` with the connection on the worker thread and wait for its answer.
    fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Client) -> Result<R, ::postgres::Error> + Send + 'static,
    ) -> Result<R, StoreError> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |w: &mut Worker| {
            let r = w.client().and_then(f);
            if r.is_err() && w.client.as_ref().is_some_and(Client::is_closed) {
                w.client = None;
            }
            let _ = tx.send(r);
        });
        let closed = || StoreError::Closed {
            url: self.url.clone(),
        };
        self.jobs.send(job).map_err(|_| closed())?;
        rx.recv_timeout(CALL_TIMEOUT)
            .map_err(|e| match e {
                mpsc::RecvTimeoutError::Timeout => StoreError::Timeout {
                    url: self.url.clone(),
                    after: CALL_TIMEOUT,
                },
                mpsc::RecvTimeoutError::Disconnected => closed(),
            })?
            .map_err(|source| StoreError::Postgres {
                url: self.url.clone(),
                source,
            })
    }
}

/// Seconds, as PostgreSQL's `make_interval` takes them.
fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

impl StateStore for PgStore {
    fn describe(&self) -> String {
        self.url.clone()
    }

    fn shared(&self) -> bool {
        true
    }

    fn put(&self, owner: &str, d: &StoredDelegation) -> Result<(), StoreError> {
        let body = serde_json::to_string(d).map_err(|source| StoreError::Corrupt { source })?;
        let id = d.record.id.as_str().to_string();
        let owner = owner.to_string();
        let terminal = d.record.state.is_terminal();
        let (created, updated) = (d.record.created_at.clone(), d.record.updated_at.clone());
        let key = id.clone();
        let refused = self.call(move |c| {
            let n = c.execute(
                "INSERT INTO delegations
                     (id, body, owner, terminal, version, created_at, updated_at)
                 VALUES ($1, $2, $3, $4, nextval('delegation_version'), $5, $6)
                 ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body,
                     owner = EXCLUDED.owner, terminal = EXCLUDED.terminal,
                     version = EXCLUDED.version, updated_at = EXCLUDED.updated_at
                 WHERE delegations.owner IS NULL OR delegations.owner = EXCLUDED.owner",
                &[&key, &body, &owner, &terminal, &created, &updated],
            )?;
            if n > 0 {
                return Ok(None);
            }
            let holder = c.query_opt("SELECT owner FROM delegations WHERE id = $1", &[&key])?;
            Ok(Some(
                holder
                    .and_then(|r| r.get::<_, Option<String>>(0))
                    .unwrap_or_default(),
            ))
        })?;
        match refused {
            None => Ok(()),
            Some(owner) => Err(StoreError::NotOwner { id, owner }),
        }
    }

    fn get(&self, id: &str) -> Result<Option<StoredRow>, StoreError> {
        let id = id.to_string();
        let raw = self.call(move |c| c.query(&format!("{ROW} WHERE id = $1"), &[&id]))?;
        Ok(rows(raw)?.into_iter().next())
    }

    fn changed_since(&self, version: i64) -> Result<Vec<StoredRow>, StoreError> {
        rows(self.call(move |c| {
            c.query(
                &format!("{ROW} WHERE version > $1 ORDER BY version"),
                &[&version],
            )
        })?)
    }

    fn heartbeat(&self, daemon: &str, api_url: &str) -> Result<(), StoreError> {
        let (daemon, api_url) = (daemon.to_string(), api_url.to_string());
        self.call(move |c| {
            c.execute(
                "INSERT INTO daemons (id, api_url, beat_at) VALUES ($1, $2, now())
                 ON CONFLICT (id) DO UPDATE SET api_url = EXCLUDED.api_url,
                     beat_at = EXCLUDED.beat_at",
                &[&daemon, &api_url],
            )
        })?;
        Ok(())
    }

    fn daemons(&self) -> Result<Vec<DaemonRow>, StoreError> {
        let raw = self.call(|c| {
            c.query(
                "SELECT id, api_url,
                        EXTRACT(EPOCH FROM (now() - beat_at))::float8
                 FROM daemons ORDER BY id",
                &[],
            )
        })?;
        Ok(raw
            .into_iter()
            .map(|r| DaemonRow {
                id: r.get(0),
                api_url: r.get(1),
                age: Duration::try_from_secs_f64(r.get::<_, f64>(2).max(0.0)).unwrap_or_default(),
            })
            .collect())
    }

    fn claim_orphans(&self, daemon: &str, lapse: Duration) -> Result<Vec<StoredRow>, StoreError> {
        let daemon = daemon.to_string();
        let lapse = secs(lapse);
        // One statement: a row another daemon claims meanwhile is re-checked after its
        // lock is released, and then its owner (the other daemon) is fresh.
        rows(self.call(move |c| {
            c.query(
                "UPDATE delegations SET owner = $1, version = nextval('delegation_version')
                 WHERE NOT terminal
                   AND owner IS DISTINCT FROM $1
                   AND (owner IS NULL OR owner NOT IN
                        (SELECT id FROM daemons
                         WHERE beat_at >= now() - make_interval(secs => $2)))
                   AND EXISTS (SELECT 1 FROM daemons WHERE id = $1
                               AND beat_at >= now() - make_interval(secs => $2))
                 RETURNING body, owner, version",
                &[&daemon, &lapse],
            )
        })?)
    }

    fn add_client_token(&self, t: &ClientTokenRow) -> Result<(), StoreError> {
        let t = t.clone();
        self.call(move |c| {
            c.execute(
                "INSERT INTO client_tokens (id, salt, hash, label, created_at)
                 VALUES ($1, $2, $3, $4, $5)",
                &[&t.id, &t.salt, &t.hash, &t.label, &t.created_at],
            )
        })?;
        Ok(())
    }

    fn client_tokens(&self) -> Result<Vec<ClientTokenRow>, StoreError> {
        let raw = self.call(|c| {
            c.query(
                "SELECT id, salt, hash, label, created_at FROM client_tokens
                 ORDER BY created_at, id",
                &[],
            )
        })?;
        Ok(raw
            .into_iter()
            .map(|r| ClientTokenRow {
                id: r.get(0),
                salt: r.get(1),
                hash: r.get(2),
                label: r.get(3),
                created_at: r.get(4),
            })
            .collect())
    }

    fn remove_client_token(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_string();
        let n = self.call(move |c| c.execute("DELETE FROM client_tokens WHERE id = $1", &[&id]))?;
        Ok(n > 0)
    }
}

/// Test databases on the PostgreSQL server named by `AWCP_TEST_POSTGRES_URL` (which
/// `scripts/pg-test-server.sh start` prints): one fresh database per test, dropped after.
pub mod testing {
    use super::*;

    /// The variable naming the test server.
    pub const URL_VAR: &str = "AWCP_TEST_POSTGRES_URL";

    /// A database made for one test, dropped (with its connections) when this is dropped.
    #[derive(Debug)]
    pub struct TestDatabase {
        admin: String,
        name: String,
        /// Its URL, for `serve --state`.
        pub url: String,
    }

    /// The test server's URL: `None` (after saying so on stderr) when it is not set, but a
    /// panic under `CI=true`, where `.ci/run` must have started it.
    pub fn server_url() -> Option<String> {
        match std::env::var(URL_VAR) {
            Ok(url) if !url.is_empty() => Some(url),
            _ => {
                let msg = format!(
                    "{URL_VAR} is not set: start a PostgreSQL test server with \
                     `eval \"$(scripts/pg-test-server.sh start)\"`"
                );
                if std::env::var("CI").is_ok_and(|v| v == "true") {
                    panic!("{msg} (CI=true: PostgreSQL tests must run)");
                }
                awcpfs::testing::skipped(
                    "the PostgreSQL tests",
                    "apt-get install postgresql, then eval \"$(scripts/pg-test-server.sh start)\"",
                );
                None
            }
        }
    }

    /// Run `f` on a thread of its own: the synchronous client must not run on a tokio
    /// thread, and these helpers are called from async tests too.
    pub fn off_runtime<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
        std::thread::spawn(f)
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }

    /// A fresh, empty database on the test server (see [`server_url`] for `None`).
    pub fn fresh_database() -> Option<TestDatabase> {
        let admin = server_url()?;
        let name = format!("awcp_test_{}", hex::encode(rand::random::<[u8; 6]>()));
        let (a, n) = (admin.clone(), name.clone());
        off_runtime(move || {
            let mut c = Client::connect(&a, NoTls)
                .unwrap_or_else(|e| panic!("{URL_VAR}={} is unreachable: {e}", redact(&a)));
            c.batch_execute(&format!("CREATE DATABASE {n}"))
                .expect("creating a test database");
        });
        let url = with_dbname(&admin, &name);
        Some(TestDatabase { admin, name, url })
    }

    /// `url` with its database replaced by `name`.
    fn with_dbname(url: &str, name: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a URL");
        let (authority, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
        let query = tail.find('?').map(|i| &tail[i..]).unwrap_or("");
        format!("{scheme}://{authority}/{name}{query}")
    }

    impl Drop for TestDatabase {
        fn drop(&mut self) {
            let (admin, name) = (self.admin.clone(), self.name.clone());
            off_runtime(move || {
                if let Ok(mut c) = Client::connect(&admin, NoTls) {
                    let _ =
                        c.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
                }
            });
        }
    }

    #[cfg(test)]
    #[test]
    fn with_dbname_replaces_only_the_database() {
        assert_eq!(
            with_dbname(
                "postgres://u:p@127.0.0.1:5432/postgres?sslmode=disable",
                "x"
            ),
            "postgres://u:p@127.0.0.1:5432/x?sslmode=disable"
        );
        assert_eq!(with_dbname("postgres://h:1", "x"), "postgres://h:1/x");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::store::suite::store_suite!(|| {
        let db = testing::fresh_database()?;
        let store = PgStore::connect(&db.url).unwrap();
        Some((Box::new(store) as Box<dyn StateStore>, db))
    });

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("postgres://awcp:s3cret@db:5432/awcp?x=1"),
            "postgres://awcp:***@db:5432/awcp?x=1"
        );
        assert_eq!(redact("postgres://awcp@db/awcp"), "postgres://awcp@db/awcp");
        assert_eq!(redact("postgres://db/awcp"), "postgres://db/awcp");
        assert_eq!(redact("garbage"), "garbage");
    }

    /// Two daemons starting at once on a fresh database apply the schema once.
    #[test]
    fn concurrent_opens_migrate_once() {
        let Some(db) = testing::fresh_database() else {
            return;
        };
        let opens: Vec<_> = (0..3)
            .map(|_| {
                let url = db.url.clone();
                std::thread::spawn(move || PgStore::connect(&url).map(|_| ()))
            })
            .collect();
        for o in opens {
            o.join().unwrap().unwrap();
        }
        let mut c = Client::connect(&db.url, NoTls).unwrap();
        let n: i64 = c
            .query_one("SELECT count(*) FROM awcp_schema", &[])
            .unwrap()
            .get(0);
        assert_eq!(n, migrations::latest(migrations::POSTGRES));
    }

    /// A statement the server cannot finish is cancelled by the server, not waited for.
    #[test]
    fn statements_have_a_timeout() {
        let Some(db) = testing::fresh_database() else {
            return;
        };
        let store = PgStore::connect(&db.url).unwrap();
        let shown: String = store
            .call(|c| c.query_one("SHOW statement_timeout", &[]).map(|r| r.get(0)))
            .unwrap();
        assert_eq!(shown, "10s");
    }

    #[test]
    fn an_unreachable_server_is_a_clear_error() {
        // Port 9 (discard) on loopback: nothing listens there.
        let e = PgStore::connect("postgres://u:pw@127.0.0.1:9/db").unwrap_err();
        let text = format!("{e:#}");
        assert!(text.contains("postgres://u:***@127.0.0.1:9/db"), "{text}");
        assert!(!text.contains("pw"), "{text}");
    }
}
