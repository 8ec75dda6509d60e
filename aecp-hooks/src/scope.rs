//! Scope resolution at publish time, with tree-sitter: a symbol scope becomes the file that
//! defines it, and the import graph (from import statements) tells which modules are related
//! for forwarding. Nothing here runs on the FUSE hot path: the mount only looks paths up.
//!
//! Reads stay inside the workspace: every candidate file is canonicalized and must lie under
//! the canonical root (a symbolic link out of the workspace is not followed), and files over
//! [`MAX_SOURCE_BYTES`] are not parsed.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use tree_sitter::{Node, Parser, Tree};

use crate::knowledge::{ArtifactError, Scope};

/// Larger sources are not parsed (generated files, vendored bundles).
pub const MAX_SOURCE_BYTES: u64 = 2 * 1024 * 1024;

/// At most this many Python files are read to build an import graph.
pub const MAX_GRAPH_FILES: usize = 20_000;

/// Why a scope could not be resolved, with what to do instead.
#[derive(Debug, thiserror::Error)]
pub enum ScopeError {
    /// The scope string or path is malformed.
    #[error(transparent)]
    Syntax(#[from] ArtifactError),
    /// No module of the workspace matches the symbol's dotted prefix.
    #[error(
        "symbol `{symbol}`: no module of the workspace matches it (looked for {tried}); publish with a `file:` or `dir:` scope if the module does not exist yet"
    )]
    NoModule {
        /// The symbol.
        symbol: String,
        /// The files looked for.
        tried: String,
    },
    /// The module exists but does not define the rest of the symbol.
    #[error("symbol `{symbol}`: `{file}` defines no `{missing}`{hint}")]
    NotDefined {
        /// The symbol.
        symbol: String,
        /// The module file.
        file: String,
        /// The part not found.
        missing: String,
        /// When `file` is a package's `__init__.py`: the `file:` scope to publish with if the
        /// missing part is a module that does not exist yet (empty otherwise).
        hint: String,
    },
    /// Reading the workspace failed.
    #[error("reading `{path}`")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Resolves a scope to the workspace-relative path the mount binds it to: a file, a
/// directory, or `""` for the workspace. Symbols go to their defining file.
pub fn resolve(root: &Path, scope: &Scope) -> Result<String, ScopeError> {
    scope.validate()?;
    match scope {
        Scope::Symbol(s) => resolve_symbol(root, s),
        Scope::File(p) | Scope::Directory(p) => Ok(p.clone()),
        Scope::Workspace => Ok(String::new()),
    }
}

/// Source roots a module name may live under (a plain layout and the `src/` layout).
const SOURCE_ROOTS: [&str; 2] = ["", "src/"];

fn resolve_symbol(root: &Path, symbol: &str) -> Result<String, ScopeError> {
    let parts: Vec<&str> = symbol.split('.').collect();
    let mut tried = Vec::new();
    // Longest module prefix first: `a.b.C.m` tries module `a.b.C`, then `a.b`, then `a`.
    for split in (1..=parts.len()).rev() {
        let module = &parts[..split];
        let rest = &parts[split..];
        for file in module_files(module) {
            tried.push(format!("`{file}`"));
            let Some(text) = read_source(root, &file)? else {
                continue;
            };
            if rest.is_empty() {
                return Ok(file);
            }
            let tree = parse(&text);
            return match find_definition(tree.root_node(), text.as_bytes(), rest) {
                Ok(()) => Ok(file),
                Err(missing) => Err(ScopeError::NotDefined {
                    hint: new_module_hint(&file, rest),
                    symbol: symbol.to_owned(),
                    file,
                    missing,
                }),
            };
        }
        // A namespace package (a directory without `__init__.py`) for the whole symbol.
        if rest.is_empty() {
            for src in SOURCE_ROOTS {
                let dir = format!("{src}{}", module.join("/"));
                if inside(root, &dir).is_some_and(|p| p.is_dir()) {
                    return Ok(dir);
                }
            }
        }
    }
    Err(ScopeError::NoModule {
        symbol: symbol.to_owned(),
        tried: tried.join(", "),
    })
}

/// For a symbol that a package's `__init__.py` does not define: the module it would be in
/// if it is a module that does not exist yet (`pkg.newmod.f` → `file:pkg/newmod.py`).
fn new_module_hint(file: &str, rest: &[&str]) -> String {
    let Some(package) = file.strip_suffix("__init__.py") else {
        return String::new();
    };
    let module = &rest[..rest.len().saturating_sub(1).max(1)];
    let dotted = format!(
        "{}.{}",
        package
            .strip_prefix("src/")
            .unwrap_or(package)
            .trim_end_matches('/')
            .replace('/', "."),
        module.join(".")
    );
    format!(
        "; if `{}` is a module that does not exist yet, publish with the scope `file:{package}{}.py`",
        dotted.trim_start_matches('.'),
        module.join("/")
    )
}

/// The files module `a.b` may be: `a/b.py`, `a/b/__init__.py`, and the same under `src/`.
fn module_files(module: &[&str]) -> Vec<String> {
    let base = module.join("/");
    SOURCE_ROOTS
        .iter()
        .flat_map(|src| {
            [
                format!("{src}{base}.py"),
                format!("{src}{base}/__init__.py"),
            ]
        })
        .collect()
}

/// `rel` under `root`, if it exists and its real path is inside the real root.
fn inside(root: &Path, rel: &str) -> Option<PathBuf> {
    let real_root = root.canonicalize().ok()?;
    let real = real_root.join(rel).canonicalize().ok()?;
    real.starts_with(&real_root).then_some(real)
}

/// The text of a workspace source file; `None` when it does not exist, is not a regular
/// file inside the workspace, is too large, or is not UTF-8.
fn read_source(root: &Path, rel: &str) -> Result<Option<String>, ScopeError> {
    let Some(path) = inside(root, rel) else {
        return Ok(None);
    };
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(_) => return Ok(None),
    };
    if !meta.is_file() || meta.len() > MAX_SOURCE_BYTES {
        return Ok(None);
    }
    match std::fs::read(&path) {
        Ok(bytes) => Ok(String::from_utf8(bytes).ok()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ScopeError::Io { path, source }),
    }
}

/// A tree-sitter parse of Python source (tree-sitter always returns a tree; syntax errors
/// become `ERROR` nodes that the walks below skip).
pub fn parse(text: &str) -> Tree {
    let mut parser = Parser::new();
    parser
        .set_language(&tree_sitter_python::LANGUAGE.into())
        .expect("the bundled Python grammar matches the tree-sitter version");
    parser
        .parse(text, None)
        .expect("a parser with a language and no timeout returns a tree")
}

/// Finds `path` (`Class.method`, `func`, `CONST`) among the definitions under `scope`
/// (a module or a class body); on failure the dotted part that was not found.
fn find_definition(scope: Node<'_>, src: &[u8], path: &[&str]) -> Result<(), String> {
    let Some((first, rest)) = path.split_first() else {
        return Ok(());
    };
    for def in definitions(scope) {
        match def.kind() {
            "function_definition" | "class_definition" if name_of(def, src) == Some(*first) => {
                if rest.is_empty() {
                    return Ok(());
                }
                let body = def
                    .child_by_field_name("body")
                    .ok_or_else(|| path.join("."))?;
                return find_definition(body, src, rest).map_err(|_| path.join("."));
            }
            "assignment" if rest.is_empty() && assigned_names(def, src).contains(first) => {
                return Ok(());
            }
            _ => {}
        }
    }
    Err(path.join("."))
}

/// The definitions directly in a block: functions, classes (also decorated) and assignment
/// statements, looking into `if`/`try`/`with` blocks (conditional definitions).
fn definitions(block: Node<'_>) -> Vec<Node<'_>> {
    let mut out = Vec::new();
    let mut stack = vec![block];
    while let Some(node) = stack.pop() {
        let mut cursor = node.walk();
        for child in node.named_children(&mut cursor) {
            match child.kind() {
                "function_definition" | "class_definition" => out.push(child),
                "decorated_definition" => {
                    if let Some(d) = child.child_by_field_name("definition") {
                        out.push(d);
                    }
                }
                "expression_statement" => {
                    let mut c = child.walk();
                    out.extend(
                        child
                            .named_children(&mut c)
                            .filter(|n| n.kind() == "assignment"),
                    );
                }
                "if_statement" | "try_statement" | "with_statement" | "block" | "else_clause"
                | "elif_clause" | "except_clause" | "finally_clause" => stack.push(child),
                _ => {}
            }
        }
    }
    out
}

fn name_of<'s>(def: Node<'_>, src: &'s [u8]) -> Option<&'s str> {
    def.child_by_field_name("name")?.utf8_text(src).ok()
}

/// Names bound by an assignment's left side (`X = …`, `A, B = …`, `X: int = …`).
fn assigned_names<'s>(assignment: Node<'_>, src: &'s [u8]) -> Vec<&'s str> {
    let Some(left) = assignment.child_by_field_name("left") else {
        return vec![];
    };
    let mut out = Vec::new();
    let mut stack = vec![left];
    while let Some(n) = stack.pop() {
        match n.kind() {
            "identifier" => out.extend(n.utf8_text(src).ok()),
            "pattern_list" | "tuple_pattern" | "list_pattern" => {
                let mut c = n.walk();
                stack.extend(n.named_children(&mut c));
            }
            _ => {}
        }
    }
    out
}

/// The dotted module name of a workspace-relative Python file (`pkg/a.py` → `pkg.a`,
/// `pkg/__init__.py` → `pkg`, `src/pkg/a.py` → `pkg.a`).
pub fn module_name(file: &str) -> Option<String> {
    let file = file.strip_prefix("src/").unwrap_or(file);
    let stem = file.strip_suffix(".py")?;
    let stem = stem.strip_suffix("/__init__").unwrap_or(stem);
    Some(stem.replace('/', "."))
}

/// An import statement's target as written: the dotted module (relative ones resolved
/// against the importing file's package) and the names imported from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Import {
    /// Absolute dotted module name.
    pub module: String,
    /// `from m import a, b`: `a`, `b` (which may be submodules); empty for `import m`.
    pub names: Vec<String>,
}

/// The imports of a Python file (anywhere in it, also inside functions).
pub fn imports(text: &str, file: &str) -> Vec<Import> {
    let tree = parse(text);
    let src = text.as_bytes();
    let package: Vec<String> = {
        let module = module_name(file).unwrap_or_default();
        let mut parts: Vec<String> = module
            .split('.')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        // A module's package is its parent; a package's `__init__` is its own package.
        if !file.ends_with("__init__.py") {
            parts.pop();
        }
        parts
    };
    let mut out = Vec::new();
    let mut stack = vec![tree.root_node()];
    while let Some(node) = stack.pop() {
        match node.kind() {
            "import_statement" => {
                let mut c = node.walk();
                for name in node.children_by_field_name("name", &mut c) {
                    if let Some(m) = dotted(name, src) {
                        out.push(Import {
                            module: m,
                            names: vec![],
                        });
                    }
                }
            }
            "import_from_statement" => {
                if let Some(module) = from_module(node, src, &package) {
                    let mut c = node.walk();
                    let names = node
                        .children_by_field_name("name", &mut c)
                        .filter_map(|n| dotted(n, src))
                        .collect();
                    out.push(Import { module, names });
                }
            }
            _ => {
                let mut c = node.walk();
                stack.extend(node.named_children(&mut c));
            }
        }
    }
    out
}

/// The dotted name of a `dotted_name` or `aliased_import` node.
fn dotted(node: Node<'_>, src: &[u8]) -> Option<String> {
    let node = match node.kind() {
        "aliased_import" => node.child_by_field_name("name")?,
        "dotted_name" => node,
        _ => return None,
    };
    node.utf8_text(src)
        .ok()
        .map(|s| s.split_whitespace().collect())
}

/// The module of `from X import …`, relative forms resolved against `package`.
fn from_module(node: Node<'_>, src: &[u8], package: &[String]) -> Option<String> {
    let m = node.child_by_field_name("module_name")?;
    if m.kind() != "relative_import" {
        return dotted(m, src);
    }
    let text = m.utf8_text(src).ok()?;
    let dots = text.chars().take_while(|c| *c == '.').count();
    let tail: String = text[dots..].split_whitespace().collect();
    // One dot: this package; each further dot: one level up.
    let keep = package.len().checked_sub(dots - 1)?;
    let mut parts: Vec<&str> = package[..keep].iter().map(String::as_str).collect();
    if !tail.is_empty() {
        parts.push(&tail);
    }
    (!parts.is_empty()).then(|| parts.join("."))
}

/// The workspace-relative files `file`'s imports may name (each import as a module, and
/// `from m import n` also as the submodule `m.n`; both `x.py` and `x/__init__.py`, at the
/// root and under `src/`), whether or not they exist. Sorted, without duplicates.
pub fn imported_files(text: &str, file: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for imp in imports(text, file) {
        let parts: Vec<&str> = imp.module.split('.').collect();
        out.extend(module_files(&parts));
        for name in &imp.names {
            let mut sub = parts.clone();
            sub.extend(name.split('.'));
            out.extend(module_files(&sub));
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Which workspace files import which, both directions, keyed by workspace-relative path.
#[derive(Debug, Clone, Default)]
pub struct ImportGraph {
    edges: HashMap<String, HashSet<String>>,
}

impl ImportGraph {
    /// Records that `from` imports `to` (kept in both directions).
    pub fn add_edge(&mut self, from: &str, to: &str) {
        if from == to {
            return;
        }
        self.edges
            .entry(from.to_owned())
            .or_default()
            .insert(to.to_owned());
        self.edges
            .entry(to.to_owned())
            .or_default()
            .insert(from.to_owned());
    }

    /// Files connected to `file` by one import, either way.
    pub fn neighbours(&self, file: &str) -> HashSet<&str> {
        self.edges
            .get(file)
            .map(|s| s.iter().map(String::as_str).collect())
            .unwrap_or_default()
    }

    /// Reads every Python file of the workspace (up to [`MAX_GRAPH_FILES`], skipping hidden
    /// directories, `__pycache__`, `node_modules` and virtual environments) and links each
    /// import that resolves to a workspace file.
    pub fn build(root: &Path) -> Result<ImportGraph, ScopeError> {
        let files = python_files(root)?;
        let known: HashSet<&str> = files.iter().map(String::as_str).collect();
        let mut graph = ImportGraph::default();
        for file in &files {
            let Some(text) = read_source(root, file)? else {
                continue;
            };
            for imp in imports(&text, file) {
                let mut targets = Vec::new();
                let parts: Vec<&str> = imp.module.split('.').collect();
                targets.extend(module_files(&parts));
                for name in &imp.names {
                    let mut sub = parts.clone();
                    sub.extend(name.split('.'));
                    targets.extend(module_files(&sub));
                }
                for t in targets.iter().filter(|t| known.contains(t.as_str())) {
                    graph.add_edge(file, t);
                }
            }
        }
        Ok(graph)
    }
}

/// Workspace-relative paths of the Python files under `root`, sorted.
fn python_files(root: &Path) -> Result<Vec<String>, ScopeError> {
    let mut out = Vec::new();
    let mut stack = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, rel)) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|source| ScopeError::Io {
            path: dir.clone(),
            source,
        })?;
        if dir.join("pyvenv.cfg").exists() {
            continue;
        }
        for entry in entries.flatten() {
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            let child_rel = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            if kind.is_dir() {
                if !name.starts_with('.') && name != "__pycache__" && name != "node_modules" {
                    stack.push((entry.path(), child_rel));
                }
            } else if kind.is_file() && name.ends_with(".py") {
                out.push(child_rel);
                if out.len() >= MAX_GRAPH_FILES {
                    out.sort();
                    return Ok(out);
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workspace(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let p = dir.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        dir
    }

    const ACCT: &str = "\
import os
from dataclasses import dataclass

RATE = 3
A, B = 1, 2

@dataclass
class Account:
    owner: str

    def deposit(self, amount):
        return amount

    @property
    def balance(self):
        return 0

    class Inner:
        def deep(self): ...

try:
    from fast import speedup
except ImportError:
    def speedup(x):
        return x

async def fetch(url): ...
";

    #[test]
    fn symbols_resolve_to_their_defining_file() {
        let ws = workspace(&[
            ("pkg/__init__.py", "VERSION = '1'\n"),
            ("pkg/acct.py", ACCT),
            ("pkg/sub/__init__.py", ""),
            ("src/lib/core.py", "def run(): pass\n"),
            ("ns/mod.py", "x = 1\n"),
        ]);
        let r = |s: &str| resolve(ws.path(), &Scope::Symbol(s.into()));
        assert_eq!(r("pkg.acct.Account.deposit").unwrap(), "pkg/acct.py");
        assert_eq!(r("pkg.acct.Account.balance").unwrap(), "pkg/acct.py");
        assert_eq!(r("pkg.acct.Account.Inner.deep").unwrap(), "pkg/acct.py");
        assert_eq!(r("pkg.acct.Account").unwrap(), "pkg/acct.py");
        assert_eq!(r("pkg.acct.RATE").unwrap(), "pkg/acct.py");
        assert_eq!(r("pkg.acct.B").unwrap(), "pkg/acct.py");
        assert_eq!(
            r("pkg.acct.speedup").unwrap(),
            "pkg/acct.py",
            "defined in an except block"
        );
        assert_eq!(r("pkg.acct.fetch").unwrap(), "pkg/acct.py", "async def");
        assert_eq!(r("pkg.acct").unwrap(), "pkg/acct.py");
        assert_eq!(r("pkg.VERSION").unwrap(), "pkg/__init__.py");
        assert_eq!(r("pkg.sub").unwrap(), "pkg/sub/__init__.py");
        assert_eq!(r("lib.core.run").unwrap(), "src/lib/core.py");
        assert_eq!(r("ns").unwrap(), "ns", "namespace package");
    }

    #[test]
    fn unresolvable_symbols_say_why() {
        let ws = workspace(&[("pkg/acct.py", ACCT)]);
        let r = |s: &str| resolve(ws.path(), &Scope::Symbol(s.into()));
        match r("pkg.acct.Account.withdraw") {
            Err(ScopeError::NotDefined { file, missing, .. }) => {
                assert_eq!(file, "pkg/acct.py");
                assert_eq!(missing, "Account.withdraw");
            }
            other => panic!("{other:?}"),
        }
        // A module that does not exist yet in a package that does: the `file:` to use.
        let pkg = workspace(&[("pkg/__init__.py", "X = 1\n"), ("pkg/acct.py", ACCT)]);
        let e = resolve(pkg.path(), &Scope::Symbol("pkg.newmod.f".into())).unwrap_err();
        assert!(
            e.to_string().contains("`file:pkg/newmod.py`"),
            "names the file to publish with: {e}"
        );
        let e = resolve(pkg.path(), &Scope::Symbol("pkg.newmod".into())).unwrap_err();
        assert!(e.to_string().contains("`file:pkg/newmod.py`"), "{e}");
        let e = r("nothere.f").unwrap_err();
        assert!(matches!(e, ScopeError::NoModule { .. }));
        assert!(
            e.to_string().contains("file:"),
            "says what to do instead: {e}"
        );
        // `os` is imported, not defined: not a definition of the module.
        assert!(r("pkg.acct.os").is_err());
    }

    #[test]
    fn file_directory_and_workspace_scopes_bind_as_given() {
        let ws = workspace(&[]);
        assert_eq!(
            resolve(ws.path(), &Scope::File("pkg/a.py".into())).unwrap(),
            "pkg/a.py"
        );
        assert_eq!(
            resolve(ws.path(), &Scope::Directory("pkg".into())).unwrap(),
            "pkg"
        );
        assert_eq!(resolve(ws.path(), &Scope::Workspace).unwrap(), "");
        assert!(resolve(ws.path(), &Scope::File("../x".into())).is_err());
    }

    #[cfg(unix)]
    #[test]
    fn a_symlink_out_of_the_workspace_is_not_read() {
        let outside = workspace(&[("secret.py", "def f(): pass\n")]);
        let ws = workspace(&[]);
        std::os::unix::fs::symlink(outside.path().join("secret.py"), ws.path().join("leak.py"))
            .unwrap();
        assert!(resolve(ws.path(), &Scope::Symbol("leak.f".into())).is_err());
    }

    #[test]
    fn imports_absolute_relative_and_nested() {
        let text = "\
import os, pkg.util as u
from pkg import acct
from . import sibling
from .helpers import h
from ..top import t
def f():
    import pkg.late
";
        let got = imports(text, "pkg/sub/mod.py");
        let modules: Vec<&str> = got.iter().map(|i| i.module.as_str()).collect();
        for m in [
            "os",
            "pkg.util",
            "pkg",
            "pkg.sub",
            "pkg.sub.helpers",
            "pkg.top",
            "pkg.late",
        ] {
            assert!(modules.contains(&m), "{m} missing from {modules:?}");
        }
        let from_pkg = got.iter().find(|i| i.module == "pkg").unwrap();
        assert_eq!(from_pkg.names, ["acct"]);
        // Too many dots: no package to go up to; ignored, not a panic.
        assert!(imports("from .... import x\n", "a.py").is_empty());
        // Broken source parses partially, without a panic.
        let _ = imports("from import (\n def", "x.py");
    }

    #[test]
    fn import_graph_links_workspace_files_both_ways() {
        let ws = workspace(&[
            ("app/main.py", "from pkg import a\nimport json\n"),
            ("pkg/__init__.py", ""),
            ("pkg/a.py", "from .util import helper\n"),
            ("pkg/util.py", "def helper(): pass\n"),
            ("pkg/c.py", "x = 1\n"),
            (".venv/lib/x.py", "import pkg.a\n"),
        ]);
        let g = ImportGraph::build(ws.path()).unwrap();
        let n = g.neighbours("pkg/a.py");
        assert!(n.contains("app/main.py"), "{n:?}");
        assert!(n.contains("pkg/util.py"), "{n:?}");
        assert!(!n.contains("pkg/c.py"));
        assert!(
            !n.iter().any(|f| f.starts_with(".venv")),
            "hidden directories are skipped"
        );
    }

    #[test]
    fn module_names() {
        assert_eq!(module_name("pkg/a.py").as_deref(), Some("pkg.a"));
        assert_eq!(module_name("pkg/__init__.py").as_deref(), Some("pkg"));
        assert_eq!(module_name("src/pkg/a.py").as_deref(), Some("pkg.a"));
        assert_eq!(module_name("README.md"), None);
    }
}
