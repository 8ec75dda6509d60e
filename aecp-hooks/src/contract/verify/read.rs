//! Reading a module for the verifier: which names each scope binds (and how), dynamic
//! attribute definitions, a class's members, and the `__init__` a dataclass generates.

use std::collections::{HashMap, HashSet};

use tree_sitter::Node;

use crate::contract::{Param, ParamKind};
use crate::python::{self, Definition, Module};

#[derive(Debug, Clone, Copy)]
pub(super) enum Bound<'t> {
    Def(Definition<'t>),
    /// An assignment: its annotation and value nodes.
    Assign {
        annotation: Option<Node<'t>>,
        value: Option<Node<'t>>,
    },
    Import,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Binding<'t> {
    pub(super) bound: Bound<'t>,
    pub(super) line: u32,
}

/// The names one scope (module or class body) binds.
#[derive(Default)]
pub(super) struct Scope<'t> {
    pub(super) names: HashMap<String, Vec<Binding<'t>>>,
    /// `@x.setter` definitions by property name.
    pub(super) setters: HashSet<String>,
    pub(super) star_import: bool,
    depth: u32,
}

/// Deepest block nesting read (Python's own limit is 100 levels of indentation).
const MAX_NESTING: u32 = 100;

impl<'t> Scope<'t> {
    pub(super) fn read(m: &Module, block: Node<'t>) -> Scope<'t> {
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
        // Python refuses more than 100 levels of indentation; deeper nesting (which
        // tree-sitter accepts) binds nothing here rather than exhausting the stack.
        if self.depth > MAX_NESTING {
            return;
        }
        self.depth += 1;
        for stmt in python::children(block) {
            self.statement(m, stmt, conditional);
        }
        self.depth -= 1;
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
pub(super) struct Dynamic {
    /// `globals()` or a `setattr` on something that is not `self`/`cls`/a class name.
    pub(super) module: Option<String>,
    /// Class names with a `setattr(self|cls, …)` or a `__dict__` inside, or a
    /// `setattr(Name, …)` anywhere.
    pub(super) classes: HashSet<String>,
}

impl Dynamic {
    pub(super) fn scan(m: &Module) -> Dynamic {
        let mut d = Dynamic {
            module: None,
            classes: HashSet::new(),
        };
        let mut stack = vec![(m.root(), None::<String>)];
        while let Some((n, class)) = stack.pop() {
            // `self.__dict__.update(…)` defines attributes no one can list statically.
            if n.kind() == "attribute"
                && n.child_by_field_name("attribute")
                    .is_some_and(|a| m.text(a) == "__dict__")
                && let Some(c) = &class
            {
                d.classes.insert(c.clone());
            }
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
pub(super) struct Class<'t> {
    pub(super) def: Definition<'t>,
    pub(super) name: String,
    pub(super) scope: Scope<'t>,
    /// `self.x = …` in any method: name → (line, annotation).
    pub(super) self_attrs: HashMap<String, (u32, Option<String>)>,
    pub(super) slots: HashSet<String>,
    pub(super) bases: Vec<String>,
    /// A base, metaclass or decorator whose members cannot be known statically.
    pub(super) opaque: Vec<String>,
    /// Methods here may legitimately be `...` (Protocol, ABC).
    pub(super) abstract_ok: bool,
    pub(super) decorators: Vec<python::Decorator>,
}

/// Bases that define no members a contract would declare.
pub(super) const NEUTRAL_BASES: &[&str] = &[
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
    pub(super) fn read(m: &Module, def: Definition<'t>) -> Class<'t> {
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

    pub(super) fn is_dataclass(&self) -> bool {
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
    let mut stack = vec![node];
    while let Some(n) = stack.pop() {
        if n.kind() == "string" {
            for c in python::children(n) {
                if c.kind() == "string_content" {
                    out.insert(m.text(c).to_string());
                }
            }
        } else {
            stack.extend(python::children(n));
        }
    }
}

/// The `__init__` a `@dataclass` generates: `self`, then each annotated field of the body in
/// order (not `ClassVar`s, not `field(init=False)`), keyword-only after `_: KW_ONLY` or with
/// `kw_only=True`, with a default when the field has a value (`field()` without `default` or
/// `default_factory` has none).
pub(super) fn dataclass_init(m: &Module, class: &Class<'_>) -> Vec<Param> {
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
