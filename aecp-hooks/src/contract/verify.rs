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
//! * Class members come from the class body, from `self.x = …` in any method (attributes),
//!   `__slots__`, and from bases defined in the same module (looked up recursively). A base
//!   imported from elsewhere might define the member: then a missing member is a note.
//! * Some bindings cannot be judged without running code — an assignment of a callable
//!   (`foo = _impl`), a name bound by an import, `from x import *`, a module or class
//!   `__getattr__`, `setattr`, `globals()`, a parameter list that a `*args`/`**kwargs`
//!   could absorb. Those are `ok` with a note, never a violation.
//!
//! The verdict is `syntax` if the file does not parse, else `mismatch` if any rule is broken,
//! else `stub` if a stub is left (the marker constant, or a contracted body that is only
//! `...` or `raise NotImplementedError`), else `ok`.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use tree_sitter::Node;

use super::{Contract, Param, ParamKind, Symbol, SymbolKind, annotation, stub};
use crate::python::{self, Definition, Module};

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

#[derive(Debug, Clone, Copy)]
enum Bound<'t> {
    Def(Definition<'t>),
    /// An assignment: its annotation and value nodes.
    Assign {
        annotation: Option<Node<'t>>,
        value: Option<Node<'t>>,
    },
    Import,
}

#[derive(Debug, Clone, Copy)]
struct Binding<'t> {
    bound: Bound<'t>,
    line: u32,
}

/// The names one scope (module or class body) binds.
#[derive(Default)]
struct Scope<'t> {
    names: HashMap<String, Vec<Binding<'t>>>,
    /// `@x.setter` definitions by property name.
    setters: HashSet<String>,
    star_import: bool,
}

impl<'t> Scope<'t> {
    fn read(m: &Module, block: Node<'t>) -> Scope<'t> {
        let mut s = Scope::default();
        s.block(m, block, false);
        s
    }

    fn bind(&mut self, name: &str, b: Binding<'t>, conditional: bool) {
        let list = self.names.entry(name.to_string()).or_default();
        if !conditional {
            list.clear();
        }
        list.push(b);
    }

    fn block(&mut self, m: &Module, block: Node<'t>, conditional: bool) {
        for stmt in python::children(block) {
            self.statement(m, stmt, conditional);
        }
    }

    fn statement(&mut self, m: &Module, stmt: Node<'t>, conditional: bool) {
        let line = m.line(stmt);
        match stmt.kind() {
            "function_definition" | "class_definition" | "decorated_definition" => {
                let Some(def) = Definition::of(stmt) else {
                    return;
                };
                let name = def.name(m).to_string();
                let accessor = def.decorators(m).iter().any(|d| {
                    d.path == format!("{name}.setter")
                        || d.path == format!("{name}.getter")
                        || d.path == format!("{name}.deleter")
                });
                if accessor {
                    if def
                        .decorators(m)
                        .iter()
                        .any(|d| d.path == format!("{name}.setter"))
                    {
                        self.setters.insert(name);
                    }
                    return;
                }
                let line = def.line(m);
                self.bind(
                    &name,
                    Binding {
                        bound: Bound::Def(def),
                        line,
                    },
                    conditional,
                );
            }
            "expression_statement" => {
                for e in python::children(stmt) {
                    if e.kind() == "assignment" {
                        self.assignment(m, e, conditional);
                    }
                }
            }
            "import_statement" | "import_from_statement" => {
                for n in stmt.children_by_field_name("name", &mut stmt.walk()) {
                    let name = match n.kind() {
                        "aliased_import" => n.child_by_field_name("alias").map(|a| m.text(a)),
                        _ if stmt.kind() == "import_statement" => m.text(n).split('.').next(),
                        _ => Some(python::last_part(m.text(n))),
                    };
                    if let Some(name) = name {
                        let b = Binding {
                            bound: Bound::Import,
                            line,
                        };
                        self.bind(name.trim(), b, conditional);
                    }
                }
                if python::children(stmt)
                    .iter()
                    .any(|c| c.kind() == "wildcard_import")
                {
                    self.star_import = true;
                }
            }
            "if_statement" => {
                let cond = stmt
                    .child_by_field_name("condition")
                    .map(|c| m.text(c).trim());
                let type_checking = matches!(cond, Some("TYPE_CHECKING" | "typing.TYPE_CHECKING"));
                for (i, part) in python::children(stmt).into_iter().enumerate() {
                    // `if TYPE_CHECKING:` never runs: its body binds nothing at run time.
                    if i == 1 && type_checking && part.kind() == "block" {
                        continue;
                    }
                    self.branch(m, part);
                }
            }
            "try_statement" | "with_statement" | "for_statement" | "while_statement" => {
                for part in python::children(stmt) {
                    self.branch(m, part);
                }
            }
            _ => {}
        }
    }

    /// A block of a compound statement, or a clause holding one: alternatives.
    fn branch(&mut self, m: &Module, part: Node<'t>) {
        match part.kind() {
            "block" => self.block(m, part, true),
            "elif_clause"
            | "else_clause"
            | "except_clause"
            | "except_group_clause"
            | "finally_clause" => {
                for b in python::children(part) {
                    if b.kind() == "block" {
                        self.block(m, b, true);
                    }
                }
            }
            _ => {}
        }
    }

    fn assignment(&mut self, m: &Module, a: Node<'t>, conditional: bool) {
        let line = m.line(a);
        let annotation = a.child_by_field_name("type");
        // `a = b = value`: every target gets the innermost value.
        let mut value = a.child_by_field_name("right");
        let mut targets = vec![a.child_by_field_name("left")];
        while let Some(v) = value.filter(|v| v.kind() == "assignment") {
            targets.push(v.child_by_field_name("left"));
            value = v.child_by_field_name("right");
        }
        for t in targets.into_iter().flatten() {
            let idents: Vec<Node<'t>> = match t.kind() {
                "identifier" => vec![t],
                "pattern_list" | "tuple_pattern" | "list_pattern" => python::children(t)
                    .into_iter()
                    .filter(|n| n.kind() == "identifier")
                    .collect(),
                _ => Vec::new(),
            };
            let single = idents.len() == 1 && t.kind() == "identifier";
            for id in idents {
                let bound = Bound::Assign {
                    annotation: if single { annotation } else { None },
                    value: if single { value } else { None },
                };
                self.bind(m.text(id), Binding { bound, line }, conditional);
            }
        }
    }
}

/// Dynamic attribute definitions found anywhere in the module.
struct Dynamic {
    /// `globals()` or a `setattr` on something that is not `self`/`cls`/a class name.
    module: Option<String>,
    /// Class names with a `setattr(self|cls, …)` inside, or a `setattr(Name, …)` anywhere.
    classes: HashSet<String>,
}

impl Dynamic {
    fn scan(m: &Module) -> Dynamic {
        let mut d = Dynamic {
            module: None,
            classes: HashSet::new(),
        };
        let mut stack = vec![(m.root(), None::<String>)];
        while let Some((n, class)) = stack.pop() {
            if n.kind() == "call" {
                let callee = n.child_by_field_name("function").map_or("", |f| m.text(f));
                let first = n
                    .child_by_field_name("arguments")
                    .and_then(|a| python::children(a).into_iter().next())
                    .map(|a| m.text(a).to_string());
                match (callee, first.as_deref(), &class) {
                    ("globals" | "vars", _, _) => {
                        d.module
                            .get_or_insert_with(|| format!("`{callee}()` on line {}", m.line(n)));
                    }
                    ("setattr", Some("self" | "cls"), Some(c)) => {
                        d.classes.insert(c.clone());
                    }
                    ("setattr", Some(target), _) => {
                        if target.chars().all(|c| c == '_' || c.is_alphanumeric()) {
                            d.classes.insert(target.to_string());
                        }
                        d.module
                            .get_or_insert_with(|| format!("`setattr` on line {}", m.line(n)));
                    }
                    _ => {}
                }
            }
            let class = if n.kind() == "class_definition" {
                n.child_by_field_name("name").map(|c| m.text(c).to_string())
            } else {
                class
            };
            let mut cursor = n.walk();
            for c in n.children(&mut cursor) {
                stack.push((c, class.clone()));
            }
        }
        d
    }
}

/// A class of the implementation, read for member lookups.
struct Class<'t> {
    def: Definition<'t>,
    name: String,
    scope: Scope<'t>,
    /// `self.x = …` in any method: name → (line, annotation).
    self_attrs: HashMap<String, (u32, Option<String>)>,
    slots: HashSet<String>,
    bases: Vec<String>,
    /// A base, metaclass or decorator whose members cannot be known statically.
    opaque: Vec<String>,
    /// Methods here may legitimately be `...` (Protocol, ABC).
    abstract_ok: bool,
    decorators: Vec<python::Decorator>,
}

/// Bases that define no members a contract would declare.
const NEUTRAL_BASES: &[&str] = &[
    "object",
    "ABC",
    "Generic",
    "Protocol",
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
    "NamedTuple",
    "TypedDict",
    "Enum",
    "IntEnum",
    "StrEnum",
    "Flag",
    "IntFlag",
];

impl<'t> Class<'t> {
    fn read(m: &Module, def: Definition<'t>) -> Class<'t> {
        let scope = def.body().map(|b| Scope::read(m, b)).unwrap_or_default();
        let mut bases = Vec::new();
        let mut opaque = Vec::new();
        let mut abstract_ok = false;
        if let Some(args) = def.node.child_by_field_name("superclasses") {
            for a in python::children(args) {
                if a.kind() == "keyword_argument" {
                    let key = a.child_by_field_name("name").map_or("", |k| m.text(k));
                    let val = a.child_by_field_name("value").map_or("", |v| m.text(v));
                    if key == "metaclass" {
                        if python::last_part(val) == "ABCMeta" {
                            abstract_ok = true;
                        } else {
                            opaque.push(format!("metaclass {val}"));
                        }
                    }
                    continue;
                }
                let text = m.text(a);
                let head = text.split('[').next().unwrap_or(text).trim();
                let last = python::last_part(head);
                if matches!(last, "ABC" | "Protocol") {
                    abstract_ok = true;
                }
                bases.push(head.to_string());
            }
        }
        let mut self_attrs = HashMap::new();
        let mut slots = HashSet::new();
        if let Some(body) = def.body() {
            collect_self_attrs(m, body, &mut self_attrs);
            for b in scope.names.get("__slots__").into_iter().flatten() {
                if let Bound::Assign { value: Some(v), .. } = b.bound {
                    collect_strings(m, v, &mut slots);
                }
            }
        }
        Class {
            name: def.name(m).to_string(),
            decorators: def.decorators(m),
            def,
            scope,
            self_attrs,
            slots,
            bases,
            opaque,
            abstract_ok,
        }
    }

    fn is_dataclass(&self) -> bool {
        self.decorators.iter().any(|d| {
            matches!(
                d.name(),
                "dataclass" | "define" | "frozen" | "mutable" | "s" | "attrs"
            )
        })
    }
}

/// `self.x = …` / `self.x: T = …` anywhere in the methods of a class body (not in nested
/// classes), `self` being each method's first parameter.
fn collect_self_attrs(
    m: &Module,
    body: Node<'_>,
    out: &mut HashMap<String, (u32, Option<String>)>,
) {
    let mut defs = Vec::new();
    let mut stack = python::children(body);
    while let Some(n) = stack.pop() {
        match n.kind() {
            "function_definition" => defs.push(n),
            "class_definition" => {}
            _ => stack.extend(python::children(n)),
        }
    }
    for def in defs {
        let Some(me) = Definition::of(def)
            .and_then(|d| d.params(m).into_iter().next())
            .map(|p| p.name)
        else {
            continue;
        };
        let mut stack = def
            .child_by_field_name("body")
            .map(python::children)
            .unwrap_or_default();
        while let Some(n) = stack.pop() {
            if matches!(n.kind(), "assignment" | "augmented_assignment") {
                let ann = n
                    .child_by_field_name("type")
                    .map(|t| python::collapse_ws(m.text(t)));
                let mut targets = vec![n.child_by_field_name("left")];
                let mut value = n.child_by_field_name("right");
                while let Some(v) = value.filter(|v| v.kind() == "assignment") {
                    targets.push(v.child_by_field_name("left"));
                    value = v.child_by_field_name("right");
                }
                for t in targets.into_iter().flatten() {
                    let attrs = if t.kind() == "attribute" {
                        vec![t]
                    } else {
                        python::children(t)
                            .into_iter()
                            .filter(|x| x.kind() == "attribute")
                            .collect()
                    };
                    for a in attrs {
                        let obj = a.child_by_field_name("object").map(|o| m.text(o));
                        let attr = a.child_by_field_name("attribute").map(|o| m.text(o));
                        if let (Some(o), Some(name)) = (obj, attr)
                            && o == me
                        {
                            out.entry(name.to_string())
                                .or_insert((m.line(a), if t == a { ann.clone() } else { None }));
                        }
                    }
                }
            }
            if n.kind() != "class_definition" {
                stack.extend(python::children(n));
            }
        }
    }
}

fn collect_strings(m: &Module, node: Node<'_>, out: &mut HashSet<String>) {
    if node.kind() == "string" {
        for c in python::children(node) {
            if c.kind() == "string_content" {
                out.insert(m.text(c).to_string());
            }
        }
        return;
    }
    for c in python::children(node) {
        collect_strings(m, c, out);
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
                    || (want == SymbolKind::Constant
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
            self.compare_params(path, &sym.params, &params, receiver, line, o);
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
        if sym.is_async != def.is_async() {
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
            self.compare_params(path, &sym.params, &def.params(m), receiver, line, o);
        }
        if let Some(want) = &sym.returns {
            let have = def
                .returns(m)
                .or_else(|| python::type_comment_return(m, def.node));
            match have {
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
                    self.compare_params(&mpath, &member.params, &params, true, line, &mut r);
                    o.violations.extend(r.violations);
                    o.notes.extend(r.notes);
                }
                Found::Unknown(why) => o.notes.push(format!(
                    "{mpath}: not defined in the class body; {why}, so it may exist at run time"
                )),
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
            return Found::Unknown(format!("class `{}` is changed with `setattr`", class.name));
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
        Found::Missing
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

/// The `__init__` a `@dataclass` generates: `self`, then each annotated field of the body in
/// order (not `ClassVar`s, not `field(init=False)`), keyword-only after `_: KW_ONLY` or with
/// `kw_only=True`, with a default when the field has a value (`field()` without `default` or
/// `default_factory` has none).
fn dataclass_init(m: &Module, class: &Class<'_>) -> Vec<Param> {
    let mut params = vec![Param {
        name: "self".to_string(),
        kind: ParamKind::PositionalOrKeyword,
        default: false,
        annotation: None,
    }];
    let mut kw_only = class
        .decorators
        .iter()
        .any(|d| d.text.replace(' ', "").contains("kw_only=True"));
    let Some(body) = class.def.body() else {
        return params;
    };
    for stmt in python::children(body) {
        if stmt.kind() != "expression_statement" {
            continue;
        }
        let Some(a) = python::children(stmt).into_iter().next() else {
            continue;
        };
        if a.kind() != "assignment" {
            continue;
        }
        let (Some(left), Some(ty)) = (a.child_by_field_name("left"), a.child_by_field_name("type"))
        else {
            continue;
        };
        if left.kind() != "identifier" {
            continue;
        }
        let ty = m.text(ty).trim();
        let ty_head = python::last_part(ty.split('[').next().unwrap_or(ty).trim());
        if ty_head == "ClassVar" {
            continue;
        }
        if ty_head == "KW_ONLY" {
            kw_only = true;
            continue;
        }
        let mut default = false;
        if let Some(v) = a.child_by_field_name("right") {
            default = true;
            if v.kind() == "call" {
                let callee = v.child_by_field_name("function").map_or("", |f| m.text(f));
                if python::last_part(callee) == "field" {
                    let args = v
                        .child_by_field_name("arguments")
                        .map_or(String::new(), |x| {
                            m.text(x).chars().filter(|c| !c.is_whitespace()).collect()
                        });
                    if args.contains("init=False") {
                        continue;
                    }
                    default = args.contains("default=") || args.contains("default_factory=");
                }
            }
        }
        params.push(Param {
            name: m.text(left).to_string(),
            kind: if kw_only {
                ParamKind::KeywordOnly
            } else {
                ParamKind::PositionalOrKeyword
            },
            default,
            annotation: Some(ty.to_string()),
        });
    }
    params
}

impl Verifier<'_> {
    /// Parameters: name, order, kind, default presence; an extra parameter is allowed only
    /// with a default; what `*args`/`**kwargs` could absorb is a note.
    fn compare_params(
        &self,
        path: &str,
        declared: &[Param],
        found: &[Param],
        receiver: bool,
        line: u32,
        o: &mut Outcome,
    ) {
        let mut problems: Vec<String> = Vec::new();
        let cpos: Vec<&Param> = declared.iter().filter(|p| p.kind.is_positional()).collect();
        let ipos: Vec<&Param> = found.iter().filter(|p| p.kind.is_positional()).collect();
        let ckw: Vec<&Param> = declared
            .iter()
            .filter(|p| p.kind == ParamKind::KeywordOnly)
            .collect();
        let ikw: Vec<&Param> = found
            .iter()
            .filter(|p| p.kind == ParamKind::KeywordOnly)
            .collect();
        let has = |ps: &[Param], k: ParamKind| ps.iter().any(|p| p.kind == k);
        let (c_args, c_kwargs) = (
            has(declared, ParamKind::VarPositional),
            has(declared, ParamKind::VarKeyword),
        );
        let (i_args, i_kwargs) = (
            has(found, ParamKind::VarPositional),
            has(found, ParamKind::VarKeyword),
        );
        let mut absorbed: Vec<&str> = Vec::new();
        let mut positional_ok = true;
        for (idx, cp) in cpos.iter().enumerate() {
            match ipos.get(idx) {
                Some(ip) => {
                    let is_receiver = receiver && idx == 0;
                    if !is_receiver && ip.name != cp.name {
                        problems.push(format!(
                            "parameter {} is `{}`, declared `{}`",
                            idx + 1,
                            ip.name,
                            cp.name
                        ));
                        positional_ok = false;
                        break;
                    }
                    if ip.kind != cp.kind {
                        problems.push(format!(
                            "`{}` is {}, declared {}",
                            ip.name,
                            ip.kind.as_str(),
                            cp.kind.as_str()
                        ));
                    }
                    if ip.default != cp.default && !is_receiver {
                        problems.push(default_problem(&ip.name, cp.default));
                    }
                }
                None => {
                    if let Some(ik) = ikw.iter().find(|k| k.name == cp.name) {
                        problems.push(format!(
                            "`{}` is keyword_only, declared {}",
                            ik.name,
                            cp.kind.as_str()
                        ));
                    } else if i_args && (cp.kind == ParamKind::PositionalOnly || i_kwargs) {
                        absorbed.push(&cp.name);
                    } else {
                        problems.push(format!("parameter `{}` is missing", cp.name));
                    }
                }
            }
        }
        if positional_ok {
            for ip in ipos.iter().skip(cpos.len()) {
                if let Some(ck) = ckw.iter().find(|k| k.name == ip.name) {
                    problems.push(format!(
                        "`{}` is {}, declared keyword_only",
                        ip.name,
                        ip.kind.as_str()
                    ));
                    if ip.default != ck.default {
                        problems.push(default_problem(&ip.name, ck.default));
                    }
                } else if !ip.default {
                    problems.push(format!(
                        "extra parameter `{}` has no default: callers written for the contract do not pass it",
                        ip.name
                    ));
                }
            }
        }
        if c_args && !i_args {
            problems.push("declared `*args`, which the definition does not accept".to_string());
        }
        if c_kwargs && !i_kwargs {
            problems.push("declared `**kwargs`, which the definition does not accept".to_string());
        }
        for ck in &ckw {
            if let Some(ik) = ikw.iter().find(|k| k.name == ck.name) {
                if ik.default != ck.default {
                    problems.push(default_problem(&ik.name, ck.default));
                }
            } else if ipos.iter().skip(cpos.len()).any(|p| p.name == ck.name) && positional_ok {
                // Reported above as a kind difference.
            } else if i_kwargs {
                absorbed.push(&ck.name);
            } else if positional_ok || !ipos.iter().any(|p| p.name == ck.name) {
                problems.push(format!("keyword-only parameter `{}` is missing", ck.name));
            }
        }
        for ik in &ikw {
            let declared_somewhere =
                ckw.iter().any(|k| k.name == ik.name) || cpos.iter().any(|p| p.name == ik.name);
            if !declared_somewhere && !ik.default {
                problems.push(format!(
                    "extra keyword-only parameter `{}` has no default: callers written for the contract do not pass it",
                    ik.name
                ));
            }
        }
        if !absorbed.is_empty() {
            o.notes.push(format!(
                "{path}: `{}` may be taken by `*args`/`**kwargs` (line {line}); whether they are forwarded cannot be decided statically",
                absorbed.join("`, `")
            ));
        }
        for p in problems {
            o.violations
                .push(violation(path, Constraint::Parameters, Some(line), p));
        }
    }
}

fn default_problem(name: &str, declared_default: bool) -> String {
    if declared_default {
        format!("`{name}` has no default, declared with one")
    } else {
        format!("`{name}` has a default, declared without one")
    }
}
