//! Declaring a contract as a Python interface in stub syntax (`.pyi`, bodies `...`).
//!
//! What an interface may hold, and what each statement becomes:
//!
//! * `def` / `async def` at module level → `function`; in a class body → `method`, or
//!   `property` (`@property`, `@cached_property`), `classmethod`, `staticmethod`. A later
//!   `@name.setter` marks the property settable. `@overload` signatures declare an
//!   `overloaded` symbol (unless a plain `def` of the same name follows, which is then the
//!   signature). Other decorators are kept: the implementation must carry them.
//! * `class` → `class`, with its bases, decorators and members (nested classes included).
//! * `NAME: T`, `NAME: T = value`, `NAME = value` → `constant` at module level, `attribute`
//!   in a class. `__all__`, `__slots__` and `TypeVar`/`ParamSpec`/`TypeVarTuple` assignments
//!   declare nothing.
//! * imports, docstrings, `...`, `pass` and comments declare nothing; of an `if` (`if
//!   TYPE_CHECKING:`, `if sys.version_info >= …:`) the first branch is read as if
//!   unconditional and `elif`/`else` are ignored.
//!
//! Bodies are `...` (a docstring, `pass` or `raise NotImplementedError` are accepted too).
//! Anything else — a body with behaviour, a loop, a `try`, a name declared twice — is refused with its line and column, so the producer learns at
//! declaration time, not when a consumer is surprised.

use std::collections::HashMap;

use tree_sitter::Node;

use super::{Contract, ContractError, FORMAT_VERSION, Symbol, SymbolKind};
use crate::python::{self, Definition, Module};

/// Parse an interface into a contract for `module` (then validated).
pub fn parse(module: &str, text: &str) -> Result<Contract, ContractError> {
    let m = Module::parse(text);
    if let Some(e) = m.syntax_error() {
        return Err(ContractError::Syntax {
            line: e.line,
            column: e.column,
            what: e.what,
        });
    }
    let symbols = Scope::read(&m, m.root(), false, 0)?;
    let c = Contract {
        version: FORMAT_VERSION,
        module: module.to_string(),
        symbols,
    };
    c.validate()?;
    Ok(c)
}

/// The symbols of one scope (module or class body) as they are read.
struct Scope {
    symbols: Vec<Symbol>,
    /// name → (index in `symbols`, line first declared, only `@overload`s so far)
    index: HashMap<String, (usize, u32, bool)>,
    in_class: bool,
    /// Class nesting.
    depth: u32,
    /// `if` nesting within this scope.
    ifs: u32,
}

fn refuse(m: &Module, node: Node<'_>, reason: impl Into<String>) -> ContractError {
    let (line, column) = m.position(node);
    ContractError::Interface {
        line,
        column,
        reason: reason.into(),
    }
}

impl Scope {
    fn read(
        m: &Module,
        block: Node<'_>,
        in_class: bool,
        depth: u32,
    ) -> Result<Vec<Symbol>, ContractError> {
        // Python refuses more than 100 levels of indentation.
        if depth > 100 {
            return Err(refuse(m, block, "classes nested more than 100 deep"));
        }
        let mut s = Scope {
            symbols: Vec::new(),
            index: HashMap::new(),
            in_class,
            depth,
            ifs: 0,
        };
        s.statements(m, block)?;
        Ok(s.symbols)
    }

    fn statements(&mut self, m: &Module, block: Node<'_>) -> Result<(), ContractError> {
        for stmt in python::children(block) {
            self.statement(m, stmt)?;
        }
        Ok(())
    }

    fn statement(&mut self, m: &Module, stmt: Node<'_>) -> Result<(), ContractError> {
        match stmt.kind() {
            "import_statement"
            | "import_from_statement"
            | "future_import_statement"
            | "pass_statement" => Ok(()),
            "function_definition" | "class_definition" | "decorated_definition" => {
                let def =
                    Definition::of(stmt).ok_or_else(|| refuse(m, stmt, "incomplete definition"))?;
                if def.is_function() {
                    self.function(m, def)
                } else {
                    self.class(m, def)
                }
            }
            "expression_statement" => self.expression(m, stmt),
            "type_alias_statement" => {
                let name = stmt
                    .child_by_field_name("left")
                    .map(|l| m.text(l).trim().to_string())
                    .unwrap_or_default();
                let name = name.split('[').next().unwrap_or("").trim().to_string();
                self.data(m, stmt, name, None)
            }
            // `if TYPE_CHECKING:`, `if sys.version_info >= (3, 11):`: the first branch is
            // read, as if unconditional; `elif`/`else` branches are alternatives an interface
            // does not need (one signature per name).
            "if_statement" => match stmt.child_by_field_name("consequence") {
                Some(_) if self.ifs > 100 => {
                    Err(refuse(m, stmt, "`if` blocks nested more than 100 deep"))
                }
                Some(body) => {
                    self.ifs += 1;
                    let r = self.statements(m, body);
                    self.ifs -= 1;
                    r
                }
                None => Ok(()),
            },
            other => Err(refuse(
                m,
                stmt,
                format!(
                    "an interface declares names (def, class, NAME: TYPE); a `{}` is behaviour",
                    other.trim_end_matches("_statement")
                ),
            )),
        }
    }

    fn expression(&mut self, m: &Module, stmt: Node<'_>) -> Result<(), ContractError> {
        if python::is_docstring(stmt) || python::is_ellipsis_stmt(stmt) {
            return Ok(());
        }
        let Some(assign) = python::children(stmt)
            .into_iter()
            .next()
            .filter(|e| e.kind() == "assignment")
        else {
            return Err(refuse(
                m,
                stmt,
                "an interface declares names (def, class, NAME: TYPE); this expression declares nothing",
            ));
        };
        let annotation = assign
            .child_by_field_name("type")
            .map(|t| python::collapse_ws(m.text(t)));
        let left = assign
            .child_by_field_name("left")
            .ok_or_else(|| refuse(m, stmt, "assignment without a target"))?;
        let names: Vec<Node<'_>> = match left.kind() {
            "identifier" => vec![left],
            "pattern_list" | "tuple_pattern" | "list_pattern" => python::children(left)
                .into_iter()
                .filter(|n| n.kind() == "identifier")
                .collect(),
            _ => {
                return Err(refuse(
                    m,
                    left,
                    format!("`{}`: an interface declares plain names", m.text(left)),
                ));
            }
        };
        if let Some(right) = assign.child_by_field_name("right")
            && right.kind() == "call"
        {
            let callee = right
                .child_by_field_name("function")
                .map_or("", |f| python::last_part(m.text(f)));
            if matches!(callee, "TypeVar" | "ParamSpec" | "TypeVarTuple") {
                return Ok(());
            }
        }
        for n in names {
            let name = m.text(n).to_string();
            // Bookkeeping names, not part of what a caller uses (a dataclass or the
            // interpreter provides the class-level ones).
            let class_dunder = self.in_class
                && matches!(
                    name.as_str(),
                    "__match_args__"
                        | "__hash__"
                        | "__doc__"
                        | "__module__"
                        | "__dict__"
                        | "__annotations__"
                        | "__dataclass_fields__"
                );
            if name == "__all__" || name == "__slots__" || class_dunder {
                continue;
            }
            self.data(m, n, name, annotation.clone())?;
        }
        Ok(())
    }

    fn data(
        &mut self,
        m: &Module,
        at: Node<'_>,
        name: String,
        annotation: Option<String>,
    ) -> Result<(), ContractError> {
        let kind = if self.in_class {
            SymbolKind::Attribute
        } else {
            SymbolKind::Constant
        };
        self.add(
            m,
            at,
            Symbol {
                name,
                kind,
                is_async: false,
                params: Vec::new(),
                returns: None,
                annotation,
                decorators: Vec::new(),
                setter: false,
                overloaded: false,
                bases: Vec::new(),
                members: Vec::new(),
            },
            false,
        )
    }

    fn add(
        &mut self,
        m: &Module,
        at: Node<'_>,
        sym: Symbol,
        overload: bool,
    ) -> Result<(), ContractError> {
        let line = m.line(at);
        match self.index.get(&sym.name).copied() {
            None => {
                self.index
                    .insert(sym.name.clone(), (self.symbols.len(), line, overload));
                self.symbols.push(sym);
            }
            // More `@overload`s of the same name: nothing new to record.
            Some((_, _, true)) if overload => {}
            // The implementation signature after `@overload`s.
            Some((i, first, true)) => {
                self.symbols[i] = sym;
                self.index
                    .insert(self.symbols[i].name.clone(), (i, first, false));
            }
            Some((_, first, false)) => {
                return Err(refuse(
                    m,
                    at,
                    format!("`{}` is declared twice (first on line {first})", sym.name),
                ));
            }
        }
        Ok(())
    }

    fn function(&mut self, m: &Module, def: Definition<'_>) -> Result<(), ContractError> {
        let name = def.name(m).to_string();
        if let Some(body) = def.body() {
            check_body(m, body)?;
        }
        let mut kind = if self.in_class {
            SymbolKind::Method
        } else {
            SymbolKind::Function
        };
        let mut overload = false;
        let mut decorators = Vec::new();
        for d in def.decorators(m) {
            let dname = d.name();
            if d.path == format!("{name}.setter") {
                return self.setter(m, def, &name);
            }
            if d.path == format!("{name}.deleter") || d.path == format!("{name}.getter") {
                return Ok(());
            }
            match dname {
                "property" | "cached_property" | "abstractproperty" => kind = SymbolKind::Property,
                "staticmethod" => kind = SymbolKind::Staticmethod,
                "classmethod" => kind = SymbolKind::Classmethod,
                "overload" => overload = true,
                _ => decorators.push(d.text),
            }
        }
        if !self.in_class && kind != SymbolKind::Function {
            return Err(refuse(
                m,
                def.node,
                format!("`{name}`: @{} only applies inside a class", kind.as_str()),
            ));
        }
        let property = kind == SymbolKind::Property;
        let sym = Symbol {
            name,
            kind,
            is_async: def.is_async(),
            params: if property || overload {
                Vec::new()
            } else {
                def.params(m)
            },
            returns: if overload { None } else { def.returns(m) },
            annotation: None,
            decorators,
            setter: false,
            overloaded: overload,
            bases: Vec::new(),
            members: Vec::new(),
        };
        self.add(m, def.node, sym, overload)
    }

    fn setter(&mut self, m: &Module, def: Definition<'_>, name: &str) -> Result<(), ContractError> {
        match self.index.get(name) {
            Some(&(i, _, _)) if self.symbols[i].kind == SymbolKind::Property => {
                self.symbols[i].setter = true;
                Ok(())
            }
            _ => Err(refuse(
                m,
                def.node,
                format!("`@{name}.setter` before a `@property` named `{name}`"),
            )),
        }
    }

    fn class(&mut self, m: &Module, def: Definition<'_>) -> Result<(), ContractError> {
        let name = def.name(m).to_string();
        let bases = def
            .node
            .child_by_field_name("superclasses")
            .map(|a| {
                python::children(a)
                    .into_iter()
                    .filter(|b| b.kind() != "keyword_argument")
                    .map(|b| python::collapse_ws(m.text(b)))
                    .collect()
            })
            .unwrap_or_default();
        let members = match def.body() {
            Some(body) => Scope::read(m, body, true, self.depth + 1)?,
            None => Vec::new(),
        };
        let sym = Symbol {
            name,
            kind: SymbolKind::Class,
            is_async: false,
            params: Vec::new(),
            returns: None,
            annotation: None,
            decorators: def.decorators(m).into_iter().map(|d| d.text).collect(),
            setter: false,
            overloaded: false,
            bases,
            members,
        };
        self.add(m, def.node, sym, false)
    }
}

/// A `def` body in an interface: `...`, `pass`, a docstring, `raise NotImplementedError`.
fn check_body(m: &Module, body: Node<'_>) -> Result<(), ContractError> {
    for stmt in python::statements_without_docstring(body) {
        let fine = python::is_ellipsis_stmt(stmt)
            || stmt.kind() == "pass_statement"
            || python::is_raise_not_implemented(m, stmt);
        if !fine {
            return Err(refuse(
                m,
                stmt,
                "interface bodies are `...`: an interface declares signatures, not behaviour",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::ParamKind;

    const ACCT: &str = r#"
"""Accounts."""
from __future__ import annotations
from decimal import Decimal
from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    from .ledger import Ledger

MAX_BALANCE: int
DEFAULT_CURRENCY = "EUR"

class InsufficientFunds(Exception): ...

@dataclass(frozen=True)
class Account(Base):
    owner: str
    balance: Decimal = ...
    def deposit(self, amount: Decimal, /, *, note: str | None = None) -> Decimal: ...
    @property
    def closed(self) -> bool: ...
    @closed.setter
    def closed(self, value: bool) -> None: ...
    @classmethod
    def open(cls, owner: str) -> "Account":
        """Open one."""
    @staticmethod
    def fee(amount): ...
    class Meta:
        table: str

async def transfer(src: Account, dst: Account, amount: Decimal, **kw) -> None: ...

@overload
def parse(x: int) -> int: ...
@overload
def parse(x: str) -> str: ...
"#;

    #[test]
    fn reads_every_declaration_form() {
        let c = parse("pkg/acct.py", ACCT).unwrap();
        let names: Vec<_> = c
            .walk()
            .into_iter()
            .map(|(p, s)| format!("{p}:{}", s.kind.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                "MAX_BALANCE:constant",
                "DEFAULT_CURRENCY:constant",
                "InsufficientFunds:class",
                "Account:class",
                "Account.owner:attribute",
                "Account.balance:attribute",
                "Account.deposit:method",
                "Account.closed:property",
                "Account.open:classmethod",
                "Account.fee:staticmethod",
                "Account.Meta:class",
                "Account.Meta.table:attribute",
                "transfer:function",
                "parse:function",
            ]
        );
        let acct = &c.symbols[3];
        assert_eq!(acct.decorators, ["dataclass(frozen=True)"]);
        assert_eq!(acct.bases, ["Base"]);
        let deposit = &acct.members[2];
        let kinds: Vec<_> = deposit.params.iter().map(|p| p.kind).collect();
        assert_eq!(
            kinds,
            [
                ParamKind::PositionalOnly,
                ParamKind::PositionalOnly,
                ParamKind::KeywordOnly
            ]
        );
        assert!(deposit.params[2].default);
        assert_eq!(deposit.returns.as_deref(), Some("Decimal"));
        assert!(acct.members[3].setter);
        assert!(c.symbols[4].is_async);
        assert!(c.symbols[5].overloaded);
    }

    #[test]
    fn an_if_reads_its_first_branch() {
        let text = "import sys\nif sys.version_info >= (3, 11):\n    def f(x: int) -> int: ...\nelse:\n    def f(x): ...\nclass P:\n    __match_args__ = ('x',)\n    x: int\n";
        let c = parse("a.py", text).unwrap();
        assert_eq!(c.symbols.len(), 2);
        assert_eq!(c.symbols[0].returns.as_deref(), Some("int"));
        assert_eq!(c.symbols[1].members.len(), 1, "{:?}", c.symbols[1].members);
    }

    #[test]
    fn behaviour_is_refused_with_a_position() {
        let e = parse("a.py", "def f(x):\n    return x + 1\n").unwrap_err();
        assert!(
            matches!(
                e,
                ContractError::Interface {
                    line: 2,
                    column: 5,
                    ..
                }
            ),
            "{e:?}"
        );
        let e = parse("a.py", "def f(): ...\ndef f(): ...\n").unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        let e = parse("a.py", "for i in x:\n    pass\n").unwrap_err();
        assert!(
            matches!(e, ContractError::Interface { line: 1, .. }),
            "{e:?}"
        );
        let e = parse("a.py", "def f(:\n").unwrap_err();
        assert!(matches!(e, ContractError::Syntax { line: 1, .. }), "{e:?}");
        let e = parse("a.py", "class C:\n    @x.setter\n    def x(self, v): ...\n").unwrap_err();
        assert!(e.to_string().contains("setter"), "{e}");
    }
}
