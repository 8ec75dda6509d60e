//! The AECP routes of the daemon API (`/aecp/…`).

use aecp_hooks::knowledge::{Artifact, Delivery};
use aecp_hooks::store::AuditEntry;
use awcp_protocol::api::OkResponse;

use super::{ClientError, DaemonClient};
use crate::daemon::aecp::{
    FlagRequest, FlagResponse, OwnersRequest, PublishRequest, PublishResponse,
};

fn worker_query(worker: &str) -> Vec<(&'static str, String)> {
    vec![("worker", worker.to_owned())]
}

impl DaemonClient {
    /// `POST /aecp/publish`.
    pub async fn aecp_publish(&self, req: &PublishRequest) -> Result<PublishResponse, ClientError> {
        self.send(self.post_("/aecp/publish").json(req)).await
    }

    /// `POST /aecp/flag`.
    pub async fn aecp_flag(&self, req: &FlagRequest) -> Result<FlagResponse, ClientError> {
        self.send(self.post_("/aecp/flag").json(req)).await
    }

    /// `POST /aecp/owners`.
    pub async fn aecp_owners(
        &self,
        worker: &str,
        owns: &[String],
    ) -> Result<OkResponse, ClientError> {
        let req = OwnersRequest {
            worker: worker.to_owned(),
            owns: owns.to_vec(),
        };
        self.send(self.post_("/aecp/owners").json(&req)).await
    }

    /// `GET /aecp/artifacts`: every artifact of the worker's workspace.
    pub async fn aecp_list(&self, worker: &str) -> Result<Vec<Artifact>, ClientError> {
        self.send(self.get_("/aecp/artifacts").query(&worker_query(worker)))
            .await
    }

    /// `GET /aecp/inbox`: what the worker received.
    pub async fn aecp_inbox(&self, worker: &str) -> Result<Vec<Delivery>, ClientError> {
        self.send(self.get_("/aecp/inbox").query(&worker_query(worker)))
            .await
    }

    /// `GET /aecp/lookup`: the findings for a path (not a delivery).
    pub async fn aecp_lookup(
        &self,
        worker: &str,
        path: &str,
    ) -> Result<Vec<Delivery>, ClientError> {
        let mut q = worker_query(worker);
        q.push(("path", path.to_owned()));
        self.send(self.get_("/aecp/lookup").query(&q)).await
    }

    /// `GET /aecp/audit`: the workspace's audit log.
    pub async fn aecp_audit(&self, worker: &str) -> Result<Vec<AuditEntry>, ClientError> {
        self.send(self.get_("/aecp/audit").query(&worker_query(worker)))
            .await
    }
}
