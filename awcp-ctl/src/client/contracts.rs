//! The AECP contract routes of the daemon API (`/aecp/contracts…`).

use super::{ClientError, DaemonClient};
use crate::daemon::aecp::{
    ConsumerRequest, DeclareRequest, DeclareResponse, ShowResponse, VerifyRequest,
};
use aecp_hooks::contract::verify::Report;

impl DaemonClient {
    /// `POST /aecp/contracts/declare` (or `/revise` when `revise`).
    pub async fn aecp_declare(
        &self,
        req: &DeclareRequest,
        revise: bool,
    ) -> Result<DeclareResponse, ClientError> {
        let path = if revise {
            "/aecp/contracts/revise"
        } else {
            "/aecp/contracts/declare"
        };
        self.send(self.post_(path).json(req)).await
    }

    /// `GET /aecp/contracts?worker=&module=`.
    pub async fn aecp_contract(
        &self,
        worker: &str,
        module: &str,
    ) -> Result<ShowResponse, ClientError> {
        self.send(
            self.get_("/aecp/contracts")
                .query(&[("worker", worker), ("module", module)]),
        )
        .await
    }

    /// `POST /aecp/contracts/verify`.
    pub async fn aecp_verify(&self, req: &VerifyRequest) -> Result<Report, ClientError> {
        self.send(self.post_("/aecp/contracts/verify").json(req))
            .await
    }

    /// `POST /aecp/contracts/depend`.
    pub async fn aecp_depend(&self, req: &ConsumerRequest) -> Result<(), ClientError> {
        let _: serde_json::Value = self
            .send(self.post_("/aecp/contracts/depend").json(req))
            .await?;
        Ok(())
    }

    /// `POST /aecp/contracts/ack`: the acknowledged revision.
    pub async fn aecp_ack(&self, req: &ConsumerRequest) -> Result<u32, ClientError> {
        let v: serde_json::Value = self
            .send(self.post_("/aecp/contracts/ack").json(req))
            .await?;
        Ok(v["revision"].as_u64().unwrap_or(0) as u32)
    }

    /// `GET /aecp/violations?worker=[&workspace=true]`: the commit screen's current reports
    /// of the worker (with `whole_workspace`, of every worker of its workspace).
    pub async fn aecp_violations(
        &self,
        worker: &str,
        whole_workspace: bool,
    ) -> Result<Vec<aecp_hooks::store::StoredViolation>, ClientError> {
        let whole = if whole_workspace { "true" } else { "false" };
        self.send(
            self.get_("/aecp/violations")
                .query(&[("worker", worker), ("workspace", whole)]),
        )
        .await
    }
}
