//! The live view (`GET /ui`) in a real headless browser (Debian's Chromium, driven over its
//! DevTools protocol): a running delegation is listed with its state, and revoking it on
//! the page ends it. The credential: nothing for a caller without one, a one-time login
//! link (`awcp-ctl ui`) trading for an HttpOnly cookie, and no change with that cookie
//! but from the page itself (CSRF). (Issue 34: there was no view for the person in charge.)
//!
//! With `AWCP_UI_SCREENSHOT=<file.png>` the test also saves what the page showed
//! (`scripts/live-view-screenshot.sh` makes `docs/img/live-view.png` this way).
//!
//! Skipped loudly where FUSE or chromium is missing, failed under `CI=true`.

use std::time::Duration;

use awcp_protocol::DelegationState;
use awcp_protocol::messages::AccessMode;
use awcp_tests::browser::{Browser, chromium_available};
use awcp_tests::{Harness, fuse_available, sample_repo};

/// The row of delegation `id`'s state, as the page shows it.
fn state_of(id: &str) -> String {
    format!("document.querySelector('tr[data-id=\"{id}\"] .state')?.textContent")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn live_view_lists_a_running_delegation_and_revokes_it_from_the_page() {
    if !fuse_available() || !chromium_available() {
        return;
    }
    // The browser runs as root on the daemon's machine: with the daemon's default, root is
    // let in by its uid. Require the token from everyone, so the page gets in by its
    // cookie alone.
    let h = Harness::start_full("sleep 120", |d| d.trust_local_uid = false, |_| {}).await;
    let repo = h.path("repo");
    sample_repo(&repo);
    let id = h.delegate(&repo, AccessMode::Rw, 600).await;
    let mut running = false;
    for _ in 0..300 {
        if h.client.get(&id).await.unwrap().record.state == DelegationState::Running {
            running = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(running, "the delegation did not start");
    let base = h.daemon.url();

    // A caller without a credential gets neither the page nor anything about the delegation.
    for path in ["/ui", "/ui/session", "/delegations"] {
        let r = reqwest::get(format!("{base}{path}")).await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "{path}");
        let body = r.text().await.unwrap();
        assert!(
            !body.contains(&id) && !body.contains("<script"),
            "{path}: {body}"
        );
    }
    let r = reqwest::get(format!("{base}/ui/login?code=forged"))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401, "a forged login code");

    let mut b = Browser::start().await;
    // Without logging in, the browser sees the refusal only.
    b.navigate(&format!("{base}/ui")).await;
    let text = b.eval("document.body.innerText").await;
    let text = text.as_str().unwrap_or_default();
    assert!(
        text.contains("Unauthorized") && !text.contains(&id),
        "{text}"
    );

    // The one-time link of `awcp-ctl ui`.
    let (link, ttl) = h.client.ui_login_link().await.unwrap();
    assert!(ttl > 0 && link.starts_with(&base), "{link}");
    b.navigate(&link).await;
    assert!(
        b.wait_for(
            &format!("{} === 'running'", state_of(&id)),
            Duration::from_secs(30)
        )
        .await,
        "the page does not list {id} as running: {}",
        b.eval("document.body.innerText").await
    );
    assert_eq!(
        b.eval("location.pathname").await,
        "/ui",
        "the login link leads to the page, and leaves no code in the address bar"
    );
    // The page shows the lease's time left and the daemon's events as they came.
    let lease = b
        .eval(&format!(
            "document.querySelector('tr[data-id=\"{id}\"] td.lease').textContent"
        ))
        .await;
    assert!(
        lease.as_str().is_some_and(|l| l.contains("min")),
        "lease left: {lease}"
    );
    assert!(
        b.wait_for(
            &format!(
                "(document.querySelector('tr[data-id=\"{id}\"] + tr .events')?.textContent || '')\
                 .includes('state running')"
            ),
            Duration::from_secs(15)
        )
        .await,
        "the events stream did not reach the page"
    );
    // The link worked once.
    let again = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .get(&link)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status().as_u16(), 401, "a login link used twice");

    // The session cookie: HttpOnly, SameSite=Strict; with it alone (no CSRF header) a
    // change is refused, and so is one sent by another site's page.
    let cookies = b.cookies().await;
    let c = cookies
        .iter()
        .find(|c| c["name"] == awcp_ctl::daemon::ui::COOKIE)
        .unwrap_or_else(|| panic!("no session cookie in {cookies:?}"));
    assert_eq!(c["httpOnly"], true, "{c}");
    assert_eq!(c["sameSite"], "Strict", "{c}");
    let cookie = format!(
        "{}={}",
        awcp_ctl::daemon::ui::COOKIE,
        c["value"].as_str().unwrap()
    );
    let http = reqwest::Client::new();
    let r = http
        .get(format!("{base}/delegations"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "the cookie lets a read in");
    let r = http
        .post(format!("{base}/delegation/{id}/revoke"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403, "a change without the CSRF header");
    let csrf: serde_json::Value = http
        .get(format!("{base}/ui/session"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let r = http
        .post(format!("{base}/delegation/{id}/renew"))
        .header("cookie", &cookie)
        .header(
            awcp_ctl::daemon::ui::CSRF_HEADER,
            csrf["csrf"].as_str().unwrap(),
        )
        .header("origin", "https://attacker.example")
        .json(&serde_json::json!({"ttlSeconds": 60}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403, "a change sent from another site");
    assert_eq!(
        h.client.get(&id).await.unwrap().record.state,
        DelegationState::Running,
        "nothing refused above changed the delegation"
    );

    if let Ok(path) = std::env::var("AWCP_UI_SCREENSHOT") {
        b.eval(&format!(
            "document.querySelector('tr[data-id=\"{id}\"] + tr details').open = true"
        ))
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        std::fs::write(&path, b.screenshot().await).unwrap();
        eprintln!("live view screenshot written to {path}");
    }

    // Revoke on the page: it asks twice (the first click arms the button).
    let clicked = b
        .eval(&format!(
            "(() => {{ const b = document.querySelector('tr[data-id=\"{id}\"] button.revoke'); \
             if (!b) return false; b.click(); b.click(); return true; }})()"
        ))
        .await;
    assert_eq!(clicked, true, "no revoke button for {id}");
    assert_eq!(
        h.wait_end(&id, Duration::from_secs(30)).await,
        DelegationState::Cancelled
    );
    assert!(
        b.wait_for(
            &format!("{} === 'cancelled'", state_of(&id)),
            Duration::from_secs(15)
        )
        .await,
        "the page does not show the end: {}",
        b.eval("document.body.innerText").await
    );
    let message = b
        .eval("document.getElementById('message').textContent")
        .await;
    assert!(
        message.as_str().is_some_and(|m| m.contains("revoked")),
        "{message}"
    );
    drop(b);
    h.stop().await;
}
