//! Comparing type annotations as a caller sees them.
//!
//! The verifier compares a contract's return annotation with the implementation's "up to
//! quoting and whitespace", and goes a little further where two spellings provably name the
//! same type, so that it never raises a false alarm over notation:
//!
//! * a string annotation is read as the expression it quotes (`"Account"` = `Account`);
//! * a dotted name compares by its last part (`typing.List` = `List`, `models.User` = `User`:
//!   which import a name came from is not visible without running code);
//! * `typing`'s aliases of builtins are the builtins (`List` = `list`, `Dict` = `dict`, …,
//!   `Text` = `str`);
//! * unions compare as sets: `Optional[X]` = `Union[X, None]` = `X | None` = `None | X`.
//!
//! Anything else compares as text without whitespace. An annotation that does not parse as an
//! expression is compared the same way (never a panic).

use std::collections::BTreeSet;

/// Whether two annotations name the same type (see the module docs).
pub fn same(a: &str, b: &str) -> bool {
    canonical(a) == canonical(b)
}

/// The canonical spelling used by [`same`].
pub fn canonical(text: &str) -> String {
    canonical_depth(text, 0)
}

fn canonical_depth(text: &str, depth: u32) -> String {
    let mut p = Parser {
        s: text.as_bytes(),
        i: 0,
        depth,
    };
    match p.expr() {
        Some(t) if p.at_end() => t.render(),
        _ => text.chars().filter(|c| !c.is_whitespace()).collect(),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Term {
    Name(String),
    Literal(String),
    Sub(Box<Term>, Vec<Term>),
    List(Vec<Term>),
    Tuple(Vec<Term>),
    Union(BTreeSet<String>),
}

impl Term {
    fn render(&self) -> String {
        match self {
            Term::Name(n) | Term::Literal(n) => n.clone(),
            Term::Sub(v, args) => format!("{}[{}]", v.render(), join(args)),
            Term::List(items) => format!("[{}]", join(items)),
            Term::Tuple(items) => format!("({})", join(items)),
            Term::Union(members) => members.iter().cloned().collect::<Vec<_>>().join("|"),
        }
    }

    fn union_members(self) -> BTreeSet<String> {
        match self {
            Term::Union(m) => m,
            other => BTreeSet::from([other.render()]),
        }
    }
}

fn join(items: &[Term]) -> String {
    items.iter().map(Term::render).collect::<Vec<_>>().join(",")
}

fn union(parts: Vec<Term>) -> Term {
    let members: BTreeSet<String> = parts.into_iter().flat_map(Term::union_members).collect();
    if members.len() == 1 {
        Term::Name(members.into_iter().next().unwrap_or_default())
    } else {
        Term::Union(members)
    }
}

fn builtin_alias(name: &str) -> &str {
    match name {
        "List" => "list",
        "Dict" => "dict",
        "Set" => "set",
        "FrozenSet" => "frozenset",
        "Tuple" => "tuple",
        "Type" => "type",
        "Text" => "str",
        "Deque" => "deque",
        "DefaultDict" => "defaultdict",
        "NoneType" => "None",
        other => other,
    }
}

/// A small recursive-descent reader of annotation expressions: names, attribute chains,
/// subscripts, `|`, lists, tuples, strings and other literals.
struct Parser<'s> {
    s: &'s [u8],
    i: usize,
    depth: u32,
}

impl Parser<'_> {
    fn skip_ws(&mut self) {
        while self.i < self.s.len() && (self.s[self.i] as char).is_whitespace() {
            self.i += 1;
        }
    }

    fn at_end(&mut self) -> bool {
        self.skip_ws();
        self.i >= self.s.len()
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.s.get(self.i).copied()
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    /// Nesting (brackets, quoted annotations) is bounded: a pathological annotation falls
    /// back to text comparison instead of exhausting the stack.
    fn expr(&mut self) -> Option<Term> {
        if self.depth > 64 {
            return None;
        }
        self.depth += 1;
        let t = self.union_expr();
        self.depth -= 1;
        t
    }

    fn union_expr(&mut self) -> Option<Term> {
        let mut parts = vec![self.postfix()?];
        while self.eat(b'|') {
            parts.push(self.postfix()?);
        }
        Some(if parts.len() == 1 {
            parts.pop()?
        } else {
            union(parts)
        })
    }

    fn postfix(&mut self) -> Option<Term> {
        let mut t = self.atom()?;
        while self.eat(b'[') {
            let literal = matches!(&t, Term::Name(n) if n == "Literal");
            let args = self.list(b']', literal)?;
            t = match &t {
                Term::Name(n) if n == "Optional" && args.len() == 1 => {
                    union(vec![args[0].clone(), Term::Name("None".into())])
                }
                Term::Name(n) if n == "Union" && !args.is_empty() => union(args),
                _ => Term::Sub(Box::new(t), args),
            };
        }
        Some(t)
    }

    fn list(&mut self, close: u8, literal: bool) -> Option<Vec<Term>> {
        let mut items = Vec::new();
        loop {
            if self.eat(close) {
                return Some(items);
            }
            let item = if literal {
                self.literal_item()?
            } else {
                self.expr()?
            };
            items.push(item);
            if !self.eat(b',') {
                return self.eat(close).then_some(items);
            }
        }
    }

    /// Inside `Literal[...]` strings are values, not forward references.
    fn literal_item(&mut self) -> Option<Term> {
        match self.peek()? {
            b'"' | b'\'' => self.string().map(Term::Literal),
            _ => self.expr(),
        }
    }

    fn atom(&mut self) -> Option<Term> {
        let c = self.peek()?;
        if c == b'"' || c == b'\'' {
            let inner = self.string()?;
            let mut sub = Parser {
                s: inner.as_bytes(),
                i: 0,
                depth: self.depth + 1,
            };
            return Some(match sub.expr() {
                Some(t) if sub.at_end() => t,
                _ => Term::Literal(inner.chars().filter(|c| !c.is_whitespace()).collect()),
            });
        }
        if c == b'[' {
            self.i += 1;
            return self.list(b']', false).map(Term::List);
        }
        if c == b'(' {
            self.i += 1;
            let items = self.list(b')', false)?;
            return Some(if items.len() == 1 {
                items.into_iter().next()?
            } else {
                Term::Tuple(items)
            });
        }
        if c == b'.' && self.s[self.i..].starts_with(b"...") {
            self.i += 3;
            return Some(Term::Literal("...".into()));
        }
        if c == b'_' || c.is_ascii_alphabetic() || c >= 0x80 {
            let mut last = self.ident()?;
            while self.eat(b'.') {
                last = self.ident()?;
            }
            return Some(Term::Name(builtin_alias(&last).to_string()));
        }
        if c.is_ascii_digit() || c == b'-' {
            let start = self.i;
            self.i += 1;
            while self.i < self.s.len()
                && (self.s[self.i].is_ascii_alphanumeric() || matches!(self.s[self.i], b'.' | b'_'))
            {
                self.i += 1;
            }
            return Some(Term::Literal(
                String::from_utf8_lossy(&self.s[start..self.i]).into_owned(),
            ));
        }
        None
    }

    fn ident(&mut self) -> Option<String> {
        self.skip_ws();
        let start = self.i;
        while self.i < self.s.len() {
            let c = self.s[self.i];
            if c == b'_' || c.is_ascii_alphanumeric() || c >= 0x80 {
                self.i += 1;
            } else {
                break;
            }
        }
        (self.i > start).then(|| String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
    }

    /// A plain string literal (no prefix): its content, escapes left as written.
    fn string(&mut self) -> Option<String> {
        self.skip_ws();
        let q = *self.s.get(self.i)?;
        let triple = self.s[self.i..].starts_with(&[q, q, q]);
        let open = if triple { 3 } else { 1 };
        let start = self.i + open;
        let mut j = start;
        while j < self.s.len() {
            if self.s[j] == b'\\' {
                j += 2;
                continue;
            }
            if self.s[j] == q && (!triple || self.s[j..].starts_with(&[q, q, q])) {
                let inner = String::from_utf8_lossy(&self.s[start..j]).into_owned();
                self.i = j + open;
                return Some(inner);
            }
            j += 1;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_spellings() {
        for (a, b) in [
            ("int", " int "),
            ("\"Account\"", "Account"),
            ("'list[Account]'", "List[ 'Account' ]"),
            ("Optional[int]", "int | None"),
            ("Optional[int]", "None | int"),
            ("typing.Optional[int]", "Union[int, None]"),
            ("Union[int, str]", "str | int"),
            ("Optional[Union[int, str]]", "int | str | None"),
            ("dict[str, int]", "Dict[str,int]"),
            ("models.User", "User"),
            (
                "Callable[[int, str], bool]",
                "typing.Callable[[int,str],bool]",
            ),
            ("tuple[int, ...]", "Tuple[int,...]"),
            ("Literal['a', 'b']", "Literal[\"a\", \"b\"]"),
        ] {
            assert!(
                same(a, b),
                "{a} vs {b}: {} / {}",
                canonical(a),
                canonical(b)
            );
        }
    }

    #[test]
    fn different_types() {
        for (a, b) in [
            ("int", "str"),
            ("Optional[int]", "int"),
            ("list[int]", "list[str]"),
            ("dict[str, int]", "dict[int, str]"),
            ("Literal['a']", "Literal['b']"),
            ("int | str", "int | bytes"),
            ("Callable[[int], bool]", "Callable[[str], bool]"),
        ] {
            assert!(!same(a, b), "{a} vs {b}");
        }
    }

    #[test]
    fn garbage_never_panics() {
        for t in [
            "",
            "[",
            "\"",
            "int[",
            "a.",
            "((",
            "'''",
            "1 +",
            "\u{e9}t\u{e9}",
        ] {
            let _ = canonical(t);
        }
    }
}
