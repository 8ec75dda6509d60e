//! The stub module a contract stands for until its producer writes the implementation.
//!
//! A stub has the declared symbols and signatures and no behaviour: every declared callable
//! raises `NotImplementedError` naming the symbol, module constants are `...`, class attributes
//! are annotations. It imports and runs (consumers import it while the producer works):
//! `from __future__ import annotations` keeps annotations unevaluated, decorators and bases the
//! stub can import are imported (`functools`, `abc`, `dataclasses`, `enum`, `typing`, …), a
//! decorator it cannot import is replaced by a no-op stand-in, and a base it cannot import by
//! an empty stand-in class of the same name. The module constant [`MARKER`] names it a stub; the verifier
//! reports a module that still defines it as verdict `stub`.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use super::{Contract, Param, ParamKind, Symbol, SymbolKind};

/// The module constant that marks a stub: `__aecp_stub__ = "<module path>"`.
pub const MARKER: &str = "__aecp_stub__";

/// Modules the stub may import by name (standard library).
const MODULES: &[&str] = &[
    "abc",
    "contextlib",
    "dataclasses",
    "enum",
    "functools",
    "typing",
];

/// Names the stub knows how to import: name → module.
const KNOWN: &[(&str, &str)] = &[
    ("abstractmethod", "abc"),
    ("ABC", "abc"),
    ("ABCMeta", "abc"),
    ("dataclass", "dataclasses"),
    ("field", "dataclasses"),
    ("cache", "functools"),
    ("lru_cache", "functools"),
    ("cached_property", "functools"),
    ("wraps", "functools"),
    ("total_ordering", "functools"),
    ("singledispatch", "functools"),
    ("contextmanager", "contextlib"),
    ("asynccontextmanager", "contextlib"),
    ("Enum", "enum"),
    ("IntEnum", "enum"),
    ("Flag", "enum"),
    ("IntFlag", "enum"),
    ("unique", "enum"),
    ("auto", "enum"),
    ("NamedTuple", "typing"),
    ("TypedDict", "typing"),
    ("Protocol", "typing"),
    ("final", "typing"),
    ("overload", "typing"),
    ("runtime_checkable", "typing"),
];

/// Builtin classes a stub may name as bases as they are.
const BUILTIN_BASES: &[&str] = &[
    "object",
    "Exception",
    "BaseException",
    "ValueError",
    "TypeError",
    "KeyError",
    "IndexError",
    "LookupError",
    "RuntimeError",
    "AttributeError",
    "OSError",
    "IOError",
    "ArithmeticError",
    "NotImplementedError",
    "PermissionError",
    "FileNotFoundError",
    "TimeoutError",
    "ConnectionError",
    "Warning",
    "UserWarning",
    "DeprecationWarning",
    "int",
    "str",
    "float",
    "bytes",
    "dict",
    "list",
    "set",
    "tuple",
    "frozenset",
];

const ENUM_BASES: &[&str] = &["Enum", "IntEnum", "Flag", "IntFlag", "StrEnum"];

/// The stub module's source for `contract`.
pub fn generate(contract: &Contract) -> String {
    let mut g = Gen {
        module: &contract.module,
        imports: BTreeSet::new(),
        shims: BTreeSet::new(),
        defined: BTreeSet::new(),
        standins: BTreeSet::new(),
        body: String::new(),
    };
    for s in &contract.symbols {
        g.symbol(s, "", 0);
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# AECP stub for {}: the declared symbols and signatures, no behaviour.",
        contract.module
    );
    out.push_str(
        "# Generated from its contract so that consumers can import it while the producer works;\n\
         # the producer replaces this file with the implementation (without the marker below).\n",
    );
    out.push_str("from __future__ import annotations\n\n");
    for i in &g.imports {
        let _ = writeln!(out, "{i}");
    }
    let _ = writeln!(out, "\n{MARKER} = {}\n", py_str(&contract.module));
    if !g.shims.is_empty() {
        out.push_str(
            "\nclass _AecpStandIn:\n    \
             \"\"\"Stands in for a decorator the stub cannot import: it changes nothing.\"\"\"\n\n    \
             def __getattr__(self, name):\n        return self\n\n    \
             def __call__(self, *args, **kwargs):\n        \
             if len(args) == 1 and not kwargs and callable(args[0]):\n            \
             return args[0]\n        return self\n\n\n",
        );
        for s in &g.shims {
            let _ = writeln!(out, "{s} = _AecpStandIn()");
        }
    }
    for b in &g.standins {
        let _ = write!(
            out,
            "\n\nclass {b}:\n    \"\"\"AECP stand-in for a base the stub cannot import.\"\"\"\n"
        );
    }
    out.push('\n');
    out.push_str(&g.body);
    out
}

struct Gen<'c> {
    module: &'c str,
    imports: BTreeSet<String>,
    shims: BTreeSet<String>,
    /// Module-level classes emitted so far (usable as bases).
    defined: BTreeSet<String>,
    /// Bases the stub cannot import: defined as empty classes.
    standins: BTreeSet<String>,
    body: String,
}

/// A Python string literal.
fn py_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
}

impl Gen<'_> {
    /// Make the root name of a decorator expression resolvable.
    fn need_decorator(&mut self, text: &str) {
        let root: String = text
            .chars()
            .take_while(|c| *c == '_' || c.is_alphanumeric())
            .collect();
        if root.is_empty() || matches!(root.as_str(), "property" | "staticmethod" | "classmethod") {
            return;
        }
        if MODULES.contains(&root.as_str()) {
            self.imports.insert(format!("import {root}"));
        } else if let Some((_, m)) = KNOWN.iter().find(|(n, _)| *n == root) {
            self.imports.insert(format!("from {m} import {root}"));
        } else {
            self.shims.insert(root);
        }
    }

    /// A base as the stub can write it, or `None` to leave it out. A base the stub cannot
    /// import gets a stand-in class of the same name, so that the stub still runs and still
    /// names its declared bases.
    fn base(&mut self, text: &str) -> Option<String> {
        let head = text.split('[').next().unwrap_or(text).trim();
        let last = head.rsplit('.').next().unwrap_or(head);
        // `Generic[T]`: the type variables are not in the contract, and a plain `Generic`
        // base is an error; the verifier does not require it.
        if last == "Generic" {
            return None;
        }
        if head.contains('.') {
            let root = head.split('.').next().unwrap_or("");
            if MODULES.contains(&root) {
                self.imports.insert(format!("import {root}"));
                return Some(head.to_string());
            }
        } else if self.defined.contains(head) || BUILTIN_BASES.contains(&head) {
            return Some(head.to_string());
        } else if let Some((_, m)) = KNOWN.iter().find(|(n, _)| *n == head) {
            self.imports.insert(format!("from {m} import {head}"));
            return Some(head.to_string());
        }
        if !is_plain_name(last) {
            return None;
        }
        self.standins.insert(last.to_string());
        Some(last.to_string())
    }

    fn line(&mut self, depth: usize, text: &str) {
        for _ in 0..depth {
            self.body.push_str("    ");
        }
        self.body.push_str(text);
        self.body.push('\n');
    }

    fn symbol(&mut self, s: &Symbol, prefix: &str, depth: usize) {
        let path = if prefix.is_empty() {
            s.name.clone()
        } else {
            format!("{prefix}.{}", s.name)
        };
        match s.kind {
            SymbolKind::Class => self.class(s, &path, depth),
            SymbolKind::Attribute | SymbolKind::Constant => {
                let text = match (&s.annotation, depth) {
                    (Some(a), 0) => format!("{}: {a} = ...", s.name),
                    (None, 0) => format!("{} = ...", s.name),
                    (Some(a), _) => format!("{}: {a}", s.name),
                    (None, _) => format!("{} = None", s.name),
                };
                self.line(depth, &text);
            }
            _ => self.function(s, &path, depth),
        }
    }

    fn class(&mut self, s: &Symbol, path: &str, depth: usize) {
        self.body.push_str(if depth == 0 { "\n\n" } else { "\n" });
        for d in &s.decorators {
            self.need_decorator(d);
            self.line(depth, &format!("@{d}"));
        }
        let mut bases = Vec::new();
        for b in &s.bases {
            match self.base(b) {
                Some(x) => bases.push(x),
                None => self.line(depth, &format!("# base `{b}` left out")),
            }
        }
        let is_enum = s
            .bases
            .iter()
            .any(|b| ENUM_BASES.contains(&b.rsplit('.').next().unwrap_or(b)));
        let is_dataclass = s.decorators.iter().any(|d| {
            let callee = d.split('(').next().unwrap_or(d);
            callee.rsplit('.').next() == Some("dataclass")
        });
        let header = if bases.is_empty() {
            format!("class {}:", s.name)
        } else {
            format!("class {}({}):", s.name, bases.join(", "))
        };
        self.line(depth, &header);
        self.line(
            depth + 1,
            &format!("\"\"\"AECP stub: `{path}` as declared; not implemented yet.\"\"\""),
        );
        for m in &s.members {
            if is_enum && m.kind.is_data() {
                self.imports.insert("from enum import auto".to_string());
                self.line(depth + 1, &format!("{} = auto()", m.name));
            } else if is_dataclass && m.kind.is_data() && m.annotation.is_none() {
                self.line(depth + 1, &format!("{}: object", m.name));
            } else {
                self.symbol(m, path, depth + 1);
            }
        }
        if depth == 0 {
            self.defined.insert(s.name.clone());
        }
    }

    fn function(&mut self, s: &Symbol, path: &str, depth: usize) {
        self.body.push_str(if depth == 0 { "\n\n" } else { "\n" });
        match s.kind {
            SymbolKind::Property => self.line(depth, "@property"),
            SymbolKind::Staticmethod => self.line(depth, "@staticmethod"),
            SymbolKind::Classmethod => self.line(depth, "@classmethod"),
            _ => {}
        }
        for d in &s.decorators {
            self.need_decorator(d);
            self.line(depth, &format!("@{d}"));
        }
        let params = if s.kind == SymbolKind::Property {
            "self".to_string()
        } else if s.overloaded {
            "*args, **kwargs".to_string()
        } else {
            render_params(&s.params)
        };
        let ret = s
            .returns
            .as_ref()
            .map_or_else(String::new, |r| format!(" -> {r}"));
        let asyn = if s.is_async { "async " } else { "" };
        self.line(depth, &format!("{asyn}def {}({params}){ret}:", s.name));
        let raise = format!(
            "raise NotImplementedError({})",
            py_str(&format!(
                "AECP stub: {} declares `{path}`; its producer has not implemented it yet",
                self.module
            ))
        );
        self.line(depth + 1, &raise);
        if s.kind == SymbolKind::Property && s.setter {
            self.body.push('\n');
            self.line(depth, &format!("@{}.setter", s.name));
            self.line(depth, &format!("def {}(self, value) -> None:", s.name));
            self.line(depth + 1, &raise);
        }
    }
}

fn is_plain_name(s: &str) -> bool {
    super::is_identifier(s)
}

/// A parameter list as Python writes it, `/` and `*` included.
pub fn render_params(params: &[Param]) -> String {
    let mut out: Vec<String> = Vec::new();
    let last_pos_only = params
        .iter()
        .rposition(|p| p.kind == ParamKind::PositionalOnly);
    let has_var_positional = params.iter().any(|p| p.kind == ParamKind::VarPositional);
    let mut star_written = false;
    for (i, p) in params.iter().enumerate() {
        if p.kind == ParamKind::KeywordOnly && !has_var_positional && !star_written {
            out.push("*".to_string());
            star_written = true;
        }
        let ann = p
            .annotation
            .as_ref()
            .map_or_else(String::new, |a| format!(": {a}"));
        let stars = match p.kind {
            ParamKind::VarPositional => "*",
            ParamKind::VarKeyword => "**",
            _ => "",
        };
        let default = if p.default {
            if ann.is_empty() { "=..." } else { " = ..." }
        } else {
            ""
        };
        out.push(format!("{stars}{}{ann}{default}", p.name));
        if Some(i) == last_pos_only {
            out.push("/".to_string());
        }
    }
    out.join(", ")
}
