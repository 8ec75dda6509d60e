//! The static verifier: does a Python module keep a contract? tree-sitter reads the source;
//! nothing is imported or run.
//!
//! How a module is read (the rules are documented for users in `docs/AECP.md`):
//!
//! * Names are bound by `def`, `class`, assignments (`x = …`, `x: T`, `x: T = …`), and
//!   imports, in the module body and in the bodies of `if`/`try`/`with`/`for`/`while`. A
//!   binding at the top level of a scope replaces the earlier ones (the later definition
//!   wins); bindings inside a branch are alternatives, and a symbol passes if one of them
//!   keeps the contract. The body of `if TYPE_CHECKING:` does not run, so it binds nothing.
//! * Declared bases must be derived from (directly, through local classes, or through a
//!   builtin known to derive from them).
//! * Class members come from the class body, from `self.x = …` in any method (attributes),
//!   `__slots__`, and from bases defined in the same module (looked up recursively). A base
//!   imported from elsewhere might define the member: then a missing member is a note.
//! * Some bindings cannot be judged without running code — an assignment of a callable
//!   (`foo = _impl`), a name bound by an import, `from x import *`, a module or class
//!   `__getattr__`, `setattr`, `globals()`, a parameter list that a `*args`/`**kwargs`
//!   could absorb. Those are `ok` with a note, never a violation.
//!
//! The verdict is `syntax` if the file does not parse — as CPython's `ast.parse` would say
//! for the newest Python the check knows ([`crate::python::syntax_error`]: Ruff's parser
//! plus CPython's indentation rules) — else `mismatch` if any rule is broken,
//! else `stub` if a stub is left (the marker constant, or a contracted body that is only
//! `...` or `raise NotImplementedError`), else `ok`.

use serde::{Deserialize, Serialize};
use tree_sitter::Node;

mod params;
mod read;

use super::{Contract, Param, Symbol, SymbolKind, annotation, stub};
use crate::python::{self, Definition, Module};
use read::{Binding, Bound, Class, Dynamic, NEUTRAL_BASES, Scope, dataclass_init};

/// The verifier's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The module keeps the contract (perhaps with notes on what could not be decided).
    Ok,
    /// At least one provable violation.
    Mismatch,
    /// The module does not parse.
    Syntax,
    /// No violation, but a stub is left where the implementation should be.
    Stub,
}

impl Verdict {
    /// The verdict's name in the JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Mismatch => "mismatch",
            Verdict::Syntax => "syntax",
            Verdict::Stub => "stub",
        }
    }
}

/// Which rule a violation breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Constraint {
    /// The file does not parse (line and column given).
    Syntax,
    /// A declared symbol is not defined.
    Missing,
    /// Defined as another kind (a method where a property is declared, …).
    Kind,
    /// `async def` where a plain `def` is declared, or the reverse.
    Async,
    /// A declared decorator is absent.
    Decorator,
    /// Parameters differ in name, order, kind or default presence, or an extra one is required.
    Parameters,
    /// The return annotation differs (or is absent).
    Return,
    /// An attribute's or constant's annotation differs.
    Annotation,
    /// A property declared with a setter has none.
    Setter,
    /// A class does not derive from a declared base.
    Base,
    /// A stub is left: the marker, or a body that is only `...`/`raise NotImplementedError`.
    Stub,
}

/// One broken rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// The dotted symbol (`Account.deposit`); for the stub marker, `__aecp_stub__`; for a
    /// syntax error, the module path.
    pub symbol: String,
    /// The rule.
    pub constraint: Constraint,
    /// The 1-based line in the verified file (`null` when the symbol is absent at module level).
    pub line: Option<u32>,
    /// The 1-based column (syntax errors only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub column: Option<u32>,
    /// What is wrong, in a sentence.
    pub detail: String,
}

/// What the verifier found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub verdict: Verdict,
    pub violations: Vec<Violation>,
    /// What could not be decided statically (never a reason for a non-`ok` verdict).
    pub notes: Vec<String>,
}

/// Check `source` (the module's text) against `contract`.
pub fn verify(contract: &Contract, source: &str) -> Report {
    let m = Module::parse(source);
    if let Some(e) = m.syntax_error() {
        return Report {
            verdict: Verdict::Syntax,
            violations: vec![Violation {
                symbol: contract.module.clone(),
                constraint: Constraint::Syntax,
                line: Some(e.line),
                column: Some(e.column),
                detail: format!("syntax error: {}", e.what),
            }],
            notes: Vec::new(),
        };
    }
    let mut v = Verifier {
        m: &m,
        violations: Vec::new(),
        notes: Vec::new(),
        module: Scope::read(&m, m.root()),
        dynamic: Dynamic::scan(&m),
    };
    if let Some(b) = v.module.names.get(stub::MARKER).and_then(|b| b.last()) {
        v.violations.push(Violation {
            symbol: stub::MARKER.to_string(),
            constraint: Constraint::Stub,
            line: Some(b.line),
            column: None,
            detail: format!("the stub marker `{}` is still defined", stub::MARKER),
        });
    }
    for sym in &contract.symbols {
        v.check_module_symbol(sym);
    }
    let verdict = if v
        .violations
        .iter()
        .any(|x| x.constraint != Constraint::Stub)
    {
        Verdict::Mismatch
    } else if v.violations.is_empty() {
        Verdict::Ok
    } else {
        Verdict::Stub
    };
    Report {
        verdict,
        violations: v.violations,
        notes: v.notes,
    }
}

/// Where a member was found.
enum Found<'t> {
    /// In the class itself (`None`) or in a base defined in the module.
    Bindings(Vec<Binding<'t>>, Option<Box<Class<'t>>>),
    SelfAttr(u32, Option<String>),
    Slot,
    Synthesized(Vec<Param>, u32),
    Unknown(String),
    Missing,
}

struct Verifier<'t> {
    m: &'t Module,
    violations: Vec<Violation>,
    notes: Vec<String>,
    module: Scope<'t>,
    dynamic: Dynamic,
}

/// The evaluation of one candidate binding: its violations and notes.
#[derive(Default)]
struct Outcome {
    violations: Vec<Violation>,
    notes: Vec<String>,
}

impl Outcome {
    fn mismatches(&self) -> usize {
        self.violations
            .iter()
            .filter(|v| v.constraint != Constraint::Stub)
            .count()
    }
}

fn violation(path: &str, c: Constraint, line: Option<u32>, detail: String) -> Violation {
    Violation {
        symbol: path.to_string(),
        constraint: c,
        line,
        column: None,
        detail,
    }
}

impl<'t> Verifier<'t> {
    fn check_module_symbol(&mut self, sym: &Symbol) {
        let path = sym.name.clone();
        match self.module.names.get(&sym.name).cloned() {
            Some(b) => self.choose(&path, sym, &b, None),
            None => {
                let reason = if self.module.star_import {
                    Some("the module has `from … import *`".to_string())
                } else if self.module.names.contains_key("__getattr__") {
                    Some("the module defines `__getattr__`".to_string())
                } else {
                    self.dynamic
                        .module
                        .as_ref()
                        .map(|d| format!("the module uses {d}"))
                };
                match reason {
                    Some(r) => self.notes.push(format!(
                        "{path}: not defined in the file; {r}, so it may exist at run time"
                    )),
                    None => self.violations.push(violation(
                        &path,
                        Constraint::Missing,
                        None,
                        format!("`{path}` ({}) is not defined", sym.kind.as_str()),
                    )),
                }
            }
        }
    }

    /// Pick among alternative bindings: the first that keeps the contract, else the one with
    /// the fewest mismatches (the last, on a tie).
    fn choose(
        &mut self,
        path: &str,
        sym: &Symbol,
        bindings: &[Binding<'t>],
        class: Option<&Class<'t>>,
    ) {
        let mut best: Option<Outcome> = None;
        for b in bindings {
            let o = self.evaluate(path, sym, *b, class);
            if o.violations.is_empty() {
                if bindings.len() > 1 {
                    self.notes.push(format!(
                        "{path}: defined {} times in alternative branches; line {} keeps the contract",
                        bindings.len(),
                        b.line
                    ));
                }
                self.notes.extend(o.notes);
                return;
            }
            if best
                .as_ref()
                .is_none_or(|x| o.mismatches() <= x.mismatches())
            {
                best = Some(o);
            }
        }
        if let Some(o) = best {
            self.violations.extend(o.violations);
            self.notes.extend(o.notes);
        }
    }

    fn evaluate(
        &self,
        path: &str,
        sym: &Symbol,
        b: Binding<'t>,
        class: Option<&Class<'t>>,
    ) -> Outcome {
        let mut o = Outcome::default();
        let m = self.m;
        match b.bound {
            Bound::Import => o.notes.push(format!(
                "{path}: bound by an import on line {}; its definition is not in this file",
                b.line
            )),
            Bound::Assign { annotation, value } => {
                self.check_assigned(path, sym, b.line, annotation, value, class, &mut o)
            }
            Bound::Def(def) if !def.is_function() => {
                if sym.kind == SymbolKind::Class {
                    self.check_class(path, sym, def, &mut o);
                } else if !sym.kind.is_data() {
                    o.violations.push(violation(
                        path,
                        Constraint::Kind,
                        Some(b.line),
                        format!("declared as a {}, defined as a class", sym.kind.as_str()),
                    ));
                }
            }
            Bound::Def(def) => {
                let decorators = def.decorators(m);
                let found = def_kind(&decorators, class.is_some());
                let want = sym.kind;
                let compatible = found == want
                    || (want.is_data() && found == SymbolKind::Property)
                    || (want.is_data()
                        && sym
                            .annotation
                            .as_deref()
                            .is_some_and(|a| a.contains("Callable")));
                if !compatible {
                    o.violations.push(violation(
                        path,
                        Constraint::Kind,
                        Some(b.line),
                        format!(
                            "declared as a {}, defined as a {}",
                            want.as_str(),
                            found.as_str()
                        ),
                    ));
                    return o;
                }
                if want.is_data() {
                    return o;
                }
                self.check_def(path, sym, def, &decorators, class, &mut o);
            }
        }
        o
    }

    #[allow(clippy::too_many_arguments)]
    fn check_assigned(
        &self,
        path: &str,
        sym: &Symbol,
        line: u32,
        ann: Option<Node<'t>>,
        value: Option<Node<'t>>,
        class: Option<&Class<'t>>,
        o: &mut Outcome,
    ) {
        let m = self.m;
        if sym.kind.is_data() {
            if let (Some(want), Some(have)) = (&sym.annotation, ann) {
                self.compare_data_annotation(path, want, m.text(have), line, o);
            }
            return;
        }
        if let Some(lambda) = value.filter(|v| v.kind() == "lambda")
            && sym.kind.is_callable()
            && !sym.overloaded
        {
            let params = lambda
                .child_by_field_name("parameters")
                .map(|p| python::params_of(m, p))
                .unwrap_or_default();
            let receiver = class.is_some() && sym.kind != SymbolKind::Staticmethod;
            params::compare_params(path, &sym.params, &params, receiver, line, o);
            if sym.returns.is_some() || sym.is_async {
                o.notes.push(format!(
                        "{path}: a lambda (line {line}) has no annotations; its return and async-ness are not checked"
                    ));
            }
            return;
        }
        let what = value.map_or_else(
            || "an annotation".to_string(),
            |v| {
                let t = python::collapse_ws(m.text(v));
                let short: String = t.chars().take(40).collect();
                format!("`{short}`")
            },
        );
        o.notes.push(format!(
            "{path}: declared as a {}, bound to {what} on line {line}; not checkable statically",
            sym.kind.as_str()
        ));
    }

    fn compare_data_annotation(
        &self,
        path: &str,
        want: &str,
        have: &str,
        line: u32,
        o: &mut Outcome,
    ) {
        let (Some(w), Some(h)) = (data_type(want), data_type(have)) else {
            return;
        };
        if !annotation::same(&w, &h) {
            o.violations.push(violation(
                path,
                Constraint::Annotation,
                Some(line),
                format!(
                    "annotated `{}`, declared `{want}`",
                    python::collapse_ws(have)
                ),
            ));
        }
    }

    fn check_def(
        &self,
        path: &str,
        sym: &Symbol,
        def: Definition<'t>,
        decorators: &[python::Decorator],
        class: Option<&Class<'t>>,
        o: &mut Outcome,
    ) {
        let m = self.m;
        let line = def.line(m);
        // An async generator is declared `def f() -> AsyncIterator[T]` in stubs and written
        // `async def f(): … yield …`: the same thing to a caller.
        let async_iterator = sym.returns.as_deref().is_some_and(|r| {
            let head = r
                .trim_matches(|c| c == '"' || c == '\'')
                .split('[')
                .next()
                .unwrap_or(r);
            matches!(
                python::last_part(head.trim()),
                "AsyncIterator" | "AsyncGenerator" | "AsyncIterable"
            )
        });
        if sym.is_async != def.is_async() && !(async_iterator && def.is_async()) {
            o.violations.push(violation(
                path,
                Constraint::Async,
                Some(line),
                if sym.is_async {
                    "declared `async def`, defined with `def`".to_string()
                } else {
                    "declared `def`, defined with `async def`".to_string()
                },
            ));
        }
        check_decorators(path, &sym.decorators, decorators, line, o);
        if sym.kind.is_callable() && !sym.overloaded {
            let receiver = matches!(sym.kind, SymbolKind::Method | SymbolKind::Classmethod);
            params::compare_params(path, &sym.params, &def.params(m), receiver, line, o);
        }
        if let Some(want) = &sym.returns {
            let have = def
                .returns(m)
                .or_else(|| python::type_comment_return(m, def.node));
            match have {
                // An unannotated `def` returning nothing (`__init__` above all) is the
                // common way to write `-> None`; it contradicts nothing.
                None if annotation::same(want, "None") => o.notes.push(format!(
                    "{path}: declared `-> None`, defined without a return annotation (line {line})"
                )),
                None => o.violations.push(violation(
                    path,
                    Constraint::Return,
                    Some(line),
                    format!("declared `-> {want}`, defined without a return annotation"),
                )),
                Some(h) if !annotation::same(want, &h) => o.violations.push(violation(
                    path,
                    Constraint::Return,
                    Some(line),
                    format!("returns `{h}`, declared `-> {want}`"),
                )),
                Some(_) => {}
            }
        }
        if sym.kind == SymbolKind::Property
            && sym.setter
            && let Some(c) = class
            && !c.scope.setters.contains(&sym.name)
        {
            o.violations.push(violation(
                path,
                Constraint::Setter,
                Some(line),
                format!("declared settable, but there is no `@{}.setter`", sym.name),
            ));
        }
        let exempt = class.is_some_and(|c| c.abstract_ok)
            || decorators
                .iter()
                .any(|d| matches!(d.name(), "abstractmethod" | "overload" | "abstractproperty"));
        if !exempt && is_stub_body(m, def) {
            o.violations.push(violation(
                path,
                Constraint::Stub,
                Some(line),
                "the body is only `...` or `raise NotImplementedError`: a stub is left".to_string(),
            ));
        }
    }

    fn check_class(&self, path: &str, sym: &Symbol, def: Definition<'t>, o: &mut Outcome) {
        let m = self.m;
        let class = Class::read(m, def);
        check_decorators(path, &sym.decorators, &class.decorators, def.line(m), o);
        for base in &sym.bases {
            match self.has_base(&class, base, 0) {
                Some(true) => {}
                Some(false) => o.violations.push(violation(
                    path,
                    Constraint::Base,
                    Some(def.line(m)),
                    format!("declared with base `{base}`, which the class does not derive from"),
                )),
                None => o.notes.push(format!(
                    "{path}: declared with base `{base}`; it may come through a base not defined in this file"
                )),
            }
        }
        for member in &sym.members {
            let mpath = format!("{path}.{}", member.name);
            match self.find_member(&class, &member.name, 0) {
                Found::Bindings(b, base) => {
                    let owner = base.as_deref().unwrap_or(&class);
                    let mut best: Option<Outcome> = None;
                    for binding in &b {
                        let r = self.evaluate(&mpath, member, *binding, Some(owner));
                        if r.violations.is_empty() {
                            best = Some(r);
                            break;
                        }
                        if best.as_ref().is_none_or(|x| r.mismatches() <= x.mismatches()) {
                            best = Some(r);
                        }
                    }
                    if let Some(r) = best {
                        o.violations.extend(r.violations);
                        o.notes.extend(r.notes);
                    }
                }
                Found::SelfAttr(line, ann) => match member.kind {
                    k if k.is_data() => {
                        if let (Some(w), Some(h)) = (&member.annotation, ann) {
                            self.compare_data_annotation(&mpath, w, &h, line, o);
                        }
                    }
                    _ => o.notes.push(format!(
                        "{mpath}: declared as a {}, assigned as `self.{}` on line {line}; not checkable statically",
                        member.kind.as_str(),
                        member.name
                    )),
                },
                Found::Slot => {}
                Found::Synthesized(params, line) => {
                    let mut r = Outcome::default();
                    params::compare_params(&mpath, &member.params, &params, true, line, &mut r);
                    o.violations.extend(r.violations);
                    o.notes.extend(r.notes);
                }
                Found::Unknown(why) => o.notes.push(format!(
                    "{mpath}: not defined in the class body; {why}, so it may exist at run time"
                )),
                // `object.__init__(self)`: declaring a constructor without parameters is
                // kept by a class that defines none.
                Found::Missing if member.name == "__init__" && member.params.len() <= 1 => {}
                // Every class has these from `object` (a dataclass generates some of them):
                // the name exists, whether it behaves as declared is not a static question.
                Found::Missing if OBJECT_DUNDERS.contains(&member.name.as_str()) => {
                    o.notes.push(format!(
                        "{mpath}: not defined in the class; `{}` is inherited from `object`",
                        member.name
                    ));
                }
                Found::Missing => o.violations.push(violation(
                    &mpath,
                    Constraint::Missing,
                    Some(class.def.line(m)),
                    format!(
                        "`{}` ({}) is not defined in class `{}`",
                        member.name,
                        member.kind.as_str(),
                        class.name
                    ),
                )),
            }
        }
    }

    /// Whether `class` derives from the declared base `want` (compared by the last part of
    /// its name): `Some(true)` yes, `Some(false)` provably not, `None` unknown (a base not
    /// defined in this file might).
    fn has_base(&self, class: &Class<'t>, want: &str, depth: u32) -> Option<bool> {
        let want = python::last_part(want.split('[').next().unwrap_or(want).trim());
        // Typing constructs and `object` say nothing a caller can lose.
        if matches!(want, "object" | "Generic" | "Protocol" | "ABC") {
            return Some(true);
        }
        let mut unknown = false;
        for base in &class.bases {
            let name = python::last_part(base);
            if name == want || implies(name, want) {
                return Some(true);
            }
            let local = (!base.contains('.'))
                .then(|| self.module.names.get(base.as_str()))
                .flatten()
                .filter(|b| b.len() == 1)
                .and_then(|b| match b[0].bound {
                    Bound::Def(d) if !d.is_function() => Some(d),
                    _ => None,
                });
            match local {
                Some(d) if depth < 16 => {
                    match self.has_base(&Class::read(self.m, d), want, depth + 1) {
                        Some(true) => return Some(true),
                        Some(false) => {}
                        None => unknown = true,
                    }
                }
                Some(_) => unknown = true,
                None if NEUTRAL_BASES.contains(&name) => {}
                None => unknown = true,
            }
        }
        if !class.opaque.is_empty() {
            unknown = true;
        }
        if unknown { None } else { Some(false) }
    }

    fn find_member(&self, class: &Class<'t>, name: &str, depth: u32) -> Found<'t> {
        if let Some(b) = class.scope.names.get(name) {
            return Found::Bindings(b.clone(), None);
        }
        if let Some((line, ann)) = class.self_attrs.get(name) {
            return Found::SelfAttr(*line, ann.clone());
        }
        if class.slots.contains(name) {
            return Found::Slot;
        }
        for dynamic in ["__getattr__", "__getattribute__"] {
            if class.scope.names.contains_key(dynamic) {
                return Found::Unknown(format!("class `{}` defines `{dynamic}`", class.name));
            }
        }
        if self.dynamic.classes.contains(&class.name) {
            return Found::Unknown(format!(
                "class `{}` is changed with `setattr` or `__dict__`",
                class.name
            ));
        }
        if class.scope.star_import {
            return Found::Unknown("the class body has `from … import *`".to_string());
        }
        if let Some(o) = class.opaque.first() {
            return Found::Unknown(format!("class `{}` has {o}", class.name));
        }
        for base in &class.bases {
            let local = (!base.contains('.'))
                .then(|| self.module.names.get(base.as_str()))
                .flatten()
                .filter(|b| b.len() == 1)
                .and_then(|b| match b[0].bound {
                    Bound::Def(d) if !d.is_function() => Some(d),
                    _ => None,
                });
            match local {
                Some(d) if depth < 16 => {
                    let base_class = Class::read(self.m, d);
                    match self.find_member(&base_class, name, depth + 1) {
                        Found::Missing => {}
                        Found::Bindings(b, None) => {
                            return Found::Bindings(b, Some(Box::new(base_class)));
                        }
                        found => return found,
                    }
                }
                Some(_) => return Found::Unknown("the class hierarchy is too deep".to_string()),
                None if NEUTRAL_BASES.contains(&python::last_part(base)) => {}
                None => {
                    return Found::Unknown(format!(
                        "it may be inherited from `{base}`, which is not defined in this file"
                    ));
                }
            }
        }
        if name == "__init__" && class.is_dataclass() && depth == 0 {
            if class.bases.is_empty() {
                return Found::Synthesized(dataclass_init(self.m, class), class.def.line(self.m));
            }
            return Found::Unknown(format!(
                "`{}` is a dataclass with bases: its generated `__init__` is not checked",
                class.name
            ));
        }
        let generated = class
            .bases
            .iter()
            .any(|b| matches!(python::last_part(b), "NamedTuple" | "TypedDict"));
        if matches!(name, "__init__" | "__new__") && generated {
            return Found::Unknown(format!(
                "`{}` is a NamedTuple/TypedDict, whose constructor is generated",
                class.name
            ));
        }
        Found::Missing
    }
}

/// Methods every class has from `object`.
const OBJECT_DUNDERS: &[&str] = &[
    "__repr__",
    "__str__",
    "__eq__",
    "__ne__",
    "__hash__",
    "__format__",
    "__sizeof__",
    "__reduce__",
    "__reduce_ex__",
    "__dir__",
    "__init_subclass__",
    "__subclasshook__",
    "__getattribute__",
    "__setattr__",
    "__delattr__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__new__",
    "__getstate__",
];

/// Builtin bases known to derive from another: every builtin exception from `Exception`
/// (and `BaseException`), the `Enum` family from `Enum`, `IntFlag` from `Flag`.
fn implies(have: &str, want: &str) -> bool {
    const EXCEPTIONS: &[&str] = &[
        "Exception",
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
        "ZeroDivisionError",
        "OverflowError",
        "UnicodeError",
        "FileExistsError",
        "IsADirectoryError",
        "NotADirectoryError",
        "Warning",
        "UserWarning",
        "DeprecationWarning",
        "RuntimeWarning",
        "AssertionError",
    ];
    match want {
        "BaseException" => {
            EXCEPTIONS.contains(&have) || have == "KeyboardInterrupt" || have == "SystemExit"
        }
        "Exception" => EXCEPTIONS.contains(&have),
        "LookupError" => matches!(have, "KeyError" | "IndexError"),
        "OSError" | "IOError" => matches!(
            have,
            "OSError"
                | "IOError"
                | "PermissionError"
                | "FileNotFoundError"
                | "TimeoutError"
                | "ConnectionError"
                | "FileExistsError"
                | "IsADirectoryError"
                | "NotADirectoryError"
        ),
        "ArithmeticError" => matches!(have, "ZeroDivisionError" | "OverflowError"),
        "RuntimeError" => have == "NotImplementedError",
        "ValueError" => have == "UnicodeError",
        "Enum" => matches!(have, "IntEnum" | "StrEnum" | "Flag" | "IntFlag"),
        "Flag" => have == "IntFlag",
        "int" => matches!(have, "IntEnum" | "IntFlag" | "bool"),
        "str" => have == "StrEnum",
        _ => false,
    }
}

/// The kind a `def` has where it stands.
fn def_kind(decorators: &[python::Decorator], in_class: bool) -> SymbolKind {
    if !in_class {
        return SymbolKind::Function;
    }
    for d in decorators {
        match d.name() {
            "property" | "cached_property" | "abstractproperty" => return SymbolKind::Property,
            "staticmethod" => return SymbolKind::Staticmethod,
            "classmethod" => return SymbolKind::Classmethod,
            _ => {}
        }
    }
    SymbolKind::Method
}

/// The callee's last dotted part of a decorator as written (`functools.lru_cache(1)` →
/// `lru_cache`).
fn decorator_name(text: &str) -> &str {
    let callee = text.split('(').next().unwrap_or(text).trim();
    python::last_part(callee)
}

fn check_decorators(
    path: &str,
    declared: &[String],
    found: &[python::Decorator],
    line: u32,
    o: &mut Outcome,
) {
    for d in declared {
        let want = decorator_name(d);
        if !found.iter().any(|f| f.name() == want) {
            o.violations.push(violation(
                path,
                Constraint::Decorator,
                Some(line),
                format!("declared with `@{d}`, which the definition lacks"),
            ));
        }
    }
}

/// An attribute's type as a caller sees it: `Final[T]`/`ClassVar[T]` → `T`; a bare `Final`
/// or `ClassVar` says nothing about the type.
fn data_type(text: &str) -> Option<String> {
    let t = text.trim();
    let head = t.split('[').next().unwrap_or(t).trim();
    let wrapper = matches!(python::last_part(head), "Final" | "ClassVar");
    if !wrapper {
        return Some(t.to_string());
    }
    let inner = t.strip_prefix(head)?.trim();
    let inner = inner.strip_prefix('[')?.strip_suffix(']')?;
    Some(inner.trim().to_string())
}

/// The body is only `...` or `raise NotImplementedError`, a docstring aside.
fn is_stub_body(m: &Module, def: Definition<'_>) -> bool {
    let Some(body) = def.body() else {
        return false;
    };
    let stmts = python::statements_without_docstring(body);
    stmts.len() == 1
        && (python::is_ellipsis_stmt(stmts[0]) || python::is_raise_not_implemented(m, stmts[0]))
}
