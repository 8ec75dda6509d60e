//! The daemon's commit screen: AECP contracts checked at write-back.
//!
//! Installed on each delegation's export when AECP attaches it ([`Daemon::aecp_attach`]).
//! Per commit it watches the workspace's contracted modules, and — with the policy switch
//! `hold_stale_writebacks` (`awcp-ctl serve --aecp-hold-stale`) and only while the worker is
//! stale on some revised module — every Python file. The decision is
//! `aecp_hooks::screen::judge`; this module stores and delivers what it says:
//!
//! * every verification is a `verdict` in the audit log (`"on": "write-back"`, `held`);
//! * a report (held, or a leftover stub written back) replaces the worker's earlier report
//!   for that path in the store and reaches its mount as an `IndexEvent::Violation`
//!   (`.aecp/violations`, the inbox, the socket); a passing write-back deletes it and sends
//!   `ViolationCleared`;
//! * when the worker acknowledges a revision ([`Daemon::aecp_after_ack`]), the files held
//!   only for that revision are released (`IndexEvent::Released`): the mount sends them
//!   again at once.

use std::sync::{Arc, Weak};

use aecp_hooks::contract::Contract;
use aecp_hooks::index::IndexEvent;
use aecp_hooks::screen::{Cause, ScreenReport, judge};
use aecp_hooks::store::{Store as AecpStore, StoredViolation};
use awcpfs::export::Export;
use awcpfs::export::screen::{CommitScreen, Screening, Watched};

use super::super::Daemon;
use super::super::flow::Refusal;
use super::store_err;

/// The screen of one worker's export.
#[derive(Debug)]
pub(crate) struct DaemonScreen {
    pub(crate) store: Arc<AecpStore>,
    pub(crate) workspace: String,
    pub(crate) hold_stale: bool,
    /// Where the worker's mount gets its events (weak: the export owns the screen).
    pub(crate) export: Weak<Export>,
}

impl DaemonScreen {
    fn push(&self, event: &IndexEvent) {
        if let Some(e) = self.export.upgrade() {
            e.aecp()
                .push(serde_json::to_value(event).unwrap_or_default());
        }
    }

    fn contract_of(&self, path: &str) -> Option<(Contract, u32)> {
        if !self.store.has_contract(&self.workspace, path).ok()? {
            return None;
        }
        let stored = self.store.contract(&self.workspace, path).ok()??;
        match serde_json::from_value::<Contract>(stored.body) {
            Ok(c) => Some((c, stored.revision)),
            Err(e) => {
                tracing::warn!(module = %path, error = %e, "AECP: a stored contract is unreadable; its module is not screened");
                None
            }
        }
    }
}

impl CommitScreen for DaemonScreen {
    fn watched(&self, worker: &str) -> Watched {
        let paths = match self.store.contracted_modules(&self.workspace) {
            Ok(p) => p.into_iter().collect(),
            Err(e) => {
                tracing::warn!(error = %e, "AECP: cannot list contracted modules; this commit is not screened");
                return Watched::default();
            }
        };
        let stale = self.hold_stale
            && self
                .store
                .stale_modules(&self.workspace, worker)
                .is_ok_and(|s| !s.is_empty());
        Watched {
            paths,
            suffixes: if stale { vec![".py".into()] } else { vec![] },
        }
    }

    fn screen(&self, worker: &str, path: &str, content: &[u8]) -> Screening {
        let source = String::from_utf8_lossy(content);
        let contract = self.contract_of(path);
        let stale = if self.hold_stale {
            self.store
                .stale_modules(&self.workspace, worker)
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let j = judge(
            path,
            &source,
            contract.as_ref().map(|(c, r)| (c, *r)),
            &stale,
        );
        let held = j.holds();
        if let (Some(report), Some((_, revision))) = (&j.verified, &contract) {
            let verdict = serde_json::json!({
                "revision": revision,
                "verdict": report.verdict.as_str(),
                "violations": report.violations,
                "on": "write-back",
                "held": held,
            });
            if let Err(e) = self
                .store
                .record_verdict(&self.workspace, path, worker, &verdict)
            {
                tracing::warn!(error = %e, "AECP: recording a verdict failed");
            }
        }
        match &j.report {
            Some(r) => {
                let stamped = ScreenReport {
                    at_ms: aecp_hooks::store::now_ms(),
                    ..r.clone()
                };
                let detail = serde_json::to_value(&stamped).unwrap_or_default();
                if let Err(e) = self
                    .store
                    .set_violation(&self.workspace, worker, path, &detail)
                {
                    tracing::warn!(error = %e, "AECP: recording a violation failed");
                }
                self.push(&IndexEvent::Violation {
                    module: path.to_owned(),
                    detail: detail.clone(),
                });
                tracing::info!(worker, path, held, cause = ?r.cause, "AECP: write-back screened");
                // The held content is kept (it survives a restart): a revision screens it
                // again and releases it if it passes.
                let kept = if held {
                    self.store.set_held(&self.workspace, worker, path, content)
                } else {
                    self.store.clear_held(worker, path).map(|_| ())
                };
                if let Err(e) = kept {
                    tracing::warn!(error = %e, "AECP: recording a held write-back failed");
                }
                if held {
                    return Screening::Hold {
                        reason: r.sentence(),
                        report: Some(detail),
                    };
                }
            }
            None => {
                let _ = self.store.clear_held(worker, path);
                if self.store.clear_violation(worker, path).unwrap_or(false) {
                    tracing::info!(
                        worker,
                        path,
                        "AECP: a write-back passed; its violation is cleared"
                    );
                    self.push(&IndexEvent::ViolationCleared {
                        module: path.to_owned(),
                        at_ms: aecp_hooks::store::now_ms(),
                    });
                }
            }
        }
        Screening::Pass
    }
}

impl Daemon {
    /// Installs the commit screen on `export` (worker `id` of `workspace`) and returns the
    /// events that seed its mount with the worker's current reports.
    pub(crate) fn aecp_install_screen(
        &self,
        id: &str,
        workspace: &str,
        export: &Arc<Export>,
    ) -> Vec<serde_json::Value> {
        export.set_screen(
            id,
            Arc::new(DaemonScreen {
                store: self.aecp.store.clone(),
                workspace: workspace.to_owned(),
                hold_stale: self.aecp.policy.hold_stale_writebacks,
                export: Arc::downgrade(export),
            }),
        );
        self.aecp
            .store
            .violations(workspace, Some(id))
            .unwrap_or_default()
            .into_iter()
            .map(|v| {
                serde_json::to_value(IndexEvent::Violation {
                    module: v.path,
                    detail: v.report,
                })
                .unwrap_or_default()
            })
            .collect()
    }

    /// After `worker` acknowledged a revision: every report of a file held for being stale
    /// whose revised imports are all acknowledged now is cleared, and those files are
    /// released on the worker's mount (sent again at once).
    pub(crate) fn aecp_after_ack(&self, workspace: &str, worker: &str) {
        let still: Vec<String> = self
            .aecp
            .store
            .stale_modules(workspace, worker)
            .unwrap_or_default()
            .into_iter()
            .map(|s| s.module)
            .collect();
        let mut released = Vec::new();
        for v in self
            .aecp
            .store
            .violations(workspace, Some(worker))
            .unwrap_or_default()
        {
            let Ok(r) = serde_json::from_value::<ScreenReport>(v.report) else {
                continue;
            };
            if r.cause != Cause::Stale || r.stale.iter().any(|s| still.contains(&s.module)) {
                continue;
            }
            if self
                .aecp
                .store
                .clear_violation(worker, &v.path)
                .unwrap_or(false)
            {
                let _ = self.aecp.store.clear_held(worker, &v.path);
                released.push(v.path);
            }
        }
        if released.is_empty() {
            return;
        }
        tracing::info!(worker, paths = ?released, "AECP: acknowledged; releasing held write-backs");
        for path in &released {
            self.aecp_push_worker(
                worker,
                &IndexEvent::ViolationCleared {
                    module: path.clone(),
                    at_ms: aecp_hooks::store::now_ms(),
                },
            );
        }
        self.aecp_push_worker(worker, &IndexEvent::Released { paths: released });
    }

    /// After a revision of `module`'s contract: every write-back of it held (by any worker
    /// of the workspace, kept in the store across restarts) is screened again against the
    /// new revision. One that passes now is released — its report cleared (or replaced by a
    /// leftover-stub report), and its mount sends it again at once, to be screened and
    /// applied; one that still fails gets the new revision's report. Whether any was
    /// released.
    pub(crate) fn aecp_rescreen_held(&self, workspace: &str, module: &str) -> bool {
        let held = match self.aecp.store.held_writes(workspace, module) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "AECP: cannot list held write-backs to screen again");
                return false;
            }
        };
        if held.is_empty() {
            return false;
        }
        let screen = self.screen_for(workspace);
        let Some((contract, revision)) = screen.contract_of(module) else {
            return false;
        };
        let mut released = false;
        for h in held {
            let source = String::from_utf8_lossy(&h.content);
            let stale = if screen.hold_stale {
                self.aecp
                    .store
                    .stale_modules(workspace, &h.worker)
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            let j = judge(module, &source, Some((&contract, revision)), &stale);
            let held_now = j.holds();
            if let Some(report) = &j.verified {
                let verdict = serde_json::json!({
                    "revision": revision,
                    "verdict": report.verdict.as_str(),
                    "violations": report.violations,
                    "on": "revision",
                    "held": held_now,
                });
                let _ = self
                    .aecp
                    .store
                    .record_verdict(workspace, module, &h.worker, &verdict);
            }
            let report = j.report.as_ref().map(|r| {
                serde_json::to_value(ScreenReport {
                    at_ms: aecp_hooks::store::now_ms(),
                    ..r.clone()
                })
                .unwrap_or_default()
            });
            match &report {
                Some(detail) => {
                    let _ = self
                        .aecp
                        .store
                        .set_violation(workspace, &h.worker, module, detail);
                    self.aecp_push_worker(
                        &h.worker,
                        &IndexEvent::Violation {
                            module: module.to_owned(),
                            detail: detail.clone(),
                        },
                    );
                }
                None => {
                    let _ = self.aecp.store.clear_violation(&h.worker, module);
                    self.aecp_push_worker(
                        &h.worker,
                        &IndexEvent::ViolationCleared {
                            module: module.to_owned(),
                            at_ms: aecp_hooks::store::now_ms(),
                        },
                    );
                }
            }
            if held_now {
                tracing::info!(worker = %h.worker, module, revision, "AECP: a held write-back still fails the revised contract");
                continue;
            }
            let _ = self.aecp.store.clear_held(&h.worker, module);
            released = true;
            tracing::info!(worker = %h.worker, module, revision, "AECP: the revised contract releases a held write-back");
            self.aecp_push_worker(
                &h.worker,
                &IndexEvent::Released {
                    paths: vec![module.to_owned()],
                },
            );
        }
        released
    }

    /// Forgets every report and held content on `worker`'s files (its change set was
    /// discarded: nothing of it stays behind), telling its mount when it has one.
    pub(crate) fn aecp_forget_worker_reports(&self, worker: &str) {
        match self.aecp.store.forget_worker_reports(worker) {
            Ok(paths) => {
                if !paths.is_empty() {
                    tracing::info!(worker, paths = ?paths, "AECP: a discarded change set's reports are forgotten");
                }
                for path in paths {
                    self.aecp_push_worker(
                        worker,
                        &IndexEvent::ViolationCleared {
                            module: path,
                            at_ms: aecp_hooks::store::now_ms(),
                        },
                    );
                }
            }
            Err(e) => {
                tracing::warn!(worker, error = %e, "AECP: forgetting a discarded change set's reports failed");
            }
        }
    }

    /// A screen over `workspace` (for [`DaemonScreen::contract_of`] outside a commit).
    fn screen_for(&self, workspace: &str) -> DaemonScreen {
        DaemonScreen {
            store: self.aecp.store.clone(),
            workspace: workspace.to_owned(),
            hold_stale: self.aecp.policy.hold_stale_writebacks,
            export: Weak::new(),
        }
    }

    /// `GET /aecp/violations?worker=[&workspace=true]`: the current reports of the worker
    /// (or of every worker of its workspace).
    pub(crate) fn aecp_violations(
        &self,
        worker: &str,
        whole_workspace: bool,
    ) -> Result<Vec<StoredViolation>, Refusal> {
        let info = self.aecp_worker(worker)?;
        self.aecp
            .store
            .violations(&info.workspace, (!whole_workspace).then_some(worker))
            .map_err(store_err)
    }
}
