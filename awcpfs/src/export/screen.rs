//! The commit screen: a narrow hook that may hold back single writes of a commit.
//!
//! The export knows nothing of AECP. A daemon that wants written files checked before they
//! land installs a [`CommitScreen`] on the export ([`super::Export::set_screen`]), with the
//! worker (delegation id) whose mount commits there. For each live commit (staged commits
//! and the standalone `awcpfs export` are never screened) the export asks the screen once
//! which paths it watches ([`CommitScreen::watched`]: a set lookup per written path, so a
//! commit that touches none of them costs nothing more), and for each watched write, after
//! its content is staged and before it is applied, asks [`CommitScreen::screen`] with the
//! new content. [`Screening::Hold`] means that path is not applied — nothing is written at
//! it or beside it — and the commit's answer lists it in `held`; the rest of the commit is
//! applied as usual. The mount keeps a held file local and sends it again once it changes
//! (see `mount/sync.rs`).
//!
//! The screen runs on the blocking pool inside the commit's lock: it must be quick (a
//! static check, a database lookup) and never wait on the network.

use std::collections::HashSet;

/// What a screen watches in one commit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Watched {
    /// Exact workspace-relative paths (contracted modules).
    pub paths: HashSet<String>,
    /// Also every path ending in one of these suffixes (`.py`: files that may import a
    /// revised module).
    pub suffixes: Vec<String>,
}

impl Watched {
    /// Whether nothing is watched (the commit is not screened at all).
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty() && self.suffixes.is_empty()
    }

    /// Whether `path` is watched.
    pub fn covers(&self, path: &str) -> bool {
        self.paths.contains(path) || self.suffixes.iter().any(|s| path.ends_with(s.as_str()))
    }
}

/// A screen's answer for one write.
#[derive(Debug, Clone, PartialEq)]
pub enum Screening {
    /// Apply it.
    Pass,
    /// Do not apply it: `reason` (a sentence) and a structured `report` for the Executor.
    Hold {
        /// Why.
        reason: String,
        /// The details (for AECP: the verifier's verdict and violations).
        report: Option<serde_json::Value>,
    },
}

/// Checks written files before a commit applies them.
pub trait CommitScreen: Send + Sync + std::fmt::Debug {
    /// Once per commit with writes: the paths `worker`'s writes are screened at.
    fn watched(&self, worker: &str) -> Watched;

    /// The write of `content` to `path` by `worker`, staged and about to be applied.
    fn screen(&self, worker: &str, path: &str, content: &[u8]) -> Screening;
}

/// Largest file handed to a screen (16 MiB); a larger watched file passes unscreened, with
/// a warning (no source module is that large; reading it whole would cost the commit).
pub const MAX_SCREENED_BYTES: u64 = 16 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watched_covers_exact_paths_and_suffixes() {
        let mut w = Watched::default();
        assert!(w.is_empty());
        w.paths.insert("pkg/acct.py".into());
        assert!(w.covers("pkg/acct.py"));
        assert!(!w.covers("pkg/other.py"));
        w.suffixes.push(".py".into());
        assert!(w.covers("pkg/other.py"));
        assert!(!w.covers("README.md"));
    }
}
