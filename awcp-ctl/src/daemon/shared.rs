//! Several daemons on one database (`serve --state postgres://…`): who runs which
//! delegation, and failover when a daemon dies.
//!
//! Every delegation has one **owner**, the daemon that created it (or took it over): only
//! the owner runs its lease watch (expiry), follows its Executor's event stream, writes its
//! record, revokes or renews it. The others hold a read-only copy, refreshed from the
//! database every tick (`Daemon::sync_once`), so `list`, `status` and `watch` on any daemon
//! show every delegation; mutating one owned elsewhere is refused with 409 and the owner's
//! address.
//!
//! Each daemon writes a heartbeat every tick (a fifth of `--failover-after`). When a daemon
//! has not beaten for `--failover-after`, the first live daemon to notice (one whose own
//! heartbeats have reached the database for at least that long) claims its running
//! delegations in one atomic update ([`crate::store::StateStore::claim_orphans`]) and takes
//! them over: it rebuilds each lease from the stored expiry and enforces it, reopens the
//! Executor's event stream where the record left off (`Last-Event-ID`), and records an
//! `owner` event in the history. What it cannot take over is the data plane: an export
//! serves a tree from the dead daemon's disk at the dead daemon's address, which the
//! Executor's handle names, so a mount can fetch nothing more; a revoke still fences it,
//! through the Executor's cancel route. A daemon that comes back after losing its
//! delegations finds its writes refused by the database ([`StoreError::NotOwner`]) and turns
//! its copies read-only.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::broadcast;

use super::flow::Refusal;
use super::{Daemon, Live};
use crate::store::{StoreError, StoredDelegation, StoredRow};
use crate::watch::WatchEvent;

/// The file in a state directory holding the daemon's id on a shared database, so a
/// restarted daemon recognises (and resumes) its own delegations.
pub const DAEMON_ID_FILE: &str = "daemon-id";

/// The owner name of every row of a SQLite file (one daemon per file).
pub const LOCAL_OWNER: &str = "local";

/// Every how many ticks the copies are reloaded in full, not only what changed: a write
/// that drew its version before another but committed after it would otherwise be missed.
const FULL_RELOAD_EVERY: u64 = 30;

/// This daemon's id on a shared database: `<state_dir>/daemon-id`, drawn at first start.
pub fn load_or_create_daemon_id(state_dir: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context as _;
    let path = state_dir.join(DAEMON_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    }
    let id = format!("dmn_{}", hex::encode(rand::random::<[u8; 8]>()));
    awcpfs::private::write(&path, format!("{id}\n").as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(id)
}

impl Live {
    /// The daemon that owns this delegation, if not this one.
    pub(crate) fn foreign_owner(&self) -> Option<String> {
        self.owner.lock().clone()
    }

    pub(crate) fn is_foreign(&self) -> bool {
        self.owner.lock().is_some()
    }
}

impl Daemon {
    /// How often this daemon beats and refreshes its copies.
    pub(crate) fn share_tick(&self) -> Duration {
        (self.cfg.failover_after / 5).clamp(Duration::from_millis(100), Duration::from_secs(2))
    }

    /// Refuse to change a delegation another daemon owns (409, with where to go instead).
    pub(crate) fn check_owned(&self, live: &Live) -> Result<(), Refusal> {
        let Some(owner) = live.foreign_owner() else {
            return Ok(());
        };
        let id = live.d.lock().record.id.as_str().to_string();
        let api = self
            .store
            .daemons()
            .ok()
            .and_then(|ds| ds.into_iter().find(|d| d.id == owner))
            .map(|d| format!(" (its API: {})", d.api_url))
            .unwrap_or_default();
        Err(Refusal {
            status: 409,
            message: format!("delegation {id} is run by daemon {owner}, not this one"),
            code: None,
            hint: Some(format!(
                "Send this to daemon {owner}{api}; if that daemon has died, this one takes \
                 the delegation over once its heartbeat is {:?} old, and then accepts it",
                self.cfg.failover_after
            )),
        })
    }

    /// Persist a delegation; a refusal because another daemon took it over turns the copy
    /// read-only.
    pub(crate) fn persist(&self, live: &Live, snapshot: &StoredDelegation) {
        match self.store.put(&self.daemon_id, snapshot) {
            Ok(()) => {}
            Err(StoreError::NotOwner { id, owner }) => {
                tracing::warn!(%id, %owner, "another daemon took this delegation over; \
                    this daemon stops running it");
                *live.owner.lock() = Some(owner);
                self.end_data_plane(live);
            }
            Err(e) => tracing::error!(error = %e, "persisting a delegation failed"),
        }
    }

    /// A read-only copy of a delegation another daemon owns (or a fresh `Live` for one
    /// this daemon takes over), keeping `tx` so watchers already attached stay attached.
    fn live_from_row(
        &self,
        d: StoredDelegation,
        owner: Option<String>,
        tx: Option<broadcast::Sender<WatchEvent>>,
    ) -> Arc<Live> {
        let lease = self.restored_lease(&d);
        let terminal = d.record.state.is_terminal();
        if terminal {
            lease.revoke(false);
        }
        Arc::new(Live {
            d: Mutex::new(d),
            lease,
            tx: tx.unwrap_or_else(|| broadcast::channel(256).0),
            exports: Mutex::new(Vec::new()),
            seen_renewals: Default::default(),
            progress: {
                let p = super::progress::Progress::new();
                p.set_phase(if terminal { "ended" } else { "started" });
                p
            },
            owner: Mutex::new(owner),
        })
    }

    /// Install or refresh the copy of a delegation another daemon owns.
    pub(crate) fn refresh_foreign(&self, row: StoredRow) {
        let id = row.delegation.record.id.as_str().to_string();
        let owner = row.owner.clone().unwrap_or_default();
        let old = self.get_live(&id);
        if let Some(l) = old.as_ref().filter(|l| !l.is_foreign()) {
            // Ours until now: someone claimed it while this daemon was not beating. Its
            // lease watch and event pump stop at their next turn.
            tracing::warn!(%id, %owner, "daemon {owner} took this delegation over");
            *l.owner.lock() = Some(owner.clone());
            self.end_data_plane(l);
        }
        let (tx, seen) = match &old {
            Some(l) => (Some(l.tx.clone()), l.d.lock().events.len()),
            None => (None, 0),
        };
        let new_events: Vec<WatchEvent> =
            row.delegation.events.iter().skip(seen).cloned().collect();
        let live = self.live_from_row(row.delegation, Some(owner), tx);
        self.live.lock().insert(id, live.clone());
        for ev in new_events {
            let _ = live.tx.send(ev);
        }
    }

    /// This daemon lost a delegation it ran: its export must not go on serving it (the new
    /// owner's revoke would not reach it), so its lease ends here — a final flush may still
    /// land within the grace — and the export is dropped after it.
    fn end_data_plane(&self, live: &Live) {
        live.lease.revoke(true);
        let ids: Vec<String> = live
            .exports
            .lock()
            .drain(..)
            .map(|e| e.id().to_string())
            .collect();
        if ids.is_empty() {
            return;
        }
        let grace = self.cfg.flush_grace + Duration::from_secs(1);
        let exports = self.exports.clone();
        self.spawn(async move {
            tokio::time::sleep(grace).await;
            for id in ids {
                exports.remove(&id);
            }
        });
    }

    /// Take over a delegation this daemon just claimed: enforce its lease, follow its
    /// Executor's events, and record the change of owner.
    pub(crate) fn take_over(self: &Arc<Self>, row: StoredRow) {
        let id = row.delegation.record.id.as_str().to_string();
        let old = self.get_live(&id);
        let previous = old.as_ref().and_then(|l| l.foreign_owner());
        if old.as_ref().is_some_and(|l| !l.is_foreign()) {
            return; // Ours already (a row without an owner, adopted).
        }
        let peer = row.delegation.record.peer_url.clone();
        let live = self.live_from_row(row.delegation, None, old.map(|l| l.tx.clone()));
        self.live.lock().insert(id.clone(), live.clone());
        tracing::warn!(%id, previous = previous.as_deref().unwrap_or("?"),
            "took over a delegation whose daemon stopped beating");
        self.record(
            &live,
            WatchEvent::Owner {
                daemon: self.daemon_id.clone(),
                previous,
                at: crate::now_iso(),
            },
        );
        if live.d.lock().record.state.is_terminal() {
            return;
        }
        let d = self.clone();
        let l = live.clone();
        self.spawn(async move { d.watch_expiry(l).await });
        let d = self.clone();
        self.spawn(async move { d.pump(live, peer, None).await });
    }

    /// One tick: beat, refresh the copies of other daemons' delegations, and take over
    /// those whose daemon has lapsed. Blocking (database calls).
    pub(crate) fn sync_once(self: &Arc<Self>, full: bool) -> Result<(), StoreError> {
        let beat = self
            .store
            .heartbeat(&self.daemon_id, &format!("http://{}", self.api_addr));
        let beating_for = {
            let mut since = self.beating_since.lock();
            if beat.is_err() {
                *since = None;
            }
            since.get_or_insert_with(Instant::now).elapsed()
        };
        beat?;
        let since = if full {
            0
        } else {
            self.seen_version.load(Ordering::SeqCst)
        };
        for row in self.store.changed_since(since)? {
            self.seen_version.fetch_max(row.version, Ordering::SeqCst);
            if row.owner.as_deref() == Some(self.daemon_id.as_str()) {
                continue;
            }
            let unchanged = self
                .get_live(row.delegation.record.id.as_str())
                .is_some_and(|l| {
                    l.is_foreign()
                        && l.d.lock().record.updated_at == row.delegation.record.updated_at
                        && l.d.lock().events.len() == row.delegation.events.len()
                        && l.foreign_owner() == row.owner
                });
            if !unchanged {
                self.refresh_foreign(row);
            }
        }
        // After an outage of the database every daemon's heartbeat is stale: a daemon that
        // has just reached it again gives the others a full lapse to beat before it takes
        // anything (and so does a daemon that has just started).
        if beating_for < self.cfg.failover_after {
            return Ok(());
        }
        for row in self
            .store
            .claim_orphans(&self.daemon_id, self.cfg.failover_after)?
        {
            self.seen_version.fetch_max(row.version, Ordering::SeqCst);
            self.take_over(row);
        }
        Ok(())
    }

    /// Beat and refresh every tick until the daemon stops.
    pub(crate) async fn share_loop(self: Arc<Self>) {
        let mut tick = 0u64;
        loop {
            let d = self.clone();
            let full = tick.is_multiple_of(FULL_RELOAD_EVERY);
            match tokio::task::spawn_blocking(move || d.sync_once(full)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "the shared state is unreachable"),
                Err(e) => tracing::error!(error = %e, "the shared-state tick failed"),
            }
            tick += 1;
            tokio::time::sleep(self.share_tick()).await;
        }
    }
}
