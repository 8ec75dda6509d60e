//! Walking a resource directory: which files and directories travel, with their sizes and
//! modes, and which are sensitive or left out.

use std::path::Path;

use super::{ArchiveError, io_err};

/// Admission limits for one delegation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanLimits {
    /// Total size of all files.
    pub max_total_bytes: u64,
    /// Number of files.
    pub max_files: u64,
    /// Size of one file.
    pub max_file_bytes: u64,
}

impl ScanLimits {
    /// The reference's archive limits: 100 MB in all, 10,000 files, 50 MB per file.
    pub const REFERENCE: ScanLimits = ScanLimits {
        max_total_bytes: 100 << 20,
        max_files: 10_000,
        max_file_bytes: 50 << 20,
    };
}

/// Which files of a resource travel: include/exclude globs and the sensitive patterns.
///
/// Globs: a pattern without `/` matches a file's or directory's name anywhere in the tree
/// (`*.log`, `.env`); a pattern with `/` matches the path from the resource's root, where
/// `*` and `?` stay within one component and `**` spans any number of them (`src/**`,
/// `build/*.o`). An excluded directory is not entered. With include patterns, only files
/// matching one of them travel. Sensitive patterns are checked on the files that would
/// travel; excluding a sensitive file is how to delegate anyway.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only these travel (empty: all).
    pub include: Vec<String>,
    /// These never travel.
    pub exclude: Vec<String>,
    /// These refuse the delegation when they would travel.
    pub sensitive: Vec<String>,
    /// These travel although they match a sensitive pattern (`--allow-sensitive`).
    pub allow_sensitive: Vec<String>,
}

impl Filter {
    /// Everything travels; nothing is sensitive.
    pub fn everything() -> Filter {
        Filter::default()
    }

    /// The reference's sensitive list, plus the given globs.
    pub fn new(include: Vec<String>, exclude: Vec<String>) -> Filter {
        Filter {
            include,
            exclude,
            sensitive: super::DEFAULT_SENSITIVE
                .iter()
                .map(|s| s.to_string())
                .collect(),
            allow_sensitive: Vec::new(),
        }
    }

    fn excluded(&self, rel: &str) -> bool {
        glob_first(&self.exclude, rel).is_some()
    }

    fn included(&self, rel: &str) -> bool {
        self.include.is_empty() || glob_first(&self.include, rel).is_some()
    }

    /// Whether `rel` matches a sensitive pattern and no `allow_sensitive` one.
    pub fn is_sensitive(&self, rel: &str) -> bool {
        self.sensitive_pattern(rel).is_some()
    }

    /// The first sensitive pattern `rel` matches, unless an `allow_sensitive` glob lets it
    /// travel.
    pub fn sensitive_pattern(&self, rel: &str) -> Option<&str> {
        let hit = glob_first(&self.sensitive, rel)?;
        if glob_first(&self.allow_sensitive, rel).is_some() {
            return None;
        }
        Some(hit)
    }

    /// Whether the entry `rel` itself is shown (its parents are checked separately): not
    /// excluded, and for a file, included and not sensitive. Directories are shown unless
    /// excluded (include patterns name files).
    pub fn visible(&self, rel: &str, is_dir: bool) -> bool {
        if self.excluded(rel) {
            return false;
        }
        is_dir || (self.included(rel) && !self.is_sensitive(rel))
    }

    /// Add the patterns of `root/.gitignore` to the excludes: blank lines and comments are
    /// skipped, a leading `/` anchors to the root, a trailing `/` is dropped (the pattern
    /// then hides files of that name too); negations (`!…`) are not supported and skipped
    /// with a warning. Nested `.gitignore` files are not read.
    pub fn add_gitignore(&mut self, root: &Path) {
        let Ok(text) = std::fs::read_to_string(root.join(".gitignore")) else {
            return;
        };
        for line in text.lines() {
            let line = line.trim_end();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if line.starts_with('!') {
                tracing::warn!(
                    pattern = line,
                    "negated .gitignore patterns are not supported; ignored"
                );
                continue;
            }
            let p = line.strip_suffix('/').unwrap_or(line);
            // `/build` is anchored: give it a `/` our matcher reads as "from the root".
            let p = match p.strip_prefix('/') {
                Some(rest) if !rest.contains('/') => format!("/{rest}"),
                _ => p.to_string(),
            };
            self.exclude.push(p);
        }
    }

    /// Whether `rel` (a file's path from the resource root) travels, ignoring sensitivity.
    pub fn passes(&self, rel: &str) -> bool {
        let parts: Vec<&str> = rel.split('/').collect();
        // An excluded ancestor directory hides everything below it.
        for i in 1..parts.len() {
            if self.excluded(&parts[..i].join("/")) {
                return false;
            }
        }
        !self.excluded(rel) && self.included(rel)
    }
}

/// Match a glob against a relative path (see [`Filter`]).
pub(crate) fn glob_path(pattern: &str, rel: &str) -> bool {
    glob_path_named(pattern, rel, last_name(rel))
}

/// The first of `patterns` that matches `rel` ([`glob_path`]), the path's last name found
/// once for all of them: every entry of a large tree is matched against every sensitive
/// pattern, at manifest time and when the withheld files are listed.
fn glob_first<'p>(patterns: &'p [String], rel: &str) -> Option<&'p str> {
    if patterns.is_empty() {
        return None;
    }
    let name = last_name(rel);
    patterns
        .iter()
        .map(String::as_str)
        .find(|p| glob_path_named(p, rel, name))
}

fn last_name(rel: &str) -> &str {
    rel.rfind('/').map_or(rel, |i| &rel[i + 1..])
}

/// [`glob_path`], given `rel`'s last name.
fn glob_path_named(pattern: &str, rel: &str, name: &str) -> bool {
    let mut pattern = pattern;
    while let Some(rest) = pattern.strip_prefix("./") {
        pattern = rest;
    }
    let pattern = pattern.strip_suffix('/').unwrap_or(pattern);
    if !pattern.as_bytes().contains(&b'/') {
        // The common case (every default sensitive pattern): match the last name only,
        // without splitting the path.
        return glob_name(pattern, name);
    }
    let path: Vec<&str> = rel.split('/').collect();
    let pat: Vec<&str> = pattern.trim_start_matches('/').split('/').collect();
    glob_parts(&pat, &path)
}

fn glob_parts(pat: &[&str], path: &[&str]) -> bool {
    match pat.split_first() {
        None => path.is_empty(),
        Some((&"**", rest)) => (0..=path.len()).any(|i| glob_parts(rest, &path[i..])),
        Some((p, rest)) => match path.split_first() {
            Some((c, path_rest)) => glob_name(p, c) && glob_parts(rest, path_rest),
            None => false,
        },
    }
}

/// `*` and `?` within one name.
fn glob_name(pattern: &str, name: &str) -> bool {
    if pattern.is_ascii() && name.is_ascii() {
        // Bytes are characters: no allocation.
        return glob_seq(pattern.as_bytes(), name.as_bytes(), b'*', b'?');
    }
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    glob_seq(&p, &n, '*', '?')
}

/// Wildcard matching over any sequence: `star` matches any run, `any` one element.
fn glob_seq<T: PartialEq + Copy>(p: &[T], n: &[T], star_c: T, any: T) -> bool {
    let (mut pi, mut ni) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == any || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == star_c {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == star_c)
}

/// A file that travels.
#[derive(Debug, Clone)]
pub(crate) struct FileInfo {
    pub(crate) rel: String,
    pub(crate) size: u64,
    pub(crate) mode: u32,
}

/// A directory that travels.
#[derive(Debug, Clone)]
pub(crate) struct DirInfo {
    pub(crate) rel: String,
    pub(crate) mode: u32,
}

/// The result of a walk.
#[derive(Debug, Default)]
pub(crate) struct Scan {
    pub(crate) files: Vec<FileInfo>,
    pub(crate) dirs: Vec<DirInfo>,
    pub(crate) sensitive: Vec<String>,
    pub(crate) skipped: Vec<String>,
}

/// Walk `root` (sorted, so archives are reproducible). Symbolic links are followed only
/// to regular files inside `root`; any other link, and names that are not UTF-8, are
/// skipped and listed.
pub(crate) fn scan(root: &Path, filter: &Filter) -> Result<Scan, ArchiveError> {
    use std::os::unix::fs::PermissionsExt;
    let canonical_root = root.canonicalize().map_err(io_err(root))?;
    let mut out = Scan::default();
    let mut stack = vec![String::new()];
    while let Some(dir_rel) = stack.pop() {
        let dir = if dir_rel.is_empty() {
            root.to_path_buf()
        } else {
            root.join(&dir_rel)
        };
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .map_err(io_err(&dir))?
            .collect::<Result<_, _>>()
            .map_err(io_err(&dir))?;
        entries.sort_by_key(|e| e.file_name());
        let mut subdirs = Vec::new();
        for e in entries {
            let Some(name) = e.file_name().to_str().map(str::to_owned) else {
                out.skipped
                    .push(format!("{dir_rel}/{}", e.file_name().to_string_lossy()));
                continue;
            };
            let rel = if dir_rel.is_empty() {
                name
            } else {
                format!("{dir_rel}/{name}")
            };
            let path = e.path();
            let meta = std::fs::symlink_metadata(&path).map_err(io_err(&path))?;
            if meta.is_dir() {
                if filter.excluded(&rel) {
                    continue;
                }
                subdirs.push((rel, meta.permissions().mode()));
                continue;
            }
            if !filter.passes(&rel) {
                continue;
            }
            let meta = if meta.file_type().is_symlink() {
                let inside = path
                    .canonicalize()
                    .ok()
                    .filter(|t| t.starts_with(&canonical_root))
                    .and_then(|t| std::fs::metadata(t).ok())
                    .filter(|m| m.is_file());
                match inside {
                    Some(m) => m,
                    None => {
                        out.skipped.push(rel);
                        continue;
                    }
                }
            } else if meta.is_file() {
                meta
            } else {
                // Sockets, FIFOs, devices: nothing to copy.
                out.skipped.push(rel);
                continue;
            };
            if filter.is_sensitive(&rel) {
                out.sensitive.push(rel.clone());
            }
            out.files.push(FileInfo {
                rel,
                size: meta.len(),
                mode: meta.permissions().mode(),
            });
        }
        // Depth first, in name order.
        for (rel, mode) in subdirs.into_iter().rev() {
            out.dirs.push(DirInfo {
                rel: rel.clone(),
                mode,
            });
            stack.push(rel);
        }
    }
    if !filter.include.is_empty() {
        // Only the directories that lead to an included file.
        let keep: std::collections::BTreeSet<String> = out
            .files
            .iter()
            .flat_map(|f| {
                let parts: Vec<&str> = f.rel.split('/').collect();
                (1..parts.len())
                    .map(|i| parts[..i].join("/"))
                    .collect::<Vec<_>>()
            })
            .collect();
        out.dirs.retain(|d| keep.contains(&d.rel));
    }
    out.dirs.sort_by(|a, b| a.rel.cmp(&b.rel));
    out.files.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_path(".env", ".env"));
        assert!(glob_path(".env", "a/b/.env"));
        // Non-ASCII names take the per-character path; `?` is one character, not one byte.
        assert!(glob_path("*.pem", "dir/clé.pem"));
        assert!(glob_path("cl?.pem", "clé.pem"));
        assert!(!glob_path("cl?.pem", "cl.pem"));
        assert!(glob_path("é*", "x/éa"));
        assert!(glob_path(".env.*", "conf/.env.local"));
        assert!(!glob_path(".env.*", ".env"));
        assert!(glob_path("*.pem", "keys/server.pem"));
        assert!(glob_path(
            "service-account*.json",
            "service-account-prod.json"
        ));
        assert!(glob_path("src/**", "src/a/b.rs"));
        assert!(glob_path("src/**/*.rs", "src/b.rs"));
        assert!(glob_path("src/**/*.rs", "src/x/y/b.rs"));
        assert!(!glob_path("src/**/*.rs", "lib/b.rs"));
        assert!(glob_path("build/*.o", "build/x.o"));
        assert!(!glob_path("build/*.o", "build/sub/x.o"));
        assert!(glob_path("dist/", "dist"));
        assert!(glob_path("a?c", "abc"));
        assert!(!glob_path("a?c", "abbc"));
    }

    #[test]
    fn excluded_directories_hide_their_content() {
        let f = Filter::new(vec![], vec!["target".into(), "docs/*.tmp".into()]);
        assert!(!f.passes("target/debug/x"));
        assert!(!f.passes("docs/a.tmp"));
        assert!(f.passes("docs/a.md"));
        let f = Filter::new(vec!["src/**".into()], vec![]);
        assert!(f.passes("src/main.rs"));
        assert!(!f.passes("README.md"));
        let f = Filter::new(vec!["*.py".into()], vec!["build".into()]);
        assert!(
            f.visible("pkg", true),
            "directories are shown for include patterns"
        );
        assert!(f.visible("pkg/a.py", false));
        assert!(!f.visible("pkg/README", false));
        assert!(!f.visible("build", true));
        assert!(!f.visible(".env", false), "sensitive");
    }

    #[test]
    fn gitignore_patterns_become_excludes() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(
            tmp.path().join(".gitignore"),
            "# comment\n\ntarget/\n/out\n*.log\n!keep.log\ndocs/*.tmp\n",
        )
        .unwrap();
        let mut f = Filter::new(vec![], vec![]);
        f.add_gitignore(tmp.path());
        assert!(!f.passes("target/debug/x"));
        assert!(!f.passes("out/a"));
        assert!(f.passes("sub/out/a"), "`/out` is anchored to the root");
        assert!(!f.passes("a/b.log"));
        assert!(!f.passes("docs/x.tmp"));
        assert!(f.passes("src/main.rs"));
    }
}
