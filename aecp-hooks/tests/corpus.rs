//! The verifier corpus: each directory of `tests/corpus/` holds an interface
//! (`interface.pyi`), a module (`module.py`) and what the verifier must say about it
//! (`expect.json`: the verdict, the violations as symbol + constraint [+ line], and whether
//! notes are expected). Every case runs; all failures are listed together.

use std::path::Path;

use aecp_hooks::contract::interface;
use aecp_hooks::contract::verify::{Report, verify};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    about: String,
    verdict: String,
    violations: Vec<Expected>,
    #[serde(default)]
    notes: bool,
}

#[derive(Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord, Clone)]
#[serde(deny_unknown_fields)]
struct Expected {
    symbol: String,
    constraint: String,
    #[serde(default)]
    line: Option<u32>,
}

fn check(dir: &Path) -> Result<(), String> {
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f)).map_err(|e| format!("{}: {e}", dir.join(f).display()))
    };
    let expect: Expect = serde_json::from_str(&read("expect.json")?).map_err(|e| e.to_string())?;
    let contract =
        interface::parse("module.py", &read("interface.pyi")?).map_err(|e| e.to_string())?;
    let report: Report = verify(&contract, &read("module.py")?);
    let json = serde_json::to_value(&report).map_err(|e| e.to_string())?;
    let mut problems = Vec::new();
    if json["verdict"] != expect.verdict.as_str() {
        problems.push(format!(
            "verdict {} (want {})",
            json["verdict"], expect.verdict
        ));
    }
    // Compare as multisets; a line is compared only where the expectation gives one.
    let mut want = expect.violations.clone();
    want.sort();
    let mut got: Vec<Expected> = report
        .violations
        .iter()
        .map(|v| Expected {
            symbol: v.symbol.clone(),
            constraint: serde_json::to_value(v.constraint)
                .ok()
                .and_then(|c| c.as_str().map(str::to_string))
                .unwrap_or_default(),
            line: v.line,
        })
        .collect();
    got.sort();
    let same = want.len() == got.len()
        && want.iter().zip(&got).all(|(w, g)| {
            w.symbol == g.symbol
                && w.constraint == g.constraint
                && (w.line.is_none() || w.line == g.line)
        });
    if !same {
        problems.push(format!("violations {got:?} (want {want:?})"));
    }
    if expect.notes == report.notes.is_empty() {
        problems.push(format!(
            "notes {:?} (want {})",
            report.notes,
            if expect.notes { "some" } else { "none" }
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} ({}): {}\n    report: {}",
            dir.file_name().unwrap_or_default().to_string_lossy(),
            expect.about,
            problems.join("; "),
            serde_json::to_string(&report).unwrap_or_default()
        ))
    }
}

#[test]
fn corpus_verdicts() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 30, "the corpus has {} cases", dirs.len());
    let verdicts = ["ok", "mismatch", "stub", "syntax"];
    for v in verdicts {
        let prefix = if v == "mismatch" { "mm_" } else { v };
        assert!(
            dirs.iter().any(|d| d
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(prefix))),
            "no {v} case"
        );
    }
    let failures: Vec<String> = dirs.iter().filter_map(|d| check(d).err()).collect();
    assert!(
        failures.is_empty(),
        "{} of {} corpus cases failed:\n{}",
        failures.len(),
        dirs.len(),
        failures.join("\n")
    );
}

/// Every corpus text, read once.
fn corpus_texts() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut out = Vec::new();
    for e in std::fs::read_dir(root).unwrap() {
        let d = e.unwrap().path();
        let iface = std::fs::read_to_string(d.join("interface.pyi")).unwrap();
        let module = std::fs::read_to_string(d.join("module.py")).unwrap();
        out.push((iface, module));
    }
    out.sort();
    out
}

fn mutate(text: &str, edits: &[(prop::sample::Index, u8)]) -> String {
    const PALETTE: &[char] = &[
        '(', ')', '[', ']', ':', ',', '*', '=', '\n', ' ', '"', '\'', '#', '\\', '@', '.', '\t',
        '\u{feff}', 'é', '\0',
    ];
    let mut chars: Vec<char> = text.chars().collect();
    for (at, what) in edits {
        let c = PALETTE[usize::from(*what) % PALETTE.len()];
        if chars.is_empty() {
            chars.push(c);
            continue;
        }
        let i = at.index(chars.len());
        match what % 3 {
            0 => chars[i] = c,
            1 => chars.insert(i, c),
            _ => {
                chars.remove(i);
            }
        }
    }
    chars.into_iter().collect()
}

use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Mutated interfaces, modules and contract JSON give errors or verdicts, never a panic;
    /// whatever parses has a stub that the verifier reads.
    #[test]
    fn mutated_input_never_panics(
        case in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let texts = corpus_texts();
        let (iface, module) = &texts[case.index(texts.len())];
        let contract = interface::parse("module.py", iface).unwrap();
        let report = verify(&contract, &mutate(module, &edits));
        prop_assert!(serde_json::to_string(&report).is_ok());
        if let Ok(c) = interface::parse("module.py", &mutate(iface, &edits)) {
            let stub = aecp_hooks::contract::stub::generate(&c);
            let r = verify(&c, &stub);
            prop_assert!(
                r.verdict == aecp_hooks::contract::verify::Verdict::Stub,
                "{:#?}\n{}", r, stub
            );
        }
        let json = mutate(&contract.to_json(), &edits);
        if let Ok(c) = aecp_hooks::contract::Contract::from_json(&json) {
            let _ = verify(&c, module);
        }
    }
}

/// Deeply nested input (which tree-sitter accepts and Python would refuse) gives a verdict or
/// an error, never a stack overflow.
#[test]
fn deep_nesting_does_not_exhaust_the_stack() {
    let contract = interface::parse("m.py", "def f(x: int) -> int: ...\n").unwrap();
    let mut deep_ifs = String::new();
    for i in 0..3000 {
        deep_ifs.push_str(&" ".repeat(i));
        deep_ifs.push_str("if x:\n");
    }
    deep_ifs.push_str(&" ".repeat(3000));
    deep_ifs.push_str("pass\n");
    let deep_expr = format!("y = {}1{}\n", "(".repeat(20_000), ")".repeat(20_000));
    let deep_ann = format!(
        "def f(x: int) -> {}int{}:\n    return x\n",
        "list[".repeat(20_000),
        "]".repeat(20_000)
    );
    for module in [&deep_ifs, &deep_expr, &deep_ann] {
        let run = {
            let contract = contract.clone();
            let module = module.clone();
            // A thread with a small stack makes an unbounded recursion fail here for sure.
            std::thread::Builder::new()
                .stack_size(256 * 1024)
                .spawn(move || verify(&contract, &module).verdict)
                .unwrap()
        };
        let verdict = run.join().expect("no stack overflow");
        let v = serde_json::to_value(verdict).unwrap();
        assert!(v == "mismatch" || v == "ok" || v == "syntax", "{v}");
    }
    let deep_iface = deep_ifs.replace("pass", "def g(): ...");
    let e = std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(move || interface::parse("m.py", &deep_iface).map(|_| ()))
        .unwrap()
        .join()
        .expect("no stack overflow");
    assert!(e.is_err());
}

/// Symptom: `class E(E@xception)` was accepted as an interface, and the stub generated from
/// it (which leaves such a base out) then verified as a mismatch instead of a stub.
#[test]
fn a_base_that_is_not_a_class_name_is_refused() {
    assert!(interface::parse("m.py", "class E(E@xception): ...\n").is_err());
    assert!(interface::parse("m.py", "class E(f()): ...\n").is_err());
    assert!(interface::parse("m.py", "class E(mod.Base, Generic[T]): ...\n").is_ok());
    // The same for decorators: `@f@unctools.lru_cache()` was accepted, then its stub
    // judged a mismatch.
    assert!(interface::parse("m.py", "@f@unctools.lru_cache()\ndef g() -> int: ...\n").is_err());
    assert!(
        interface::parse(
            "m.py",
            "@functools.lru_cache(maxsize=None)\ndef g() -> int: ...\n"
        )
        .is_ok()
    );
}
