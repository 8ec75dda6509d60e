//! The verifier's syntax check against CPython: generated modules (every construct of the
//! Python versions the check claims, with random indentation in spaces and tabs), the
//! verifier corpus, and mutations of both (indentation moved, tabs swapped in, tokens
//! deleted or inserted, lines joined or swapped) are each parsed by
//! `aecp_hooks::python::syntax_error` at the local `python3`'s version and by that
//! `python3`'s `ast.parse`, many modules per process. Every disagreement fails the test.
//!
//! `AECP_DIFF_SEED` changes the seed (the default one is fixed, so a failure reproduces);
//! `AECP_DIFF_COUNT` the number of generated modules.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use aecp_hooks::python::{python_version, syntax_error};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Parses a JSON list of sources; prints, per source, `null` or the error's line.
const CHECKER: &str = r#"
import ast, json, sys, warnings
warnings.simplefilter("ignore")
out = []
for src in json.load(sys.stdin):
    try:
        ast.parse(src)
        out.append(None)
    except SyntaxError as e:
        out.append(e.lineno or 0)
    except ValueError:
        out.append(0)
json.dump(out, sys.stdout)
"#;

/// Which Python the reference is, as `3.N`, or why it cannot run.
fn python() -> Result<String, String> {
    let out = Command::new("python3")
        .args(["-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
        .output()
        .map_err(|e| format!("python3 cannot start: {e}"))?;
    if !out.status.success() {
        return Err("python3 -c failed".into());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// CPython's answer for each source: `None` when it parses.
fn cpython(sources: &[String]) -> Vec<Option<u64>> {
    let mut child = Command::new("python3")
        .args(["-c", CHECKER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 starts");
    let input = serde_json::to_vec(sources).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(out.status.success(), "the checker failed");
    let answers: Vec<Option<u64>> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answers.len(), sources.len());
    answers
}

/// A random module built from every construct of Python 3.8 to 3.14.
struct Gen {
    rng: StdRng,
    /// The indentation unit of this module (`"    "`, `"  "`, `"\t"`, …).
    unit: String,
    depth: usize,
    /// The newest Python minor version whose constructs this module may use: most modules
    /// stay within the reference's, the others use anything up to 3.14.
    newest: u32,
    /// The reference Python's minor version.
    reference: u32,
}

const NAMES: &[&str] = &[
    "a", "b", "x", "y", "value", "items", "self", "cls", "_private",
];

impl Gen {
    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.rng.random_range(0..from.len())]
    }

    /// Whether a construct added in Python 3.`minor` may be used.
    fn has(&self, minor: u32) -> bool {
        minor <= self.newest
    }

    fn name(&mut self) -> &'static str {
        self.pick(NAMES)
    }

    fn expr(&mut self, depth: usize) -> String {
        if depth > 2 {
            return self.atom();
        }
        let d = depth + 1;
        match self.rng.random_range(0..22) {
            0 => format!("{} + {}", self.expr(d), self.expr(d)),
            1 => format!("{}({})", self.name(), self.args(d)),
            2 => format!(
                "[{} for {} in {} if {}]",
                self.expr(d),
                self.name(),
                self.expr(d),
                self.expr(d)
            ),
            3 => format!(
                "{{{}: {} for {} in {}}}",
                self.atom(),
                self.expr(d),
                self.name(),
                self.expr(d)
            ),
            4 => format!("lambda {}: {}", self.name(), self.expr(d)),
            5 => format!("({} := {})", self.name(), self.expr(d)),
            6 => format!("{} if {} else {}", self.expr(d), self.expr(d), self.expr(d)),
            7 => format!(
                "f\"{{{}!r:>{}}} and {{{}=}}\"",
                self.name(),
                10,
                self.name()
            ),
            8 if self.has(12) => format!("f\"{{{}[\"k\"]}}\"", self.name()), // nested quotes
            9 => format!(
                "not {} and {} or {}",
                self.expr(d),
                self.expr(d),
                self.expr(d)
            ),
            10 => format!("{}[{}:{}]", self.name(), self.expr(d), self.expr(d)),
            11 => format!("{}.{}", self.name(), self.name()),
            12 => format!("(*{}, {})", self.name(), self.expr(d)),
            13 => format!("{{**{}, 'k': {}}}", self.name(), self.expr(d)),
            14 => format!("await {}", self.expr(d)),
            15 => format!("{} is not {}", self.expr(d), self.expr(d)),
            16 => format!("({} for {} in {})", self.expr(d), self.name(), self.expr(d)),
            17 => format!("{{{}, {}}}", self.expr(d), self.expr(d)),
            18 => format!("{} @ {} ** -{}", self.expr(d), self.expr(d), self.atom()),
            19 if self.has(11) => format!("{}[{}, *{}]", self.name(), self.expr(d), self.name()), // 3.11
            20 if self.has(14) => format!("t\"{{{}}}\"", self.name()), // 3.14
            _ => self.atom(),
        }
    }

    fn atom(&mut self) -> String {
        match self.rng.random_range(0..10) {
            0 => "1_000".into(),
            1 => "0x1F".into(),
            2 => "3.5j".into(),
            3 => "'text'".into(),
            4 => "b'\\x00'".into(),
            5 => "r'\\d+'".into(),
            6 => "None".into(),
            7 => "...".into(),
            8 => "\"\"\"doc\nstring\"\"\"".into(),
            _ => self.name().into(),
        }
    }

    fn args(&mut self, d: usize) -> String {
        match self.rng.random_range(0..5) {
            0 => String::new(),
            1 => self.expr(d),
            2 => format!("{}, key={}", self.expr(d), self.expr(d)),
            3 => format!("*{}, **{}", self.name(), self.name()),
            _ => format!("{} for {} in {}", self.expr(d), self.name(), self.name()),
        }
    }

    fn params(&mut self) -> String {
        self.pick(&[
            "",
            "a, b=1",
            "a, /, b, *, c",
            "self, *args: int, **kwargs: str",
            "a: int = 0, *, b: 'str | None' = None",
            "*args, b",
            "a, b, /",
        ])
        .to_string()
    }

    fn line(&self, text: &str) -> String {
        format!("{}{}\n", self.unit.repeat(self.depth), text)
    }

    fn block(&mut self, header: &str) -> String {
        let mut s = self.line(header);
        self.depth += 1;
        let n = self.rng.random_range(1..4);
        for _ in 0..n {
            s += &self.statement();
        }
        self.depth -= 1;
        s
    }

    fn statement(&mut self) -> String {
        let simple = self.depth >= 3 || self.rng.random_range(0..3) == 0;
        if simple {
            let e = self.expr(0);
            let t = match self.rng.random_range(0..16) {
                0 => format!("{} = {}", self.name(), e),
                1 => format!(
                    "{}: {} = {}",
                    self.name(),
                    self.pick(&["int", "list[str]", "'A'"]),
                    e
                ),
                2 => format!("{} += {}", self.name(), e),
                3 => format!("{}, *{} = {}", self.name(), self.name(), e),
                4 => format!("return {e}"),
                5 => format!("yield from {e}"),
                6 => format!("assert {e}, 'why'"),
                7 => format!("raise ValueError({e}) from None"),
                8 => format!("del {}, {}[0]", self.name(), self.name()),
                9 => self
                    .pick(&["pass", "break", "continue", "global a", "nonlocal b"])
                    .into(),
                10 => self
                    .pick(&[
                        "import os.path as p",
                        "from . import a",
                        "from ..m import (a, b,)",
                        "from __future__ import annotations",
                    ])
                    .into(),
                11 => format!("{}; {}", e, self.expr(0)),
                12 if self.has(12) => format!("type Alias[T] = list[{}]", self.name()),
                13 => format!("{} = (\n{}{},\n)", self.name(), self.unit, e),
                14 => format!("print({e}, sep='') # comment"),
                _ => e,
            };
            return self.line(&t);
        }
        match self.rng.random_range(0..15) {
            0 => {
                let h = format!(
                    "def {}({}) -> {}:",
                    self.name(),
                    self.params(),
                    self.pick(&["int", "None", "'T'"])
                );
                self.block(&h)
            }
            1 => {
                let d = self.pick(&["@property", "@functools.cache", "@x[0].y", "@(lambda f: f)"]);
                let mut s = self.line(d);
                let h = format!("async def {}({}):", self.name(), self.params());
                s += &self.block(&h);
                s
            }
            2 => {
                let h = format!("class {}({}, metaclass=M):", self.name(), self.name());
                self.block(&h)
            }
            3 => {
                let h = format!("if {}:", self.expr(0));
                let mut s = self.block(&h);
                let h = format!("elif {}:", self.expr(0));
                s += &self.block(&h);
                s += &self.block("else:");
                s
            }
            4 => {
                let h = format!("for {}, {} in {}:", self.name(), self.name(), self.expr(0));
                let mut s = self.block(&h);
                s += &self.block("else:");
                s
            }
            5 => {
                let h = format!("while {}:", self.expr(0));
                self.block(&h)
            }
            6 => {
                let mut s = self.block("try:");
                s += &self.block("except (ValueError, KeyError) as e:");
                s += &self.block("except Exception:");
                s += &self.block("else:");
                s += &self.block("finally:");
                s
            }
            7 if self.has(11) => {
                let mut s = self.block("try:");
                s += &self.block("except* OSError as g:");
                s
            }
            8 => {
                let h = format!("with open({}) as f, lock:", self.expr(0));
                self.block(&h)
            }
            9 if self.has(9) => {
                let h = "with (\n    open(a) as f,\n    open(b) as g,\n):".to_string(); // 3.9
                self.block(&h)
            }
            10 if self.has(10) => {
                let h = format!("match {}:", self.expr(0));
                let mut s = self.line(&h);
                self.depth += 1;
                for case in [
                    "case [1, *rest] if rest:",
                    "case {'k': v, **kw}:",
                    "case Point(x=0) | None:",
                    "case _:",
                ] {
                    s += &self.block(case);
                }
                self.depth -= 1;
                s
            }
            11 => {
                let h = format!("async for {} in {}:", self.name(), self.expr(0));
                self.block(&h)
            }
            12 if self.has(12) => {
                let h = format!("def {}[T: int, *Ts, **P]({}):", self.name(), self.params());
                self.block(&h)
            }
            13 if self.has(13) => {
                let h = "class C[T = int]:".to_string();
                self.block(&h)
            }
            _ => {
                let h = format!("async with {} as {}:", self.expr(0), self.name());
                self.block(&h)
            }
        }
    }

    fn module(&mut self) -> String {
        self.unit = self
            .pick(&["    ", "  ", " ", "\t", "        ", "\t "])
            .to_string();
        self.depth = 0;
        self.newest = if self.rng.random_range(0..4) == 0 {
            14
        } else {
            self.reference
        };
        let n = self.rng.random_range(1..6);
        (0..n).map(|_| self.statement()).collect()
    }
}

/// One random edit of the kind that turns a module CPython reads into one it refuses, or
/// the other way round.
fn mutate(rng: &mut StdRng, text: &str) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    if lines.is_empty() {
        return text.to_string();
    }
    let i = rng.random_range(0..lines.len());
    match rng.random_range(0..11) {
        0 => lines[i] = lines[i].trim_start().to_string(),
        1 => lines[i].insert_str(0, ["    ", " ", "\t", "  "][rng.random_range(0..4)]),
        2 => {
            let ws: String = lines[i].chars().take_while(|c| *c == ' ').collect();
            if ws.len() >= 8 {
                lines[i] = format!("\t{}", &lines[i][8..]);
            } else {
                lines[i] = lines[i].replacen(' ', "\t", 1);
            }
        }
        3 => {
            let l = &mut lines[i];
            if !l.is_empty() {
                let mut at = rng.random_range(0..l.len());
                while !l.is_char_boundary(at) {
                    at -= 1;
                }
                l.remove(at);
            }
        }
        4 => {
            let l = &mut lines[i];
            let mut at = rng.random_range(0..=l.len());
            while !l.is_char_boundary(at) {
                at -= 1;
            }
            let tokens = [
                ":", "(", ")", ",", "=", " ", "\t", "\\", "'", "*", "@", "lambda", "1", ".",
            ];
            l.insert_str(at, tokens[rng.random_range(0..tokens.len())]);
        }
        5 => {
            if i + 1 < lines.len() {
                lines.swap(i, i + 1);
            }
        }
        6 => {
            if i + 1 < lines.len() {
                let next = lines.remove(i + 1);
                lines[i] = format!("{} {}", lines[i], next.trim_start());
            }
        }
        7 => lines[i] = lines[i].replace(':', ""),
        8 => lines.insert(
            i,
            [" \t", "  # c", "\\", "\t"][rng.random_range(0..4)].into(),
        ),
        9 => {
            let l = lines[i].clone();
            lines.insert(i, l);
        }
        _ => lines.remove(i).truncate(0),
    }
    let mut out = lines.join("\n");
    if rng.random_range(0..4) != 0 {
        out.push('\n');
    }
    out
}

fn corpus_modules() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut out = Vec::new();
    for dir in std::fs::read_dir(root).unwrap() {
        let dir = dir.unwrap().path();
        for f in ["interface.pyi", "module.py"] {
            if let Ok(t) = std::fs::read_to_string(dir.join(f)) {
                out.push(t);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn the_verifier_and_cpython_agree_on_syntax_errors() {
    let version = match python() {
        Ok(v) => v,
        Err(why) => {
            eprintln!("SKIPPED the_verifier_and_cpython_agree_on_syntax_errors: {why}");
            assert_ne!(
                std::env::var("CI").as_deref(),
                Ok("true"),
                "python3 must be there in CI (.ci/run installs it): {why}"
            );
            return;
        }
    };
    let target = python_version(&version).unwrap_or_else(|| {
        panic!("python3 is {version}, outside what the syntax check knows (3.8 to 3.14)")
    });
    let seed: u64 = std::env::var("AECP_DIFF_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_0033);
    let count: usize = std::env::var("AECP_DIFF_COUNT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let mut generator = Gen {
        rng: StdRng::seed_from_u64(seed),
        unit: String::new(),
        depth: 0,
        newest: 14,
        reference: target.minor.into(),
    };
    let mut sources = corpus_modules();
    assert!(sources.len() > 50, "the verifier corpus is read");
    // The issue's case, word for word.
    sources.push("def area(w: float, h: float) -> float:\nreturn w * h\n".into());
    // CPython's nesting limits, each side of the line.
    for n in [200, 201] {
        sources.push(format!("x = {}1{}\n", "(".repeat(n), ")".repeat(n)));
    }
    for n in [99, 100] {
        let mut s: String = (0..n)
            .map(|i| format!("{}if x:\n", "\t".repeat(i)))
            .collect();
        s += &format!("{}pass\n", "\t".repeat(n));
        sources.push(s);
    }
    for _ in 0..count {
        sources.push(generator.module());
    }
    let mut mrng = StdRng::seed_from_u64(seed ^ 0xfeed);
    let originals = sources.clone();
    for text in &originals {
        for _ in 0..3 {
            let once = mutate(&mut mrng, text);
            sources.push(mutate(&mut mrng, &once));
            sources.push(once);
        }
    }
    let started = std::time::Instant::now();
    let mut answers = Vec::new();
    for batch in sources.chunks(2000) {
        answers.extend(cpython(batch));
    }
    eprintln!("cpython: {:?}", started.elapsed());
    let started = std::time::Instant::now();
    let mut disagreements = Vec::new();
    let (mut refused, mut accepted) = (0, 0);
    for (src, py) in sources.iter().zip(&answers) {
        let ours = syntax_error(src, target);
        match (py, &ours) {
            (None, None) => accepted += 1,
            (Some(_), Some(_)) => refused += 1,
            _ => disagreements.push(format!(
                "python {version}: {}; verifier: {}\n{src}",
                py.map_or("parses".to_string(), |l| format!("syntax error, line {l}")),
                ours.as_ref().map_or("parses".to_string(), |e| format!(
                    "{} at {}:{}",
                    e.what, e.line, e.column
                )),
            )),
        }
    }
    eprintln!("verifier: {:?}", started.elapsed());
    eprintln!(
        "{} modules: {accepted} parse in both, {refused} refused by both, {} disagreements",
        sources.len(),
        disagreements.len()
    );
    assert!(
        disagreements.is_empty(),
        "{} disagreements with CPython; the first ones:\n\n{}",
        disagreements.len(),
        disagreements
            .iter()
            .take(8)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n---\n")
    );
    // Both sides must be exercised, or agreement says nothing.
    assert!(
        accepted > sources.len() / 10,
        "too few valid modules: {accepted}"
    );
    assert!(
        refused > sources.len() / 10,
        "too few invalid modules: {refused}"
    );
}
