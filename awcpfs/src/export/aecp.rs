//! AECP's channel through an export: the artifact-index events a mount replicates, and the
//! deliveries the mount reports back.
//!
//! The export knows nothing of artifacts: the daemon pushes opaque JSON events
//! ([`AecpFeed::push`]); every `GET /events` stream sends all of them once on connect
//! (catch-up) and then each new one, as `aecp` events. The mount reports what it delivered
//! with `POST /aecp/delivered`; the export hands that to the sink the daemon installed
//! ([`AecpFeed::set_sink`]). The files each applied commit wrote go to the commit sink
//! ([`AecpFeed::set_commit_sink`]): a worker owns what it wrote back. The worker's agent
//! asks the daemon through its mount (`POST /aecp/request`, forwarded from the worker's AECP
//! socket): the export hands the request to the handler the daemon installed
//! ([`AecpFeed::set_request_handler`]), which acts as this export's worker and no other. An
//! export nobody pushed to costs an empty `Vec`.

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::watch;

/// What a sink receives: the raw `POST /aecp/delivered` body, already checked to be JSON.
pub type DeliverySink = Arc<dyn Fn(serde_json::Value) + Send + Sync>;

/// What a commit sink receives: the workspace-relative paths of the files one applied commit
/// wrote (conflicting and held changes left out).
pub type CommitSink = Arc<dyn Fn(&[String]) + Send + Sync>;

/// What a request handler answers: an HTTP status and a JSON body.
pub type RequestAnswer =
    std::pin::Pin<Box<dyn std::future::Future<Output = (u16, serde_json::Value)> + Send + 'static>>;

/// What a request handler receives: the raw `POST /aecp/request` body (`{"method", "path",
/// "query", "body"}`), already checked to be JSON.
pub type RequestHandler = Arc<dyn Fn(serde_json::Value) -> RequestAnswer + Send + Sync>;

/// Most events one export keeps for catch-up (beyond it, the oldest are dropped: a replica
/// is rebuilt by the daemon pushing a fresh snapshot, see [`AecpFeed::replace`]).
pub const MAX_EVENTS: usize = 100_000;

/// How far one event stream has sent a feed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cursor {
    generation: u64,
    pos: usize,
}

/// The AECP events of one export.
pub struct AecpFeed {
    /// The events, and a generation bumped by [`AecpFeed::replace`].
    events: Mutex<(Vec<serde_json::Value>, u64)>,
    /// Bumped on every change: event streams wait on it.
    seq: watch::Sender<u64>,
    sink: Mutex<Option<DeliverySink>>,
    commit_sink: Mutex<Option<CommitSink>>,
    requests: Mutex<Option<RequestHandler>>,
    /// Set when the serving process stops: every event stream of the export ends.
    closed: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for AecpFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AecpFeed")
            .field("events", &self.events.lock().0.len())
            .finish_non_exhaustive()
    }
}

impl Default for AecpFeed {
    fn default() -> Self {
        AecpFeed {
            events: Mutex::new((Vec::new(), 0)),
            seq: watch::channel(0).0,
            sink: Mutex::new(None),
            commit_sink: Mutex::new(None),
            requests: Mutex::new(None),
            closed: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

impl AecpFeed {
    /// Appends an event for every mount of this export (now and on later connects).
    pub fn push(&self, event: serde_json::Value) {
        {
            let ev = &mut self.events.lock().0;
            if ev.len() >= MAX_EVENTS {
                ev.remove(0);
            }
            ev.push(event);
        }
        self.seq.send_modify(|s| *s += 1);
    }

    /// Replaces every event (a fresh snapshot of the workspace's index).
    pub fn replace(&self, events: Vec<serde_json::Value>) {
        {
            let mut ev = self.events.lock();
            ev.0 = events;
            ev.1 += 1;
        }
        self.seq.send_modify(|s| *s += 1);
    }

    /// Events after `cursor` (start with `Cursor::default()`), and the cursor after them.
    /// After a [`AecpFeed::replace`], everything again.
    pub fn since(&self, cursor: Cursor) -> (Vec<serde_json::Value>, Cursor) {
        let ev = self.events.lock();
        let from = if cursor.generation == ev.1 {
            cursor.pos.min(ev.0.len())
        } else {
            0
        };
        let next = Cursor {
            generation: ev.1,
            pos: ev.0.len(),
        };
        (ev.0[from..].to_vec(), next)
    }

    /// Ends every event stream of this export (the daemon stops: its mounts reconnect to
    /// whichever daemon serves the export next, instead of listening to a stopped one).
    pub fn close_streams(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        self.seq.send_modify(|s| *s += 1);
    }

    /// Whether [`AecpFeed::close_streams`] was called.
    pub fn streams_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Wakes on every push.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.seq.subscribe()
    }

    /// Where delivery reports go.
    pub fn set_sink(&self, sink: DeliverySink) {
        *self.sink.lock() = Some(sink);
    }

    /// Where the files of applied commits go.
    pub fn set_commit_sink(&self, sink: CommitSink) {
        *self.commit_sink.lock() = Some(sink);
    }

    /// Where the worker's requests go (`POST /aecp/request`).
    pub fn set_request_handler(&self, handler: RequestHandler) {
        *self.requests.lock() = Some(handler);
    }

    /// A worker's request, answered by the daemon's handler; `None` when none is installed
    /// (AECP is off for this export).
    pub fn request(&self, request: serde_json::Value) -> Option<RequestAnswer> {
        let handler = self.requests.lock().clone();
        handler.map(|h| h(request))
    }

    /// One applied commit wrote `files` (nothing happens without a commit sink).
    pub fn committed(&self, files: &[String]) {
        let sink = self.commit_sink.lock().clone();
        if let Some(s) = sink
            && !files.is_empty()
        {
            s(files);
        }
    }

    /// A mount's delivery report; false when no sink is installed (AECP is off).
    pub fn delivered(&self, report: serde_json::Value) -> bool {
        let sink = self.sink.lock().clone();
        match sink {
            Some(s) => {
                s(report);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_catches_up_and_follows() {
        let f = AecpFeed::default();
        let rx = f.subscribe();
        f.push(serde_json::json!({"n": 1}));
        f.push(serde_json::json!({"n": 2}));
        assert!(rx.has_changed().unwrap());
        let (all, pos) = f.since(Cursor::default());
        assert_eq!(all.len(), 2);
        f.push(serde_json::json!({"n": 3}));
        let (new, pos) = f.since(pos);
        assert_eq!(new, [serde_json::json!({"n": 3})]);
        f.replace(vec![serde_json::json!({"n": 9}); 5]);
        let (again, pos) = f.since(pos);
        assert_eq!(again.len(), 5, "a replaced feed is sent whole");
        assert!(f.since(pos).0.is_empty());
    }

    #[test]
    fn reports_reach_the_sink() {
        let f = AecpFeed::default();
        assert!(!f.delivered(serde_json::json!([])));
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        f.set_sink(Arc::new(move |v| g.lock().push(v)));
        assert!(f.delivered(serde_json::json!([{"id": 1, "revision": 1}])));
        assert_eq!(got.lock().len(), 1);
    }
    #[tokio::test]
    async fn requests_reach_the_handler() {
        let f = AecpFeed::default();
        assert!(f.request(serde_json::json!({})).is_none());
        f.set_request_handler(Arc::new(|v| {
            Box::pin(async move { (201, serde_json::json!({ "echo": v })) })
        }));
        let (status, body) = f
            .request(serde_json::json!({"path": "/aecp/inbox"}))
            .unwrap()
            .await;
        assert_eq!(
            (status, body["echo"]["path"].as_str()),
            (201, Some("/aecp/inbox"))
        );
    }

    #[test]
    fn written_files_reach_the_commit_sink() {
        let f = AecpFeed::default();
        f.committed(&["a.py".into()]);
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        f.set_commit_sink(Arc::new(move |files| g.lock().extend_from_slice(files)));
        f.committed(&[]);
        f.committed(&["pkg/a.py".into(), "b.txt".into()]);
        assert_eq!(*got.lock(), ["pkg/a.py", "b.txt"]);
    }
}
