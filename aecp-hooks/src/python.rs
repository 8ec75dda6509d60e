//! tree-sitter-python helpers shared by the interface parser and the verifier: parsing,
//! the first syntax error, and reading a `def` into the contract's parameter model, so that
//! an interface and an implementation are read by the same code.
//!
//! What is a syntax error is decided by Ruff's parser (`ruff_python_parser`), not by
//! tree-sitter: tree-sitter recovers from input CPython refuses (a function body left
//! unindented parses without an error node), while Ruff's parser follows CPython's
//! tokenizer (indentation, tabs against spaces) and grammar, and knows which constructs each
//! Python version added. tree-sitter stays the reader of definitions, which it does well.
//! `aecp-hooks/tests/syntax_differential.rs` holds the two to CPython's `ast.parse`.

use ruff_python_ast::PythonVersion;
use ruff_python_parser::{Mode, ParseOptions};
use ruff_text_size::TextSize;
use tree_sitter::{Node, Parser, Tree};

use crate::contract::{Param, ParamKind};

/// A parsed Python source.
pub struct Module {
    tree: Tree,
    text: String,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("bytes", &self.text.len())
            .finish()
    }
}

/// Where a syntax error is, 1-based, the column counted in characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntaxError {
    pub line: u32,
    pub column: u32,
    pub what: String,
}

/// The oldest Python whose syntax the check knows.
pub const OLDEST: PythonVersion = PythonVersion::PY38;
/// The newest Python whose syntax the check knows, and the default target: a module is
/// refused when this Python would refuse it.
pub const NEWEST: PythonVersion = PythonVersion::PY314;

/// Parses a `3.N` version string into one the check knows ([`OLDEST`] to [`NEWEST`]).
pub fn python_version(text: &str) -> Option<PythonVersion> {
    let (major, minor) = text.trim().split_once('.')?;
    let v = PythonVersion {
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
    };
    (OLDEST..=NEWEST).contains(&v).then_some(v)
}

/// The first syntax error of `text` as CPython `target` would report it from `ast.parse`
/// (a module that does not parse, or that uses syntax `target` does not have), or `None`.
pub fn syntax_error(text: &str, target: PythonVersion) -> Option<SyntaxError> {
    // CPython's tokenizer limits, checked first: past them Ruff's tree would be deep enough
    // to exhaust the stack when it is dropped.
    if let Some((at, what)) = too_deep(text) {
        let (line, column) = line_column(text, at);
        return Some(SyntaxError { line, column, what });
    }
    let parsed = ruff_python_parser::parse_unchecked(
        text,
        ParseOptions::from(Mode::Module).with_target_version(target),
    );
    let first = parsed
        .errors()
        .iter()
        .map(|e| (e.location.start(), e.error.to_string()))
        .chain(
            parsed
                .unsupported_syntax_errors()
                .iter()
                .map(|e| (e.range.start(), e.to_string())),
        )
        .chain(indentation_error(text, parsed.tokens()))
        .min_by_key(|(at, _)| *at)?;
    let (line, column) = line_column(text, first.0);
    Some(SyntaxError {
        line,
        column,
        what: first.1,
    })
}

/// CPython's tokenizer refuses more than 200 nested brackets (`MAXLEVEL`) and 99 nested
/// indented blocks (`MAXINDENT`, 100: the 100th level is refused). Ruff's lexer does not say where a token is, so the
/// place is found by lexing ever shorter prefixes (only for such a pathological module).
fn too_deep(text: &str) -> Option<(TextSize, String)> {
    let what = nesting_limit(text)?;
    let (mut lo, mut hi) = (0, text.len());
    while lo < hi {
        let mid = (lo..=hi).find(|&i| text.is_char_boundary(i) && i >= (lo + hi) / 2)?;
        if mid == hi {
            break;
        }
        if nesting_limit(&text[..mid]).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let at = text[..hi].char_indices().next_back().map_or(0, |(i, _)| i);
    Some((TextSize::try_from(at).unwrap_or_default(), what.into()))
}

/// Which of CPython's nesting limits `text` goes past, if any.
fn nesting_limit(text: &str) -> Option<&'static str> {
    use ruff_python_ast::token::TokenKind;
    let mut lexer = ruff_python_parser::lexer::lex(text, Mode::Module);
    let (mut brackets, mut indents) = (0u32, 0u32);
    loop {
        match lexer.next_token() {
            TokenKind::EndOfFile => return None,
            TokenKind::Lpar | TokenKind::Lsqb | TokenKind::Lbrace => {
                if brackets >= 200 {
                    return Some("too many nested parentheses");
                }
                brackets += 1;
            }
            TokenKind::Rpar | TokenKind::Rsqb | TokenKind::Rbrace => {
                brackets = brackets.saturating_sub(1);
            }
            TokenKind::Indent => {
                if indents + 1 >= 100 {
                    return Some("too many levels of indentation");
                }
                indents += 1;
            }
            TokenKind::Dedent => indents = indents.saturating_sub(1),
            _ => {}
        }
    }
}

/// CPython's tokenizer check of indentation, which Ruff's lexer makes with a tab size of 2
/// where CPython uses 8: every logical line's indentation is measured twice, a tab counting
/// as the rest of 8 columns and as 1 column, and the two measures must order the lines the
/// same way (else `TabError`); a dedent must return to an enclosing level (else
/// `IndentationError`). Blank and comment lines do not count; a form feed starts over.
fn indentation_error(
    text: &str,
    tokens: &ruff_python_ast::token::Tokens,
) -> Option<(TextSize, String)> {
    use ruff_python_ast::token::TokenKind;
    use ruff_text_size::Ranged;
    let mut stack: Vec<(u32, u32)> = vec![(0, 0)];
    let mut at_line_start = true;
    for token in tokens.iter() {
        match token.kind() {
            TokenKind::Newline => {
                at_line_start = true;
                continue;
            }
            TokenKind::NonLogicalNewline
            | TokenKind::Comment
            | TokenKind::Indent
            | TokenKind::Dedent
            | TokenKind::EndOfFile => continue,
            _ if !at_line_start => continue,
            _ => at_line_start = false,
        }
        let start = usize::from(token.start()).min(text.len());
        let line_start = text[..start].rfind(['\n', '\r']).map_or(0, |i| i + 1);
        let prefix = &text[line_start..start];
        if !prefix.chars().all(|c| matches!(c, ' ' | '\t' | '\x0c')) {
            continue; // a line continued with a backslash: its first line was measured
        }
        let (mut col, mut alt) = (0u32, 0u32);
        for c in prefix.chars() {
            match c {
                ' ' => (col, alt) = (col + 1, alt + 1),
                '\t' => (col, alt) = ((col / 8 + 1) * 8, alt + 1),
                _ => (col, alt) = (0, 0),
            }
        }
        let at = TextSize::try_from(line_start).unwrap_or_default();
        let tab_error = || {
            Some((
                at,
                "inconsistent use of tabs and spaces in indentation".to_string(),
            ))
        };
        let &(top, top_alt) = stack.last()?;
        if col == top {
            if alt != top_alt {
                return tab_error();
            }
        } else if col > top {
            if alt <= top_alt {
                return tab_error();
            }
            stack.push((col, alt));
        } else {
            while stack.len() > 1 && col < stack.last()?.0 {
                stack.pop();
            }
            let &(top, top_alt) = stack.last()?;
            if col != top {
                return Some((
                    at,
                    "unindent does not match any outer indentation level".to_string(),
                ));
            }
            if alt != top_alt {
                return tab_error();
            }
        }
    }
    None
}

/// A byte offset as a 1-based line and character column.
fn line_column(text: &str, at: TextSize) -> (u32, u32) {
    let at = usize::from(at).min(text.len());
    let at = (0..=at)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    let before = &text[..at];
    let line = before.matches('\n').count() + 1;
    let start = before.rfind('\n').map_or(0, |i| i + 1);
    (to_u32(line), to_u32(before[start..].chars().count() + 1))
}

impl Module {
    /// Parse `text` (tree-sitter never fails outright: errors are nodes in the tree).
    pub fn parse(text: &str) -> Module {
        let mut parser = Parser::new();
        // The grammar is compiled in; a version mismatch would fail every test at once.
        parser
            .set_language(&tree_sitter_python::LANGUAGE.into())
            .expect("tree-sitter-python is compatible with the tree-sitter it is built with");
        let tree = parser
            .parse(text, None)
            .expect("parsing without a timeout or cancellation flag returns a tree");
        Module {
            tree,
            text: text.to_string(),
        }
    }

    /// The module node.
    pub fn root(&self) -> Node<'_> {
        self.tree.root_node()
    }

    /// The source text of a node.
    pub fn text(&self, node: Node<'_>) -> &str {
        node.utf8_text(self.text.as_bytes()).unwrap_or("")
    }

    /// The source.
    pub fn source(&self) -> &str {
        &self.text
    }

    /// The first syntax error in source order, if any, for the newest Python syntax the
    /// verifier knows ([`NEWEST`]); see [`syntax_error`].
    pub fn syntax_error(&self) -> Option<SyntaxError> {
        syntax_error(&self.text, NEWEST)
    }

    /// A node's start, 1-based line and character column.
    pub fn position(&self, node: Node<'_>) -> (u32, u32) {
        let p = node.start_position();
        let line_start = node.start_byte() - p.column;
        let col = self
            .text
            .get(line_start..node.start_byte())
            .map_or(p.column, |s| s.chars().count());
        (to_u32(p.row + 1), to_u32(col + 1))
    }

    /// A node's 1-based start line.
    pub fn line(&self, node: Node<'_>) -> u32 {
        to_u32(node.start_position().row + 1)
    }
}

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The named children of a node, comments left out.
pub fn children(node: Node<'_>) -> Vec<Node<'_>> {
    let mut cursor = node.walk();
    node.named_children(&mut cursor)
        .filter(|c| c.kind() != "comment")
        .collect()
}

/// One decorator of a definition.
#[derive(Debug, Clone)]
pub struct Decorator {
    /// The expression as written, whitespace collapsed (`functools.lru_cache(maxsize=None)`).
    pub text: String,
    /// The dotted name called or used (`functools.lru_cache`).
    pub path: String,
}

impl Decorator {
    /// The last part of the dotted name (`lru_cache`): what decorators are compared by.
    pub fn name(&self) -> &str {
        last_part(&self.path)
    }
}

/// The part of a dotted name after the last dot.
pub fn last_part(path: &str) -> &str {
    path.rsplit('.').next().unwrap_or(path)
}

/// A `class_definition` or `function_definition` with its decorators (from an enclosing
/// `decorated_definition`).
#[derive(Debug, Clone, Copy)]
pub struct Definition<'t> {
    /// The `function_definition` or `class_definition`.
    pub node: Node<'t>,
    /// The `decorated_definition`, if any.
    pub decorated: Option<Node<'t>>,
}

impl<'t> Definition<'t> {
    /// For a `function_definition`, `class_definition` or `decorated_definition` node.
    pub fn of(node: Node<'t>) -> Option<Definition<'t>> {
        match node.kind() {
            "function_definition" | "class_definition" => Some(Definition {
                node,
                decorated: None,
            }),
            "decorated_definition" => Some(Definition {
                node: node.child_by_field_name("definition")?,
                decorated: Some(node),
            }),
            _ => None,
        }
    }

    /// Whether it is a `def` (else a `class`).
    pub fn is_function(&self) -> bool {
        self.node.kind() == "function_definition"
    }

    /// Its name.
    pub fn name<'m>(&self, m: &'m Module) -> &'m str {
        self.node
            .child_by_field_name("name")
            .map_or("", |n| m.text(n))
    }

    /// `async def`.
    pub fn is_async(&self) -> bool {
        self.node.child(0).is_some_and(|c| c.kind() == "async")
    }

    /// Its decorators, outermost first.
    pub fn decorators(&self, m: &Module) -> Vec<Decorator> {
        let Some(d) = self.decorated else {
            return Vec::new();
        };
        children(d)
            .into_iter()
            .filter(|c| c.kind() == "decorator")
            .filter_map(|dec| {
                let expr = children(dec).into_iter().next()?;
                let callee = if expr.kind() == "call" {
                    expr.child_by_field_name("function")?
                } else {
                    expr
                };
                Some(Decorator {
                    text: collapse_ws(m.text(expr)),
                    path: m
                        .text(callee)
                        .chars()
                        .filter(|c| !c.is_whitespace())
                        .collect(),
                })
            })
            .collect()
    }

    /// The return annotation as written, whitespace collapsed.
    pub fn returns(&self, m: &Module) -> Option<String> {
        self.node
            .child_by_field_name("return_type")
            .map(|t| collapse_ws(m.text(t)))
    }

    /// The body block.
    pub fn body(&self) -> Option<Node<'t>> {
        self.node.child_by_field_name("body")
    }

    /// Its parameters in the contract's model.
    pub fn params(&self, m: &Module) -> Vec<Param> {
        self.node
            .child_by_field_name("parameters")
            .map_or_else(Vec::new, |p| params_of(m, p))
    }

    /// The line of the `def` or `class` keyword.
    pub fn line(&self, m: &Module) -> u32 {
        m.line(self.node)
    }
}

/// Collapse runs of whitespace (newlines in a wrapped annotation) to one space.
pub fn collapse_ws(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Read a `parameters` or `lambda_parameters` node.
pub fn params_of(m: &Module, node: Node<'_>) -> Vec<Param> {
    let mut out: Vec<Param> = Vec::new();
    let mut keyword_only = false;
    for p in children(node) {
        let (name, kind, default, annotation) = match p.kind() {
            "identifier" => (m.text(p).to_string(), None, false, None),
            "typed_parameter" => {
                let inner = children(p).into_iter().next();
                let ann = p
                    .child_by_field_name("type")
                    .map(|t| collapse_ws(m.text(t)));
                match inner {
                    Some(i) if i.kind() == "list_splat_pattern" => {
                        (splat_name(m, i), Some(ParamKind::VarPositional), false, ann)
                    }
                    Some(i) if i.kind() == "dictionary_splat_pattern" => {
                        (splat_name(m, i), Some(ParamKind::VarKeyword), false, ann)
                    }
                    Some(i) => (m.text(i).to_string(), None, false, ann),
                    None => continue,
                }
            }
            "default_parameter" => {
                let name = p.child_by_field_name("name").map_or("", |n| m.text(n));
                (name.to_string(), None, true, None)
            }
            "typed_default_parameter" => {
                let name = p.child_by_field_name("name").map_or("", |n| m.text(n));
                let ann = p
                    .child_by_field_name("type")
                    .map(|t| collapse_ws(m.text(t)));
                (name.to_string(), None, true, ann)
            }
            "list_splat_pattern" => (
                splat_name(m, p),
                Some(ParamKind::VarPositional),
                false,
                None,
            ),
            "dictionary_splat_pattern" => {
                (splat_name(m, p), Some(ParamKind::VarKeyword), false, None)
            }
            "keyword_separator" => {
                keyword_only = true;
                continue;
            }
            "positional_separator" => {
                for q in &mut out {
                    if q.kind == ParamKind::PositionalOrKeyword {
                        q.kind = ParamKind::PositionalOnly;
                    }
                }
                continue;
            }
            // A Python 2 tuple parameter: keep its text so that it compares as written.
            _ => (m.text(p).to_string(), None, false, None),
        };
        let kind = match kind {
            Some(ParamKind::VarPositional) => {
                keyword_only = true;
                ParamKind::VarPositional
            }
            Some(k) => k,
            None if keyword_only => ParamKind::KeywordOnly,
            None => ParamKind::PositionalOrKeyword,
        };
        out.push(Param {
            name,
            kind,
            default,
            annotation,
        });
    }
    out
}

fn splat_name(m: &Module, node: Node<'_>) -> String {
    children(node)
        .into_iter()
        .next()
        .map_or_else(String::new, |n| m.text(n).to_string())
}

/// The statements of a body, a leading docstring left out.
pub fn statements_without_docstring(block: Node<'_>) -> Vec<Node<'_>> {
    let mut stmts = children(block);
    if stmts.first().is_some_and(|s| is_docstring(*s)) {
        stmts.remove(0);
    }
    stmts
}

/// An expression statement that is only a string.
pub fn is_docstring(stmt: Node<'_>) -> bool {
    stmt.kind() == "expression_statement"
        && children(stmt).len() == 1
        && children(stmt)
            .first()
            .is_some_and(|e| matches!(e.kind(), "string" | "concatenated_string"))
}

/// A statement that is only `...`.
pub fn is_ellipsis_stmt(stmt: Node<'_>) -> bool {
    stmt.kind() == "expression_statement"
        && children(stmt).len() == 1
        && children(stmt)
            .first()
            .is_some_and(|e| e.kind() == "ellipsis")
}

/// `raise NotImplementedError`, `raise NotImplementedError(...)` (any arguments).
pub fn is_raise_not_implemented(m: &Module, stmt: Node<'_>) -> bool {
    if stmt.kind() != "raise_statement" {
        return false;
    }
    let Some(e) = children(stmt).into_iter().next() else {
        return false;
    };
    let callee = if e.kind() == "call" {
        e.child_by_field_name("function")
    } else {
        Some(e)
    };
    callee.is_some_and(|c| last_part(m.text(c).trim()) == "NotImplementedError")
}

/// The return type of a `# type: (...) -> R` comment at the start of a `def`'s body.
pub fn type_comment_return(m: &Module, def: Node<'_>) -> Option<String> {
    let body = def.child_by_field_name("body")?;
    let first_stmt = children(body).into_iter().next();
    let limit = first_stmt.map_or(body.end_byte(), |s| s.start_byte());
    let mut stack = vec![def];
    while let Some(n) = stack.pop() {
        if n.kind() == "comment" && n.start_byte() < limit {
            let t = m.text(n).trim_start_matches('#').trim();
            if let Some(sig) = t.strip_prefix("type:")
                && let Some((_, ret)) = sig.rsplit_once("->")
            {
                return Some(collapse_ws(ret));
            }
        }
        if n.start_byte() < limit {
            let mut cursor = n.walk();
            stack.extend(n.children(&mut cursor));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first_def(src: &str) -> (Module, usize) {
        (Module::parse(src), 0)
    }

    #[test]
    fn params_in_every_kind() {
        let (m, _) =
            first_def("def f(a, b: int, /, c=1, *args: str, d, e: int = 2, **kw) -> 'X': ...\n");
        let def = Definition::of(children(m.root())[0]).unwrap();
        let ps = def.params(&m);
        let got: Vec<_> = ps
            .iter()
            .map(|p| (p.name.as_str(), p.kind, p.default))
            .collect();
        use ParamKind::*;
        assert_eq!(
            got,
            [
                ("a", PositionalOnly, false),
                ("b", PositionalOnly, false),
                ("c", PositionalOrKeyword, true),
                ("args", VarPositional, false),
                ("d", KeywordOnly, false),
                ("e", KeywordOnly, true),
                ("kw", VarKeyword, false),
            ]
        );
        assert_eq!(ps[1].annotation.as_deref(), Some("int"));
        assert_eq!(def.returns(&m).as_deref(), Some("'X'"));
    }

    #[test]
    fn bare_star_and_async_and_decorators() {
        let m = Module::parse(
            "@functools.lru_cache(maxsize=None)\n@staticmethod\nasync def g(*, key): pass\n",
        );
        let def = Definition::of(children(m.root())[0]).unwrap();
        assert!(def.is_async());
        assert_eq!(def.params(&m)[0].kind, ParamKind::KeywordOnly);
        let d = def.decorators(&m);
        assert_eq!(d[0].path, "functools.lru_cache");
        assert_eq!(d[0].name(), "lru_cache");
        assert_eq!(d[1].name(), "staticmethod");
        assert_eq!(def.line(&m), 3);
    }

    #[test]
    fn syntax_errors_have_a_position() {
        let m = Module::parse("def f(a, b:\n    return a\n");
        let e = m.syntax_error().unwrap();
        assert_eq!(e.line, 1, "{e:?}");
        assert!(
            Module::parse("def f():\n    return 1\n")
                .syntax_error()
                .is_none()
        );
        let e = Module::parse("x = 1\nprint 'hi'\n").syntax_error().unwrap();
        assert_eq!(e.line, 2);
    }

    // A function body left unindented passed: tree-sitter recovers from it without an
    // error node, CPython raises IndentationError.
    #[test]
    fn an_unindented_body_is_a_syntax_error() {
        let e = Module::parse("def area(w: float, h: float) -> float:\nreturn w * h\n")
            .syntax_error()
            .unwrap();
        assert_eq!(e.line, 2, "{e:?}");
        let tab = Module::parse("def f():\n        x = 1\n\treturn x\n").syntax_error();
        assert!(
            tab.is_some(),
            "spaces then a tab on one block is a TabError"
        );
        // Ruff's lexer counts a tab as 2 columns and let these pass; CPython counts 8.
        for src in [
            "class L:\n\t   def m(self):\n        pass\n",
            "if 1:\n\tx = 1\n  \ty = 2\n",
        ] {
            let e = Module::parse(src).syntax_error();
            assert!(e.as_ref().is_some_and(|e| e.line >= 2), "{src:?}: {e:?}");
        }
        let fine = "if 1:\n\tx = 1\n\tif 2:\n\t\ty = (\n  3)\n\n  # c\nz = 1\n";
        assert_eq!(Module::parse(fine).syntax_error(), None);
    }

    #[test]
    fn cpythons_nesting_limits() {
        let ok = format!("x = {}1{}\n", "(".repeat(200), ")".repeat(200));
        assert_eq!(Module::parse(&ok).syntax_error(), None);
        let deep = format!("x = {}1{}\n", "(".repeat(201), ")".repeat(201));
        let e = Module::parse(&deep).syntax_error().unwrap();
        assert_eq!((e.line, e.column), (1, 205), "{e:?}");
        let blocks = |n: usize| -> String {
            let mut s: String = (0..n)
                .map(|i| format!("{}if x:\n", " ".repeat(i)))
                .collect();
            s += &format!("{}pass\n", " ".repeat(n));
            s
        };
        assert_eq!(Module::parse(&blocks(99)).syntax_error(), None);
        let e = Module::parse(&blocks(100)).syntax_error().unwrap();
        assert_eq!(e.what, "too many levels of indentation");
    }

    #[test]
    fn newer_syntax_is_refused_for_an_older_target() {
        let src = "type Pair = tuple[int, int]\n";
        assert!(syntax_error(src, NEWEST).is_none());
        let e = syntax_error(src, python_version("3.11").unwrap()).unwrap();
        assert_eq!((e.line, e.column), (1, 1), "{e:?}");
        assert!(python_version("2.7").is_none());
        assert!(python_version("3.x").is_none());
    }

    #[test]
    fn type_comments() {
        let m = Module::parse("def f(a, b):\n    # type: (int, int) -> int\n    return a\n");
        let def = Definition::of(children(m.root())[0]).unwrap();
        assert_eq!(type_comment_return(&m, def.node).as_deref(), Some("int"));
    }
}
