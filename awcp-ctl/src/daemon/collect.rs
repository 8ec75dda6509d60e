//! `awcp-ctl collect`: bring back the changes an Executor kept because it could not write
//! them back before the lease ended, one resource at a time.

use std::sync::Arc;
use std::time::Duration;

use awcp_lease::{Lease, LeaseTerms, SystemClock};
use awcp_protocol::ErrorCode;
use awcpfs::export::ExportConfig;

use super::Daemon;
use super::api::CollectResponse;
use super::flow::{Refusal, awcp_base, with_token};
use crate::store::StoredResource;
use crate::watch::WatchEvent;

impl Daemon {
    /// Collect (or discard) the changes an Executor kept because it could not write them
    /// back before the lease ended: apply them to each resource with the usual conflict
    /// checks, then tell the Executor to drop them.
    pub(crate) async fn collect(
        &self,
        id: &str,
        discard: bool,
    ) -> Result<CollectResponse, Refusal> {
        let live = self.get_live(id).ok_or_else(|| Refusal {
            status: 404,
            message: format!("Unknown delegation: {id}"),
            code: None,
            hint: None,
        })?;
        self.check_owned(&live)?;
        let (state, peer, resources, token) = {
            let d = live.d.lock();
            (
                d.record.state,
                d.record.peer_url.clone(),
                d.exported_resources(),
                d.executor_credential(),
            )
        };
        if !state.is_terminal() {
            return Err(Refusal {
                status: 409,
                message: format!(
                    "delegation {id} is still {}; its changes are being written back live",
                    state.as_str()
                ),
                code: None,
                hint: Some("Revoke it first, or wait for it to end".into()),
            });
        }
        let url = format!("{}/tasks/{id}/bundle", awcp_base(&peer));
        let several = resources.len() > 1;
        let mut response = CollectResponse::default();
        let mut kept = 0;
        for r in &resources {
            // One resource: the bundle of the delegation; several: one per resource.
            let query: Vec<(&str, &str)> = if several {
                vec![("resource", r.name.as_str())]
            } else {
                Vec::new()
            };
            if discard {
                let rb = with_token(self.http.delete(&url), token.as_deref()).query(&query);
                if rb.send().await.is_ok_and(|r| r.status().is_success()) {
                    kept += 1;
                }
                continue;
            }
            let Some(bytes) = self.fetch_bundle(&url, &query, token.as_deref()).await? else {
                continue;
            };
            kept += 1;
            let (applied, conflicts) = self.apply_bundle(&live, id, r, &bytes).await?;
            response.applied += applied;
            response.conflicts.extend(conflicts);
            // Applied: the Executor may drop its copy.
            let _ = with_token(self.http.delete(&url), token.as_deref())
                .query(&query)
                .send()
                .await;
        }
        if kept == 0 && !discard {
            return Err(Refusal {
                status: 404,
                message: format!("the executor keeps no unwritten changes for {id}"),
                code: None,
                hint: Some("Everything was written back, or it was already collected".into()),
            });
        }
        response.discarded = discard;
        self.record(
            &live,
            WatchEvent::State {
                state,
                at: crate::now_iso(),
                detail: Some(if discard {
                    "kept changes discarded".into()
                } else {
                    format!(
                        "collected {} change(s), {} conflict(s)",
                        response.applied,
                        response.conflicts.len()
                    )
                }),
            },
        );
        Ok(response)
    }

    /// The recovery bundle the Executor keeps (None: nothing kept).
    async fn fetch_bundle(
        &self,
        url: &str,
        query: &[(&str, &str)],
        token: Option<&str>,
    ) -> Result<Option<bytes::Bytes>, Refusal> {
        // Right after a revoke the Executor may still be unmounting: give it a moment.
        let mut tries = 0;
        let resp = loop {
            let rb = with_token(self.http.get(url), token).query(query);
            let resp = rb.send().await.map_err(|e| {
                Refusal::internal(format!("asking the executor for its kept changes: {e}"))
            })?;
            if resp.status().as_u16() != 409 || tries >= 50 {
                break resp;
            }
            tries += 1;
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        if resp.status().as_u16() == 404 {
            return Ok(None);
        }
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            return Err(Refusal::internal(format!(
                "the executor answered {status}: {body}"
            )));
        }
        resp.bytes()
            .await
            .map(Some)
            .map_err(|e| Refusal::internal(format!("reading the recovery bundle: {e}")))
    }

    /// Apply one resource's bundle through a short-lived export of it (the usual checks).
    async fn apply_bundle(
        &self,
        live: &super::Live,
        id: &str,
        r: &StoredResource,
        bytes: &[u8],
    ) -> Result<(u64, Vec<awcp_protocol::dataplane::Conflict>), Refusal> {
        let (changes, blocks) = awcp_protocol::dataplane::decode_bundle(bytes)
            .map_err(|e| Refusal::internal(format!("the recovery bundle is malformed: {e}")))?;
        if r.read_only {
            return Err(Refusal::bad(
                ErrorCode::WorkspaceInvalid,
                format!(
                    "resource {} of delegation {id} was read-only; it has nothing to collect",
                    r.name
                ),
                "Discard the kept changes with --discard",
            ));
        }
        // Snapshot mode staged/discard: the kept changes join the change set instead.
        if super::staged::stages_commits(live) {
            let result = self.stage_bundle(live, changes, blocks).await?;
            return Ok((result.applied, result.conflicts));
        }
        let exports = self.exports.clone();
        let cid = format!("collect-{}", r.export_id);
        let staging = self.cfg.state_dir.join("staging").join(&cid);
        let block_size = self.cfg.block_size;
        let spec = live
            .d
            .lock()
            .record
            .environment
            .resources
            .iter()
            .find(|s| s.name == r.name)
            .cloned();
        let source = r.source.clone();
        let filter = spec
            .map(|s| super::admission::export_filter(self.resource_filter(&s, &source), false).0);
        let result = tokio::task::spawn_blocking(move || {
            let lease = Arc::new(Lease::grant(
                Arc::new(SystemClock::new()),
                LeaseTerms {
                    ttl: Duration::from_secs(60),
                    max_ttl: Duration::from_secs(60),
                    flush_grace: Duration::ZERO,
                },
            ));
            let cfg = ExportConfig {
                root: source,
                read_only: false,
                block_size,
                staging_dir: staging,
            };
            let export = exports
                .register_filtered(cid.clone(), crate::random_token(), cfg, lease, filter)
                .map_err(|e| e.to_string())?;
            let r = export
                .apply_bundle(&changes, &blocks)
                .map_err(|e| e.to_string());
            exports.remove(&cid);
            r
        })
        .await
        .map_err(|e| Refusal::internal(format!("applying the bundle: {e}")))?
        .map_err(|e| Refusal::internal(format!("applying the bundle: {e}")))?;
        Ok((result.applied, result.conflicts))
    }
}
