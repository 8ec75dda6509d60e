//! tree-sitter-python helpers shared by the interface parser and the verifier: parsing,
//! the first syntax error, and reading a `def` into the contract's parameter model, so that
//! an interface and an implementation are read by the same code.

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

    /// The first syntax error in source order, if any. Beyond tree-sitter's error and
    /// missing nodes, Python 2 `print x` and `exec x` statements count: Python 3 refuses
    /// them.
    pub fn syntax_error(&self) -> Option<SyntaxError> {
        // Depth-first in source order, with an explicit stack: a deeply nested file must
        // not exhaust the thread's stack.
        fn find(root: Node<'_>) -> Option<(Node<'_>, &'static str)> {
            let mut stack = vec![root];
            while let Some(node) = stack.pop() {
                if node.is_missing() {
                    return Some((node, "missing token"));
                }
                if node.is_error() {
                    return Some((node, "unexpected input"));
                }
                if node.kind() == "print_statement" || node.kind() == "exec_statement" {
                    return Some((node, "Python 2 statement"));
                }
                let mut cursor = node.walk();
                let kids: Vec<_> = node.children(&mut cursor).collect();
                stack.extend(kids.into_iter().rev());
            }
            None
        }
        let (node, what) = find(self.root())?;
        let what = if node.is_missing() {
            format!("missing `{}`", node.kind())
        } else if node.is_error() {
            let t = self.text(node);
            let snippet: String = t.chars().take(20).collect();
            format!("unexpected `{}`", snippet.trim())
        } else {
            what.to_string()
        };
        let (line, column) = self.position(node);
        Some(SyntaxError { line, column, what })
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

    #[test]
    fn type_comments() {
        let m = Module::parse("def f(a, b):\n    # type: (int, int) -> int\n    return a\n");
        let def = Definition::of(children(m.root())[0]).unwrap();
        assert_eq!(type_comment_return(&m, def.node).as_deref(), Some("int"));
    }
}
