//! A real headless browser for the tests: Debian's `chromium`, started on loopback with its
//! DevTools protocol, driven over its websocket (`tokio-tungstenite`) with a few commands —
//! navigate, evaluate JavaScript, read cookies, take a screenshot. The process is ours and
//! killed (by its pid) when dropped.

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// The browser binary: `$AWCP_CHROMIUM`, else `chromium` on the PATH.
pub fn chromium_bin() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("AWCP_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("chromium"))
            .find(|p| p.is_file())
    })
}

/// Whether the browser is installed. Under `CI=true` a missing one fails the test (`.ci/run`
/// installs it); elsewhere the test is skipped, loudly.
pub fn chromium_available() -> bool {
    if chromium_bin().is_some() {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!(
            "the live view's browser test must run in CI, but chromium is missing (.ci/run installs it)"
        );
    }
    awcpfs::testing::skipped("a browser test (chromium)", "apt-get install chromium");
    false
}

/// One headless Chromium with one page.
pub struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
    ws: Ws,
    next_id: u64,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Browser {
    /// Start Chromium (headless, a throwaway profile, 1280×800) and open one blank page.
    pub async fn start() -> Browser {
        let bin = chromium_bin().expect("chromium");
        let profile = tempfile::tempdir().unwrap();
        let mut child = Command::new(bin)
            .args([
                "--headless",
                // The tests run as root, where Chromium's own sandbox cannot start.
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--hide-scrollbars",
                "--window-size=1280,800",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting chromium");
        // It says where its DevTools listen on stderr: `DevTools listening on ws://…`.
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("DevTools listening on ") {
                    let _ = tx.send(url.trim().to_owned());
                }
            }
        });
        let browser_ws = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("chromium did not open its DevTools port within 60 s");
        let http = browser_ws
            .trim_start_matches("ws://")
            .split('/')
            .next()
            .unwrap()
            .to_owned();
        // The page it opened: its own websocket.
        let targets: Value = reqwest::get(format!("http://{http}/json/list"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let page_ws = targets
            .as_array()
            .and_then(|a| a.iter().find(|t| t["type"] == "page"))
            .and_then(|t| t["webSocketDebuggerUrl"].as_str())
            .expect("a page target")
            .to_owned();
        let (ws, _) = tokio_tungstenite::connect_async(page_ws).await.unwrap();
        let mut b = Browser {
            child,
            _profile: profile,
            ws,
            next_id: 0,
        };
        b.call("Page.enable", json!({})).await;
        b
    }

    /// Send one DevTools command and wait for its answer (events in between are dropped).
    pub async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        self.ws.send(Message::Text(msg.into())).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let m = tokio::time::timeout(left, self.ws.next())
                .await
                .unwrap_or_else(|_| panic!("no answer to {method} within 30 s"))
                .expect("the DevTools socket closed")
                .unwrap();
            let Message::Text(t) = m else { continue };
            let v: Value = serde_json::from_str(&t).unwrap();
            if v["id"].as_u64() == Some(id) {
                if let Some(e) = v.get("error") {
                    panic!("{method}: {e}");
                }
                return v["result"].clone();
            }
        }
    }

    /// Load `url` and wait until its document has loaded.
    pub async fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url})).await;
        assert!(
            self.wait_for(
                "document.readyState === 'complete'",
                Duration::from_secs(30)
            )
            .await,
            "{url} did not load"
        );
    }

    /// Evaluate a JavaScript expression in the page (promises awaited); its value as JSON.
    pub async fn eval(&mut self, expr: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
            )
            .await;
        if let Some(e) = r.get("exceptionDetails") {
            panic!("{expr}: {e}");
        }
        r["result"]["value"].clone()
    }

    /// Poll `expr` until it is `true`, at most `timeout`.
    pub async fn wait_for(&mut self, expr: &str, timeout: Duration) -> bool {
        let start = Instant::now();
        loop {
            if self.eval(&format!("!!({expr})")).await == Value::Bool(true) {
                return true;
            }
            if start.elapsed() > timeout {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The page's cookies (HttpOnly ones included, which its scripts cannot read).
    pub async fn cookies(&mut self) -> Vec<Value> {
        let r = self.call("Network.getCookies", json!({})).await;
        r["cookies"].as_array().cloned().unwrap_or_default()
    }

    /// A PNG of the page as it is shown.
    pub async fn screenshot(&mut self) -> Vec<u8> {
        use base64::Engine as _;
        let r = self
            .call("Page.captureScreenshot", json!({"format": "png"}))
            .await;
        base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().expect("screenshot data"))
            .unwrap()
    }
}
