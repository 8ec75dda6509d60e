//! Refusals of data-plane requests, and how each becomes an HTTP answer.
//!
//! Every refused request is answered with a [`DataPlaneError`] JSON body
//! (`{code, message}`): the code is for programs, the message tells a person what happened
//! and what to do. The status/code table lives in one place, [`ApiError::status_and_code`].

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use awcp_lease::{LeaseError, LeaseState};
use awcp_protocol::dataplane::DataPlaneError;

use super::rootfs::FsError;

/// Most hashes listed in a `MISSING_BLOCKS` message (the rest are counted).
const MAX_LISTED: usize = 16;

/// Why a data-plane request was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ApiError {
    /// No `Authorization: Bearer` header, or the wrong token.
    #[error(
        "missing or wrong capability token: send `Authorization: Bearer <token>` with the token from the transport handle"
    )]
    AuthFailed,
    /// No export by that id.
    #[error(
        "no export {export_id:?} here; it was removed or never registered, check the transport handle"
    )]
    NotFound {
        /// The id asked for.
        export_id: String,
    },
    /// The lease does not allow this request.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// Commit or upload on a read-only export.
    #[error("export {export_id:?} is read-only (`ro` delegation); changes cannot be written back")]
    ReadOnly {
        /// The export.
        export_id: String,
    },
    /// The body is not what the route expects.
    #[error("invalid body for {route}: {detail}")]
    BadBody {
        /// Which route.
        route: &'static str,
        /// What is wrong (parser message with line and column for JSON).
        detail: String,
    },
    /// A hash on the wire is not 64 hex digits.
    #[error("invalid block hash {hash:?}: expected 64 hex digits (blake3)")]
    BadHash {
        /// The offending value (cut to 80 characters).
        hash: String,
    },
    /// Too many items in one request.
    #[error("{what}: {count} is more than the limit of {max}; split the request")]
    TooMany {
        /// What was counted.
        what: &'static str,
        /// How many were sent.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The body is larger than the route accepts.
    #[error(
        "request body is larger than the {limit} bytes this route accepts; send it in smaller parts"
    )]
    TooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The client stopped sending the body.
    #[error("request body stalled for more than {secs} s; the request was abandoned")]
    BodyTimeout {
        /// The idle limit.
        secs: u64,
    },
    /// The body could not be read.
    #[error("could not read the request body")]
    BodyRead {
        /// The transport error.
        #[source]
        source: axum::Error,
    },
    /// A path that is malformed, reserved, or leads out of the export.
    #[error("invalid path: {reason}")]
    InvalidPath {
        /// Why.
        reason: String,
    },
    /// Content does not match its announced hash.
    #[error("checksum mismatch for {what}: announced {expected}, content hashes to {actual}")]
    ChecksumMismatch {
        /// Which block or file.
        what: String,
        /// The hash that was announced.
        expected: String,
        /// The hash of what arrived or was assembled.
        actual: String,
    },
    /// A commit needs blocks the export does not have.
    #[error(
        "{} block(s) needed by the commit are not on the export: {}; upload them (POST /upload) and retry the commit",
        .hashes.len(),
        listed(.hashes)
    )]
    MissingBlocks {
        /// The missing hashes (hex).
        hashes: Vec<String>,
    },
    /// Something failed on the export's side.
    #[error("export-side failure while {context}; see the export's log")]
    Internal {
        /// What was being done.
        context: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A filesystem-layer failure while the request was being served.
    #[error("export-side failure while {context}; see the export's log")]
    Fs {
        /// What was being done.
        context: &'static str,
        /// The cause.
        #[source]
        source: FsError,
    },
}

fn listed(hashes: &[String]) -> String {
    let mut s = hashes
        .iter()
        .take(MAX_LISTED)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if hashes.len() > MAX_LISTED {
        s.push_str(&format!(" and {} more", hashes.len() - MAX_LISTED));
    }
    s
}

impl ApiError {
    /// The HTTP status and the machine-readable code of each refusal.
    pub(crate) fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::AuthFailed => (StatusCode::UNAUTHORIZED, "AUTH_FAILED"),
            ApiError::NotFound { .. } => (StatusCode::NOT_FOUND, "NOT_FOUND"),
            ApiError::Lease(e) => (
                StatusCode::FORBIDDEN,
                match e.state() {
                    LeaseState::Revoked => "REVOKED",
                    // `Active` never comes with a refusal; EXPIRED is the safe reading.
                    LeaseState::Expired | LeaseState::Active => "EXPIRED",
                },
            ),
            ApiError::ReadOnly { .. } => (StatusCode::FORBIDDEN, "READ_ONLY"),
            ApiError::BadBody { .. }
            | ApiError::BadHash { .. }
            | ApiError::TooMany { .. }
            | ApiError::BodyRead { .. } => (StatusCode::BAD_REQUEST, "BAD_REQUEST"),
            ApiError::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "TOO_LARGE"),
            ApiError::BodyTimeout { .. } => (StatusCode::REQUEST_TIMEOUT, "TIMEOUT"),
            ApiError::InvalidPath { .. } => (StatusCode::BAD_REQUEST, "INVALID_PATH"),
            ApiError::ChecksumMismatch { .. } => (StatusCode::BAD_REQUEST, "CHECKSUM_MISMATCH"),
            // 409: the request is fine but the export's state lacks something the client
            // can supply (by uploading), then retry.
            ApiError::MissingBlocks { .. } => (StatusCode::CONFLICT, "MISSING_BLOCKS"),
            ApiError::Internal { .. } | ApiError::Fs { .. } => {
                (StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL")
            }
        }
    }

    /// The body sent to the client.
    pub(crate) fn body(&self) -> DataPlaneError {
        DataPlaneError {
            code: self.status_and_code().1.to_owned(),
            message: self.to_string(),
        }
    }

    /// Shorthand for a malformed-body refusal.
    pub(crate) fn bad_body(route: &'static str, detail: impl ToString) -> ApiError {
        ApiError::BadBody {
            route,
            detail: detail.to_string(),
        }
    }

    /// Shorthand for a bad hash (cut so a huge value is not echoed back whole).
    pub(crate) fn bad_hash(hash: &str) -> ApiError {
        ApiError::BadHash {
            hash: hash.chars().take(80).collect(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, _) = self.status_and_code();
        if status.is_server_error() {
            tracing::error!(error = %self, cause = ?std::error::Error::source(&self), "data-plane request failed");
        } else {
            tracing::debug!(error = %self, "data-plane request refused");
        }
        let mut resp = (status, Json(self.body())).into_response();
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
