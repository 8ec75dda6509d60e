//! Transport handles: how the Executor reaches the workspace.
//!
//! START carries one [`TransportHandle`], a JSON object whose `transport` field says which
//! transport it is for. The reference defines four (`archive`, `sshfs`, `storage`, `git`);
//! we add `awcpfs`. Each variant's fields are exactly the reference's, in camelCase, with
//! optional fields left out of the JSON when absent (the reference never sends `null`).
//!
//! Handles carry credentials (tokens, private keys) and, for `archive`, the whole workspace as
//! base64. Their `Debug` output redacts those fields; use the fields themselves when the value
//! is really needed.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::decode::{decode, discriminator};
use crate::error::ProtocolError;
use crate::redact::Redacted;

/// A transport's name, as in INVITE's `requirements.transport` and a handle's `transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportType {
    /// A live SSHFS mount over a one-off SSH certificate (reference).
    Sshfs,
    /// The whole workspace as a base64 zip inside START (reference).
    Archive,
    /// A zip behind pre-signed download/upload URLs (reference).
    Storage,
    /// A branch pushed to a git remote (reference).
    Git,
    /// Our lazily-fetched FUSE mount of the Delegator's export.
    Awcpfs,
}

impl TransportType {
    /// The wire name, e.g. `"archive"`.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportType::Sshfs => "sshfs",
            TransportType::Archive => "archive",
            TransportType::Storage => "storage",
            TransportType::Git => "git",
            TransportType::Awcpfs => "awcpfs",
        }
    }
}

impl fmt::Display for TransportType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// START's `transportHandle`: everything the Executor needs to reach the workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "transport", rename_all = "lowercase")]
pub enum TransportHandle {
    /// `sshfs`.
    Sshfs(SshfsHandle),
    /// `archive`.
    Archive(ArchiveHandle),
    /// `storage`.
    Storage(StorageHandle),
    /// `git`.
    Git(GitHandle),
    /// `awcpfs` (ours).
    Awcpfs(AwcpfsHandle),
}

impl TransportHandle {
    /// Every `transport` string, in declaration order.
    pub const KINDS: [&'static str; 5] = ["sshfs", "archive", "storage", "git", "awcpfs"];

    /// Which transport this handle is for.
    pub fn transport_type(&self) -> TransportType {
        match self {
            TransportHandle::Sshfs(_) => TransportType::Sshfs,
            TransportHandle::Archive(_) => TransportType::Archive,
            TransportHandle::Storage(_) => TransportType::Storage,
            TransportHandle::Git(_) => TransportType::Git,
            TransportHandle::Awcpfs(_) => TransportType::Awcpfs,
        }
    }
}

/// Parse a transport handle on its own (e.g. a handle file given to `awcpfs mount`), with the
/// same precise errors as [`parse_message`](crate::parse_message).
pub fn parse_transport_handle(bytes: &[u8]) -> Result<TransportHandle, ProtocolError> {
    decode(bytes, |obj| {
        let kind = discriminator(
            obj,
            "transport",
            "transport handle",
            &TransportHandle::KINDS,
        )?;
        Ok(format!("{kind} transport handle"))
    })
}

/// `archive`: the workspace zip, inline.
///
/// The zip holds one top-level directory per resource, named after the resource
/// (`<resourceName>/…`), and no `.awcp/` directory.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ArchiveHandle {
    /// The zip file, standard base64 with padding.
    pub workspace_base64: String,
    /// SHA-256 of the zip bytes (not of the base64 text), lowercase hex.
    pub checksum: String,
}

impl fmt::Debug for ArchiveHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArchiveHandle")
            .field("workspace_base64", &Redacted(&self.workspace_base64))
            .field("checksum", &self.checksum)
            .finish()
    }
}

/// `sshfs`: an SSH endpoint and a short-lived certificate to mount the export with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SshfsHandle {
    /// Where to connect.
    pub endpoint: SshEndpoint,
    /// The remote path to mount.
    pub export_locator: String,
    /// Key and certificate to log in with.
    pub credential: SshCredential,
    /// Extra `sshfs -o` options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<BTreeMap<String, String>>,
    /// Ours (additive): the SSH server's public host key (`ssh-ed25519 AAAA…`), so the
    /// Executor checks the server strictly instead of trusting the first key it sees. The
    /// reference neither sends nor reads it; without it our Executor pins the first key it
    /// sees in a per-delegation `known_hosts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_key: Option<String>,
}

/// Host, port and user of an SSH server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SshEndpoint {
    /// Host name or address.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Login user.
    pub user: String,
}

/// A private key and the certificate signed for it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SshCredential {
    /// OpenSSH private key (PEM text).
    pub private_key: String,
    /// OpenSSH certificate (one line).
    pub certificate: String,
}

impl fmt::Debug for SshCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SshCredential")
            .field("private_key", &Redacted(&self.private_key))
            .field("certificate", &self.certificate)
            .finish()
    }
}

/// `storage`: the workspace zip behind pre-signed URLs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StorageHandle {
    /// Where to GET the workspace zip.
    pub download_url: String,
    /// Where to PUT the result zip.
    pub upload_url: String,
    /// SHA-256 of the workspace zip, lowercase hex.
    pub checksum: String,
    /// When the URLs stop working, ISO 8601.
    pub expires_at: String,
    /// Extra HTTP headers for both requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, String>>,
}

/// `git`: a repository holding the workspace on a base branch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GitHandle {
    /// Remote to clone and push to.
    pub repo_url: String,
    /// Branch holding the workspace.
    pub base_branch: String,
    /// Commit the workspace was committed as.
    pub base_commit: String,
    /// How to authenticate to the remote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<GitCredential>,
}

/// Credential for a git remote, tagged on `type`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum GitCredential {
    /// HTTPS token.
    Token {
        /// The token.
        token: String,
    },
    /// SSH key (the Executor's own if absent).
    Ssh {
        /// OpenSSH private key (PEM text).
        #[serde(
            rename = "privateKey",
            default,
            skip_serializing_if = "Option::is_none"
        )]
        private_key: Option<String>,
    },
    /// No authentication.
    None,
}

impl fmt::Debug for GitCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GitCredential::Token { token } => f
                .debug_struct("Token")
                .field("token", &Redacted(token))
                .finish(),
            GitCredential::Ssh { private_key } => f
                .debug_struct("Ssh")
                .field("private_key", &private_key.as_deref().map(Redacted))
                .finish(),
            GitCredential::None => f.write_str("None"),
        }
    }
}

/// What a `storage` Executor puts in a `snapshot` event's `snapshotBase64` once it has
/// uploaded the result zip: the JSON text of this object (not base64), as the reference's
/// does. The Delegator fetches the zip from `resultUrl` (the handle's `uploadUrl`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StorageSnapshotInfo {
    /// Where the result zip was uploaded.
    pub result_url: String,
}

/// What a `git` Executor puts in a `snapshot` event's `snapshotBase64` once it has pushed
/// its result branch: the JSON text of this object (not base64), as the reference's does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GitSnapshotInfo {
    /// The result branch on the handle's `repoUrl` (the reference names it
    /// `awcp/<delegationId>`).
    pub branch: String,
    /// The commit the branch points to.
    pub commit_hash: String,
    /// The handle's `baseCommit`, which the result descends from.
    pub base_commit: String,
    /// Paths changed between `baseCommit` and `commitHash`, relative to the repository.
    pub changed_files: Vec<String>,
}

/// `awcpfs` (ours): the Delegator's export, mounted lazily with FUSE.
///
/// The data plane it points to is described in [`crate::dataplane`].
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AwcpfsHandle {
    /// Base URL of the Delegator's export service, e.g. `https://host:7100`.
    pub endpoint: String,
    /// Capability token, sent as `Authorization: Bearer <token>`.
    pub token: String,
    /// Which export on that endpoint.
    pub export_id: String,
    /// Digest of the manifest as of START, so the Executor can check what it fetched.
    pub manifest_digest: String,
    /// Block size the export cuts files into, in bytes.
    pub block_size: u32,
    /// Lease expiry, ISO 8601 (the same instant as START's `lease.expiresAt`).
    pub expires_at: String,
    /// SHA-256 fingerprint of the export's TLS certificate, to pin a self-signed one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_fingerprint: Option<String>,
    /// Milliseconds of lease left when the handle was sent. The Executor counts it down on
    /// its own monotonic clock, so a skewed wall clock cannot extend the lease (`expiresAt`
    /// is for people and for peers that lack this field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining_ms: Option<u64>,
    /// Several resources (ours): one export per resource, all behind `endpoint` and
    /// `token`, each mounted at `<workDir>/<name>`. Absent for a delegation of one
    /// resource, which `exportId` and `manifestDigest` describe and which is mounted at
    /// the work directory itself. When present, `exportId` and `manifestDigest` repeat the
    /// first entry's, so a peer that knows only one resource still gets a usable handle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Vec<AwcpfsResource>>,
}

/// One resource of a several-resource `awcpfs` handle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AwcpfsResource {
    /// The resource's name, as in INVITE's `environment.resources` (one path component).
    pub name: String,
    /// Its export on the handle's endpoint.
    pub export_id: String,
    /// Digest of its manifest as of START.
    pub manifest_digest: String,
    /// `ro` (the export refuses commits and the mount answers `EROFS`) or `rw`.
    pub access_mode: crate::messages::AccessMode,
}

impl AwcpfsHandle {
    /// The handle of one of this handle's resources alone (what a mount of that resource
    /// needs); `self` unchanged but without `resources`.
    pub fn for_resource(&self, r: &AwcpfsResource) -> AwcpfsHandle {
        AwcpfsHandle {
            export_id: r.export_id.clone(),
            manifest_digest: r.manifest_digest.clone(),
            resources: None,
            ..self.clone()
        }
    }
}

impl fmt::Debug for AwcpfsHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AwcpfsHandle")
            .field("endpoint", &self.endpoint)
            .field("token", &Redacted(&self.token))
            .field("export_id", &self.export_id)
            .field("manifest_digest", &self.manifest_digest)
            .field("block_size", &self.block_size)
            .field("expires_at", &self.expires_at)
            .field("tls_fingerprint", &self.tls_fingerprint)
            .field("remaining_ms", &self.remaining_ms)
            .field("resources", &self.resources)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn awcpfs() -> AwcpfsHandle {
        AwcpfsHandle {
            endpoint: "https://delegator.example:7100".into(),
            token: "cap_supersecret".into(),
            export_id: "exp_1".into(),
            manifest_digest: "ab".repeat(32),
            block_size: 1 << 20,
            expires_at: "2026-03-09T14:38:47.123Z".into(),
            tls_fingerprint: None,
            remaining_ms: None,
            resources: None,
        }
    }

    #[test]
    fn awcpfs_wire_shape_is_camel_case_without_absent_options() {
        let json = serde_json::to_value(TransportHandle::Awcpfs(awcpfs())).unwrap();
        let obj = json.as_object().unwrap();
        assert_eq!(obj["transport"], "awcpfs");
        assert_eq!(obj["exportId"], "exp_1");
        assert_eq!(obj["blockSize"], 1 << 20);
        assert!(!obj.contains_key("tlsFingerprint"));
        assert_eq!(obj.len(), 7);
    }

    #[test]
    fn awcpfs_resources_round_trip_and_split() {
        let mut h = awcpfs();
        h.resources = Some(vec![
            AwcpfsResource {
                name: "src".into(),
                export_id: "exp_1".into(),
                manifest_digest: "ab".repeat(32),
                access_mode: crate::messages::AccessMode::Rw,
            },
            AwcpfsResource {
                name: "data".into(),
                export_id: "exp_1.1".into(),
                manifest_digest: "cd".repeat(32),
                access_mode: crate::messages::AccessMode::Ro,
            },
        ]);
        let json = serde_json::to_value(TransportHandle::Awcpfs(h.clone())).unwrap();
        assert_eq!(json["resources"][1]["exportId"], "exp_1.1");
        assert_eq!(json["resources"][1]["accessMode"], "ro");
        let back: TransportHandle = serde_json::from_value(json).unwrap();
        assert_eq!(back, TransportHandle::Awcpfs(h.clone()));
        let one = h.for_resource(&h.resources.as_ref().unwrap()[1]);
        assert_eq!(one.export_id, "exp_1.1");
        assert_eq!(one.manifest_digest, "cd".repeat(32));
        assert_eq!(one.token, h.token);
        assert!(one.resources.is_none());
    }

    #[test]
    fn debug_never_shows_secrets() {
        let shown = format!("{:?}", TransportHandle::Awcpfs(awcpfs()));
        assert!(!shown.contains("supersecret"), "{shown}");
        assert!(shown.contains("exp_1"));
        let shown = format!(
            "{:?}",
            GitCredential::Token {
                token: "ghp_secret".into()
            }
        );
        assert!(!shown.contains("ghp_secret"), "{shown}");
        let shown = format!(
            "{:?}",
            ArchiveHandle {
                workspace_base64: "UEsDBBQAAAAI".into(),
                checksum: "00".into()
            }
        );
        assert!(!shown.contains("UEsDBBQAAAAI"), "{shown}");
    }

    #[test]
    fn unknown_transport_is_refused() {
        let err = serde_json::from_str::<TransportHandle>(r#"{"transport":"ftp","url":"x"}"#)
            .unwrap_err();
        assert!(err.to_string().contains("ftp"), "{err}");
        let err = parse_transport_handle(br#"{"transport":"ftp","url":"x"}"#).unwrap_err();
        assert!(
            matches!(&err, ProtocolError::UnknownType { what: "transport handle", received } if received == "ftp"),
            "{err:?}"
        );
    }

    #[test]
    fn missing_handle_field_is_named() {
        let err =
            parse_transport_handle(br#"{"transport":"archive","checksum":"00"}"#).unwrap_err();
        assert!(
            matches!(&err, ProtocolError::MissingField { context, field }
                if context == "archive transport handle" && field == "workspaceBase64"),
            "{err:?}"
        );
    }

    #[test]
    fn git_none_credential_is_just_a_tag() {
        let json = serde_json::to_string(&GitCredential::None).unwrap();
        assert_eq!(json, r#"{"type":"none"}"#);
        let ssh: GitCredential = serde_json::from_str(r#"{"type":"ssh"}"#).unwrap();
        assert_eq!(ssh, GitCredential::Ssh { private_key: None });
    }
}
