//! Comparing a declared parameter list with a definition's.

use super::{Constraint, Outcome, violation};
use crate::contract::{Param, ParamKind};

/// Parameters: name, order, kind, default presence; an extra parameter is allowed only
/// with a default; what `*args`/`**kwargs` could absorb is a note.
pub(super) fn compare_params(
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

fn default_problem(name: &str, declared_default: bool) -> String {
    if declared_default {
        format!("`{name}` has no default, declared with one")
    } else {
        format!("`{name}` has a default, declared without one")
    }
}
