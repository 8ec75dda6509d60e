//! AECP on the mount: knowledge and contract artifacts delivered at the point of use.
//!
//! Contract artifacts live in [`contract`]: the model and its JSON form, interfaces in
//! `.pyi` syntax, the stub generator and the static verifier (tree-sitter, never running
//! code). [`python`] holds the tree-sitter-python helpers they share. See `docs/AECP.md`.

pub mod contract;
pub mod python;
