//! A [`Remote`] that answers block requests from the [`BlockCache`] first, asks the export
//! only for what is missing (one request for all of it), and joins requests already in
//! flight for the same block instead of fetching it twice.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use awcp_protocol::dataplane::{ChangeSet, CommitResult, ExportEvent, Manifest};

use super::remote::{Remote, RemoteError, StreamItem, parse_hash};
use super::stats::Stats;
use crate::cache::{BlockCache, BlockHash};

/// One block being fetched by some thread; others wait for it here.
#[derive(Default)]
struct Inflight {
    /// `None` while in flight; then the block, or `None` inside if the fetch failed.
    result: Mutex<Option<Option<Arc<[u8]>>>>,
    cv: Condvar,
}

impl Inflight {
    fn finish(&self, r: Option<Arc<[u8]>>) {
        *self.result.lock() = Some(r);
        self.cv.notify_all();
    }

    fn wait(&self) -> Option<Arc<[u8]>> {
        let mut g = self.result.lock();
        while g.is_none() {
            self.cv.wait(&mut g);
        }
        g.clone().flatten()
    }
}

/// The caching layer in front of a mount's remote.
pub struct CachedRemote {
    inner: Arc<dyn Remote>,
    cache: Arc<BlockCache>,
    stats: Arc<Stats>,
    inflight: Mutex<HashMap<BlockHash, Arc<Inflight>>>,
}

impl std::fmt::Debug for CachedRemote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedRemote")
            .field("cache", &self.cache)
            .finish()
    }
}

impl CachedRemote {
    /// Put `cache` in front of `inner`; hits and misses are counted in `stats`.
    pub fn new(inner: Arc<dyn Remote>, cache: Arc<BlockCache>, stats: Arc<Stats>) -> Self {
        CachedRemote {
            inner,
            cache,
            stats,
            inflight: Mutex::new(HashMap::new()),
        }
    }
}

/// Removes this call's in-flight entries however it ends, so no waiter hangs.
struct InflightGuard<'a> {
    map: &'a Mutex<HashMap<BlockHash, Arc<Inflight>>>,
    mine: Vec<(BlockHash, Arc<Inflight>)>,
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        let mut map = self.map.lock();
        for (h, f) in self.mine.drain(..) {
            map.remove(&h);
            // Waiters fetch it themselves if this call failed before finishing it.
            if f.result.lock().is_none() {
                f.finish(None);
            }
        }
    }
}

impl Remote for CachedRemote {
    fn manifest(&self) -> Result<(Manifest, String), RemoteError> {
        self.inner.manifest()
    }

    fn manifest_bytes(&self) -> Result<Vec<u8>, RemoteError> {
        self.inner.manifest_bytes()
    }

    fn fetch_blocks(&self, hashes: &[String]) -> Result<Vec<Vec<u8>>, RemoteError> {
        let mut out: Vec<Option<Vec<u8>>> = vec![None; hashes.len()];
        // Blocks this call fetches: hash → (hex, indexes in `out`, its in-flight entry).
        let mut fetch: HashMap<BlockHash, (String, Vec<usize>, Arc<Inflight>)> = HashMap::new();
        let mut fetch_order: Vec<BlockHash> = Vec::new();
        let mut waits: Vec<(usize, Arc<Inflight>)> = Vec::new();
        let mut guard = InflightGuard {
            map: &self.inflight,
            mine: Vec::new(),
        };
        let mut unparsed: Vec<usize> = Vec::new();
        for (i, hex_hash) in hashes.iter().enumerate() {
            let Some(h) = parse_hash(hex_hash) else {
                // Not a hash the cache can hold: let the export answer it.
                unparsed.push(i);
                continue;
            };
            if let Some((_, idx, _)) = fetch.get_mut(&h) {
                idx.push(i);
                continue;
            }
            if let Some(d) = self.cache.get(&h) {
                self.stats.add_cache(true, d.len() as u64);
                out[i] = Some(d.to_vec());
                continue;
            }
            let mut map = self.inflight.lock();
            if let Some(f) = map.get(&h) {
                waits.push((i, f.clone()));
                continue;
            }
            let f = Arc::new(Inflight::default());
            map.insert(h, f.clone());
            drop(map);
            guard.mine.push((h, f.clone()));
            self.stats.add_cache(false, 0);
            fetch.insert(h, (hex_hash.clone(), vec![i], f));
            fetch_order.push(h);
        }
        if !fetch_order.is_empty() || !unparsed.is_empty() {
            let mut ask: Vec<String> = fetch_order.iter().map(|h| fetch[h].0.clone()).collect();
            ask.extend(unparsed.iter().map(|&i| hashes[i].clone()));
            let data = self.inner.fetch_blocks(&ask)?;
            let mut data = data.into_iter();
            for h in &fetch_order {
                let Some(d) = data.next() else { break };
                let d: Arc<[u8]> = d.into();
                // The inner remote verified it against its hash.
                self.cache.put(*h, d.clone());
                let (_, indexes, inflight) = &fetch[h];
                inflight.finish(Some(d.clone()));
                for &i in indexes {
                    out[i] = Some(d.to_vec());
                }
            }
            for &i in &unparsed {
                out[i] = data.next();
            }
        }
        drop(guard);
        let mut retry: Vec<usize> = Vec::new();
        for (i, f) in waits {
            match f.wait() {
                Some(d) => out[i] = Some(d.to_vec()),
                None => retry.push(i),
            }
        }
        if !retry.is_empty() {
            let ask: Vec<String> = retry.iter().map(|&i| hashes[i].clone()).collect();
            for (i, d) in retry.into_iter().zip(self.inner.fetch_blocks(&ask)?) {
                out[i] = Some(d);
            }
        }
        out.into_iter()
            .zip(hashes)
            .map(|(d, h)| d.ok_or_else(|| RemoteError::BadBlock { hash: h.clone() }))
            .collect()
    }

    fn fetch_blocks_each(
        &self,
        hashes: &[String],
        each: &mut dyn FnMut(usize, Vec<u8>) -> Result<(), RemoteError>,
    ) -> Result<(), RemoteError> {
        // The common case of a file read for the first time - none of its blocks cached,
        // repeated, or being fetched by someone else - streams from the export, caching each
        // block as it passes. Anything else takes the batch path above.
        let mut guard = InflightGuard {
            map: &self.inflight,
            mine: Vec::with_capacity(hashes.len()),
        };
        let mut parsed = Vec::with_capacity(hashes.len());
        for hex_hash in hashes {
            match parse_hash(hex_hash) {
                Some(h) if !self.cache.contains(&h) => parsed.push(h),
                _ => break,
            }
        }
        let streams = parsed.len() == hashes.len() && {
            let mut map = self.inflight.lock();
            let clear = parsed.iter().all(|h| !map.contains_key(h))
                && parsed
                    .iter()
                    .collect::<std::collections::HashSet<_>>()
                    .len()
                    == parsed.len();
            if clear {
                for h in &parsed {
                    let f = Arc::new(Inflight::default());
                    map.insert(*h, f.clone());
                    guard.mine.push((*h, f));
                }
            }
            clear
        };
        if !streams {
            drop(guard);
            for (i, block) in self.fetch_blocks(hashes)?.into_iter().enumerate() {
                each(i, block)?;
            }
            return Ok(());
        }
        self.inner.fetch_blocks_each(hashes, &mut |i, block| {
            self.stats.add_cache(false, 0);
            // The inner remote verified it against its hash.
            let shared: Arc<[u8]> = Arc::from(block.as_slice());
            self.cache.put(parsed[i], shared.clone());
            guard.mine[i].1.finish(Some(shared));
            each(i, block)
        })
    }

    fn missing(&self, hashes: &[String]) -> Result<Vec<String>, RemoteError> {
        self.inner.missing(hashes)
    }

    fn transfer_counters(&self) -> Option<Arc<super::remote::TransferCounters>> {
        self.inner.transfer_counters()
    }

    fn upload(&self, blocks: &[([u8; 32], &[u8])]) -> Result<(), RemoteError> {
        self.inner.upload(blocks)
    }

    fn commit(&self, changes: &ChangeSet) -> Result<CommitResult, RemoteError> {
        self.inner.commit(changes)
    }

    fn applied(&self, ids: &[String]) -> Result<Vec<CommitResult>, RemoteError> {
        self.inner.applied(ids)
    }

    fn renew(&self) -> Result<ExportEvent, RemoteError> {
        self.inner.renew()
    }

    fn events(&self) -> Result<Box<dyn Iterator<Item = StreamItem> + Send>, RemoteError> {
        self.inner.events()
    }

    fn events_since(
        &self,
        since: u64,
    ) -> Result<Box<dyn Iterator<Item = StreamItem> + Send>, RemoteError> {
        self.inner.events_since(since)
    }

    fn aecp_delivered(&self, report: &serde_json::Value) -> Result<(), RemoteError> {
        self.inner.aecp_delivered(report)
    }

    fn mount_ended(&self, instance: &str) -> Result<bool, RemoteError> {
        self.inner.mount_ended(instance)
    }

    fn mount_ended_clean(&self, instance: &str) -> Result<bool, RemoteError> {
        self.inner.mount_ended_clean(instance)
    }

    fn aecp_request(
        &self,
        request: &serde_json::Value,
    ) -> Result<(u16, serde_json::Value), RemoteError> {
        self.inner.aecp_request(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::CacheConfig;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A remote holding blocks in memory, counting the blocks it is asked for.
    #[derive(Default)]
    struct Blocks {
        data: HashMap<String, Vec<u8>>,
        asked: AtomicUsize,
        requests: AtomicUsize,
        delay: Option<std::time::Duration>,
    }

    impl Remote for Blocks {
        fn manifest(&self) -> Result<(Manifest, String), RemoteError> {
            unimplemented!()
        }
        fn fetch_blocks(&self, hashes: &[String]) -> Result<Vec<Vec<u8>>, RemoteError> {
            self.requests.fetch_add(1, Ordering::SeqCst);
            self.asked.fetch_add(hashes.len(), Ordering::SeqCst);
            if let Some(d) = self.delay {
                std::thread::sleep(d);
            }
            hashes
                .iter()
                .map(|h| {
                    self.data
                        .get(h)
                        .cloned()
                        .ok_or(RemoteError::BadBlock { hash: h.clone() })
                })
                .collect()
        }
        fn missing(&self, _: &[String]) -> Result<Vec<String>, RemoteError> {
            unimplemented!()
        }
        fn upload(&self, _: &[([u8; 32], &[u8])]) -> Result<(), RemoteError> {
            unimplemented!()
        }
        fn commit(&self, _: &ChangeSet) -> Result<CommitResult, RemoteError> {
            unimplemented!()
        }
        fn renew(&self) -> Result<ExportEvent, RemoteError> {
            unimplemented!()
        }
        fn events(&self) -> Result<Box<dyn Iterator<Item = StreamItem> + Send>, RemoteError> {
            unimplemented!()
        }
    }

    fn blocks(n: usize) -> (Blocks, Vec<String>) {
        let mut b = Blocks::default();
        let mut hashes = Vec::new();
        for i in 0..n {
            let d = format!("block number {i}").into_bytes();
            let h = blake3::hash(&d).to_hex().to_string();
            b.data.insert(h.clone(), d);
            hashes.push(h);
        }
        (b, hashes)
    }

    #[test]
    fn hits_skip_the_export_and_duplicates_are_asked_once() {
        let (inner, hashes) = blocks(4);
        let inner = Arc::new(inner);
        let cache = Arc::new(BlockCache::open(&CacheConfig::new(None)).unwrap());
        let stats = Arc::new(Stats::default());
        let r = CachedRemote::new(inner.clone(), cache, stats.clone());
        let ask = vec![
            hashes[0].clone(),
            hashes[1].clone(),
            hashes[0].clone(),
            hashes[2].clone(),
        ];
        let got = r.fetch_blocks(&ask).unwrap();
        assert_eq!(got[0], b"block number 0");
        assert_eq!(got[2], b"block number 0");
        assert_eq!(got[3], b"block number 2");
        assert_eq!(inner.asked.load(Ordering::SeqCst), 3);
        // Everything asked before is now a hit; only block 3 goes out.
        let got = r.fetch_blocks(&hashes).unwrap();
        assert_eq!(got[3], b"block number 3");
        assert_eq!(inner.asked.load(Ordering::SeqCst), 4);
        assert_eq!(inner.requests.load(Ordering::SeqCst), 2);
        let s = stats.snapshot();
        assert_eq!(s.cache_hits, 3);
        assert_eq!(s.cache_misses, 4);
    }

    #[test]
    fn concurrent_requests_for_one_block_fetch_it_once() {
        let (mut inner, hashes) = blocks(1);
        inner.delay = Some(std::time::Duration::from_millis(200));
        let inner = Arc::new(inner);
        let cache = Arc::new(BlockCache::open(&CacheConfig::new(None)).unwrap());
        let r = Arc::new(CachedRemote::new(
            inner.clone(),
            cache,
            Arc::new(Stats::default()),
        ));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let r = r.clone();
                let h = hashes.clone();
                std::thread::spawn(move || r.fetch_blocks(&h).unwrap())
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap()[0], b"block number 0");
        }
        assert_eq!(inner.asked.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_failed_fetch_is_an_error_and_leaves_nothing_in_flight() {
        let (inner, mut hashes) = blocks(1);
        hashes.push(blake3::hash(b"nowhere").to_hex().to_string());
        let r = CachedRemote::new(
            Arc::new(inner),
            Arc::new(BlockCache::open(&CacheConfig::new(None)).unwrap()),
            Arc::new(Stats::default()),
        );
        assert!(r.fetch_blocks(&hashes).is_err());
        assert!(r.inflight.lock().is_empty());
        // Bad hex goes to the export untouched, which refuses it.
        assert!(r.fetch_blocks(&["zz".into()]).is_err());
        // The same through the streaming path: the error, and nothing left in flight.
        let mut seen = 0;
        assert!(
            r.fetch_blocks_each(&hashes[1..], &mut |_, _| {
                seen += 1;
                Ok(())
            })
            .is_err()
        );
        assert_eq!(seen, 0);
        assert!(r.inflight.lock().is_empty());
    }

    /// `fetch_blocks_each` into a vector of (index, block).
    fn each(r: &CachedRemote, hashes: &[String]) -> Result<Vec<(usize, Vec<u8>)>, RemoteError> {
        let mut got = Vec::new();
        r.fetch_blocks_each(hashes, &mut |i, b| {
            got.push((i, b));
            Ok(())
        })?;
        Ok(got)
    }

    #[test]
    fn streamed_blocks_arrive_in_order_and_are_cached_on_the_way() {
        let (inner, hashes) = blocks(5);
        let inner = Arc::new(inner);
        let cache = Arc::new(BlockCache::open(&CacheConfig::new(None)).unwrap());
        let r = CachedRemote::new(inner.clone(), cache.clone(), Arc::new(Stats::default()));
        // Nothing cached: one request, every block handed on in order, and cached.
        let got = each(&r, &hashes[..3]).unwrap();
        let want: Vec<(usize, Vec<u8>)> = (0..3)
            .map(|i| (i, format!("block number {i}").into_bytes()))
            .collect();
        assert_eq!(got, want);
        assert_eq!(inner.requests.load(Ordering::SeqCst), 1);
        for h in &hashes[..3] {
            assert!(cache.contains(&parse_hash(h).unwrap()));
        }
        assert!(r.inflight.lock().is_empty());
        // Partly cached (and a repeat): the batch path, still in order, asking only for the
        // two blocks not cached.
        let ask = [&hashes[..], &hashes[..1]].concat();
        let got = each(&r, &ask).unwrap();
        let order: Vec<usize> = got.iter().map(|g| g.0).collect();
        assert_eq!(order, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(got[4].1, b"block number 4");
        assert_eq!(got[5].1, b"block number 0");
        assert_eq!(inner.asked.load(Ordering::SeqCst), 5);
        // A caller's error ends the fetch with it, and leaves nothing in flight.
        let (inner, hashes) = blocks(3);
        let r = CachedRemote::new(
            Arc::new(inner),
            Arc::new(BlockCache::open(&CacheConfig::new(None)).unwrap()),
            Arc::new(Stats::default()),
        );
        let err = r
            .fetch_blocks_each(&hashes, &mut |i, _| {
                if i == 1 {
                    Err(RemoteError::Protocol {
                        what: "caller gave up".into(),
                    })
                } else {
                    Ok(())
                }
            })
            .unwrap_err();
        assert!(err.to_string().contains("caller gave up"), "{err}");
        assert!(r.inflight.lock().is_empty());
    }
}
