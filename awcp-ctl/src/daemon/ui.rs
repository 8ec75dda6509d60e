//! The live view (`GET /ui`): one page for the person in charge of the delegations, served
//! by the daemon itself — an HTML file with its script inline ([`PAGE`]), embedded in the
//! binary: no build step, nothing loaded from elsewhere.
//!
//! The page only calls the daemon API (`GET /delegations`, `GET /delegation/:id`, the
//! events stream, AECP's artifacts and violations, and revoke / renew / apply), so it sees
//! and does exactly what an API client may. Its credential:
//!
//! * A browser cannot be given the bearer token without showing it to every script on the
//!   page, so `awcp-ctl ui` (an API client, with the usual credential) asks for a
//!   **one-time login link** (`POST /ui/login-link`): a random code, good once and for
//!   [`LOGIN_TTL`]. Opening it (`GET /ui/login?code=…`, the one route besides `/health`
//!   open to all) trades the code for a **session cookie**: `HttpOnly` (no script reads
//!   it), `SameSite=Strict` (no other site's page sends it), for [`SESSION_TTL`]. Codes and
//!   sessions live in the daemon's memory only, stored by their SHA-256: a restart logs
//!   every browser out.
//! * **CSRF**: a request carrying the cookie that changes anything (every method but
//!   `GET`/`HEAD`) must also carry the session's CSRF token in [`CSRF_HEADER`], which the
//!   page reads from `GET /ui/session` — a custom header no other origin can send without
//!   a CORS preflight the daemon never grants.
//! * The page's `Content-Security-Policy` allows its own inline script (by hash) and
//!   connections to its own origin only, and no framing.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use awcp_protocol::api::ApiError;

use super::Daemon;
use super::api::ApiFailure;

/// The page: HTML, style and script in one file.
pub const PAGE: &str = include_str!("ui.html");
/// The session cookie's name.
pub const COOKIE: &str = "awcp_ui";
/// The header that carries the session's CSRF token on every change the page asks for.
pub const CSRF_HEADER: &str = "x-awcp-csrf";
/// How long a login link may wait to be opened.
pub const LOGIN_TTL: Duration = Duration::from_secs(120);
/// How long a browser session lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// The login route, open to all (it checks the code itself).
pub const LOGIN_PATH: &str = "/ui/login";

/// Login codes and browser sessions, by the SHA-256 of their secret.
#[derive(Default)]
pub(crate) struct UiSessions {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    codes: HashMap<String, Instant>,
    sessions: HashMap<String, Session>,
}

struct Session {
    csrf: String,
    until: Instant,
}

/// What a request's session cookie says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CookieAuth {
    /// No cookie, or one of no live session.
    None,
    /// A live session, and (for a change) its CSRF token.
    Ok,
    /// A live session, but a change without its CSRF token.
    NoCsrf,
}

fn digest(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

impl UiSessions {
    fn prune(inner: &mut Inner, now: Instant) {
        inner.codes.retain(|_, until| *until > now);
        inner.sessions.retain(|_, s| s.until > now);
    }

    /// A fresh one-time login code.
    fn new_code(&self) -> String {
        let code = crate::random_token();
        let now = Instant::now();
        let mut inner = self.inner.lock();
        Self::prune(&mut inner, now);
        inner.codes.insert(digest(&code), now + LOGIN_TTL);
        code
    }

    /// Trade a login code (used up) for a new session's secret.
    fn redeem(&self, code: &str) -> Option<String> {
        let now = Instant::now();
        let mut inner = self.inner.lock();
        Self::prune(&mut inner, now);
        inner.codes.remove(&digest(code))?;
        let sid = crate::random_token();
        inner.sessions.insert(
            digest(&sid),
            Session {
                csrf: crate::random_token(),
                until: now + SESSION_TTL,
            },
        );
        Some(sid)
    }

    fn session_of(headers: &HeaderMap) -> Option<String> {
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|kv| kv.trim().split_once('='))
            .find(|(k, _)| *k == COOKIE)
            .map(|(_, v)| v.to_string())
    }

    /// The CSRF token of the request's session, if it has a live one.
    fn csrf_of(&self, headers: &HeaderMap) -> Option<String> {
        let sid = Self::session_of(headers)?;
        let inner = self.inner.lock();
        inner
            .sessions
            .get(&digest(&sid))
            .filter(|s| s.until > Instant::now())
            .map(|s| s.csrf.clone())
    }

    /// Whether the request's cookie lets it in.
    pub(crate) fn check(&self, headers: &HeaderMap, method: &Method) -> CookieAuth {
        let Some(csrf) = self.csrf_of(headers) else {
            return CookieAuth::None;
        };
        if method == Method::GET || method == Method::HEAD {
            return CookieAuth::Ok;
        }
        let sent = headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok());
        if sent.is_some_and(|s| crate::same_secret(s, &csrf)) {
            CookieAuth::Ok
        } else {
            CookieAuth::NoCsrf
        }
    }

    /// End the request's session.
    fn logout(&self, headers: &HeaderMap) {
        if let Some(sid) = Self::session_of(headers) {
            self.inner.lock().sessions.remove(&digest(&sid));
        }
    }
}

/// Whether a request came from a page of another site (a browser says so in `Origin` or
/// `Sec-Fetch-Site`; other clients send neither). Such a request is refused whatever
/// credential it carries: a browser on the daemon's machine, run by the daemon's user, would
/// otherwise be let in by its uid.
pub(crate) fn cross_site(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok())
        && !matches!(site, "same-origin" | "none")
    {
        return true;
    }
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let origin_host = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    origin_host.is_none() || origin_host != host
}

/// `POST /ui/login-link` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoginLink {
    /// Path and query to open on the daemon's API address (`/ui/login?code=…`).
    pub path: String,
    /// How long the link may wait to be opened; it works once.
    pub expires_in_seconds: u64,
}

/// `GET /ui/session` answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionInfo {
    /// The token to send in [`CSRF_HEADER`] with every change; `None` when the page was
    /// let in by another credential (the daemon's own user, a bearer token).
    pub csrf: Option<String>,
    /// This daemon's name as an owner of delegations.
    pub daemon: String,
}

pub(crate) fn routes() -> Router<Arc<Daemon>> {
    Router::new()
        .route("/ui", get(page))
        .route("/ui/", get(page))
        .route("/ui/login-link", post(login_link))
        .route(LOGIN_PATH, get(login))
        .route("/ui/session", get(session))
        .route("/ui/logout", post(logout))
}

/// The CSP source of the page's inline `<tag>` block (its SHA-256).
fn inline_hash(tag: &str) -> String {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    let body = PAGE
        .find(&open)
        .and_then(|i| {
            let rest = &PAGE[i + open.len()..];
            rest.find(&close).map(|j| &rest[..j])
        })
        .unwrap_or("");
    format!(
        "'sha256-{}'",
        base64::engine::general_purpose::STANDARD.encode(Sha256::digest(body.as_bytes()))
    )
}

static CSP: LazyLock<String> = LazyLock::new(|| {
    format!(
        "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; \
         img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        inline_hash("script"),
        inline_hash("style")
    )
});

fn page_headers(resp: &mut Response) {
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&CSP) {
        h.insert(header::CONTENT_SECURITY_POLICY, v);
    }
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
}

async fn page() -> Response {
    let mut resp = (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        PAGE.to_string(),
    )
        .into_response();
    page_headers(&mut resp);
    resp
}

async fn login_link(State(d): State<Arc<Daemon>>) -> Json<LoginLink> {
    let code = d.ui.new_code();
    Json(LoginLink {
        path: format!("{LOGIN_PATH}?code={code}"),
        expires_in_seconds: LOGIN_TTL.as_secs(),
    })
}

#[derive(Debug, Deserialize)]
struct LoginQuery {
    #[serde(default)]
    code: String,
}

async fn login(State(d): State<Arc<Daemon>>, Query(q): Query<LoginQuery>) -> Response {
    let Some(sid) = d.ui.redeem(&q.code) else {
        let mut e = ApiError::new("this login link is unknown, used or expired");
        e.hint = Some(format!(
            "a link works once, within {} s: run `awcp-ctl ui` for a new one",
            LOGIN_TTL.as_secs()
        ));
        let mut resp = ApiFailure(StatusCode::UNAUTHORIZED, e).into_response();
        page_headers(&mut resp);
        return resp;
    };
    let cookie = format!(
        "{COOKIE}={sid}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}",
        SESSION_TTL.as_secs()
    );
    let mut resp = (
        StatusCode::SEE_OTHER,
        [
            (header::LOCATION, "/ui".to_string()),
            (header::SET_COOKIE, cookie),
        ],
    )
        .into_response();
    page_headers(&mut resp);
    resp
}

async fn session(State(d): State<Arc<Daemon>>, headers: HeaderMap) -> Json<SessionInfo> {
    Json(SessionInfo {
        csrf: d.ui.csrf_of(&headers),
        daemon: d.daemon_id.clone(),
    })
}

async fn logout(State(d): State<Arc<Daemon>>, headers: HeaderMap) -> Response {
    d.ui.logout(&headers);
    (
        [(
            header::SET_COOKIE,
            format!("{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"),
        )],
        Json(awcp_protocol::api::OkResponse::OK),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_cookie(sid: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_str(&format!("other=1; {COOKIE}={sid}")).unwrap(),
        );
        h
    }

    #[test]
    fn a_login_code_works_once_and_a_change_needs_the_csrf_token() {
        let s = UiSessions::default();
        let code = s.new_code();
        assert!(s.redeem("not-a-code").is_none());
        let sid = s.redeem(&code).expect("a fresh code is good");
        assert!(s.redeem(&code).is_none(), "a code works only once");
        let mut h = with_cookie(&sid);
        assert_eq!(s.check(&h, &Method::GET), CookieAuth::Ok);
        assert_eq!(s.check(&h, &Method::POST), CookieAuth::NoCsrf);
        h.insert(CSRF_HEADER, HeaderValue::from_static("wrong"));
        assert_eq!(s.check(&h, &Method::POST), CookieAuth::NoCsrf);
        let csrf = s.csrf_of(&h).unwrap();
        h.insert(CSRF_HEADER, HeaderValue::from_str(&csrf).unwrap());
        assert_eq!(s.check(&h, &Method::POST), CookieAuth::Ok);
        assert_eq!(
            s.check(&with_cookie("forged"), &Method::GET),
            CookieAuth::None
        );
        s.logout(&h);
        assert_eq!(s.check(&h, &Method::GET), CookieAuth::None);
    }

    #[test]
    fn requests_from_another_site_are_told_apart() {
        let mut h = HeaderMap::new();
        assert!(!cross_site(&h), "a CLI sends neither header");
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:3100"));
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:3100"),
        );
        assert!(!cross_site(&h));
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://evil.example"),
        );
        assert!(cross_site(&h));
        h.remove(header::ORIGIN);
        h.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(cross_site(&h));
        h.insert("sec-fetch-site", HeaderValue::from_static("same-origin"));
        assert!(!cross_site(&h));
    }

    #[test]
    fn the_page_has_one_inline_script_and_style_for_its_policy() {
        assert_eq!(PAGE.matches("<script>").count(), 1);
        assert_eq!(PAGE.matches("<style>").count(), 1);
        assert!(!PAGE.contains("http://") && !PAGE.contains("https://"));
        assert!(CSP.contains("script-src 'sha256-"));
    }
}
