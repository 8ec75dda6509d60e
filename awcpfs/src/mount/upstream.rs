//! The Delegator's own changes, shown on a running mount.
//!
//! The export watches its tree and sends `changed` events on its event stream (see the
//! export's `watch` module). The mount applies each changed path only where it has nothing
//! of its own to write back there: a path is *clean* when the node is exactly what the
//! syncer last knew the export to have (`synced`: same kind, content hash, mode, modification
//! time, attributes or target, and, for a file, not open for writing). A clean path takes
//! the Delegator's new state — metadata at once, content fetched on the next open — and the
//! syncer's record moves with it, so nothing is written back. A path with local changes
//! keeps them: the write-back that follows meets the Delegator's change and becomes a
//! conflict as before (both versions kept). Files with several names (hard links) are left
//! alone.
//!
//! Events are versioned: each carries the export's change sequence at which it was
//! described, and the syncer remembers, per path, the highest sequence it knows of there
//! (what its own commits left, from the commit results, and the events it applied). An
//! event no newer than that for a path, one of its parents, or anything below it is stale —
//! described before a commit of ours that it would roll back, typically the catch-up
//! answer of a reconnect that arrives late — and is ignored for that path
//! ([`UpstreamReport::stale`]).
//!
//! A path that the commit whose answer never came (the syncer's pending commit) changes, at
//! or below it, is the mount's own too: the export may have applied that commit without the
//! mount learning its sequence, so an event there — possibly that commit's own change,
//! handed back by a reconnect's catch-up — is left alone ([`UpstreamReport::kept_local`])
//! whatever the mount has there now, a file removed since included (it would come back,
//! and the retry would find nothing to remove). The retry learns the commit's sequence.
//!
//! A change of the mount's that loses to the Delegator's (a `chmod`, removal, `mkdir`,
//! `rmdir` or symlink that met a Delegator-side change: nothing of it is kept) would leave
//! the mount showing its own, discarded version while the event that described the
//! Delegator's was refused. Two things prevent that, both applied after the round
//! ([`Syncer::apply_settled`]): the commit's answer describes the Delegator's state at such
//! paths (`CommitResult::current`), shown at the commit's sequence where the path is still
//! what the commit sent; and every refused event is remembered (the latest per path) and
//! judged again, so it is shown once the path is clean — which is also how a mount learns
//! the Delegator's version from an export that predates `current`. A refused event older
//! than a commit of the mount's that landed at its path is dropped, and so is one at a path
//! whose write conflicted: the mount keeps its version there.
//!
//! Every applied change is journaled ([`Record::Upstream`], [`Record::Unlink`]) and logged
//! to `synced.log`, so crash recovery rebuilds the same tree and does not mistake the
//! Delegator's change for one of ours. The kernel is told after the tables are unlocked
//! ([`Inval`]): cached attributes and pages of changed files, and cached names, including
//! negative ones, of new and removed entries.

use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;

use awcp_protocol::dataplane::{EntryKind, ManifestEntry};

use super::inode::{
    Data, Ino, InodeTable, Kind, Node, ROOT_INO, hash_from_hex, manifest_xattrs, time_from_ns,
    time_to_ns,
};
use super::journal::Record;
use super::sync::{Synced, SyncedRecord, Syncer, hex_map, hex_xattrs};

/// Something the kernel must forget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inval {
    /// Attributes and cached pages of an inode.
    Inode(Ino),
    /// A name in a directory (it may be cached as absent).
    Entry(Ino, String),
    /// A name removed from a directory, and the inode it named.
    Delete(Ino, Ino, String),
    /// A regular file's content or attributes changed in place: its attributes and pages,
    /// and (with the kernel's writeback cache, which trusts its own size and times of a
    /// cached file over the filesystem's) the inode itself, reached through the name it
    /// changed under (parent, inode, name).
    Content(Ino, Ino, String),
}

/// What one batch of Delegator-side changes did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct UpstreamReport {
    /// Paths updated, created or removed on the mount.
    pub applied: usize,
    /// Paths left alone because the mount has its own changes there.
    pub kept_local: usize,
    /// Paths left alone because the event is older than what the mount committed or saw
    /// there.
    pub stale: usize,
}

/// Whether an event of sequence `seq` is stale at `path`: the mount knows of a state at
/// least as new at the path, at one of its parents, or below it.
pub(super) fn is_stale(seen: &BTreeMap<String, u64>, path: &str, seq: u64) -> bool {
    seen.get(path).is_some_and(|s| *s >= seq) || is_stale_around(seen, path, seq)
}

/// Whether an event of sequence `seq` is stale at `path` for what the mount knows of the
/// path's parents or of anything below it.
fn is_stale_around(seen: &BTreeMap<String, u64>, path: &str, seq: u64) -> bool {
    let newer = |p: &str| seen.get(p).is_some_and(|s| *s >= seq);
    if path.match_indices('/').any(|(i, _)| newer(&path[..i])) {
        return true;
    }
    let prefix = format!("{path}/");
    seen.range::<str, _>((
        std::ops::Bound::Included(prefix.as_str()),
        std::ops::Bound::Unbounded,
    ))
    .take_while(|(p, _)| p.starts_with(&prefix))
    .any(|(_, s)| *s >= seq)
}

/// Whether the mount has a change at `path` or below it that the export may have applied
/// without the mount learning its outcome: one of `pending` (the paths of the commit whose
/// answer has not come) is `path` or lies below it.
pub(super) fn is_pending(pending: &BTreeSet<String>, path: &str) -> bool {
    if pending.contains(path) {
        return true;
    }
    let prefix = format!("{path}/");
    pending
        .range::<str, _>((
            std::ops::Bound::Included(prefix.as_str()),
            std::ops::Bound::Unbounded,
        ))
        .next()
        .is_some_and(|p| p.starts_with(&prefix))
}

/// Record that the mount knows `path` as of sequence `seq`.
pub(super) fn note_seen(seen: &mut BTreeMap<String, u64>, path: &str, seq: u64) {
    let s = seen.entry(path.to_owned()).or_insert(seq);
    *s = (*s).max(seq);
}

/// The syncer's view of a path's node, as it would record it after a commit.
fn state_of(n: &Node) -> Option<Synced> {
    let xattrs = || hex_xattrs(n);
    match n.kind {
        Kind::Dir => Some(Synced::Dir {
            mode: u32::from(n.perm),
            xattrs: xattrs(),
        }),
        Kind::Symlink => Some(Synced::Symlink {
            target: n.target.clone().unwrap_or_default(),
        }),
        // Never written back: as a change of the mount's own at that path.
        Kind::Fifo | Kind::Socket | Kind::CharDev(_) | Kind::BlockDev(_) => None,
        Kind::File => {
            let hash = match &n.data {
                Data::Remote { hash, .. } => *hash,
                Data::Local {
                    dirty: false,
                    hash: Some(h),
                    ..
                } => *h,
                _ => return None,
            };
            Some(Synced::File {
                hash,
                mode: u32::from(n.perm),
                mtime_ns: Some(time_to_ns(n.mtime)),
                xattrs: xattrs(),
            })
        }
    }
}

/// What the syncer should record for an entry the Delegator now has.
fn state_of_entry(e: &ManifestEntry) -> Synced {
    // As the node will hold them (only what `manifest_xattrs` keeps), in hex.
    let xattrs = || hex_map(&manifest_xattrs(e));
    match e.kind {
        EntryKind::Dir => Synced::Dir {
            mode: e.mode & 0o7777,
            xattrs: xattrs(),
        },
        EntryKind::File => Synced::File {
            hash: e.hash.as_deref().map_or([0; 32], hash_from_hex),
            mode: e.mode & 0o7777,
            mtime_ns: Some(e.mtime_ns),
            xattrs: xattrs(),
        },
        EntryKind::Symlink => Synced::Symlink {
            target: e.target.clone().unwrap_or_default(),
        },
    }
}

/// Whether two syncer states agree on what a mount must show (a state logged before
/// modification times were recorded matches any time).
fn same_state(a: &Synced, b: &Synced) -> bool {
    match (a, b) {
        (
            Synced::File {
                hash: h1,
                mode: m1,
                mtime_ns: t1,
                xattrs: x1,
            },
            Synced::File {
                hash: h2,
                mode: m2,
                mtime_ns: t2,
                xattrs: x2,
            },
        ) => h1 == h2 && m1 == m2 && x1 == x2 && (t1.is_none() || t2.is_none() || t1 == t2),
        _ => a == b,
    }
}

/// `path`'s node and every node below it, with their paths, parents first.
fn subtree(table: &InodeTable, path: &str, ino: Ino) -> Vec<(String, Ino)> {
    let mut out = vec![(path.to_owned(), ino)];
    let mut i = 0;
    while i < out.len() {
        let (p, n) = out[i].clone();
        if let Some(node) = table.get(n) {
            for (name, child) in &node.children {
                out.push((format!("{p}/{name}"), *child));
            }
        }
        i += 1;
    }
    out
}

/// Whether every node in `nodes` is exactly what `synced` says the export has, not open
/// for writing (nor written without a handle and not yet handed to the syncer, nor a created
/// file the kernel may still write directly: its writer holds the upper file, which a
/// replacement would leave behind), and has one name.
fn all_clean(
    fs: &super::fs::AwcpFs,
    table: &InodeTable,
    synced: &BTreeMap<String, Synced>,
    nodes: &[(String, Ino)],
) -> bool {
    nodes.iter().all(|(path, ino)| {
        let Some(n) = table.get(*ino) else {
            return false;
        };
        if n.open_writers > 0 || n.bypassed || !n.links.is_empty() || fs.recently_written(*ino) {
            return false;
        }
        match (state_of(n), synced.get(path)) {
            (Some(now), Some(known)) => same_state(&now, known),
            _ => false,
        }
    })
}

/// Where a description of the Delegator's state comes from, which decides when it is
/// stale at a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// A `changed` event: stale where the mount knows of a state as new at the path, a
    /// parent or below it (see [`is_stale`]).
    Event,
    /// An event refused earlier, judged again: as an event, except that at the path itself
    /// only a newer state makes it stale (its own refusal noted its sequence there; a
    /// commit of the mount's that landed at the path forgets it instead, see
    /// `Syncer::finish_commit`).
    Refused,
    /// A commit's answer, where the Delegator's state won over the mount's change
    /// (`CommitResult::current`), at the commit's sequence: described after everything
    /// that sequence covers, so stale only where the mount took a newer event at that very
    /// path since. Paths that the same commit changed around it do not make it stale.
    Answer,
}

impl Syncer {
    /// Apply one `changed` event of sequence `seq`; returns what the kernel must forget
    /// and what was done. Paths where the event is stale (see the module docs) are left
    /// alone; paths left alone because the mount has its own change there are remembered
    /// and judged again after each round (see [`Syncer::apply_settled`]).
    pub fn apply_upstream(
        &self,
        seq: u64,
        entries: &[ManifestEntry],
        removed: &[String],
    ) -> (Vec<Inval>, UpstreamReport) {
        self.judge(Source::Event, seq, entries, removed)
    }

    /// Whether a round has something to show afterwards ([`Syncer::apply_settled`]).
    pub(super) fn has_settled(&self) -> bool {
        !self.answered.lock().is_empty() || !self.refused.lock().is_empty()
    }

    /// Show what rounds learned of the Delegator's state: the state commit answers
    /// described where the Delegator's version won over a change of the mount's (a `chmod`,
    /// removal, `mkdir`, `rmdir` or symlink that met a Delegator-side change, nothing of it
    /// kept), then every event refused earlier, judged again (it applies where the path is
    /// clean now: the mount's change there was dropped, or was no change after all; it is
    /// dropped where a commit of the mount's since makes it stale). Called after each
    /// round, with the syncer's locks released; returns what the kernel must forget and
    /// what was done (`kept_local` counts only answers: refused events were counted when
    /// they came).
    pub fn apply_settled(&self) -> (Vec<Inval>, UpstreamReport) {
        let mut invals = Vec::new();
        let mut report = UpstreamReport::default();
        let answered = std::mem::take(&mut *self.answered.lock());
        for (seq, current) in answered {
            let (i, r) = self.judge(Source::Answer, seq, &current.entries, &current.removed);
            invals.extend(i);
            report.applied += r.applied;
            report.kept_local += r.kept_local;
            report.stale += r.stale;
        }
        // Judged again in the order they came (a path's latest one only), each at its own
        // sequence; those still refused are remembered again.
        let refused = std::mem::take(&mut *self.refused.lock());
        let mut by_seq: BTreeMap<u64, (Vec<ManifestEntry>, Vec<String>)> = BTreeMap::new();
        for (path, (seq, entry)) in refused {
            let (entries, removed) = by_seq.entry(seq).or_default();
            match entry {
                Some(e) => entries.push(e),
                None => removed.push(path),
            }
        }
        for (seq, (entries, removed)) in by_seq {
            let (i, r) = self.judge(Source::Refused, seq, &entries, &removed);
            invals.extend(i);
            report.applied += r.applied;
            report.stale += r.stale;
        }
        (invals, report)
    }

    fn judge(
        &self,
        source: Source,
        seq: u64,
        entries: &[ManifestEntry],
        removed: &[String],
    ) -> (Vec<Inval>, UpstreamReport) {
        let stale = |seen: &BTreeMap<String, u64>, path: &str| match source {
            Source::Event => is_stale(seen, path, seq),
            Source::Refused => {
                seen.get(path).is_some_and(|s| *s > seq) || is_stale_around(seen, path, seq)
            }
            Source::Answer => seen.get(path).is_some_and(|s| *s > seq),
        };
        // Paths left alone for a change of the mount's (events only: an answer is as new
        // as anything the mount has refused there), and paths settled otherwise.
        let mut refused_now: Vec<(String, Option<ManifestEntry>)> = Vec::new();
        let mut settled: Vec<&str> = Vec::new();
        let mut synced = self.synced.lock();
        // Taken under `synced`: a round holds it while it sends, so the pending commit
        // cannot change until this event is judged.
        let pending = self.pending_paths();
        let mut seen = self.seen.lock();
        // Paths this event is news for: marked seen once the whole event is judged, so a
        // path does not make its own event stale for its parent or children.
        let mut fresh: Vec<&str> = Vec::new();
        let fs = self.fs();
        let mut table = fs.table.lock();
        let mut invals = Vec::new();
        let mut records: Vec<Record> = Vec::new();
        let mut logged: Vec<SyncedRecord> = Vec::new();
        let mut report = UpstreamReport::default();

        for path in removed {
            if awcp_protocol::dataplane::validate_rel_path(path).is_err() {
                continue;
            }
            if stale(&seen, path) {
                report.stale += 1;
                settled.push(path);
                continue;
            }
            fresh.push(path);
            if is_pending(&pending, path) {
                report.kept_local += 1;
                refused_now.push((path.clone(), None));
                continue;
            }
            settled.push(path);
            match table.resolve(path) {
                None => {
                    // Gone here too (removed or moved away locally): the syncer must not
                    // send a removal the Delegator already made.
                    forget(&mut synced, &mut logged, path);
                }
                Some(ino) => {
                    let nodes = subtree(&table, path, ino);
                    if !all_clean(fs, &table, &synced, &nodes) {
                        report.kept_local += 1;
                        settled.pop();
                        refused_now.push((path.clone(), None));
                        continue;
                    }
                    remove_subtree(fs, &mut table, &nodes, &mut records, &mut invals);
                    forget(&mut synced, &mut logged, path);
                    report.applied += 1;
                }
            }
        }

        for e in entries {
            if awcp_protocol::dataplane::validate_rel_path(&e.path).is_err() {
                continue;
            }
            if stale(&seen, &e.path) {
                report.stale += 1;
                settled.push(&e.path);
                continue;
            }
            if e.kind == EntryKind::File && e.hash.is_none() {
                // A withheld file (excluded or sensitive): no content to show; the mount
                // keeps the metadata it started with.
                continue;
            }
            fresh.push(&e.path);
            if is_pending(&pending, &e.path) {
                // Ours, changed in a commit whose answer never came: the event may be that
                // commit's own echo (a file removed here since would come back) or older.
                // The retry learns what the export has there.
                report.kept_local += 1;
                refused_now.push((e.path.clone(), Some(e.clone())));
                continue;
            }
            let (parent_path, name) = match e.path.rsplit_once('/') {
                Some((p, n)) => (Some(p), n),
                None => (None, e.path.as_str()),
            };
            let parent = match parent_path {
                None => Some(ROOT_INO),
                Some(p) => table.resolve(p),
            };
            let Some(parent) =
                parent.filter(|p| table.get(*p).is_some_and(|n| n.kind == Kind::Dir))
            else {
                // The directory is gone here (or never came): the entry has nowhere to go.
                report.kept_local += 1;
                refused_now.push((e.path.clone(), Some(e.clone())));
                continue;
            };
            let want = state_of_entry(e);
            match table.child(parent, name) {
                None => {
                    if synced.contains_key(&e.path) {
                        // Removed or renamed away here: that change is still to be written
                        // back (and meets the Delegator's as a conflict).
                        report.kept_local += 1;
                        refused_now.push((e.path.clone(), Some(e.clone())));
                        continue;
                    }
                    create(
                        &mut table,
                        parent,
                        name,
                        e,
                        &mut records,
                        &mut invals,
                        fs.options(),
                    );
                }
                Some(ino) => {
                    let Some(node) = table.get(ino) else { continue };
                    if node.kind == Kind::from(e.kind)
                        && state_of(node).is_some_and(|s| same_state(&s, &want))
                    {
                        // Already so (our own write-back, or a repeat after a reconnect).
                        if synced.get(&e.path) != Some(&want) {
                            synced.insert(e.path.clone(), want.clone());
                            logged.push(SyncedRecord {
                                path: e.path.clone(),
                                state: Some(want),
                            });
                        }
                        settled.push(&e.path);
                        continue;
                    }
                    // Same kind: only the node itself changes. Another kind: the node and
                    // everything below it are replaced, so all of it must be clean.
                    let same_kind = node.kind == Kind::from(e.kind);
                    let is_file = node.kind == Kind::File;
                    let nodes = if same_kind {
                        vec![(e.path.clone(), ino)]
                    } else {
                        subtree(&table, &e.path, ino)
                    };
                    if !all_clean(fs, &table, &synced, &nodes) {
                        report.kept_local += 1;
                        refused_now.push((e.path.clone(), Some(e.clone())));
                        continue;
                    }
                    if same_kind {
                        update(fs, &mut table, ino, e, &mut records);
                        invals.push(if is_file {
                            Inval::Content(parent, ino, name.to_owned())
                        } else {
                            Inval::Inode(ino)
                        });
                    } else {
                        remove_subtree(fs, &mut table, &nodes, &mut records, &mut invals);
                        forget(&mut synced, &mut logged, &e.path);
                        create(
                            &mut table,
                            parent,
                            name,
                            e,
                            &mut records,
                            &mut invals,
                            fs.options(),
                        );
                    }
                }
            }
            synced.insert(e.path.clone(), want.clone());
            logged.push(SyncedRecord {
                path: e.path.clone(),
                state: Some(want),
            });
            settled.push(&e.path);
            report.applied += 1;
        }
        drop(table);
        for path in fresh {
            note_seen(&mut seen, path, seq);
        }
        drop(seen);
        {
            let mut refused = self.refused.lock();
            for path in settled {
                if refused.get(path).is_some_and(|(s, _)| *s <= seq) {
                    refused.remove(path);
                }
            }
            if source != Source::Answer {
                for (path, entry) in refused_now {
                    if refused.get(&path).is_none_or(|(s, _)| *s <= seq) {
                        refused.insert(path, (seq, entry));
                    }
                }
            }
        }
        if let Err(e) = fs.journal(&records) {
            tracing::warn!(error = %e, "cannot journal the Delegator's changes");
        }
        self.log_synced(&logged);
        (invals, report)
    }
}

/// Drop `path` and everything below it from the syncer's record.
fn forget(synced: &mut BTreeMap<String, Synced>, logged: &mut Vec<SyncedRecord>, path: &str) {
    // The path, then its subtree: the keys from `path/` that start with it (sorted map).
    let prefix = format!("{path}/");
    let gone: Vec<String> = synced
        .get_key_value(path)
        .map(|(k, _)| k.clone())
        .into_iter()
        .chain(
            synced
                .range(prefix.clone()..)
                .map(|(k, _)| k)
                .take_while(|k| k.starts_with(&prefix))
                .cloned(),
        )
        .collect();
    for p in gone {
        synced.remove(&p);
        logged.push(SyncedRecord {
            path: p,
            state: None,
        });
    }
}

/// Remove the nodes of a subtree (given parents first), deepest first.
fn remove_subtree(
    fs: &super::fs::AwcpFs,
    table: &mut InodeTable,
    nodes: &[(String, Ino)],
    records: &mut Vec<Record>,
    invals: &mut Vec<Inval>,
) {
    for (_, ino) in nodes.iter().rev() {
        let Some((parent, name)) = table.get(*ino).map(|n| (n.parent, n.name.clone())) else {
            continue;
        };
        fs.remove_dentry(table, parent, &name);
        records.push(Record::Unlink {
            parent,
            name: name.clone(),
        });
        if let Some((_, top)) = nodes.first()
            && top == ino
        {
            invals.push(Inval::Delete(parent, *ino, name));
        }
    }
}

/// A new node for an entry the Delegator created.
fn create(
    table: &mut InodeTable,
    parent: Ino,
    name: &str,
    e: &ManifestEntry,
    records: &mut Vec<Record>,
    invals: &mut Vec<Inval>,
    opts: &super::fs::FsOptions,
) {
    let ino = table.alloc_ino();
    let t = time_from_ns(e.mtime_ns);
    let kind = Kind::from(e.kind);
    let node = Node {
        ino,
        parent,
        name: name.to_owned(),
        kind,
        perm: (e.mode & 0o7777) as u16,
        uid: opts.uid,
        gid: opts.gid,
        size: e.size,
        atime: t,
        mtime: t,
        ctime: e.ctime_ns.map_or(t, time_from_ns),
        children: Default::default(),
        subdirs: 0,
        target: e.target.clone(),
        data: match kind {
            Kind::File => Data::remote(e.hash.as_deref(), &e.blocks),
            _ => Data::None,
        },
        open_handles: 0,
        open_writers: 0,
        bypassed: false,
        unlinked: false,
        links: Vec::new(),
        xattrs: manifest_xattrs(e),
    };
    records.push(Record::upstream(&node));
    table.insert(node);
    table.insert_child(parent, name.to_owned(), ino);
    if let Some(p) = table.get_mut(parent) {
        p.mtime = SystemTime::now();
        p.ctime = p.mtime;
    }
    invals.push(Inval::Entry(parent, name.to_owned()));
}

/// Give an existing, clean node the entry's state; its content is fetched again on the
/// next open.
fn update(
    fs: &super::fs::AwcpFs,
    table: &mut InodeTable,
    ino: Ino,
    e: &ManifestEntry,
    records: &mut Vec<Record>,
) {
    let Some(n) = table.get_mut(ino) else { return };
    let t = time_from_ns(e.mtime_ns);
    n.perm = (e.mode & 0o7777) as u16;
    n.ctime = e.ctime_ns.map_or_else(SystemTime::now, time_from_ns);
    if n.kind != Kind::Symlink {
        n.xattrs = manifest_xattrs(e);
    }
    match n.kind {
        Kind::File => {
            let had_local = matches!(n.data, Data::Local { .. });
            n.size = e.size;
            n.mtime = t;
            n.data = Data::remote(e.hash.as_deref(), &e.blocks);
            if had_local {
                // Open readers keep the old content through their descriptors.
                let _ = std::fs::remove_file(fs.upper_path(ino));
                fs.upper.forget(ino);
            }
        }
        Kind::Symlink => {
            n.target = e.target.clone();
            n.size = e.target.as_ref().map_or(0, |t| t.len() as u64);
            n.mtime = t;
        }
        Kind::Dir | Kind::Fifo | Kind::Socket | Kind::CharDev(_) | Kind::BlockDev(_) => {}
    }
    records.push(Record::upstream(n));
}

#[cfg(test)]
mod tests {
    use super::*;

    // A reconnect's catch-up described before the mount's own commit (a lower sequence)
    // must not roll that commit back: not at the path, nor through a parent or a child.
    #[test]
    fn events_no_newer_than_what_the_mount_knows_are_stale() {
        let mut seen = BTreeMap::new();
        note_seen(&mut seen, "d/x", 10);
        assert!(is_stale(&seen, "d/x", 9));
        assert!(is_stale(&seen, "d/x", 10));
        assert!(!is_stale(&seen, "d/x", 11));
        // A removal of the parent described before the commit below it.
        assert!(is_stale(&seen, "d", 10));
        assert!(!is_stale(&seen, "d", 11));
        // Below a path known newer.
        assert!(is_stale(&seen, "d/x/y", 5));
        // Unrelated paths, including one sharing a prefix.
        assert!(!is_stale(&seen, "d/xy", 5));
        assert!(!is_stale(&seen, "e", 1));
        // Never lowered.
        note_seen(&mut seen, "d/x", 3);
        assert!(is_stale(&seen, "d/x", 10));
    }

    // An event at a path the unanswered commit changed (or below it) cannot be told from
    // that commit's echo: it is the mount's own.
    #[test]
    fn paths_of_the_unanswered_commit_are_the_mounts_own() {
        let pending: BTreeSet<String> = ["d/x".to_owned(), "e".to_owned()].into();
        assert!(is_pending(&pending, "d/x"));
        assert!(is_pending(&pending, "d"));
        assert!(is_pending(&pending, "e"));
        assert!(!is_pending(&pending, "d/x/y"));
        assert!(!is_pending(&pending, "d/xy"));
        assert!(!is_pending(&pending, "d/w"));
        assert!(!is_pending(&pending, "f"));
        assert!(!is_pending(&BTreeSet::new(), "d/x"));
    }
}
