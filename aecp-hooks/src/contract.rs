//! Contract artifacts: a module's interface commitments, the two ways to declare them, the
//! stub a consumer imports meanwhile, and the static check of an implementation against them.
//!
//! A [`Contract`] names one module path (`pkg/acct.py`) and declares its [`Symbol`]s: functions,
//! classes (with their methods, properties and attributes, and nested classes), and module
//! constants, each with what a caller relies on — parameters (name, order, kind, whether a
//! default exists), async-ness, return annotation, the decorators that matter. Contracts are
//! declared as JSON (the serde form below, strict: unknown fields are refused) or as a Python
//! interface in stub syntax (`.pyi`, bodies `...`), which [`interface::parse`] turns into the
//! same model. Either way [`Contract::validate`] runs before a contract is used, so every later
//! step can rely on a well-formed model (unique names, a legal parameter order).
//!
//! [`stub::generate`] writes a Python module with the declared symbols and signatures and no
//! behaviour, marked by the module constant [`stub::MARKER`]; [`verify::verify`] parses a
//! module with tree-sitter (never running it) and reports an [`verify::Report`]: `ok`,
//! `mismatch`, `syntax` or `stub`. The verifier's rules, and what it cannot decide, are in
//! `docs/AECP.md` ("Contract artifacts").

pub mod annotation;
pub mod interface;
pub mod stub;
pub mod verify;

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

/// The version of the JSON form this crate reads and writes.
pub const FORMAT_VERSION: u32 = 1;

/// One module's interface commitments.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Contract {
    /// The JSON form's version: [`FORMAT_VERSION`].
    pub version: u32,
    /// The module's path in the workspace, relative, `/`-separated, ending in `.py`.
    pub module: String,
    /// The module-level symbols, in declaration order.
    pub symbols: Vec<Symbol>,
}

/// What a declared name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SymbolKind {
    /// A module-level `def`.
    Function,
    /// A `class`, at module level or nested in another class.
    Class,
    /// A plain `def` in a class body (called on an instance).
    Method,
    /// A `@property` in a class body (`returns` is the getter's annotation).
    Property,
    /// A `@classmethod`.
    Classmethod,
    /// A `@staticmethod`.
    Staticmethod,
    /// A data attribute: of a class (class body, dataclass field, `self.x =`) or a module.
    Attribute,
    /// A module-level (or class-level) named value.
    Constant,
}

impl SymbolKind {
    /// The kind's name in the JSON form and in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            SymbolKind::Function => "function",
            SymbolKind::Class => "class",
            SymbolKind::Method => "method",
            SymbolKind::Property => "property",
            SymbolKind::Classmethod => "classmethod",
            SymbolKind::Staticmethod => "staticmethod",
            SymbolKind::Attribute => "attribute",
            SymbolKind::Constant => "constant",
        }
    }

    /// Kinds that are `def`s and so have parameters.
    pub fn is_callable(self) -> bool {
        matches!(
            self,
            SymbolKind::Function
                | SymbolKind::Method
                | SymbolKind::Classmethod
                | SymbolKind::Staticmethod
        )
    }

    /// Kinds that only exist inside a class body.
    pub fn is_member_only(self) -> bool {
        matches!(
            self,
            SymbolKind::Method
                | SymbolKind::Property
                | SymbolKind::Classmethod
                | SymbolKind::Staticmethod
        )
    }

    /// Data kinds (a name bound to a value).
    pub fn is_data(self) -> bool {
        matches!(self, SymbolKind::Attribute | SymbolKind::Constant)
    }
}

/// One declared name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Symbol {
    /// The plain name (`deposit`), not dotted: nesting is expressed by `members`.
    pub name: String,
    /// What it is.
    pub kind: SymbolKind,
    /// `async def` (callables only).
    #[serde(default, rename = "async", skip_serializing_if = "is_false")]
    pub is_async: bool,
    /// Parameters in order, `self`/`cls` included (callables only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub params: Vec<Param>,
    /// Return annotation as written (callables and properties).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub returns: Option<String>,
    /// Type annotation (attributes and constants).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotation: Option<String>,
    /// Decorators the implementation must carry, as written without `@`
    /// (`functools.lru_cache(maxsize=None)`, `dataclass`). The kind's own decorators
    /// (`@property`, `@staticmethod`, `@classmethod`, `@x.setter`) are not listed here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decorators: Vec<String>,
    /// A property with a setter (properties only).
    #[serde(default, skip_serializing_if = "is_false")]
    pub setter: bool,
    /// Declared by `@overload` signatures only: existence, kind and async-ness are checked,
    /// the parameters are not (callables only).
    #[serde(default, skip_serializing_if = "is_false")]
    pub overloaded: bool,
    /// Base classes as written (classes only): the implementation must derive from each
    /// (directly or through the module's own classes); the stub uses them where it can.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bases: Vec<String>,
    /// Methods, properties, attributes and nested classes (classes only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<Symbol>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// How an argument binds to a parameter (Python's `inspect.Parameter.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamKind {
    /// Before `/`.
    PositionalOnly,
    /// The ordinary kind.
    PositionalOrKeyword,
    /// `*args`.
    VarPositional,
    /// After `*` or `*args`.
    KeywordOnly,
    /// `**kwargs`.
    VarKeyword,
}

impl ParamKind {
    /// The kind's name in the JSON form and in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            ParamKind::PositionalOnly => "positional_only",
            ParamKind::PositionalOrKeyword => "positional_or_keyword",
            ParamKind::VarPositional => "var_positional",
            ParamKind::KeywordOnly => "keyword_only",
            ParamKind::VarKeyword => "var_keyword",
        }
    }

    /// Positional-only or positional-or-keyword.
    pub fn is_positional(self) -> bool {
        matches!(
            self,
            ParamKind::PositionalOnly | ParamKind::PositionalOrKeyword
        )
    }
}

/// One parameter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Param {
    /// Its name (for `*args`/`**kwargs`, without the stars).
    pub name: String,
    /// How arguments bind to it.
    pub kind: ParamKind,
    /// Whether it has a default value (the value itself is not part of the contract).
    #[serde(default, skip_serializing_if = "is_false")]
    pub default: bool,
    /// Its annotation as written; carried into stubs, not compared by the verifier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotation: Option<String>,
}

/// Why a contract (JSON or interface) was refused. Positions are 1-based.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    /// The JSON did not parse into the model (unknown field, wrong type, bad syntax).
    #[error("contract JSON, line {line} column {column}: {message}")]
    Json {
        line: usize,
        column: usize,
        message: String,
    },
    /// The interface file is not valid Python.
    #[error("interface, line {line} column {column}: syntax error: {what}")]
    Syntax {
        line: u32,
        column: u32,
        what: String,
    },
    /// The interface file holds something an interface cannot declare.
    #[error("interface, line {line} column {column}: {reason}")]
    Interface {
        line: u32,
        column: u32,
        reason: String,
    },
    /// The model is not well formed.
    #[error("contract for {module}: {symbol}: {reason}")]
    Invalid {
        module: String,
        symbol: String,
        reason: String,
    },
    /// The contract's version is not one this build reads.
    #[error(
        "contract version {found} is not supported (this build reads version {FORMAT_VERSION})"
    )]
    Version { found: u32 },
    /// The module path is not a relative `.py` path inside the workspace.
    #[error(
        "module path `{module}`: {reason} (write it relative to the workspace, e.g. pkg/acct.py)"
    )]
    ModulePath {
        module: String,
        reason: &'static str,
    },
}

impl Contract {
    /// Parse and validate the JSON form.
    pub fn from_json(text: &str) -> Result<Contract, ContractError> {
        let c: Contract = serde_json::from_str(text).map_err(|e| ContractError::Json {
            line: e.line(),
            column: e.column(),
            message: strip_position(&e.to_string()),
        })?;
        c.validate()?;
        Ok(c)
    }

    /// The JSON form (pretty-printed).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Check the model: version, module path, identifiers, unique names per scope, which
    /// fields each kind may carry, and a legal parameter list.
    pub fn validate(&self) -> Result<(), ContractError> {
        if self.version != FORMAT_VERSION {
            return Err(ContractError::Version {
                found: self.version,
            });
        }
        check_module_path(&self.module)?;
        self.check_scope(&self.symbols, "", false)
    }

    fn invalid(&self, symbol: &str, reason: impl Into<String>) -> ContractError {
        ContractError::Invalid {
            module: self.module.clone(),
            symbol: if symbol.is_empty() {
                "(module)".to_string()
            } else {
                symbol.to_string()
            },
            reason: reason.into(),
        }
    }

    fn check_scope(
        &self,
        symbols: &[Symbol],
        prefix: &str,
        in_class: bool,
    ) -> Result<(), ContractError> {
        let mut seen = HashSet::new();
        for s in symbols {
            let path = if prefix.is_empty() {
                s.name.clone()
            } else {
                format!("{prefix}.{}", s.name)
            };
            if !is_identifier(&s.name) {
                return Err(self.invalid(&path, "the name is not a Python identifier"));
            }
            if !seen.insert(s.name.as_str()) {
                return Err(self.invalid(&path, "declared twice in the same scope"));
            }
            if s.kind.is_member_only() && !in_class {
                return Err(self.invalid(
                    &path,
                    format!(
                        "a {} is declared inside a class (use kind `function` at module level)",
                        s.kind.as_str()
                    ),
                ));
            }
            if in_class && s.kind == SymbolKind::Function {
                return Err(self.invalid(
                    &path,
                    "inside a class, declare `method`, `classmethod` or `staticmethod`",
                ));
            }
            if !s.kind.is_callable() {
                if !s.params.is_empty() {
                    return Err(self.invalid(&path, format!("a {} has no params", s.kind.as_str())));
                }
                if s.is_async {
                    return Err(
                        self.invalid(&path, format!("a {} cannot be async", s.kind.as_str()))
                    );
                }
                if s.overloaded {
                    return Err(self.invalid(&path, "only callables are overloaded"));
                }
            }
            if s.returns.is_some() && !(s.kind.is_callable() || s.kind == SymbolKind::Property) {
                return Err(self.invalid(
                    &path,
                    format!(
                        "a {} has no return annotation (use `annotation`)",
                        s.kind.as_str()
                    ),
                ));
            }
            if s.annotation.is_some() && !s.kind.is_data() {
                return Err(self.invalid(
                    &path,
                    format!("a {} has no `annotation` (use `returns`)", s.kind.as_str()),
                ));
            }
            if s.setter && s.kind != SymbolKind::Property {
                return Err(self.invalid(&path, "only a property has a setter"));
            }
            if s.kind != SymbolKind::Class && (!s.members.is_empty() || !s.bases.is_empty()) {
                return Err(self.invalid(&path, "only a class has members and bases"));
            }
            if s.kind.is_data() && !s.decorators.is_empty() {
                return Err(self.invalid(&path, "an attribute or constant has no decorators"));
            }
            for d in &s.decorators {
                if !fragment_ok(Fragment::Decorator, d) {
                    return Err(self.invalid(
                        &path,
                        format!(
                            "decorator `{d}`: write one Python expression as in the source, \
                             without `@`, on one line"
                        ),
                    ));
                }
                // A decorator the verifier can match is a (dotted) name, optionally called
                // (`property`, `functools.lru_cache(maxsize=None)`); `a @ b` is not.
                // No space inside the dotted name: the verifier compares it as written, so
                // `functools. lru_cache` would never match a definition's decorator.
                let head = d.split('(').next().unwrap_or(d).trim();
                if !head.split('.').all(is_identifier) {
                    return Err(self.invalid(
                        &path,
                        format!("decorator `{d}`: name it (`name`, `mod.name`, `mod.name(…)`)"),
                    ));
                }
            }
            let annotations = s
                .returns
                .iter()
                .chain(&s.annotation)
                .chain(s.params.iter().filter_map(|p| p.annotation.as_ref()));
            for a in annotations {
                if !fragment_ok(Fragment::Annotation, a) {
                    return Err(self.invalid(
                        &path,
                        format!("annotation `{a}`: write one Python expression on one line"),
                    ));
                }
            }
            for b in &s.bases {
                if !fragment_ok(Fragment::Base, b) {
                    return Err(self.invalid(
                        &path,
                        format!("base `{b}`: write one Python expression on one line"),
                    ));
                }
                // A base the verifier can check is a class named by a (dotted) name,
                // optionally subscripted (`Generic[T]`); `A @ B` or a call is not.
                let head = b.split('[').next().unwrap_or(b).trim();
                if !head.split('.').all(|part| is_identifier(part.trim())) {
                    return Err(self.invalid(
                        &path,
                        format!("base `{b}`: name the class (`Base`, `mod.Base`, `Generic[T]`)"),
                    ));
                }
            }
            if s.kind.is_callable() && !s.overloaded {
                check_params(&s.params).map_err(|r| self.invalid(&path, r))?;
                if matches!(s.kind, SymbolKind::Method | SymbolKind::Classmethod)
                    && !s.params.first().is_some_and(|p| p.kind.is_positional())
                {
                    return Err(self.invalid(
                        &path,
                        format!(
                            "a {} takes `{}` as its first, positional parameter",
                            s.kind.as_str(),
                            if s.kind == SymbolKind::Method {
                                "self"
                            } else {
                                "cls"
                            }
                        ),
                    ));
                }
            }
            if s.kind == SymbolKind::Class {
                self.check_scope(&s.members, &path, true)?;
            }
        }
        Ok(())
    }

    /// Every symbol with its dotted path (`Account.deposit`), depth first, in order.
    pub fn walk(&self) -> Vec<(String, &Symbol)> {
        fn go<'c>(out: &mut Vec<(String, &'c Symbol)>, prefix: &str, syms: &'c [Symbol]) {
            for s in syms {
                let path = if prefix.is_empty() {
                    s.name.clone()
                } else {
                    format!("{prefix}.{}", s.name)
                };
                out.push((path.clone(), s));
                go(out, &path, &s.members);
            }
        }
        let mut out = Vec::new();
        go(&mut out, "", &self.symbols);
        out
    }
}

#[derive(Clone, Copy)]
enum Fragment {
    Annotation,
    Decorator,
    Base,
}

/// A piece of Python the stub writes verbatim (an annotation, a decorator, a base) is one
/// expression on one line: nothing in a contract can smuggle statements into a stub.
fn fragment_ok(kind: Fragment, text: &str) -> bool {
    if text.trim().is_empty() || text.contains(['\n', '\r', '\0']) || text.starts_with('@') {
        return false;
    }
    let source = match kind {
        Fragment::Annotation => format!("_x: {text}\n"),
        Fragment::Decorator => format!("@{text}\ndef _f(): ...\n"),
        Fragment::Base => format!("class _C({text}): ...\n"),
    };
    let m = crate::python::Module::parse(&source);
    if m.syntax_error().is_some() {
        return false;
    }
    let stmts = crate::python::children(m.root());
    let [stmt] = stmts.as_slice() else {
        return false;
    };
    match kind {
        Fragment::Annotation => {
            stmt.kind() == "expression_statement"
                && crate::python::children(*stmt)
                    .first()
                    .and_then(|a| a.child_by_field_name("type"))
                    .is_some_and(|t| t.end_byte() == source.len() - 1)
        }
        Fragment::Decorator => {
            stmt.kind() == "decorated_definition"
                && crate::python::children(*stmt)
                    .iter()
                    .filter(|c| c.kind() == "decorator")
                    .count()
                    == 1
        }
        Fragment::Base => stmt
            .child_by_field_name("superclasses")
            .is_some_and(|a| crate::python::children(a).len() == 1),
    }
}

/// serde_json appends " at line L column C"; the error variant carries them as fields.
fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}

fn check_module_path(module: &str) -> Result<(), ContractError> {
    let bad = |reason| {
        Err(ContractError::ModulePath {
            module: module.to_string(),
            reason,
        })
    };
    if module.is_empty() {
        return bad("it is empty");
    }
    if module.starts_with('/') || module.contains('\\') {
        return bad("it must be relative and `/`-separated");
    }
    if !module.ends_with(".py") {
        return bad("a Python module path ends in `.py`");
    }
    if module
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return bad("no empty, `.` or `..` components");
    }
    Ok(())
}

/// Parameter order and defaults as Python allows them in a `def`.
fn check_params(params: &[Param]) -> Result<(), String> {
    let mut names = HashSet::new();
    let mut last = ParamKind::PositionalOnly;
    let mut positional_default = false;
    for p in params {
        if !is_identifier(&p.name) {
            return Err(format!("parameter `{}` is not a Python identifier", p.name));
        }
        if !names.insert(p.name.as_str()) {
            return Err(format!("parameter `{}` is declared twice", p.name));
        }
        if p.kind < last {
            return Err(format!(
                "parameter `{}` ({}) comes after a {} parameter; the order is positional_only, \
                 positional_or_keyword, var_positional, keyword_only, var_keyword",
                p.name,
                p.kind.as_str(),
                last.as_str()
            ));
        }
        if p.kind == last && matches!(p.kind, ParamKind::VarPositional | ParamKind::VarKeyword) {
            return Err(format!("only one {} parameter is allowed", p.kind.as_str()));
        }
        last = p.kind;
        match p.kind {
            ParamKind::PositionalOnly | ParamKind::PositionalOrKeyword => {
                if p.default {
                    positional_default = true;
                } else if positional_default {
                    return Err(format!(
                        "parameter `{}` has no default but follows one that has",
                        p.name
                    ));
                }
            }
            ParamKind::VarPositional | ParamKind::VarKeyword => {
                if p.default {
                    return Err(format!(
                        "`{}` ({}) cannot have a default",
                        p.name,
                        p.kind.as_str()
                    ));
                }
            }
            ParamKind::KeywordOnly => {}
        }
    }
    Ok(())
}

/// A Python identifier (ASCII letters, digits, `_`, or any non-ASCII letter), not a keyword.
pub fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    let Some(first) = chars.next() else {
        return false;
    };
    (first == '_' || first.is_alphabetic())
        && chars.all(|c| c == '_' || c.is_alphanumeric())
        && !KEYWORDS.contains(&s)
}

const KEYWORDS: &[&str] = &[
    "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class", "continue",
    "def", "del", "elif", "else", "except", "finally", "for", "from", "global", "if", "import",
    "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return", "try", "while",
    "with", "yield",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn minimal(symbols: &str) -> String {
        format!(r#"{{"version":1,"module":"pkg/acct.py","symbols":{symbols}}}"#)
    }

    #[test]
    fn json_round_trip() {
        let text = minimal(
            r#"[{"name":"Account","kind":"class","members":[
                {"name":"balance","kind":"attribute","annotation":"int"},
                {"name":"deposit","kind":"method","params":[
                    {"name":"self","kind":"positional_or_keyword"},
                    {"name":"amount","kind":"positional_or_keyword","annotation":"int"},
                    {"name":"note","kind":"keyword_only","default":true}],
                 "returns":"int"}]},
               {"name":"open_account","kind":"function","async":true,"params":[],"returns":"Account"}]"#,
        );
        let c = Contract::from_json(&text).unwrap();
        assert_eq!(c.symbols.len(), 2);
        assert!(c.symbols[1].is_async);
        let back = Contract::from_json(&c.to_json()).unwrap();
        assert_eq!(back, c);
        let paths: Vec<_> = c.walk().into_iter().map(|(p, _)| p).collect();
        assert_eq!(
            paths,
            [
                "Account",
                "Account.balance",
                "Account.deposit",
                "open_account"
            ]
        );
    }

    // An unknown field is a typo the producer must hear about, not something to ignore.
    #[test]
    fn unknown_field_is_refused_with_its_position() {
        let text = minimal(r#"[{"name":"f","kind":"function","retruns":"int"}]"#);
        let e = Contract::from_json(&text).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("retruns"), "{msg}");
        assert!(matches!(e, ContractError::Json { line: 1, .. }), "{e:?}");
    }

    #[test]
    fn bad_models_are_refused() {
        let cases = [
            (
                r#"[{"name":"f","kind":"method","params":[{"name":"self","kind":"positional_or_keyword"}]}]"#,
                "inside a class",
            ),
            (
                r#"[{"name":"f","kind":"function"},{"name":"f","kind":"constant"}]"#,
                "twice",
            ),
            (
                r#"[{"name":"f","kind":"function","params":[{"name":"a","kind":"keyword_only"},{"name":"b","kind":"positional_or_keyword"}]}]"#,
                "comes after",
            ),
            (
                r#"[{"name":"f","kind":"function","params":[{"name":"a","kind":"positional_or_keyword","default":true},{"name":"b","kind":"positional_or_keyword"}]}]"#,
                "follows one",
            ),
            (
                r#"[{"name":"C","kind":"class","members":[{"name":"m","kind":"method"}]}]"#,
                "first, positional",
            ),
            (r#"[{"name":"class","kind":"function"}]"#, "identifier"),
            (
                r#"[{"name":"X","kind":"constant","params":[{"name":"a","kind":"positional_or_keyword"}]}]"#,
                "no params",
            ),
        ];
        for (symbols, want) in cases {
            let e = Contract::from_json(&minimal(symbols))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{symbols}: {e}");
        }
    }

    #[test]
    fn module_path_and_version_are_checked() {
        for m in ["/abs.py", "../up.py", "pkg/acct", "", "a//b.py"] {
            let t = format!(r#"{{"version":1,"module":"{m}","symbols":[]}}"#);
            assert!(
                matches!(
                    Contract::from_json(&t),
                    Err(ContractError::ModulePath { .. })
                ),
                "{m}"
            );
        }
        let t = r#"{"version":2,"module":"a.py","symbols":[]}"#;
        assert!(matches!(
            Contract::from_json(t),
            Err(ContractError::Version { found: 2 })
        ));
    }
}
