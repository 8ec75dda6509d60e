//! Revision tracking as a mount sees it: the contracts of its workspace, this worker's
//! standing as a consumer of each (acknowledged revision, stale flag, the diff to look at),
//! and the fixed-template record a revision is delivered in.
//!
//! A [`RevisionNotice`] is quoted data like a knowledge [`crate::knowledge::Delivery`]: one
//! JSON object per line, fields in a fixed order, the diff cut to [`MAX_DIFF_CHARS`]. Its
//! first field, `"kind": "contract_revision"`, tells it apart from a knowledge delivery
//! (whose first field is `id`) in `.aecp/inbox` and on the socket.

use serde::{Deserialize, Serialize};

/// The longest diff a notice or `.aecp/contracts/<module>` carries (a cut diff ends with
/// `…`; `awcp-ctl aecp contract show` has the whole contract).
pub const MAX_DIFF_CHARS: usize = 16_000;

/// What a stale consumer receives when a contract it depends on is revised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RevisionNotice {
    /// Always [`RevisionNotice::KIND`].
    pub kind: String,
    /// The module path (`pkg/acct.py`).
    pub module: String,
    /// The newest revision.
    pub revision: u32,
    /// The revision this worker acknowledged (what the diff starts from).
    pub acked_revision: u32,
    /// The worker that revised it.
    pub by: String,
    /// A unified diff of the interfaces, cut to [`MAX_DIFF_CHARS`].
    pub diff: String,
}

impl RevisionNotice {
    /// The `kind` of every notice.
    pub const KIND: &'static str = "contract_revision";

    /// A notice, its diff cut by the policy.
    pub fn new(
        module: &str,
        revision: u32,
        acked_revision: u32,
        by: &str,
        diff: &str,
    ) -> RevisionNotice {
        RevisionNotice {
            kind: Self::KIND.to_owned(),
            module: module.to_owned(),
            revision,
            acked_revision,
            by: by.to_owned(),
            diff: cut(diff),
        }
    }

    /// One NDJSON line, newline included.
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self).unwrap_or_default();
        line.push('\n');
        line
    }
}

fn cut(s: &str) -> String {
    match s.char_indices().nth(MAX_DIFF_CHARS) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// This worker's standing as a consumer of one module.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Standing {
    /// The revision it acknowledged (or registered at).
    pub acked_revision: u32,
    /// Whether a newer revision awaits its acknowledgement.
    pub stale: bool,
}

/// What a replica knows of one contracted module: `.aecp/contracts/<module>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContractView {
    /// Always `"contract"`.
    #[serde(default = "contract_kind")]
    pub kind: crate::knowledge::LineKind,
    /// The module path.
    pub module: String,
    /// The newest revision.
    pub revision: u32,
    /// Who declared or revised it.
    pub by: String,
    /// The contract (the contract library's JSON).
    pub contract: serde_json::Value,
    /// This worker as a consumer (`null`: it is not one).
    pub consumer: Option<Standing>,
    /// While stale: what changed since the acknowledged revision (`null` otherwise).
    pub diff: Option<String>,
}

fn contract_kind() -> crate::knowledge::LineKind {
    crate::knowledge::LineKind::Contract
}

impl Default for ContractView {
    fn default() -> Self {
        ContractView {
            kind: contract_kind(),
            module: String::new(),
            revision: 0,
            by: String::new(),
            contract: serde_json::Value::Null,
            consumer: None,
            diff: None,
        }
    }
}

impl ContractView {
    /// The file's content: one JSON object and a newline.
    pub fn render(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

/// The module whose compiled copy `path` is: `pkg/__pycache__/acct.cpython-312.pyc` →
/// `pkg/acct.py` (Python opens only that copy when it is current, so opening it is an
/// import of the module). `None` for any other path.
pub fn module_of_cached(path: &str) -> Option<String> {
    let (dir, file) = path.rsplit_once('/').unwrap_or(("", path));
    let parent = match dir.rsplit_once('/') {
        Some((p, "__pycache__")) => Some(p),
        None if dir == "__pycache__" => Some(""),
        _ => None,
    }?;
    let stem = file.strip_suffix(".pyc")?.split('.').next()?;
    if stem.is_empty() {
        return None;
    }
    Some(if parent.is_empty() {
        format!("{stem}.py")
    } else {
        format!("{parent}/{stem}.py")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_modules_map_to_their_source() {
        assert_eq!(
            module_of_cached("pkg/__pycache__/acct.cpython-312.pyc").as_deref(),
            Some("pkg/acct.py")
        );
        assert_eq!(
            module_of_cached("__pycache__/app.cpython-311.opt-1.pyc").as_deref(),
            Some("app.py")
        );
        assert_eq!(module_of_cached("pkg/acct.py"), None);
        assert_eq!(module_of_cached("pkg/acct.pyc"), None, "not in __pycache__");
        assert_eq!(module_of_cached("pkg/__pycache__/.pyc"), None);
    }

    #[test]
    fn a_notice_is_one_line_in_a_fixed_order_with_its_diff_cut() {
        let long = "+x\n".repeat(MAX_DIFF_CHARS);
        let n = RevisionNotice::new("pkg/acct.py", 2, 1, "w1", &long);
        let line = n.to_line();
        assert_eq!(line.matches('\n').count(), 1);
        assert!(line.starts_with(
            r#"{"kind":"contract_revision","module":"pkg/acct.py","revision":2,"ackedRevision":1,"by":"w1","diff":"#
        ));
        assert_eq!(n.diff.chars().count(), MAX_DIFF_CHARS + 1);
        assert!(n.diff.ends_with('…'));
        let back: RevisionNotice = serde_json::from_str(&line).unwrap();
        assert_eq!(back, n);
    }
}
