//! Client credentials kept in the state database (`awcp-ctl token create`), so that every
//! daemon of a shared PostgreSQL database accepts the same one: a client that moves to
//! another daemon after a failover keeps its credential.
//!
//! A token is `tok_<16 hex>.<64 hex>`: a public id, then 256 random bits. The database
//! keeps the id, a random salt and SHA-256(salt ‖ secret), never the secret: whoever reads
//! the table cannot present a token. (A fast hash is enough for a 256-bit random secret,
//! which no dictionary holds; a slow one would only cost every request.) The token is shown
//! once, when made. A daemon checks a token of this shape against the rows it read at most
//! [`FRESH`] ago (re-read sooner, at most once per [`RETRY`], when the id is not among them,
//! so a token made on another daemon works at once); a deleted one stops working within
//! [`FRESH`]. The daemon's own `api-token` keeps working beside them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{delete, get};
use axum::{Json, Router};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use awcp_protocol::api::ApiError;

use super::Daemon;
use super::api::{ApiFailure, bad_json};
use crate::store::ClientTokenRow;

/// How long the rows read are trusted.
pub const FRESH: Duration = Duration::from_secs(5);
/// How often an unknown id may make the daemon read the rows again.
pub const RETRY: Duration = Duration::from_secs(1);
/// The id's prefix.
pub const ID_PREFIX: &str = "tok_";

/// The rows last read, and when.
#[derive(Default)]
pub(crate) struct TokenCache {
    rows: Mutex<Option<(Instant, Arc<Vec<ClientTokenRow>>)>>,
}

fn hash(salt: &str, secret: &str) -> String {
    let mut h = Sha256::new();
    h.update(salt.as_bytes());
    h.update(secret.as_bytes());
    hex::encode(h.finalize())
}

/// `tok_<id>.<secret>` → (`tok_<id>`, `<secret>`), if it has that shape.
fn split(token: &str) -> Option<(&str, &str)> {
    let (id, secret) = token.split_once('.')?;
    let hex16 = id.strip_prefix(ID_PREFIX)?;
    (hex16.len() == 16
        && hex16.bytes().all(|b| b.is_ascii_hexdigit())
        && secret.len() == 64
        && secret.bytes().all(|b| b.is_ascii_hexdigit()))
    .then_some((id, secret))
}

/// A new token and the row that stores it.
pub fn mint(label: &str) -> (String, ClientTokenRow) {
    let id = format!("{ID_PREFIX}{}", hex::encode(rand::random::<[u8; 8]>()));
    let secret = crate::random_token();
    let salt = hex::encode(rand::random::<[u8; 16]>());
    let row = ClientTokenRow {
        hash: hash(&salt, &secret),
        id: id.clone(),
        salt,
        label: label.to_string(),
        created_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    };
    (format!("{id}.{secret}"), row)
}

/// Whether `token` matches `row`.
pub fn matches(token: &str, row: &ClientTokenRow) -> bool {
    split(token).is_some_and(|(id, secret)| {
        id == row.id && crate::same_secret(&hash(&row.salt, secret), &row.hash)
    })
}

impl Daemon {
    /// Whether `token` is one of the client credentials in the state database.
    pub(crate) async fn client_token_ok(self: &Arc<Self>, token: &str) -> bool {
        let Some((id, _)) = split(token) else {
            return false;
        };
        let cached = self.tokens.rows.lock().clone();
        let rows = match cached {
            Some((at, rows))
                if at.elapsed() < FRESH
                    && (rows.iter().any(|r| r.id == id) || at.elapsed() < RETRY) =>
            {
                rows
            }
            _ => {
                let d = self.clone();
                match tokio::task::spawn_blocking(move || d.store.client_tokens()).await {
                    Ok(Ok(rows)) => {
                        let rows = Arc::new(rows);
                        *self.tokens.rows.lock() = Some((Instant::now(), rows.clone()));
                        rows
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "reading the client tokens failed");
                        return false;
                    }
                    Err(_) => return false,
                }
            }
        };
        rows.iter().any(|r| matches(token, r))
    }

    fn forget_token_cache(&self) {
        *self.tokens.rows.lock() = None;
    }
}

/// `POST /api-tokens` body.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateTokenRequest {
    /// What it is for (a person, a CI job); shown by `token list`.
    #[serde(default)]
    pub label: String,
}

/// `POST /api-tokens` answer: the only time the token is shown.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateTokenResponse {
    /// Its id (for `token delete`).
    pub id: String,
    /// The token (`Authorization: Bearer <token>`).
    pub token: String,
    /// Whether other daemons accept it too (they share this daemon's database).
    pub shared: bool,
}

/// `GET /api-tokens` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenList {
    /// Every token's id, label and date (never the token or its hash).
    pub tokens: Vec<ClientTokenRow>,
}

pub(crate) fn routes() -> Router<Arc<Daemon>> {
    Router::new()
        .route("/api-tokens", get(list).post(create))
        .route("/api-tokens/{id}", delete(remove))
}

fn store_failure(e: crate::store::StoreError) -> ApiFailure {
    let mut err = ApiError::new(format!("the state database failed: {e}"));
    err.hint = Some("`awcp-ctl doctor` checks the daemon; its log says more".into());
    ApiFailure(StatusCode::SERVICE_UNAVAILABLE, err)
}

fn interrupted() -> ApiFailure {
    ApiFailure(
        StatusCode::INTERNAL_SERVER_ERROR,
        ApiError::new("the state database call was interrupted; try again"),
    )
}

async fn create(
    State(d): State<Arc<Daemon>>,
    body: Result<Json<CreateTokenRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<CreateTokenResponse>, ApiFailure> {
    let label = match body {
        Ok(Json(b)) => b.label,
        Err(rej) if rej.status() == StatusCode::UNSUPPORTED_MEDIA_TYPE => String::new(),
        Err(rej) => return Err(bad_json(rej)),
    };
    let (token, row) = mint(&label);
    let id = row.id.clone();
    let dd = d.clone();
    tokio::task::spawn_blocking(move || dd.store.add_client_token(&row))
        .await
        .map_err(|_| interrupted())?
        .map_err(store_failure)?;
    d.forget_token_cache();
    tracing::info!(%id, %label, "client token created");
    Ok(Json(CreateTokenResponse {
        id,
        token,
        shared: d.store.shared(),
    }))
}

async fn list(State(d): State<Arc<Daemon>>) -> Result<Json<TokenList>, ApiFailure> {
    let dd = d.clone();
    let tokens = tokio::task::spawn_blocking(move || dd.store.client_tokens())
        .await
        .map_err(|_| interrupted())?
        .map_err(store_failure)?;
    Ok(Json(TokenList { tokens }))
}

async fn remove(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
) -> Result<Json<awcp_protocol::api::OkResponse>, ApiFailure> {
    let dd = d.clone();
    let idc = id.clone();
    let found = tokio::task::spawn_blocking(move || dd.store.remove_client_token(&idc))
        .await
        .map_err(|_| interrupted())?
        .map_err(store_failure)?;
    d.forget_token_cache();
    if !found {
        let mut e = ApiError::new(format!("no client token with id {id}"));
        e.hint = Some("`awcp-ctl token list` shows them".into());
        return Err(ApiFailure(StatusCode::NOT_FOUND, e));
    }
    tracing::info!(%id, "client token deleted");
    Ok(Json(awcp_protocol::api::OkResponse::OK))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_matches_its_row_only() {
        let (token, row) = mint("ci");
        assert!(matches(&token, &row));
        assert!(!token.contains(&row.hash) && !row.hash.contains(&token));
        let (other, other_row) = mint("ci");
        assert!(!matches(&other, &row) && !matches(&token, &other_row));
        // The same secret under another id, a changed secret, and malformed shapes.
        let secret = token.split_once('.').unwrap().1;
        assert!(!matches(&format!("{}.{secret}", other_row.id), &row));
        let mut bad = token.clone();
        bad.pop();
        bad.push(if token.ends_with('0') { '1' } else { '0' });
        assert!(!matches(&bad, &row));
        for t in ["", "tok_", "tok_x.y", &row.hash, &format!("{}.", row.id)] {
            assert!(!matches(t, &row), "{t}");
        }
        // Each row has its own salt.
        assert_ne!(row.salt, other_row.salt);
    }
}
